// dW = dVᵀ x on fp32 mode's split kernel (weight_grad_f16x3.h).
#include "weight_grad_f16x3.h"

#include <cuda_fp16.h>

#include "fp32_gemm_f16x3.h"
#include "gemm_f16x3.h"
#include "layout.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

// The workspace, each buffer on a 256-byte boundary: dVᵀ's parts, exponents, marks, tiny
// counts and split scratch; x's column split's parts, exponents, marks, list and scratch; the
// GEMM's workspace.
struct Layout {
  size_t a_parts, a_exps, a_flags, a_tiny, a_stats, b_parts, b_exps, b_flags, b_list, b_stats, gemm, gemm_bytes,
      total;
  Layout(int64_t M, int64_t N, int64_t K, int splits) {
    Cursor c;
    a_parts = c.take(2 * 2 * N * M);
    a_exps = c.take(4 * N);
    a_flags = c.take(4 * N);
    a_tiny = c.take(4 * N);
    a_stats = c.take(split_f16x2_transposed_scratch_bytes(N));
    b_parts = c.take(2 * 2 * K * M);
    b_exps = c.take(4 * K);
    b_flags = c.take(4 * K);
    b_list = c.take(4 * (1 + K));
    b_stats = c.take(split_f16x2_columns_scratch_bytes(K));
    gemm_bytes = sm90::f16x3_workspace_bytes(N, K, M, /*w_mn_major=*/true, splits);
    gemm = c.take(gemm_bytes);
    total = c.end();
  }
};

}  // namespace

size_t weight_grad_f16x3_workspace_bytes(int64_t M, int64_t N, int64_t K, int splits) {
  return Layout(M, N, K, splits).total;
}

void launch_weight_grad_f16x3(const WeightGradF16x3& w, cudaStream_t stream) {
  const Layout L(w.M, w.N, w.K, w.splits);
  char* ws = static_cast<char*>(w.workspace);
  const LaidOut buf{ws};
  Fp32GemmF16x3 g;
  g.M = w.N;
  g.N = w.K;
  g.K = w.M;
  g.x = w.dv;
  g.x_transposed = true;
  split_w_by_columns(g, w.x, {buf.as<__half>(L.b_parts), buf.as<float>(L.b_exps), buf.as<int>(L.b_flags),
                              buf.as<int>(L.b_list), ws + L.b_stats}, stream);
  g.y = w.dw;
  g.scratch.x_parts = buf.as<__half>(L.a_parts);
  g.scratch.x_exps = buf.as<float>(L.a_exps);
  g.scratch.x_flags = buf.as<int>(L.a_flags);
  g.scratch.x_tiny = buf.as<int>(L.a_tiny);
  g.scratch.x_stats = ws + L.a_stats;
  g.gemm_workspace = ws + L.gemm;
  g.gemm_workspace_bytes = L.gemm_bytes;
  g.splits = w.splits;
  launch_fp32_gemm_f16x3(g, stream);
}

}  // namespace gemmfuse::cuda

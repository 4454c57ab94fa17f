// The CUDA executor's backward (backward.h) and its GEMM stage. The backward runs, in stream
// order: the row stage (backward_rows.cu: the operands' gradients and dV), then db = Σ_rows dV,
// and dx = dV W and dW = dVᵀ x in the chain's precision, on the kernels the Selection chose
// (selection.h's BackwardChoice): fp32 dW on the f16x3 kernel where its cost rule takes the
// shape (weight_grad_f16x3.h: dV and x read where they lie), fp32 dx on it too (dV split by rows as x is, W
// split by columns and read MN-major, its parts in the weight scratch), else cuBLAS
// (fp32: SGEMM, no TF32; `tf32`: TF32; 16-bit models: their own type with fp32
// accumulation). The GEMV's backward is a rank-one update instead. Stream-ordered, no host
// sync. The scratch's layout is made once with the plan's Selection (plan_state.h).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>

#include "backward_layout.h"
#include "backward_stages.h"
#include "blas_handles.h"
#include "cuda_check.h"
#include "cuda_executor.h"
#include "fp32_gemm_f16x3.h"
#include "gemm_f16x3.h"
#include "plan_state.h"
#include "row_backward.h"
#include "weight_grad_f16x3.h"

namespace gemmfuse {
namespace cuda {
namespace {

// dx[M, K] = dV W on the f16x3 kernel: dV split by rows as the forward's x (with its second
// level), W [N, K] by columns (its parts into `w_parts`: N K fp16 pairs) and read MN-major.
void dx_on_f16x3(const Plan& plan, const BackwardLayout& L, int splits, char* ws, void* w_parts,
                 const float* dv, const float* w, float* gx, cudaStream_t stream) {
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  const LaidOut buf{ws};
  Fp32GemmF16x3 g;
  g.M = M;
  g.N = K;
  g.K = N;
  g.x = dv;
  split_w_by_columns(g, w, {static_cast<__half*>(w_parts), buf.as<float>(L.wc_exps), buf.as<int>(L.wc_flags),
                            buf.as<int>(L.wc_list), ws + L.wc_stats}, stream);
  g.y = gx;
  g.scratch.x_parts = buf.as<__half>(L.dv_parts);
  g.scratch.x_exps = buf.as<float>(L.dv_exps);
  g.scratch.x_flags = buf.as<int>(L.dv_flags);
  g.scratch.x_tiny = buf.as<int>(L.dv_tiny);
  g.scratch.second.rows = buf.as<int>(L.second_rows);
  g.scratch.second.slot_row = buf.as<int>(L.slot_row);
  g.scratch.second.slot_tiny = buf.as<int>(L.slot_tiny);
  g.scratch.second.exps = buf.as<float>(L.slot_exps);
  g.scratch.second.parts = buf.as<__half>(L.slot_parts);
  g.scratch.second.y = buf.as<float>(L.slot_y);
  g.gemm_workspace = ws + L.dx_ws;
  g.gemm_workspace_bytes = L.dx_ws_bytes;
  g.splits = splits;
  launch_fp32_gemm_f16x3(g, stream);
}

template <typename T>
__global__ void to_16bit_kernel(const float* in, int64_t n, T* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = static_cast<T>(in[i]);
}

// The GEMV's backward: dx[m, k] = s dv[m] colsum(W)[k]; row[k] = s sum_m dv[m] x[m, k];
// dW[n, k] = row[k]; db[n] = s sum(dv).
__global__ void gemv_dx_kernel(const float* dv, const float* colsum, int64_t M, int64_t K,
                               float s, float* dx) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < M * K) dx[i] = s * dv[i / K] * colsum[i % K];
}
__global__ void gemv_row_kernel(const float* dv, const float* x, int64_t M, int64_t K, float s,
                                float* row) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= K) return;
  float t = 0.f;
  for (int64_t m = 0; m < M; ++m) t += dv[m] * x[m * K + k];
  row[k] = s * t;
}
__global__ void broadcast_rows_kernel(const float* row, int64_t N, int64_t K, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < N * K) out[i] = row[i % K];
}

// The GEMV's backward (its dW and dx when asked for, and db), from dV.
void gemv_backward(const BackwardCall& c) {
  const int64_t M = c.plan.M, N = c.plan.N, K = c.plan.K;
  const float s = static_cast<float>(c.bp.gemv_scale);
  const float* dv = c.at(c.L.dv);
  const float* x = static_cast<const float*>(c.a.x);
  const float* w = static_cast<const float*>(c.a.weight);
  float* gx = static_cast<float*>(c.a.grad_x);
  float* gw = static_cast<float*>(c.a.grad_w);
  float* gb = static_cast<float*>(c.a.grad_b);
  float* row = c.at(c.L.gemv_row);
  const cudaStream_t stream = c.stream;
  if (gx) {
    launch_column_sums(w, N, K, row, 1.f, false, stream);  // colsum(W)
    gemv_dx_kernel<<<blocks_of_256(M * K), 256, 0, stream>>>(dv, row, M, K, s, gx);
    GF_LAUNCH_CHECK();
  }
  if (gw) {
    gemv_row_kernel<<<blocks_of_256(K), 256, 0, stream>>>(dv, x, M, K, s, row);
    GF_LAUNCH_CHECK();
    broadcast_rows_kernel<<<blocks_of_256(N * K), 256, 0, stream>>>(row, N, K, gw);
    GF_LAUNCH_CHECK();
  }
  if (gb) {
    launch_column_sums(dv, M, 1, row, s, false, stream);
    broadcast_rows_kernel<<<blocks_of_256(N), 256, 0, stream>>>(row, N, 1, gb);
    GF_LAUNCH_CHECK();
  }
}

// dV as cuBLAS reads it, and its type in `ab`: dV itself in fp32; for a 16-bit model, its
// copy in the model's type (L.dv16), as eager's gradient of Y is.
const void* dv_for_cublas(const BackwardCall& c, cudaDataType_t* ab) {
  const Plan& plan = c.plan;
  const float* dv = c.at(c.L.dv);
  *ab = CUDA_R_32F;
  if (plan.dtype == DType::F32) return dv;
  const int64_t MN = plan.M * plan.N;
  *ab = plan.dtype == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  void* d16 = c.ws + c.L.dv16;
  if (plan.dtype == DType::BF16)
    to_16bit_kernel<<<blocks_of_256(MN), 256, 0, c.stream>>>(dv, MN, static_cast<__nv_bfloat16*>(d16));
  else
    to_16bit_kernel<<<blocks_of_256(MN), 256, 0, c.stream>>>(dv, MN, static_cast<__half*>(d16));
  GF_LAUNCH_CHECK();
  return d16;
}

// The Linear's db, then dW and dx: each asked-for one on the f16x3 kernel where the Selection
// chose it, else on cuBLAS.
void linear_backward(const BackwardCall& c) {
  const Plan& plan = c.plan;
  const BackwardLayout& L = c.L;
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  float* dv = c.at(L.dv);
  float* gx = static_cast<float*>(c.a.grad_x);
  float* gw = static_cast<float*>(c.a.grad_w);
  float* gb = static_cast<float*>(c.a.grad_b);
  if (gb) launch_column_sums(dv, M, N, gb, 1.f, false, c.stream);
  if (!gx && !gw) return;
  if (M == 0) {
    if (gw) GF_CUDA_CHECK(cudaMemsetAsync(gw, 0, 4 * N * K, c.stream));
    return;
  }
  cublasHandle_t h = cublas_handle(c.stream);
  cudaDataType_t ab = CUDA_R_32F;
  const void* dvp = dv_for_cublas(c, &ab);
  if (gw && L.dw_f16x3) {
    WeightGradF16x3 g;
    g.M = M, g.N = N, g.K = K;
    g.dv = dv, g.x = static_cast<const float*>(c.a.x), g.dw = gw;
    g.splits = c.choice.dw_splits;
    g.workspace = c.ws + L.dw_ws;
    launch_weight_grad_f16x3(g, c.stream);
    gw = nullptr;
  }
  if (gx && L.dx_f16x3) {
    if (c.a.weight_scratch == nullptr) throw std::invalid_argument("gemmfuse: no backward weight scratch");
    dx_on_f16x3(plan, L, c.choice.dx_splits, c.ws, c.a.weight_scratch, dv, static_cast<const float*>(c.a.weight),
                gx, c.stream);
    gx = nullptr;
  }
  // Row-major dx[M,K] = dV[M,N] W[N,K] is column-major dxᵀ = Wᵀ dVᵀ: A = W (col-major [K,N],
  // ld K), B = dV (col-major [N,M], ld N). dW[N,K] = dVᵀ x is column-major dWᵀ = xᵀ dV:
  // A = x (col-major [K,M], ld K), B = dV transposed (stored col-major [N,M], ld N).
  const GemmKind blas = c.choice.dx != GemmKind::F16x3 ? c.choice.dx : c.choice.dw;  // what cuBLAS runs
  const cublasComputeType_t compute = blas == GemmKind::Tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const float one = 1.f, zero = 0.f;
  if (gx)
    GF_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, K, M, N, &one, c.a.weight, ab, K, dvp,
                                 ab, N, &zero, gx, CUDA_R_32F, K, compute, CUBLAS_GEMM_DEFAULT));
  if (gw)
    GF_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, K, N, M, &one, c.a.x, ab, K, dvp, ab,
                                 N, &zero, gw, CUDA_R_32F, K, compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace
}  // namespace cuda

std::string CudaExecutor::describe_backward(const Plan& plan, const BackwardPlan& bp) {
  check(plan);
  return cuda::plan_state(plan, &bp)->sel.describe_backward();
}

size_t CudaExecutor::backward_workspace_bytes(const Plan& plan, const BackwardPlan& bp) const {
  return cuda::plan_state(plan, &bp)->backward_workspace.total;
}

size_t CudaExecutor::backward_weight_bytes(const Plan& plan, const BackwardPlan& bp) const {
  return cuda::plan_state(plan, &bp)->sel.backward.dx == cuda::GemmKind::F16x3 ? size_t(4) * plan.N * plan.K
                                                                                : 0;
}

// The row stage, then the GEMM stage (backward_stages.h).
void CudaExecutor::backward(const Plan& plan, const BackwardPlan& bp, const BackwardArgs& a) {
  using namespace cuda;
  const auto st = plan_state(plan, &bp);
  const BackwardCall c{plan, bp, st->sel.backward, st->backward_workspace, a, static_cast<char*>(a.workspace),
                       static_cast<cudaStream_t>(a.stream)};
  if (c.L.total > 0 && c.ws == nullptr) throw std::invalid_argument("gemmfuse: no backward workspace");
  backward_rows(c);
  if (c.choice.dw == GemmKind::Gemv)
    gemv_backward(c);
  else
    linear_backward(c);
}

}  // namespace gemmfuse

// fp32 mode's GEMM on fp16 tensor cores, end to end (fp32_gemm_f16x3.h).
#include "fp32_gemm_f16x3.h"

#include <stdexcept>

#include "cuda_check.h"
#include "gemm_f16x3.h"

namespace gemmfuse::cuda {

void split_w_by_columns(Fp32GemmF16x3& g, const float* w, const ColumnSplitBuffers& b, cudaStream_t stream) {
  GF_CUDA_CHECK(cudaMemsetAsync(b.list, 0, sizeof(int), stream));
  launch_split_f16x2_columns(w, g.K, g.N, b.parts, b.exps, RowMarks{b.flags, b.list}, b.stats, stream);
  g.w = w;
  g.w_parts = b.parts;
  g.w_exps = b.exps;
  g.w_list = b.list;
  g.w_flags = b.flags;
  g.w_transposed = true;
}

void launch_fp32_gemm_f16x3(const Fp32GemmF16x3& g, cudaStream_t stream) {
  const F16x3Scratch& s = g.scratch;
  const bool second_level = s.second.parts != nullptr;
  const RowMarks x_marks{s.x_flags, nullptr, s.x_tiny};
  if (g.x_transposed && (second_level || !g.w_transposed))
    throw std::logic_error("CUDA gemm: x transposed is split without a second level, with W transposed");
  if (g.x_transposed)
    launch_split_f16x2_transposed(g.x, g.K, g.M, s.x_parts, s.x_exps, x_marks, s.x_stats, stream);
  else
    launch_split_f16x2(g.x, g.M, g.K, s.x_parts, s.x_exps, x_marks, stream);
  if (second_level)
    launch_split_second_level(g.x, g.M, g.K, s.x_exps, s.x_flags, s.x_tiny, s.second, stream);
  else
    launch_recompute_crowded_rows(s.x_flags, s.x_tiny, g.M, g.K, stream);
  sm90::F16x3Problem p;
  p.M = g.M;
  p.N = g.N;
  p.K = g.K;
  p.x_parts = s.x_parts;
  p.w_parts = g.w_parts;
  p.x_exps = s.x_exps;
  p.w_exps = g.w_exps;
  p.bias = g.bias;
  p.y = g.y_padded ? g.y_padded : g.y;
  p.ldy = g.y_padded ? g.ldy : 0;
  p.splits = g.splits;
  p.w_mn_major = g.w_transposed;
  if (!sm90::launch_f16x3_gemm(p, g.gemm_workspace, g.gemm_workspace_bytes, stream))
    throw std::logic_error("CUDA gemm: the f16x3 GEMM declined an accepted call");
  if (second_level) {  // the second level: its slots' parts times W's, into second.y (no bias: Y has it)
    sm90::F16x3Problem q = p;
    q.x_parts = s.second.parts;
    q.x_exps = s.second.exps;
    q.bias = nullptr;
    q.y = s.second.y;
    q.rows = s.second.rows;
    if (!sm90::launch_f16x3_gemm(q, g.gemm_workspace, g.gemm_workspace_bytes, stream))
      throw std::logic_error("CUDA gemm: the f16x3 GEMM declined the second level");
  }
  SecondLevel second = second_level ? s.second : SecondLevel{};
  if (g.y_padded) {  // the padded rows into place; the fix-up then works on y
    const size_t row = sizeof(float) * g.N;
    GF_CUDA_CHECK(cudaMemcpy2DAsync(g.y, row, g.y_padded, sizeof(float) * g.ldy, row, g.M,
                                    cudaMemcpyDeviceToDevice, stream));
    second.ldy = g.ldy;
  }
  launch_fixup_exceptional(g.x, g.w, nullptr, g.bias, g.y, g.M, g.N, g.K, s.x_exps, s.x_flags, g.w_list,
                           g.w_flags, second, stream, g.w_transposed, g.x_transposed);
}

}  // namespace gemmfuse::cuda

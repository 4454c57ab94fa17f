// Byte layouts of the CUDA executor's prepared memory (once per weight version) and of its
// per-run workspace. Every region starts on a 256-byte boundary; `kAbsent` marks a region the
// plan does not need. Computed from the plan and its Selection (selection.h), once per plan
// and device (plan_state.h), so prepared_bytes/workspace_bytes/prepare/run always agree.
#pragma once

#include <cstddef>
#include <cstdint>

#include "buffer_layout.h"
#include "gemmfuse/plan.h"
#include "selection.h"

namespace gemmfuse::cuda {

constexpr size_t kAbsent = static_cast<size_t>(-1);
// 16-byte vector loads/stores and TMA need it.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// cuBLASLt workspace (NVIDIA recommends 32 MiB on Hopper). The limit the heuristic sees is
// the Selection's (GemmChoice::lt_heuristic_bytes).
constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;

size_t dtype_size(DType d);

// Where the Gemm / Gemv step sits (nullptr when the plan has none).
const Step* find_step(const Plan& plan, Step::Kind kind);

// K rounded up to a multiple of 8 (16-byte rows of bf16): the width of one segment of a
// `fast` split row (split.h).
inline int64_t split_segment_width(int64_t K) { return (K + 7) / 8 * 8; }

// Prepared memory (see prepare.cu):
//   scale     fp32 [N]        s[n] = gamma / sqrt(running_var + eps)      (fold_batchnorm)
//   bias_f32  fp32 [N]        bias as fp32: folded b' or the dtype bias converted
//                             (fold_batchnorm, or a bf16/fp16 bias)
//   bias_dt   dtype [N]       folded b' in the model dtype (fold, Gemm writes the 16-bit output)
//   w_folded  dtype [N, K]    W' = W * s[n]                              (fold, Gemm, no split)
//   w_split   bf16 [N, 3*Kh]  [W'hi | W'lo | W'hi], Kh = split_segment_width(K)  (GemmChoice::split_parts)
//   w_parts   fp16 [2, N, K]  W' as two scaled fp16 parts (split.h)      (f16x3_parts)
//   w_exps    fp32 [N]        their rows' scale exponents                (f16x3_parts)
//   w_flags   int32 [N]       W' rows' RowMark (split.h)                 (split_parts, f16x3_parts)
//   w_list    int32 [1 + N]   the rows of W' the split marks (split.h)   (split_parts, f16x3_parts)
//   wsum      fp32 [K]        column sums of W' over N (fp64 accumulation, rounded once)
//   bsum      fp32 [1]        sum of the (folded) bias                    (column_sums)
//   colsign   fp32 [K]        +1 / -1 where every W'[:,k] is > 0 / < 0, else NaN: rows with
//                             inf/NaN inputs (executors/common/gemv_nonfinite.h) (column_sums)
struct PreparedLayout {
  size_t scale = kAbsent, bias_f32 = kAbsent, bias_dt = kAbsent, w_folded = kAbsent,
         w_split = kAbsent, w_parts = kAbsent, w_exps = kAbsent, w_flags = kAbsent, w_list = kAbsent, wsum = kAbsent, bsum = kAbsent, colsign = kAbsent;
  int64_t Kh = 0;
  size_t total = 0;
};
PreparedLayout prepared_layout(const Plan& plan, const Selection& sel);

// Workspace of one run:
//   [0, plan.buffers_bytes())   the plan's fp32 buffers (Plan::buffer_offset)
//   x_split     bf16 [M, 3*Kh]  [xlo | xhi | xhi]                         (split_parts)
//   x_parts     fp16 [2, M, K]  x as two scaled fp16 parts                 (f16x3_parts)
//               or fp32 [M, ldy] once the GEMM has read them, the second level's products
//                               (SecondLevel::y; ldy: GemmChoice::ldy, or N): the larger size
//   x_exps      fp32 [M]        their rows' scale exponents                (f16x3_parts)
//   x_flags     int32 [M]       x rows' RowMark (split.h)                  (split_parts, f16x3_parts)
//   x_tiny      int32 [M]       x rows' counts of tiny values               (f16x3_parts)
//   second_*    the second level's slots (split.h SecondLevel): rows int32 [1], slot_row,
//               slot_tiny int32 [M], exps fp32 [M], parts fp16 [2, M, K]   (f16x3_parts)
//   y_padded    fp32 [M, ldy]   the f16x3 GEMM's Y with padded rows, copied into Y after
//                               (GemmChoice::ldy > 0)
//   lt          kLtWorkspaceBytes, or the f16x3 kernel's need at the selected
//               splits if more                                              (Gemm step)
//   colstats    fp64 [R, 2, W]  per-chunk shifted sums (max over ColumnStats steps)
//   row_scratch fp32            rows of row passes too wide for shared memory (max over steps)
// A plan the fused sm90 kernel takes (FusedSoftmaxChoice::used) has a workspace of its own instead:
// the kernel's row partials alone (CudaExecutor::workspace_bytes).
struct WorkspaceLayout {
  size_t x_split = kAbsent, x_parts = kAbsent, x_exps = kAbsent, x_flags = kAbsent, lt = kAbsent, colstats = kAbsent, row_scratch = kAbsent;
  size_t x_tiny = kAbsent, second_rows = kAbsent, second_slot_row = kAbsent, second_slot_tiny = kAbsent,
         second_exps = kAbsent, second_parts = kAbsent, y_padded = kAbsent;
  size_t lt_bytes = 0, colstats_bytes = 0, row_scratch_bytes = 0;
  size_t total = 0;
};
WorkspaceLayout workspace_layout(const Plan& plan, const Selection& sel);

}  // namespace gemmfuse::cuda

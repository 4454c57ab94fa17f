// The backward of a planned chain: what the forward saves, and the steps that turn the
// gradient of the chain's output into the gradients of x, W, b and every operand tensor.
//
//   saved by the forward   V = the value the GEMM (or GEMV) produces, [M, width] fp32, when
//                          stages follow it; each BatchNorm's batch mean, invstd and var
//   RowBackward            per row: the chain's values recomputed from V (cheaper than saving
//                          them: eager saves one tensor per stage), then each stage's
//                          derivative in reverse (executors/common/pointwise.h's
//                          Pointwise<Op>::bwd for the pointwise ops); residual reads v<i>
//                          add their share to v<i>'s gradient. Operand tensors' gradients
//                          are reduced over the rows.
//   ColumnGradStats        where a BatchNorm normalised with batch statistics: the column sums
//                          of its output gradient (and of that times x-hat) over all rows,
//                          which the rows below it need: the row backward is cut there
//   dX = dV W, dW = dVᵀ x, db = Σ_rows dV   (the GEMV's: rank one, from W's column sums)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "gemmfuse/plan.h"

namespace gemmfuse {

// Offsets (in floats) into the forward's `saved` tensor.
struct SavedLayout {
  int64_t v = -1;       // V [M, v_cols], or -1 when no stage follows the GEMM/GEMV
  int64_t v_cols = 0;
  std::map<int, int64_t> batch_stats;  // node index -> [3, width]: mean, invstd, biased var
  int64_t total = 0;
};

struct BackwardPlan {
  int start = 0;               // the chain value the GEMM (0) or the GEMV (1) produces
  bool gemv = false;           // the Linear and nodes[0] (sum or mean) are one GEMV
  double gemv_scale = 1.0;     // 1/N for a mean
  // program[i - start] is node i's instruction (its resolved operands, norms' affine
  // parameters); nodes that read a value v<j> keep it in node.b.
  std::vector<Instr> program;
  std::vector<int> batch_norms;  // nodes normalised with batch statistics, ascending
  SavedLayout saved;
  std::string describe(const Plan& fwd) const;
};

// Throws Unsupported for a plan whose backward gemmfuse does not compute (the chain then
// runs in PyTorch while autograd records).
BackwardPlan make_backward_plan(const Plan& fwd);

}  // namespace gemmfuse

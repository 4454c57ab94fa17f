// The backward's scratch layout (backward_layout.h), placed in the order the fields are
// listed there.
#include "backward_layout.h"

#include <algorithm>

#include "gemm_f16x3.h"
#include "split.h"
#include "weight_grad_f16x3.h"

namespace gemmfuse::cuda {
namespace {

// Each value's scratch rows (vals) from the GEMM's on, and the g rows (two, as wide as the
// widest value).
void place_value_rows(BackwardLayout& L, const Chain& ch, const BackwardPlan& bp) {
  const int n = static_cast<int>(ch.nodes.size());
  L.g_width = ch.row_width(bp.start);
  for (int j = bp.start + 1; j <= n; ++j) {
    L.vals[j] = L.add(4 * L.slots * ch.row_width(j));
    L.g_width = std::max(L.g_width, ch.row_width(j));
  }
  L.g = L.add(4 * 2 * L.slots * L.g_width);
}

// An operand's sink, [slots, cols], once per operand.
void place_sink(BackwardLayout& L, int index, int64_t cols) {
  if (index < 0 || L.sinks.count(index)) return;
  L.sinks[index] = L.add(4 * L.slots * cols);
  L.sink_cols[index] = cols;
}

// Stage i's buffers: the gradient of a value it reads (acc), its operands' sinks, and an eval
// BatchNorm's statistics.
void place_stage(BackwardLayout& L, const Plan& plan, const BackwardPlan& bp, int i) {
  const Chain& ch = plan.chain;
  const Node& nd = ch.nodes[i];
  const Instr& in = bp.program[i - bp.start];
  if (family(nd.op) == OpFamily::Binary && nd.b.kind == Operand::Kind::Value && !L.acc.count(nd.b.index))
    L.acc[nd.b.index] = L.add(4 * plan.M * ch.row_width(nd.b.index));
  if (in.kind == Instr::Kind::Pointwise && in.b.kind == OperandRef::Kind::Col) place_sink(L, in.b.index, in.width_in);
  if (in.kind == Instr::Kind::Pointwise && in.b.kind == OperandRef::Kind::Scalar) place_sink(L, in.b.index, 1);
  const bool eval_bn = in.kind == Instr::Kind::BatchNormApply && !bp.saved.batch_stats.count(i);
  if (in.kind == Instr::Kind::GroupNorm || eval_bn) {
    if (in.weight.kind == OperandRef::Kind::Col) place_sink(L, in.weight.index, in.width_in);
    if (in.bias.kind == OperandRef::Kind::Col) place_sink(L, in.bias.index, in.width_in);
  }
  if (eval_bn) L.eval_stats[i] = L.add(4 * 3 * in.width_in);
}

// The row backward's buffers, then the GEMV's row.
void place_row_backward(BackwardLayout& L, const Plan& plan, const BackwardPlan& bp) {
  const Chain& ch = plan.chain;
  const int n = static_cast<int>(ch.nodes.size());
  place_value_rows(L, ch, bp);
  for (int i = bp.start; i < n; ++i) place_stage(L, plan, bp, i);
  for (int b : bp.batch_norms) {
    const int64_t w = ch.row_width(b);
    L.bn_g[b] = L.add(4 * plan.M * w);
    L.bn_gx[b] = L.add(4 * plan.M * w);
    L.bn_sums[b] = L.add(4 * 2 * w);
  }
  if (bp.gemv) L.gemv_row = L.add(4 * plan.K);
}

// dW = dVᵀ x on the f16x3 kernel: launch_weight_grad_f16x3's workspace (dV and x themselves
// are read where they lie).
void place_dw_f16x3(BackwardLayout& L, const Plan& plan, int splits) {
  L.dw_ws_bytes = weight_grad_f16x3_workspace_bytes(plan.M, plan.N, plan.K, splits);
  L.dw_ws = L.add(L.dw_ws_bytes);
}

// dx = dV W on the f16x3 kernel: dV's parts and marks with its second level, W's column
// split's exponents, marks and scratch, the kernel's workspace.
void place_dx_f16x3(BackwardLayout& L, const Plan& plan, int splits) {
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  L.dv_parts = L.add(std::max(2 * 2 * M * N, 4 * M * K));  // the slots' products (slot_y) after
  L.slot_y = L.dv_parts;                                    // the parts are read
  L.dv_exps = L.add(4 * M);
  L.dv_flags = L.add(4 * M);
  L.dv_tiny = L.add(4 * M);
  L.wc_exps = L.add(4 * K);
  L.wc_flags = L.add(4 * K);
  L.wc_list = L.add(4 * (1 + K));
  L.wc_stats = L.add(split_f16x2_columns_scratch_bytes(K));
  L.second_rows = L.add(4);
  L.slot_row = L.add(4 * M);
  L.slot_tiny = L.add(4 * M);
  L.slot_exps = L.add(4 * M);
  L.slot_parts = L.add(2 * 2 * M * N);
  L.dx_ws_bytes = sm90::f16x3_workspace_bytes(M, K, N, /*w_mn_major=*/true, splits);
  L.dx_ws = L.add(L.dx_ws_bytes);
}

}  // namespace

BackwardLayout backward_layout(const Plan& plan, const BackwardPlan& bp, const BackwardChoice& choice) {
  BackwardLayout L;
  L.slots = choice.slots;
  L.dv = L.add(4 * plan.M * plan.chain.row_width(bp.start));
  if (plan.dtype != DType::F32) L.dv16 = L.add(2 * plan.M * plan.chain.row_width(bp.start));
  const size_t scratch = L.place.end();  // the row backward's, dW's and dx's buffers start here
  place_row_backward(L, plan, bp);
  L.total = L.place.end();
  L.dw_f16x3 = choice.dw == GemmKind::F16x3;
  if (L.dw_f16x3) {
    L.place.at = scratch;
    place_dw_f16x3(L, plan, choice.dw_splits);
    L.total = std::max(L.total, L.place.end());
  }
  L.dx_f16x3 = choice.dx == GemmKind::F16x3;
  if (L.dx_f16x3) {
    L.place.at = scratch;
    place_dx_f16x3(L, plan, choice.dx_splits);
    L.total = std::max(L.total, L.place.end());
  }
  return L;
}

}  // namespace gemmfuse::cuda

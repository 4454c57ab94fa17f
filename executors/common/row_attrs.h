// A row instruction's attributes, lowered once from the planner's Instr for every executor:
// the CUDA forward's DevInstr and the row backward's BwInstr derive from RowAttrs and fill it
// by row_attrs; the CPU executor reads a Pool node's windows by pool_windows. What differs
// between the forms (the forward's operand kinds and buffers, the backward's values and
// gradient sinks) each executor binds itself.
#pragma once

#include <cstdint>

#include "gemmfuse/plan.h"
#include "pointwise.h"
#include "row_ops.h"

namespace gemmfuse {

struct RowAttrs {
  uint8_t op = 0;             // the node's OpCode
  bool first_index = false;   // Reduce: max/min's gradient to the first extreme only
  int32_t win = 0, wout = 0;  // the row's widths before and after
  int32_t groups = 1;         // GroupNorm
  float eps = 0.f;            // the norms'
  PoolWindows pool{};         // Pool
  PointwiseParams pp{};       // unary attributes
};

// A Pool node's windows (PoolOp).
inline PoolWindows pool_windows(const Node& n) {
  return {static_cast<int>(n.kernel), static_cast<int>(n.stride), static_cast<int>(n.padding),
          n.op == OpCode::AvgPool, n.count_include_pad};
}

// Instruction `in`'s attributes, meeting a row of width w_in and leaving one of w_out.
inline RowAttrs row_attrs(const Instr& in, int64_t w_in, int64_t w_out) {
  const Node& nd = in.node;
  RowAttrs a;
  a.op = static_cast<uint8_t>(nd.op);
  a.first_index = nd.first_index;
  a.win = static_cast<int32_t>(w_in);
  a.wout = static_cast<int32_t>(w_out);
  a.groups = static_cast<int32_t>(nd.groups);
  a.eps = static_cast<float>(nd.eps);
  a.pool = pool_windows(nd);
  a.pp = pointwise_params(nd);
  return a;
}

}  // namespace gemmfuse

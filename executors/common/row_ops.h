// The row ops of op_table.h's Reduce and Softmax rows: each declared once, its forward and its
// backward, written over a row team (row_team.h). The CPU executor, the CUDA row interpreter,
// the register kernel and the row backward all run these same functions.
//
// A Reduce op:   static float forward(Team&)                         the row's one value
//                static void backward(Team&, const RowGrad&, bool first_index)
// A Softmax op:  static void forward(Team&, float m)                 the row, in place, given
//                                                                    its max m (the family's
//                                                                    common first step)
//                static void backward(Team&, const RowGrad&)
// RowGrad holds the stage's input x, output y, the output's gradient g and the input's
// gradient gi (written, one entry per column). The op's derivative follows PyTorch's
// (torch/csrc/autograd/FunctionsManual.cpp).
//
// The dispatch below is generated from the table: a row without its RowOp fails to build.
#pragma once

#include <stdexcept>

#include "row_team.h"

namespace gemmfuse {

// Softmax's 1 / sum, applied as a product: an IEEE division per element costs ~8
// instructions (reciprocal, Newton steps, range check) on a pass bound by instruction issue;
// the product is within 1.5 ulp of the quotient.
GF_HD float softmax_scale(double sum) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(static_cast<float>(sum));
#else
  return 1.0f / static_cast<float>(sum);
#endif
}

struct RowGrad {
  const float* x;  // the stage's input row
  const float* y;  // its output (one value for a Reduce)
  const float* g;  // the output's gradient (one value for a Reduce)
  float* gi;       // the input's gradient
};

template <OpCode kOp>
struct RowOp;

// ---- Reduce -------------------------------------------------------------------------------
// sum and mean spread g over the row.
template <>
struct RowOp<OpCode::Sum> {
  template <class Team>
  GF_HD static float forward(Team& row) {
    return static_cast<float>(row.sum([](float v) { return v; }));
  }
  template <class Team>
  GF_HD static void backward(Team& row, const RowGrad& d, bool) {
    const float g0 = d.g[0];
    row.each_col([&](int c) { d.gi[c] = g0; });
  }
};
template <>
struct RowOp<OpCode::Mean> {
  template <class Team>
  GF_HD static float forward(Team& row) {
    return static_cast<float>(row.sum([](float v) { return v; }) / row.width());
  }
  template <class Team>
  GF_HD static void backward(Team& row, const RowGrad& d, bool) {
    const float g = d.g[0] / static_cast<float>(row.width());
    row.each_col([&](int c) { d.gi[c] = g; });
  }
};

// max and min (NaN wins), over Op (MaxF, MinF): g goes to the first extreme (torch.max(x,
// dim)'s values: the first NaN where there is one) or is split among ties (amax, amin).
template <class Op>
struct ExtremeRowOp {
  template <class Team>
  GF_HD static float forward(Team& row) { return row.extremum(Op::identity(), Op()); }
  template <class Team>
  GF_HD static void backward(Team& row, const RowGrad& d, bool first_index) {
    const float g0 = d.g[0], res = d.y[0];
    const float* x = d.x;
    auto hit = [&](int c) { return (gf_isnan(res) && gf_isnan(x[c])) || x[c] == res; };
    if (first_index) {
      const int at = row.first_col(hit);
      row.each_col([&](int c) { d.gi[c] = c == at ? g0 : 0.f; });
      return;
    }
    const float n = static_cast<float>(row.sum_cols([&](int c) { return x[c] == res ? 1.0 : 0.0; }));
    row.each_col([&](int c) { d.gi[c] = (x[c] == res ? g0 : 0.f) / n; });
  }
};
template <>
struct RowOp<OpCode::Max> : ExtremeRowOp<MaxF> {};
template <>
struct RowOp<OpCode::Min> : ExtremeRowOp<MinF> {};

// logsumexp, shifted by the row max (0 where it is +-inf); every exponent added in fp64 (the
// row's one output value). The gradient is g exp(x - result).
template <>
struct RowOp<OpCode::LogSumExp> {
  template <class Team>
  GF_HD static float forward(Team& row) {
    const float sh = lse_shift(row.extremum(-HUGE_VALF, ShiftMaxF()));
    const double s = row.sum([&](float v) { return static_cast<double>(expf(v - sh)); });
    return logf(static_cast<float>(s)) + sh;
  }
  template <class Team>
  GF_HD static void backward(Team& row, const RowGrad& d, bool) {
    const float g0 = d.g[0], res = d.y[0];
    row.each_col([&](int c) { d.gi[c] = g0 * expf(d.x[c] - res); });
  }
};

// ---- Softmax ------------------------------------------------------------------------------
// softmax = exp(x - max) / sum; the gradient y (g - sum(g y)).
template <>
struct RowOp<OpCode::Softmax> {
  template <class Team>
  GF_HD static void forward(Team& row, float m) {
    const float inv = softmax_scale(row.map_sum_positive([&](float v) { return expf(v - m); }));
    row.map([&](float v) { return v * inv; });
  }
  template <class Team>
  GF_HD static void backward(Team& row, const RowGrad& d) {
    const float s = static_cast<float>(row.sum_cols([&](int c) { return double(d.g[c]) * d.y[c]; }));
    row.each_col([&](int c) { d.gi[c] = d.y[c] * (d.g[c] - s); });
  }
};

// log_softmax = x - max - log(sum); the gradient g - exp(y) sum(g).
template <>
struct RowOp<OpCode::LogSoftmax> {
  template <class Team>
  GF_HD static void forward(Team& row, float m) {
    const float ls = logf(static_cast<float>(row.sum_positive([&](float v) { return expf(v - m); })));
    row.map([&](float v) { return (v - m) - ls; });
  }
  template <class Team>
  GF_HD static void backward(Team& row, const RowGrad& d) {
    const float s = static_cast<float>(row.sum_cols([&](int c) { return double(d.g[c]); }));
    row.each_col([&](int c) { d.gi[c] = d.g[c] - expf(d.y[c]) * s; });
  }
};

// softmin = softmax(-x) = exp(min - x) / sum, shifted by the row's min (its own extremum: the
// family's max is not the shift); the gradient y (sum(g y) - g).
template <>
struct RowOp<OpCode::Softmin> {
  template <class Team>
  GF_HD static void forward(Team& row, float) {
    const float mn = row.extremum(MinF::identity(), MinF());
    const float inv = softmax_scale(row.map_sum_positive([&](float v) { return expf(mn - v); }));
    row.map([&](float v) { return v * inv; });
  }
  template <class Team>
  GF_HD static void backward(Team& row, const RowGrad& d) {
    const float s = static_cast<float>(row.sum_cols([&](int c) { return double(d.g[c]) * d.y[c]; }));
    row.each_col([&](int c) { d.gi[c] = d.y[c] * (s - d.g[c]); });
  }
};

// ---- dispatch (from the table) -------------------------------------------------------------
// The planner lowers only the family's ops to its instructions (Planner::instr); any other op
// here is a bug, and stops the kernel or throws.
[[noreturn]] GF_HD void not_this_family() {
#if defined(__CUDA_ARCH__)
  __trap();
  __builtin_unreachable();
#else
  throw std::logic_error("row op dispatch: an op outside its family");
#endif
}

template <class Team>
GF_HD float reduce_forward(OpCode op, Team& row) {
  switch (op) {
#define GF_REDUCE(code, name, fam, scalar) \
  case OpCode::code: return RowOp<OpCode::code>::forward(row);
    GEMMFUSE_REDUCE_OPS(GF_REDUCE)
#undef GF_REDUCE
    default: not_this_family();
  }
}
template <class Team>
GF_HD void reduce_backward(OpCode op, Team& row, const RowGrad& d, bool first_index) {
  switch (op) {
#define GF_REDUCE(code, name, fam, scalar) \
  case OpCode::code: RowOp<OpCode::code>::backward(row, d, first_index); return;
    GEMMFUSE_REDUCE_OPS(GF_REDUCE)
#undef GF_REDUCE
    default: not_this_family();
  }
}
// The row max comes first, out of the switch: one copy of its reduction (in the register
// kernel, one copy per op spills registers).
template <class Team>
GF_HD void softmax_forward(OpCode op, Team& row) {
  const float m = row.extremum(-HUGE_VALF, ShiftMaxF());
  switch (op) {
#define GF_SOFTMAX(code, name, fam, scalar) \
  case OpCode::code: RowOp<OpCode::code>::forward(row, m); return;
    GEMMFUSE_SOFTMAX_OPS(GF_SOFTMAX)
#undef GF_SOFTMAX
    default: not_this_family();
  }
}
template <class Team>
GF_HD void softmax_backward(OpCode op, Team& row, const RowGrad& d) {
  switch (op) {
#define GF_SOFTMAX(code, name, fam, scalar) \
  case OpCode::code: RowOp<OpCode::code>::backward(row, d); return;
    GEMMFUSE_SOFTMAX_OPS(GF_SOFTMAX)
#undef GF_SOFTMAX
    default: not_this_family();
  }
}

}  // namespace gemmfuse

// The row ops of op_table.h: each declared once, its forward and its backward, written over
// a row team (row_team.h). The CPU executor, the CUDA row interpreter, the register kernel and
// the row backward all run these same functions.
//
// A Reduce op:   static float forward(Team&)                         the row's one value
//                static void backward(Team&, const RowGrad&, bool first_index)
// A Softmax op:  static void forward(Team&, float m)                 the row, in place, given
//                                                                    its max m (the family's
//                                                                    common first step)
//                static void backward(Team&, const RowGrad&)
// GroupNormOp:   forward and backward over one group's team (its sums in the team's Acc)
// PoolOp:        a window's value and an input column's gradient, per index
// RowGrad holds the stage's input x, output y, the output's gradient g and the input's
// gradient gi (written, one entry per column). The op's derivative follows PyTorch's
// (torch/csrc/autograd/FunctionsManual.cpp). BatchNorm's formulas are batch_norm_op.h's.
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

// ---- GroupNorm (LayerNorm: one group) -------------------------------------------------------
// A group is a team of its own (row_team.h): the columns [0, gs) of the group, with the
// affine vectors, x, g and gi pointing at its first column. Its sums come in the team's Acc.
struct GroupStats {
  float mean, rstd;
};
struct GroupGrad {
  const float* x;       // the group's input
  const float* g;       // its output's gradient
  const float* weight;  // the affine weight, or nullptr
  float* gi;            // the input's gradient (written)
};

// A per-column vector from column c0 on (a group's share of the row's), or nullptr for none.
GF_HD const float* from_col(const float* v, int c0) { return v ? v + c0 : nullptr; }

GF_HD float inv_sqrt(float q) { return 1.0f / sqrtf(q); }
GF_HD double inv_sqrt(double q) { return 1.0 / sqrt(q); }

struct GroupNormOp {
  // The mean and the biased variance, from the centred values (two passes).
  template <class Group>
  GF_HD static GroupStats stats(Group& grp, double eps) {
    using Acc = typename Group::Acc;
    const Acc inv_n = static_cast<Acc>(1) / static_cast<Acc>(grp.width());
    const Acc mean = grp.sum([](float v) { return static_cast<Acc>(v); }) * inv_n;
    const Acc var = grp.sum([&](float v) {
      const Acc d = static_cast<Acc>(v) - mean;
      return d * d;
    }) * inv_n;
    return {static_cast<float>(mean), static_cast<float>(inv_sqrt(var + static_cast<Acc>(eps)))};
  }
  // y = (x - mean) rstd, times the weight, plus the bias.
  template <class Group>
  GF_HD static void forward(Group& grp, const float* weight, const float* bias, double eps) {
    const GroupStats s = stats(grp, eps);
    grp.map_affine(weight, bias, [=](float v) { return (v - s.mean) * s.rstd; });
  }
  // gi = rstd (g w - mean(g w) - x^ mean(g w x^)), x^ = (x - mean) rstd; sink(c, g x^, g) takes
  // column c's shares of the weight's and the bias's gradients. The team's source is x.
  template <class Group, class Sink>
  GF_HD static void backward(Group& grp, const GroupGrad& d, double eps, Sink sink) {
    using Acc = typename Group::Acc;
    const GroupStats s = stats(grp, eps);
    const Acc n = static_cast<Acc>(grp.width());
    auto xh = [&](int c) { return (d.x[c] - s.mean) * s.rstd; };
    auto gw = [&](int c) { return d.weight ? d.g[c] * d.weight[c] : d.g[c]; };
    const float m1 = static_cast<float>(grp.sum_cols([&](int c) { return static_cast<Acc>(gw(c)); }) / n);
    const float m2 = static_cast<float>(
        grp.sum_cols([&](int c) { return static_cast<Acc>(gw(c)) * static_cast<Acc>(xh(c)); }) / n);
    grp.each_col([&](int c) {
      const float x_hat = xh(c);
      d.gi[c] = s.rstd * (gw(c) - m1 - x_hat * m2);
      sink(c, d.g[c] * x_hat, d.g[c]);
    });
  }
};

// ---- Pool windows (avg_pool1d, max_pool1d: PyTorch's windows, dilation 1) --------------------
// Window o of a row of w values spans [o stride - padding, + kernel), clipped to the row; its
// output width (ceil_mode's among it) is the planner's. Every executor computes the windows
// and their gradients by these functions, a member of the team per output (or input) column.
struct PoolWindows {
  int kernel, stride, padding;
  bool avg;          // avg_pool (else max_pool)
  bool include_pad;  // the average's divisor counts the padding (count_include_pad)
};

struct PoolOp {
  struct Span {
    int st, en;     // the window's columns in the row
    float divisor;  // the average's
  };
  GF_HD static Span span(const PoolWindows& p, int o, int w) {
    const int st = o * p.stride - p.padding;
    const int en = st + p.kernel < w + p.padding ? st + p.kernel : w + p.padding;
    const int s0 = st > 0 ? st : 0, e0 = en < w ? en : w;
    return {s0, e0, static_cast<float>(p.include_pad ? en - st : e0 - s0)};
  }
  // The column max pooling takes in [st, en): the first largest, or the first NaN (NaN wins,
  // as in PyTorch); -1 where no value exceeds -inf (a window of padding).
  GF_HD static int max_at(const float* x, int st, int en) {
    int at = -1;
    float m = -HUGE_VALF;
    for (int c = st; c < en; ++c)
      if (x[c] > m || gf_isnan(x[c])) {
        m = x[c];
        at = c;
        if (gf_isnan(m)) break;
      }
    return at;
  }
  // Window o's value: the average (its sum in fp64) or the maximum (-inf for padding only).
  GF_HD static float forward(const PoolWindows& p, const float* x, int w, int o) {
    const Span sp = span(p, o, w);
    if (p.avg) {
      double acc = 0.0;
      for (int c = sp.st; c < sp.en; ++c) acc += x[c];
      return static_cast<float>(acc / sp.divisor);
    }
    const int at = max_at(x, sp.st, sp.en);
    return at >= 0 ? x[at] : -HUGE_VALF;
  }
  // Input column c's gradient: over the windows o that hold c, g[o] / divisor (average) or
  // g[o] where c is o's maximum.
  GF_HD static float backward(const PoolWindows& p, const float* x, const float* g, int w,
                              int wout, int c) {
    const int lo = (c + p.padding - p.kernel) / p.stride, hi = (c + p.padding) / p.stride;
    float acc = 0.f;
    for (int o = lo > 0 ? lo : 0; o <= hi && o < wout; ++o) {
      const Span sp = span(p, o, w);
      if (c < sp.st || c >= sp.en) continue;
      if (p.avg) acc += g[o] / sp.divisor;
      else if (max_at(x, sp.st, sp.en) == c) acc += g[o];
    }
    return acc;
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

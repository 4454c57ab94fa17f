// The declared-once ops that are not a RowOp (executors/common/row_ops.h's PoolOp and
// GroupNormOp, batch_norm_op.h's BatchNormOp), against float64 formulas of their own: every
// executor computes these by the same functions, so each is checked once here, over many
// window shapes and random rows.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "batch_norm_op.h"
#include "row_ops.h"

using namespace gemmfuse;

namespace {

// PyTorch's avg_pool1d / max_pool1d (dilation 1) and their gradients, by scattering each
// window's gradient to its columns.
struct PoolRef {
  PoolWindows p;
  int w, wout;
  void window(int o, int& st, int& en, double& divisor) const {
    const int s = o * p.stride - p.padding, e = std::min(s + p.kernel, w + p.padding);
    st = std::max(s, 0);
    en = std::min(e, w);
    divisor = p.include_pad ? e - s : en - st;
  }
  std::vector<double> grad(const std::vector<float>& x, const std::vector<float>& g) const {
    std::vector<double> gi(w, 0.0);
    for (int o = 0; o < wout; ++o) {
      int st, en;
      double d;
      window(o, st, en, d);
      if (p.avg) {
        for (int c = st; c < en; ++c) gi[c] += g[o] / d;
        continue;
      }
      int at = -1;
      for (int c = st; c < en; ++c)
        if (at < 0 || x[c] > x[at]) at = c;
      if (at >= 0) gi[at] += g[o];
    }
    return gi;
  }
};

int out_width(const PoolWindows& p, int w, bool ceil_mode) {
  const int span = w + 2 * p.padding - p.kernel;
  int n = (ceil_mode ? (span + p.stride - 1) / p.stride : span / p.stride) + 1;
  if (ceil_mode && (n - 1) * p.stride >= w + p.padding) --n;  // the last window starts in the input
  return n;
}

}  // namespace

TEST(PoolOp, ValuesAndGradientsMatchScatteredWindows) {
  std::mt19937 rng(20261206);
  std::normal_distribution<float> nd;
  int cases = 0;
  for (int w : {1, 5, 16, 37})
    for (int k = 1; k <= 4; ++k)
      for (int s = 1; s <= k; ++s)
        for (int pad = 0; pad <= k / 2; ++pad)
          for (int mode = 0; mode < 6; ++mode) {
            const bool avg = mode % 2 == 0, ceil_mode = mode >= 2, include_pad = mode >= 4;
            const PoolWindows p{k, s, pad, avg, include_pad};
            if (w + 2 * pad < k) continue;
            const int wout = out_width(p, w, ceil_mode);
            std::vector<float> x(w), g(wout);
            for (float& v : x) v = nd(rng);
            for (float& v : g) v = nd(rng);
            const PoolRef ref{p, w, wout};
            const std::vector<double> gi = ref.grad(x, g);
            for (int o = 0; o < wout; ++o) {
              int st, en;
              double d;
              ref.window(o, st, en, d);
              double want = avg ? 0.0 : -INFINITY;
              for (int c = st; c < en; ++c) want = avg ? want + x[c] : std::max(want, double(x[c]));
              if (avg) want /= d;
              const float got = PoolOp::forward(p, x.data(), w, o);
              if (std::isinf(want))  // a window of padding only: max pooling's -inf
                EXPECT_EQ(got, want) << "w " << w << " k " << k << " s " << s << " p " << pad;
              else
                EXPECT_NEAR(got, want, 1e-6)
                    << "w " << w << " k " << k << " s " << s << " p " << pad << " mode " << mode;
            }
            for (int c = 0; c < w; ++c)
              EXPECT_NEAR(PoolOp::backward(p, x.data(), g.data(), w, wout, c), gi[c], 1e-5)
                  << "w " << w << " k " << k << " s " << s << " p " << pad << " mode " << mode;
            ++cases;
          }
  EXPECT_GT(cases, 200);
}

TEST(GroupNormOp, ForwardAndBackwardMatchFloat64) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (int gs : {1, 2, 32, 100}) {
    std::vector<float> x(gs), g(gs), wt(gs), y(gs), gi(gs, NAN);
    for (int c = 0; c < gs; ++c) x[c] = 3.0f + nd(rng), g[c] = nd(rng), wt[c] = 1.0f + 0.1f * nd(rng);
    const double eps = 1e-5;
    double mean = 0, var = 0;
    for (float v : x) mean += v;
    mean /= gs;
    for (float v : x) var += (v - mean) * (v - mean);
    var /= gs;
    const double rstd = 1.0 / std::sqrt(var + eps);
    auto grp = alone_row(x.data(), y.data(), gs);
    GroupNormOp::forward(grp, wt.data(), nullptr, eps);
    double m1 = 0, m2 = 0;
    for (int c = 0; c < gs; ++c) {
      const double xh = (x[c] - mean) * rstd;
      EXPECT_NEAR(y[c], xh * wt[c], 1e-5 * (1 + std::fabs(xh))) << "gs " << gs;
      m1 += double(g[c]) * wt[c] / gs;
      m2 += double(g[c]) * wt[c] * xh / gs;
    }
    std::vector<double> dw(gs, 0.0), db(gs, 0.0);
    auto bw = alone_row(x.data(), nullptr, gs);
    GroupNormOp::backward(bw, {x.data(), g.data(), wt.data(), gi.data()}, eps,
                          [&](int c, float a, float b) { dw[c] += a, db[c] += b; });
    for (int c = 0; c < gs; ++c) {
      const double xh = (x[c] - mean) * rstd;
      const double want = rstd * (double(g[c]) * wt[c] - m1 - xh * m2);
      EXPECT_NEAR(gi[c], want, 1e-4 * (1 + std::fabs(want))) << "gs " << gs << " c " << c;
      EXPECT_NEAR(dw[c], g[c] * xh, 1e-5 * (1 + std::fabs(g[c] * xh)));
      EXPECT_EQ(db[c], g[c]);
    }
  }
}

TEST(BatchNormOp, StatisticsUpdateAndGradients) {
  // Shifted sums against a two-pass mean and variance, on values far from zero.
  std::vector<double> col = {1000.25, 1000.5, 999.75, 1001.0, 1000.0};
  const double n = col.size(), x0 = col[0];
  double s1 = 0, s2 = 0, mean = 0, var = 0;
  for (double v : col) s1 += v - x0, s2 += (v - x0) * (v - x0), mean += v / n;
  for (double v : col) var += (v - mean) * (v - mean) / n;
  const BatchNormOp::Stats st = BatchNormOp::from_shifted_sums(x0, s1, s2, n);
  EXPECT_NEAR(st.mean, mean, 1e-12);
  EXPECT_NEAR(st.var, var, 1e-12);
  EXPECT_FLOAT_EQ(BatchNormOp::invstd(var, 1e-5), float(1.0 / std::sqrt(var + 1e-5)));
  // A NaN column's variance stays NaN; rounding below zero is clamped.
  EXPECT_TRUE(std::isnan(BatchNormOp::from_shifted_sums(0, NAN, NAN, 4).var));
  EXPECT_EQ(BatchNormOp::from_shifted_sums(0, 1e-9, 0, 4).var, 0.0);
  // The running update: the unbiased variance; NaN for one row, as PyTorch's.
  EXPECT_NEAR(BatchNormOp::running_var(2.0, var, n, 0.1), 0.9 * 2.0 + 0.1 * var * n / (n - 1), 1e-12);
  EXPECT_NEAR(BatchNormOp::running_mean(2.0, mean, 0.1), 0.9 * 2.0 + 0.1 * mean, 1e-9);
  EXPECT_TRUE(std::isnan(BatchNormOp::running_var(2.0, 0.0, 1.0, 0.1)));
  // Batch statistics' gradient: w invstd / n (n g - sum g - x^ sum g x^).
  EXPECT_NEAR(BatchNormOp::batch_grad(0.5, 0.25, 2.0, 4.0, 8.0, 1.5, -0.5),
              2.0 * 4.0 / 8.0 * (8.0 * 0.5 - 1.5 + 0.25 * 0.5), 1e-12);
  EXPECT_EQ(BatchNormOp::eval_grad(0.5f, 2.0f, 4.0f), 4.0f);
}

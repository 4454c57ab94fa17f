// BatchNorm (op_table's ColumnNorm family), declared once: its statistics over the rows, the
// running statistics' update, and its per-element forward and input gradient. The CPU
// executor, the CUDA column statistics, the row kernels and the row backward all compute
// BatchNorm by these functions. T is the arithmetic's type: fp32 on the GPU's per-element
// paths, fp64 on the CPU's and for every statistic.
#pragma once

#include "pointwise.h"

namespace gemmfuse {

struct BatchNormOp {
  struct Stats {
    double mean, var;  // the biased variance (the one that normalises)
  };
  // A column's statistics from the sums s1 of (x - x0) and s2 of (x - x0)^2 over n rows: x0,
  // one of the column's values, keeps the sums small (one pass, no cancellation to speak of
  // in fp64 for fp32 data).
  GF_HD static Stats from_shifted_sums(double x0, double s1, double s2, double n) {
    const double var = (s2 - s1 * s1 / n) / n;  // rounding may leave it below 0; NaN stays
    return {x0 + s1 / n, var < 0.0 ? 0.0 : var};
  }
  GF_HD static float invstd(double var, double eps) { return static_cast<float>(1.0 / sqrt(var + eps)); }
  // The running statistics' update with factor m (the momentum, or 1 / num_batches_tracked
  // for momentum=None): the batch mean, and the unbiased variance over n rows (NaN for n = 1,
  // as PyTorch's).
  GF_HD static double running_mean(double old, double mean, double m) { return (1.0 - m) * old + m * mean; }
  GF_HD static double running_var(double old, double var, double n, double m) {
    return (1.0 - m) * old + m * (var * n / (n - 1.0));
  }

  // y = (x - mean) invstd (the affine weight and bias follow).
  template <class T>
  GF_HD static T normalize(T x, T mean, T invstd) { return (x - mean) * invstd; }
  // Column c of w: normalized by `stats` (the w means, then the w invstds: ColumnStats's
  // layout), times the affine weight, plus the bias, each where given.
  GF_HD static float apply(float x, const float* stats, int64_t w, const float* weight, const float* bias,
                           int64_t c) {
    float y = normalize(x, stats[c], stats[w + c]);
    if (weight) y *= weight[c];
    if (bias) y += bias[c];
    return y;
  }
  // The input's gradient with the statistics held fixed (eval: running statistics): g w invstd.
  template <class T>
  GF_HD static T eval_grad(T g, T w, T invstd) { return g * w * invstd; }
  // With batch statistics over n rows: w invstd / n (n g - sum(g) - x^ sum(g x^)), x^ the
  // normalised input, the sums over the column.
  template <class T>
  GF_HD static T batch_grad(T g, T x_hat, T w, T invstd, T n, T sum_g, T sum_g_xhat) {
    return w * invstd / n * (n * g - sum_g - x_hat * sum_g_xhat);
  }
};

}  // namespace gemmfuse

// The CPU executor's row functions (cpu_rows.h).
#include "cpu_rows.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "pointwise.h"
#include "row_ops.h"

namespace gemmfuse {

float reduce_row(OpCode op, const float* x, int64_t w) {
  auto row = alone_row(x, nullptr, w);
  return reduce_forward(op, row);
}

void softmax_row(OpCode op, float* x, int64_t w) {
  auto row = alone_row(x, x, w);
  softmax_forward(op, row);
}

GroupStats group_stats(const float* v, int64_t gs, double eps) {
  double mean = 0;
  for (int64_t c = 0; c < gs; ++c) mean += v[c];
  mean /= static_cast<double>(gs);
  double var = 0;
  for (int64_t c = 0; c < gs; ++c) var += (v[c] - mean) * (v[c] - mean);
  var /= static_cast<double>(gs);
  return {mean, 1.0 / std::sqrt(var + eps)};
}

void group_norm_row(const Node& n, float* x, int64_t w, const float* wt, const float* bs) {
  const int64_t gs = w / n.groups;
  for (int64_t g = 0; g < n.groups; ++g) {
    float* v = x + g * gs;
    const auto [mean, rstd] = group_stats(v, gs, n.eps);
    for (int64_t c = 0; c < gs; ++c) {
      const int64_t col = g * gs + c;
      double y = (v[c] - mean) * rstd;
      if (wt) y *= wt[col];
      if (bs) y += bs[col];
      v[c] = static_cast<float>(y);
    }
  }
}

void batch_norm_row(float* x, int64_t w, const float* stats, const float* wt, const float* bs) {
  for (int64_t c = 0; c < w; ++c) {
    float y = (x[c] - stats[c]) * stats[w + c];
    if (wt) y *= wt[c];
    if (bs) y += bs[c];
    x[c] = y;
  }
}

void running_stats_row(const float* rm, const float* rv, double eps, int64_t w, float* stats) {
  for (int64_t c = 0; c < w; ++c) {
    stats[c] = rm[c];
    stats[w + c] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(rv[c]) + eps));
  }
}

PoolWindow pool_window(const Node& n, int64_t o, int64_t w) {
  int64_t st = o * n.stride - n.padding, en = std::min(st + n.kernel, w + n.padding);
  const int64_t pool_size = en - st;  // includes padding (count_include_pad)
  st = std::max<int64_t>(st, 0);
  en = std::min(en, w);
  return {st, en, static_cast<float>(n.count_include_pad ? pool_size : en - st)};
}

int64_t max_pool_at(const float* x, int64_t st, int64_t en) {
  int64_t at = -1;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = st; c < en; ++c)
    if (x[c] > m || gf_isnan(x[c])) {
      m = x[c];
      at = c;
      if (gf_isnan(m)) break;
    }
  return at;
}

void pool_row(const Node& n, const float* x, int64_t w, float* out, int64_t w_out) {
  for (int64_t o = 0; o < w_out; ++o) {
    const auto [st, en, divisor] = pool_window(n, o, w);
    if (n.op == OpCode::AvgPool) {
      double s = 0;
      for (int64_t c = st; c < en; ++c) s += x[c];
      out[o] = static_cast<float>(s / static_cast<double>(divisor));
    } else {
      const int64_t at = max_pool_at(x, st, en);
      out[o] = at >= 0 ? x[at] : -std::numeric_limits<float>::infinity();  // padding is -inf
    }
  }
}

}  // namespace gemmfuse

// The CPU executor's row functions (row_ops.h).
#include "row_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "pointwise.h"

namespace gemmfuse {

float reduce_row(OpCode op, const float* x, int64_t w) {
  switch (op) {
    case OpCode::Sum: case OpCode::Mean: {
      double s = 0;
      for (int64_t c = 0; c < w; ++c) s += x[c];
      return static_cast<float>(op == OpCode::Mean ? s / static_cast<double>(w) : s);
    }
    case OpCode::Max: case OpCode::Min: {
      float m = x[0];
      for (int64_t c = 1; c < w; ++c) m = op == OpCode::Max ? nan_max(m, x[c]) : nan_min(m, x[c]);
      return m;
    }
    case OpCode::LogSumExp: {
      float m = x[0];
      for (int64_t c = 1; c < w; ++c) m = nan_max(m, x[c]);
      const float shift = lse_shift(m);
      double s = 0;
      for (int64_t c = 0; c < w; ++c) s += std::exp(static_cast<double>(x[c] - shift));
      return static_cast<float>(std::log(s) + static_cast<double>(shift));
    }
    default: throw std::logic_error("reduce_row: not a reduction");
  }
}

void softmax_row(bool log, float* x, int64_t w) {
  float m = x[0];
  for (int64_t c = 1; c < w; ++c) m = nan_max(m, x[c]);
  double s = 0;
  for (int64_t c = 0; c < w; ++c) s += std::exp(static_cast<double>(x[c] - m));
  if (log) {
    const double ls = std::log(s);
    for (int64_t c = 0; c < w; ++c) x[c] = static_cast<float>(static_cast<double>(x[c] - m) - ls);
  } else {
    for (int64_t c = 0; c < w; ++c)
      x[c] = static_cast<float>(std::exp(static_cast<double>(x[c] - m)) / s);
  }
}

void group_norm_row(const Node& n, float* x, int64_t w, const float* wt, const float* bs) {
  const int64_t gs = w / n.groups;
  for (int64_t g = 0; g < n.groups; ++g) {
    float* v = x + g * gs;
    double mean = 0;
    for (int64_t c = 0; c < gs; ++c) mean += v[c];
    mean /= static_cast<double>(gs);
    double var = 0;
    for (int64_t c = 0; c < gs; ++c) var += (v[c] - mean) * (v[c] - mean);
    var /= static_cast<double>(gs);
    const double rstd = 1.0 / std::sqrt(var + n.eps);
    for (int64_t c = 0; c < gs; ++c) {
      const int64_t col = g * gs + c;
      double y = (v[c] - mean) * rstd;
      if (wt) y *= wt[col];
      if (bs) y += bs[col];
      v[c] = static_cast<float>(y);
    }
  }
}

PoolWindow pool_window(const Node& n, int64_t o, int64_t w) {
  int64_t st = o * n.stride - n.padding, en = std::min(st + n.kernel, w + n.padding);
  const int64_t pool_size = en - st;  // includes padding (count_include_pad)
  st = std::max<int64_t>(st, 0);
  en = std::min(en, w);
  return {st, en, static_cast<float>(n.count_include_pad ? pool_size : en - st)};
}

void pool_row(const Node& n, const float* x, int64_t w, float* out, int64_t w_out) {
  for (int64_t o = 0; o < w_out; ++o) {
    const auto [st, en, divisor] = pool_window(n, o, w);
    if (n.op == OpCode::AvgPool) {
      double s = 0;
      for (int64_t c = st; c < en; ++c) s += x[c];
      out[o] = static_cast<float>(s / static_cast<double>(divisor));
    } else {
      float m = -std::numeric_limits<float>::infinity();  // padding is -inf
      for (int64_t c = st; c < en; ++c)
        if (x[c] > m || gf_isnan(x[c])) m = x[c];  // as PyTorch: NaN wins
      out[o] = m;
    }
  }
}

}  // namespace gemmfuse

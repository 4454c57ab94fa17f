// The CPU executor's row functions (cpu_rows.h).
#include "cpu_rows.h"

#include <cmath>

#include "batch_norm_op.h"
#include "pointwise.h"
#include "row_attrs.h"
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

void group_norm_row(const Node& n, float* x, int64_t w, const float* wt, const float* bs) {
  const int64_t gs = w / n.groups;
  for (int64_t g = 0; g < n.groups; ++g) {
    StridedRow<Alone> grp = alone_row(x + g * gs, x + g * gs, gs);
    const int c0 = static_cast<int>(g * gs);
    GroupNormOp::forward(grp, from_col(wt, c0), from_col(bs, c0), n.eps);
  }
}

void batch_norm_row(float* x, int64_t w, const float* stats, const float* wt, const float* bs) {
  for (int64_t c = 0; c < w; ++c) x[c] = BatchNormOp::apply(x[c], stats, w, wt, bs, c);
}

void running_stats_row(const float* rm, const float* rv, double eps, int64_t w, float* stats) {
  for (int64_t c = 0; c < w; ++c) {
    stats[c] = rm[c];
    stats[w + c] = BatchNormOp::invstd(rv[c], eps);
  }
}

void pool_row(const Node& n, const float* x, int64_t w, float* out, int64_t w_out) {
  const PoolWindows p = pool_windows(n);
  for (int64_t o = 0; o < w_out; ++o)
    out[o] = PoolOp::forward(p, x, static_cast<int>(w), static_cast<int>(o));
}

}  // namespace gemmfuse

// The row ops' dispatch (executors/common/row_ops.h) on the CPU's one-thread team: every op of
// a family reaches its RowOp, and an op outside the family throws instead of passing through.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "row_ops.h"

using namespace gemmfuse;

namespace {

const std::vector<float> kRow = {0.5f, -1.25f, 3.0f, 2.0f, -0.75f};

StridedRow<Alone> team(const float* src, float* dst) { return alone_row(src, dst, kRow.size()); }

double ref_reduce(OpCode op) {
  double s = 0, mx = -INFINITY, mn = INFINITY;
  for (float v : kRow) s += v, mx = std::fmax(mx, v), mn = std::fmin(mn, v);
  double e = 0;
  for (float v : kRow) e += std::exp(v - mx);
  switch (op) {
    case OpCode::Sum: return s;
    case OpCode::Mean: return s / kRow.size();
    case OpCode::Max: return mx;
    case OpCode::Min: return mn;
    case OpCode::LogSumExp: return mx + std::log(e);
    default: return NAN;
  }
}

}  // namespace

TEST(RowOps, EveryReduceOpOfTheTableDispatches) {
#define GF_REDUCE(code, name, fam, scalar)                                    \
  {                                                                           \
    auto row = team(kRow.data(), nullptr);                                    \
    EXPECT_NEAR(reduce_forward(OpCode::code, row), ref_reduce(OpCode::code), \
                1e-6 * (1 + std::fabs(ref_reduce(OpCode::code))))             \
        << name;                                                              \
  }
  GEMMFUSE_REDUCE_OPS(GF_REDUCE)
#undef GF_REDUCE
}

TEST(RowOps, EverySoftmaxOpOfTheTableDispatchesAndSumsToOne) {
#define GF_SOFTMAX(code, name, fam, scalar)                                            \
  {                                                                                    \
    std::vector<float> y = kRow;                                                       \
    auto row = team(y.data(), y.data());                                               \
    softmax_forward(OpCode::code, row);                                                \
    double s = 0;                                                                      \
    for (float v : y) s += OpCode::code == OpCode::LogSoftmax ? std::exp(v) : v;       \
    EXPECT_NEAR(s, 1.0, 1e-6) << name;                                                 \
  }
  GEMMFUSE_SOFTMAX_OPS(GF_SOFTMAX)
#undef GF_SOFTMAX
}

TEST(RowOps, AnOpOutsideItsFamilyThrows) {
  std::vector<float> y = kRow, g(kRow.size(), 1.f), gi(kRow.size());
  auto row = team(y.data(), y.data());
  const RowGrad d{kRow.data(), y.data(), g.data(), gi.data()};
  EXPECT_THROW(reduce_forward(OpCode::Softmax, row), std::logic_error);
  EXPECT_THROW(reduce_backward(OpCode::GeluErf, row, d, false), std::logic_error);
  EXPECT_THROW(softmax_forward(OpCode::Sum, row), std::logic_error);
  EXPECT_THROW(softmax_backward(OpCode::GroupNorm, row, d), std::logic_error);
}

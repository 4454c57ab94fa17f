// The transposed row split (executors/cuda/split/split.h, launch_split_f16x2_transposed: dW =
// dVᵀ x splits dV's columns as rows of dVᵀ) against the rule written out on the host, value by
// value: each column's exponent from its largest finite magnitude, each value's two fp16 parts
// (the host's fp16 rounding, bit for bit), the values left out (infinities; nonzero values
// below fp16's normal range once scaled) with zero parts, a NaN column's parts all zero, each
// column's tiny count, mark and list entry. Fresh random values per run (seed printed); the
// outputs poisoned. Runs on a GPU and, through tools/kernel_emu, on the CPU.
// (cuda_split_test.cpp checks it bit for bit against the row split of the transposed copy.)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpu_test_util.h"
#include "cuda_test_util.h"
#include "split.h"

namespace {

using gemmfuse::cuda::RowMarks;
using gftest::DevMem;

// src [rows, cols] of uniform [-1, 1), columns 0..8 (where cols > 8) special: an infinity,
// both infinities and a value 3e38 (the rest tiny beside it), a NaN, one value 1e-36 beside
// ordinary ones, values 2^-100..2^100, zeros only, fp32 subnormals, values near fp32's largest,
// and as many infinities as correctable_infinities(rows) allows plus one.
std::vector<float> columns_to_split(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(rows * cols);
  for (float& e : v) e = d(rng);
  if (cols <= 8) return v;
  auto at = [&](int64_t r, int64_t c) -> float& { return v[(r % rows) * cols + c]; };
  constexpr float kInf = std::numeric_limits<float>::infinity();
  at(3, 0) = kInf;
  at(1, 1) = -kInf, at(rows - 1, 1) = kInf, at(2, 1) = 3e38f;
  at(rows / 2, 2) = std::numeric_limits<float>::quiet_NaN();
  at(5, 3) = 1e-36f;
  for (int64_t r = 0; r < rows; ++r) {
    at(r, 4) = std::ldexp(at(r, 4), -100 + static_cast<int>(r % 200));
    at(r, 5) = 0.f;
    at(r, 6) = std::ldexp(at(r, 6), -140);
    at(r, 7) = std::ldexp(at(r, 7), 127);
  }
  for (int64_t i = 0; i <= gemmfuse::cuda::correctable_infinities(rows); ++i) at(7 * i + 1, 8) = -kInf;
  return v;
}

// What the split must write for column c of src.
struct Want {
  std::vector<uint16_t> p0, p1;  // the column's parts, row by row
  float e = 0.f;
  int mark = 0, tiny = 0;
};

uint16_t bits(__half h) { return __half_as_ushort(h); }

Want rule(const std::vector<float>& src, int64_t rows, int64_t cols, int64_t c) {
  bool nan = false;
  float top = 0.f;
  for (int64_t r = 0; r < rows; ++r) {
    const float v = src[r * cols + c];
    nan |= std::isnan(v);
    if (std::isfinite(v)) top = std::max(top, std::fabs(v));
  }
  Want w;
  const int e = nan || top == 0.f ? 0 : 14 - std::ilogb(top);
  w.e = static_cast<float>(e);
  int infs = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float v = src[r * cols + c], s = std::ldexp(v, e);
    const bool tiny = v != 0.f && std::fabs(s) < std::ldexp(1.f, -14);
    const bool left = !nan && (std::isinf(v) || tiny);
    w.tiny += !nan && tiny && !std::isinf(v);
    infs += !nan && std::isinf(v);
    const __half p0 = __float2half_rn(nan || left ? 0.f : s);
    w.p0.push_back(bits(p0));
    w.p1.push_back(bits(__float2half_rn(nan || left ? 0.f : (s - __half2float(p0)) * 2048.f)));
  }
  using namespace gemmfuse::cuda;
  w.mark = nan ? kRowNaN : infs > correctable_infinities(rows) ? kRowRecompute : w.tiny + infs > 0 ? kRowTiny : kRowKept;
  return w;
}

void check(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
  const std::vector<float> src = columns_to_split(rows, cols, rng);
  DevMem dsrc(src.size() * 4), parts(2 * rows * cols * 2), exps(cols * 4), flags(cols * 4), tiny(cols * 4),
      list((cols + 1) * 4), scratch(gemmfuse::cuda::split_f16x2_transposed_scratch_bytes(cols));
  CK(cudaMemcpy(dsrc.p, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(list.p, 0, 4));  // the rest stays poisoned (DevMem's NaN bytes)
  gemmfuse::cuda::launch_split_f16x2_transposed(
      static_cast<float*>(dsrc.p), rows, cols, static_cast<__half*>(parts.p), static_cast<float*>(exps.p),
      RowMarks{static_cast<int*>(flags.p), static_cast<int*>(list.p), static_cast<int*>(tiny.p)}, scratch.p, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(2 * rows * cols);
  std::vector<float> got_e(cols);
  std::vector<int> got_flags(cols), got_tiny(cols), got_list(cols + 1);
  CK(cudaMemcpy(got.data(), parts.p, got.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_e.data(), exps.p, cols * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_flags.data(), flags.p, cols * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_tiny.data(), tiny.p, cols * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(got_list.data(), list.p, (cols + 1) * 4, cudaMemcpyDeviceToHost));
  std::set<int> marked;
  for (int64_t c = 0; c < cols; ++c) {
    const Want w = rule(src, rows, cols, c);
    ASSERT_EQ(got_e[c], w.e) << "column " << c;
    ASSERT_EQ(got_flags[c], w.mark) << "column " << c;
    ASSERT_EQ(got_tiny[c], w.tiny) << "column " << c;
    if (w.mark != gemmfuse::cuda::kRowKept) marked.insert(static_cast<int>(c));
    for (int64_t r = 0; r < rows; ++r) {
      ASSERT_EQ(got[c * rows + r], w.p0[r]) << "column " << c << " row " << r << ": " << src[r * cols + c];
      ASSERT_EQ(got[rows * cols + c * rows + r], w.p1[r]) << "column " << c << " row " << r;
    }
  }
  ASSERT_GE(got_list[0], 0);
  ASSERT_LE(got_list[0], cols);
  EXPECT_EQ(std::set<int>(got_list.begin() + 1, got_list.begin() + 1 + got_list[0]), marked);
  if (cols > 8) EXPECT_GE(marked.size(), 6u);  // columns 0-4 and 8 at least
}

// Column blocks cut at their edge (132 columns: 256 a CTA; 264: a second block), runs of 16
// rows cut at 8 (200 and 1032 rows), a single short run (8 rows).
TEST(CudaSplitTransposed, AgainstTheHostRule) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  check(200, 132, rng);
  check(8, 4, rng);
  check(1032, 264, rng);
}

}  // namespace

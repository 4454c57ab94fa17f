// The bf16 splits of fp32 operands (executors/cuda/split.h: `fast`'s hi + lo, `fp32`'s three
// parts) and the fp32 fix-up: parts exact against the host's bf16 rounding, zero parts and
// marked rows for the values no split can carry (NaN, infinities, past bf16's range, nonzero
// below 2^-110), every row's flag written (the buffer starts poisoned), the list form, the
// padding of `fast`'s halves zero; the fix-up rewrites exactly the marked rows and columns,
// as float64 has them (with a per-row W scale and a bias), across more than one chunk of x flags.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "cuda_test_util.h"
#include "split.h"

namespace {

using gemmfuse::cuda::HiLoOrder;
using gemmfuse::cuda::RowMarks;
using gftest::DevMem;

constexpr float kBf16Max = 3.38953139e38f;

bool exceptional(float v) {
  const float a = std::fabs(v);
  return !(a <= kBf16Max) || (a != 0.f && a < std::ldexp(1.f, -110));
}

float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
float bf16_value(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// rows x K of uniform [-1, 1) with, in the rows named, one value no split can carry.
std::vector<float> with_exceptions(int64_t rows, int64_t K, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(rows * K);
  for (float& e : v) e = d(rng);
  const float bad[] = {std::numeric_limits<float>::infinity(), -1.002f * kBf16Max,
                       std::numeric_limits<float>::quiet_NaN(), 3e-36f};
  for (int i = 0; i < 4 && 1 + 2 * i < rows; ++i) v[(1 + 2 * i) * K + (5 * i) % K] = bad[i];
  return v;
}

std::vector<int> marked_rows(const std::vector<float>& v, int64_t rows, int64_t K,
                             const std::vector<float>& scale) {
  std::vector<int> out;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      if (exceptional(v[r * K + k] * (scale.empty() ? 1.f : scale[r]))) {
        out.push_back(static_cast<int>(r));
        break;
      }
  return out;
}

template <class T>
std::vector<T> download(const DevMem& m, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), m.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

TEST(CudaSplit, HiLoPartsAndMarks) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(11);
  // K = 64: the whole-row form; 37: bounds and scalar loads; 36: 4-column halves
  for (int64_t K : {64, 37, 36}) {
    for (bool scaled : {false, true}) {
      for (HiLoOrder order : {HiLoOrder::LoHiHi, HiLoOrder::HiLoHi}) {
        SCOPED_TRACE(::testing::Message() << "K=" << K << " scaled=" << scaled
                                          << " order=" << static_cast<int>(order));
        const int64_t rows = 9, Kh = (K + 7) / 8 * 8;
        static_assert(gemmfuse::cuda::kFastSplitSegments == 3, "seg_hi lists three segments");
        const int64_t S = gemmfuse::cuda::kFastSplitSegments;  // which part each holds (hi: true):
        const std::vector<bool> seg_hi = order == HiLoOrder::LoHiHi
                                             ? std::vector<bool>{false, true, true}
                                             : std::vector<bool>{true, false, true};
        const std::vector<float> src = with_exceptions(rows, K, rng);
        std::vector<float> scale;
        if (scaled)
          for (int64_t r = 0; r < rows; ++r) scale.push_back(0.5f + 0.25f * r);
        DevMem dsrc(src.size() * 4), dscale(rows * 4), dout(rows * S * Kh * 2), dflags(rows * 4),
            dlist((rows + 1) * 4);
        CK(cudaMemcpy(dsrc.p, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
        if (scaled) CK(cudaMemcpy(dscale.p, scale.data(), rows * 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(dlist.p, 0, 4));
        CK(cudaMemset(dout.p, 0xff, rows * S * Kh * 2));  // poison: every segment must be written
        CK(cudaMemset(dflags.p, 0xff, rows * 4));
        gemmfuse::cuda::launch_split_hilo(
            static_cast<float*>(dsrc.p), scaled ? static_cast<float*>(dscale.p) : nullptr, rows, K,
            Kh, order, static_cast<__nv_bfloat16*>(dout.p),
            RowMarks{static_cast<int*>(dflags.p), static_cast<int*>(dlist.p)}, nullptr);
        CK(cudaDeviceSynchronize());
        const auto out = download<uint16_t>(dout, rows * S * Kh);
        const auto flags = download<int>(dflags, rows);
        const auto list = download<int>(dlist, rows + 1);
        const std::vector<int> want = marked_rows(src, rows, K, scale);
        for (int64_t r = 0; r < rows; ++r) {
          const bool marked = std::count(want.begin(), want.end(), r) > 0;
          EXPECT_EQ(flags[r], marked ? 1 : 0) << "row " << r;
          for (int64_t k = 0; k < Kh; ++k) {
            const float v = k < K ? src[r * K + k] * (scaled ? scale[r] : 1.f) : 0.f;
            const float want_hi = exceptional(v) ? 0.f : bf16_round(v);
            const float want_lo = exceptional(v) ? 0.f : bf16_round(v - want_hi);
            for (int64_t g = 0; g < S; ++g) {
              const float part = bf16_value(out[r * S * Kh + g * Kh + k]);
              ASSERT_EQ(part, seg_hi[g] ? want_hi : want_lo)
                  << "row " << r << " segment " << g << " col " << k << " v " << v;
            }
          }
        }
        ASSERT_EQ(list[0], static_cast<int>(want.size()));
        EXPECT_EQ(std::set<int>(list.begin() + 1, list.begin() + 1 + list[0]),
                  std::set<int>(want.begin(), want.end()));
      }
    }
  }
}

TEST(CudaSplit, ThreePartsExactAndMarks) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(12);
  const int64_t rows = 9, K = 72;
  std::vector<float> src = with_exceptions(rows, K, rng);
  for (int64_t k = 0; k < K; ++k) src[8 * K + k] = std::ldexp(src[8 * K + k], -100 + k % 200);
  DevMem dsrc(src.size() * 4), dparts(3 * rows * K * 2), dflags(rows * 4);
  CK(cudaMemcpy(dsrc.p, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
  gemmfuse::cuda::launch_split_bf16x3(static_cast<float*>(dsrc.p), rows, K,
                                      static_cast<__nv_bfloat16*>(dparts.p),
                                      RowMarks{static_cast<int*>(dflags.p), nullptr}, nullptr);
  CK(cudaDeviceSynchronize());
  const auto parts = download<uint16_t>(dparts, 3 * rows * K);
  const auto flags = download<int>(dflags, rows);
  const std::vector<int> want = marked_rows(src, rows, K, {});
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(flags[r], std::count(want.begin(), want.end(), r) > 0 ? 1 : 0) << "row " << r;
    for (int64_t k = 0; k < K; ++k) {
      const float v = src[r * K + k];
      double sum = 0.0;
      for (int i = 0; i < 3; ++i) sum += bf16_value(parts[i * rows * K + r * K + k]);
      ASSERT_EQ(sum, exceptional(v) ? 0.0 : static_cast<double>(v)) << "row " << r << " col " << k;
    }
  }
}

TEST(CudaSplit, FixupRewritesExactlyTheMarkedRowsAndColumns) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  // M past one chunk of flags (1024 rows a step)
  const int64_t M = 1100, N = 24, K = 40;
  std::vector<float> x(M * K), w(N * K), scale(N), bias(N);
  for (float& e : x) e = d(rng);
  for (float& e : w) e = d(rng);
  for (float& e : scale) e = 0.5f + (d(rng) + 1.f);
  for (float& e : bias) e = d(rng);
  x[1050 * K + 3] = std::numeric_limits<float>::infinity();
  const std::vector<int> x_rows = {2, 1023, 1024, 1050}, w_cols = {3, 17};
  std::vector<int> flags(M, 0), list = {static_cast<int>(w_cols.size())};
  for (int r : x_rows) flags[r] = 1;
  list.insert(list.end(), w_cols.begin(), w_cols.end());
  const float sentinel = 12345.f;
  std::vector<float> y(M * N, sentinel);
  DevMem dx(x.size() * 4), dw(w.size() * 4), ds(N * 4), db(N * 4), dy(y.size() * 4),
      dflags(M * 4), dlist(list.size() * 4);
  CK(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ds.p, scale.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db.p, bias.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dy.p, y.data(), y.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dflags.p, flags.data(), M * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dlist.p, list.data(), list.size() * 4, cudaMemcpyHostToDevice));
  gemmfuse::cuda::launch_fixup_exceptional(
      static_cast<float*>(dx.p), static_cast<float*>(dw.p), static_cast<float*>(ds.p),
      static_cast<float*>(db.p), static_cast<float*>(dy.p), M, N, K, static_cast<int*>(dflags.p),
      static_cast<int*>(dlist.p), nullptr);
  CK(cudaDeviceSynchronize());
  y = download<float>(dy, M * N);
  std::vector<float> w_scaled(w.size());  // W' as the fix-up forms it, rounded once
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) w_scaled[n * K + k] = w[n * K + k] * scale[n];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const bool marked = std::count(x_rows.begin(), x_rows.end(), m) ||
                          std::count(w_cols.begin(), w_cols.end(), n);
      const float got = y[m * N + n];
      if (!marked) {
        ASSERT_EQ(got, sentinel) << m << "," << n;
        continue;
      }
      const auto [ref, mag] = gftest::dot_ref(x, w_scaled, &bias[n], m, n, K);
      if (std::isinf(ref)) {
        ASSERT_EQ(got, static_cast<float>(ref)) << m << "," << n;
      } else {
        ASSERT_NEAR(got, ref, 4 * K * std::ldexp(mag, -24)) << m << "," << n;
      }
    }
  }
}

}  // namespace

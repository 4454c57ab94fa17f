// The splits of fp32 operands (executors/cuda/split/split.h: `fast`'s bf16 hi + lo, `fp32`'s
// row-scaled fp16 parts) and the fp32 fix-up: `fast`'s parts exact against the host's bf16
// rounding, zero parts and marked rows for the values it cannot carry (NaN, infinities, past
// bf16's range, nonzero below 2^-110), every row's flag written (the buffer starts poisoned),
// the list form, the padding of `fast`'s halves zero; `fp32`'s parts within their bound, its
// row exponents, its tiny values left out and its marks; the fix-up rewrites exactly the
// recomputed rows and the listed columns, as float64 has them (with a per-row W scale and a
// bias), and adds the tiny values' products to exactly the corrected rows, across more than
// one chunk of x flags and more than one item of columns; `fp32`'s second level: whether it
// pays, its slots in row order, their exponents and parts, the values still tiny there; the
// fix-up adding a slot's products and correcting (or recomputing) from the slot's exponent.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpu_test_util.h"
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
          const bool nan = std::any_of(src.begin() + r * K, src.begin() + (r + 1) * K,
                                       [](float v) { return std::isnan(v); });
          EXPECT_EQ(flags[r], nan      ? gemmfuse::cuda::kRowNaN
                              : marked ? gemmfuse::cuda::kRowRecompute
                                       : gemmfuse::cuda::kRowKept)
              << "row " << r;
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

// `fp32`'s split: each row's exponent puts its largest finite magnitude in [2^14, 2^15); the
// two fp16 parts give v 2^e within 2^-22 of it, and zero for a value left out (infinite, or
// tiny: nonzero, |v 2^e| below 2^-14, fp16's least normal value); marks: kRowNaN for rows with
// a NaN (zero parts, e = 0, no value counted), kRowRecompute for rows with more than
// correctable_infinities(K) infinities, kRowTiny for other rows with values left out (the
// tiny ones counted), none for the rest.
// Rows: ordinary, at the ends of fp32's range (near its largest, subnormal), spread over
// 2^-100..2^100 (marked), all zero. K = 72 (most threads idle), 8200 and 16392: the kernel
// keeps a row in registers in 4 and in 8 steps of 8 values per thread, and reads it twice
// beyond that.
void check_row_scaled_split(int64_t K, std::mt19937_64& rng) {
  SCOPED_TRACE("K=" + std::to_string(K));
  const int64_t rows = 12;
  std::vector<float> src = with_exceptions(rows, K, rng);  // rows 1 (inf), 3, 5 (NaN), 7
  src[1 * K + K - 1] = -std::numeric_limits<float>::infinity();  // row 1: both infinities
  for (int64_t k = 0; k < K; ++k) {
    src[8 * K + k] = std::ldexp(src[8 * K + k], -100 + k % 200);
    src[9 * K + k] = 0.f;
    src[10 * K + k] = std::ldexp(src[10 * K + k], -140);  // fp32 subnormals
    src[11 * K + k] = std::ldexp(src[11 * K + k], 127);   // near fp32's largest
  }
  DevMem dsrc(src.size() * 4), dparts(2 * rows * K * 2), dexps(rows * 4), dflags(rows * 4),
      dtiny(rows * 4);
  CK(cudaMemcpy(dsrc.p, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dflags.p, 0x7f, rows * 4));  // poisoned: every row's flag and count must be written
  CK(cudaMemset(dtiny.p, 0x7f, rows * 4));
  gemmfuse::cuda::launch_split_f16x2(
      static_cast<float*>(dsrc.p), rows, K, static_cast<__half*>(dparts.p), static_cast<float*>(dexps.p),
      RowMarks{static_cast<int*>(dflags.p), nullptr, static_cast<int*>(dtiny.p)}, nullptr);
  CK(cudaDeviceSynchronize());
  const auto parts = download<__half>(dparts, 2 * rows * K);
  const auto exps = download<float>(dexps, rows);
  const auto flags = download<int>(dflags, rows);
  const auto tiny_counts = download<int>(dtiny, rows);
  for (int64_t r = 0; r < rows; ++r) {
    bool nan = false;
    float top = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      nan |= std::isnan(src[r * K + k]);
      if (std::isfinite(src[r * K + k])) top = std::max(top, std::fabs(src[r * K + k]));
    }
    const int e = nan || top == 0.f ? 0 : 14 - std::ilogb(top);
    ASSERT_EQ(exps[r], static_cast<float>(e)) << "row " << r;
    auto is_tiny = [&](float v) {  // nonzero, below fp16's normal range once scaled
      return v != 0.f && std::fabs(std::ldexp(static_cast<double>(v), e)) < std::ldexp(1.0, -14);
    };
    auto left_out = [&](float v) { return std::isinf(v) || is_tiny(v); };
    int64_t tiny = 0, infs = 0;
    for (int64_t k = 0; k < K && !nan; ++k) {
      tiny += is_tiny(src[r * K + k]);
      infs += std::isinf(src[r * K + k]);
    }
    const int want_mark = nan                                                  ? gemmfuse::cuda::kRowNaN
                          : infs > gemmfuse::cuda::correctable_infinities(K) ? gemmfuse::cuda::kRowRecompute
                          : tiny + infs > 0                                    ? gemmfuse::cuda::kRowTiny
                                                                               : gemmfuse::cuda::kRowKept;
    EXPECT_EQ(flags[r], want_mark) << "row " << r << " (" << tiny << " tiny values, " << infs << " infinities)";
    EXPECT_EQ(tiny_counts[r], tiny) << "row " << r;
    // the rows the test means: 3 (3.4e38 beside ordinary values) and 8 (2^-100..2^100) hold
    // many tiny values, 7 (3e-36 beside ordinary values) one, 1 two infinities (marked
    // kRowTiny where K >= 1024, kRowRecompute below)
    EXPECT_EQ(tiny > 1, r == 3 || r == 8) << "row " << r;
    EXPECT_EQ(tiny == 1, r == 7) << "row " << r;
    EXPECT_EQ(infs, r == 1 ? 2 : 0) << "row " << r;
    for (int64_t k = 0; k < K; ++k) {
      const double p0 = __half2float(parts[r * K + k]), p1 = __half2float(parts[rows * K + r * K + k]);
      const double got = p0 + std::ldexp(p1, -11);
      if (nan || left_out(src[r * K + k])) {  // left out of the parts
        ASSERT_EQ(p0, 0.0) << "row " << r << " col " << k;
        ASSERT_EQ(p1, 0.0) << "row " << r << " col " << k;
        continue;
      }
      const double want = std::ldexp(static_cast<double>(src[r * K + k]), e);
      ASSERT_LE(std::fabs(p0), 32768.0);
      ASSERT_LE(std::fabs(got - want), std::max(std::ldexp(std::fabs(want), -22), std::ldexp(1.0, -36)))
          << "row " << r << " col " << k << ": " << src[r * K + k];
    }
  }
}

TEST(CudaSplit, RowScaledFp16PartsAndMarks) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(12);
  for (const int64_t K : {72, 8200, 16392}) check_row_scaled_split(K, rng);
}

// The transposed split of src [rows, cols] (launch_split_f16x2_transposed) against the row split
// of its transposed copy: the same parts bit for bit, the same exponents, marks, tiny counts and
// list. Columns 0..11 hold check_row_scaled_split's rows (infinities, NaN, values past fp16's
// reach either way, fp32 subnormals, a zero column); outputs poisoned.
void check_transposed_split(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols));
  std::vector<float> t = with_exceptions(cols, rows, rng);  // srcᵀ: a row per column of src
  for (int64_t k = 0; k < rows && cols > 11; ++k) {
    t[8 * rows + k] = std::ldexp(t[8 * rows + k], -100 + k % 200);
    t[9 * rows + k] = 0.f;
    t[10 * rows + k] = std::ldexp(t[10 * rows + k], -140);
    t[11 * rows + k] = std::ldexp(t[11 * rows + k], 127);
  }
  std::vector<float> src(rows * cols);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) src[r * cols + c] = t[c * rows + r];
  struct Out {
    DevMem parts, exps, flags, tiny, list;
    explicit Out(int64_t n, int64_t cols)
        : parts(2 * n * 2), exps(cols * 4), flags(cols * 4), tiny(cols * 4), list((cols + 1) * 4) {
      for (DevMem* m : {&parts, &exps, &flags, &tiny, &list}) CK(cudaMemset(m->p, 0x7f, m->bytes));
      CK(cudaMemset(list.p, 0, 4));
    }
    RowMarks marks() { return {static_cast<int*>(flags.p), static_cast<int*>(list.p), static_cast<int*>(tiny.p)}; }
  } want(rows * cols, cols), got(rows * cols, cols);
  DevMem dt(t.size() * 4), dsrc(src.size() * 4), scratch(gemmfuse::cuda::split_f16x2_transposed_scratch_bytes(cols));
  CK(cudaMemcpy(dt.p, t.data(), t.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dsrc.p, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(scratch.p, 0x7f, scratch.bytes));  // the launcher zeroes what it accumulates into
  gemmfuse::cuda::launch_split_f16x2(static_cast<float*>(dt.p), cols, rows, static_cast<__half*>(want.parts.p),
                                     static_cast<float*>(want.exps.p), want.marks(), nullptr);
  gemmfuse::cuda::launch_split_f16x2_transposed(static_cast<float*>(dsrc.p), rows, cols,
                                                static_cast<__half*>(got.parts.p), static_cast<float*>(got.exps.p),
                                                got.marks(), scratch.p, nullptr);
  CK(cudaDeviceSynchronize());
  EXPECT_EQ(download<uint16_t>(got.parts, 2 * rows * cols), download<uint16_t>(want.parts, 2 * rows * cols));
  EXPECT_EQ(download<float>(got.exps, cols), download<float>(want.exps, cols));
  EXPECT_EQ(download<int>(got.flags, cols), download<int>(want.flags, cols));
  EXPECT_EQ(download<int>(got.tiny, cols), download<int>(want.tiny, cols));
  auto listed = [&](const DevMem& list) {
    const auto l = download<int>(list, cols + 1);
    return std::set<int>(l.begin() + 1, l.begin() + 1 + l[0]);
  };
  EXPECT_EQ(listed(got.list), listed(want.list));
  EXPECT_GE(listed(got.list).size(), cols > 11 ? 5u : 0u);  // columns 1, 3, 5, 7 and 8 at least
}

TEST(CudaSplit, TransposedSplitIsTheRowSplitOfTheTranspose) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  check_transposed_split(200, 132, rng);   // tiles cut at both edges
  check_transposed_split(8, 4, rng);       // one partial tile
  check_transposed_split(1032, 64, rng);   // many row tiles a CTA's column block
  check_transposed_split(8200, 12, rng);   // a column's infinities within correctable_infinities
}

// The fix-up, on flags, lists and (with `second_level`) slots written by hand. Rows 5, 6, 1023
// and 1099 hold tiny values at k = 0 (3e-9: the largest), 17 (-1e-20) and 39 (1e-44, scaled to
// zero at the first level), row 6 also -inf at k = 50. Without the second level, all four are
// corrected from the rows' exponent. With it, they sit in slots 0 to 3 (exponent 43, from 3e-9,
// at which 3e-9 is no longer tiny): slots 0 to 2 add the slot's products, then the values at 17
// and 39 (and 50); slot 3 says it holds more than correctable_tiny_values and is recomputed.
// Recomputed rows: two per chunk of flags (by warps), three in the second chunk with slot 3's
// row (by tiles), and with `many_rows` `many` more in the first chunk (by tiles: 40, two
// groups of small tiles; 600 at N = 4100, large tiles), one holding a NaN and one both
// infinities. Rows 7 and 1060 are marked kRowNaN (NaN written), W's row 600 too (a NaN
// column). W's listed columns cross every recomputed row. K = 1027: rows off 16 bytes, the
// tiles' scalar loads and a partial last step; K = 260: a partial last step of large tiles.
void check_fixup(bool second_level, bool many_rows, int64_t K = 1024, int64_t N = 1300, int many = 40) {
  SCOPED_TRACE(std::string(second_level ? "second level" : "first level") + (many_rows ? ", many rows" : "") +
               ", N=" + std::to_string(N) + ", " + std::to_string(many) +
               ", K=" + std::to_string(K));
  using gemmfuse::cuda::kRowKept;
  using gemmfuse::cuda::kRowRecompute;
  using gemmfuse::cuda::kRowTiny;
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  // M past one chunk of flags (1024 rows a step), N past one correction item (1024 columns)
  const int64_t M = 1100;  // correctable_tiny_values(K) = 4 at K = 1024
  std::vector<float> x(M * K), w(N * K), scale(N), bias(N), exps(M, 14.f);  // |x| < 1: e = 14
  for (float& e : x) e = d(rng);
  for (float& e : w) e = d(rng);
  for (float& e : scale) e = 0.5f + (d(rng) + 1.f);
  for (float& e : bias) e = d(rng);
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  x[1050 * K + 3] = kInf;
  const std::vector<int> tiny_rows = {5, 6, 1023, 1099};
  for (int r : tiny_rows) {
    x[r * K + 0] = 3e-9f;
    x[r * K + 17] = -1e-20f;
    x[r * K + 39] = 1e-44f;
  }
  x[6 * K + 50] = -kInf;
  const std::vector<int> nan_rows = {7, 1060};
  for (int r : nan_rows) x[r * K + 2 * r % K] = kNaN;
  std::vector<int> x_rows = {2, 1023 - 1, 1024, 1050};
  const std::vector<int> w_cols = {3, 17, 600, 1200};
  w[600 * K + 11] = kNaN;
  if (many_rows) {
    for (int r = 100; r < 100 + many; ++r) x_rows.push_back(r);
    x[120 * K + 7] = kNaN;
    x[121 * K + 8] = kInf;
    x[121 * K + 9] = -kInf;
  }
  std::vector<int> flags(M, kRowKept), w_flags(N, kRowKept), list = {static_cast<int>(w_cols.size())};
  for (int r : x_rows) flags[r] = kRowRecompute;
  for (int r : tiny_rows) flags[r] = kRowTiny;
  for (int r : nan_rows) flags[r] = gemmfuse::cuda::kRowNaN;
  for (int c : w_cols) w_flags[c] = c == 600 ? gemmfuse::cuda::kRowNaN : kRowRecompute;
  list.insert(list.end(), w_cols.begin(), w_cols.end());
  // the second level: slot s holds tiny_rows[s]
  const int slots = second_level ? 4 : 0, e2 = 14 - std::ilogb(3e-9f);
  ASSERT_EQ(e2, 43);
  if (second_level) ASSERT_GE(gemmfuse::cuda::correctable_tiny_values(K), 3);
  const std::vector<int> slot_tiny = {2, 3, 2, static_cast<int>(gemmfuse::cuda::correctable_tiny_values(K)) + 1};
  const std::vector<float> slot_exps(4, static_cast<float>(e2));
  std::vector<float> y2(4 * N);
  for (float& e : y2) e = 1e-20f * d(rng);  // the size of the values added after it
  const float sentinel = 12345.f;
  std::vector<float> y(M * N, sentinel);
  for (int r : tiny_rows)  // 0 there: the correction must show
    for (int64_t n = 0; n < N; ++n) y[r * N + n] = 0.f;
  DevMem dx(x.size() * 4), dw(w.size() * 4), ds(N * 4), db(N * 4), dy(y.size() * 4),
      dexps(M * 4), dflags(M * 4), dlist(list.size() * 4), dwflags(N * 4), dslots(4), dslot_row(4 * 4),
      dslot_tiny(4 * 4), dslot_exps(4 * 4), dy2(y2.size() * 4);
  CK(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ds.p, scale.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db.p, bias.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dy.p, y.data(), y.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dexps.p, exps.data(), M * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dflags.p, flags.data(), M * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dlist.p, list.data(), list.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dwflags.p, w_flags.data(), N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dslots.p, &slots, 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dslot_row.p, tiny_rows.data(), 4 * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dslot_tiny.p, slot_tiny.data(), 4 * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dslot_exps.p, slot_exps.data(), 4 * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dy2.p, y2.data(), y2.size() * 4, cudaMemcpyHostToDevice));
  gemmfuse::cuda::SecondLevel second;
  second.rows = static_cast<int*>(dslots.p);
  second.slot_row = static_cast<int*>(dslot_row.p);
  second.slot_tiny = static_cast<int*>(dslot_tiny.p);
  second.exps = static_cast<float*>(dslot_exps.p);
  second.y = static_cast<float*>(dy2.p);
  gemmfuse::cuda::launch_fixup_exceptional(
      static_cast<float*>(dx.p), static_cast<float*>(dw.p), static_cast<float*>(ds.p),
      static_cast<float*>(db.p), static_cast<float*>(dy.p), M, N, K, static_cast<float*>(dexps.p),
      static_cast<int*>(dflags.p), static_cast<int*>(dlist.p), static_cast<int*>(dwflags.p), second, nullptr);
  CK(cudaDeviceSynchronize());
  y = download<float>(dy, M * N);
  std::vector<float> w_scaled(w.size());  // W' as the fix-up forms it, rounded once
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) w_scaled[n * K + k] = w[n * K + k] * scale[n];
  for (int64_t m = 0; m < M; ++m) {
    const auto tiny_at = std::find(tiny_rows.begin(), tiny_rows.end(), m);
    const int slot = tiny_at == tiny_rows.end() || !second_level ? -1 : int(tiny_at - tiny_rows.begin());
    const bool recomputed = std::count(x_rows.begin(), x_rows.end(), m) || slot == 3;
    const bool nan_row = std::count(nan_rows.begin(), nan_rows.end(), m) > 0;
    // the values the fix-up adds: left out at the row's exponent, or at its slot's
    std::vector<int> added = slot >= 0 ? std::vector<int>{17, 39} : std::vector<int>{0, 17, 39};
    if (m == 6) added.push_back(50);
    for (int64_t n = 0; n < N; ++n) {
      const float got = y[m * N + n];
      if (nan_row || n == 600) {
        ASSERT_TRUE(std::isnan(got)) << m << "," << n;
      } else if (recomputed || std::count(w_cols.begin(), w_cols.end(), n)) {
        const auto [ref, mag] = gftest::dot_ref(x, w_scaled, &bias[n], m, n, K);
        if (std::isnan(ref)) {
          ASSERT_TRUE(std::isnan(got)) << m << "," << n;
        } else if (std::isinf(ref)) {
          ASSERT_EQ(got, static_cast<float>(ref)) << m << "," << n;
        } else {
          ASSERT_NEAR(got, ref, 4 * K * std::ldexp(mag, -24)) << m << "," << n;
        }
      } else if (tiny_at != tiny_rows.end()) {
        double add = slot >= 0 ? y2[slot * N + n] : 0.0, mag = std::fabs(add);
        for (int k : added) {  // the tiny values' products, W' as float64 has it
          add += static_cast<double>(x[m * K + k]) * w[n * K + k] * scale[n];
          mag += std::fabs(static_cast<double>(x[m * K + k]) * w[n * K + k] * scale[n]);
        }
        ASSERT_NE(add, 0.0);
        if (std::isinf(add))
          ASSERT_EQ(got, static_cast<float>(add)) << m << "," << n;
        else
          ASSERT_NEAR(got, add, 8 * std::ldexp(mag, -24)) << m << "," << n;
      } else {
        ASSERT_EQ(got, sentinel) << m << "," << n;
      }
    }
  }
}

TEST(CudaSplit, FixupRewritesExactlyTheMarkedRowsAndColumns) {
  SKIP_WITHOUT_GPU();
  for (bool many_rows : {false, true}) {
    check_fixup(false, many_rows);
    check_fixup(true, many_rows);
  }
  check_fixup(true, true, 1027);
  // 600 rows by 4100 columns: the large tiles (choose_large_tile, on up to 165 SMs)
  check_fixup(false, true, 260, 4100, 600);
}

// launch_split_second_level on x after launch_split_f16x2, against the host: whether it pays
// (second_level_pays over all rows' tiny values), and where it does, slot s holding the s-th
// kRowTiny row in row order, its exponent from its largest tiny value, its parts as the first
// level's rule makes them for the tiny values alone (the rest zero), and the values still tiny
// at that exponent counted. M past one chunk of flags and past two slots per CTA; rows of
// values spread over 2^-40..1 (tiny values carried at the second level), over 2^-80..1 (some
// still tiny there), with one tiny value (k = 3), none, or an infinity (row 3 too, with `many`:
// no tiny value, a slot at the row's own exponent).
void check_second_level(int64_t M, int64_t K, bool many, std::mt19937_64& rng) {
  SCOPED_TRACE("M=" + std::to_string(M) + " K=" + std::to_string(K) + (many ? " many" : " few"));
  std::uniform_real_distribution<float> d(0.5f, 1.f);
  std::vector<float> x(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      float v = d(rng) * (k % 2 ? 1.f : -1.f);
      if (many && m % 3 == 1) v = std::ldexp(v, -static_cast<int>(k % 41));
      if (many && m % 7 == 2) v = std::ldexp(v, -static_cast<int>(k % 81));
      x[m * K + k] = v;
    }
  for (int64_t m = 0; m < M; m += 5) x[m * K + 3] = 1e-12f;
  x[(M / 2) * K + 1] = std::numeric_limits<float>::infinity();
  if (many) x[3 * K + 5] = -std::numeric_limits<float>::infinity();
  DevMem dx(x.size() * 4), dparts(2 * M * K * 2), dexps(M * 4), dflags(M * 4), dtiny(M * 4), drows(4),
      dslot_row(M * 4), dslot_tiny(M * 4), dslot_exps(M * 4), dslot_parts(2 * M * K * 2);
  CK(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(drows.p, 0x7f, 4));  // poisoned: written every call
  CK(cudaMemset(dslot_row.p, 0xff, M * 4));
  gemmfuse::cuda::SecondLevel second;
  second.rows = static_cast<int*>(drows.p);
  second.slot_row = static_cast<int*>(dslot_row.p);
  second.slot_tiny = static_cast<int*>(dslot_tiny.p);
  second.exps = static_cast<float*>(dslot_exps.p);
  second.parts = static_cast<__half*>(dslot_parts.p);
  const auto* xd = static_cast<const float*>(dx.p);
  gemmfuse::cuda::launch_split_f16x2(xd, M, K, static_cast<__half*>(dparts.p), static_cast<float*>(dexps.p),
                                     RowMarks{static_cast<int*>(dflags.p), nullptr, static_cast<int*>(dtiny.p)},
                                     nullptr);
  gemmfuse::cuda::launch_split_second_level(xd, M, K, static_cast<float*>(dexps.p), static_cast<int*>(dflags.p),
                                            static_cast<int*>(dtiny.p), second, nullptr);
  CK(cudaDeviceSynchronize());
  const auto exps = download<float>(dexps, M);
  const auto flags = download<int>(dflags, M);
  int rows = 0;
  CK(cudaMemcpy(&rows, drows.p, 4, cudaMemcpyDeviceToHost));
  // the host's view: each row's tiny values at its exponent
  std::vector<int> tiny_rows;
  int64_t values = 0;
  auto tiny_at = [](float v, int e) { return v != 0.f && std::fabs(std::ldexp(v, e)) < std::ldexp(1.f, -14); };
  for (int64_t m = 0; m < M; ++m) {
    if (flags[m] != gemmfuse::cuda::kRowTiny) continue;
    tiny_rows.push_back(static_cast<int>(m));
    for (int64_t k = 0; k < K; ++k) values += tiny_at(x[m * K + k], static_cast<int>(exps[m]));
  }
  const bool pays = gemmfuse::cuda::second_level_pays(values, K);
  EXPECT_EQ(pays, many);
  ASSERT_EQ(rows, pays ? static_cast<int>(tiny_rows.size()) : 0) << values << " tiny values";
  if (!pays) return;
  const auto slot_row = download<int>(dslot_row, M);
  const auto slot_tiny = download<int>(dslot_tiny, M);
  const auto slot_exps = download<float>(dslot_exps, M);
  const auto parts = download<__half>(dslot_parts, 2 * M * K);
  int still_tiny_rows = 0, inf_slots = 0;
  for (int s = 0; s < rows; ++s) {
    const int m = tiny_rows[s], e1 = static_cast<int>(exps[m]);
    ASSERT_EQ(slot_row[s], m) << "slot " << s;
    float top = 0.f;
    for (int64_t k = 0; k < K; ++k)
      if (tiny_at(x[m * K + k], e1)) top = std::max(top, std::fabs(x[m * K + k]));
    const int e2 = top > 0.f ? 14 - std::ilogb(top) : e1;
    ASSERT_EQ(slot_exps[s], static_cast<float>(e2)) << "slot " << s;
    int still = 0;  // values left out at e2: still tiny, or infinite
    for (int64_t k = 0; k < K; ++k) {
      const float v = x[m * K + k];
      const double p0 = __half2float(parts[s * K + k]), p1 = __half2float(parts[M * K + s * K + k]);
      const double got = p0 + std::ldexp(p1, -11);
      if (!tiny_at(v, e1) || tiny_at(v, e2)) {  // carried by the first level, or still tiny
        still += tiny_at(v, e1) || std::isinf(v);
        inf_slots += std::isinf(v);
        ASSERT_EQ(got, 0.0) << "slot " << s << " k " << k;
        continue;
      }
      const double want = std::ldexp(static_cast<double>(v), e2);
      ASSERT_LE(std::fabs(got - want), std::ldexp(std::fabs(want), -22)) << "slot " << s << " k " << k;
    }
    EXPECT_EQ(slot_tiny[s], still) << "slot " << s;
    still_tiny_rows += still > 0;
  }
  EXPECT_GT(still_tiny_rows, 0);  // the test reaches values tiny at both levels
  // and both infinities' rows, row 3 holding no tiny value (recomputed rows where K < 512)
  EXPECT_EQ(inf_slots, gemmfuse::cuda::correctable_infinities(K) >= 1 ? 2 : 0);
}

TEST(CudaSplit, SecondLevelSlots) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(14);
  check_second_level(1100, 264, true, rng);   // many: the second level pays
  check_second_level(40, 264, false, rng);    // 8 rows with one tiny value each: the fix-up's
  check_second_level(3000, 72, true, rng);    // more slots than CTAs on any GPU
  check_second_level(600, 1032, true, rng);   // rows with an infinity corrected (K >= 512): slots
}

}  // namespace

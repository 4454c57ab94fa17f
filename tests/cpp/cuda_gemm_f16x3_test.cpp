// The fp32 GEMM on fp16 tensor cores (executors/cuda/sm90/gemm_f16x3.cu, with the split and
// the fp32 fix-up of split.h) against a float64 reference: fresh random inputs per test (seed
// printed; GEMMFUSE_SEED=<n> repeats one), output poisoned with NaN, every element within the
// worst-case bound of the method and, from the K the executor gives the kernel, the
// norm-wise error below a plain fp32 dot product's typical one. Shapes cover M, N and K tails
// (K not a multiple of the 64-wide k-tile, K below it, odd and even k-tile counts), bias or
// none; rows of x and W at scales 2^-40..2^40 (the split's row exponents); the values the
// split cannot carry (NaN, infinities), whose rows and columns are recomputed in fp32, and
// the ends of fp32's range, which the row scales carry: all must come out as float64 has them.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <tuple>
#include <vector>

#include "cpu_test_util.h"
#include "cuda_test_util.h"
#include "device_facts.h"
#include "fp32_gemm_f16x3.h"
#include "gemm_f16x3.h"
#include "split.h"
#include "weight_grad_f16x3.h"

namespace {

using gemmfuse::cuda::Fp32GemmF16x3;
using gemmfuse::cuda::launch_fp32_gemm_f16x3;
using gemmfuse::cuda::launch_split_f16x2;
using gemmfuse::cuda::RowMarks;
using gftest::DevMem;

// The kernel selection's f16x3_unfit for the current device and overrides.
const char* f16x3_unfit(int64_t M, int64_t N, int64_t K) {
  return gemmfuse::cuda::f16x3_unfit(M, N, K, gemmfuse::cuda::device_facts(), gemmfuse::cuda::current_overrides());
}

#define SKIP_WITHOUT_SM90()                                                     \
  do {                                                                          \
    SKIP_WITHOUT_GPU();                                                         \
    if (!gftest::is_sm90()) GTEST_SKIP() << "the f16x3 GEMM needs an sm_90 GPU";       \
    if (!gemmfuse::cuda::sm90::f16x3_built()) GTEST_SKIP() << "not built";     \
  } while (0)

std::vector<float> uniform(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& e : v) e = d(rng);
  return v;
}

// Each row of v [rows, cols] times 2^s (s uniform in -40..40), each value also times 2^-t
// (t uniform in 0..12): rows far apart in scale, values spread inside a row. Exact in fp32.
void scale_rows(std::vector<float>& v, int64_t cols, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> row_exp(-40, 40), spread(0, 12);
  for (size_t r = 0; r * cols < v.size(); ++r) {
    const int s = row_exp(rng);
    for (int64_t c = 0; c < cols; ++c) v[r * cols + c] = std::ldexp(v[r * cols + c], s - spread(rng));
  }
}

// Y = x W^T (+ b) as the executor runs it (fp32_gemm_f16x3.h): W's parts and marked rows,
// then x's split, its second level, the kernel, the second level's GEMM and the fix-up.
// `splits` as F16x3Problem's (0: the shape's choice). `second_rows`, if given, gets how many
// rows the second level took. With `mn_major`, as the backward's dx = dV W runs it: W stored
// transposed ([K, N]), split by columns, read MN-major. With `x_transposed` (and mn_major), as
// dW = dVᵀ x runs it: x stored transposed ([K, M]), split by launch_split_f16x2_transposed, no
// second level.
std::vector<float> run_gemm(int64_t M, int64_t N, int64_t K, const std::vector<float>& x,
                            const std::vector<float>& w, const float* bias_host, int splits = 0,
                            int* second_rows = nullptr, bool mn_major = false, bool x_transposed = false) {
  DevMem dx(M * K * 4), dxp(std::max(M * K * 4, M * N * 4)), dxe(M * 4), dxf(M * 4), dxt(M * 4),
      dw(N * K * 4), dwp(N * K * 4), dwe(N * 4), dwf(N * 4), dwl((N + 1) * 4), db(N * 4), dy(M * N * 4),
      ws(size_t(32) << 20), d2rows(4), d2row(M * 4), d2tiny(M * 4), d2exps(M * 4), d2parts(M * K * 4),
      dxs(gemmfuse::cuda::split_f16x2_transposed_scratch_bytes(M));
  if (x_transposed) {
    std::vector<float> xt(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xt[k * M + m] = x[m * K + k];
    CK(cudaMemcpy(dx.p, xt.data(), xt.size() * 4, cudaMemcpyHostToDevice));
  } else {
    CK(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  }
  if (bias_host) CK(cudaMemcpy(db.p, bias_host, N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dwl.p, 0, 4));  // x's flags stay poisoned: the split writes every row's
  const RowMarks w_marks{static_cast<int*>(dwf.p), static_cast<int*>(dwl.p)};
  if (mn_major) {
    std::vector<float> wt(N * K);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) wt[k * N + n] = w[n * K + k];
    CK(cudaMemcpy(dw.p, wt.data(), wt.size() * 4, cudaMemcpyHostToDevice));
    DevMem stats(gemmfuse::cuda::split_f16x2_columns_scratch_bytes(N));
    gemmfuse::cuda::launch_split_f16x2_columns(static_cast<float*>(dw.p), K, N, static_cast<__half*>(dwp.p),
                                               static_cast<float*>(dwe.p), w_marks, stats.p, nullptr);
    CK(cudaDeviceSynchronize());
  } else {
    CK(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    launch_split_f16x2(static_cast<float*>(dw.p), N, K, static_cast<__half*>(dwp.p), static_cast<float*>(dwe.p),
                       w_marks, nullptr);
  }
  Fp32GemmF16x3 g;
  g.M = M;
  g.N = N;
  g.K = K;
  g.x = static_cast<const float*>(dx.p);
  g.w = static_cast<const float*>(dw.p);
  g.w_parts = static_cast<const __half*>(dwp.p);
  g.w_exps = static_cast<const float*>(dwe.p);
  g.w_list = static_cast<const int*>(dwl.p);
  g.w_flags = static_cast<const int*>(dwf.p);
  g.bias = bias_host ? static_cast<const float*>(db.p) : nullptr;
  g.y = static_cast<float*>(dy.p);
  g.scratch.x_parts = static_cast<__half*>(dxp.p);
  g.scratch.x_exps = static_cast<float*>(dxe.p);
  g.scratch.x_flags = static_cast<int*>(dxf.p);
  g.scratch.x_tiny = static_cast<int*>(dxt.p);
  g.scratch.second.rows = static_cast<int*>(d2rows.p);
  g.scratch.second.slot_row = static_cast<int*>(d2row.p);
  g.scratch.second.slot_tiny = static_cast<int*>(d2tiny.p);
  g.scratch.second.exps = static_cast<float*>(d2exps.p);
  g.scratch.second.parts = static_cast<__half*>(d2parts.p);
  g.scratch.second.y = static_cast<float*>(dxp.p);  // as the executor lays it out
  g.gemm_workspace = ws.p;
  g.gemm_workspace_bytes = ws.bytes;
  g.splits = splits;
  g.w_transposed = mn_major;
  g.x_transposed = x_transposed;
  g.scratch.x_stats = dxs.p;
  if (x_transposed) g.scratch.second = {};
  launch_fp32_gemm_f16x3(g, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<float> y(M * N);
  CK(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost));
  if (second_rows) CK(cudaMemcpy(second_rows, d2rows.p, 4, cudaMemcpyDeviceToHost));
  return y;
}

// Every element within the method's worst-case bound, in units of u = 2^-24 times
// sum_k |x w| (+ |b|): each part pair is within 2^-22 of its value (4 u each for x and W) and
// the product left out, 2^-22 x1.w1, below 4 u of |x w|: 12 u; per 64 of K the tensor core
// sums the large product in 4 steps, each losing at most ~2 u of the partial sum (8 u); the
// small products' sum, below 2^-10 of it, in K/8 such steps (K/4096 u); the large chains add
// up in fp32 in K/64 steps; the small sum, the row scales (exact) and the bias, 3. And, from
// kF16x3MinK, the norm-wise error below sqrt(K) u / 4 (SGEMM's is about sqrt(K) u / 3 at the
// seed shape: 1.6e-6 at K = 8192); below it the parts' fixed rounding (~2 u) is not under
// that, which is why the executor keeps such K on SGEMM.
// The bounds above for Y from x, w and b (null: none).
void expect_within_bound(int64_t M, int64_t N, int64_t K, const std::vector<float>& x,
                         const std::vector<float>& w, const float* b, const std::vector<float>& y) {
  const bool executor_k = K >= gemmfuse::cuda::sm90::kF16x3MinK;
  const double u = std::ldexp(1.0, -24), n_round = 12 + 8 + K / 4096.0 + K / 64.0 + 3;
  double err2 = 0, ref2 = 0;
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const auto [ref, mag] = gftest::dot_ref(x, w, b ? &b[n] : nullptr, m, n, K);
      const double got = y[m * N + n];
      err2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
      if (!(std::fabs(got - ref) <= n_round * u * mag) && bad++ < 5)
        ADD_FAILURE() << "Y[" << m << ", " << n << "] = " << got << ", float64 " << ref
                      << " (bound " << n_round * u * mag << ")";
    }
  EXPECT_EQ(bad, 0);
  if (executor_k) EXPECT_LE(std::sqrt(err2 / ref2), std::sqrt(static_cast<double>(K)) * u / 4);
}

void check(int64_t M, int64_t N, int64_t K, bool with_bias, std::mt19937_64& rng, int splits = 0,
           bool scaled = false, bool mn_major = false) {
  std::ostringstream what;
  what << "M=" << M << " N=" << N << " K=" << K << " bias=" << with_bias << " splits=" << splits
       << " scaled=" << scaled << " mn_major=" << mn_major;
  SCOPED_TRACE(what.str());
  if (splits == 0 && K >= gemmfuse::cuda::sm90::kF16x3MinK) ASSERT_EQ(f16x3_unfit(M, N, K), nullptr);
  auto x = uniform(M * K, rng), w = uniform(N * K, rng);
  const auto b = uniform(N, rng);
  if (scaled) {
    scale_rows(x, K, rng);
    scale_rows(w, K, rng);
  }
  const std::vector<float> y = run_gemm(M, N, K, x, w, with_bias ? b.data() : nullptr, splits, nullptr, mn_major);
  expect_within_bound(M, N, K, x, w, with_bias ? b.data() : nullptr, y);
}

TEST(CudaF16x3Gemm, Domain) {
  EXPECT_NE(f16x3_unfit(32, 128, 128), nullptr);   // few rows: the small-M kernel or SGEMM
  EXPECT_NE(f16x3_unfit(256, 128, 132), nullptr);  // K % 8 != 0: fp16 rows off 16 bytes
  EXPECT_NE(f16x3_unfit(256, 128, 120), nullptr);  // K below kF16x3MinK
  EXPECT_NE(f16x3_unfit(256, 126, 128), nullptr);  // N % 4 != 0
  EXPECT_NE(f16x3_unfit(256, 128, int64_t(1) << 31), nullptr);
  if (gftest::gpu_present() && gftest::is_sm90() && gemmfuse::cuda::sm90::f16x3_built())
    EXPECT_EQ(f16x3_unfit(256, 128, 128), nullptr);
  else
    EXPECT_NE(f16x3_unfit(256, 128, 128), nullptr);
}

// The cost rule's choices on an H100 (132 SMs) against measured times, kernel / SGEMM in ms:
// bench/micro/f16x3_probe.cu (the x split, the kernel and the fix-up against SGEMM) and,
// marked sweep, bench/micro/fp32_path_sweep.py (Linear -> relu against SGEMM, measured with a
// six-product form of the kernel, slower than this one).
TEST(CudaF16x3Gemm, CostRule) {
  using gemmfuse::cuda::sm90::f16x3_slower_than_sgemm;
  using gemmfuse::cuda::sm90::f16x3_splits;
  const int sms = 132;
  // (M, N, K): the kernel where it is faster ...
  EXPECT_EQ(f16x3_slower_than_sgemm(1024, 8192, 8192, sms), nullptr);  // the seed GEMM: 0.581 / 2.842
  EXPECT_EQ(f16x3_slower_than_sgemm(4096, 8192, 8192, sms), nullptr);  // 2.52 / 10.94
  EXPECT_EQ(f16x3_slower_than_sgemm(256, 8192, 8192, sms), nullptr);   // 0.176 / 0.720
  EXPECT_EQ(f16x3_slower_than_sgemm(256, 4096, 4096, sms), nullptr);   // 0.070 / 0.199
  EXPECT_EQ(f16x3_slower_than_sgemm(4096, 512, 512, sms), nullptr);    // sweep: 0.048 / 0.066
  EXPECT_EQ(f16x3_slower_than_sgemm(4096, 8192, 256, sms), nullptr);   // sweep: 0.313 / 0.551
  EXPECT_EQ(f16x3_slower_than_sgemm(128, 8192, 8192, sms), nullptr);   // 0.136 / 0.366 (split 2)
  EXPECT_EQ(f16x3_slower_than_sgemm(96, 8192, 8192, sms), nullptr);    // 0.133 / 0.360
  EXPECT_EQ(f16x3_slower_than_sgemm(64, 8192, 8192, sms), nullptr);    // 0.136 / 0.219
  EXPECT_EQ(f16x3_slower_than_sgemm(40, 8192, 8192, sms), nullptr);    // 32 and 64 rows: 0.13 / 0.22
  EXPECT_EQ(f16x3_slower_than_sgemm(128, 4096, 4096, sms), nullptr);   // 0.064 / 0.118
  EXPECT_EQ(f16x3_slower_than_sgemm(256, 2048, 2048, sms), nullptr);   // 0.043 / 0.071
  EXPECT_EQ(f16x3_slower_than_sgemm(1024, 256, 8192, sms), nullptr);   // 0.083 / 0.117
  EXPECT_EQ(f16x3_slower_than_sgemm(4096, 256, 8192, sms), nullptr);   // 0.215 / 0.373
  EXPECT_EQ(f16x3_slower_than_sgemm(100, 16384, 8192, sms), nullptr);  // 0.237 / 0.700
  // ... SGEMM where the kernel's fixed costs dominate.
  EXPECT_NE(f16x3_slower_than_sgemm(256, 1024, 1024, sms), nullptr);   // 0.046 / 0.036
  EXPECT_NE(f16x3_slower_than_sgemm(256, 256, 8192, sms), nullptr);    // 0.057 / 0.055
  EXPECT_NE(f16x3_slower_than_sgemm(4096, 256, 256, sms), nullptr);    // sweep: 0.047 / 0.027
  // Host-bound: the kernel's GPU time is the smaller, its host work the larger (0.87x eager).
  EXPECT_NE(f16x3_slower_than_sgemm(256, 8192, 256, sms), nullptr);
  // Fewer SMs: the same tiles take more waves.
  EXPECT_NE(f16x3_slower_than_sgemm(256, 4096, 4096, 16), nullptr);
  // The split-K kernel where the tiles fill less than half the SMs, one CTA per SM.
  EXPECT_EQ(f16x3_splits(1024, 8192, sms), 1);
  EXPECT_EQ(f16x3_splits(192, 8192, sms), 1);  // 128 tiles
  EXPECT_EQ(f16x3_splits(128, 8192, sms), 2);  // 64 tiles
  EXPECT_EQ(f16x3_splits(128, 4096, sms), 4);
  EXPECT_EQ(f16x3_splits(100, 100, sms), 8);   // at most kF16x3MaxSplits
  EXPECT_EQ(f16x3_splits(100, 16384, sms), 2); // one row of 128 tiles: 2-CTA clusters would idle half
}

TEST(CudaF16x3Gemm, AgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  check(256, 128, 128, true, rng);     // one 2-CTA cluster, 2 k-tiles
  check(300, 260, 1000, false, rng);   // M, N tails; K tail inside the last k-tile (16 k-tiles)
  check(384, 136, 8, true, rng);       // K below one k-tile (the kernel's; the executor's from 128)
  check(256, 4, 1088, true, rng);      // N = 4; 17 k-tiles
  check(520, 200, 4160, true, rng);    // 65 k-tiles
}

// Rows of x and W 2^-40..2^40 apart, values spread 2^12 inside a row: the split's row
// exponents, undone in the epilogue; with the wide kernel and split-K.
TEST(CudaF16x3Gemm, RowScalesAgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  check(300, 260, 1000, true, rng, 0, true);
  check(100, 260, 1000, false, rng, 3, true);
  check(256, 136, 8, true, rng, 0, true);
}

// The split-K kernel: each tile's k-tiles (each the three products of one k-tile of K) cut into
// ranges of odd and even lengths, as many as there are k-tiles, summed through the workspace;
// the wide kernel on a shape with a single row of tiles.
TEST(CudaF16x3Gemm, SplitKAgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  check(128, 256, 1024, true, rng, 2);  // 2 tiles, each of 16 k-tiles in halves
  check(100, 260, 1000, false, rng, 3); // M, N and K tails; 16 k-tiles in 3 ranges of 5-6
  check(128, 4, 1088, true, rng, 4);    // 17 k-tiles in 4 ranges of 4-5
  check(64, 136, 8, true, rng, 5);      // K below one k-tile: 1 k-tile (CUTLASS keeps 1 range)
  check(77, 128, 4160, true, rng, 8);   // 65 k-tiles, 8 ranges
  check(128, 256, 1024, true, rng, 1);  // the wide kernel: one 2-CTA cluster per column of tiles, half empty
  // The shape's own choice for one row of 128 tiles: 2 ranges, 256 units on at most one CTA
  // per SM, so CTAs take a second unit while others still wait on their first.
  check(100, 16384, 64, true, rng);
}

// Y from inputs with values the split cannot carry, checked against float64: NaN and
// infinities as fp32 has them, everything else within 64 u of sum |x w|.
void check_exceptional(int64_t M, int64_t N, int64_t K, const std::vector<float>& x,
                       const std::vector<float>& w, const std::vector<float>& b, bool second_level,
                       bool mn_major = false, bool x_transposed = false) {
  int second_rows = -1;
  const std::vector<float> y = run_gemm(M, N, K, x, w, b.data(), 0, &second_rows, mn_major, x_transposed);
  if (!x_transposed) EXPECT_EQ(second_rows > 0, second_level) << second_rows << " rows at the second level";
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = b[n], mag = std::fabs(b[n]);
      float ref32 = 0.f;  // fp32 evaluation, for overflow to infinity
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(x[m * K + k]) * w[n * K + k];
        ref += p;
        mag += std::fabs(p);
        ref32 = std::fmaf(x[m * K + k], w[n * K + k], ref32);
      }
      const float got = y[m * N + n];
      const bool inf32 = std::isinf(ref32) && !std::isnan(ref);
      const bool ok = std::isnan(ref)            ? std::isnan(got)
                      : std::isinf(ref) || inf32 ? got == (std::isinf(ref) ? static_cast<float>(ref) : ref32)
                                                 : std::fabs(got - ref) <= 64 * std::ldexp(1.0, -24) * mag;
      if (!ok && bad++ < 5) ADD_FAILURE() << "Y[" << m << ", " << n << "] = " << got << ", float64 " << ref;
    }
  EXPECT_EQ(bad, 0);
}

// Tiny values where a W row is up to 2e7 times its other values (not marked itself): their
// products are ~1e-4 of Y's, which must come back. Rows 17 and 18: 7 tiny values in all.
void plant_tiny_beside_large_weights(std::vector<float>& x, std::vector<float>& w, int64_t K) {
  for (int64_t k = 0; k < K; ++k) w[20 * K + k] = std::copysign(1e-3f * (0.5f + 0.5f * std::fabs(w[20 * K + k])), w[20 * K + k]);
  for (int64_t k : {50, 51, 52}) {
    w[20 * K + k] = 1e4f;
    x[17 * K + k] = 1e-9f * static_cast<float>(k - 49);
    x[18 * K + k] = -2e-12f;
  }
  x[18 * K + 60] = 1e-45f;  // scaled to zero: still a tiny value
}

// Values the split cannot carry (NaN, +-inf; values over 2^28 below their row's largest, in
// rows recomputed or corrected) reach the outputs they touch as in float64 evaluated in fp32:
// NaN where it is NaN, the same infinity where it is one, finite values within fp32's error;
// a whole tiny row, which the row scales carry, too. NaN rows (x's 3, W's 7) are written NaN;
// rows with few infinities are corrected (11, 12: one each; 25: with tiny values), with more
// than correctable_infinities(K) recomputed (24).
void exceptional_inputs(std::vector<float>& x, std::vector<float>& w, int64_t K) {
  for (float& v : x) v = std::fabs(v);  // x >= 0, so an infinite W entry keeps one sign
  x[3 * K + 5] = std::numeric_limits<float>::quiet_NaN();
  x[11 * K + 2] = std::numeric_limits<float>::infinity();
  x[12 * K + 2] = -std::numeric_limits<float>::infinity();
  x[13 * K + 7] = 3.4e38f;   // near fp32's largest: the row's other values are marked tiny
  x[14 * K + 7] = 1e-35f;    // tiny beside its row's other values
  x[16 * K + 0] = 1e30f;     // against W rows with 0 at k = 0 (below), its other values decide Y
  w[10 * K + 0] = 0.f;
  w[11 * K + 0] = 0.f;
  w[12 * K + 3] = 1e30f;     // a W row marked tiny: its small values meet x's ordinary ones
  for (int64_t k = 0; k < K; ++k) x[15 * K + k] = 1e-36f * (1 + k % 3);  // a whole tiny row
  w[5 * K + 40] = std::numeric_limits<float>::infinity();
  w[7 * K + 9] = std::numeric_limits<float>::quiet_NaN();
  w[9 * K + 2] = 0.5f;  // exact in fp16 (a zero small part) under an infinite x: must give inf
  plant_tiny_beside_large_weights(x, w, K);
  // Many tiny values (row 13 alone has K - 1): the second level takes every row holding one.
  // Rows 19 and 21 hold values ~2^-35 of their largest, carried there; 22 and 23 also values
  // still tiny at the second level (1e-30 beside 1e-10): as many as the fix-up corrects
  // (correctable_tiny_values, 4 at K = 1024) and one more (the row recomputed).
  const int64_t correctable = gemmfuse::cuda::correctable_tiny_values(K);
  ASSERT_GE(correctable, 2);
  for (int64_t k = 0; k < 12; ++k) x[19 * K + 7 * k] = 1e-10f;
  for (int64_t k = 0; k < 13; ++k) x[21 * K + 7 * k] = 1e-10f;
  x[22 * K + 1] = x[23 * K + 1] = 1e-10f;
  for (int64_t k = 0; k < correctable; ++k) x[22 * K + 7 * k + 2] = 1e-30f;
  for (int64_t k = 0; k < correctable + 1; ++k) x[23 * K + 7 * k + 2] = 1e-30f;
  for (int64_t k = 0; k <= gemmfuse::cuda::correctable_infinities(K); ++k)
    x[24 * K + 5 * k + 3] = std::numeric_limits<float>::infinity();
  x[25 * K + 1] = 1e-10f;
  x[25 * K + 8] = 1e-30f;
  x[25 * K + 4] = std::numeric_limits<float>::infinity();
}

TEST(CudaF16x3Gemm, ExceptionalInputs) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  const int64_t M = 256, N = 64, K = 1024;
  auto x = uniform(M * K, rng), w = uniform(N * K, rng);
  exceptional_inputs(x, w, K);
  check_exceptional(M, N, K, x, w, std::vector<float>(N, 0.25f), true);
}


// Few tiny values (7, at most K/32 = 16): the fix-up corrects them, no second level; and an
// infinity (as many as correctable_infinities(K) = 1), corrected the same way.
TEST(CudaF16x3Gemm, FewTinyValuesAreCorrected) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  const int64_t M = 256, N = 64, K = 512;
  auto x = uniform(M * K, rng), w = uniform(N * K, rng);
  plant_tiny_beside_large_weights(x, w, K);
  x[30 * K + 9] = -std::numeric_limits<float>::infinity();
  check_exceptional(M, N, K, x, w, uniform(N, rng), false);
}

// Softmax outputs of N(0, sigma^2) logits against float64, Y within the kernel's bound as for
// ordinary data. sigma = 4 (docs/measurements.md): every row holds values ~2^-30..2^-50 of its
// largest, so the second level takes every row. sigma = 12: most rows also hold more than K/8
// values below 2^-56 of their largest, still tiny at the second level, so the fix-up
// recomputes them, by tiles.
void check_softmax_rows(double sigma, std::mt19937_64& rng, bool mn_major = false) {
  SCOPED_TRACE("sigma=" + std::to_string(sigma) + " mn_major=" + std::to_string(mn_major));
  const int64_t M = 300, N = 200, K = 1024;
  std::normal_distribution<double> logit(0.0, sigma);
  std::vector<float> x(M * K);
  for (int64_t m = 0; m < M; ++m) {
    std::vector<double> e(K);
    double sum = 0;
    for (double& v : e) sum += (v = std::exp(logit(rng)));
    for (int64_t k = 0; k < K; ++k) x[m * K + k] = static_cast<float>(e[k] / sum);
  }
  const auto w = uniform(N * K, rng), b = uniform(N, rng);
  int second_rows = -1;
  const std::vector<float> y = run_gemm(M, N, K, x, w, b.data(), 0, &second_rows, mn_major);
  EXPECT_EQ(second_rows, M);
  expect_within_bound(M, N, K, x, w, b.data(), y);
}

TEST(CudaF16x3Gemm, SoftmaxRowsAgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  check_softmax_rows(4.0, rng);
  check_softmax_rows(12.0, rng);
}

// W read MN-major (the backward's dx = dV W: W [N_out, K_in] is the B operand [K, N] of that
// GEMM), split by columns: columns 2^-40..2^40 apart (the column exponents), tails, the wide
// and split-K kernels; the exceptional inputs above, W's columns marked by the column split
// (NaN, infinite, tiny) recomputed by the fix-up reading W transposed; softmax rows (x's
// second level, the counted kernel reading W MN-major).
TEST(CudaF16x3Gemm, MnMajorAgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  check(256, 128, 128, true, rng, 0, false, true);
  check(300, 264, 1000, false, rng, 0, true, true);
  check(100, 264, 1000, false, rng, 3, true, true);
  check(520, 200, 4160, true, rng, 0, false, true);
  check(128, 256, 1024, true, rng, 2, false, true);
  const int64_t M = 256, N = 64, K = 1024;
  auto x = uniform(M * K, rng), w = uniform(N * K, rng);
  exceptional_inputs(x, w, K);
  check_exceptional(M, N, K, x, w, std::vector<float>(N, 0.25f), true, true);
  check_softmax_rows(4.0, rng, true);
  check_softmax_rows(12.0, rng, true);
}

// x read transposed, as the backward's dW = dVᵀ x reads dV [M_lin, N_lin] as its A [N_lin,
// M_lin] (with W MN-major, no second level): ordinary data within the bound (tails of M, N and
// K, a split-K choice), then the exceptional inputs against float64, rows with more tiny values
// than the fix-up corrects recomputed by it, reading x transposed.
TEST(CudaF16x3Gemm, TransposedXAgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  for (const auto [M, N, K, splits] : {std::tuple<int64_t, int64_t, int64_t, int>{256, 128, 128, 0},
                                       {300, 264, 1000, 0}, {100, 264, 1000, 3}}) {
    SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K));
    auto x = uniform(M * K, rng), w = uniform(N * K, rng);
    scale_rows(x, K, rng);
    const std::vector<float> y = run_gemm(M, N, K, x, w, nullptr, splits, nullptr, true, true);
    expect_within_bound(M, N, K, x, w, nullptr, y);
  }
  const int64_t M = 256, N = 64, K = 1024;
  auto x = uniform(M * K, rng), w = uniform(N * K, rng);
  exceptional_inputs(x, w, K);
  check_exceptional(M, N, K, x, w, std::vector<float>(N, 0.25f), false, true, true);
}

// dW = dVᵀ x as the backward and linear_cross_entropy run it (weight_grad_f16x3.h: dV and x
// read where they lie), within the kernel's bound against float64: dV's columns and x's columns
// 2^-40..2^40 apart (their exponents), tails of every dimension, a split-K choice.
TEST(CudaF16x3Gemm, WeightGradAgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  for (const auto [M, N, K, splits] : {std::tuple<int64_t, int64_t, int64_t, int>{1000, 264, 136, 0},
                                       {256, 100, 512, 3}}) {
    SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K));
    std::vector<float> dvt = uniform(N * M, rng), xt = uniform(K * M, rng);  // dVᵀ and xᵀ, rows scaled
    scale_rows(dvt, M, rng);
    scale_rows(xt, M, rng);
    std::vector<float> dv(M * N), x(M * K);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) dv[m * N + n] = dvt[n * M + m];
      for (int64_t k = 0; k < K; ++k) x[m * K + k] = xt[k * M + m];
    }
    DevMem ddv(dv.size() * 4), dx(x.size() * 4), ddw(N * K * 4),
        ws(gemmfuse::cuda::weight_grad_f16x3_workspace_bytes(M, N, K, splits));
    CK(cudaMemcpy(ddv.p, dv.data(), dv.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    gemmfuse::cuda::WeightGradF16x3 g;
    g.M = M, g.N = N, g.K = K, g.splits = splits;
    g.dv = static_cast<const float*>(ddv.p), g.x = static_cast<const float*>(dx.p);
    g.dw = static_cast<float*>(ddw.p), g.workspace = ws.p;
    gemmfuse::cuda::launch_weight_grad_f16x3(g, nullptr);
    CK(cudaDeviceSynchronize());
    std::vector<float> dw(N * K);
    CK(cudaMemcpy(dw.data(), ddw.p, dw.size() * 4, cudaMemcpyDeviceToHost));
    expect_within_bound(N, K, M, dvt, xt, nullptr, dw);
  }
}

}  // namespace

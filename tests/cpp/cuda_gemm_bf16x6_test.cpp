// The fp32 GEMM on bf16 tensor cores (executors/cuda/sm90/gemm_bf16x6.cu, with the split and
// the fp32 fix-up of split.h) against a float64 reference: fresh random inputs per test (seed
// printed; GEMMFUSE_SEED=<n> repeats one), output poisoned with NaN, every element within the
// worst-case bound of the method and the norm-wise error below a plain fp32 dot product's
// typical one. Shapes cover M, N and K tails (K not a multiple of the 64-wide k-tile, K below
// it, odd and even k-tile counts), bias or none; and the values the split cannot
// carry (NaN, infinities, values past bf16's range, tiny values), whose rows and columns are
// recomputed in fp32 and must come out as float64 has them.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "cpu_test_util.h"
#include "cuda_test_util.h"
#include "gemm_bf16x6.h"
#include "split.h"

namespace {

using gemmfuse::cuda::launch_fixup_exceptional;
using gemmfuse::cuda::launch_split_bf16x3;
using gemmfuse::cuda::RowMarks;
using gemmfuse::cuda::sm90::bf16x6_unfit;
using gemmfuse::cuda::sm90::Bf16x6Problem;
using gemmfuse::cuda::sm90::launch_bf16x6_gemm;
using gftest::DevMem;

#define SKIP_WITHOUT_SM90()                                                     \
  do {                                                                          \
    SKIP_WITHOUT_GPU();                                                         \
    if (!gftest::is_sm90()) GTEST_SKIP() << "the bf16x6 GEMM needs an sm_90 GPU";       \
    if (!gemmfuse::cuda::sm90::bf16x6_built()) GTEST_SKIP() << "not built";     \
  } while (0)

std::vector<float> uniform(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& e : v) e = d(rng);
  return v;
}

// Y = x W^T (+ b) as the executor runs it (executors/cuda/gemm_cublas.cu): W's parts and
// exceptional rows, x's, the kernel, the fix-up.
// `splits` as Bf16x6Problem's (0: the shape's choice).
std::vector<float> run_gemm(int64_t M, int64_t N, int64_t K, const std::vector<float>& x,
                            const std::vector<float>& w, const float* bias_host, int splits = 0) {
  DevMem dx(M * K * 4), dxp(M * K * 6), dxf(M * 4), dw(N * K * 4), dwp(N * K * 6),
      dwl((N + 1) * 4), db(N * 4), dy(M * N * 4), ws(size_t(32) << 20);
  CK(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  if (bias_host) CK(cudaMemcpy(db.p, bias_host, N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dwl.p, 0, 4));  // x's flags stay poisoned: the split writes every row's
  launch_split_bf16x3(static_cast<float*>(dx.p), M, K, static_cast<__nv_bfloat16*>(dxp.p),
                      RowMarks{static_cast<int*>(dxf.p), nullptr}, nullptr);
  launch_split_bf16x3(static_cast<float*>(dw.p), N, K, static_cast<__nv_bfloat16*>(dwp.p),
                      RowMarks{nullptr, static_cast<int*>(dwl.p)}, nullptr);
  Bf16x6Problem p;
  p.M = M;
  p.N = N;
  p.K = K;
  p.x_parts = static_cast<const __nv_bfloat16*>(dxp.p);
  p.w_parts = static_cast<const __nv_bfloat16*>(dwp.p);
  p.bias = bias_host ? static_cast<const float*>(db.p) : nullptr;
  p.y = static_cast<float*>(dy.p);
  p.splits = splits;
  EXPECT_TRUE(launch_bf16x6_gemm(p, ws.p, ws.bytes, nullptr));
  launch_fixup_exceptional(static_cast<float*>(dx.p), static_cast<float*>(dw.p), nullptr, p.bias, p.y, M,
                           N, K, static_cast<int*>(dxf.p), static_cast<int*>(dwl.p), nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<float> y(M * N);
  CK(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost));
  return y;
}

// Every element within the method's worst-case bound, in units of u = 2^-24 times
// sum_k |x w| (+ |b|): the split is exact and the three products left out are below
// 2^-9 2^-18 + 2^-18 2^-9 + 2^-18 2^-18 of each |x w| (1 u); per 64 of K the tensor core sums
// the large product in 4 steps, each losing at most ~2 u of the partial sum, and the small ones
// in 20 steps on a sum below 2^-7 of it (under 9 u; 16 u allowed, the bound of an earlier
// order's chains of 128); the chains add up in fp32 in K/32 steps (6K/128 allowed); the bias,
// 1. And the norm-wise error below sqrt(K) u / 4
// (SGEMM's is about sqrt(K) u / 3 at the seed shape: 1.6e-6 at K = 8192).
void check(int64_t M, int64_t N, int64_t K, bool with_bias, std::mt19937_64& rng, int splits = 0) {
  std::ostringstream what;
  what << "M=" << M << " N=" << N << " K=" << K << " bias=" << with_bias << " splits=" << splits;
  SCOPED_TRACE(what.str());
  if (splits == 0) ASSERT_EQ(bf16x6_unfit(M, N, K), nullptr);
  const auto x = uniform(M * K, rng), w = uniform(N * K, rng), b = uniform(N, rng);
  const std::vector<float> y = run_gemm(M, N, K, x, w, with_bias ? b.data() : nullptr, splits);
  const double u = std::ldexp(1.0, -24), n_round = 1 + 16 + 6.0 * K / 128 + 2;
  double err2 = 0, ref2 = 0;
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const auto [ref, mag] = gftest::dot_ref(x, w, with_bias ? &b[n] : nullptr, m, n, K);
      const double got = y[m * N + n];
      err2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
      if (!(std::fabs(got - ref) <= n_round * u * mag) && bad++ < 5)
        ADD_FAILURE() << "Y[" << m << ", " << n << "] = " << got << ", float64 " << ref
                      << " (bound " << n_round * u * mag << ")";
    }
  EXPECT_EQ(bad, 0);
  EXPECT_LE(std::sqrt(err2 / ref2), std::sqrt(static_cast<double>(K)) * u / 4);
}

TEST(CudaBf16x6Gemm, Domain) {
  EXPECT_NE(bf16x6_unfit(32, 128, 128), nullptr);   // few rows: the small-M kernel or SGEMM
  EXPECT_NE(bf16x6_unfit(256, 128, 132), nullptr);  // K % 8 != 0: bf16 rows off 16 bytes
  EXPECT_NE(bf16x6_unfit(256, 126, 128), nullptr);  // N % 4 != 0
  EXPECT_NE(bf16x6_unfit(256, 128, int64_t(1) << 31), nullptr);
  if (gftest::gpu_present() && gftest::is_sm90() && gemmfuse::cuda::sm90::bf16x6_built())
    EXPECT_EQ(bf16x6_unfit(256, 128, 128), nullptr);
  else
    EXPECT_NE(bf16x6_unfit(256, 128, 128), nullptr);
}

// The cost rule's choices on an H100 (132 SMs) against what was measured: session 20
// (scripts/fp32_path_sweep.py, Linear -> relu, bf16x6 against the SGEMM path, ms) and,
// marked 27, shapes the split-K kernel takes (bench/micro/bf16x6_probe.cu, the GEMM alone,
// kernel / SGEMM, ms; -s27-bf16x6-probe-staged.log).
TEST(CudaBf16x6Gemm, CostRule) {
  using gemmfuse::cuda::sm90::bf16x6_slower_than_sgemm;
  using gemmfuse::cuda::sm90::bf16x6_splits;
  const int sms = 132;
  // (M, N, K): the kernel where it was faster ...
  EXPECT_EQ(bf16x6_slower_than_sgemm(1024, 8192, 8192, sms), nullptr);  // the seed GEMM: 1.28 / 2.88
  EXPECT_EQ(bf16x6_slower_than_sgemm(256, 8192, 8192, sms), nullptr);   // 0.376 / 0.691
  EXPECT_EQ(bf16x6_slower_than_sgemm(256, 4096, 4096, sms), nullptr);   // 27: 0.091 / 0.195
  EXPECT_EQ(bf16x6_slower_than_sgemm(4096, 512, 512, sms), nullptr);    // 0.048 / 0.066
  EXPECT_EQ(bf16x6_slower_than_sgemm(4096, 8192, 256, sms), nullptr);   // 0.313 / 0.551
  EXPECT_EQ(bf16x6_slower_than_sgemm(128, 8192, 8192, sms), nullptr);   // 27: 0.186 / 0.383
  EXPECT_EQ(bf16x6_slower_than_sgemm(96, 8192, 8192, sms), nullptr);    // 27: 0.183 / 0.365
  EXPECT_EQ(bf16x6_slower_than_sgemm(128, 4096, 4096, sms), nullptr);   // 27: 0.072 / 0.122
  EXPECT_EQ(bf16x6_slower_than_sgemm(256, 2048, 2048, sms), nullptr);   // 27: 0.048 / 0.069
  EXPECT_EQ(bf16x6_slower_than_sgemm(1024, 256, 8192, sms), nullptr);   // 27: 0.092 / 0.112
  EXPECT_EQ(bf16x6_slower_than_sgemm(4096, 256, 8192, sms), nullptr);   // 27: 0.269 / 0.370
  EXPECT_EQ(bf16x6_slower_than_sgemm(64, 8192, 8192, sms), nullptr);    // 27: 0.179 / 0.208
  EXPECT_EQ(bf16x6_slower_than_sgemm(100, 16384, 8192, sms), nullptr);  // 27: 0.336 / 0.720 (split 2)
  // ... SGEMM where reading W's parts, the kernel's tiles leaving SMs idle or its fixed costs
  // dominate.
  EXPECT_NE(bf16x6_slower_than_sgemm(40, 8192, 8192, sms), nullptr);    // W's parts alone: 0.118 ms
  EXPECT_NE(bf16x6_slower_than_sgemm(256, 1024, 1024, sms), nullptr);   // 0.046 / 0.032
  EXPECT_NE(bf16x6_slower_than_sgemm(256, 256, 8192, sms), nullptr);    // 27: 0.067 / 0.050
  EXPECT_NE(bf16x6_slower_than_sgemm(4096, 256, 256, sms), nullptr);    // 0.047 / 0.027
  // Host-bound: the kernel's GPU time is the smaller, its host work the larger (0.87x eager).
  EXPECT_NE(bf16x6_slower_than_sgemm(256, 8192, 256, sms), nullptr);
  // Fewer SMs: the same tiles take more waves.
  EXPECT_NE(bf16x6_slower_than_sgemm(256, 4096, 4096, 16), nullptr);
  // The split-K kernel where the tiles fill less than half the SMs, one CTA per SM.
  EXPECT_EQ(bf16x6_splits(1024, 8192, sms), 1);
  EXPECT_EQ(bf16x6_splits(192, 8192, sms), 1);  // 128 tiles
  EXPECT_EQ(bf16x6_splits(128, 8192, sms), 2);  // 64 tiles
  EXPECT_EQ(bf16x6_splits(128, 4096, sms), 4);
  EXPECT_EQ(bf16x6_splits(100, 100, sms), 8);   // at most kBf16x6MaxSplits
  EXPECT_EQ(bf16x6_splits(100, 16384, sms), 2); // one row of 128 tiles: 2-CTA clusters would idle half
}

TEST(CudaBf16x6Gemm, AgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  check(256, 128, 128, true, rng);     // one 2-CTA cluster, 2 k-tiles
  check(300, 260, 1000, false, rng);   // M, N tails; K tail inside the last k-tile (16 k-tiles)
  check(384, 136, 8, true, rng);       // K below one k-tile
  check(256, 4, 1088, true, rng);      // N = 4; 17 k-tiles
  check(520, 200, 4160, true, rng);    // 65 k-tiles
}

// The split-K kernel: each tile's k-tiles (each all six products of one k-tile of K) cut into
// ranges of odd and even lengths, as many as there are k-tiles, summed through the workspace;
// the wide kernel on a shape with a single row of tiles.
TEST(CudaBf16x6Gemm, SplitKAgainstFloat64) {
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

// Values the split cannot carry (NaN, +-inf, past bf16's range, tiny) reach the outputs
// they touch as in float64 evaluated in fp32: NaN where it is NaN, the same infinity where it
// is one, finite values (the tiny ones' rows, recomputed in fp32) within fp32's error.
TEST(CudaBf16x6Gemm, ExceptionalInputs) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  const int64_t M = 256, N = 64, K = 96;
  auto x = uniform(M * K, rng), w = uniform(N * K, rng);
  for (float& v : x) v = std::fabs(v);  // x >= 0, so an infinite W entry keeps one sign
  x[3 * K + 5] = std::numeric_limits<float>::quiet_NaN();
  x[11 * K + 2] = std::numeric_limits<float>::infinity();
  x[12 * K + 2] = -std::numeric_limits<float>::infinity();
  x[13 * K + 7] = 3.4e38f;   // past bf16's largest finite value: Y overflows as in fp32
  x[14 * K + 7] = 1e-35f;    // tiny: its third part would be subnormal
  for (int64_t k = 0; k < K; ++k) x[15 * K + k] = 1e-36f * (1 + k % 3);  // a whole tiny row
  w[5 * K + 40] = std::numeric_limits<float>::infinity();
  w[9 * K + 2] = 0.5f;  // exact in bf16 (zero small parts) under an infinite x: must give inf
  std::vector<float> b(N, 0.25f);
  const std::vector<float> y = run_gemm(M, N, K, x, w, b.data());
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

}  // namespace

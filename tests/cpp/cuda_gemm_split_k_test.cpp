// `fast`'s GEMM on the split-K kernel (executors/cuda/sm90/gemm_split_k.h) against a float64
// reference, as the executor runs it: x and W split into bf16 hi + lo rows ([lo | hi | hi] and
// [hi | lo | hi], split.h), the kernel, the fp32 fix-up. Fresh random inputs per test (seed
// printed; GEMMFUSE_SEED=<n> repeats one), output poisoned with NaN. Shapes with M, N and K
// tails (K not a multiple of 8, so the segments are zero padded), promoted chunks of 2 and 1
// k-tiles, K below one k-tile, bias or none; and an exceptional row and column.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "cpu_test_util.h"
#include "cuda_test_util.h"
#include "gemm_bf16x6.h"
#include "gemm_split_k.h"
#include "split.h"

namespace {

using gemmfuse::cuda::HiLoOrder;
using gemmfuse::cuda::kFastSplitSegments;
using gemmfuse::cuda::launch_fixup_exceptional;
using gemmfuse::cuda::launch_split_hilo;
using gemmfuse::cuda::RowMarks;
using gemmfuse::cuda::sm90::fast_split_k_declines;
using gemmfuse::cuda::sm90::FastSplitProblem;
using gemmfuse::cuda::sm90::launch_fast_split_k;
using gftest::DevMem;

#define SKIP_WITHOUT_SM90()                                                          \
  do {                                                                               \
    SKIP_WITHOUT_GPU();                                                              \
    if (!gftest::is_sm90()) GTEST_SKIP() << "the split-K kernel needs an sm_90 GPU"; \
    if (!gemmfuse::cuda::sm90::bf16x6_built()) GTEST_SKIP() << "not built";          \
  } while (0)

std::vector<float> uniform(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& e : v) e = d(rng);
  return v;
}

std::vector<float> run_gemm(int64_t M, int64_t N, int64_t K, const std::vector<float>& x,
                            const std::vector<float>& w, const float* bias_host) {
  const int64_t Kh = (K + 7) / 8 * 8, S = kFastSplitSegments;
  DevMem dx(M * K * 4), dxs(M * S * Kh * 2), dxf(M * 4), dw(N * K * 4), dws(N * S * Kh * 2),
      dwl((N + 1) * 4), db(N * 4), dy(M * N * 4), ws(size_t(32) << 20);
  CK(cudaMemcpy(dx.p, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  if (bias_host) CK(cudaMemcpy(db.p, bias_host, N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dwl.p, 0, 4));
  launch_split_hilo(static_cast<float*>(dx.p), nullptr, M, K, Kh, HiLoOrder::LoHiHi,
                    static_cast<__nv_bfloat16*>(dxs.p), RowMarks{static_cast<int*>(dxf.p), nullptr}, nullptr);
  launch_split_hilo(static_cast<float*>(dw.p), nullptr, N, K, Kh, HiLoOrder::HiLoHi,
                    static_cast<__nv_bfloat16*>(dws.p), RowMarks{nullptr, static_cast<int*>(dwl.p)}, nullptr);
  FastSplitProblem p;
  p.M = M;
  p.N = N;
  p.Kh = Kh;
  p.x_split = static_cast<const __nv_bfloat16*>(dxs.p);
  p.w_split = static_cast<const __nv_bfloat16*>(dws.p);
  p.bias = bias_host ? static_cast<const float*>(db.p) : nullptr;
  p.y = static_cast<float*>(dy.p);
  EXPECT_TRUE(launch_fast_split_k(p, ws.p, ws.bytes, nullptr));
  launch_fixup_exceptional(static_cast<float*>(dx.p), static_cast<float*>(dw.p), nullptr, p.bias, p.y,
                           M, N, K, static_cast<int*>(dxf.p), static_cast<int*>(dwl.p), nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<float> y(M * N);
  CK(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost));
  return y;
}

// Every element within the method's bound, in units of u = 2^-24 times sum_k |x w| (+ |b|):
// hi + lo leaves at most 2^-18 of each value out (2 x 64 u per term, x's and W's), the
// product left out, xlo.wlo, is below 2^-18 of it (64 u); the tensor core sums a chunk of at
// most 128 of K in 8 steps, each losing at most ~2 u (16 u); the chunks add up in fp32 in
// 3K/128 steps; the bias, 1. And the norm-wise error below `fast`'s promise, 2e-5.
void check(int64_t M, int64_t N, int64_t K, bool with_bias, std::mt19937_64& rng) {
  std::ostringstream what;
  what << "M=" << M << " N=" << N << " K=" << K << " bias=" << with_bias;
  SCOPED_TRACE(what.str());
  ASSERT_EQ(fast_split_k_declines(M, N, (K + 7) / 8 * 8), nullptr);
  const auto x = uniform(M * K, rng), w = uniform(N * K, rng), b = uniform(N, rng);
  const std::vector<float> y = run_gemm(M, N, K, x, w, with_bias ? b.data() : nullptr);
  const double u = std::ldexp(1.0, -24), n_round = 3 * 64 + 16 + 3.0 * K / 128 + 2;
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
  EXPECT_LE(std::sqrt(err2 / ref2), 2e-5);
}

TEST(CudaFastSplitK, AgainstFloat64) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  check(128, 256, 1024, true, rng);   // 2 tiles, K' = 48 k-tiles in up to 8 ranges
  check(100, 260, 1001, false, rng);  // M, N tails; K padded to 1008 (16 k-tiles, the last partial)
  check(128, 4, 1088, true, rng);     // N = 4; 17 k-tiles per product: promoted every k-tile
  check(64, 136, 8, true, rng);       // K below one k-tile: 3 k-tiles in all
  check(77, 4096, 520, true, rng);    // 32 tiles
}

// A NaN in x, an infinity in W: their row and column are recomputed in fp32 as float64 has
// them; the rest stays within the bound above.
TEST(CudaFastSplitK, ExceptionalRowAndColumn) {
  SKIP_WITHOUT_SM90();
  std::mt19937_64 rng(gftest::test_seed());
  const int64_t M = 128, N = 256, K = 200;
  ASSERT_EQ(fast_split_k_declines(M, N, K), nullptr);
  auto x = uniform(M * K, rng), w = uniform(N * K, rng);
  for (float& v : x) v = std::fabs(v);  // x >= 0, so the infinite W entry keeps one sign
  x[5 * K + 3] = std::numeric_limits<float>::quiet_NaN();
  w[7 * K + 11] = std::numeric_limits<float>::infinity();
  const std::vector<float> y = run_gemm(M, N, K, x, w, nullptr);
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const auto [ref, mag] = gftest::dot_ref(x, w, nullptr, m, n, K);
      const float got = y[m * N + n];
      const bool ok = std::isnan(ref)   ? std::isnan(got)
                      : std::isinf(ref) ? got == static_cast<float>(ref)
                                        : std::fabs(got - ref) <= 300 * std::ldexp(1.0, -24) * mag;
      if (!ok && bad++ < 5) ADD_FAILURE() << "Y[" << m << ", " << n << "] = " << got << ", float64 " << ref;
    }
  EXPECT_EQ(bad, 0);
}

}  // namespace

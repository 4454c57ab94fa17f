// The fp32 GEMM for a few rows (executors/cuda/gemm/gemm_small_m.cu) against a float64 reference:
// fresh random inputs per test (seed printed; GEMMFUSE_SEED=<n> repeats one), output and
// scratch poisoned with NaN, every element within the worst-case error bound of its
// summation chain. Shapes cover each row template (M = 1 .. 32), N and K tails, x read in
// place and through shifted copies (K % 4 != 0, x or W off a 16-byte boundary: every W shift
// and every number of copies), and the K-split path with and without room for all its splits.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <vector>

#include "cpu_test_util.h"
#include "cuda_test_util.h"
#include "gemm_small_m.h"

namespace {

using gemmfuse::cuda::launch_small_m_gemm;
using gemmfuse::cuda::small_m_gemm_fits;
using gftest::DevMem;

std::vector<float> uniform(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> d(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& e : v) e = d(rng);
  return v;
}

void upload(DevMem& m, const std::vector<float>& v) {
  CK(cudaMemcpy(m.p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
}

// Y = x W^T + b on the GPU, checked against float64: |y - ref| <= n u sum_k |x w| (+ |b|),
// n bounding the roundings on one output's path (its lane's chain of at most K/32 sums of
// 4 products, the warp's 5-level tree, the split sums, the bias). x_offset, w_offset:
// x and W start that many elements past a 16-byte boundary. DevMem fills with NaN: the
// elements before W and the 4 after it are NaN, so a load outside W's rows would show.
void check(int64_t M, int64_t N, int64_t K, bool with_bias, size_t scratch_bytes,
           std::mt19937_64& rng, int x_offset = 0, int w_offset = 0) {
  std::ostringstream what;
  what << "M=" << M << " N=" << N << " K=" << K << " bias=" << with_bias
       << " scratch=" << scratch_bytes << " offsets=" << x_offset << "," << w_offset;
  SCOPED_TRACE(what.str());
  const auto x = uniform(M * K, rng), w = uniform(N * K, rng), b = uniform(N, rng);
  DevMem dx((x.size() + x_offset) * 4), dw((w.size() + w_offset + 4) * 4), db(b.size() * 4),
      dy(M * N * 4), scratch(scratch_bytes);
  float* xp = static_cast<float*>(dx.p) + x_offset;
  float* wp = static_cast<float*>(dw.p) + w_offset;
  CK(cudaMemcpy(xp, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(wp, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  upload(db, b);
  ASSERT_TRUE(small_m_gemm_fits(M, N, K, xp, wp, scratch_bytes));
  launch_small_m_gemm(xp, wp, with_bias ? static_cast<const float*>(db.p) : nullptr,
                      static_cast<float*>(dy.p), M, N, K, scratch.p, scratch_bytes, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<float> y(M * N);
  CK(cudaMemcpy(y.data(), dy.p, y.size() * 4, cudaMemcpyDeviceToHost));

  const double u = std::ldexp(1.0, -24), n_round = static_cast<double>(K) / 32 + 24;
  int bad = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const auto [ref, mag] = gftest::dot_ref(x, w, with_bias ? &b[n] : nullptr, m, n, K);
      const double got = y[m * N + n];
      if (!(std::fabs(got - ref) <= n_round * u * mag) && bad++ < 5)
        ADD_FAILURE() << "Y[" << m << ", " << n << "] = " << got << ", float64 " << ref
                      << " (bound " << n_round * u * mag << ")";
    }
  EXPECT_EQ(bad, 0);
}

TEST(CudaSmallMGemm, Domain) {
  alignas(16) static float buf[8];
  const size_t room = size_t(32) << 20;
  EXPECT_TRUE(small_m_gemm_fits(32, 3, 4, buf, buf, 0));  // aligned rows: x in place
  EXPECT_TRUE(small_m_gemm_fits(1, 1, 1, buf, buf, room));
  EXPECT_TRUE(small_m_gemm_fits(17, 3, 6, buf + 1, buf + 2, room));  // shifted copies of x
  EXPECT_FALSE(small_m_gemm_fits(17, 3, 6, buf, buf, 0));  // ... which need scratch
  // x unaligned, W rows aligned: one copy of x, 17 rows of K floats, in 256-byte units.
  EXPECT_FALSE(small_m_gemm_fits(17, 3, 8, buf + 1, buf, 767));
  EXPECT_TRUE(small_m_gemm_fits(17, 3, 8, buf + 1, buf, 768));
  // W one element off: rows at shift 1, one copy of 12 (K + 3 rounded up to 4) floats a row.
  EXPECT_FALSE(small_m_gemm_fits(17, 3, 8, buf, buf + 1, 1023));
  EXPECT_TRUE(small_m_gemm_fits(17, 3, 8, buf, buf + 1, 1024));
  EXPECT_FALSE(small_m_gemm_fits(4, 3, 8, reinterpret_cast<char*>(buf) + 2, buf, room));
  EXPECT_FALSE(small_m_gemm_fits(33, 3, 4, buf, buf, room));  // too many rows: cuBLASLt
  EXPECT_FALSE(small_m_gemm_fits(0, 3, 4, buf, buf, room));   // empty batch: nothing to launch
  EXPECT_FALSE(small_m_gemm_fits(4, 0, 4, buf, buf, room));
  EXPECT_FALSE(small_m_gemm_fits(4, 3, 0, buf, buf, room));   // K = 0: Y = bias, done by the caller
  EXPECT_FALSE(small_m_gemm_fits(4, 3, gemmfuse::cuda::kSmallMMaxK + 1, buf, buf, room));
}

TEST(CudaSmallMGemm, EveryRowCountAgainstFloat64) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  const size_t room = size_t(32) << 20;
  for (int64_t M : {1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32}) {
    check(M, 37, 1000, true, room, rng);   // N tail inside one CTA, K tail inside a warp
    check(M, 300, 12, false, room, rng);   // K shorter than a warp's first load
    check(M, 70, 1001, true, room, rng);   // K % 4 == 1: W rows at every shift, 4 copies
    check(M, 70, 1002, true, room, rng, 0, 1);  // K % 4 == 2, W off by one: shifts 1 and 3
    check(M, 70, 1000, true, room, rng, 1, 0);  // x off a 16-byte boundary: one copy
    check(M, 70, 1000, false, room, rng, 0, 3);  // W off a 16-byte boundary: one copy, shift 3
    check(M, 5, 3, true, room, rng, 2, 3);  // every row inside one partial chunk
  }
}

TEST(CudaSmallMGemm, SplitKAgainstFloat64) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(gftest::test_seed());
  check(16, 37, 8192, true, size_t(32) << 20, rng);  // 1 CTA along N: K split 16 ways
  check(7, 37, 8192, true, 3 * 4 * 7 * 37, rng);     // room for 3 splits only
  check(16, 4100, 2048, false, size_t(32) << 20, rng);  // 65 CTAs along N: 2 splits
  check(1, 5, 4, true, 0, rng);                       // no scratch at all
  check(9, 37, 5000, true, size_t(32) << 20, rng, 2, 1);  // copies, split, masked tail
  check(30, 37, 4100, true, size_t(32) << 20, rng);  // 4 lane groups, split, masked tail
  check(30, 37, 4099, true, size_t(32) << 20, rng, 1, 2);  // ... with 4 shifted copies
  // Copies and split partials share the scratch: room for the copies and 2 splits.
  check(20, 37, 4099, false, 4 * ((20 * 4104 * 4 + 255) / 256 * 256) + 2 * 4 * 20 * 37, rng);
}

}  // namespace

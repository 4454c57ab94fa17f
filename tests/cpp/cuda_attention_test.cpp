// fp32 attention on split fp16 products (executors/cuda/attention/attention_f16x3.h) against a
// float64 reference: fresh random Q, K, V per test (seed printed; GEMMFUSE_SEED=<n> repeats
// one), output and LSE poisoned with NaN, S not a multiple of the 64-row tiles, D = 64 and
// 128, causal or not. The norm-wise error must stay within 1.5x a plain fp32 computation's
// (the same formulas in float on the host) and every element within 1e-5 of the output's
// largest magnitude.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "attention_f16x3.h"
#include "cuda_test_util.h"

namespace {

using gemmfuse::cuda::AttentionF16x3;
using gftest::DevMem;

uint64_t seed_for(const char* what) {
  const char* env = std::getenv("GEMMFUSE_SEED");
  const uint64_t s = env ? std::strtoull(env, nullptr, 10) : std::random_device{}();
  std::printf("[ seed     ] %s: GEMMFUSE_SEED=%llu\n", what, static_cast<unsigned long long>(s));
  return s;
}

// softmax(q kᵀ scale [+ causal]) v for one head in T (double: the reference; float: what a
// plain fp32 computation gives), and each row's log-sum-exp.
template <class T>
void reference(const float* q, const float* k, const float* v, int64_t S, int D, double scale,
               bool causal, std::vector<T>& o, std::vector<T>& lse) {
  o.assign(S * D, T(0));
  lse.assign(S, T(0));
  std::vector<T> s(S);
  for (int64_t i = 0; i < S; ++i) {
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < S; ++j) {
      T dot = 0;
      for (int d = 0; d < D; ++d) dot += T(q[i * D + d]) * T(k[j * D + d]);
      s[j] = (causal && j > i) ? -std::numeric_limits<T>::infinity() : dot * T(scale);
      m = std::max(m, s[j]);
    }
    T l = 0;
    for (int64_t j = 0; j < S; ++j) l += (s[j] = std::exp(s[j] - m));
    for (int64_t j = 0; j < S; ++j)
      for (int d = 0; d < D; ++d) o[i * D + d] += s[j] / l * T(v[j * D + d]);
    lse[i] = m + std::log(l);
  }
}

void check(int64_t BH, int64_t S, int D, bool causal) {
  std::mt19937_64 rng(seed_for("attention"));
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t n = BH * S * D;
  std::vector<float> q(n), k(n), v(n);
  for (auto* t : {&q, &k, &v})
    for (float& e : *t) e = nd(rng);
  DevMem dq(n * 4), dk(n * 4), dv(n * 4), dout(n * 4), dlse(BH * S * 4),
      ws(gemmfuse::cuda::attention_f16x3_workspace_bytes(BH, S, D));
  CK(cudaMemcpy(dq.p, q.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk.p, k.data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv.p, v.data(), n * 4, cudaMemcpyHostToDevice));
  AttentionF16x3 a;
  a.BH = BH, a.S = S, a.D = D, a.causal = causal, a.scale = 1.f / std::sqrt(float(D));
  a.q = static_cast<float*>(dq.p), a.k = static_cast<float*>(dk.p), a.v = static_cast<float*>(dv.p);
  a.o = static_cast<float*>(dout.p), a.lse = static_cast<float*>(dlse.p), a.workspace = ws.p;
  gemmfuse::cuda::launch_attention_f16x3(a, nullptr);
  CK(cudaDeviceSynchronize());
  std::vector<float> o(n), lse(BH * S);
  CK(cudaMemcpy(o.data(), dout.p, n * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(lse.data(), dlse.p, BH * S * 4, cudaMemcpyDeviceToHost));

  double err = 0, err32 = 0, norm = 0, amax = 0, worst = 0, lse_worst = 0;
  for (int64_t h = 0; h < BH; ++h) {
    const int64_t off = h * S * D;
    std::vector<double> want, want_lse;
    std::vector<float> f32, f32_lse;
    reference(&q[off], &k[off], &v[off], S, D, a.scale, causal, want, want_lse);
    reference(&q[off], &k[off], &v[off], S, D, a.scale, causal, f32, f32_lse);
    for (int64_t i = 0; i < S * D; ++i) {
      const double got = o[off + i], d = got - want[i], d32 = f32[i] - want[i];
      ASSERT_TRUE(std::isfinite(got)) << "head " << h << " element " << i;
      err += d * d, err32 += d32 * d32, norm += want[i] * want[i];
      amax = std::max(amax, std::fabs(want[i]));
      worst = std::max(worst, std::fabs(d));
    }
    for (int64_t i = 0; i < S; ++i)
      lse_worst = std::max(lse_worst, std::fabs(lse[h * S + i] - want_lse[i]));
  }
  const double rel = std::sqrt(err / norm), rel32 = std::sqrt(err32 / norm);
  EXPECT_LE(rel, 1.5 * rel32 + 1e-7) << "f16x3 " << rel << ", plain fp32 " << rel32;
  EXPECT_LE(worst, 1e-5 * amax);
  EXPECT_LE(lse_worst, 1e-5);
}

#define SKIP_WITHOUT_SM80()                                                                 \
  do {                                                                                     \
    SKIP_WITHOUT_GPU();                                                                    \
    int dev = 0, major = 0;                                                                \
    CK(cudaGetDevice(&dev));                                                               \
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));            \
    if (major < 8) GTEST_SKIP() << "mma.sync m16n8k16 with fp32 accumulation needs sm_80+"; \
  } while (0)

TEST(CudaAttention, FullAgainstFloat64) {
  SKIP_WITHOUT_SM80();
  check(3, 100, 64, false);
  check(2, 130, 128, false);
}

TEST(CudaAttention, CausalAgainstFloat64) {
  SKIP_WITHOUT_SM80();
  check(3, 100, 64, true);
  check(2, 193, 128, true);
}

TEST(CudaAttention, OneTileAndManyTiles) {
  SKIP_WITHOUT_SM80();
  check(1, 64, 64, false);
  check(1, 1, 64, true);
  check(2, 512, 64, true);
}

}  // namespace

// fp32 attention with NaN and infinities in Q, K, V, dO (attention_nonfinite.h): the heads that
// hold one come out as PyTorch's math path gives them (scores plus the mask's 0 or −inf, a
// NaN-propagating softmax, P V over every key; the backward's dS = P (dO·V − dO·O)), NaN where
// it is NaN and the same infinities; the finite values within 1e-5 of the head's largest
// magnitude. So do finite heads whose magnitudes lie outside the split kernels' exponent range.
// A head with finite inputs beside them keeps the split kernels' result.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "attention_f16x3.h"
#include "cpu_test_util.h"
#include "cuda_test_util.h"

namespace {

using gftest::DevMem;
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Head {
  const float *q, *k, *v, *go;
  int64_t S;
  int D;
  double scale;
  bool causal;
  double score(int64_t i, int64_t j) const {
    double s = 0;
    for (int d = 0; d < D; ++d) s += double(q[i * D + d]) * k[j * D + d];
    return s * scale + (causal && j > i ? -kInf : 0.0);
  }
  double dot(const float* x, int64_t i, const float* y, int64_t j) const {
    double s = 0;
    for (int d = 0; d < D; ++d) s += double(x[i * D + d]) * y[j * D + d];
    return s;
  }
};

// The math path's O and LSE of one head, in double.
void forward(const Head& h, std::vector<double>& o, std::vector<double>& lse) {
  o.assign(h.S * h.D, 0.0), lse.assign(h.S, 0.0);
  for (int64_t i = 0; i < h.S; ++i) {
    double m = -kInf, l = 0;
    for (int64_t j = 0; j < h.S; ++j) {
      const double s = h.score(i, j);
      m = (std::isnan(m) || std::isnan(s)) ? NAN : std::max(m, s);
    }
    for (int64_t j = 0; j < h.S; ++j) {
      const double p = std::exp(h.score(i, j) - m);
      l += p;
      for (int d = 0; d < h.D; ++d) o[i * h.D + d] += p * h.v[j * h.D + d];
    }
    for (int d = 0; d < h.D; ++d) o[i * h.D + d] /= l;
    lse[i] = m + std::log(l);
  }
}

// dQ, dK, dV of one head from O and LSE (float, as the kernels read them), in double.
void backward(const Head& h, const float* o, const float* lse, std::vector<double> (&g)[3]) {
  for (auto& x : g) x.assign(h.S * h.D, 0.0);
  for (int64_t i = 0; i < h.S; ++i)
    for (int64_t j = 0; j < h.S; ++j) {
      const double p = std::exp(h.score(i, j) - lse[i]);
      const double ds = p * (h.dot(h.go, i, h.v, j) - h.dot(h.go, i, o, i));
      for (int d = 0; d < h.D; ++d) {
        g[0][i * h.D + d] += ds * h.k[j * h.D + d] * h.scale;
        g[1][j * h.D + d] += ds * h.q[i * h.D + d] * h.scale;
        g[2][j * h.D + d] += p * h.go[i * h.D + d];
      }
    }
}

// NaN where want is NaN, the same infinity where it is one, else within tol of it.
void expect_as(const float* got, const std::vector<double>& want, double tol, const char* what) {
  int bad = 0;
  for (size_t i = 0; i < want.size() && bad < 5; ++i) {
    const double w = want[i], g = got[i];
    const bool ok = std::isnan(w) ? std::isnan(g) : std::isinf(w) ? g == w
                                                                  : std::fabs(g - w) <= tol;
    if (!ok) ++bad, ADD_FAILURE() << what << " element " << i << ": got " << g << ", want " << w;
  }
}

double finite_amax(const std::vector<double>& x) {
  double m = 0;
  for (double e : x)
    if (std::isfinite(e)) m = std::max(m, std::fabs(e));
  return m;
}

struct Problem {
  int64_t BH, S;
  int D;
  bool causal;
  std::vector<float> q, k, v, go;
  Problem(int64_t bh, int64_t s, int d, bool c) : BH(bh), S(s), D(d), causal(c) {
    std::mt19937_64 rng(gftest::test_seed());
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto* t : {&q, &k, &v, &go}) {
      t->resize(BH * S * D);
      for (float& e : *t) e = nd(rng);
    }
    // Head 0 stays finite; 1: +inf in a key; 2: -inf in a query and NaN in a value;
    // 3: +inf in a value (masked keys' p = 0 make NaN under the causal mask); 4: NaN in dO.
    const int64_t n = S * D;
    k[1 * n + 10 * D + 7] = INFINITY;
    q[2 * n + 30 * D + 3] = -INFINITY, v[2 * n + 50 * D + 1] = NAN;
    v[3 * n + 20 * D + 5] = INFINITY;
    go[4 * n + 40 * D + 2] = NAN;
    // Finite heads whose magnitudes lie outside the split kernels' exponent range
    // (kMaxSplitExp), where an unguarded kernel's powers of two leave a float's range: 5: Q x
    // 2^-120; 6: K x 2^-120; 7: V x 2^120 (dS's bound 2 D max|dO| max|V| overflows); 8: dO x
    // 2^-120.
    if (BH > 8) {
      const std::pair<std::vector<float>*, float> scaled[4] = {
          {&q, 0x1p-120f}, {&k, 0x1p-120f}, {&v, 0x1p120f}, {&go, 0x1p-120f}};
      for (int i = 0; i < 4; ++i)
        for (int64_t j = 0; j < n; ++j) (*scaled[i].first)[(5 + i) * n + j] *= scaled[i].second;
    }
  }
  Head head(int64_t h) const {
    const int64_t off = h * S * D;
    return {&q[off], &k[off], &v[off], &go[off], S, D, 1.0 / std::sqrt(double(D)), causal};
  }
};

std::vector<float> to_host(const DevMem& m, size_t n) {
  std::vector<float> x(n);
  CK(cudaMemcpy(x.data(), m.p, n * 4, cudaMemcpyDeviceToHost));
  return x;
}

void check_forward(int D, bool causal) {
  const Problem pb(9, 70, D, causal);
  const int64_t n = pb.BH * pb.S * D;
  DevMem dq(n * 4), dk(n * 4), dv(n * 4), dout(n * 4), dlse(pb.BH * pb.S * 4),
      ws(gemmfuse::cuda::attention_f16x3_workspace_bytes(pb.BH, pb.S, pb.S, D));
  for (auto [dst, src] : {std::pair{&dq, &pb.q}, {&dk, &pb.k}, {&dv, &pb.v}})
    CK(cudaMemcpy(dst->p, src->data(), n * 4, cudaMemcpyHostToDevice));
  gemmfuse::cuda::AttentionF16x3 a;
  a.BH = pb.BH, a.Sq = pb.S, a.Sk = pb.S, a.D = D, a.causal = causal;
  a.scale = 1.f / std::sqrt(float(D));
  a.q = static_cast<float*>(dq.p), a.k = static_cast<float*>(dk.p), a.v = static_cast<float*>(dv.p);
  a.o = static_cast<float*>(dout.p), a.lse = static_cast<float*>(dlse.p), a.workspace = ws.p;
  gemmfuse::cuda::launch_attention_f16x3(a, nullptr);
  CK(cudaDeviceSynchronize());
  const auto o = to_host(dout, n), lse = to_host(dlse, pb.BH * pb.S);
  for (int64_t h = 0; h < pb.BH; ++h) {
    std::vector<double> want, want_lse;
    forward(pb.head(h), want, want_lse);
    SCOPED_TRACE("head " + std::to_string(h));
    expect_as(&o[h * pb.S * D], want, 1e-5 * finite_amax(want), "O");
    expect_as(&lse[h * pb.S], want_lse, 1e-5 * finite_amax(want_lse) + 1e-5, "LSE");
  }
}

void check_backward(int D, bool causal) {
  const Problem pb(9, 70, D, causal);
  const int64_t n = pb.BH * pb.S * D;
  std::vector<float> o(n), lse(pb.BH * pb.S);
  for (int64_t h = 0; h < pb.BH; ++h) {
    std::vector<double> oh, lh;
    forward(pb.head(h), oh, lh);
    for (int64_t i = 0; i < pb.S * D; ++i) o[h * pb.S * D + i] = static_cast<float>(oh[i]);
    for (int64_t i = 0; i < pb.S; ++i) lse[h * pb.S + i] = static_cast<float>(lh[i]);
  }
  DevMem dq_(n * 4), dk_(n * 4), dv_(n * 4), dgo(n * 4), dout(n * 4), dlse(pb.BH * pb.S * 4),
      g[3] = {DevMem(n * 4), DevMem(n * 4), DevMem(n * 4)},
      ws(gemmfuse::cuda::attention_f16x3_backward_workspace_bytes(pb.BH, pb.S, pb.S, D));
  for (auto [dst, src] : {std::pair{&dq_, &pb.q}, {&dk_, &pb.k}, {&dv_, &pb.v}, {&dgo, &pb.go},
                          {&dout, static_cast<const std::vector<float>*>(&o)}})
    CK(cudaMemcpy(dst->p, src->data(), n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dlse.p, lse.data(), pb.BH * pb.S * 4, cudaMemcpyHostToDevice));
  gemmfuse::cuda::AttentionF16x3Backward a;
  a.BH = pb.BH, a.Sq = pb.S, a.Sk = pb.S, a.D = D, a.causal = causal;
  a.scale = 1.f / std::sqrt(float(D));
  a.q = static_cast<float*>(dq_.p), a.k = static_cast<float*>(dk_.p), a.v = static_cast<float*>(dv_.p);
  a.o = static_cast<float*>(dout.p), a.dout = static_cast<float*>(dgo.p);
  a.lse = static_cast<float*>(dlse.p), a.lse_stride = pb.S, a.workspace = ws.p;
  a.dq = static_cast<float*>(g[0].p), a.dk = static_cast<float*>(g[1].p), a.dv = static_cast<float*>(g[2].p);
  gemmfuse::cuda::launch_attention_f16x3_backward(a, nullptr);
  CK(cudaDeviceSynchronize());
  const char* names[3] = {"dQ", "dK", "dV"};
  for (int64_t h = 1; h < pb.BH; ++h) {  // head 0 is BackwardAgainstFloat64's case
    std::vector<double> want[3];
    backward(pb.head(h), &o[h * pb.S * D], &lse[h * pb.S], want);
    SCOPED_TRACE("head " + std::to_string(h));
    for (int i = 0; i < 3; ++i)
      expect_as(&to_host(g[i], n)[h * pb.S * D], want[i], 1e-5 * finite_amax(want[i]), names[i]);
  }
}

TEST(CudaAttentionNonFinite, ForwardAsTheMathPath) {
  SKIP_WITHOUT_SM80();
  check_forward(64, false);
  check_forward(64, true);
  check_forward(128, true);
}

TEST(CudaAttentionNonFinite, BackwardAsTheMathPath) {
  SKIP_WITHOUT_SM80();
  check_backward(64, false);
  check_backward(64, true);
  check_backward(96, true);
}

}  // namespace

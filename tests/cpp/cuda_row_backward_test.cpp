// The CUDA row stage of the backward (backward_stages.h's backward_rows: the row backward by
// segments, its slot sinks and their column sums) against float64, for the seed models' row
// chains at small shapes: m99's gelu -> softmax; m94's add (a column operand) -> clamp -> mish
// -> GroupNorm (its groups by warps, by 8 lanes, and by the CTA where they are few); m22's scalings, clamp,
// logsumexp and x * mish(x) (a value read twice); m84's training BatchNorm (two segments cut
// at its column sums) -> a scalar operand -> softmax. More rows than
// slots, so each CTA's scratch and sink rows are reused; widths that are not multiples of the
// CTA's 256 threads. dV and every operand's gradient are checked; fresh random values per run
// (seed printed), outputs poisoned. Runs on a GPU and, through tools/kernel_emu, on the CPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backward_layout.h"
#include "backward_stages.h"
#include "cpu_test_util.h"
#include "cuda_test_util.h"
#include "gemmfuse/backward.h"
#include "gemmfuse/plan.h"

namespace {

using namespace gemmfuse;
using namespace gemmfuse::cuda;
using gftest::DevMem;

constexpr int64_t kRows = 11, kSlots = 4;

// A training plan of the stages after a Linear to N columns; operand t<i> holds widths[i] values.
Plan training_plan(const std::string& stages, int64_t N, const std::vector<int64_t>& widths) {
  PlanRequest r;
  r.chain = parse_chain("linear in=16 out=" + std::to_string(N) + " bias=1\n" + stages);
  r.batch_sizes = {kRows};
  for (int64_t w : widths) r.operand_sizes.push_back({w});
  r.dtype = DType::F32;
  r.precision = Precision::FP32;
  r.device = Device::CUDA;
  r.for_training = true;
  return make_plan(r);
}

void upload(const std::vector<float>& host, DevMem& dev) {
  CK(cudaMemcpy(dev.p, host.data(), 4 * host.size(), cudaMemcpyHostToDevice));
}

std::vector<float> from_device(const void* p, size_t n) {
  std::vector<float> h(n);
  CK(cudaMemcpy(h.data(), p, 4 * n, cudaMemcpyDeviceToHost));
  return h;
}

// ||got - ref|| / ||ref|| (NaN anywhere fails).
double rel_err(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// The row stage's outputs for V (the GEMM's value, [kRows, N]) and the output's gradient g:
// dV, then each operand's gradient.
struct RowStage {
  std::vector<float> dv;
  std::vector<std::vector<float>> grads;
};

// The saved batch statistics a plan's BatchNorms read ([3, w]: mean, invstd, biased var), from
// their input, here V itself (m84's BatchNorm comes first).
using SavedStats = std::vector<float>;

RowStage run_row_stage(const Plan& p, const std::vector<float>& v, const std::vector<float>& g,
                       const std::vector<std::vector<float>>& operands, const SavedStats& stats = {},
                       int group_norm_lanes = 32) {
  const BackwardPlan bp = make_backward_plan(p);
  BackwardChoice choice;
  choice.present = true;
  choice.rows = RowBackwardMode::Segments;
  choice.slots = kSlots;
  choice.group_norm_lanes = group_norm_lanes;
  const BackwardLayout L = backward_layout(p, bp, choice);
  const int64_t N = p.N;
  DevMem saved(4 * bp.saved.total), grad_out(4 * g.size()), ws(L.total);
  std::vector<float> saved_h(bp.saved.total, 0.f);
  std::copy(v.begin(), v.end(), saved_h.begin() + bp.saved.v);
  for (const auto& [node, off] : bp.saved.batch_stats) std::copy(stats.begin(), stats.end(), saved_h.begin() + off);
  upload(saved_h, saved);
  upload(g, grad_out);
  std::vector<std::unique_ptr<DevMem>> ops, grads;
  BackwardArgs a;
  a.grad_out = grad_out.p;
  a.saved = static_cast<const float*>(saved.p);
  for (const auto& o : operands) {
    ops.push_back(std::make_unique<DevMem>(4 * o.size()));
    grads.push_back(std::make_unique<DevMem>(4 * o.size()));
    upload(o, *ops.back());
    a.operands.push_back(static_cast<const float*>(ops.back()->p));
    a.operand_numel.push_back(static_cast<int64_t>(o.size()));
    a.grad_operands.push_back(static_cast<float*>(grads.back()->p));
  }
  backward_rows(BackwardCall{p, bp, choice, L, a, static_cast<char*>(ws.p), nullptr});
  CK(cudaDeviceSynchronize());
  RowStage out{from_device(static_cast<char*>(ws.p) + L.dv, kRows * N), {}};
  for (size_t t = 0; t < operands.size(); ++t) out.grads.push_back(from_device(grads[t]->p, operands[t].size()));
  return out;
}

std::vector<float> normal(size_t n, double scale, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.f, static_cast<float>(scale));
  std::vector<float> v(n);
  for (float& e : v) e = d(rng);
  return v;
}

// gelu (erf form) -> softmax: dV in float64.
std::vector<double> gelu_softmax_grad(const std::vector<float>& v, const std::vector<float>& g, int64_t N) {
  std::vector<double> dv(v.size());
  for (int64_t r = 0; r < kRows; ++r) {
    std::vector<double> x(N), y(N);
    double top = -INFINITY, sum = 0, gy = 0;
    for (int64_t c = 0; c < N; ++c) {
      x[c] = v[r * N + c];
      y[c] = 0.5 * x[c] * (1 + std::erf(x[c] / std::sqrt(2.0)));
      top = std::max(top, y[c]);
    }
    for (int64_t c = 0; c < N; ++c) sum += (y[c] = std::exp(y[c] - top));
    for (int64_t c = 0; c < N; ++c) gy += g[r * N + c] * (y[c] /= sum);
    for (int64_t c = 0; c < N; ++c) {
      const double pdf = std::exp(-0.5 * x[c] * x[c]) / std::sqrt(2 * M_PI);
      const double cdf = 0.5 * (1 + std::erf(x[c] / std::sqrt(2.0)));
      dv[r * N + c] = y[c] * (g[r * N + c] - gy) * (cdf + x[c] * pdf);
    }
  }
  return dv;
}

TEST(CudaRowBackward, GeluSoftmaxAgainstFloat64) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gftest::test_seed();
  std::mt19937_64 rng(seed);
  for (int64_t N : {300, 1000}) {
    const Plan p = training_plan("gelu\nsoftmax\n", N, {});
    const auto v = normal(kRows * N, 2.0, rng), g = normal(kRows * N, 1.0, rng);
    const RowStage got = run_row_stage(p, v, g, {});
    EXPECT_LT(rel_err(got.dv, gelu_softmax_grad(v, g, N)), 1e-5) << "N " << N << ", seed " << seed;
  }
}

// add b -> clamp(-1, 1) -> mish -> GroupNorm(groups, gamma, beta), in float64: dV, then the
// gradients of b, gamma and beta.
struct M94Grads {
  std::vector<double> dv, db, dgamma, dbeta;
};

M94Grads m94_grads(const std::vector<float>& v, const std::vector<float>& g, const std::vector<float>& b,
                   const std::vector<float>& gamma, int64_t N, int groups) {
  const double eps = 1e-5;
  const int64_t gs = N / groups;
  M94Grads d{std::vector<double>(v.size()), std::vector<double>(N), std::vector<double>(N), std::vector<double>(N)};
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t q = 0; q < groups; ++q) {
      std::vector<double> pre(gs), m(gs), xh(gs), dxh(gs);
      double mean = 0, var = 0, mdxh = 0, mdxhx = 0;
      for (int64_t k = 0; k < gs; ++k) {
        const int64_t c = q * gs + k;
        pre[k] = static_cast<double>(v[r * N + c]) + b[c];
        const double h = std::min(1.0, std::max(-1.0, pre[k]));
        m[k] = h * std::tanh(std::log1p(std::exp(h)));
        mean += m[k] / gs;
      }
      for (int64_t k = 0; k < gs; ++k) var += (m[k] - mean) * (m[k] - mean) / gs;
      const double inv = 1 / std::sqrt(var + eps);
      for (int64_t k = 0; k < gs; ++k) {
        const int64_t c = q * gs + k;
        xh[k] = (m[k] - mean) * inv;
        const double gc = g[r * N + c];
        d.dgamma[c] += gc * xh[k];
        d.dbeta[c] += gc;
        dxh[k] = gc * gamma[c];
        mdxh += dxh[k] / gs;
        mdxhx += dxh[k] * xh[k] / gs;
      }
      for (int64_t k = 0; k < gs; ++k) {
        const int64_t c = q * gs + k;
        const double dm = inv * (dxh[k] - mdxh - xh[k] * mdxhx);
        const double h = std::min(1.0, std::max(-1.0, pre[k])), sp = std::log1p(std::exp(h)), t = std::tanh(sp);
        const double dh = dm * (t + h * (1 - t * t) / (1 + std::exp(-h)));
        const double dpre = (pre[k] >= -1 && pre[k] <= 1) ? dh : 0;
        d.dv[r * N + c] = dpre;
        d.db[c] += dpre;
      }
    }
  return d;
}

TEST(CudaRowBackward, M94ChainAgainstFloat64) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gftest::test_seed();
  std::mt19937_64 rng(seed);
  // Groups of 10 (300 / 30), 32 (320 / 10: fewer than a round of four a warp) and 16 (640 / 40:
  // a second round, part idle), by a warp or by 8 lanes each; 3 of 100 (300 / 3: by the CTA
  // either way).
  struct Case {
    int64_t N;
    int groups, lanes;
  };
  for (const Case k : {Case{300, 30, 32}, Case{300, 30, 8}, Case{320, 10, 32}, Case{320, 10, 8}, Case{640, 40, 8},
                       Case{300, 3, 8}}) {
    const int64_t N = k.N;
    const int groups = k.groups;
    const Plan p = training_plan("add b=t0\nclamp lo=-1 hi=1\nmish\ngroup_norm groups=" + std::to_string(groups) +
                                     " weight=t1 bias=t2\n",
                                 N, {N, N, N});
    const auto v = normal(kRows * N, 1.5, rng), g = normal(kRows * N, 1.0, rng);
    const auto b = normal(N, 0.5, rng), gamma = normal(N, 1.0, rng), beta = normal(N, 1.0, rng);
    const RowStage got = run_row_stage(p, v, g, {b, gamma, beta}, {}, k.lanes);
    const M94Grads ref = m94_grads(v, g, b, gamma, N, groups);
    const std::string at = "N " + std::to_string(N) + ", groups " + std::to_string(groups) + ", lanes " +
                           std::to_string(k.lanes) + ", seed " + std::to_string(seed);
    EXPECT_LT(rel_err(got.dv, ref.dv), 1e-5) << "dV, " << at;
    EXPECT_LT(rel_err(got.grads[0], ref.db), 1e-5) << "d bias, " << at;
    EXPECT_LT(rel_err(got.grads[1], ref.dgamma), 1e-5) << "d gamma, " << at;
    EXPECT_LT(rel_err(got.grads[2], ref.dbeta), 1e-5) << "d beta, " << at;
  }
}

// m22: v2 = 4 v0 (x * 2, then x + x), clamp to [-10, 10], v4 = logsumexp, out = mish(v4) v4
// (one value a row), in float64: dV.
std::vector<double> m22_grad(const std::vector<float>& v, const std::vector<float>& g, int64_t N) {
  std::vector<double> dv(v.size());
  for (int64_t r = 0; r < kRows; ++r) {
    std::vector<double> c(N);
    double top = -INFINITY, sum = 0;
    for (int64_t k = 0; k < N; ++k) top = std::max(top, c[k] = std::min(10.0, std::max(-10.0, 4.0 * v[r * N + k])));
    for (int64_t k = 0; k < N; ++k) sum += std::exp(c[k] - top);
    const double l = top + std::log(sum), sp = std::log1p(std::exp(l)), t = std::tanh(sp);
    const double mish = l * t, dmish = t + l * (1 - t * t) / (1 + std::exp(-l));
    const double gl = g[r] * (mish + l * dmish);
    for (int64_t k = 0; k < N; ++k) {
      const double x = 4.0 * v[r * N + k];
      dv[r * N + k] = (x >= -10 && x <= 10) ? 4.0 * gl * std::exp(c[k] - l) : 0.0;
    }
  }
  return dv;
}

TEST(CudaRowBackward, M22ChainAgainstFloat64) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gftest::test_seed();
  std::mt19937_64 rng(seed);
  const int64_t N = 500;
  const Plan p = training_plan("mul b=2.0\nadd b=v1\nclamp lo=-10 hi=10\nlogsumexp\nmish\nmul b=v4\n", N, {});
  const auto v = normal(kRows * N, 1.0, rng), g = normal(kRows, 1.0, rng);
  const RowStage got = run_row_stage(p, v, g, {});
  EXPECT_LT(rel_err(got.dv, m22_grad(v, g, N)), 1e-5) << "seed " << seed;
}

// m84: y = BatchNorm(V) with batch statistics (gamma, beta), times a scalar s, softmax; in
// float64: the saved statistics, dV, and the gradients of gamma, beta and s.
struct M84 {
  SavedStats stats;
  std::vector<double> dv, dgamma, dbeta, ds;
};

M84 m84(const std::vector<float>& v, const std::vector<float>& g, const std::vector<float>& gamma,
        const std::vector<float>& beta, float s, int64_t N) {
  const double eps = 1e-5;
  M84 d{SavedStats(3 * N), std::vector<double>(v.size()), std::vector<double>(N), std::vector<double>(N), {0.0}};
  std::vector<double> mean(N), inv(N), xh(v.size()), g1(v.size());
  for (int64_t c = 0; c < N; ++c) {
    double m = 0, var = 0;
    for (int64_t r = 0; r < kRows; ++r) m += v[r * N + c] / double(kRows);
    for (int64_t r = 0; r < kRows; ++r) var += (v[r * N + c] - m) * (v[r * N + c] - m) / double(kRows);
    mean[c] = m, inv[c] = 1 / std::sqrt(var + eps);
    d.stats[c] = static_cast<float>(m), d.stats[N + c] = static_cast<float>(inv[c]), d.stats[2 * N + c] = static_cast<float>(var);
  }
  for (int64_t r = 0; r < kRows; ++r) {
    std::vector<double> y1(N), y3(N);
    double top = -INFINITY, sum = 0, gy = 0;
    for (int64_t c = 0; c < N; ++c) {
      xh[r * N + c] = (v[r * N + c] - mean[c]) * inv[c];
      y1[c] = xh[r * N + c] * gamma[c] + beta[c];
      top = std::max(top, y1[c] * s);
    }
    for (int64_t c = 0; c < N; ++c) sum += (y3[c] = std::exp(y1[c] * s - top));
    for (int64_t c = 0; c < N; ++c) gy += g[r * N + c] * (y3[c] /= sum);
    for (int64_t c = 0; c < N; ++c) {
      const double g2 = y3[c] * (g[r * N + c] - gy);
      d.ds[0] += g2 * y1[c];
      g1[r * N + c] = g2 * s;
      d.dbeta[c] += g1[r * N + c];
      d.dgamma[c] += g1[r * N + c] * xh[r * N + c];
    }
  }
  for (int64_t c = 0; c < N; ++c) {
    double sum_d = 0, sum_dx = 0;
    for (int64_t r = 0; r < kRows; ++r) {
      sum_d += g1[r * N + c] * gamma[c];
      sum_dx += g1[r * N + c] * gamma[c] * xh[r * N + c];
    }
    for (int64_t r = 0; r < kRows; ++r) {
      const double dxh = g1[r * N + c] * gamma[c];
      d.dv[r * N + c] = inv[c] / kRows * (kRows * dxh - sum_d - xh[r * N + c] * sum_dx);
    }
  }
  return d;
}

TEST(CudaRowBackward, M84ChainAgainstFloat64) {
  SKIP_WITHOUT_GPU();
  const uint64_t seed = gftest::test_seed();
  std::mt19937_64 rng(seed);
  const int64_t N = 300;
  const Plan p = training_plan("batch_norm training=1 weight=t0 bias=t1\nmul b=t2\nsoftmax\n", N, {N, N, 1});
  const auto v = normal(kRows * N, 1.0, rng), g = normal(kRows * N, 1.0, rng);
  const auto gamma = normal(N, 1.0, rng), beta = normal(N, 1.0, rng), s = normal(1, 1.0, rng);
  const M84 ref = m84(v, g, gamma, beta, s[0], N);
  const RowStage got = run_row_stage(p, v, g, {gamma, beta, s}, ref.stats);
  EXPECT_LT(rel_err(got.dv, ref.dv), 1e-5) << "dV, seed " << seed;
  EXPECT_LT(rel_err(got.grads[0], ref.dgamma), 1e-5) << "d gamma, seed " << seed;
  EXPECT_LT(rel_err(got.grads[1], ref.dbeta), 1e-5) << "d beta, seed " << seed;
  EXPECT_LT(rel_err(got.grads[2], ref.ds), 1e-5) << "d scalar, seed " << seed;
}

}  // namespace

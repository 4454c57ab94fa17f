// Test helpers for the core and CPU executor suites: random problems, a run through the
// planner + CpuExecutor (outputs and workspace poisoned with NaN first), and a plain
// double-precision reference of every stage written from PyTorch's definitions.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu_executor.h"
#include "gemmfuse/chain.h"
#include "gemmfuse/plan.h"

namespace gftest {

using namespace gemmfuse;

// A fresh seed per test (GEMMFUSE_SEED=<n> repeats one), printed so a failure can be rerun.
inline uint64_t test_seed() {
  uint64_t seed;
  if (const char* env = std::getenv("GEMMFUSE_SEED")) seed = std::strtoull(env, nullptr, 10);
  else seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::cout << "[ seed     ] " << (info ? info->name() : "?") << ": GEMMFUSE_SEED=" << seed
            << "\n";
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

struct StateTensor {
  std::vector<float> f;  // running_mean / running_var
  int64_t i = 0;         // num_batches
  bool is_int = false;
};

// One call: the chain, x/W/b and every operand and state tensor.
struct Case {
  std::string spec;
  Chain chain;
  std::vector<int64_t> batch;
  std::vector<std::vector<int64_t>> operand_sizes;
  std::vector<std::vector<float>> operands;
  std::vector<StateTensor> state;
  std::vector<float> x, w, b;
  int64_t M = 1;
};

inline int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Fill a case: x uniform [-1, 1), W uniform +-1/sqrt(K) (PyTorch's init), operands
// uniform [lo, hi). state: 'f' is a float vector of `state_width` (running_var gets
// [0.5, 2)), 'i' a counter.
inline Case make_case(const std::string& spec, std::vector<int64_t> batch,
                      std::vector<std::vector<int64_t>> operand_sizes, const std::string& state,
                      std::mt19937_64& rng, int64_t state_width = 0, float lo = -1.f,
                      float hi = 1.f) {
  Case c;
  c.spec = spec;
  c.chain = parse_chain(spec);
  c.batch = std::move(batch);
  c.M = numel(c.batch);
  c.operand_sizes = std::move(operand_sizes);
  const int64_t K = c.chain.in_features, N = c.chain.out_features;
  std::uniform_real_distribution<float> u(-1.f, 1.f), ops(lo, hi), var(0.5f, 2.f);
  const float bound = 1.f / std::sqrt(static_cast<float>(K));
  c.x.resize(c.M * K);
  for (float& v : c.x) v = u(rng);
  c.w.resize(N * K);
  for (float& v : c.w) v = u(rng) * bound;
  if (c.chain.has_bias) {
    c.b.resize(N);
    for (float& v : c.b) v = u(rng) * bound;
  }
  for (const auto& s : c.operand_sizes) {
    std::vector<float> t(numel(s));
    for (float& v : t) v = ops(rng);
    c.operands.push_back(std::move(t));
  }
  int float_states = 0;
  for (char k : state) {
    StateTensor t;
    if (k == 'i') {
      t.is_int = true;
      t.i = 3;
    } else {
      t.f.resize(state_width);
      for (float& v : t.f) v = (float_states % 2 == 0) ? u(rng) * 0.1f : var(rng);
      ++float_states;
    }
    c.state.push_back(std::move(t));
  }
  return c;
}

struct CpuResult {
  Plan plan;
  std::vector<float> out;
  std::vector<StateTensor> state;
};

// Plan and run on the CPU executor. Output and workspace start as NaN, so anything the plan
// fails to write shows up.
inline CpuResult run_cpu(const Case& c, bool simplify = true, bool external_gemm = false) {
  PlanRequest req;
  req.chain = c.chain;
  req.batch_sizes = c.batch;
  req.operand_sizes = c.operand_sizes;
  req.simplify = simplify;
  CpuResult r;
  r.plan = make_plan(req);
  r.state = c.state;
  CpuExecutor ex;
  RunArgs a;
  a.x = c.x.data();
  a.weight = c.w.data();
  a.bias = c.chain.has_bias ? c.b.data() : nullptr;
  for (const auto& t : c.operands) a.operands.push_back(t.data());
  for (auto& s : r.state) a.state.push_back(s.is_int ? static_cast<void*>(&s.i) : s.f.data());
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  r.out.assign(c.M * r.plan.out_width, qnan);
  a.out = r.out.data();
  if (external_gemm)
    a.cpu_gemm = [](int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double s = 0;
          for (int64_t k = 0; k < K; ++k) s += static_cast<double>(x[m * K + k]) * w[n * K + k];
          y[m * N + n] = static_cast<float>(s);
        }
    };
  std::vector<float> prepared(ex.prepared_bytes(r.plan) / sizeof(float) + 1, qnan);
  std::vector<float> workspace(ex.workspace_bytes(r.plan) / sizeof(float) + 1, qnan);
  ex.prepare(r.plan, a, prepared.data());
  ex.run(r.plan, a, prepared.data(), workspace.data());
  return r;
}

// ---- the double-precision reference -------------------------------------------------------

struct Mat {
  int64_t w = 0;      // row width (1 without a feature dim)
  bool feat = true;
  std::vector<double> d;  // [M, w]
};

inline double nanmax(double a, double b) { return (a != a || b != b) ? a + b : std::max(a, b); }
inline double nanmin(double a, double b) { return (a != a || b != b) ? a + b : std::min(a, b); }

inline double ref_unary(const Node& n, double x) {
  switch (n.op) {
    case OpCode::Neg: return -x;
    case OpCode::Abs: return std::fabs(x);
    case OpCode::Square: return x * x;
    case OpCode::Sqrt: return std::sqrt(x);
    case OpCode::Rsqrt: return 1 / std::sqrt(x);
    case OpCode::Exp: return std::exp(x);
    case OpCode::Log: return std::log(x);
    case OpCode::Relu: return x != x ? x : (x > 0 ? x : 0);
    case OpCode::Sigmoid: return 1 / (1 + std::exp(-x));
    case OpCode::Tanh: return std::tanh(x);
    case OpCode::Silu: return x / (1 + std::exp(-x));
    case OpCode::Mish: return x * std::tanh(std::log1p(std::exp(x)));
    case OpCode::GeluErf: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case OpCode::GeluTanh:
      return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    case OpCode::Softplus:
      return x * n.beta > n.threshold ? x : std::log1p(std::exp(x * n.beta)) / n.beta;
    case OpCode::Elu: return x > 0 ? x : n.alpha * std::expm1(x);
    case OpCode::LeakyRelu: return x > 0 ? x : x * n.alpha;
    case OpCode::Clamp: return x != x ? x : std::min(std::max(x, n.lo), n.hi);
    case OpCode::Pow: return std::pow(x, n.alpha);
    case OpCode::Reciprocal: return 1 / x;
    default: ADD_FAILURE() << "not unary"; return 0;
  }
}

inline double ref_binary(OpCode op, double x, double b, bool rev) {
  const double l = rev ? b : x, r = rev ? x : b;
  switch (op) {
    case OpCode::Add: return l + r;
    case OpCode::Sub: return l - r;
    case OpCode::Mul: return l * r;
    case OpCode::Div: return l / r;
    case OpCode::Minimum: return nanmin(l, r);
    case OpCode::Maximum: return nanmax(l, r);
    default: ADD_FAILURE() << "not binary"; return 0;
  }
}

struct RefResult {
  std::vector<double> out;
  std::vector<StateTensor> state;  // updated running stats (rounded to float)
};

inline RefResult reference(const Case& c) {
  const Chain& ch = c.chain;
  const int64_t M = c.M, K = ch.in_features, N = ch.out_features;
  std::vector<Mat> vals;
  Mat y;
  y.w = N;
  y.d.resize(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = ch.has_bias ? c.b[n] : 0.0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<double>(c.x[m * K + k]) * c.w[n * K + k];
      y.d[m * N + n] = s;
    }
  vals.push_back(y);
  RefResult res;
  res.state = c.state;
  for (const Node& n : ch.nodes) {
    const Mat& in = vals.back();
    Mat o = in;
    const int64_t w = in.w;
    auto at = [&](int64_t r, int64_t col) -> double& { return o.d[r * o.w + col]; };
    switch (family(n.op)) {
      case OpFamily::Unary:
        for (double& v : o.d) v = ref_unary(n, v);
        break;
      case OpFamily::Binary: {
        for (int64_t r = 0; r < M; ++r)
          for (int64_t col = 0; col < w; ++col) {
            double b = 0;
            if (n.b.kind == Operand::Kind::Imm) {
              b = n.b.imm;
            } else if (n.b.kind == Operand::Kind::Value) {
              const Mat& v = vals[n.b.index];
              b = v.d[r * v.w + (v.w == 1 ? 0 : col)];
            } else {
              const auto& s = c.operand_sizes[n.b.index];
              const auto& t = c.operands[n.b.index];
              std::vector<int64_t> vs = c.batch;
              if (in.feat) vs.push_back(w);
              if (numel(s) == 1) b = t[0];
              else if (s == vs) b = t[r * w + col];
              else if (!s.empty() && s.back() == w && numel(s) == w) b = t[col];
              else b = t[r];
            }
            at(r, col) = ref_binary(n.op, at(r, col), b, n.reversed);
          }
        break;
      }
      case OpFamily::Reduce: {
        o.w = 1;
        o.feat = n.keepdim;
        o.d.assign(M, 0.0);
        for (int64_t r = 0; r < M; ++r) {
          const double* x = &in.d[r * w];
          double acc = 0, mx = x[0], mn = x[0];
          for (int64_t col = 0; col < w; ++col) {
            acc += x[col];
            mx = nanmax(mx, x[col]);
            mn = nanmin(mn, x[col]);
          }
          double v = acc;
          if (n.op == OpCode::Mean) v = acc / w;
          if (n.op == OpCode::Max) v = mx;
          if (n.op == OpCode::Min) v = mn;
          if (n.op == OpCode::LogSumExp) {
            const double sh = std::isinf(mx) ? 0.0 : mx;
            double s = 0;
            for (int64_t col = 0; col < w; ++col) s += std::exp(x[col] - sh);
            v = std::log(s) + sh;
          }
          o.d[r] = v;
        }
        break;
      }
      case OpFamily::RowNorm: {
        const int64_t G = n.op == OpCode::GroupNorm ? n.groups : 1;
        const int64_t gs = w / G;
        for (int64_t r = 0; r < M; ++r)
          for (int64_t g = 0; g < G; ++g) {
            double* x = &o.d[r * w + g * gs];
            if (n.op == OpCode::GroupNorm) {
              double mean = 0, var = 0;
              for (int64_t i = 0; i < gs; ++i) mean += x[i];
              mean /= gs;
              for (int64_t i = 0; i < gs; ++i) var += (x[i] - mean) * (x[i] - mean);
              var /= gs;
              for (int64_t i = 0; i < gs; ++i) {
                const int64_t col = g * gs + i;
                double v = (x[i] - mean) / std::sqrt(var + n.eps);
                if (n.weight.present()) v *= c.operands[n.weight.index][col];
                if (n.bias.present()) v += c.operands[n.bias.index][col];
                x[i] = v;
              }
            } else {  // softmin(x) is softmax(-x)
              const double sign = n.op == OpCode::Softmin ? -1.0 : 1.0;
              double mx = sign * x[0];
              for (int64_t i = 0; i < gs; ++i) mx = nanmax(mx, sign * x[i]);
              double s = 0;
              for (int64_t i = 0; i < gs; ++i) s += std::exp(sign * x[i] - mx);
              for (int64_t i = 0; i < gs; ++i)
                x[i] = n.op == OpCode::LogSoftmax ? x[i] - mx - std::log(s)
                                                  : std::exp(sign * x[i] - mx) / s;
            }
          }
        break;
      }
      case OpFamily::Pool: {
        const int64_t wo = pool_output_width(w, n);
        o.w = wo;
        o.d.assign(M * wo, 0.0);
        for (int64_t r = 0; r < M; ++r)
          for (int64_t j = 0; j < wo; ++j) {
            const int64_t s0 = j * n.stride - n.padding;
            const int64_t e0 = std::min(s0 + n.kernel, w + n.padding);
            const int64_t s1 = std::max<int64_t>(s0, 0), e1 = std::min(e0, w);
            double acc = 0, mx = -INFINITY;
            for (int64_t i = s1; i < e1; ++i) {
              const double v = in.d[r * w + i];
              acc += v;
              if (v > mx || v != v) mx = v;
            }
            o.d[r * wo + j] = n.op == OpCode::MaxPool
                                  ? mx
                                  : acc / (n.count_include_pad ? (e0 - s0) : (e1 - s1));
          }
        break;
      }
      case OpFamily::ColumnNorm: {
        const bool running = n.running_mean.present();
        const bool batch = n.training || !running;
        for (int64_t col = 0; col < w; ++col) {
          double mean = 0, var = 0;
          if (batch) {
            for (int64_t r = 0; r < M; ++r) mean += in.d[r * w + col];
            mean /= M;
            for (int64_t r = 0; r < M; ++r)
              var += (in.d[r * w + col] - mean) * (in.d[r * w + col] - mean);
            var /= M;
          } else {
            mean = c.state[n.running_mean.index].f[col];
            var = c.state[n.running_var.index].f[col];
          }
          for (int64_t r = 0; r < M; ++r) {
            double v = (in.d[r * w + col] - mean) / std::sqrt(var + n.eps);
            if (n.weight.present()) v *= c.operands[n.weight.index][col];
            if (n.bias.present()) v += c.operands[n.bias.index][col];
            at(r, col) = v;
          }
          if (n.training && running) {
            double m = n.momentum;
            const int64_t nb = n.num_batches.present()
                                   ? c.state[n.num_batches.index].i + 1 : 0;
            if (m < 0) m = 1.0 / nb;
            auto& rm = res.state[n.running_mean.index].f[col];
            auto& rv = res.state[n.running_var.index].f[col];
            rm = static_cast<float>((1 - m) * rm + m * mean);
            rv = static_cast<float>((1 - m) * rv + m * var * M / (M - 1));
          }
        }
        if (n.training && running && n.num_batches.present())
          res.state[n.num_batches.index].i = c.state[n.num_batches.index].i + 1;
        break;
      }
      case OpFamily::Dropout:
        break;  // eval / p = 0 only
    }
    vals.push_back(std::move(o));
  }
  res.out = vals.back().d;
  return res;
}

// Elementwise: NaN where the reference is NaN, the same inf, else within atol + rtol*|ref|.
template <typename Ref>
::testing::AssertionResult all_close(const std::vector<float>& got, const std::vector<Ref>& ref,
                                     double atol, double rtol) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << ref.size();
  int bad = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = static_cast<double>(ref[i]);
    bool ok;
    if (r != r) ok = g != g;
    else if (std::isinf(r)) ok = g == r;
    else ok = std::fabs(g - r) <= atol + rtol * std::fabs(r);
    if (!ok && bad++ < 5) msg << " [" << i << "] got " << g << " want " << r;
  }
  if (bad) return ::testing::AssertionFailure() << bad << " mismatches:" << msg.str();
  return ::testing::AssertionSuccess();
}

// Bitwise equality of two float runs (NaN == NaN).
inline ::testing::AssertionResult same_bits(const std::vector<float>& a,
                                            const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (a[i] != a[i] && b[i] != b[i])) ||
        std::signbit(a[i]) != std::signbit(b[i]))
      return ::testing::AssertionFailure() << "[" << i << "] " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

// max |a - b| <= rel * max |b| (both finite where compared; NaN must match).
inline ::testing::AssertionResult rel_close(const std::vector<float>& a,
                                            const std::vector<float>& b, double rel) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  double scale = 0, err = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if ((a[i] != a[i]) != (b[i] != b[i]))
      return ::testing::AssertionFailure() << "NaN differs at " << i;
    if (b[i] == b[i]) {
      scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
      err = std::max(err, std::fabs(static_cast<double>(a[i]) - b[i]));
    }
  }
  if (err > rel * scale)
    return ::testing::AssertionFailure() << "max err " << err << " > " << rel << " * " << scale;
  return ::testing::AssertionSuccess();
}

}  // namespace gftest

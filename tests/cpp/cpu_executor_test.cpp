// The CPU executor against a plain double-precision reference (cpu_test_util.h) for every op
// family, on random shapes: M from 1, N and K not multiples of 8, NaN/inf propagation.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "cpu_test_util.h"

using namespace gemmfuse;
using namespace gftest;

namespace {

template <typename T>
T pick(std::mt19937_64& rng, std::vector<T> v) {
  return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
}

std::string linear(int64_t K, int64_t N, bool bias = true) {
  return "linear in=" + std::to_string(K) + " out=" + std::to_string(N) +
         " bias=" + (bias ? "1" : "0") + "\n";
}

// Plan, run and compare with the reference; returns the CPU result for further checks.
CpuResult check(const Case& c, double atol = 1e-4, double rtol = 1e-4, bool ext_gemm = false) {
  SCOPED_TRACE(c.spec);
  CpuResult r = run_cpu(c, true, ext_gemm);
  const RefResult ref = reference(c);
  EXPECT_TRUE(all_close(r.out, ref.out, atol, rtol))
      << c.spec << "M=" << c.M << "\n" << r.plan.describe();
  for (size_t i = 0; i < c.state.size(); ++i) {
    if (c.state[i].is_int) EXPECT_EQ(r.state[i].i, ref.state[i].i) << "state " << i;
    else EXPECT_TRUE(all_close(r.state[i].f, ref.state[i].f, 1e-5, 1e-5)) << "state " << i;
  }
  return r;
}

}  // namespace

TEST(CpuExecutor, GemmOnlyAndBlockedLoop) {
  std::mt19937_64 rng(test_seed());
  for (int64_t M : {1, 2, 7}) {
    for (int64_t K : {1, 13, 300}) {
      for (int64_t N : {1, 5, 70}) {
        const Case c = make_case(linear(K, N, M != 2), {M}, {}, "", rng);
        check(c, 1e-5, 1e-5);
        check(c, 1e-5, 1e-5, /*ext_gemm=*/true);
      }
    }
  }
}

TEST(CpuExecutor, UnaryOps) {
  std::mt19937_64 rng(test_seed());
  const std::vector<std::string> ops = {
      "neg", "abs", "square", "exp", "relu", "sigmoid", "tanh", "silu", "mish", "gelu",
      "gelu_tanh", "softplus", "softplus beta=2 threshold=1", "elu", "elu alpha=0.3",
      "leaky_relu", "leaky_relu alpha=0.2", "clamp lo=-0.2 hi=0.3", "clamp lo=0", "clamp hi=0",
      "pow alpha=2", "pow alpha=3",
      // Defined for positive inputs only: shift them first.
      "abs\nadd b=0.5\nsqrt", "abs\nadd b=0.5\nrsqrt", "abs\nadd b=0.5\nlog",
      "abs\nadd b=0.5\nreciprocal", "abs\nadd b=0.5\npow alpha=0.5", "abs\nadd b=0.5\npow alpha=-0.5",
      "abs\nadd b=0.5\npow alpha=-1", "abs\nadd b=0.5\npow alpha=-2", "abs\nadd b=0.5\npow alpha=1.7",
  };
  for (const std::string& op : ops) {
    const int64_t M = pick<int64_t>(rng, {1, 3, 17}), K = pick<int64_t>(rng, {1, 13, 29}),
                  N = pick<int64_t>(rng, {1, 10, 37});
    check(make_case(linear(K, N) + "mul b=3\n" + op + "\n", {M}, {}, "", rng));
  }
}

TEST(CpuExecutor, BinaryOpsEveryOperandKind) {
  std::mt19937_64 rng(test_seed());
  for (const char* op : {"add", "sub", "mul", "div", "minimum", "maximum"}) {
    for (int kind = 0; kind < 7; ++kind) {
      for (int rev = 0; rev < 2; ++rev) {
        const int64_t M = pick<int64_t>(rng, {1, 4, 9}), K = pick<int64_t>(rng, {3, 11}),
                      N = pick<int64_t>(rng, {1, 6, 19});
        std::string b;
        std::vector<std::vector<int64_t>> shapes;
        std::string pre;
        switch (kind) {
          case 0: b = "1.25"; break;
          case 1: b = "t0"; shapes = {{1}}; break;
          case 2: b = "t0"; shapes = {{N}}; break;
          case 3: b = "t0"; shapes = {{M, 1}}; break;
          case 4: b = "t0"; shapes = {{M, N}}; break;
          case 5: b = "v1"; pre = "logsumexp\nexp\n"; break;  // a saved [M,1] value
          case 6: b = "v0"; pre = "tanh\n"; break;           // Y read back in full
        }
        std::string spec = linear(K, N) + pre + op + " b=" + b + (rev ? " rev=1" : "") + "\n";
        // Operands in [0.5, 1.5) keep division well away from zero.
        const Case c = make_case(spec, {M}, shapes, "", rng, 0, 0.5f, 1.5f);
        if (std::string(op) == "div" && (kind >= 5 || rev)) continue;  // x may be near zero
        check(c);
      }
    }
  }
}

TEST(CpuExecutor, SelfReferenceAndSavedValuesAcrossPasses) {
  std::mt19937_64 rng(test_seed());
  for (int64_t M : {2, 5}) {
    const Case c = make_case(
        linear(7, 12) + "exp\nmul b=v1\nsub b=v2\nbatch_norm training=1\nadd b=v1\nsum\n"
                        "exp\nmaximum b=v6\n",
        {M}, {}, "", rng);
    const CpuResult r = check(c, 1e-3, 1e-3);
    EXPECT_EQ(r.plan.steps.size(), 4u) << r.plan.describe();
  }
}

TEST(CpuExecutor, Reductions) {
  std::mt19937_64 rng(test_seed());
  for (const char* op : {"sum", "mean", "max", "min", "logsumexp"}) {
    for (const char* keep : {"", " keepdim=0"}) {
      for (const char* first : {"exp\n", ""}) {  // "" puts sum/mean on the GEMV path
        const int64_t M = pick<int64_t>(rng, {1, 5, 23}), K = pick<int64_t>(rng, {1, 9, 61}),
                      N = pick<int64_t>(rng, {1, 2, 37, 130});
        const Case c =
            make_case(linear(K, N) + first + op + keep + "\nneg\n", {M}, {}, "", rng);
        const CpuResult r = check(c, 1e-4, 1e-4);
        EXPECT_EQ(r.plan.out_has_feature_dim, std::string(keep).empty());
      }
    }
  }
}

TEST(CpuExecutor, SoftmaxAndLogSoftmax) {
  std::mt19937_64 rng(test_seed());
  for (const char* op : {"softmax", "log_softmax", "softmin"})
    for (int64_t N : {1, 3, 37, 200}) {
      const int64_t M = pick<int64_t>(rng, {1, 4, 11});
      check(make_case(linear(17, N) + "mul b=4\n" + op + "\n", {M}, {}, "", rng));
    }
}

TEST(CpuExecutor, GroupNormGroupsThatDoAndDoNotDivide128) {
  std::mt19937_64 rng(test_seed());
  struct G { int64_t N, groups; bool affine; };
  const G cases[] = {{128, 1, true}, {128, 4, false}, {128, 32, true}, {128, 128, true},
                     {120, 3, true}, {120, 5, false}, {96, 3, true},   {37, 1, true},
                     {75, 25, true}};
  for (const G& g : cases) {
    const int64_t M = pick<int64_t>(rng, {1, 3, 9});
    std::string spec = linear(19, g.N) + "group_norm groups=" + std::to_string(g.groups) +
                       " eps=1e-05" + (g.affine ? " weight=t0 bias=t1" : "") + "\n";
    const auto shapes = g.affine ? std::vector<std::vector<int64_t>>{{g.N}, {g.N}}
                                 : std::vector<std::vector<int64_t>>{};
    check(make_case(spec, {M}, shapes, "", rng), 1e-3, 1e-3);
  }
}

TEST(CpuExecutor, Pooling) {
  std::mt19937_64 rng(test_seed());
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t N = pick<int64_t>(rng, {5, 9, 16, 37});
    const int64_t k = pick<int64_t>(rng, {1, 2, 3, 4}), s = pick<int64_t>(rng, {1, 2, 3});
    const int64_t p = std::uniform_int_distribution<int64_t>(0, k / 2)(rng);
    const bool ceil = rng() & 1, inc = rng() & 1, maxp = rng() & 1;
    std::string stage = std::string(maxp ? "max_pool" : "avg_pool") + " kernel=" +
                        std::to_string(k) + " stride=" + std::to_string(s) + " padding=" +
                        std::to_string(p) + " ceil=" + (ceil ? "1" : "0");
    if (!maxp) stage += std::string(" include_pad=") + (inc ? "1" : "0");
    const Case c = make_case(linear(11, N) + stage + "\nsilu\n", {pick<int64_t>(rng, {1, 6})},
                             {}, "", rng);
    const CpuResult r = check(c);
    EXPECT_EQ(r.plan.out_width, pool_output_width(N, c.chain.nodes[0])) << stage;
  }
}

TEST(CpuExecutor, BatchNormTrainingUpdatesRunningStats) {
  std::mt19937_64 rng(test_seed());
  for (const char* momentum : {"", " momentum=none", " momentum=0.5"}) {
    for (int64_t M : {2, 3, 40}) {
      const int64_t N = pick<int64_t>(rng, {1, 7, 45});
      const std::string spec = linear(13, N) +
                               "batch_norm training=1" + momentum +
                               " weight=t0 bias=t1 running_mean=s0 running_var=s1 "
                               "num_batches=s2\nmul b=t2\nsoftmax\n";
      const Case c = make_case(spec, {M}, {{N}, {N}, {1}}, "ffi", rng, N);
      const CpuResult r = check(c, 1e-3, 1e-3);
      EXPECT_EQ(r.state[2].i, 4);
    }
  }
  // Without running stats (track_running_stats=False), affine off, after other stages.
  const Case c = make_case(linear(9, 10) + "tanh\nbatch_norm training=1\nrelu\n", {6}, {}, "", rng);
  check(c, 1e-3, 1e-3);
  // Eval without running stats also normalises with the batch.
  check(make_case(linear(9, 10) + "batch_norm training=0\n", {6}, {}, "", rng), 1e-3, 1e-3);
}

TEST(CpuExecutor, BatchNormEvalFoldedAndNot) {
  std::mt19937_64 rng(test_seed());
  for (const char* pre : {"", "exp\n"}) {
    const int64_t N = pick<int64_t>(rng, {3, 29});
    const std::string spec = linear(21, N) + pre +
                             "batch_norm training=0 eps=0.01 weight=t0 bias=t1 "
                             "running_mean=s0 running_var=s1 num_batches=s2\ngelu\n";
    const Case c = make_case(spec, {pick<int64_t>(rng, {1, 5})}, {{N}, {N}}, "ffi", rng, N);
    const CpuResult r = check(c, 1e-4, 1e-4);
    EXPECT_EQ(r.plan.prep.fold_batchnorm, std::string(pre).empty());
    EXPECT_EQ(r.state[2].i, 3);  // eval: untouched
  }
}

TEST(CpuExecutor, NaNAndInfPropagate) {
  std::mt19937_64 rng(test_seed());
  const std::vector<std::string> stages = {
      "clamp lo=-0.5 hi=0.5", "relu", "max", "min", "maximum b=0.1", "minimum b=t1 rev=1",
      "max_pool kernel=3 stride=2 padding=1", "logsumexp", "softmax", "sum", "mean",
      "clamp lo=0\nmaximum b=v0", "group_norm groups=2", "avg_pool kernel=2", "exp\nlog",
  };
  for (const std::string& st : stages) {
    const int64_t M = 6, N = 10;
    // t0 adds NaN/+inf/-inf into chosen rows; the rest is finite.
    Case c = make_case(linear(5, N) + "add b=t0\n" + st + "\n", {M}, {{M, N}, {N}}, "", rng);
    for (float& v : c.operands[0]) v = 0.f;
    c.operands[0][0 * N + 3] = NAN;
    c.operands[0][1 * N + 5] = INFINITY;
    c.operands[0][2 * N + 9] = -INFINITY;
    c.operands[0][3 * N + 1] = INFINITY;
    c.operands[0][3 * N + 2] = -INFINITY;
    check(c);
  }
}

TEST(CpuExecutor, BatchDimsDropoutAndKeepdimFalseOutput) {
  std::mt19937_64 rng(test_seed());
  // LayerNorm is group_norm with groups=1; a 3-d input is fine for it.
  const Case d = make_case(
      linear(8, 12) + "dropout p=0.2 training=0\ngroup_norm weight=t0\nlogsumexp keepdim=0\n"
                      "mul b=t1\n",
      {2, 3}, {{12}, {2, 3}}, "", rng);
  const CpuResult r = check(d, 1e-4, 1e-4);
  EXPECT_FALSE(r.plan.out_has_feature_dim);
  EXPECT_EQ(r.out.size(), 6u);
}

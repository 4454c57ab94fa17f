// Each simplification pass: the rewrite it reports, the chain it leaves, and that the CPU
// executor computes the same numbers with and without it.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "cpu_test_util.h"
#include "gemmfuse/passes.h"

using namespace gemmfuse;
using namespace gftest;

namespace {

// The stages of a chain as spec text, without the linear line.
std::string body(const Chain& c) {
  const std::string s = to_spec(c);
  return s.substr(s.find('\n') + 1);
}

// Apply `pass` to a copy of the case's chain; returns the case with the rewritten chain.
template <typename Pass>
Case rewritten(const Case& c, Pass pass, Rewrites* r) {
  Case d = c;
  *r = pass(d.chain);
  return d;
}

}  // namespace

TEST(ChainEdit, RemoveAndInsertRenumber) {
  Chain c = parse_chain("linear in=2 out=4\nexp\nrelu\nadd b=v2\nmul b=v1\nsub b=v4\n");
  EXPECT_TRUE(value_referenced(c, 1));
  EXPECT_FALSE(value_referenced(c, 3));
  remove_node(c, 1);  // relu (v2) goes: readers of v2 read v1, v3.. shift down
  EXPECT_EQ(body(c), "exp\nadd b=v1\nmul b=v1\nsub b=v3\n");
  Node n;
  n.op = OpCode::Neg;
  insert_node(c, 1, n);  // continues exp: readers of v1 now read the neg
  EXPECT_EQ(body(c), "exp\nneg\nadd b=v2\nmul b=v2\nsub b=v4\n");
  EXPECT_THROW(remove_node(c, 9), std::out_of_range);
}

TEST(FoldScalarChains, M22TimesTwoPlusItself) {
  std::mt19937_64 rng(test_seed());
  const std::string spec =
      "linear in=37 out=29 bias=1\nmul b=2\nadd b=v1\nclamp lo=-10 hi=10\nlogsumexp\nmish\n"
      "mul b=v4\n";
  const Case c = make_case(spec, {13}, {}, "", rng);
  Rewrites r;
  const Case d = rewritten(c, fold_scalar_chains, &r);
  EXPECT_EQ(body(d.chain), "mul b=4\nclamp lo=-10 hi=10\nlogsumexp\nmish\nmul b=v3\n");
  ASSERT_EQ(r.size(), 2u);
  EXPECT_NE(r[0].find("x + x is x * 2"), std::string::npos) << r[0];
  EXPECT_NE(r[1].find("is x * 4"), std::string::npos) << r[1];
  EXPECT_TRUE(same_bits(run_cpu(c, false).out, run_cpu(d, false).out));
}

TEST(FoldScalarChains, OnlyExactFolds) {
  Chain c = parse_chain("linear in=2 out=4\nmul b=2\nmul b=3\nmul b=0.5\nmul b=0.5\nexp\n"
                        "mul b=8\nmul b=16 rev=1\nmul b=1\n");
  fold_scalar_chains(c);
  // x*2*3 might round; /2/2 can lose bits to subnormals; 8*16*1 is exact.
  EXPECT_EQ(body(c), "mul b=2\nmul b=3\nmul b=0.5\nmul b=0.5\nexp\nmul b=128\n");
  // A value read later is never folded away.
  Chain d = parse_chain("linear in=2 out=4\nmul b=2\nmul b=2\nadd b=v1\n");
  EXPECT_TRUE(fold_scalar_chains(d).empty());
  // The product must stay a finite float.
  Chain e = parse_chain("linear in=2 out=4\nmul b=1.7014118346046923e+38\nmul b=4\n");
  EXPECT_TRUE(fold_scalar_chains(e).empty());
}

TEST(FoldScalarChains, ExactWithInfAndNaN) {
  std::mt19937_64 rng(test_seed());
  // t0 puts inf/-inf/NaN/huge values into the row before the folds.
  const std::string spec = "linear in=5 out=8 bias=0\nadd b=t0\nmul b=2\nadd b=v2\nmul b=1024\n";
  Case c = make_case(spec, {4}, {{4, 8}}, "", rng);
  c.operands[0][0] = INFINITY;
  c.operands[0][1] = -INFINITY;
  c.operands[0][2] = NAN;
  c.operands[0][3] = 3e37f;
  c.operands[0][4] = 1e-40f;  // subnormal: scaling up by powers of two is exact
  Rewrites r;
  const Case d = rewritten(c, fold_scalar_chains, &r);
  EXPECT_EQ(body(d.chain), "add b=t0\nmul b=4096\n");
  EXPECT_TRUE(same_bits(run_cpu(c, false).out, run_cpu(d, false).out));
}

TEST(DropSize1Reductions, M18CollapsesToTheSum) {
  std::mt19937_64 rng(test_seed());
  const std::string spec =
      "linear in=33 out=21 bias=1\nsum\nmax\nmean\nlogsumexp\nlogsumexp\n";
  const Case c = make_case(spec, {9}, {}, "", rng);
  Rewrites r;
  const Case d = rewritten(c, drop_size1_reductions, &r);
  EXPECT_EQ(body(d.chain), "sum\n");
  EXPECT_EQ(r.size(), 4u);
  for (const auto& line : r) EXPECT_NE(line.find("identity"), std::string::npos) << line;
  EXPECT_TRUE(same_bits(run_cpu(c, false).out, run_cpu(d, false).out));
}

TEST(DropSize1Reductions, SoftmaxAndLogSoftmaxKeepNaNAndInf) {
  std::mt19937_64 rng(test_seed());
  const std::string spec =
      "linear in=6 out=1 bias=1\nadd b=t0\nsoftmax\nmul b=v1\nlog_softmax\nadd b=v1\n";
  Case c = make_case(spec, {6}, {{6, 1}}, "", rng);
  c.operands[0][0] = INFINITY;
  c.operands[0][1] = -INFINITY;
  c.operands[0][2] = NAN;
  Rewrites r;
  const Case d = rewritten(c, drop_size1_reductions, &r);
  EXPECT_EQ(body(d.chain), "add b=t0\nmul b=0\nadd b=1\nmul b=v1\nsub b=v4\nadd b=v1\n");
  EXPECT_EQ(r.size(), 2u);
  const auto a = run_cpu(c, false).out, b = run_cpu(d, false).out;
  EXPECT_TRUE(same_bits(a, b));
  EXPECT_TRUE(std::isnan(a[0]) && std::isnan(a[1]) && std::isnan(a[2]));
}

TEST(DropSize1Reductions, KeepdimFalseMovesToTheReductionBefore) {
  Chain c = parse_chain("linear in=2 out=4\nsum\nmax keepdim=0\nexp\n");
  auto r = drop_size1_reductions(c);
  EXPECT_EQ(body(c), "sum keepdim=0\nexp\n");
  EXPECT_FALSE(c.output_has_feature_dim());
  // Alone (nothing to merge into) it stays: the dim must still go.
  Chain d = parse_chain("linear in=2 out=1\nmean keepdim=0\n");
  EXPECT_TRUE(drop_size1_reductions(d).empty());
  // Not over a size-1 dim: untouched.
  Chain e = parse_chain("linear in=2 out=4\nmax\nsoftmax\nmax_pool kernel=2\n");
  drop_size1_reductions(e);
  EXPECT_EQ(body(e), "max\nmul b=0\nadd b=1\nmax_pool kernel=2\n");
}

TEST(FoldEvalBatchNorm, FoldsIntoWeights) {
  std::mt19937_64 rng(test_seed());
  const std::string spec =
      "linear in=24 out=19 bias=1\nbatch_norm training=0 eps=0.001 weight=t0 bias=t1 "
      "running_mean=s0 running_var=s1 num_batches=s2\ngelu\nadd b=v1\n";
  const Case c = make_case(spec, {11}, {{19}, {19}}, "ffi", rng, 19);
  Chain ch = c.chain;
  WeightPrep prep;
  const Rewrites r = fold_eval_batchnorm(ch, prep);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NE(r[0].find("folded"), std::string::npos);
  EXPECT_TRUE(prep.fold_batchnorm);
  EXPECT_EQ(prep.batchnorm.running_var.index, 1);
  EXPECT_EQ(body(ch), "gelu\nadd b=v0\n");
  const auto before = run_cpu(c, false), after = run_cpu(c, true);
  EXPECT_TRUE(after.plan.prep.fold_batchnorm);
  EXPECT_TRUE(rel_close(after.out, before.out, 1e-6));
  // Eval BatchNorm leaves the running state alone.
  EXPECT_EQ(after.state[2].i, 3);
  EXPECT_EQ(after.state[0].f, c.state[0].f);
}

TEST(FoldEvalBatchNorm, NotWhenTrainingOrLater) {
  WeightPrep prep;
  Chain a = parse_chain("linear in=2 out=4\nbatch_norm training=1 running_mean=s0 running_var=s1\n");
  EXPECT_TRUE(fold_eval_batchnorm(a, prep).empty());
  Chain b = parse_chain("linear in=2 out=4\nbatch_norm training=0\n");  // no running stats
  EXPECT_TRUE(fold_eval_batchnorm(b, prep).empty());
  Chain c = parse_chain(
      "linear in=2 out=4\nbatch_norm running_mean=s0 running_var=s1\nadd b=v0\n");
  EXPECT_TRUE(fold_eval_batchnorm(c, prep).empty());  // v0 is read later
  Chain d = parse_chain("linear in=2 out=4\nexp\nbatch_norm running_mean=s0 running_var=s1\n");
  EXPECT_TRUE(fold_eval_batchnorm(d, prep).empty());
  EXPECT_FALSE(prep.fold_batchnorm);
}

TEST(SumToGemv, SumAndMeanAnyKeepdim) {
  std::mt19937_64 rng(test_seed());
  for (const char* stage : {"sum", "mean", "sum keepdim=0", "mean keepdim=0"}) {
    SCOPED_TRACE(stage);
    const std::string spec = std::string("linear in=45 out=23 bias=1\n") + stage + "\ntanh\n";
    const Case c = make_case(spec, {3, 5}, {}, "", rng);
    Chain ch = c.chain;
    WeightPrep prep;
    const Rewrites r = sum_to_gemv(ch, prep);
    ASSERT_EQ(r.size(), 1u);
    EXPECT_NE(r[0].find("GEMV"), std::string::npos);
    EXPECT_TRUE(prep.column_sums);
    const auto before = run_cpu(c, false), after = run_cpu(c, true);
    ASSERT_EQ(after.plan.steps[0].kind, Step::Kind::Gemv);
    EXPECT_TRUE(rel_close(after.out, before.out, 1e-6));
    EXPECT_TRUE(all_close(after.out, reference(c).out, 1e-5, 1e-5));
  }
  WeightPrep prep;
  Chain keep = parse_chain("linear in=2 out=4\nsum\nadd b=v0\n");
  EXPECT_TRUE(sum_to_gemv(keep, prep).empty());
  Chain later = parse_chain("linear in=2 out=4\nexp\nsum\n");
  EXPECT_TRUE(sum_to_gemv(later, prep).empty());
}

TEST(Simplify, FixpointAcrossPasses) {
  std::mt19937_64 rng(test_seed());
  // Dropout goes, the BatchNorm folds, the size-1 reductions go, the sum becomes a GEMV
  // over the folded weights, and the scalar muls fold.
  const std::string spec =
      "linear in=40 out=24 bias=1\ndropout p=0.3 training=0\nbatch_norm running_mean=s0 "
      "running_var=s1 weight=t0\nsum\nmax\ndropout p=0 training=1\nmul b=2\nadd b=v6\n";
  const Case c = make_case(spec, {7}, {{24}}, "ff", rng, 24);
  Chain ch = c.chain;
  WeightPrep prep;
  const Rewrites r = simplify(ch, prep);
  EXPECT_EQ(body(ch), "sum\nmul b=4\n");
  EXPECT_TRUE(prep.fold_batchnorm);
  EXPECT_TRUE(prep.column_sums);
  EXPECT_EQ(r.size(), 7u);
  const auto before = run_cpu(c, false), after = run_cpu(c, true);
  EXPECT_TRUE(rel_close(after.out, before.out, 1e-6));
  EXPECT_TRUE(all_close(after.out, reference(c).out, 1e-5, 1e-5));
}

TEST(HoistScalarsOverSum, AffineStagesMovePastTheReductionAndItBecomesAGemv) {
  std::mt19937_64 rng(test_seed());
  struct Want { const char* reduction; const char* after; };
  for (const Want& w : {Want{"sum keepdim=0", "sum keepdim=0\ndiv b=2\nadd b=23\nneg\nsub b=11.5 rev=1\nmul b=3\n"},
                        Want{"mean", "mean\ndiv b=2\nadd b=1\nneg\nsub b=0.5 rev=1\nmul b=3\n"}}) {
    SCOPED_TRACE(w.reduction);
    const std::string spec = std::string("linear in=45 out=23 bias=1\ndiv b=2\nadd b=1\nneg\n"
                                         "sub b=0.5 rev=1\n") + w.reduction + "\nmul b=3\n";
    const Case c = make_case(spec, {3, 5}, {}, "", rng);
    Chain ch = c.chain;
    WeightPrep prep;
    const Rewrites r = simplify(ch, prep);
    EXPECT_EQ(body(ch), w.after);
    EXPECT_TRUE(prep.column_sums);
    ASSERT_EQ(r.size(), 2u);
    EXPECT_NE(r[0].find("moved before div b=2, add b=1, neg, sub b=0.5 rev=1"), std::string::npos)
        << r[0];
    const auto before = run_cpu(c, false), after = run_cpu(c, true);
    ASSERT_EQ(after.plan.steps[0].kind, Step::Kind::Gemv);
    EXPECT_TRUE(rel_close(after.out, before.out, 1e-5));
    EXPECT_TRUE(all_close(after.out, reference(c).out, 1e-4, 1e-5));
  }
}

TEST(HoistScalarsOverSum, LeavesWhatDoesNotCommute) {
  for (const char* stages : {"div b=2 rev=1\nsum\n",        // a / x is not affine
                             "div b=0\nsum\n",              // x / 0 makes infinities
                             "mul b=inf\nsum\n",            // so does inf * x
                             "mul b=t0\nsum\n",             // a column vector, not a scalar
                             "add b=3e38\nsum\n",           // N*c overflows a float
                             "mul b=2\nsum\nadd b=v1\n",    // v1 is read later
                             "exp\nsum\n",                  // not affine
                             "mul b=2\nmax\n"}) {           // not a sum or mean
    SCOPED_TRACE(stages);
    Chain ch = parse_chain(std::string("linear in=4 out=8\n") + stages);
    const std::string before = body(ch);
    EXPECT_TRUE(hoist_scalars_over_sum(ch).empty());
    EXPECT_EQ(body(ch), before);
  }
}

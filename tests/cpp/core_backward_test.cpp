// The backward plan: what the forward saves, where the row backward is cut, how it reads.
#include <gtest/gtest.h>

#include <string>

#include "gemmfuse/backward.h"

using namespace gemmfuse;

namespace {

Plan training_plan(const std::string& spec, std::vector<std::vector<int64_t>> ops = {},
                   int64_t M = 16) {
  PlanRequest r;
  r.chain = parse_chain(spec);
  r.batch_sizes = {M};
  r.operand_sizes = std::move(ops);
  r.for_training = true;
  return make_plan(r);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST(Backward, SavesTheGemmOutputAndBatchStatistics) {
  const Plan p = training_plan(
      "linear in=8 out=32 bias=1\nbatch_norm training=1 momentum=0.1 running_mean=s0 "
      "running_var=s1 weight=t0 bias=t1\nmul b=t2\nsoftmax\n",
      {{32}, {32}, {1}});
  const BackwardPlan bp = make_backward_plan(p);
  EXPECT_EQ(bp.start, 0);
  EXPECT_FALSE(bp.gemv);
  EXPECT_EQ(bp.saved.v, 0);
  EXPECT_EQ(bp.saved.v_cols, 32);
  ASSERT_EQ(bp.batch_norms.size(), 1u);
  EXPECT_EQ(bp.batch_norms[0], 0);
  EXPECT_EQ(bp.saved.batch_stats.at(0), 16 * 32);
  EXPECT_EQ(bp.saved.total, 16 * 32 + 3 * 32);
  EXPECT_EQ(bp.program.size(), 3u);
  const std::string d = bp.describe(p);
  EXPECT_TRUE(contains(d, "ColumnGradStats v1")) << d;
  EXPECT_TRUE(contains(d, "GemmDW")) << d;
}

TEST(Backward, TrainingPlansKeepEvalBatchNormAsAStage) {
  const std::string spec =
      "linear in=8 out=32 bias=1\nbatch_norm training=0 running_mean=s0 running_var=s1\nrelu\n";
  PlanRequest r;
  r.chain = parse_chain(spec);
  r.batch_sizes = {4};
  EXPECT_TRUE(make_plan(r).prep.fold_batchnorm);  // inference folds it into W
  const Plan t = training_plan(spec, {}, 4);
  EXPECT_FALSE(t.prep.fold_batchnorm);
  const BackwardPlan bp = make_backward_plan(t);
  EXPECT_TRUE(bp.batch_norms.empty());  // running statistics: no cut
  EXPECT_EQ(bp.program.size(), 2u);
}

TEST(Backward, GemvAndBareLinear) {
  const BackwardPlan gemv = make_backward_plan(training_plan("linear in=8 out=32 bias=1\nmean\nexp\n"));
  EXPECT_TRUE(gemv.gemv);
  EXPECT_EQ(gemv.start, 1);
  EXPECT_DOUBLE_EQ(gemv.gemv_scale, 1.0 / 32);
  EXPECT_EQ(gemv.saved.v_cols, 1);
  const BackwardPlan bare = make_backward_plan(training_plan("linear in=8 out=32 bias=0\n"));
  EXPECT_EQ(bare.saved.total, 0);
  EXPECT_EQ(bare.saved.v, -1);
  PlanRequest r;
  r.chain = parse_chain("linear in=8 out=32 bias=0\n");
  r.batch_sizes = {4};
  EXPECT_THROW(make_backward_plan(make_plan(r)), std::logic_error);  // not a training plan
}

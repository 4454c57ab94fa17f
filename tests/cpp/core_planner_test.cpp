// The planner: step structure of the five seed chains, buffers, Save/Buffer operands,
// BatchNorm cuts, byte and FLOP counts, describe(), and what it refuses and why.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "gemmfuse/plan.h"

using namespace gemmfuse;

namespace {

constexpr int64_t B = 1024, K = 8192, N = 8192;

Plan plan_for(const std::string& spec, std::vector<std::vector<int64_t>> operand_sizes = {},
              std::vector<int64_t> batch = {B}) {
  PlanRequest r;
  r.chain = parse_chain(spec);
  r.batch_sizes = std::move(batch);
  r.operand_sizes = std::move(operand_sizes);
  return make_plan(r);
}

std::string why_unsupported(const std::string& spec, std::vector<std::vector<int64_t>> ops = {},
                            std::vector<int64_t> batch = {B}) {
  try {
    plan_for(spec, std::move(ops), std::move(batch));
  } catch (const Unsupported& e) {
    return e.what();
  }
  return "(planned)";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

const std::string kLinear = "linear in=8192 out=8192 bias=1\n";

}  // namespace

TEST(Planner, M18IsOneGemv) {
  const Plan p = plan_for(kLinear + "sum\nmax\nmean\nlogsumexp\nlogsumexp\n");
  EXPECT_TRUE(p.prep.column_sums);
  EXPECT_FALSE(p.prep.fold_batchnorm);
  ASSERT_EQ(p.steps.size(), 1u);
  EXPECT_EQ(p.steps[0].kind, Step::Kind::Gemv);
  EXPECT_EQ(p.steps[0].node.op, OpCode::Sum);
  EXPECT_EQ(p.steps[0].output, kOutput);
  EXPECT_TRUE(p.buffers.empty());
  EXPECT_EQ(p.out_width, 1);
  EXPECT_TRUE(p.out_has_feature_dim);
  EXPECT_EQ(p.rewrites.size(), 5u);
  EXPECT_DOUBLE_EQ(p.steps[0].flops, 2.0 * B * K);
  EXPECT_EQ(p.M, B);
  const std::string d = p.describe();
  EXPECT_TRUE(contains(d, "1. Gemv")) << d;
  EXPECT_TRUE(contains(d, "column sums")) << d;
}

TEST(Planner, M22SavesTheLogSumExpForTheLastMul) {
  const Plan p = plan_for(kLinear +
                          "mul b=2.0\nadd b=v1\nclamp lo=-10 hi=10\nlogsumexp\nmish\nmul b=v4\n");
  ASSERT_EQ(p.steps.size(), 2u);
  EXPECT_EQ(p.steps[0].kind, Step::Kind::Gemm);
  EXPECT_EQ(p.steps[0].output, 0);
  ASSERT_GE(p.buffers.size(), 2u);
  EXPECT_EQ(p.buffers[0].name, "Y");
  EXPECT_EQ(p.buffers[0].rows, B);
  EXPECT_EQ(p.buffers[0].cols, N);
  const Step& rp = p.steps[1];
  EXPECT_EQ(rp.kind, Step::Kind::RowPass);
  EXPECT_EQ(rp.input, 0);
  EXPECT_EQ(rp.output, kOutput);
  EXPECT_EQ(rp.width_in, N);
  EXPECT_EQ(rp.width_out, 1);
  ASSERT_EQ(rp.program.size(), 6u);  // mul 4, clamp, logsumexp, save, mish, mul(saved)
  EXPECT_EQ(rp.program[0].node.op, OpCode::Mul);
  EXPECT_EQ(rp.program[0].b.kind, OperandRef::Kind::Imm);
  EXPECT_EQ(rp.program[0].b.imm, 4.f);
  EXPECT_EQ(rp.program[1].node.op, OpCode::Clamp);
  EXPECT_EQ(rp.program[2].kind, Instr::Kind::Reduce);
  EXPECT_EQ(rp.program[2].width_out, 1);
  EXPECT_EQ(rp.program[3].kind, Instr::Kind::Save);
  const int saved = rp.program[3].buffer;
  EXPECT_EQ(p.buffers[saved].cols, 1);
  EXPECT_EQ(rp.program[4].node.op, OpCode::Mish);
  EXPECT_EQ(rp.program[5].b.kind, OperandRef::Kind::Buffer);
  EXPECT_EQ(rp.program[5].b.index, saved);
  EXPECT_EQ(rp.program[5].b.cols, 1);
  EXPECT_EQ(p.out_width, 1);
  EXPECT_DOUBLE_EQ(p.steps[0].flops, 2.0 * B * N * K);
  const std::string d = p.describe();
  EXPECT_TRUE(contains(d, "1. Gemm")) << d;
  EXPECT_TRUE(contains(d, "137.4 GFLOP")) << d;
  EXPECT_TRUE(contains(d, "2. RowPass")) << d;
  EXPECT_TRUE(contains(d, "Y → out")) << d;
}

TEST(Planner, M84CutsForColumnStats) {
  const Plan p = plan_for(kLinear +
                              "batch_norm training=1 weight=t0 bias=t1 running_mean=s0 "
                              "running_var=s1 num_batches=s2\nmul b=t2\nsoftmax\n",
                          {{N}, {N}, {1}});
  ASSERT_EQ(p.steps.size(), 3u);
  EXPECT_EQ(p.steps[0].kind, Step::Kind::Gemm);
  const Step& cs = p.steps[1];
  EXPECT_EQ(cs.kind, Step::Kind::ColumnStats);
  EXPECT_EQ(cs.input, 0);  // nothing before the BatchNorm: the stats read Y directly
  EXPECT_EQ(p.buffers[cs.output].rows, 3);  // mean, invstd, var
  EXPECT_EQ(p.buffers[cs.output].cols, N);
  EXPECT_EQ(cs.node.op, OpCode::BatchNorm);
  const Step& rp = p.steps[2];
  EXPECT_EQ(rp.input, 0);
  EXPECT_EQ(rp.output, kOutput);
  ASSERT_EQ(rp.program.size(), 3u);
  EXPECT_EQ(rp.program[0].kind, Instr::Kind::BatchNormApply);
  EXPECT_EQ(rp.program[0].stats, cs.output);
  EXPECT_EQ(rp.program[0].weight.kind, OperandRef::Kind::Col);
  EXPECT_EQ(rp.program[0].bias.index, 1);
  EXPECT_EQ(rp.program[1].b.kind, OperandRef::Kind::Scalar);
  EXPECT_EQ(rp.program[2].kind, Instr::Kind::Softmax);
}

TEST(Planner, BatchNormAfterStagesWritesAnIntermediate) {
  const Plan p = plan_for(kLinear + "relu\nbatch_norm training=1\nexp\nbatch_norm training=1\n");
  // Gemm, RowPass Y->v1 [relu], ColumnStats v1, RowPass v1->v3 [bn, exp], ColumnStats v3,
  // RowPass v3->out [bn].
  ASSERT_EQ(p.steps.size(), 6u);
  EXPECT_EQ(p.steps[1].kind, Step::Kind::RowPass);
  EXPECT_NE(p.steps[1].output, kOutput);
  EXPECT_EQ(p.steps[2].kind, Step::Kind::ColumnStats);
  EXPECT_EQ(p.steps[2].input, p.steps[1].output);
  EXPECT_EQ(p.steps[3].input, p.steps[1].output);
  EXPECT_EQ(p.steps[3].program.size(), 2u);
  EXPECT_EQ(p.steps[4].input, p.steps[3].output);
  EXPECT_EQ(p.steps[5].output, kOutput);
}

TEST(Planner, EvalBatchNormNotFoldedReadsRunningStats) {
  const Plan p = plan_for(kLinear + "exp\nbatch_norm running_mean=s0 running_var=s1\nrelu\n");
  ASSERT_EQ(p.steps.size(), 3u);  // Gemm, ColumnStats(from running stats), one RowPass
  EXPECT_EQ(p.steps[1].kind, Step::Kind::ColumnStats);
  EXPECT_EQ(p.steps[1].input, -1);
  EXPECT_EQ(p.steps[2].program.size(), 3u);
  EXPECT_EQ(p.steps[2].program[1].stats, p.steps[1].output);
  // Right after the Linear it folds instead.
  const Plan q = plan_for(kLinear + "batch_norm running_mean=s0 running_var=s1\nrelu\n");
  EXPECT_TRUE(q.prep.fold_batchnorm);
  EXPECT_EQ(q.steps.size(), 2u);
}

TEST(Planner, M94AndM99AreGemmPlusOnePass) {
  const Plan p94 = plan_for(kLinear + "add b=t0\nclamp lo=-1 hi=1\nmish\n"
                                      "group_norm groups=256 weight=t1 bias=t2\n",
                            {{N}, {N}, {N}});
  ASSERT_EQ(p94.steps.size(), 2u);
  const auto& prog = p94.steps[1].program;
  ASSERT_EQ(prog.size(), 4u);
  EXPECT_EQ(prog[0].b.kind, OperandRef::Kind::Col);
  EXPECT_EQ(prog[3].kind, Instr::Kind::GroupNorm);
  EXPECT_EQ(prog[3].node.groups, 256);
  EXPECT_EQ(prog[3].weight.kind, OperandRef::Kind::Col);

  const Plan p99 = plan_for(kLinear + "gelu\nsoftmax\n");
  ASSERT_EQ(p99.steps.size(), 2u);
  EXPECT_EQ(p99.steps[1].summary, "Y → out: gelu, softmax");
  // Read Y (fp32) and write out (fp32): 2 * 1024 * 8192 * 4 bytes.
  EXPECT_DOUBLE_EQ(p99.steps[1].bytes, 2.0 * B * N * 4);
  EXPECT_DOUBLE_EQ(p99.steps[0].bytes, (B * K + N * K + N + B * N) * 4.0);
  EXPECT_TRUE(p99.rewrites.empty());
}

TEST(Planner, OperandBroadcasts) {
  auto kind = [](std::vector<int64_t> shape, std::vector<int64_t> batch) {
    PlanRequest r;
    r.chain = parse_chain("linear in=4 out=6 bias=0\nadd b=t0\n");
    r.batch_sizes = batch;
    r.operand_sizes = {shape};
    return make_plan(r).steps[1].program[0].b.kind;
  };
  EXPECT_EQ(kind({1}, {5}), OperandRef::Kind::Scalar);
  EXPECT_EQ(kind({}, {5}), OperandRef::Kind::Scalar);
  EXPECT_EQ(kind({1, 1}, {5}), OperandRef::Kind::Scalar);
  EXPECT_EQ(kind({6}, {5}), OperandRef::Kind::Col);
  EXPECT_EQ(kind({1, 6}, {5}), OperandRef::Kind::Col);
  EXPECT_EQ(kind({1, 1, 6}, {2, 5}), OperandRef::Kind::Col);
  EXPECT_EQ(kind({5, 1}, {5}), OperandRef::Kind::Row);
  EXPECT_EQ(kind({2, 5, 1}, {2, 5}), OperandRef::Kind::Row);
  EXPECT_EQ(kind({5, 6}, {5}), OperandRef::Kind::Full);
  EXPECT_EQ(kind({2, 5, 6}, {2, 5}), OperandRef::Kind::Full);
  EXPECT_TRUE(contains(why_unsupported("linear in=4 out=6\nadd b=t0\n", {{3, 6}}, {5}),
                       "does not broadcast"));
  EXPECT_TRUE(contains(why_unsupported("linear in=4 out=6\nadd b=t0\n", {{1, 5, 6}}, {5}),
                       "does not broadcast"));
  EXPECT_TRUE(contains(why_unsupported("linear in=4 out=6\nadd b=t0\n", {{5}}, {5}),
                       "does not broadcast"));
}

TEST(Planner, UnsupportedReasons) {
  EXPECT_EQ(why_unsupported(kLinear + "dropout p=0.5 training=1\n"),
            "dropout in training mode is random: runs in PyTorch");
  EXPECT_TRUE(contains(why_unsupported(kLinear + "group_norm groups=3\n"),
                       "3 groups do not divide the width 8192"));
  EXPECT_TRUE(contains(why_unsupported(kLinear + "sum keepdim=0\nsoftmax\n"),
                       "needs a feature dim"));
  EXPECT_TRUE(contains(why_unsupported(kLinear + "mul b=s0\n"), "must be a number"));
  EXPECT_TRUE(contains(why_unsupported(kLinear + "sum\nadd b=v0\n"), "does not broadcast"));
  EXPECT_TRUE(contains(why_unsupported(kLinear + "batch_norm training=1\n", {}, {2, 3}),
                       "BatchNorm1d on a 3-d input"));
  EXPECT_TRUE(contains(why_unsupported(kLinear + "batch_norm running_mean=t0 running_var=s1\n",
                                       {{N}}), "state tensors"));
  // Fine: a keepdim=0 reduction followed by pointwise stages, and a [M] operand.
  EXPECT_EQ(why_unsupported(kLinear + "sum keepdim=0\nexp\nmul b=t0\n", {{B}}), "(planned)");
  EXPECT_EQ(why_unsupported(kLinear + "dropout p=0.5 training=0\n"), "(planned)");
}

TEST(Planner, InvalidLikePyTorch) {
  EXPECT_THROW(
      {
        try {
          plan_for(kLinear + "batch_norm training=1\n", {}, {1});
        } catch (const std::invalid_argument& e) {
          EXPECT_TRUE(contains(e.what(), "Expected more than 1 value per channel when training"));
          throw;
        }
      },
      std::invalid_argument);
  // Eval BatchNorm with running stats is fine with one row.
  EXPECT_NO_THROW(plan_for(kLinear + "exp\nbatch_norm running_mean=s0 running_var=s1\n", {}, {1}));
  EXPECT_THROW(plan_for(kLinear + "add b=t3\n", {{1}}), std::invalid_argument);
  EXPECT_THROW(plan_for(kLinear + "group_norm groups=2 weight=t0\n", {{7}}),
               std::invalid_argument);
  EXPECT_THROW(plan_for(kLinear + "max_pool kernel=2 padding=2\n"), std::invalid_argument);
  EXPECT_THROW(plan_for("linear in=4 out=3\navg_pool kernel=5\n"), std::invalid_argument);
}

TEST(Planner, BuffersAreAligned) {
  const Plan p = plan_for("linear in=4 out=3\nexp\nadd b=v1\nrelu\nbatch_norm training=1\n"
                          "mul b=v1\n", {}, {5});
  ASSERT_GE(p.buffers.size(), 3u);
  size_t expect = 0;
  for (size_t i = 0; i < p.buffers.size(); ++i) {
    EXPECT_EQ(p.buffer_offset(static_cast<int>(i)), expect);
    EXPECT_EQ(p.buffer_offset(static_cast<int>(i)) % 256, 0u);
    expect += (p.buffers[i].rows * p.buffers[i].cols * 4 + 255) / 256 * 256;
  }
  EXPECT_EQ(p.buffers_bytes(), expect);
}

TEST(Planner, Names) {
  Precision pr;
  DType dt;
  EXPECT_TRUE(precision_from_name("fast", &pr));
  EXPECT_EQ(pr, Precision::Fast);
  EXPECT_STREQ(precision_name(Precision::TF32), "tf32");
  EXPECT_FALSE(precision_from_name("bf16", &pr));
  EXPECT_TRUE(dtype_from_name("bf16", &dt));
  EXPECT_EQ(dt, DType::BF16);
  EXPECT_STREQ(dtype_name(DType::F16), "fp16");
  EXPECT_FALSE(dtype_from_name("fp64", &dt));
}

TEST(Planner, NoStagesWritesOutputFromTheGemm) {
  const Plan p = plan_for("linear in=4 out=3 bias=1\n", {}, {2, 5});
  ASSERT_EQ(p.steps.size(), 1u);
  EXPECT_EQ(p.steps[0].output, kOutput);
  EXPECT_EQ(p.M, 10);
  EXPECT_EQ(p.out_width, 3);
}

TEST(Planner, FastWithFewRowsRunsTheGemmInFp32) {
  PlanRequest r;
  r.chain = parse_chain(kLinear + "gelu\n");
  r.precision = Precision::Fast;
  r.batch_sizes = {16};
  const Plan few = make_plan(r);
  EXPECT_EQ(few.precision, Precision::FP32);
  EXPECT_TRUE(contains(few.describe(), "bound by reading W")) << few.describe();
  r.batch_sizes = {17};
  EXPECT_EQ(make_plan(r).precision, Precision::Fast);
  r.batch_sizes = {16};
  r.fast_min_rows = 0;
  EXPECT_EQ(make_plan(r).precision, Precision::Fast);
  r.dtype = DType::BF16;  // 16-bit models have no split: their precision stays as asked
  r.fast_min_rows = 16;
  EXPECT_EQ(make_plan(r).precision, Precision::Fast);
}

TEST(Planner, FastWithLittleWorkRunsTheGemmInFp32) {
  PlanRequest r;
  r.chain = parse_chain("linear in=1024 out=1024 bias=1\ngelu\n");
  r.precision = Precision::Fast;
  r.batch_sizes = {256};  // 2MNK = 0.54 GFLOP
  const Plan small = make_plan(r);
  EXPECT_EQ(small.precision, Precision::FP32);
  EXPECT_TRUE(contains(small.describe(), "0.54 GFLOP")) << small.describe();
  r.batch_sizes = {1024};  // 2.1 GFLOP
  EXPECT_EQ(make_plan(r).precision, Precision::Fast);
  r.batch_sizes = {256};
  r.fast_min_flops = 0;
  EXPECT_EQ(make_plan(r).precision, Precision::Fast);
}

// fast's bf16 split GEMM loses accuracy with K (kFastMaxK): a longer sum runs in fp32.
TEST(Planner, FastWithLongSumsRunsTheGemmInFp32) {
  PlanRequest r;
  r.chain = parse_chain("linear in=" + std::to_string(kFastMaxK + 8) + " out=768 bias=0\n");
  r.precision = Precision::Fast;
  r.batch_sizes = {1024};
  const Plan long_k = make_plan(r);
  EXPECT_EQ(long_k.precision, Precision::FP32);
  EXPECT_TRUE(contains(long_k.describe(), "fast's 1e-4")) << long_k.describe();
  r.chain = parse_chain("linear in=" + std::to_string(kFastMaxK) + " out=768 bias=0\n");
  EXPECT_EQ(make_plan(r).precision, Precision::Fast);
}

// Where PyTorch's CPU kernels beat the CPU row pass the plan says so (the Python front then
// runs the call in PyTorch); on CUDA, for arithmetic-only chains and for the GEMV it does not.
TEST(Planner, CpuRoutesScalarRowOpsToPytorch) {
  auto route = [](const std::string& spec, Device device, DType dtype = DType::F32) {
    PlanRequest r;
    r.chain = parse_chain(spec);
    r.batch_sizes = {64};
    r.device = device;
    r.dtype = dtype;
    return make_plan(r);
  };
  const Plan softmax = route(kLinear + "gelu\nsoftmax\n", Device::CPU);
  EXPECT_TRUE(contains(softmax.pytorch_faster, "gelu")) << softmax.pytorch_faster;
  EXPECT_TRUE(contains(softmax.describe(), "route: runs in PyTorch")) << softmax.describe();
  EXPECT_TRUE(route(kLinear + "gelu\nsoftmax\n", Device::CUDA).pytorch_faster.empty());
  EXPECT_TRUE(route(kLinear + "relu\nclamp lo=-1 hi=1\nmul b=2\nsum\n", Device::CPU)
                  .pytorch_faster.empty());
  EXPECT_TRUE(route(kLinear + "sum\nlogsumexp\n", Device::CPU).pytorch_faster.empty());  // GEMV
  const Plan bf16 = route(kLinear + "relu\n", Device::CPU, DType::BF16);
  EXPECT_TRUE(contains(bf16.pytorch_faster, "bf16")) << bf16.pytorch_faster;
  EXPECT_TRUE(route(kLinear + "sum\n", Device::CPU, DType::BF16).pytorch_faster.empty());
}

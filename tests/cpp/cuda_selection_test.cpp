// The CUDA executor's kernel selection (executors/cuda/selection.h) on the CPU: for plans,
// devices (DeviceFacts) and overrides chosen here, each choice's kind and that its reason
// says why. No GPU: select is plain C++.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gemmfuse/backward.h"
#include "gemmfuse/plan.h"
#include "selection.h"
#include "selection_test_util.h"

using namespace gemmfuse;
using namespace gemmfuse::cuda;
using namespace gemmfuse::cuda::test;

namespace {

Selection sel(const Plan& p, const DeviceFacts& d = hopper(), const Overrides& o = Overrides{},
              const BackwardPlan* bp = nullptr) {
  return select(p, bp, d, o);
}

int row_step(const Selection& s) {
  for (size_t i = 0; i < s.rows.size(); ++i)
    if (s.rows[i].kind != RowKind::None) return static_cast<int>(i);
  return -1;
}

}  // namespace

TEST(CudaSelection, Fp32SeedShapeRunsF16x3OnHopper) {
  const Selection s = sel(plan_of(linear(8192, 8192) + "relu", 1024));
  EXPECT_EQ(s.gemm.kind, GemmKind::F16x3);
  EXPECT_EQ(s.gemm.fallback, GemmKind::Sgemm);
  EXPECT_EQ(s.gemm.splits, 1);
  EXPECT_TRUE(s.gemm.f16x3_parts);
  EXPECT_GT(s.gemm.cost.sgemm_s, s.gemm.cost.f16x3_s);
  EXPECT_TRUE(has(s.gemm.reason, "runs on fp16 tensor cores")) << s.gemm.reason;
  EXPECT_TRUE(has(s.gemm.reason, "the cost model expects")) << s.gemm.reason;
  EXPECT_TRUE(has(s.describe(), "runs on fp16 tensor cores"));
}

TEST(CudaSelection, FewTilesSplitK) {
  const Selection s = sel(plan_of(linear(8192, 8192) + "relu", 128));
  ASSERT_EQ(s.gemm.kind, GemmKind::F16x3);
  EXPECT_EQ(s.gemm.splits, 2);  // 64 tiles on 132 SMs
  EXPECT_TRUE(has(s.gemm.reason, "cut into 2 ranges on as many SMs")) << s.gemm.reason;
  EXPECT_EQ(f16x3_splits(128, 8192, 132), 2);
  EXPECT_EQ(f16x3_splits(1024, 8192, 132), 1);
  EXPECT_EQ(f16x3_splits(128, 1024, 132), 8);
}

TEST(CudaSelection, F16x3DeclinedWithItsReason) {
  // Not an sm_90 GPU: SGEMM, with the 4 MiB heuristic limit at 1024 rows.
  Selection s = sel(plan_of(linear(8192, 8192), 1024), ampere());
  EXPECT_EQ(s.gemm.kind, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.gemm.reason, "needs an sm_90 GPU")) << s.gemm.reason;
  EXPECT_EQ(s.gemm.lt_heuristic_bytes, size_t(4) << 20);
  // Built without the kernels.
  DeviceFacts unbuilt = hopper();
  unbuilt.sm90_kernels = false;
  s = sel(plan_of(linear(8192, 8192), 1024), unbuilt);
  EXPECT_TRUE(has(s.gemm.reason, "built without the sm90 kernels")) << s.gemm.reason;
  // K below 128; a small GEMM the cost model leaves on SGEMM (with its figures).
  s = sel(plan_of(linear(64, 8192), 1024));
  EXPECT_EQ(s.gemm.kind, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.gemm.reason, "K below 128")) << s.gemm.reason;
  s = sel(plan_of(linear(256, 256), 256));
  EXPECT_EQ(s.gemm.kind, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.gemm.reason, "SGEMM is faster at this shape")) << s.gemm.reason;
  EXPECT_TRUE(has(s.gemm.reason, "the cost model:")) << s.gemm.reason;
  // Rows outside [512, 2048]: the heuristic sees the whole workspace.
  s = sel(plan_of(linear(8192, 8192), 4096), ampere());
  EXPECT_EQ(s.gemm.lt_heuristic_bytes, 0u);
}

TEST(CudaSelection, F16x3OverrideShowsInExplain) {
  Overrides o;
  o.f16x3 = false;
  const Selection s = sel(plan_of(linear(8192, 8192), 1024), hopper(), o);
  EXPECT_EQ(s.gemm.kind, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.gemm.reason, "switched off (GEMMFUSE_F16X3=0)")) << s.gemm.reason;
  EXPECT_TRUE(has(s.describe(), "overrides set: GEMMFUSE_F16X3=0")) << s.describe();
  EXPECT_FALSE(has(sel(plan_of(linear(8192, 8192), 1024)).describe(), "overrides set"));
}

TEST(CudaSelection, F16x3PaddedRowsWhereNIsNotAMultipleOf4) {
  // An LM head (768 -> 50257): SGEMM unless the override lets the kernel write padded rows.
  const Plan lm_head = plan_of(linear(768, 50257), 4096);
  Selection s = sel(lm_head);
  EXPECT_EQ(s.gemm.kind, GemmKind::Sgemm);
  EXPECT_EQ(s.gemm.ldy, 0);
  EXPECT_TRUE(has(s.gemm.reason, "N must be a multiple of 4")) << s.gemm.reason;
  EXPECT_TRUE(has(s.gemm.reason, "GEMMFUSE_F16X3_PADDED_N=1")) << s.gemm.reason;
  Overrides o;
  o.f16x3_padded_n = true;
  s = sel(lm_head, hopper(), o);
  EXPECT_EQ(s.gemm.kind, GemmKind::F16x3);
  EXPECT_EQ(s.gemm.ldy, 50260);
  EXPECT_TRUE(has(s.gemm.reason, "writes rows of 50260 in the workspace")) << s.gemm.reason;
  EXPECT_TRUE(has(s.describe(), "GEMMFUSE_F16X3_PADDED_N=1")) << s.describe();
  // The copy is in the cost model; N a multiple of 4 keeps Y itself.
  EXPECT_GT(f16x3_cost(4096, 50257, 768, 132, 50260).f16x3_s, f16x3_cost(4096, 50257, 768, 132).f16x3_s);
  EXPECT_EQ(sel(plan_of(linear(8192, 8192), 1024), hopper(), o).gemm.ldy, 0);
  // K must still be a multiple of 8 (x's and W's parts).
  s = sel(plan_of(linear(770, 50257), 4096), hopper(), o);
  EXPECT_EQ(s.gemm.kind, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.gemm.reason, "K must be a multiple of 8")) << s.gemm.reason;
}

TEST(CudaSelection, SmallMFastTf32And16Bit) {
  Selection s = sel(plan_of(linear(8192, 8192), 32));
  EXPECT_EQ(s.gemm.kind, GemmKind::SmallM);
  EXPECT_EQ(s.gemm.fallback, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.gemm.reason, "at most 32 rows")) << s.gemm.reason;
  s = sel(plan_of(linear(8192, 8192), 1024, DType::F32, Precision::Fast));
  EXPECT_EQ(s.gemm.kind, GemmKind::FastSplit);
  EXPECT_TRUE(s.gemm.split_parts);
  EXPECT_FALSE(s.gemm.f16x3_parts);
  EXPECT_TRUE(has(s.gemm.reason, "bf16 hi + lo")) << s.gemm.reason;
  s = sel(plan_of(linear(8192, 8192), 32, DType::F32, Precision::TF32));
  EXPECT_EQ(s.gemm.kind, GemmKind::Tf32);  // TF32 never takes the small-M kernel
  EXPECT_TRUE(has(s.gemm.reason, "TF32")) << s.gemm.reason;
  s = sel(plan_of(linear(8192, 8192) + "relu", 1024, DType::BF16));
  EXPECT_EQ(s.gemm.kind, GemmKind::Half);
  EXPECT_TRUE(has(s.gemm.reason, "16-bit type")) << s.gemm.reason;
}

TEST(CudaSelection, GemvAndEmptyK) {
  Selection s = sel(plan_of(linear(256, 512) + "sum", 64));
  EXPECT_EQ(s.gemm.kind, GemmKind::Gemv);
  EXPECT_TRUE(has(s.gemm.reason, "colsum")) << s.gemm.reason;
  Plan empty = plan_of(linear(8, 512) + "relu", 64);  // the planner refuses K = 0 itself
  empty.K = 0;
  s = sel(empty);
  EXPECT_EQ(s.gemm.kind, GemmKind::BiasOnly);
  EXPECT_TRUE(has(s.gemm.reason, "K = 0")) << s.gemm.reason;
}

TEST(CudaSelection, FusedSoftmaxAndWhyNot) {
  const std::string spec = linear(1024, 8192) + "gelu\nmul b=0.5\nsoftmax";
  Selection s = sel(plan_of(spec, 1024, DType::BF16));
  EXPECT_TRUE(s.fused.matches);
  EXPECT_TRUE(s.fused.used);
  EXPECT_TRUE(s.fused.gelu);
  EXPECT_FLOAT_EQ(s.fused.scale, 0.5f);
  EXPECT_EQ(s.fused.tiles, 8 * 32);
  EXPECT_TRUE(has(s.describe(), "run as one sm90 kernel")) << s.describe();
  EXPECT_FALSE(has(s.describe(), "RowPass on")) << s.describe();  // the fused kernel runs it
  s = sel(plan_of(spec, 1024, DType::BF16), ampere());
  EXPECT_FALSE(s.fused.used);
  EXPECT_TRUE(has(s.fused.reason, "needs an sm_90 GPU (this is sm_80)")) << s.fused.reason;
  s = sel(plan_of(spec, 64, DType::BF16));
  EXPECT_TRUE(has(s.fused.reason, "too few 128x256 tiles")) << s.fused.reason;
  s = sel(plan_of(spec, 1 << 16, DType::BF16));
  EXPECT_TRUE(has(s.fused.reason, "too many 128x256 tiles")) << s.fused.reason;
  Overrides o;
  o.fused_softmax = false;
  o.sm90_programmatic = false;
  s = sel(plan_of(spec, 1024, DType::F16), hopper(), o);
  EXPECT_FALSE(s.fused.used);
  EXPECT_FALSE(s.fused.programmatic);
  EXPECT_TRUE(has(s.describe(), "not used: switched off")) << s.describe();
  EXPECT_TRUE(has(s.describe(), "GEMMFUSE_SM90_PDL=0")) << s.describe();
  s = sel(plan_of(spec, 1024));
  EXPECT_FALSE(s.fused.matches);
  EXPECT_EQ(s.fused.reason, "fp32 model");
  EXPECT_FALSE(has(s.describe(), "fused")) << s.describe();
}

TEST(CudaSelection, RowPassKinds) {
  // 4096 columns: registers, 256 threads x 4 chunks, every chunk a row value.
  Selection s = sel(plan_of(linear(512, 4096) + "relu\nsoftmax", 256));
  int i = row_step(s);
  ASSERT_GE(i, 0);
  EXPECT_EQ(s.rows[i].kind, RowKind::Register);
  EXPECT_EQ(s.rows[i].fallback, RowKind::Block);
  EXPECT_EQ(s.rows[i].register_threads, 256);
  EXPECT_EQ(s.rows[i].config.reg_vpt, 4);
  EXPECT_TRUE(s.rows[i].register_full);
  EXPECT_TRUE(has(s.rows[i].reason, "in registers")) << s.rows[i].reason;
  // Narrow rows: a warp each.
  s = sel(plan_of(linear(512, 128) + "softmax", 256));
  i = row_step(s);
  EXPECT_EQ(s.rows[i].kind, RowKind::Warp);
  EXPECT_TRUE(has(s.rows[i].reason, "a warp per row")) << s.rows[i].reason;
  // Pooling keeps the row off registers.
  s = sel(plan_of(linear(512, 4096) + "avg_pool kernel=2", 256));
  i = row_step(s);
  EXPECT_EQ(s.rows[i].kind, RowKind::Block);
  EXPECT_TRUE(has(s.rows[i].reason, "a pooling stage")) << s.rows[i].reason;
  // Too wide for registers and for this device's shared memory: global scratch rows.
  DeviceFacts small_smem = hopper();
  small_smem.row_smem_limit = 48 * 1024;
  s = sel(plan_of(linear(512, 20000) + "softmax", 1000), small_smem);
  i = row_step(s);
  EXPECT_EQ(s.rows[i].kind, RowKind::Scratch);
  EXPECT_EQ(s.rows[i].config.grid, kScratchCtas);
  EXPECT_TRUE(has(s.rows[i].reason, "global scratch")) << s.rows[i].reason;
}

TEST(CudaSelection, RowPassOverrides) {
  const Plan p = plan_of(linear(512, 8192) + "relu\nsoftmax", 256);
  Overrides o;
  o.register_rows = false;
  Selection s = sel(p, hopper(), o);
  int i = row_step(s);
  EXPECT_EQ(s.rows[i].kind, RowKind::Block);
  EXPECT_TRUE(has(s.rows[i].reason, "set_register_rows")) << s.rows[i].reason;
  EXPECT_TRUE(has(s.describe(), "overrides set: set_register_rows(false)")) << s.describe();
  o = Overrides{};
  o.register_wide_threads = 256;  // 8192 columns: 256 threads x 8 chunks
  s = sel(p, hopper(), o);
  EXPECT_EQ(s.rows[i].register_threads, 256);
  EXPECT_EQ(s.rows[i].config.reg_vpt, 8);
  EXPECT_EQ(sel(p).rows[i].register_threads, 512);
  // A row that ends as one value, with that form switched off.
  o = Overrides{};
  o.register_one_value = false;
  s = sel(plan_of(linear(512, 4096) + "relu\nlogsumexp", 256), hopper(), o);
  i = row_step(s);
  EXPECT_NE(s.rows[i].kind, RowKind::Register);
  EXPECT_TRUE(has(s.rows[i].reason, "set_register_one_value")) << s.rows[i].reason;
}

TEST(CudaSelection, ColumnStatistics) {
  const std::string bn = "batch_norm training=1 running_mean=s0 running_var=s1\nrelu";
  Selection s = sel(plan_of(linear(512, 8192) + bn, 256));
  int cs = -1;
  for (size_t i = 0; i < s.colstats.size(); ++i)
    if (s.colstats[i].kind != ColStatsKind::None) cs = static_cast<int>(i);
  ASSERT_GE(cs, 0);
  EXPECT_EQ(s.colstats[cs].kind, ColStatsKind::Fused);
  EXPECT_EQ(s.colstats[cs].threads_per_segment, 8);  // 256 slices of 32 columns >= 1.5 x 132
  EXPECT_TRUE(has(s.colstats[cs].reason, "one kernel")) << s.colstats[cs].reason;
  s = sel(plan_of(linear(512, 64) + bn, 256));
  EXPECT_EQ(s.colstats[cs].kind, ColStatsKind::TwoLevel);
  EXPECT_TRUE(s.colstats[cs].vector);
  EXPECT_TRUE(has(s.colstats[cs].reason, "too few CTAs")) << s.colstats[cs].reason;
  Overrides o;
  o.fused_colstats = 0;
  o.vector_colstats = false;
  s = sel(plan_of(linear(512, 8192) + bn, 256), hopper(), o);
  EXPECT_EQ(s.colstats[cs].kind, ColStatsKind::TwoLevel);
  EXPECT_FALSE(s.colstats[cs].vector);
  EXPECT_TRUE(has(s.colstats[cs].reason, "switched off")) << s.colstats[cs].reason;
  o = Overrides{};
  o.fused_colstats = 4;
  s = sel(plan_of(linear(512, 64) + bn, 256), hopper(), o);
  EXPECT_EQ(s.colstats[cs].threads_per_segment, 4);
}

TEST(CudaSelection, BackwardGemmsAndSlots) {
  const Plan p = plan_of(linear(8192, 8192) + "relu\nsoftmax", 1024, DType::F32, Precision::FP32, true);
  const BackwardPlan bp = make_backward_plan(p);
  Selection s = sel(p, hopper(), Overrides{}, &bp);
  ASSERT_TRUE(s.backward.present);
  EXPECT_EQ(s.backward.dw, GemmKind::F16x3);
  EXPECT_EQ(s.backward.dx, GemmKind::F16x3);
  EXPECT_TRUE(has(s.describe_backward(), "dW = dVᵀ x on the fp32 f16x3 kernel")) << s.describe_backward();
  EXPECT_TRUE(has(s.describe_backward(), "dx = dV W on the fp32 f16x3 kernel")) << s.describe_backward();
  EXPECT_EQ(s.backward.rows, RowBackwardMode::Segments);
  EXPECT_EQ(s.backward.segments, 1);
  EXPECT_EQ(s.backward.slots, 4 * 132);
  EXPECT_TRUE(has(s.backward.rows_reason, "slots")) << s.backward.rows_reason;
  EXPECT_EQ(s.backward.group_norm_lanes, 32);  // 8 lanes a group only where asked for (untimed)
  Overrides lanes8;
  lanes8.group_norm_lanes8 = true;
  s = sel(p, hopper(), lanes8, &bp);
  EXPECT_EQ(s.backward.group_norm_lanes, 8);
  EXPECT_TRUE(has(s.backward.rows_reason, "GEMMFUSE_GN_LANES8")) << s.backward.rows_reason;
  // Off sm90: cuBLAS, and why.
  s = sel(p, ampere(), Overrides{}, &bp);
  EXPECT_EQ(s.backward.dw, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.backward.dw_reason, "dW on cuBLAS (needs an sm_90 GPU")) << s.backward.dw_reason;
  EXPECT_EQ(s.backward.slots, 4 * 108);
  // dW reads x MN-major and dx reads W so: both need K, their output rows' length, a multiple of 8.
  const Plan odd = plan_of(linear(8196, 8192) + "relu", 1024, DType::F32, Precision::FP32, true);
  const BackwardPlan ob = make_backward_plan(odd);
  s = sel(odd, hopper(), Overrides{}, &ob);
  EXPECT_EQ(s.backward.dw, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.backward.dw_reason, "multiple of 8")) << s.backward.dw_reason;
  EXPECT_EQ(s.backward.dx, GemmKind::Sgemm);
  // dW's transposed split of dV reads its rows as 16-byte vectors: N a multiple of 4.
  const Plan narrow = plan_of(linear(8192, 8194) + "relu", 1024, DType::F32, Precision::FP32, true);
  const BackwardPlan nb = make_backward_plan(narrow);
  s = sel(narrow, hopper(), Overrides{}, &nb);
  EXPECT_EQ(s.backward.dw, GemmKind::Sgemm);
  EXPECT_TRUE(has(s.backward.dw_reason, "N must be a multiple of 4 (dV's rows")) << s.backward.dw_reason;
  // tf32 and a Linear alone (dV is the output's gradient).
  const Plan t = plan_of(linear(8192, 8192), 1024, DType::F32, Precision::TF32, true);
  const BackwardPlan tb = make_backward_plan(t);
  s = sel(t, hopper(), Overrides{}, &tb);
  EXPECT_EQ(s.backward.dx, GemmKind::Tf32);
  EXPECT_TRUE(has(s.backward.dx_reason, "only fp32 mode's dx")) << s.backward.dx_reason;
  EXPECT_EQ(s.backward.rows, RowBackwardMode::CopyGradient);
}

TEST(CudaSelection, FastMinRows) {
  EXPECT_EQ(fast_min_rows(128, 8192, 8192, hopper(), Overrides{}), kF16x3TileMN);
  EXPECT_EQ(fast_min_rows(512, 8192, 8192, hopper(), Overrides{}), PlanRequest{}.fast_min_rows);
  EXPECT_EQ(fast_min_rows(128, 8192, 8192, ampere(), Overrides{}), PlanRequest{}.fast_min_rows);
  Overrides o;
  o.f16x3 = false;
  EXPECT_EQ(fast_min_rows(128, 8192, 8192, hopper(), o), PlanRequest{}.fast_min_rows);
}

TEST(CudaSelection, OverridesFromEnvironment) {
  ::setenv("GEMMFUSE_F16X3", "0", 1);
  ::setenv("GEMMFUSE_SM90_DEFER", "1", 1);  // only "0" switches a path off
  Overrides o = Overrides::from_environment();
  EXPECT_FALSE(o.f16x3);
  EXPECT_TRUE(o.sm90_defer);
  EXPECT_TRUE(o.fused_softmax);
  ::unsetenv("GEMMFUSE_F16X3");
  ::unsetenv("GEMMFUSE_SM90_DEFER");
  ::setenv("GEMMFUSE_F16X3_PADDED_N", "1", 1);  // a path off by default: on with "1"
  ::setenv("GEMMFUSE_GN_LANES8", "1", 1);
  EXPECT_TRUE(Overrides::from_environment().f16x3_padded_n);
  EXPECT_TRUE(Overrides::from_environment().group_norm_lanes8);
  ::unsetenv("GEMMFUSE_F16X3_PADDED_N");
  ::unsetenv("GEMMFUSE_GN_LANES8");
  EXPECT_EQ(Overrides::from_environment(), Overrides{});
  EXPECT_TRUE(Overrides{}.set().empty());
}

TEST(CudaSelection, SettersAreOverrides) {
  const Overrides before = current_overrides();
  set_register_rows(false);
  set_fused_colstats(0);
  set_f16x3_padded_n(true);
  set_group_norm_lanes8(true);
  const Overrides o = current_overrides();
  EXPECT_FALSE(o.register_rows);
  EXPECT_EQ(o.fused_colstats, 0);
  EXPECT_TRUE(o.f16x3_padded_n);
  EXPECT_TRUE(o.group_norm_lanes8);
  EXPECT_NE(o, before);
  set_register_rows(true);
  set_fused_colstats(1);
  set_f16x3_padded_n(false);
  set_group_norm_lanes8(false);
  EXPECT_EQ(current_overrides(), before);
}

#include "layout.h"

#include <algorithm>

#include "column_stats.h"
#include "gemm_f16x3.h"
#include "split.h"

namespace gemmfuse::cuda {

size_t dtype_size(DType d) { return d == DType::F32 ? 4 : 2; }

const Step* find_step(const Plan& plan, Step::Kind kind) {
  for (const Step& s : plan.steps)
    if (s.kind == kind) return &s;
  return nullptr;
}

namespace {
}  // namespace

PreparedLayout prepared_layout(const Plan& plan, const Selection& sel) {
  PreparedLayout L;
  const int64_t N = plan.N, K = plan.K;
  const size_t dsz = dtype_size(plan.dtype);
  const Step* gemm = find_step(plan, Step::Kind::Gemm);
  const bool fold = plan.prep.fold_batchnorm;
  const bool split = sel.gemm.split_parts, f16x3 = sel.gemm.f16x3_parts;
  Cursor c;
  if (fold) L.scale = c.take(sizeof(float) * N);
  if (fold || (plan.chain.has_bias && plan.dtype != DType::F32))
    L.bias_f32 = c.take(sizeof(float) * N);
  if (gemm && fold && gemm->output == kOutput && plan.dtype != DType::F32)
    L.bias_dt = c.take(dsz * N);
  if (gemm && fold && !split) L.w_folded = c.take(dsz * N * K);
  if (split) {
    L.Kh = split_segment_width(K);
    L.w_split = c.take(sizeof(uint16_t) * N * kFastSplitSegments * L.Kh);
  }
  if (f16x3) {
    L.w_parts = c.take(sizeof(uint16_t) * 2 * N * K);
    L.w_exps = c.take(sizeof(float) * N);
  }
  if (split || f16x3) {
    L.w_flags = c.take(sizeof(int32_t) * N);
    L.w_list = c.take(sizeof(int32_t) * (1 + N));
  }
  if (plan.prep.column_sums) {
    L.wsum = c.take(sizeof(float) * K);
    L.bsum = c.take(sizeof(float));
    L.colsign = c.take(sizeof(float) * K);
  }
  L.total = c.end();
  return L;
}

WorkspaceLayout workspace_layout(const Plan& plan, const Selection& sel) {
  WorkspaceLayout L;
  Cursor c;
  c.at = plan.buffers_bytes();
  const bool split = sel.gemm.split_parts, f16x3 = sel.gemm.f16x3_parts;
  if (split) {
    const int64_t Kh = split_segment_width(plan.K);
    L.x_split = c.take(sizeof(uint16_t) * plan.M * kFastSplitSegments * Kh);
  }
  if (f16x3) {
    const int64_t ldy = sel.gemm.ldy > 0 ? sel.gemm.ldy : plan.N;
    L.x_parts = c.take(std::max(sizeof(uint16_t) * 2 * plan.M * plan.K, sizeof(float) * plan.M * ldy));
    L.x_exps = c.take(sizeof(float) * plan.M);
    L.x_tiny = c.take(sizeof(int32_t) * plan.M);
    L.second_rows = c.take(sizeof(int32_t));
    L.second_slot_row = c.take(sizeof(int32_t) * plan.M);
    L.second_slot_tiny = c.take(sizeof(int32_t) * plan.M);
    L.second_exps = c.take(sizeof(float) * plan.M);
    L.second_parts = c.take(sizeof(uint16_t) * 2 * plan.M * plan.K);
  }
  if (split || f16x3) L.x_flags = c.take(sizeof(int32_t) * plan.M);
  if (sel.gemm.ldy > 0) L.y_padded = c.take(sizeof(float) * plan.M * sel.gemm.ldy);
  if (find_step(plan, Step::Kind::Gemm)) {
    L.lt_bytes = kLtWorkspaceBytes;  // the split-K f16x3 kernel may need more for its partial tiles
    if (f16x3)
      L.lt_bytes = std::max(L.lt_bytes, sm90::f16x3_workspace_bytes(plan.M, plan.N, plan.K, false, sel.gemm.splits));
    L.lt = c.take(L.lt_bytes);
  }
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    const Step& s = plan.steps[i];
    if (s.kind == Step::Kind::ColumnStats && s.input >= 0)
      L.colstats_bytes =
          std::max(L.colstats_bytes, colstats_workspace_bytes(plan.M, std::max<int64_t>(s.width_in, 1)));
    const RowConfig& rc = sel.rows[i].config;  // the interpreter's (Register's fallback) shape
    if (s.kind == Step::Kind::RowPass && rc.scratch)
      L.row_scratch_bytes = std::max(L.row_scratch_bytes, rc.scratch_bytes);
  }
  if (L.colstats_bytes) L.colstats = c.take(L.colstats_bytes);
  if (L.row_scratch_bytes) L.row_scratch = c.take(L.row_scratch_bytes);
  L.total = c.end();
  return L;
}

}  // namespace gemmfuse::cuda

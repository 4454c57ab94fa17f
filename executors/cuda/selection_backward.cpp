// select's backward (selection.h): dW = dVᵀ x and dx = dV W on the f16x3 kernel or cuBLAS,
// and the row backward's mode and grid.
#include <algorithm>
#include <string>

#include "selection.h"

namespace gemmfuse::cuda {

namespace {

// Row backward CTAs per SM. Fewer slots mean less scratch (it is slots rows deep) but too
// little latency hiding (docs/measurements.md, "Training at the reference shape").
constexpr int64_t kRowBackwardSlotsPerSm = 4;

GemmKind cublas_kind(const Plan& plan) {
  if (plan.dtype != DType::F32) return GemmKind::Half;
  return plan.precision == Precision::TF32 ? GemmKind::Tf32 : GemmKind::Sgemm;
}

// One of dW and dx: the f16x3 kernel where `declines` is nullptr, else cuBLAS and why.
void choose(const Plan& plan, const char* declines, int64_t rows, int64_t cols, const DeviceFacts& d,
            GemmKind* kind, int* splits, std::string* reason, const char* f16x3_text) {
  if (plan.M > 0 && declines == nullptr) {
    *kind = GemmKind::F16x3;
    *splits = f16x3_splits(rows, cols, d.sms);
    *reason = f16x3_text;
    return;
  }
  *kind = cublas_kind(plan);
  *reason = std::string("cuBLAS (") + (declines != nullptr ? declines : "no rows") + ")";
}

// dW as an f16x3 problem (launch_weight_grad_f16x3).
const char* dw_declines(const Plan& plan, const DeviceFacts& d, const Overrides& o) {
  if (plan.dtype != DType::F32 || plan.precision != Precision::FP32)
    return "only fp32 mode's dW runs on the split kernel";
  return f16x3_weight_grad_declines(plan.M, plan.N, plan.K, d, o);
}

// dx as an f16x3 problem: M rows, K columns, reduced over N, W [N, K] read MN-major.
const char* dx_declines(const Plan& plan, const DeviceFacts& d, const Overrides& o) {
  if (plan.dtype != DType::F32 || plan.precision != Precision::FP32)
    return "only fp32 mode's dx runs on the split kernel";
  return f16x3_declines_mn_major(plan.M, plan.K, plan.N, d, o);
}

}  // namespace

BackwardChoice select_backward(const Plan& plan, const BackwardPlan& bp, const DeviceFacts& d,
                               const Overrides& o) {
  BackwardChoice b;
  b.present = true;
  if (bp.gemv) {
    b.dw = b.dx = GemmKind::Gemv;
    b.dw_reason = "dW: the GEMV's dW is one row broadcast";
    b.dx_reason = "dx: the GEMV's dx is a rank-one product";
  } else {
    choose(plan, dw_declines(plan, d, o), plan.N, plan.K, d, &b.dw, &b.dw_splits, &b.dw_reason,
           "dW = dVᵀ x on the fp32 f16x3 kernel (dV's columns split as the forward's x's rows, "
           "transposed into the parts; x split by columns and read MN-major)");
    choose(plan, dx_declines(plan, d, o), plan.M, plan.K, d, &b.dx, &b.dx_splits, &b.dx_reason,
           "dx = dV W on the fp32 f16x3 kernel (dV split as the forward's x, W split by columns and "
           "read MN-major, its parts over the forward's prepared W where it is cached, which the "
           "next forward prepares again)");
    if (b.dw != GemmKind::F16x3) b.dw_reason = "dW on " + b.dw_reason;
    if (b.dx != GemmKind::F16x3) b.dx_reason = "dx on " + b.dx_reason;
  }
  const int n = static_cast<int>(plan.chain.nodes.size());
  b.slots = plan.M > 0 ? std::min<int64_t>(plan.M, int64_t(d.sms) * kRowBackwardSlotsPerSm) : 0;
  if (bp.start == n) {
    b.rows = RowBackwardMode::CopyGradient;
    b.rows_reason = "no stage after the GEMM: dV is the output's gradient";
  } else if (plan.M > 0) {
    b.rows = RowBackwardMode::Segments;
    b.segments = static_cast<int>(bp.batch_norms.size()) + 1;
    b.rows_reason = "the row backward in " + std::to_string(b.segments) +
                    " segment(s) (cut at batch-statistics BatchNorms), " + std::to_string(b.slots) +
                    " slots (" + std::to_string(kRowBackwardSlotsPerSm) + " CTAs an SM, at most M) taking rows in turn";
    b.group_norm_lanes = o.group_norm_lanes8 ? 8 : 32;
    if (o.group_norm_lanes8) b.rows_reason += "; GroupNorm groups of at most 64 columns by 8 lanes (GEMMFUSE_GN_LANES8)";
  }
  return b;
}

}  // namespace gemmfuse::cuda

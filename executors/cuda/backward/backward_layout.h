// The scratch of one backward (BackwardArgs::workspace, CudaExecutor::backward_workspace_bytes):
// the byte offset of each buffer, every one on a 256-byte boundary. It follows from the plan,
// its BackwardPlan and the Selection's BackwardChoice alone, so it is made once with the
// Selection (plan_state.h) and every backward call reads it.
//
// dV (and its 16-bit copy) come first. After them the same bytes hold, one stage after the
// other: the row backward's buffers, then dW's buffers on the f16x3 kernel, then dx's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

#include "buffer_layout.h"
#include "gemmfuse/backward.h"
#include "gemmfuse/plan.h"
#include "selection.h"

namespace gemmfuse::cuda {

struct BackwardLayout {
  size_t total = 0;  // the bytes of all three stages' buffers
  size_t dv = 0, dv16 = 0;  // dV [M, w] fp32; its 16-bit copy for a 16-bit model's cuBLAS GEMMs
  // The row backward (row_backward.h's BwSegment): values and gradient rows per slot, the
  // gradients of values read again later (acc, [M, w]), the batch-statistics BatchNorms'
  // output gradients, g x-hat and column sums, eval BatchNorms' statistics, operand sinks.
  int64_t slots = 0;  // the row backward's CTAs: vals, g and sinks hold a row per slot
  int64_t g_width = 0;  // the g rows' width: the widest value from the GEMM's on
  size_t g = 0;
  std::map<int, size_t> vals, acc, bn_g, bn_gx, bn_sums, eval_stats, sinks;
  std::map<int, int64_t> sink_cols;  // operand index -> sink columns (1: a Scalar's row sums)
  size_t gemv_row = 0;
  // dW on the f16x3 kernel (the Selection's): after the row backward, over its scratch, the
  // workspace of launch_weight_grad_f16x3 (dV's and x's parts, their marks, the GEMM's).
  bool dw_f16x3 = false;
  size_t dw_ws = 0, dw_ws_bytes = 0;
  // dx on the f16x3 kernel (the Selection's): after dW, over the same scratch; W's column
  // split's parts in the weight scratch (CudaExecutor::backward_weight_bytes). With dV's
  // second level (softmax-like gradients hold many values ~2^-30 below their row's largest).
  bool dx_f16x3 = false;
  size_t dv_parts = 0, dv_exps = 0, dv_flags = 0, dv_tiny = 0, wc_exps = 0, wc_flags = 0, wc_list = 0,
         wc_stats = 0, dx_ws = 0, dx_ws_bytes = 0, second_rows = 0, slot_row = 0, slot_tiny = 0,
         slot_exps = 0, slot_parts = 0, slot_y = 0;

  Cursor place;  // where the next buffer goes (buffer_layout.h); each stage starts it over at dV's end
  size_t add(size_t bytes) { return place.take(bytes); }
};

BackwardLayout backward_layout(const Plan& plan, const BackwardPlan& bp, const BackwardChoice& choice);

}  // namespace gemmfuse::cuda

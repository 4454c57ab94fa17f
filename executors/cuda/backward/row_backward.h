// The CUDA row backward (backward.h's RowBackward steps): a CTA per row recomputes the
// chain's values from the saved GEMM output into a scratch row per value, then runs every
// stage's derivative in reverse (pointwise.h's Pointwise<Op>::bwd for the pointwise ops).
// The grid is `slots` CTAs, each taking rows slot, slot + slots, ... in order, with its own
// scratch rows (values, gradients) reused row after row: the scratch is slots rows deep, not
// M, and stays in L2. Gradients of operand vectors (Col, Scalar, norms' affine parameters)
// add into the slot's sink row, in row order; a column reduction sums the slots' rows in a
// fixed order afterwards, so the result does not depend on the order in which CTAs run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gemmfuse/plan.h"
#include "row_attrs.h"

namespace gemmfuse::cuda {

constexpr int kMaxBackwardInstrs = 24;
// The most pointwise stages one register run takes (BwSegment::run_first).
constexpr int kMaxPointwiseRun = 8;
// The widest GroupNorm group BwSegment::gn_lanes = 8 takes (8 columns a lane).
constexpr int kGroupLanesMaxWidth = 64;

enum : uint8_t {
  kBwPointwise = 0, kBwReduce, kBwSoftmax, kBwGroupNorm, kBwPool, kBwBatchNorm
};
enum : uint8_t {  // the operand of a binary stage
  kBwNone = 0, kBwImm, kBwScalar, kBwCol, kBwRow, kBwFull, kBwValue
};
enum : uint8_t {
  kBwBinary = 1, kBwReversed = 2, kBwBatchStats = 4
};

struct BwInstr : RowAttrs {    // its attributes by row_attrs, shared with the forward
  uint8_t kind = kBwPointwise, flags = 0, opnd = kBwNone;
  float imm = 0.f;
  int32_t value = -1;           // kBwValue: the value id read
  const float* b = nullptr;     // the operand tensor (kBwScalar .. kBwFull)
  float* b_grad = nullptr;      // its gradient: sinks [slots] (Scalar), [slots, win] (Col); the
                                // gradient itself [M, win] (Full), [M] (Row)
  const float* weight = nullptr;  // norms' affine parameters, [win]
  const float* bias = nullptr;
  float* weight_grad = nullptr;   // their sinks, [slots, win]
  float* bias_grad = nullptr;
  const float* stats = nullptr;   // BatchNorm: [3, win] mean, invstd, var (saved or running)
};

// One segment [lo, hi) of the chain's nodes, for all rows (backward.h).
struct BwSegment {
  int32_t n = 0;                      // instructions: nodes start .. hi-1 (forward recompute)
  int32_t lo = 0;                     // nodes lo .. hi-1 are differentiated (relative to start)
  BwInstr ins[kMaxBackwardInstrs];
  int64_t M = 0;
  int64_t slots = 0;                  // the grid (BackwardChoice::slots): scratch rows per buffer
  const float* v0 = nullptr;          // the saved start value, [M, w0]
  int32_t w0 = 0;
  float* vals = nullptr;              // scratch: value j (relative, 1..n) at vals + off[j] + slot * w_j
  int64_t val_off[kMaxBackwardInstrs + 1] = {};
  float* acc[kMaxBackwardInstrs + 1] = {};  // value j's gradient from reads of v<j>, [M, w_j]
  const float* g_top = nullptr;       // the gradient at the top value, [M, w_top]
  // The top is a batch-statistics BatchNorm's input: g_top is its output's gradient, and
  // these its column sums (sum g, sum g x-hat) and node (relative).
  int32_t bn_top = -1;
  const float* bn_sum_g = nullptr;
  const float* bn_sum_gx = nullptr;
  float* g_scratch = nullptr;         // [2, slots, w_max]
  int32_t w_max = 0;
  float* out = nullptr;               // the gradient at value lo, [M, w_lo]
  float* out_gx = nullptr;            // with a BatchNorm below: g x-hat per row, [M, w_lo]
  int32_t bn_below = -1;              // that BatchNorm (relative)
  // Stage i belongs to the run of pointwise stages run_first[i] .. (i itself where it runs
  // alone): at most kMaxPointwiseRun stages whose inner values nothing else reads (no other
  // stage, residual read, segment end or BatchNorm), computed and differentiated per element
  // in registers; only the run's input and output values are kept in scratch.
  int8_t run_first[kMaxBackwardInstrs] = {};
  // Lanes a GroupNorm group of at most kGroupLanesMaxWidth columns (BackwardChoice::
  // group_norm_lanes): 8, four groups a warp at once; 32, a warp a group.
  int32_t gn_lanes = 32;
};

// Fills seg.run_first from its instructions, lo, bn_below and acc (backward_rows.cu, once per
// segment).
void plan_pointwise_runs(BwSegment& seg);

void launch_row_backward(const BwSegment& seg, cudaStream_t stream);

// out[c] = sum over rows of in[r, c], accumulated in fp64 in a fixed order (deterministic);
// `scale` multiplies the sum, `accumulate` adds it to out.
void launch_column_sums(const float* in, int64_t rows, int64_t cols, float* out, float scale,
                        bool accumulate, cudaStream_t stream);

}  // namespace gemmfuse::cuda

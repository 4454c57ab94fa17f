// The CPU executor's row functions, shared by its row passes and by its backward's recompute
// of the chain's values: one row at a time, fp32 in and out, sums in double.
#pragma once

#include <cstdint>

#include "gemmfuse/chain.h"

namespace gemmfuse {

// A Reduce op's value over one row (RowOp<op>::forward, executors/common/row_ops.h).
float reduce_row(OpCode op, const float* x, int64_t w);

// In place: a Softmax-kind op over one row (RowOp<op>::forward).
void softmax_row(OpCode op, float* x, int64_t w);

// In place: GroupNorm over groups of w/groups contiguous columns (GroupNormOp::forward, sums in
// fp64), with the affine weight and bias (either may be nullptr).
void group_norm_row(const Node& n, float* x, int64_t w, const float* wt, const float* bs);

// In place: BatchNorm with stats [2, w] (mean, invstd): (x - mean) invstd, times the weight,
// plus the bias (either may be nullptr), in fp32.
void batch_norm_row(float* x, int64_t w, const float* stats, const float* wt, const float* bs);

// stats [2, w] (mean, invstd) of an eval BatchNorm from its running mean and variance.
void running_stats_row(const float* rm, const float* rv, double eps, int64_t w, float* stats);

// PyTorch's avg_pool1d / max_pool1d (dilation 1) over one row; `out` has w_out entries.
void pool_row(const Node& n, const float* x, int64_t w, float* out, int64_t w_out);

}  // namespace gemmfuse

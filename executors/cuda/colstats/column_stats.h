// Training BatchNorm column statistics (ColumnStats steps): deterministic two-level reduction
// over the M rows, mean, invstd and biased var to a [3, W] buffer, running statistics updated
// on device (unless RunArgs::update_state is off).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"

namespace gemmfuse::cuda {

// Row chunks of the first level (each writes fp64 [2, W] partial sums).
int64_t colstats_chunks(int64_t M);
size_t colstats_workspace_bytes(int64_t M, int64_t W);

// The 16-byte-vector level-1 kernel on (default) or off (the scalar kernel): for timing.
void set_vector_colstats(bool on);
// The one-kernel path (a CTA per column slice streaming every row, finalize in the same kernel):
// 0 off (two levels), 1 auto (default: when the slices fill the GPU), 8 or 4 forced threads per
// row segment (32 or 16 columns per CTA). For timing.
void set_fused_colstats(int mode);

void launch_column_stats(const Plan& plan, const Step& step, const RunArgs& args,
                         char* workspace, double* partials, cudaStream_t stream);

}  // namespace gemmfuse::cuda

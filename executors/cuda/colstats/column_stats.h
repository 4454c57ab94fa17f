// Training BatchNorm column statistics (ColumnStats steps): deterministic two-level reduction
// over the M rows, mean, invstd and biased var to a [3, W] buffer, running statistics updated
// on device (unless RunArgs::update_state is off).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"
#include "selection.h"

namespace gemmfuse::cuda {

// Row chunks of the first level (each writes fp64 [2, W] partial sums).
int64_t colstats_chunks(int64_t M);
size_t colstats_workspace_bytes(int64_t M, int64_t W);

// Which kernel computes a step's statistics (one kernel streaming every row per column slice,
// or two levels; set_fused_colstats and set_vector_colstats switch them for timing) is the
// kernel selection's (selection.h's ColStatsChoice).
void launch_column_stats(const Plan& plan, const Step& step, const ColStatsChoice& choice,
                         const RunArgs& args, char* workspace, double* partials, cudaStream_t stream);

}  // namespace gemmfuse::cuda

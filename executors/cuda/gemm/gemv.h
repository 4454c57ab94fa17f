// The Gemv step: Y[m] = (x[m,:] . wsum + bsum) * scale, scale = 1 or 1/N (Mean).
#pragma once

#include <cuda_runtime.h>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"

namespace gemmfuse::cuda {

void launch_gemv(const Plan& plan, const Step& step, const RunArgs& args, const char* prepared,
                 char* workspace, cudaStream_t stream);

}  // namespace gemmfuse::cuda

// The Gemm step on cuBLASLt: Y[M,N] = x[M,K] W[N,K]^T (+ bias), row-major, in the plan's
// precision (fp32 SGEMM, TF32, bf16 hi + lo split for `fast`, or the model's 16-bit type);
// fp32 on sm90 where sm90/gemm_f16x3.h takes the shape, fp32 up to 32 rows on gemm_small_m.h.
#pragma once

#include <cuda_runtime.h>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"

namespace gemmfuse::cuda {

void run_gemm(const Plan& plan, const Step& step, const RunArgs& args, const char* prepared,
              char* workspace, cudaStream_t stream);

}  // namespace gemmfuse::cuda

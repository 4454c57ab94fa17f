// The Gemm step: Y[M,N] = x[M,K] W[N,K]^T (+ bias), row-major, on the kernel the plan's
// Selection chose (selection.h's GemmChoice): cuBLASLt (fp32 SGEMM, TF32, bf16 hi + lo split
// for `fast`, or the model's 16-bit type), the f16x3 kernel (sm90/gemm_f16x3.h) or the
// small-M kernel (gemm_small_m.h).
#pragma once

#include <cuda_runtime.h>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"
#include "plan_state.h"

namespace gemmfuse::cuda {

void run_gemm(const Plan& plan, const PlanState& state, const Step& step, const RunArgs& args,
              const char* prepared, char* workspace, cudaStream_t stream);

}  // namespace gemmfuse::cuda

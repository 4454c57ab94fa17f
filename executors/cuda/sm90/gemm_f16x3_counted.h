// The wide fp32 GEMM on fp16 tensor cores over a row count read on the device
// (gemm_f16x3.h's F16x3Problem::rows), instantiated in gemm_f16x3_counted.cu;
// gemm_f16x3.cu dispatches to it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "gemm_f16x3.h"

namespace gemmfuse::cuda::sm90 {

// As launch_f16x3_gemm, for a problem with `rows` set.
bool launch_f16x3_counted(const F16x3Problem& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

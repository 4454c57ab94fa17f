// The split-K variant of the fp32 GEMM on fp16 tensor cores (gemm_f16x3.h), instantiated
// in gemm_f16x3_split_k.cu; gemm_f16x3.cu dispatches to it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "gemm_f16x3.h"

namespace gemmfuse::cuda::sm90 {

size_t f16x3_split_k_workspace_bytes(const F16x3Problem& p, int splits);

// As launch_f16x3_gemm, with each output tile's K cut into `splits` (> 1) ranges.
bool launch_f16x3_split_k(const F16x3Problem& p, int splits, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

// The split-K variant of the fp32 GEMM on bf16 tensor cores (gemm_bf16x6.h), instantiated
// in gemm_bf16x6_split_k.cu; gemm_bf16x6.cu dispatches to it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "gemm_bf16x6.h"

namespace gemmfuse::cuda::sm90 {

size_t bf16x6_split_k_workspace_bytes(const Bf16x6Problem& p, int splits);

// As launch_bf16x6_gemm, with each output tile's K cut into `splits` (> 1) ranges.
bool launch_bf16x6_split_k(const Bf16x6Problem& p, int splits, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

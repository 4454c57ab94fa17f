// The fp32 GEMM on fp16 tensor cores with W's parts read MN-major (F16x3Problem::w_mn_major:
// W stored [K, N], as dx = dV W reads the weight [N_out, K_in]): the wide kernel and the one
// over a row count (gemm_f16x3_mn_major.cu) and the split-K one (gemm_f16x3_split_k_mn.cu, built without
// programmatic launch as gemm_f16x3_split_k.cu is); gemm_f16x3.cu dispatches to them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "gemm_f16x3.h"

namespace gemmfuse::cuda::sm90 {

size_t f16x3_mn_major_workspace_bytes(const F16x3Problem& p, int splits);

// As launch_f16x3_gemm: with p.rows the counted kernel, else `splits` 1 runs the wide kernel,
// more the split-K one.
bool launch_f16x3_mn_major(const F16x3Problem& p, int splits, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);

// The split-K kernel's half of the above (splits > 1).
size_t f16x3_split_k_mn_workspace_bytes(const F16x3Problem& p, int splits);
bool launch_f16x3_split_k_mn(const F16x3Problem& p, int splits, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

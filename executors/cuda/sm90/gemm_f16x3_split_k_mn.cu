// The split-K fp32 GEMM on fp16 tensor cores reading W MN-major (gemm_f16x3_mn_major.h);
// built without programmatic launch for the reason gemm_f16x3_split_k.cu gives.
#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#undef CUTLASS_ENABLE_GDC_FOR_SM90

#include "gemm_f16x3_mn_major.h"

#include "f16x3_kernel.cuh"

namespace gemmfuse::cuda::sm90 {

size_t f16x3_split_k_mn_workspace_bytes(const F16x3Problem& p, int splits) {
  return workspace_size<SplitKMN>(p, splits);
}

bool launch_f16x3_split_k_mn(const F16x3Problem& p, int splits, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  return launch<SplitKMN>(p, splits, workspace, workspace_bytes, stream, /*pdl=*/false);
}

}  // namespace gemmfuse::cuda::sm90
#endif

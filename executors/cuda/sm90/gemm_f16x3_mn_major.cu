// The fp32 GEMM on fp16 tensor cores reading W MN-major, the wide kernel and the wide one over
// a row count read on the device (gemm_f16x3_mn_major.h), in a file of their own so that they
// build beside the others.
#if defined(GEMMFUSE_WITH_SM90_KERNELS)

#include "gemm_f16x3_mn_major.h"

#include "f16x3_kernel.cuh"

namespace gemmfuse::cuda::sm90 {

size_t f16x3_mn_major_workspace_bytes(const F16x3Problem& p, int splits) {
  return splits > 1 ? f16x3_split_k_mn_workspace_bytes(p, splits) : workspace_size<WideMN>(p, 1);
}

// Programmatic, as the K-major wide and counted kernels (gemm_f16x3.cu, gemm_f16x3_counted.cu).
bool launch_f16x3_mn_major(const F16x3Problem& p, int splits, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  if (p.rows) return launch<CountedMN>(p, 1, workspace, workspace_bytes, stream, /*pdl=*/true);
  if (splits > 1) return launch_f16x3_split_k_mn(p, splits, workspace, workspace_bytes, stream);
  return launch<WideMN>(p, 1, workspace, workspace_bytes, stream, /*pdl=*/true);
}

}  // namespace gemmfuse::cuda::sm90
#endif

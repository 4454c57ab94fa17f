// The split-K kernel of the fp32 GEMM on fp16 tensor cores (f16x3_kernel.cuh), in a file of
// its own because it is built without programmatic dependent launch: CUTLASS 4.2's stream-K
// scheduler does not compile with CUTLASS_ENABLE_GDC_FOR_SM90 (its const is_last_tile, which
// only the GDC path calls, binds a member to a non-const reference). Without it the kernel's
// load warps do not wait on the grid before them, so it is launched as an ordinary kernel,
// after the memset that clears its reduction flags.
#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#undef CUTLASS_ENABLE_GDC_FOR_SM90

#include "gemm_f16x3_split_k.h"

#include "f16x3_kernel.cuh"

namespace gemmfuse::cuda::sm90 {

size_t f16x3_split_k_workspace_bytes(const F16x3Problem& p, int splits) {
  return workspace_size<SplitK>(p, splits);
}

// The CTAs of one tile add their partial sums into the workspace in K order, each waiting
// only for the ranges before its own, which run on CTAs of lower index (scheduled first:
// CUTLASS's stream-K design; its persistent grid has at most one CTA per SM).
bool launch_f16x3_split_k(const F16x3Problem& p, int splits, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  return launch<SplitK>(p, splits, workspace, workspace_bytes, stream, /*pdl=*/false);
}

}  // namespace gemmfuse::cuda::sm90
#endif

// The wide fp32 GEMM on fp16 tensor cores over the first *rows rows (f16x3_kernel.cuh's
// Counted, counted_rows_scheduler.h), in a file of its own so that it builds beside the others.
#if defined(GEMMFUSE_WITH_SM90_KERNELS)

#include "gemm_f16x3_counted.h"

#include "f16x3_kernel.cuh"

namespace gemmfuse::cuda::sm90 {

// Programmatic (PDL): the scheduler waits for the grid before it, whose output the count is,
// before any CTA takes a tile, and the load warps wait too (CUTLASS_ENABLE_GDC_FOR_SM90).
bool launch_f16x3_counted(const F16x3Problem& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  return launch<Counted>(p, 1, workspace, workspace_bytes, stream, /*pdl=*/true);
}

}  // namespace gemmfuse::cuda::sm90
#endif

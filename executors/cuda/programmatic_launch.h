// Programmatic dependent launch (PDL, sm_90+) for the executor's short kernels that follow
// another kernel in the stream (the splits, the fix-up, the fused column statistics, the
// register row pass; CUTLASS's kernels have their own switch for it): the kernel's CTAs are
// scheduled as the previous kernel's CTAs end, instead of after the whole grid has retired
// and the next launch has been processed, and wait in hardware for that grid's results.
//
// The contract, for a kernel launched with launch_programmatic:
// - it calls wait_for_previous_grid() before its first global-memory access (read or write);
//   every grid ahead of it in the stream has then completed and its writes are visible (the
//   previous grid completed only after its own wait, so this holds transitively);
// - it may call let_next_grid_start() to let the stream's next kernel be scheduled early;
//   that kernel still waits for this one to complete if it was launched programmatically,
//   and starts after completion as usual if not.
// On devices before sm_90 the launch is an ordinary one and both calls compile to nothing.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda_check.h"
#include "device_info.h"

namespace gemmfuse::cuda {

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_next_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), programmatic where the device has PDL.
template <class... Params, class... Args>
void launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (compute_capability() >= 90) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  GF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace gemmfuse::cuda

// Whether the current stream of t's device is being captured into a CUDA graph. Cached
// device state (prepared weights, converted operands) is then built inside the graph instead
// of reused: a replay skips the host code that would see a weight change.
#pragma once

#include <ATen/ATen.h>

#ifdef GEMMFUSE_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace gemmfuse::bindings {

inline bool graph_capturing(const at::Tensor& t) {
#ifdef GEMMFUSE_WITH_CUDA
  return t.is_cuda() &&
         c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  (void)t;
  return false;
#endif
}

}  // namespace gemmfuse::bindings

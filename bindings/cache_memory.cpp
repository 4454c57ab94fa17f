#include "cache_memory.h"

#include <future>

#ifdef GEMMFUSE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace gemmfuse::bindings {

at::Tensor cache_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
#ifdef GEMMFUSE_WITH_CUDA
  if (options.device().is_cuda()) {
    const c10::DeviceIndex dev = options.device().index();
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(dev);
    const std::vector<int64_t> shape(sizes.begin(), sizes.end());
    at::Tensor t = std::async(std::launch::async, [&] {
                     c10::cuda::CUDAGuard guard(dev);
                     return at::empty(shape, options);
                   }).get();
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), caller);
    return t;
  }
#endif
  return at::empty(sizes, options);
}

}  // namespace gemmfuse::bindings

// Properties of the current device that launch configurations depend on.
#pragma once

#include <cuda_runtime.h>

namespace gemmfuse::cuda {

// Streaming multiprocessors of the current device (132 on an H100 SXM if the query fails).
inline int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 132;
  }
  return n;
}

}  // namespace gemmfuse::cuda

// Properties of the current device that launch configurations depend on.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace gemmfuse::cuda {

// Streaming multiprocessors of the current device (132 on an H100 SXM if the query fails),
// queried once per device: it is asked on every launch of the kernels that size their grids
// by it.
inline int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices] = {};  // 0: not queried yet
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 132;
  }
  if (dev >= 0 && dev < kMaxDevices && (n = known[dev].load(std::memory_order_relaxed)) > 0) return n;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  if (dev >= 0 && dev < kMaxDevices) known[dev].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace gemmfuse::cuda

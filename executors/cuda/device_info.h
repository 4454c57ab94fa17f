// Properties of the current device that launch configurations depend on.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace gemmfuse::cuda {

constexpr int kMaxDevices = 64;

// A property of the current device, read once per device by query(dev, &value) (true and a
// value > 0 when it succeeds) and kept in `known` (0: not read yet); `fallback` when the
// device or the query fails.
template <class Query>
inline int per_device(std::atomic<int> (&known)[kMaxDevices], int fallback, Query query) {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return fallback;
  }
  if (dev >= 0 && dev < kMaxDevices && (v = known[dev].load(std::memory_order_relaxed)) > 0) return v;
  if (!query(dev, &v) || v <= 0) {
    (void)cudaGetLastError();
    return fallback;
  }
  if (dev >= 0 && dev < kMaxDevices) known[dev].store(v, std::memory_order_relaxed);
  return v;
}

// Streaming multiprocessors of the current device (132 on an H100 SXM if the query fails),
// read once per device: it is asked on every launch of the kernels that size their grids
// by it.
inline int sm_count() {
  static std::atomic<int> known[kMaxDevices] = {};
  return per_device(known, 132, [](int dev, int* n) {
    return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess;
  });
}

// The current device's compute capability as major * 10 + minor (90 on an H100/H200), 0 when
// it cannot be read; read once per device (asked on every call of an fp32 GEMM plan).
inline int compute_capability() {
  static std::atomic<int> known[kMaxDevices] = {};
  return per_device(known, 0, [](int dev, int* cc) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
      return false;
    *cc = major * 10 + minor;
    return true;
  });
}

}  // namespace gemmfuse::cuda

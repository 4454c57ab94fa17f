// Properties of the current device that launch configurations depend on.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda_check.h"

namespace gemmfuse::cuda {

constexpr int kMaxDevices = 64;

// A property of device `dev`, read once per device by query(dev, &value) (true and a value > 0
// when it succeeds) and kept in `known` (0: not read yet); `fallback` when the query fails.
template <class Query>
inline int per_device_at(int dev, std::atomic<int> (&known)[kMaxDevices], int fallback,
                         Query query) {
  int v = 0;
  if (dev >= 0 && dev < kMaxDevices && (v = known[dev].load(std::memory_order_relaxed)) > 0) return v;
  if (!query(dev, &v) || v <= 0) {
    (void)cudaGetLastError();
    return fallback;
  }
  if (dev >= 0 && dev < kMaxDevices) known[dev].store(v, std::memory_order_relaxed);
  return v;
}

// The same of the current device; `fallback` when there is none.
template <class Query>
inline int per_device(std::atomic<int> (&known)[kMaxDevices], int fallback, Query query) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return fallback;
  }
  return per_device_at(dev, known, fallback, query);
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

// Device `dev`'s compute capability as major * 10 + minor (90 on an H100/H200), 0 when it
// cannot be read; read once per device (asked on every call of an fp32 GEMM plan).
inline int compute_capability_of(int dev) {
  static std::atomic<int> known[kMaxDevices] = {};
  return per_device_at(dev, known, 0, [](int d, int* cc) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d) != cudaSuccess)
      return false;
    *cc = major * 10 + minor;
    return true;
  });
}

inline int compute_capability() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return compute_capability_of(dev);
}

// The most dynamic shared memory a block of device `dev` may opt into (bytes; 0 when it
// cannot be read), read once per device.
inline int shared_memory_optin_of(int dev) {
  static std::atomic<int> known[kMaxDevices] = {};
  return per_device_at(dev, known, 0, [](int d, int* bytes) {
    return cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, d) ==
           cudaSuccess;
  });
}

// Opts `kernel` into `bytes` of dynamic shared memory on the current device, once per device:
// `done` (the caller's static, one per kernel) holds a bit per device id.
inline void allow_dynamic_shared(const void* kernel, int bytes, std::atomic<uint64_t>& done) {
  int dev = 0;
  GF_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (bit && (done.load(std::memory_order_acquire) & bit)) return;
  GF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit, std::memory_order_release);
}

}  // namespace gemmfuse::cuda

// Helpers of the CUDA test suites: skipping without a GPU, checked CUDA calls, and device
// memory poisoned with NaN so that anything a kernel fails to write shows up.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace gftest {

inline bool gpu_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define SKIP_WITHOUT_GPU()                                          \
  do {                                                              \
    if (!::gftest::gpu_present()) GTEST_SKIP() << "no CUDA device available"; \
  } while (0)

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CK(call) ::gftest::ck((call), #call)

// Device memory for one test; poisoned with 0xFF bytes (NaN in fp32, bf16 and fp16).
struct DevMem {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevMem(size_t n) : bytes(n) {
    CK(cudaMalloc(&p, std::max<size_t>(n, 256)));
    CK(cudaMemset(p, 0xFF, std::max<size_t>(n, 256)));
  }
  ~DevMem() { cudaFree(p); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
};

}  // namespace gftest

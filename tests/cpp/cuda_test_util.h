// Helpers of the CUDA test suites: skipping without a GPU, checked CUDA calls, and device
// memory poisoned with NaN so that anything a kernel fails to write shows up.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace gftest {

inline bool gpu_present() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

// Whether the current device is an sm_90 GPU (H100/H200): the sm90 kernels' tests need one.
inline bool is_sm90() {
  int dev = 0;
  cudaDeviceProp prop;
  return cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess &&
         prop.major == 9 && prop.minor == 0;
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

// mma.sync m16n8k16 with fp32 accumulation (the attention kernels) needs sm_80 or newer.
#define SKIP_WITHOUT_SM80()                                                                 \
  do {                                                                                     \
    SKIP_WITHOUT_GPU();                                                                    \
    int dev = 0, major = 0;                                                                \
    CK(cudaGetDevice(&dev));                                                               \
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));            \
    if (major < 8) GTEST_SKIP() << "mma.sync m16n8k16 with fp32 accumulation needs sm_80+"; \
  } while (0)

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

// One output of Y = x W^T (+ b) in float64 (x and W row-major, K wide): its value, and
// sum_k |x w| (+ |b|), the scale of a rounding bound. b: the bias value, or null.
struct DotRef {
  double value = 0, mag = 0;
};
inline DotRef dot_ref(const std::vector<float>& x, const std::vector<float>& w, const float* b,
                      int64_t m, int64_t n, int64_t K) {
  DotRef r;
  if (b) {
    r.value = *b;
    r.mag = std::fabs(*b);
  }
  for (int64_t k = 0; k < K; ++k) {
    const double p = static_cast<double>(x[m * K + k]) * w[n * K + k];
    r.value += p;
    r.mag += std::fabs(p);
  }
  return r;
}

}  // namespace gftest

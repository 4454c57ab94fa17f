// Error checking for the CUDA executor: every CUDA and cuBLAS(Lt) return code goes through
// these, and a failure throws std::runtime_error naming the call, the file and the line.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace gemmfuse::cuda {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* what, const char* file, int line) {
  throw std::runtime_error(std::string("gemmfuse CUDA error: ") + what + " -> " +
                           cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") at " + file +
                           ":" + std::to_string(line));
}

[[noreturn]] inline void throw_cublas(cublasStatus_t s, const char* what, const char* file,
                                      int line) {
  throw std::runtime_error(std::string("gemmfuse cuBLAS error: ") + what + " -> status " +
                           std::to_string(static_cast<int>(s)) + " at " + file + ":" +
                           std::to_string(line));
}

}  // namespace gemmfuse::cuda

#define GF_CUDA_CHECK(call)                                                       \
  do {                                                                            \
    cudaError_t gf_err_ = (call);                                                 \
    if (gf_err_ != cudaSuccess) ::gemmfuse::cuda::throw_cuda(gf_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define GF_CUBLAS_CHECK(call)                                                     \
  do {                                                                            \
    cublasStatus_t gf_st_ = (call);                                               \
    if (gf_st_ != CUBLAS_STATUS_SUCCESS)                                          \
      ::gemmfuse::cuda::throw_cublas(gf_st_, #call, __FILE__, __LINE__);          \
  } while (0)

// After a kernel launch: a bad launch configuration shows up here (no sync; asynchronous
// faults surface at the caller's next synchronising call, as for any CUDA library).
#define GF_LAUNCH_CHECK() GF_CUDA_CHECK(cudaGetLastError())

// The CUDA executor's cuBLAS and cuBLASLt handles: one of each per device, created on first
// use and kept for the process (never destroyed: destroying at static-destruction time races
// the driver's teardown), in one table behind one mutex. Both read the current device.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace gemmfuse::cuda {

// The device's cuBLAS handle, set to run on `stream` (the backward's dx and dW).
cublasHandle_t cublas_handle(cudaStream_t stream);

// The device's cuBLASLt handle (the forward's Gemm step); cuBLASLt takes the stream per call.
cublasLtHandle_t cublaslt_handle();

}  // namespace gemmfuse::cuda

// The per-device cuBLAS and cuBLASLt handles (blas_handles.h).
#include "blas_handles.h"

#include <mutex>
#include <vector>

#include "cuda_check.h"

namespace gemmfuse::cuda {
namespace {

struct DeviceHandles {
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
};

std::mutex g_mutex;
std::vector<DeviceHandles> g_devices;  // indexed by device

int current_device() {
  int dev = 0;
  GF_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

// Device `dev`'s handles, null until made; the caller holds g_mutex.
DeviceHandles& entry(int dev) {
  if (g_devices.size() <= static_cast<size_t>(dev)) g_devices.resize(dev + 1);
  return g_devices[dev];
}

}  // namespace

cublasHandle_t cublas_handle(cudaStream_t stream) {
  const int dev = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceHandles& d = entry(dev);
  if (!d.blas) GF_CUBLAS_CHECK(cublasCreate(&d.blas));
  GF_CUBLAS_CHECK(cublasSetStream(d.blas, stream));
  return d.blas;
}

cublasLtHandle_t cublaslt_handle() {
  const int dev = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceHandles& d = entry(dev);
  if (!d.lt) GF_CUBLAS_CHECK(cublasLtCreate(&d.lt));
  return d.lt;
}

}  // namespace gemmfuse::cuda

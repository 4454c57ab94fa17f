// Host stubs of the CUDA runtime for running the project's GoogleTest files through the fiber
// emulator (emu.h) without libcudart: force-include this header (-include emu_rt.h) into every
// translation unit, kernels and tests alike. "Device" memory is host memory; copies of any kind
// are memcpy; launches run synchronously (emu::launch), so every sync is a no-op. The device
// reported is an sm_90 one with 227 KiB of opt-in shared memory per block (emu.h's
// cudaDeviceGetAttribute).
#pragma once
#include "emu.h"

#include <cstdlib>
#include <cstring>

namespace emu::rt {
inline cudaError_t malloc_(void** p, size_t n) {
  const size_t bytes = (std::max<size_t>(n, 1) + 255) / 256 * 256;
  *p = std::aligned_alloc(256, bytes);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
template <class T> cudaError_t malloc_(T** p, size_t n) { return malloc_(reinterpret_cast<void**>(p), n); }
inline cudaError_t free_(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t memcpy_(void* d, const void* s, size_t n, cudaMemcpyKind) {
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
inline cudaError_t memcpyAsync_(void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t = 0) {
  return memcpy_(d, s, n, k);
}
inline cudaError_t memset_(void* p, int v, size_t n) { std::memset(p, v, n); return cudaSuccess; }
inline cudaError_t ok_() { return cudaSuccess; }
inline cudaError_t streamSync_(cudaStream_t) { return cudaSuccess; }
inline cudaError_t getDeviceCount_(int* n) { *n = 1; return cudaSuccess; }
inline cudaError_t setDevice_(int) { return cudaSuccess; }
inline const char* errorString_(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated CUDA error"; }
inline const char* errorName_(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }
inline cudaError_t getDeviceProperties_(cudaDeviceProp* p, int) {
  std::memset(p, 0, sizeof *p);
  std::strcpy(p->name, "emulated sm_90");
  p->major = 9, p->minor = 0;
  p->multiProcessorCount = 132;
  p->sharedMemPerBlock = 48 * 1024;
  p->sharedMemPerBlockOptin = 227 * 1024;
  p->maxThreadsPerBlock = 1024;
  p->warpSize = 32;
  return cudaSuccess;
}
}  // namespace emu::rt

// a device-wide float atomic add (emu.h has the float one)
inline double atomicAdd(double* p, double v) { double o = *p; *p = o + v; return o; }
inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }

#define cudaMalloc emu::rt::malloc_
#define cudaFree emu::rt::free_
#define cudaMemcpy emu::rt::memcpy_
#define cudaMemcpyAsync emu::rt::memcpyAsync_
#define cudaMemset emu::rt::memset_
#define cudaDeviceSynchronize emu::rt::ok_
#define cudaStreamSynchronize emu::rt::streamSync_
#define cudaPeekAtLastError emu::rt::ok_
#define cudaGetDeviceCount emu::rt::getDeviceCount_
#define cudaSetDevice emu::rt::setDevice_
#define cudaGetErrorString emu::rt::errorString_
#define cudaGetErrorName emu::rt::errorName_
#define cudaGetDeviceProperties emu::rt::getDeviceProperties_

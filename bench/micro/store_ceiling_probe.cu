// How fast can the fused softmax kernel's last phase store its output? Each of its 128 CTAs
// (one per SM) writes 128 rows x 1 KB of the 16 MB bf16 output (rows 16 KB apart) from shared
// memory, all at about the same time, into an L2 full of clean lines (W streamed through it
// just before). The kernel's stores take ~3.6 us (~4.4 TB/s; docs/measurements.md): at the
// ceiling, or would another way of storing (more threads, TMA bulk copies) be faster?
// Each variant: the previous call's output written, 128 MB read through L2 (like W), then the
// timed kernel: its CTAs meet at a grid barrier (all resident: 128 CTAs, one per SM), stamp
// %globaltimer, store 128 KB each from shared memory, fence, stamp again. Reported: the
// phase from the first CTA's start to the last CTA's fenced end, median over launches.
//   Built by CMake with -DGEMMFUSE_BUILD_PROBES=ON (target store_ceiling_probe).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_check.h"

constexpr int kCtas = 128, kRows = 128, kRowBytes = 1024, kPitch = 16384;  // bytes
constexpr int kTileBytes = kRows * kRowBytes;                               // 128 KB per CTA

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// All CTAs resident: one arrives per CTA, then all spin until the count is reached.
__device__ void grid_meet(unsigned* count, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicAdd(count, 1u);
    while (atomicAdd(count, 0u) < target) {
    }
  }
  __syncthreads();
}

// mode 0: 16-byte st.global by `storers` threads (the fused kernel: 256); mode 1: TMA bulk
// copies, one per 1 KB row, issued by the first warp's lanes.
__global__ void store_tile(char* out, unsigned* count, unsigned target, int mode, int storers,
                           unsigned long long* stamps) {
  extern __shared__ __align__(128) char tile[];
  for (int i = threadIdx.x; i < kTileBytes / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(tile)[i] = make_uint4(i, blockIdx.x, 3u, 5u);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  grid_meet(count, target);
  const unsigned long long t0 = now();
  char* base = out + static_cast<size_t>(blockIdx.x / 16) * kRows * kPitch + (blockIdx.x % 16) * kRowBytes;
  if (mode == 0) {
    if (threadIdx.x < storers) {
      constexpr int kVecPerRow = kRowBytes / 16;
      for (int i = threadIdx.x; i < kRows * kVecPerRow; i += storers) {
        const int r = i / kVecPerRow, c = i % kVecPerRow;
        const uint4 v = reinterpret_cast<const uint4*>(tile)[i];
        *reinterpret_cast<uint4*>(base + static_cast<size_t>(r) * kPitch + c * 16) = v;
      }
    }
  } else if (threadIdx.x < 32) {
    for (int r = threadIdx.x; r < kRows; r += 32) {
      const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(tile + r * kRowBytes));
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                       base + static_cast<size_t>(r) * kPitch),
                   "r"(src), "n"(kRowBytes)
                   : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[2 * blockIdx.x] = t0;
    stamps[2 * blockIdx.x + 1] = now();
  }
}

__global__ void stream_read(const uint4* p, size_t n, unsigned* sink) {
  unsigned s = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    s ^= v.x ^ v.w;
  }
  if (s == 0x12345678u) *sink = s;
}

__global__ void write_prev(uint4* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(unsigned(i), 1u, 2u, 3u);
}

int main() {
  const size_t out_bytes = size_t(kCtas / 16) * kRows * kPitch;  // 16 MB
  const size_t stream_bytes = size_t(128) << 20;
  char *out, *prev;
  uint4* w;
  unsigned *count, *sink;
  unsigned long long* stamps;
  CHECK_CUDA(cudaMalloc(&out, out_bytes));
  CHECK_CUDA(cudaMalloc(&prev, out_bytes));
  CHECK_CUDA(cudaMalloc(&w, stream_bytes));
  CHECK_CUDA(cudaMalloc(&count, 4));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMalloc(&stamps, 2 * kCtas * sizeof(unsigned long long)));
  CHECK_CUDA(cudaMemset(w, 1, stream_bytes));
  CHECK_CUDA(cudaFuncSetAttribute(store_tile, cudaFuncAttributeMaxDynamicSharedMemorySize, kTileBytes));
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("16 MB stored by %d CTAs (one per SM, %d SMs) from shared memory, rows of 1 KB 16 KB apart\n",
              kCtas, sms);
  struct Variant {
    const char* name;
    int mode, threads, storers;
  } variants[] = {{"st.global.v4, 256 of 384 threads (the fused kernel)", 0, 384, 256},
                  {"st.global.v4, all 384 threads", 0, 384, 384},
                  {"st.global.v4, 512 threads", 0, 512, 512},
                  {"TMA bulk copy per 1 KB row (32 lanes issue)", 1, 384, 0}};
  std::vector<unsigned long long> h(2 * kCtas);
  for (int round = 0; round < 2; ++round)
    for (const Variant& v : variants) {
      std::vector<double> phase, per_cta;
      for (int it = 0; it < 30; ++it) {
        write_prev<<<1024, 256>>>(reinterpret_cast<uint4*>(prev), out_bytes / 16);
        stream_read<<<1024, 512>>>(w, stream_bytes / 16, sink);
        CHECK_CUDA(cudaMemset(count, 0, 4));
        store_tile<<<kCtas, v.threads, kTileBytes>>>(out, count, kCtas, v.mode, v.storers, stamps);
        CHECK_CUDA(cudaGetLastError());
        CHECK_CUDA(cudaMemcpy(h.data(), stamps, h.size() * 8, cudaMemcpyDeviceToHost));
        unsigned long long t0 = ~0ull, t1 = 0;
        std::vector<double> d;
        for (int c = 0; c < kCtas; ++c) {
          t0 = std::min(t0, h[2 * c]);
          t1 = std::max(t1, h[2 * c + 1]);
          d.push_back(double(h[2 * c + 1] - h[2 * c]));
        }
        std::sort(d.begin(), d.end());
        if (it >= 3) {
          phase.push_back(double(t1 - t0));
          per_cta.push_back(d[d.size() / 2]);
        }
      }
      std::sort(phase.begin(), phase.end());
      std::sort(per_cta.begin(), per_cta.end());
      const double us = phase[phase.size() / 2] / 1e3;
      std::printf("round %d  %-52s phase %.2f us (%.2f TB/s), median CTA %.2f us, phase min %.2f max %.2f us\n",
                  round, v.name, us, out_bytes / (us * 1e-6) / 1e12, per_cta[per_cta.size() / 2] / 1e3,
                  phase.front() / 1e3, phase.back() / 1e3);
    }
  return 0;
}

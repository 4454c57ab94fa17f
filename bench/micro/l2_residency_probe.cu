// Does a 16 MB buffer written with an L2 evict_last hint stay in L2 while a GEMM streams its
// operands through? A fused softmax that writes each tile's exp(v - max) through L2 into the
// output buffer, instead of keeping it in shared memory, and rescales it in place after the
// grid barrier only pays if the read-back hits L2. This writes the buffer (evict_last, or the
// default policy), runs the seed-shape bf16 cuBLAS GEMM (x 16 MB, W 128 MB, out 16 MB), then
// times reading the buffer back, against a read of the same buffer straight after writing it
// (L2) and after flushing L2 (HBM).
//   Built by CMake with -DGEMMFUSE_BUILD_PROBES=ON (target l2_residency_probe).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

// Writes n 16-byte vectors; evict_last: with an L2::evict_last cache policy.
__global__ void write_buf(uint4* p, size_t n, unsigned seed, bool evict_last) {
  unsigned long long policy = 0;
  if (evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = make_uint4(unsigned(i) ^ seed, seed, unsigned(i), 7u);
    if (evict_last)
      asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p + i), "r"(v.x),
                   "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy) : "memory");
    else
      p[i] = v;
  }
}

// Reads n 16-byte vectors (sum kept so the loads stay).
__global__ void read_buf(const uint4* p, size_t n, unsigned* sink) {
  unsigned s = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    s ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (s == 0x12345678u) *sink = s;
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(((unsigned(i) * 2654435761u ^ seed) >> 8) * (1.0f / 16777216.0f) - 0.5f);
}

int main() {
  const int M = 1024, N = 8192, K = 8192;
  const size_t buf_bytes = size_t(M) * N * 2;  // the bf16 output's size
  const size_t nvec = buf_bytes / 16;
  uint4 *buf, *flush;
  unsigned* sink;
  __nv_bfloat16 *x, *w, *y;
  CHECK_CUDA(cudaMalloc(&buf, buf_bytes));
  CHECK_CUDA(cudaMalloc(&flush, size_t(256) << 20));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMalloc(&x, size_t(M) * K * 2));
  CHECK_CUDA(cudaMalloc(&w, size_t(N) * K * 2));
  CHECK_CUDA(cudaMalloc(&y, size_t(M) * N * 2));
  fill<<<1024, 256>>>(x, size_t(M) * K, 1);
  fill<<<1024, 256>>>(w, size_t(N) * K, 2);
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1.f, zero = 0.f;
  auto gemm = [&] {
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, x, CUDA_R_16BF, K,
                 &zero, y, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  auto timed_read = [&] {
    cudaEventRecord(a);
    read_buf<<<sms * 8, 256>>>(buf, nvec, sink);
    cudaEventRecord(b);
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    return ms * 1e3f;
  };
  struct Case {
    const char* name;
    bool evict_last, gemm_between, flush_between;
  };
  const Case cases[] = {
      {"read right after writing (L2)", false, false, false},
      {"read after an L2 flush (HBM)", false, false, true},
      {"default policy, GEMM in between", false, true, false},
      {"evict_last, GEMM in between", true, true, false},
  };
  std::printf("16 MB buffer, bf16 GEMM %dx%dx%d in between; median of 21 reads, us\n", M, N, K);
  for (const Case& c : cases) {
    std::vector<float> t;
    for (int rep = 0; rep < 21; ++rep) {
      write_buf<<<sms * 8, 256>>>(buf, nvec, 11u + rep, c.evict_last);
      if (c.flush_between) CHECK_CUDA(cudaMemsetAsync(flush, rep, size_t(256) << 20));
      if (c.gemm_between) gemm();
      t.push_back(timed_read());
    }
    std::sort(t.begin(), t.end());
    std::printf("  %-36s %7.2f us  (%.2f TB/s)\n", c.name, t[t.size() / 2],
                buf_bytes / (t[t.size() / 2] * 1e-6) / 1e12);
  }
  // Leave no evict_last lines behind for whatever runs next.
  CHECK_CUDA(cudaCtxResetPersistingL2Cache());
  return 0;
}

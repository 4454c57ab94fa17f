// The three-part bf16 split of fp32 operands for the sm90 fp32 GEMM (split.h,
// sm90/gemm_bf16x6.h), and the fp32 recompute of the rows and columns of Y whose inputs the
// split cannot carry.
#include <cuda_bf16.h>

#include <algorithm>
#include <stdexcept>

#include "cuda_check.h"
#include "device_info.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

// A CTA per row (grid-stride over rows), 8 values a thread per step: two 16-byte loads, one
// 16-byte store per part plane. Memory bound.
__global__ void __launch_bounds__(256)
    split_bf16x3_kernel(const float* __restrict__ src, int64_t rows, int64_t K,
                        __nv_bfloat16* __restrict__ parts, int* __restrict__ list) {
  const int64_t plane = rows * K;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = src + r * K;
    bool exceptional = false;
    for (int64_t c = 8 * static_cast<int64_t>(threadIdx.x); c < K; c += 8 * blockDim.x) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(row + c));
      const float4 b = __ldg(reinterpret_cast<const float4*>(row + c + 4));
      const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      __nv_bfloat16 p[3][8];
#pragma unroll
      for (int j = 0; j < 8; ++j) exceptional |= !split_bf16x3(v[j], p[0][j], p[1][j], p[2][j]);
#pragma unroll
      for (int i = 0; i < 3; ++i) {
        uint4 u;
        u.x = pack_bf16x2(p[i][0], p[i][1]);
        u.y = pack_bf16x2(p[i][2], p[i][3]);
        u.z = pack_bf16x2(p[i][4], p[i][5]);
        u.w = pack_bf16x2(p[i][6], p[i][7]);
        *reinterpret_cast<uint4*>(parts + i * plane + r * K + c) = u;
      }
    }
    if (__syncthreads_or(exceptional) && threadIdx.x == 0) list[1 + atomicAdd(list, 1)] = static_cast<int>(r);
  }
}

// One warp per output: lanes take every 32nd k, fp32 FMA, then a warp tree. Outputs are
// numbered rows first (x_rows[0] * N of them), then columns (w_rows[0] * M); an output in
// both is written twice with the same value.
__global__ void __launch_bounds__(256)
    fixup_kernel(const float* __restrict__ x, const float* __restrict__ w,
                 const float* __restrict__ bias, float* __restrict__ y, int64_t M, int64_t N,
                 int64_t K, const int* __restrict__ x_rows, const int* __restrict__ w_rows) {
  const int64_t n_rows = x_rows[0], n_cols = w_rows[0];
  const int64_t total = n_rows * N + n_cols * M;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < total;
       i += warps) {
    int64_t m, n;
    if (i < n_rows * N) {
      m = x_rows[1 + i / N];
      n = i % N;
    } else {
      const int64_t j = i - n_rows * N;
      n = w_rows[1 + j / M];
      m = j % M;
    }
    const float* xr = x + m * K;
    const float* wr = w + n * K;
    float acc = 0.f;
    for (int64_t k = lane; k < K; k += 32) acc = fmaf(__ldg(xr + k), __ldg(wr + k), acc);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[m * N + n] = bias ? acc + bias[n] : acc;
  }
}

}  // namespace

void launch_split_bf16x3(const float* src, int64_t rows, int64_t K, __nv_bfloat16* parts,
                         int* list, cudaStream_t stream) {
  if (K % 8 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(parts) % 16 != 0)
    throw std::logic_error("CUDA bf16x3 split: K must be a multiple of 8 and the buffers 16-byte aligned");
  if (rows <= 0 || K <= 0) return;
  const int64_t grid = std::min<int64_t>(rows, int64_t(sm_count()) * 8);
  split_bf16x3_kernel<<<static_cast<unsigned>(grid), 256, 0, stream>>>(src, rows, K, parts, list);
  GF_LAUNCH_CHECK();
}

void launch_fixup_exceptional(const float* x, const float* w, const float* bias, float* y,
                              int64_t M, int64_t N, int64_t K, const int* x_rows,
                              const int* w_rows, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return;
  fixup_kernel<<<static_cast<unsigned>(sm_count()) * 2, 256, 0, stream>>>(x, w, bias, y, M, N, K,
                                                                         x_rows, w_rows);
  GF_LAUNCH_CHECK();
}

}  // namespace gemmfuse::cuda

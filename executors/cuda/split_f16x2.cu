// The row-scaled two-part fp16 split of fp32 operands for the sm90 fp32 GEMM (split.h,
// sm90/gemm_f16x3.h), and the fp32 recompute of the rows and columns of Y whose inputs a
// split cannot carry (this one's and `fast`'s).
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cfloat>
#include <stdexcept>

#include "cuda_check.h"
#include "device_info.h"
#include "programmatic_launch.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kSplitThreads = 256;

// Eight values of a row from c on (two 16-byte loads).
__device__ __forceinline__ void load8(const float* __restrict__ row, int64_t c, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(row + c));
  const float4 b = __ldg(reinterpret_cast<const float4*>(row + c + 4));
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// A CTA per row (grid-stride over rows), 8 values a thread per step: the row's largest finite
// magnitude first, then one 16-byte store per part plane. With kSteps > 0 the row stays in
// registers between the two (K <= kSteps * 8 * kSplitThreads): one read of x; with 0 the row
// is read again for the split, from L2. Memory bound.
template <int kSteps>
__global__ void __launch_bounds__(kSplitThreads)
    split_f16x2_kernel(const float* __restrict__ src, int64_t rows, int64_t K,
                       __half* __restrict__ parts, float* __restrict__ exps, RowMarks marks) {
  using Reduce = cub::BlockReduce<float, kSplitThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ float row_max;
  constexpr int64_t kStride = 8 * kSplitThreads;
  float held[kSteps > 0 ? kSteps : 1][8];
  wait_for_previous_grid();  // launched programmatically
  const int64_t plane = rows * K, first = 8 * static_cast<int64_t>(threadIdx.x);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = src + r * K;
    float top = 0.f;
    bool exceptional = false;
    auto see = [&](const float (&v)[8]) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float m = fabsf(v[j]);
        exceptional |= !(m <= FLT_MAX);  // NaN or infinite
        top = fmaxf(top, m);             // fmaxf drops a NaN operand
      }
    };
    if constexpr (kSteps > 0) {
#pragma unroll
      for (int i = 0; i < kSteps; ++i)  // every load in flight before the first use
        if (first + i * kStride < K) load8(row, first + i * kStride, held[i]);
#pragma unroll
      for (int i = 0; i < kSteps; ++i)
        if (first + i * kStride < K) see(held[i]);
    } else {
      for (int64_t c = first; c < K; c += kStride) {
        load8(row, c, held[0]);
        see(held[0]);
      }
    }
    const float block_top = Reduce(reduce).Reduce(top, [](float a, float b) { return fmaxf(a, b); });
    exceptional = __syncthreads_or(exceptional);  // also orders reduce's storage for reuse
    if (threadIdx.x == 0) row_max = block_top;
    __syncthreads();
    const float m = row_max;
    const int e = exceptional || m == 0.f ? 0 : 14 - ilogbf(m);
    bool tiny = false;  // a nonzero value below fp16's normal range once scaled
    auto split = [&](const float (&v)[8], int64_t c) {
      __half p[2][8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float s = exceptional ? 0.f : ldexpf(v[j], e);
        tiny |= s != 0.f && fabsf(s) < 0x1p-14f;
        p[0][j] = __float2half_rn(s);
        p[1][j] = __float2half_rn((s - __half2float(p[0][j])) * 0x1p11f);  // the difference is exact
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<uint4*>(parts + i * plane + r * K + c) = *reinterpret_cast<const uint4*>(p[i]);
    };
    if constexpr (kSteps > 0) {
#pragma unroll
      for (int i = 0; i < kSteps; ++i)
        if (first + i * kStride < K) split(held[i], first + i * kStride);
    } else {
      for (int64_t c = first; c < K; c += kStride) {
        load8(row, c, held[0]);
        split(held[0], c);
      }
    }
    if (threadIdx.x == 0) exps[r] = static_cast<float>(e);
    mark_row(exceptional || tiny, r, marks);  // its __syncthreads also guards row_max for the next row
  }
}

constexpr int kFixupThreads = 256;
constexpr int kFlagsPerThread = 4;
constexpr int kFlagChunk = kFixupThreads * kFlagsPerThread;  // x rows listed per step

// Y[m, n] = x[m, :] . W'[n, :] (+ bias[n]) by one warp: lanes take every 32nd k, fp32 FMA,
// then a warp tree.
__device__ __forceinline__ void recompute(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ w_scale,
                                          const float* __restrict__ bias, float* __restrict__ y,
                                          int64_t m, int64_t n, int64_t N, int64_t K, int lane) {
  const float* xr = x + m * K;
  const float* wr = w + n * K;
  const float s = w_scale ? w_scale[n] : 1.f;  // W' as the split saw it (rounded once)
  float acc = 0.f;
  for (int64_t k = lane; k < K; k += 32) acc = fmaf(__ldg(xr + k), __ldg(wr + k) * s, acc);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[m * N + n] = bias ? acc + bias[n] : acc;
}

// Outputs are spread over every warp of the grid. x's marked rows are listed a chunk of
// kFlagChunk rows at a time, by every CTA in the same (ascending) order; W's come as a list.
// An output in both a marked row and a marked column is written twice with the same value.
__global__ void __launch_bounds__(kFixupThreads)
    fixup_kernel(const float* __restrict__ x, const float* __restrict__ w,
                 const float* __restrict__ w_scale, const float* __restrict__ bias,
                 float* __restrict__ y, int64_t M, int64_t N, int64_t K,
                 const int* __restrict__ x_flags, const int* __restrict__ w_list) {
  using Scan = cub::BlockScan<int, kFixupThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int rows[kFlagChunk];
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // Launched programmatically; the row pass after it may be scheduled at once (it waits for
  // this grid to complete): a fix-up with nothing marked is over in a few loads.
  wait_for_previous_grid();
  let_next_grid_start();
  const int64_t n_cols = w_list[0];  // read early: its latency overlaps the flags'
  for (int64_t base = 0; base < M; base += kFlagChunk) {
    const int64_t first = base + kFlagsPerThread * threadIdx.x;
    bool f[kFlagsPerThread];
    int count = 0;
#pragma unroll
    for (int j = 0; j < kFlagsPerThread; ++j) {
      f[j] = first + j < M && x_flags[first + j] != 0;
      count += f[j];
    }
    if (__syncthreads_or(count) == 0) continue;  // the common case: nothing marked
    int at = 0, marked = 0;
    Scan(scan).ExclusiveSum(count, at, marked);
#pragma unroll
    for (int j = 0; j < kFlagsPerThread; ++j)
      if (f[j]) rows[at++] = static_cast<int>(first + j);
    __syncthreads();
    for (int64_t i = warp; i < marked * N; i += warps)
      recompute(x, w, w_scale, bias, y, rows[i / N], i % N, N, K, lane);
    __syncthreads();  // rows and the scan storage are reused by the next chunk
  }
  for (int64_t i = warp; i < n_cols * M; i += warps)
    recompute(x, w, w_scale, bias, y, i % M, w_list[1 + i / M], N, K, lane);
}

}  // namespace

void launch_split_f16x2(const float* src, int64_t rows, int64_t K, __half* parts, float* exps,
                        RowMarks marks, cudaStream_t stream) {
  if (K % 8 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(parts) % 16 != 0)
    throw std::logic_error("CUDA fp16 split: K must be a multiple of 8 and the buffers 16-byte aligned");
  if (rows <= 0) return;
  const int64_t grid = std::min<int64_t>(rows, int64_t(sm_count()) * 8);
  const dim3 blocks(static_cast<unsigned>(grid)), threads(kSplitThreads);
  constexpr int64_t kRowStep = 8 * kSplitThreads;  // values a CTA takes per step
  if (K <= 4 * kRowStep)  // the seed's K = 8192: 32 values a thread
    launch_programmatic(split_f16x2_kernel<4>, blocks, threads, 0, stream, src, rows, K, parts, exps, marks);
  else if (K <= 8 * kRowStep)
    launch_programmatic(split_f16x2_kernel<8>, blocks, threads, 0, stream, src, rows, K, parts, exps, marks);
  else
    launch_programmatic(split_f16x2_kernel<0>, blocks, threads, 0, stream, src, rows, K, parts, exps, marks);
}

void launch_fixup_exceptional(const float* x, const float* w, const float* w_scale,
                              const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                              const int* x_flags, const int* w_list, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return;
  launch_programmatic(fixup_kernel, dim3(static_cast<unsigned>(sm_count()) * 2), dim3(kFixupThreads),
                      0, stream, x, w, w_scale, bias, y, M, N, K, x_flags, w_list);
}

}  // namespace gemmfuse::cuda

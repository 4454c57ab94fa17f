// Column statistics of an fp32 matrix for the splits that scale by column: the column split
// (launch_split_f16x2_columns) and the transposed row split (launch_split_f16x2_transposed).
// Included by their .cu files (device code).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

// Per column, gathered by the stats kernel: the largest finite magnitude's bits, the least
// nonzero magnitude's bits inverted (so that both are atomicMax over a zeroed buffer; 0 inverted
// is "none"), and whether the column holds a NaN or an infinity.
struct ColumnStats {
  unsigned top, least_inv;
  int nan, inf;
  // The column's exponent, as the row split's (split_exponent_of).
  __device__ __forceinline__ int exponent() const { return split_exponent_of(__uint_as_float(top), nan != 0); }
};
constexpr int kColQuads = 64, kColLanes = 4, kColRowsPerLane = 16;  // 256 columns x 64 rows a CTA

// A CTA takes 256 columns (a float4 of 4 columns a thread) by chunks of 64 rows (16 a thread,
// loads unrolled by 4), reduces its four row lanes through shared memory, then one atomic per column
// and statistic. Memory bound: one read of src.
__global__ void __launch_bounds__(kColQuads * kColLanes)
    column_stats_kernel(const float* __restrict__ src, int64_t rows, int64_t cols,
                        ColumnStats* __restrict__ stats) {
  __shared__ ColumnStats part[kColLanes][4 * kColQuads];
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kColQuads + threadIdx.x) * 4;
  unsigned top[4] = {}, least[4] = {0x7f800000u, 0x7f800000u, 0x7f800000u, 0x7f800000u};
  int nan[4] = {}, inf[4] = {};
  constexpr int64_t kChunk = kColLanes * kColRowsPerLane;
  for (int64_t r0 = blockIdx.y * kChunk + threadIdx.y; c0 < cols && r0 < rows; r0 += gridDim.y * kChunk) {
#pragma unroll 4
    for (int i = 0; i < kColRowsPerLane; ++i) {
      const int64_t r = r0 + static_cast<int64_t>(i) * kColLanes;
      if (r >= rows) break;
      const float4 q = __ldg(reinterpret_cast<const float4*>(src + r * cols + c0));
      const float v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned b = __float_as_uint(fabsf(v[j]));
        nan[j] |= v[j] != v[j];
        inf[j] |= isinf(v[j]);
        if (b < 0x7f800000u) {  // finite
          top[j] = max(top[j], b);
          if (b != 0u) least[j] = min(least[j], b);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) part[threadIdx.y][4 * threadIdx.x + j] = {top[j], ~least[j], nan[j], inf[j]};
  __syncthreads();
  const int t = threadIdx.y * kColQuads + threadIdx.x;  // one column of the CTA's 256 per thread
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 4 * kColQuads + t;
  if (c >= cols) return;
  ColumnStats s = part[0][t];
#pragma unroll
  for (int l = 1; l < kColLanes; ++l) {
    const ColumnStats o = part[l][t];
    s = {max(s.top, o.top), max(s.least_inv, o.least_inv), s.nan | o.nan, s.inf | o.inf};
  }
  if (s.top) atomicMax(&stats[c].top, s.top);
  if (s.least_inv != ~0x7f800000u) atomicMax(&stats[c].least_inv, s.least_inv);
  if (s.nan) atomicOr(&stats[c].nan, 1);
  if (s.inf) atomicOr(&stats[c].inf, 1);
}


constexpr size_t column_stats_bytes(int64_t cols) { return sizeof(ColumnStats) * static_cast<size_t>(cols); }

// stats [cols] zeroed, then gathered over src [rows, cols] (cols a multiple of 4, src 16-byte
// aligned).
inline void launch_column_stats(const float* src, int64_t rows, int64_t cols, ColumnStats* stats,
                                cudaStream_t stream) {
  GF_CUDA_CHECK(cudaMemsetAsync(stats, 0, column_stats_bytes(cols), stream));
  if (rows <= 0) return;
  const dim3 grid(static_cast<unsigned>((cols + 4 * kColQuads - 1) / (4 * kColQuads)),
                  static_cast<unsigned>(std::min<int64_t>(
                      (rows + kColLanes * kColRowsPerLane - 1) / (kColLanes * kColRowsPerLane), 65535)));
  column_stats_kernel<<<grid, dim3(kColQuads, kColLanes), 0, stream>>>(src, rows, cols, stats);
  GF_LAUNCH_CHECK();
}

}  // namespace
}  // namespace gemmfuse::cuda

// The row-scaled two-part fp16 split of fp32 operands for the sm90 fp32 GEMM (split.h,
// sm90/gemm_f16x3.h), and its second level for x's tiny values.
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cfloat>
#include <stdexcept>

#include "block_list.cuh"
#include "column_stats.cuh"
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

// Eight values of a row, value j scaled by 2^e[j], as two fp16 part planes (a 16-byte store
// into each: dst and dst + plane). A value not taken, or left out (tiny once scaled, or
// infinite), gets zero parts; returns how many taken values were left out. Both levels of the
// row split (one exponent for the eight) and the column split store their parts this way.
__device__ __forceinline__ int split8(const float (&v)[8], const int (&e)[8], const bool (&take)[8],
                                      __half* dst, int64_t plane) {
  __half p[2][8];
  int left = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) left += split_f16x2_scaled(v[j], e[j], take[j], p[0][j], p[1][j]);
#pragma unroll
  for (int i = 0; i < 2; ++i) *reinterpret_cast<uint4*>(dst + i * plane) = *reinterpret_cast<const uint4*>(p[i]);
  return left;
}
__device__ __forceinline__ int split8(const float (&v)[8], int e, const bool (&take)[8], __half* dst,
                                      int64_t plane) {
  int es[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) es[j] = e;
  return split8(v, es, take, dst, plane);
}

// What a row's first pass notes over a thread's values: the largest finite magnitude, whether
// a NaN was seen, how many infinities.
struct RowScan {
  float top = 0.f;
  bool nan = false;
  int infs = 0;
  __device__ __forceinline__ void see(const float (&v)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float m = fabsf(v[j]);
      nan |= v[j] != v[j];
      infs += isinf(v[j]);
      if (m <= FLT_MAX) top = fmaxf(top, m);  // finite values only
    }
  }
};

constexpr int64_t kSplitStride = 8 * kSplitThreads;  // columns a CTA takes per step

// The first pass over row `row` (K values), this thread's columns first, first + kSplitStride,
// ...: with kSteps > 0 they stay in `held` (every load in flight before the first use).
template <int kSteps>
__device__ __forceinline__ RowScan scan_row(const float* __restrict__ row, int64_t K, int64_t first,
                                            float (&held)[kSteps > 0 ? kSteps : 1][8]) {
  RowScan scan;
  if constexpr (kSteps > 0) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i)
      if (first + i * kSplitStride < K) load8(row, first + i * kSplitStride, held[i]);
#pragma unroll
    for (int i = 0; i < kSteps; ++i)
      if (first + i * kSplitStride < K) scan.see(held[i]);
  } else {
    for (int64_t c = first; c < K; c += kSplitStride) {
      load8(row, c, held[0]);
      scan.see(held[0]);
    }
  }
  return scan;
}

// The second pass: this thread's values scaled by 2^e into the part planes (from `held`, or
// read again from L2 when kSteps == 0); returns how many were left out (split8).
template <int kSteps>
__device__ __forceinline__ int split_row(const float* __restrict__ row, int64_t K, int64_t first,
                                         const float (&held)[kSteps > 0 ? kSteps : 1][8], int e,
                                         bool nan, __half* dst, int64_t plane) {
  int left = 0;
  bool take[8];  // a NaN row's parts are all zero
#pragma unroll
  for (int j = 0; j < 8; ++j) take[j] = !nan;
  if constexpr (kSteps > 0) {
#pragma unroll
    for (int i = 0; i < kSteps; ++i)
      if (first + i * kSplitStride < K)
        left += split8(held[i], e, take, dst + first + i * kSplitStride, plane);
  } else {
    float v[8];
    for (int64_t c = first; c < K; c += kSplitStride) {
      load8(row, c, v);
      left += split8(v, e, take, dst + c, plane);
    }
  }
  return left;
}

// Row r's exponent, tiny-value count and mark, from the CTA's totals (thread 0): counts.x the
// values left out that are tiny, counts.y the infinities (not read for a NaN row).
__device__ __forceinline__ void record_row(int64_t r, int e, bool nan, int2 counts,
                                           int64_t most_infinities, float* exps,
                                           const RowMarks& marks) {
  const int tiny = nan ? 0 : counts.x;
  exps[r] = static_cast<float>(e);
  if (marks.tiny) marks.tiny[r] = tiny;
  record_mark(split_row_mark(nan, tiny, counts.y, most_infinities), r, marks);
}

// A CTA per row (grid-stride over rows), 8 values a thread per step: the row's largest finite
// magnitude (and whether it holds a NaN, how many infinities) first, then one 16-byte store
// per part plane. With kSteps > 0 the row stays in registers between the two (K <= kSteps * 8
// * kSplitThreads): one read of x; with 0 the row is read again for the split, from L2.
// Memory bound.
template <int kSteps>
__global__ void __launch_bounds__(kSplitThreads)
    split_f16x2_kernel(const float* __restrict__ src, int64_t rows, int64_t K,
                       __half* __restrict__ parts, float* __restrict__ exps, RowMarks marks) {
  using Reduce = cub::BlockReduce<float, kSplitThreads>;
  using ReduceInt2 = cub::BlockReduce<int2, kSplitThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ typename ReduceInt2::TempStorage reduce_int2;
  __shared__ float row_max;
  const int64_t most_infinities = correctable_infinities(K);  // more: the row is recomputed
  float held[kSteps > 0 ? kSteps : 1][8];
  wait_for_previous_grid();  // launched programmatically
  const int64_t plane = rows * K, first = 8 * static_cast<int64_t>(threadIdx.x);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = src + r * K;
    const RowScan scan = scan_row<kSteps>(row, K, first, held);
    const float block_top = Reduce(reduce).Reduce(scan.top, [](float a, float b) { return fmaxf(a, b); });
    const bool nan = __syncthreads_or(scan.nan);  // also orders reduce's storage for reuse
    if (threadIdx.x == 0) row_max = block_top;
    __syncthreads();
    const float m = row_max;
    const int e = split_exponent_of(m, nan);
    // values left out of the parts (left_out_at e): this thread's infinities too
    const int left = split_row<kSteps>(row, K, first, held, e, nan, parts + r * K, plane);
    // the row's tiny values and infinities (valid in thread 0)
    const int2 counts = ReduceInt2(reduce_int2).Reduce(make_int2(left - scan.infs, scan.infs), [](int2 a, int2 b) {
      return make_int2(a.x + b.x, a.y + b.y);
    });
    if (threadIdx.x == 0) record_row(r, e, nan, counts, most_infinities, exps, marks);
    __syncthreads();  // row_max and the reductions' storage are reused by the next row
  }
}

constexpr int kLevelThreads = 256;
constexpr int kLevelFlagsPerThread = 4;
constexpr int kLevelChunk = kLevelThreads * kLevelFlagsPerThread;  // x rows listed per step

// Slot s of the second level, row m of x, by the whole CTA: the largest of the row's tiny
// values (tiny at x_exps[m]) sets the slot's exponent e2 (x_exps[m] where the row holds only
// infinities); the tiny values scaled by 2^e2 are split as the first level splits (every other
// value's parts zero), except those still tiny at e2, which are counted for the fix-up with
// the row's infinities: the values left out at e2. Reads the row twice (the second from L2).
__device__ void split_slot(const float* __restrict__ xr, float e1, int64_t K, int64_t M, int64_t s,
                           int m, SecondLevel second) {
  using Reduce = cub::BlockReduce<float, kLevelThreads>;
  using ReduceInt = cub::BlockReduce<int, kLevelThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ typename ReduceInt::TempStorage reduce_int;
  __shared__ float slot_top;
  const int ei = static_cast<int>(e1);
  constexpr int64_t kStride = 8 * kLevelThreads;
  const int64_t first = 8 * static_cast<int64_t>(threadIdx.x);
  float top = 0.f;
  int left_out = 0;  // the infinities here; the values still tiny at e2 below
  for (int64_t c = first; c < K; c += kStride) {
    float v[8];
    load8(xr, c, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (tiny_at(v[j], ei)) top = fmaxf(top, fabsf(v[j]));
      left_out += isinf(v[j]);
    }
  }
  const float block_top = Reduce(reduce).Reduce(top, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) slot_top = block_top;
  __syncthreads();
  const int e2 = slot_top > 0.f ? 14 - ilogbf(slot_top) : ei;
  for (int64_t c = first; c < K; c += kStride) {
    float v[8];
    load8(xr, c, v);
    bool tiny[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) tiny[j] = tiny_at(v[j], ei);
    left_out += split8(v, e2, tiny, second.parts + s * K + c, M * K);
  }
  const int slot_left_out = ReduceInt(reduce_int).Sum(left_out);  // valid in thread 0
  if (threadIdx.x == 0) {
    second.slot_row[s] = m;
    second.exps[s] = static_cast<float>(e2);
    second.slot_tiny[s] = slot_left_out;
  }
  __syncthreads();  // slot_top and the reductions' storage are reused by the next slot
}

// Every CTA reads every row's flag and tiny count: the totals first (second_level_pays, the
// same in every CTA), then, when it pays, the kRowTiny rows' slots in row order, a chunk of
// kLevelChunk rows at a time; CTA b splits slots b, b + G, ...
__global__ void __launch_bounds__(kLevelThreads)
    split_second_level_kernel(const float* __restrict__ x, int64_t M, int64_t K,
                              const float* __restrict__ x_exps, const int* __restrict__ x_flags,
                              const int* __restrict__ x_tiny, SecondLevel second) {
  using ReduceLL = cub::BlockReduce<long long, kLevelThreads>;
  using Scan = cub::BlockScan<int, kLevelThreads>;
  __shared__ typename ReduceLL::TempStorage reduce;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int chunk_rows[kLevelChunk];
  __shared__ bool pays;
  wait_for_previous_grid();  // launched programmatically
  long long rows = 0, values = 0;
  for (int64_t m = threadIdx.x; m < M; m += kLevelThreads) {
    if (x_flags[m] == kRowTiny) {
      ++rows;
      values += x_tiny[m];
    }
  }
  const long long all_rows = ReduceLL(reduce).Sum(rows);  // valid in thread 0
  __syncthreads();                                      // the storage is reused
  const long long all_values = ReduceLL(reduce).Sum(values);
  if (threadIdx.x == 0) {
    pays = second_level_pays(all_values, K);
    if (blockIdx.x == 0) *second.rows = pays ? static_cast<int>(all_rows) : 0;
  }
  __syncthreads();
  let_next_grid_start();
  if (!pays) return;
  int64_t slot_base = 0;
  for (int64_t base = 0; base < M; base += kLevelChunk) {
    const int64_t first = base + kLevelFlagsPerThread * threadIdx.x;
    bool tiny[kLevelFlagsPerThread];
#pragma unroll
    for (int j = 0; j < kLevelFlagsPerThread; ++j) tiny[j] = first + j < M && x_flags[first + j] == kRowTiny;
    const int listed = list_picked_rows<Scan>(tiny, first, chunk_rows, scan);
    // this CTA's slots in the chunk: slot_base + i with (slot_base + i) % G == blockIdx.x
    int64_t i = (static_cast<int64_t>(blockIdx.x) - slot_base % gridDim.x + gridDim.x) % gridDim.x;
    for (; i < listed; i += gridDim.x) {
      const int m = chunk_rows[i];
      split_slot(x + m * K, x_exps[m], K, M, slot_base + i, m, second);
    }
    slot_base += listed;
    __syncthreads();  // chunk_rows is rewritten by the next chunk
  }
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

namespace {

// Per column: its exponent (as the row split's: 14 - floor(log2 of the largest finite
// magnitude), 0 where none is nonzero or the column holds a NaN) and its mark: kRowNaN, or
// kRowTiny where it holds a value left out (an infinity, or a least nonzero magnitude tiny at
// the exponent: then so is nothing larger), every mark but kRowKept listed.
__global__ void column_marks_kernel(const ColumnStats* __restrict__ stats, int64_t cols,
                                    float* __restrict__ exps, RowMarks marks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const ColumnStats s = stats[c];
  const int e = s.exponent();
  const bool tiny = s.least_inv != 0u && tiny_at(__uint_as_float(~s.least_inv), e);
  const int mark = s.nan ? kRowNaN : s.inf || tiny ? kRowTiny : kRowKept;
  exps[c] = static_cast<float>(e);
  write_mark(mark, c, marks);
}

// Eight values of a row a thread, each scaled by its column's exponent (a NaN column's parts
// zero, as are the values left out).
__global__ void __launch_bounds__(kSplitThreads)
    split_columns_kernel(const float* __restrict__ src, int64_t rows, int64_t cols,
                         const float* __restrict__ exps, const int* __restrict__ flags,
                         __half* __restrict__ parts) {
  const int64_t per_row = cols / 8, plane = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * per_row;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = 8 * (i % per_row);
    float v[8];
    load8(src + r * cols, c, v);
    int e[8];
    bool take[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      e[j] = static_cast<int>(__ldg(exps + c + j));
      take[j] = __ldg(flags + c + j) != kRowNaN;
    }
    split8(v, e, take, parts + r * cols + c, plane);
  }
}

}  // namespace

size_t split_f16x2_columns_scratch_bytes(int64_t cols) { return column_stats_bytes(cols); }

void launch_split_f16x2_columns(const float* src, int64_t rows, int64_t cols, __half* parts, float* exps,
                                RowMarks marks, void* scratch, cudaStream_t stream) {
  if (cols % 8 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(parts) % 16 != 0 || marks.flags == nullptr)
    throw std::logic_error("CUDA fp16 column split: columns a multiple of 8, 16-byte aligned buffers, flags given");
  if (cols <= 0) return;
  auto* stats = static_cast<ColumnStats*>(scratch);
  launch_column_stats(src, rows, cols, stats, stream);
  column_marks_kernel<<<static_cast<unsigned>((cols + 255) / 256), 256, 0, stream>>>(stats, cols, exps, marks);
  GF_LAUNCH_CHECK();
  if (rows <= 0) return;
  const int64_t grid = std::min<int64_t>((rows * (cols / 8) + kSplitThreads - 1) / kSplitThreads,
                                         int64_t(sm_count()) * 16);
  split_columns_kernel<<<static_cast<unsigned>(grid), kSplitThreads, 0, stream>>>(src, rows, cols, exps,
                                                                                   marks.flags, parts);
  GF_LAUNCH_CHECK();
}

void launch_split_second_level(const float* x, int64_t M, int64_t K, const float* x_exps,
                               const int* x_flags, const int* x_tiny, SecondLevel second,
                               cudaStream_t stream) {
  if (K % 8 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(second.parts) % 16 != 0)
    throw std::logic_error("CUDA fp16 split: K must be a multiple of 8 and the buffers 16-byte aligned");
  if (M <= 0) return;
  const int64_t grid = std::min<int64_t>(M, int64_t(sm_count()) * 2);
  launch_programmatic(split_second_level_kernel, dim3(static_cast<unsigned>(grid)), dim3(kLevelThreads), 0,
                      stream, x, M, K, x_exps, x_flags, x_tiny, second);
}

namespace {
__global__ void recompute_crowded_rows_kernel(int* __restrict__ x_flags, const int* __restrict__ x_tiny,
                                              int64_t M, int64_t K) {
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m < M && x_flags[m] == kRowTiny && x_tiny[m] > correctable_tiny_values(K)) x_flags[m] = kRowRecompute;
}
}  // namespace

void launch_recompute_crowded_rows(int* x_flags, const int* x_tiny, int64_t M, int64_t K,
                                   cudaStream_t stream) {
  if (M <= 0) return;
  recompute_crowded_rows_kernel<<<static_cast<unsigned>((M + 255) / 256), 256, 0, stream>>>(x_flags, x_tiny, M, K);
  GF_LAUNCH_CHECK();
}

}  // namespace gemmfuse::cuda

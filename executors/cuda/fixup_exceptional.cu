// The fp32 fix-up after a split GEMM (split.h): the rows and columns of Y whose inputs a
// split cannot carry, recomputed in fp32 (`fast`'s and `fp32`'s), and the products of the
// tiny values `fp32`'s split leaves out, added (from x itself, or from the second level's GEMM).
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "device_info.h"
#include "programmatic_launch.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kFixupThreads = 256;
constexpr int kFlagsPerThread = 4;
constexpr int kFlagChunk = kFixupThreads * kFlagsPerThread;  // x rows listed per step
constexpr int kCorrectCols = 4 * kFixupThreads;              // Y columns per correction item
constexpr int kTinyListMax = correctable_tiny_values(int64_t{1} << 40);

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

struct TinyList {
  int k[kTinyListMax];
  float v[kTinyListMax];
};

// The tiny values of x's row m at exponent e (the row's, or its second-level slot's: a value
// tiny at the slot's is tiny at the row's, and no other value is), listed in k order by the
// whole CTA; their count (at most kTinyListMax: second_level_pays and the fix-up's slot rule
// keep lists within correctable_tiny_values).
template <typename Scan>
__device__ int list_tiny_values(const float* __restrict__ xr, float e, int64_t K, TinyList& list,
                                typename Scan::TempStorage& scan) {
  const int ei = static_cast<int>(e);
  int listed = 0;
  for (int64_t base = 0; base < K; base += 8 * kFixupThreads) {
    const int64_t c = base + 8 * static_cast<int64_t>(threadIdx.x);
    float v[8];
    bool tiny[8];
    int mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = c + j < K ? __ldg(xr + c + j) : 0.f;
      tiny[j] = tiny_once_scaled(v[j], ldexpf(v[j], ei));
      mine += tiny[j];
    }
    int at = 0, total = 0;
    Scan(scan).ExclusiveSum(mine, at, total);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (tiny[j]) {
        const int i = listed + at++;
        if (i < kTinyListMax) list.k[i] = static_cast<int>(c + j), list.v[i] = v[j];
      }
    }
    listed += total;
    __syncthreads();  // the scan's storage is reused
  }
  return min(listed, kTinyListMax);
}

// Y[m, n0 .. n0 + kCorrectCols) += add[n] (the second level's products, or nothing when add is
// null), then + the row's tiny values times W' at their k: four columns a thread, each sum in
// k order (a 32-byte sector of W' per value and column). For short lists.
__device__ __forceinline__ void correct(const TinyList& list, int count, const float* __restrict__ w,
                                        const float* __restrict__ w_scale,
                                        const int* __restrict__ w_flags, const float* __restrict__ add,
                                        float* __restrict__ y, int64_t m, int64_t n0, int64_t N, int64_t K) {
  constexpr int kCols = kCorrectCols / kFixupThreads;
  int64_t n[kCols];
  bool live[kCols];
  float acc[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    n[i] = n0 + threadIdx.x + i * kFixupThreads;
    live[i] = n[i] < N && w_flags[n[i]] == kRowKept;  // W's listed columns are recomputed whole
    acc[i] = 0.f;
  }
#pragma unroll 4
  for (int j = 0; j < count; ++j) {
    const int64_t k = list.k[j];
    const float v = list.v[j];
#pragma unroll
    for (int i = 0; i < kCols; ++i)
      if (live[i]) acc[i] = fmaf(v, __ldg(w + n[i] * K + k), acc[i]);
  }
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    if (live[i])
      y[m * N + n[i]] = (y[m * N + n[i]] + (add ? add[n[i]] : 0.f)) + (w_scale ? acc[i] * w_scale[n[i]] : acc[i]);
  }
}

// The same for lists of kWarpListFrom values or more: a warp takes kWarpCols columns at once,
// lanes over the list, then a warp tree per column, so a warp's loads fall in kWarpCols rows
// of W'. At the seed shape, every row of x corrected: 11.4 ms with 36 values a row, 14.0 with
// 256, against 13.1 and 47.8 a thread per column; with 1 value in 2 rows, 0.699 ms against
// 0.574 (bench/NOTES.md, session 29).
constexpr int kWarpCols = 4;
constexpr int kWarpListFrom = 8;
__device__ __forceinline__ void correct_by_warp(const TinyList& list, int count, const float* __restrict__ w,
                                                const float* __restrict__ w_scale,
                                                const int* __restrict__ w_flags,
                                                const float* __restrict__ add, float* __restrict__ y,
                                                int64_t m, int64_t n0, int64_t N, int64_t K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  constexpr int kStep = kWarpCols * (kFixupThreads / 32);
  for (int64_t nb = n0 + warp * kWarpCols; nb < min(N, n0 + kCorrectCols); nb += kStep) {
    // lane i < kWarpCols owns column nb + i: its flag and Y value, loaded before the gathers
    const int64_t own = nb + lane;
    const bool live_own = lane < kWarpCols && own < N && w_flags[own] == kRowKept;
    const float y_own = live_own ? y[m * N + own] + (add ? add[own] : 0.f) : 0.f;
    float acc[kWarpCols];
    const float* wr[kWarpCols];
#pragma unroll
    for (int i = 0; i < kWarpCols; ++i) {
      acc[i] = 0.f;
      wr[i] = w + min(nb + i, N - 1) * K;  // a column past N reads row N - 1, unused
    }
    for (int j = lane; j < count; j += 32) {
      const float v = list.v[j];
      const int64_t k = list.k[j];
#pragma unroll
      for (int i = 0; i < kWarpCols; ++i) acc[i] = fmaf(v, __ldg(wr[i] + k), acc[i]);
    }
    float mine = 0.f;
#pragma unroll
    for (int i = 0; i < kWarpCols; ++i) {
      for (int o = 16; o > 0; o >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
      if (lane == i) mine = acc[i];
    }
    if (live_own) y[m * N + own] = y_own + (w_scale ? mine * w_scale[own] : mine);
  }
}

// Item `item` of a row m whose tiny values the fix-up adds (kCorrectCols columns from n0):
// list them (those tiny at exponent e) and add their products, after `add` (or nothing).
template <typename Scan>
__device__ void correct_item(const float* __restrict__ x, float e, const float* __restrict__ w,
                             const float* __restrict__ w_scale, const int* __restrict__ w_flags,
                             const float* __restrict__ add, float* __restrict__ y, int64_t m,
                             int64_t n0, int64_t N, int64_t K, TinyList& tiny,
                             typename Scan::TempStorage& scan) {
  const int count = list_tiny_values<Scan>(x + m * K, e, K, tiny, scan);
  if (count >= kWarpListFrom)
    correct_by_warp(tiny, count, w, w_scale, w_flags, add, y, m, n0, N, K);
  else
    correct(tiny, count, w, w_scale, w_flags, add, y, m, n0, N, K);
  __syncthreads();  // the list is rebuilt by the next item
}

// x's marked rows are listed a chunk of kFlagChunk rows at a time, by every CTA in the same
// (ascending) order: recomputed rows' outputs spread over every warp of the grid, corrected
// rows in items of kCorrectCols columns, one per CTA. With second-level slots, kRowTiny rows
// are taken by slot instead, in items too. W's listed rows are recomputed as columns; an
// output in both a recomputed row and a listed column is written twice with the same value.
__global__ void __launch_bounds__(kFixupThreads)
    fixup_kernel(const float* __restrict__ x, const float* __restrict__ w,
                 const float* __restrict__ w_scale, const float* __restrict__ bias,
                 float* __restrict__ y, int64_t M, int64_t N, int64_t K,
                 const float* __restrict__ x_exps, const int* __restrict__ x_flags,
                 const int* __restrict__ w_list, const int* __restrict__ w_flags, SecondLevel second) {
  using Scan = cub::BlockScan<int, kFixupThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int rows[2][kFlagChunk];  // [0] recomputed, [1] corrected
  __shared__ TinyList tiny;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // Launched programmatically; the row pass after it may be scheduled at once (it waits for
  // this grid to complete): a fix-up with nothing marked is over in a few loads.
  wait_for_previous_grid();
  let_next_grid_start();
  const int64_t n_cols = w_list[0];  // read early: their latency overlaps the flags'
  const int64_t slots = second.rows ? *second.rows : 0;
  const int64_t items_per_row = (N + kCorrectCols - 1) / kCorrectCols;
  for (int64_t base = 0; base < M; base += kFlagChunk) {
    const int64_t first = base + kFlagsPerThread * threadIdx.x;
    int f[kFlagsPerThread];
    int count = 0;  // recomputed rows in the low half, corrected ones in the high half
#pragma unroll
    for (int j = 0; j < kFlagsPerThread; ++j) {
      f[j] = first + j < M ? x_flags[first + j] : kRowKept;
      if (f[j] == kRowTiny && slots > 0) f[j] = kRowKept;  // taken by slot below
      count += f[j] == kRowRecompute ? 1 : f[j] == kRowTiny ? 1 << 16 : 0;
    }
    if (__syncthreads_or(count) == 0) continue;  // the common case: nothing marked
    int at = 0, marked = 0;
    Scan(scan).ExclusiveSum(count, at, marked);  // each half stays below 2^16
    int at_r = at & 0xffff, at_c = at >> 16;
#pragma unroll
    for (int j = 0; j < kFlagsPerThread; ++j) {
      if (f[j] == kRowRecompute) rows[0][at_r++] = static_cast<int>(first + j);
      if (f[j] == kRowTiny) rows[1][at_c++] = static_cast<int>(first + j);
    }
    __syncthreads();
    const int64_t recomputed = marked & 0xffff, corrected = marked >> 16;
    for (int64_t i = warp; i < recomputed * N; i += warps)
      recompute(x, w, w_scale, bias, y, rows[0][i / N], i % N, N, K, lane);
    for (int64_t item = blockIdx.x; item < corrected * items_per_row; item += gridDim.x) {
      const int64_t m = rows[1][item / items_per_row];
      correct_item<Scan>(x, x_exps[m], w, w_scale, w_flags, nullptr, y, m, (item % items_per_row) * kCorrectCols,
                         N, K, tiny, scan);
    }
    __syncthreads();  // rows and the scan storage are reused by the next chunk
  }
  for (int64_t item = blockIdx.x; item < slots * items_per_row; item += gridDim.x) {
    const int64_t s = item / items_per_row, n0 = (item % items_per_row) * kCorrectCols;
    const int64_t m = second.slot_row[s];
    if (second.slot_tiny[s] > correctable_tiny_values(K)) {  // block-uniform
      for (int64_t n = n0 + threadIdx.x / 32; n < min(N, n0 + kCorrectCols); n += kFixupThreads / 32)
        recompute(x, w, w_scale, bias, y, m, n, N, K, lane);
    } else {
      correct_item<Scan>(x, second.exps[s], w, w_scale, w_flags, second.y + s * N, y, m, n0, N, K, tiny, scan);
    }
  }
  for (int64_t i = warp; i < n_cols * M; i += warps)
    recompute(x, w, w_scale, bias, y, i % M, w_list[1 + i / M], N, K, lane);
}
}  // namespace

void launch_fixup_exceptional(const float* x, const float* w, const float* w_scale,
                              const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                              const float* x_exps, const int* x_flags, const int* w_list,
                              const int* w_flags, SecondLevel second, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return;
  launch_programmatic(fixup_kernel, dim3(static_cast<unsigned>(sm_count()) * 2), dim3(kFixupThreads),
                      0, stream, x, w, w_scale, bias, y, M, N, K, x_exps, x_flags, w_list, w_flags,
                      second);
}

}  // namespace gemmfuse::cuda

// The fp32 fix-up after a split GEMM (split.h): the rows and columns of Y whose inputs a
// split cannot carry, recomputed in fp32 (`fast`'s and `fp32`'s) or, where they hold a NaN,
// written NaN; and the products of the values `fp32`'s split leaves out (tiny or infinite),
// added (from x itself, or with the second level's GEMM).
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <stdexcept>

#include "block_list.cuh"
#include "device_info.h"
#include "programmatic_launch.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kFixupThreads = 256;
constexpr int kFlagsPerThread = 4;
constexpr int kFlagChunk = kFixupThreads * kFlagsPerThread;  // x rows listed per step
constexpr int kCorrectCols = 4 * kFixupThreads;              // Y columns per correction item
// A row's list: at most 1024 tiny values (second_level_pays) and 1024 infinities
// (correctable_infinities) at the first level, 1024 in all at the second (correctable_tiny_values).
constexpr int kListMax = 2048;
static_assert(kListMax >= 2 * at_most_1024(INT64_MAX), "a tiny value's and an infinity's limits");

// What a row or column holding a NaN gets in every output (CUDA's canonical NaN).
__device__ __forceinline__ float nan_output() { return __int_as_float(0x7fffffff); }

// Whether the row paths write Y's column n: W's listed rows' columns are recomputed whole by
// the column path, so that every output has one writer.
__device__ __forceinline__ bool row_paths_write(const int* __restrict__ w_flags, int64_t n) {
  return w_flags[n] == kRowKept;
}

// An operand [R, K] as the paths read it: element (r, k) at p[r K + k], or at p[k R + r] with
// kTransposed (stored [K, R]: dx = dV W reads W so, dW = dVᵀ x reads dV so). A template, so
// that the forward's kernel keeps its 16-byte loads and registers.
template <bool kTransposed>
struct Rows {
  static constexpr bool kStoredTransposed = kTransposed;
  const float* p;
  int64_t R, K;
  __device__ __forceinline__ float at(int64_t r, int64_t k) const {
    return __ldg(p + (kTransposed ? k * R + r : r * K + k));
  }
  // Four values of row r from k on (0 past K): one 16-byte load where rows are contiguous and
  // 16-byte aligned (vec).
  __device__ __forceinline__ float4 load4(int64_t r, int64_t k, bool vec) const;
};

// W' as the paths read it: W'[n, k] = W[n, k] times scale[n] (scale null: 1).
template <bool kTransposed>
struct WPrime : Rows<kTransposed> {
  const float* scale;
  __device__ __forceinline__ float scale_of(int64_t n) const { return scale ? scale[n] : 1.f; }
};

// Y[m, n] = x[m, :] . W'[n, :] (+ bias[n]) by one warp: lanes take every 32nd k, fp32 FMA,
// then a warp tree. For W's listed columns, and for a chunk's recomputed rows where they are
// few (at most kWarpRowsMax: a tile's 64 rows would be mostly idle).
template <class XR, class WP>
__device__ __forceinline__ void recompute(const XR& x, const WP& wp,
                                          const float* __restrict__ bias, float* __restrict__ y,
                                          int64_t m, int64_t n, int64_t N, int64_t K, int lane) {
  const float s = wp.scale_of(n);
  float acc = 0.f;
  for (int64_t k = lane; k < K; k += 32) acc = fmaf(x.at(m, k), wp.at(n, k) * s, acc);  // W' rounded once
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[m * N + n] = bias ? acc + bias[n] : acc;
}

// A chunk's recomputed rows, past kWarpRowsMax of them, by tiles: an item is kTile listed rows
// by kTile columns, K through shared memory kTileK at a time (the next step's loads in flight
// during this one's FMAs), k in order per output as SGEMM sums it. Each thread takes quads of
// 4 rows by 4 columns, kQuads each way, 64 apart. A hand-written SIMT tile, because its rows
// come from a list whose length only the device knows (CUTLASS's SIMT GEMMs take M from the
// host). Two sizes: 64 x 64 (a quad a thread: per k a warp reads 3 shared-memory wavefronts for
// 16 FMAs a thread) and 128 x 128 (2 x 2 quads: 6 wavefronts for 64 FMAs), taken when its
// fewer items still fill half the grid (choose_large_tile).
constexpr int kWarpRowsMax = 4;  // a warp per output below that: W' read once per row
constexpr int kQuad = 4, kQuadSpan = kQuad * 16;  // 16 x 16 threads, each a 4 x 4 quad per 64
static_assert(16 * 16 == kFixupThreads, "16 x 16 threads over a tile");

template <int kTileRows, int kStepK>
struct TileShape {
  static constexpr int kTile = kTileRows, kTileK = kStepK;
  static constexpr int kQuads = kTile / kQuadSpan;   // quads a thread takes each way
  static constexpr int kPitch = kTile + 4;            // float4 reads stay aligned; 2-way conflicts on the stores
  static constexpr int kStageRows = 4 * kFixupThreads / kTileK;  // rows a step's float4 loads cover at once
  static constexpr int kStageLoads = kTile / kStageRows;         // float4s of x and of W' a thread stages per step
  static_assert(kQuads * kQuadSpan == kTile && kStageLoads * kStageRows == kTile, "whole quads and loads");
  struct alignas(16) Stage {  // k-major: a thread reads its rows and columns as float4s
    float x[kTileK][kPitch];
    float w[kTileK][kPitch];
  };
};
using SmallTile = TileShape<64, 32>;
using LargeTile = TileShape<128, 16>;  // 16 k a step keeps its two stages in static shared memory

// Four values of a row from k on (0 past K): one 16-byte load where rows are 16-byte aligned.
__device__ __forceinline__ float4 load4(const float* __restrict__ row, int64_t k, int64_t K, bool vec) {
  if (vec) return k < K ? __ldg(reinterpret_cast<const float4*>(row + k)) : make_float4(0.f, 0.f, 0.f, 0.f);
  float v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = k + j < K ? __ldg(row + k + j) : 0.f;
  return make_float4(v[0], v[1], v[2], v[3]);
}

template <bool kTransposed>
__device__ __forceinline__ float4 Rows<kTransposed>::load4(int64_t r, int64_t k, bool vec) const {
  if constexpr (!kTransposed) {
    return gemmfuse::cuda::load4(p + r * K, k, K, vec);
  } else {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = k + j < K ? at(r, k + j) : 0.f;
    return make_float4(v[0], v[1], v[2], v[3]);
  }
}

// Where thread t stages an operand's values in a tile step: {row sr (then sr + kStageRows l),
// first k sk}. Along k for rows stored as rows (eight threads cover 32 contiguous values of a
// row), along rows for an operand stored transposed (a warp covers 32 neighbouring rows at
// each of its four k: one row of the stored operand).
template <class Shape, bool kTransposed>
__device__ __forceinline__ int2 stage_at(int t) {
  constexpr int kGroups = Shape::kTileK / 4;
  return kTransposed ? make_int2(t % Shape::kStageRows, 4 * (t / Shape::kStageRows))
                     : make_int2(t / kGroups, 4 * (t % kGroups));
}

template <int kRows, int kPitch>
__device__ __forceinline__ void stash4(float (&dst)[kRows][kPitch], int k, int r, float4 v) {
  dst[k][r] = v.x;
  dst[k + 1][r] = v.y;
  dst[k + 2][r] = v.z;
  dst[k + 3][r] = v.w;
}

template <class Shape, class XR, class WP>
__device__ void recompute_tile(const XR& x, const WP& wp, const int* __restrict__ w_flags,
                               const float* __restrict__ bias, float* __restrict__ y,
                               const int* rows, int count, int64_t n0, int64_t N, int64_t K, bool vec,
                               typename Shape::Stage (&stage)[2]) {
  constexpr int kTileK = Shape::kTileK, kQuads = Shape::kQuads, kLoads = Shape::kStageLoads;
  const int t = threadIdx.x;
  // staging (stage_at): thread t loads 4 values from k + ax.y of x's listed rows
  // ax.x + kStageRows l, and from k + aw.y of W's rows n0 + aw.x + kStageRows l. Rows and
  // columns past the tile's end load a valid row, unused.
  const int2 ax = stage_at<Shape, XR::kStoredTransposed>(t), aw = stage_at<Shape, WP::kStoredTransposed>(t);
  int xm[kLoads], wn[kLoads];  // row numbers, not pointers: registers are what the large tile lacks
  float s[kLoads];
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    xm[l] = rows[min(ax.x + Shape::kStageRows * l, count - 1)];
    wn[l] = static_cast<int>(min(n0 + aw.x + Shape::kStageRows * l, N - 1));
    s[l] = wp.scale_of(wn[l]);
  }
  float4 gx[kLoads], gw[kLoads];
  auto fetch = [&](int64_t k0) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      gx[l] = x.load4(xm[l], k0 + ax.y, vec);
      const float4 v = wp.load4(wn[l], k0 + aw.y, vec);
      gw[l] = make_float4(v.x * s[l], v.y * s[l], v.z * s[l], v.w * s[l]);  // W' rounded once
    }
  };
  auto stash = [&](typename Shape::Stage& st) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      stash4(st.x, ax.y, ax.x + Shape::kStageRows * l, gx[l]);
      stash4(st.w, aw.y, aw.x + Shape::kStageRows * l, gw[l]);
    }
  };
  fetch(0);
  stash(stage[0]);
  __syncthreads();
  // this thread's outputs: rows tr + kQuadSpan q + i and columns tc + kQuadSpan q + j (i, j < 4)
  const int tr = kQuad * (t / 16), tc = kQuad * (t % 16);
  float acc[kQuads * kQuad][kQuads * kQuad] = {};
  int cur = 0;
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    const bool more = k0 + kTileK < K;
    if (more) fetch(k0 + kTileK);
#pragma unroll
    for (int k = 0; k < kTileK; ++k) {
      float av[kQuads * kQuad], bv[kQuads * kQuad];
#pragma unroll
      for (int q = 0; q < kQuads; ++q) {
        const float4 a = *reinterpret_cast<const float4*>(&stage[cur].x[k][tr + kQuadSpan * q]);
        const float4 b = *reinterpret_cast<const float4*>(&stage[cur].w[k][tc + kQuadSpan * q]);
        av[4 * q] = a.x, av[4 * q + 1] = a.y, av[4 * q + 2] = a.z, av[4 * q + 3] = a.w;
        bv[4 * q] = b.x, bv[4 * q + 1] = b.y, bv[4 * q + 2] = b.z, bv[4 * q + 3] = b.w;
      }
#pragma unroll
      for (int i = 0; i < kQuads * kQuad; ++i)
#pragma unroll
        for (int j = 0; j < kQuads * kQuad; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    if (more) stash(stage[cur ^ 1]);  // read last in the previous step, before its barrier
    __syncthreads();
    cur ^= 1;
  }
#pragma unroll
  for (int i = 0; i < kQuads * kQuad; ++i) {
    const int r = tr + i % kQuad + kQuadSpan * (i / kQuad);
    const int64_t m = rows[min(r, count - 1)];
#pragma unroll
    for (int j = 0; j < kQuads * kQuad; ++j) {
      const int64_t n = n0 + tc + j % kQuad + kQuadSpan * (j / kQuad);
      if (r < count && n < N && row_paths_write(w_flags, n))
        y[m * N + n] = bias ? acc[i][j] + bias[n] : acc[i][j];
    }
  }
}

// The recomputed rows of a chunk, `rows` of them, by tiles of Shape: each CTA of the grid takes
// items (a group of kTile rows by a tile of columns) row-group-fastest, so that the CTAs running
// at once share tiles of W'.
template <class Shape, class XR, class WP>
__device__ void recompute_rows_by_tiles(const XR& x, const WP& wp, const int* __restrict__ w_flags,
                                        const float* __restrict__ bias, float* __restrict__ y,
                                        const int* listed, int rows, int64_t N, int64_t K, bool vec,
                                        typename Shape::Stage (&stage)[2]) {
  constexpr int kTile = Shape::kTile;
  const int groups = (rows + kTile - 1) / kTile;
  const int64_t col_tiles = (N + kTile - 1) / kTile;
  for (int64_t item = blockIdx.x; item < groups * col_tiles; item += gridDim.x) {
    const int g = static_cast<int>(item % groups);
    recompute_tile<Shape>(x, wp, w_flags, bias, y, listed + g * kTile, min(kTile, rows - g * kTile),
                          (item / groups) * kTile, N, K, vec, stage);
  }
}

// The large tile when its items fill at least half the grid: with fewer, the small tile's 4x as
// many items keep more SMs busy, which outweighs the large tile's higher rate per SM
// (docs/measurements.md, "Fix-up limits").
__device__ __forceinline__ bool choose_large_tile(int rows, int64_t N) {
  constexpr int kTile = LargeTile::kTile;
  const int64_t items = static_cast<int64_t>((rows + kTile - 1) / kTile) * ((N + kTile - 1) / kTile);
  return 2 * items >= gridDim.x;
}

struct LeftOutList {
  int k[kListMax];
  float v[kListMax];
};

// The values of x's row m left out at exponent e (left_out_at: the row's, or its second-level
// slot's: a value tiny at the slot's is tiny at the row's, and no other value is), listed in k
// order by the whole CTA; their count (at most kListMax, by second_level_pays and
// correctable_tiny_values).
template <typename Scan, class XR>
__device__ int list_left_out(const XR& x, int64_t m, float e, int64_t K, LeftOutList& list,
                             typename Scan::TempStorage& scan) {
  const int ei = static_cast<int>(e);
  int listed = 0;
  for (int64_t base = 0; base < K; base += 8 * kFixupThreads) {
    const int64_t c = base + 8 * static_cast<int64_t>(threadIdx.x);
    float v[8];
    bool left[8];
    int mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[j] = c + j < K ? x.at(m, c + j) : 0.f;
      left[j] = left_out_at(v[j], ei);
      mine += left[j];
    }
    int at = 0, total = 0;
    Scan(scan).ExclusiveSum(mine, at, total);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (left[j]) {
        const int i = listed + at++;
        if (i < kListMax) list.k[i] = static_cast<int>(c + j), list.v[i] = v[j];
      }
    }
    listed += total;
    __syncthreads();  // the scan's storage is reused
  }
  return min(listed, kListMax);
}

// Y[m, n0 .. n0 + kCorrectCols) += add[n] (the second level's products, or nothing when add is
// null), then + the row's values left out times W' at their k: four columns a thread, each sum
// in k order (a 32-byte sector of W' per value and column). For short lists.
template <class WP>
__device__ __forceinline__ void correct(const LeftOutList& list, int count, const WP& wp,
                                        const int* __restrict__ w_flags, const float* __restrict__ add,
                                        float* __restrict__ y, int64_t m, int64_t n0, int64_t N, int64_t K) {
  constexpr int kCols = kCorrectCols / kFixupThreads;
  int64_t n[kCols];
  bool live[kCols];
  float acc[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    n[i] = n0 + threadIdx.x + i * kFixupThreads;
    live[i] = n[i] < N && row_paths_write(w_flags, n[i]);
    acc[i] = 0.f;
  }
#pragma unroll 4
  for (int j = 0; j < count; ++j) {
    const int64_t k = list.k[j];
    const float v = list.v[j];
#pragma unroll
    for (int i = 0; i < kCols; ++i)
      if (live[i]) acc[i] = fmaf(v, wp.at(n[i], k), acc[i]);
  }
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    if (live[i])
      y[m * N + n[i]] = (y[m * N + n[i]] + (add ? add[n[i]] : 0.f)) + acc[i] * wp.scale_of(n[i]);
  }
}

// The same for lists of kWarpListFrom values or more: a warp takes kWarpCols columns at once,
// lanes over the list, then a warp tree per column, so a warp's loads fall in kWarpCols rows
// of W'. Long lists gain from it (a thread per column walks its whole list alone); short
// ones lose to the warp tree's fixed cost, hence kWarpListFrom (docs/measurements.md,
// "Fix-up limits").
constexpr int kWarpCols = 4;
constexpr int kWarpListFrom = 8;
template <class WP>
__device__ __forceinline__ void correct_by_warp(const LeftOutList& list, int count, const WP& wp,
                                                const int* __restrict__ w_flags,
                                                const float* __restrict__ add, float* __restrict__ y,
                                                int64_t m, int64_t n0, int64_t N, int64_t K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  constexpr int kStep = kWarpCols * (kFixupThreads / 32);
  for (int64_t nb = n0 + warp * kWarpCols; nb < min(N, n0 + kCorrectCols); nb += kStep) {
    // lane i < kWarpCols owns column nb + i: its flag and Y value, loaded before the gathers
    const int64_t own = nb + lane;
    const bool live_own = lane < kWarpCols && own < N && row_paths_write(w_flags, own);
    const float y_own = live_own ? y[m * N + own] + (add ? add[own] : 0.f) : 0.f;
    float acc[kWarpCols];
    int64_t wn[kWarpCols];
#pragma unroll
    for (int i = 0; i < kWarpCols; ++i) {
      acc[i] = 0.f;
      wn[i] = min(nb + i, N - 1);  // a column past N reads row N - 1, unused
    }
    for (int j = lane; j < count; j += 32) {
      const float v = list.v[j];
      const int64_t k = list.k[j];
#pragma unroll
      for (int i = 0; i < kWarpCols; ++i) acc[i] = fmaf(v, wp.at(wn[i], k), acc[i]);
    }
    float mine = 0.f;
#pragma unroll
    for (int i = 0; i < kWarpCols; ++i) {
      for (int o = 16; o > 0; o >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
      if (lane == i) mine = acc[i];
    }
    if (live_own) y[m * N + own] = y_own + mine * wp.scale_of(own);
  }
}

// Item `item` of a row m whose values left out the fix-up adds (kCorrectCols columns from n0):
// list them (those left out at exponent e) and add their products, after `add` (or nothing).
template <typename Scan, class XR, class WP>
__device__ void correct_item(const XR& x, float e, const WP& wp, const int* __restrict__ w_flags,
                             const float* __restrict__ add, float* __restrict__ y, int64_t m,
                             int64_t n0, int64_t N, int64_t K, LeftOutList& list,
                             typename Scan::TempStorage& scan) {
  const int count = list_left_out<Scan>(x, m, e, K, list, scan);
  if (count >= kWarpListFrom)
    correct_by_warp(list, count, wp, w_flags, add, y, m, n0, N, K);
  else
    correct(list, count, wp, w_flags, add, y, m, n0, N, K);
  __syncthreads();  // the list is rebuilt by the next item
}

// This thread's kFlagsPerThread flags of x's rows from `first` (rows past M kept); whether
// any is marked.
__device__ __forceinline__ bool read_flags(const int* __restrict__ x_flags, int64_t first, int64_t M,
                                           int (&f)[kFlagsPerThread]) {
  bool marked = false;
#pragma unroll
  for (int j = 0; j < kFlagsPerThread; ++j) {
    f[j] = first + j < M ? x_flags[first + j] : kRowKept;
    marked |= f[j] != kRowKept;
  }
  return marked;
}

// The chunk's kRowTiny rows are second-level slots slot_base, slot_base + 1, ...: those whose
// slot left out more than correctable_tiny_values are added to the recomputed rows (any order).
__device__ __forceinline__ void list_crowded_slots(const SecondLevel& second, int64_t slot_base,
                                                   const int* tiny_rows, int64_t count, int64_t K,
                                                   int* recomputed_rows, int* recomputed_count) {
  for (int i = threadIdx.x; i < count; i += kFixupThreads)
    if (second.slot_tiny[slot_base + i] > correctable_tiny_values(K))
      recomputed_rows[atomicAdd(recomputed_count, 1)] = tiny_rows[i];
}

// NaN into the `rows` listed rows of y (a NaN row of x), at the columns the row paths write,
// spread over the grid's threads.
__device__ __forceinline__ void write_nan_rows(const int* rows, int count, const int* __restrict__ w_flags,
                                               float* __restrict__ y, int64_t N) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kFixupThreads + threadIdx.x; i < count * N;
       i += static_cast<int64_t>(gridDim.x) * kFixupThreads) {
    const int64_t n = i % N;
    if (row_paths_write(w_flags, n)) y[rows[i / N] * N + n] = nan_output();
  }
}

// A few listed rows recomputed by warps, one output each, spread over the grid's warps.
template <class XR, class WP>
__device__ __forceinline__ void recompute_rows_by_warps(const XR& x, const WP& wp,
                                                        const int* __restrict__ w_flags,
                                                        const float* __restrict__ bias, float* __restrict__ y,
                                                        const int* rows, int count, int64_t N, int64_t K,
                                                        int64_t warp, int64_t warps, int lane) {
  for (int64_t i = warp; i < count * N; i += warps) {
    const int64_t n = i % N;
    if (row_paths_write(w_flags, n)) recompute(x, wp, bias, y, rows[i / N], n, N, K, lane);
  }
}

// W's listed rows (w_list[1 ..]) recomputed as columns of y for every row of x, or written NaN
// where W's row holds one.
template <class XR, class WP>
__device__ __forceinline__ void recompute_listed_columns(const XR& x, const WP& wp,
                                                         const int* __restrict__ w_list,
                                                         const int* __restrict__ w_flags,
                                                         const float* __restrict__ bias, float* __restrict__ y,
                                                         int64_t M, int64_t N, int64_t K, int64_t n_cols,
                                                         int64_t warp, int64_t warps, int lane) {
  for (int64_t i = warp; i < n_cols * M; i += warps) {
    const int64_t m = i % M, n = w_list[1 + i / M];
    if (w_flags[n] != kRowNaN)
      recompute(x, wp, bias, y, m, n, N, K, lane);
    else if (lane == 0)
      y[m * N + n] = nan_output();
  }
}

// x's marked rows are listed a chunk of kFlagChunk rows at a time, by every CTA in the same
// (ascending) order: NaN rows written, spread over the grid's threads; recomputed rows by
// tiles (or, a few, by warps), spread over the grid; corrected rows in items of kCorrectCols
// columns, one per CTA. With second-level slots, kRowTiny rows are slots in row order: a slot
// holding more values left out than correctable_tiny_values makes its row recomputed; the
// others are taken by slot, in items too. W's listed rows are recomputed as columns (written
// NaN where they hold one), and the row paths leave those columns alone.
// Two CTAs an SM cap it at 128 registers: ptxas then keeps ~200 bytes of the kernel's own state
// in local memory (none in the tiles' k loops), and the corrections (gathers from all over W')
// run faster than with one CTA an SM. With nothing marked the large tile's code adds a little
// to every call (docs/measurements.md, "Fix-up limits").
template <class XR, class WP>
__global__ void __launch_bounds__(kFixupThreads, 2)  // the grid: two CTAs an SM
    fixup_kernel(const XR x, const WP wp, const float* __restrict__ bias,
                 float* __restrict__ y, int64_t M, int64_t N, int64_t K,
                 const float* __restrict__ x_exps, const int* __restrict__ x_flags,
                 const int* __restrict__ w_list, const int* __restrict__ w_flags, SecondLevel second) {
  using Scan = cub::BlockScan<int, kFixupThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int recomputed_rows[kFlagChunk], tiny_rows[kFlagChunk];
  __shared__ int recomputed_count;
  // A correction's list and a tile's stages are never live together: each item ends on a barrier.
  __shared__ union {
    LeftOutList list;
    SmallTile::Stage small[2];
    LargeTile::Stage large[2];
  } work;
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
  // 16-byte loads of x's and W's rows in the tiles
  const bool vec = K % 4 == 0 && reinterpret_cast<uintptr_t>(x.p) % 16 == 0 && reinterpret_cast<uintptr_t>(wp.p) % 16 == 0;
  int64_t slot_base = 0;  // the slot of the chunk's first kRowTiny row
  for (int64_t base = 0; base < M; base += kFlagChunk) {
    const int64_t first = base + kFlagsPerThread * threadIdx.x;
    int f[kFlagsPerThread];
    if (__syncthreads_or(read_flags(x_flags, first, M, f)) == 0) continue;  // the common case: nothing marked
    bool pick[kFlagsPerThread];
#pragma unroll
    for (int j = 0; j < kFlagsPerThread; ++j) pick[j] = f[j] == kRowNaN;
    const int nan_rows = list_picked_rows<Scan>(pick, first, recomputed_rows, scan);
    write_nan_rows(recomputed_rows, nan_rows, w_flags, y, N);
    __syncthreads();  // recomputed_rows is rewritten below
#pragma unroll
    for (int j = 0; j < kFlagsPerThread; ++j) pick[j] = f[j] == kRowRecompute;
    const int listed = list_picked_rows<Scan>(pick, first, recomputed_rows, scan);
    if (threadIdx.x == 0) recomputed_count = listed;  // seen after the next list's barrier
#pragma unroll
    for (int j = 0; j < kFlagsPerThread; ++j) pick[j] = f[j] == kRowTiny;
    int64_t corrected = list_picked_rows<Scan>(pick, first, tiny_rows, scan);
    if (slots > 0) {  // block-uniform; the slot loop below takes these rows
      list_crowded_slots(second, slot_base, tiny_rows, corrected, K, recomputed_rows, &recomputed_count);
      slot_base += corrected;
      corrected = 0;
    }
    __syncthreads();
    const int recomputed = recomputed_count;
    if (recomputed <= kWarpRowsMax) {
      recompute_rows_by_warps(x, wp, w_flags, bias, y, recomputed_rows, recomputed, N, K, warp, warps, lane);
    } else if (choose_large_tile(recomputed, N)) {
      recompute_rows_by_tiles<LargeTile>(x, wp, w_flags, bias, y, recomputed_rows, recomputed, N, K, vec,
                                         work.large);
    } else {
      recompute_rows_by_tiles<SmallTile>(x, wp, w_flags, bias, y, recomputed_rows, recomputed, N, K, vec,
                                         work.small);
    }
    // items row-fastest: the CTAs running at once gather from the same kCorrectCols rows of W'
    for (int64_t item = blockIdx.x; item < corrected * items_per_row; item += gridDim.x) {
      const int64_t m = tiny_rows[item % corrected];
      correct_item<Scan>(x, x_exps[m], wp, w_flags, nullptr, y, m, (item / corrected) * kCorrectCols,
                         N, K, work.list, scan);
    }
    __syncthreads();  // the lists are rewritten by the next chunk
  }
  for (int64_t item = blockIdx.x; item < slots * items_per_row; item += gridDim.x) {  // row-fastest too
    const int64_t s = item % slots, n0 = (item / slots) * kCorrectCols;
    if (second.slot_tiny[s] > correctable_tiny_values(K)) continue;  // recomputed above
    const float* add = second.y + s * (second.ldy > 0 ? second.ldy : N);
    correct_item<Scan>(x, second.exps[s], wp, w_flags, add, y, second.slot_row[s], n0, N, K,
                       work.list, scan);
  }
  recompute_listed_columns(x, wp, w_list, w_flags, bias, y, M, N, K, n_cols, warp, warps, lane);
}
}  // namespace

namespace {
// The fix-up with x and W read as stored: the forward's (both [rows, K]), dx's (W transposed)
// and dW's (both transposed).
template <bool kXTransposed, bool kWTransposed>
void launch_fixup(const float* x, const float* w, const float* w_scale, const float* bias, float* y,
                  int64_t M, int64_t N, int64_t K, const float* x_exps, const int* x_flags,
                  const int* w_list, const int* w_flags, SecondLevel second, cudaStream_t stream) {
  using XR = Rows<kXTransposed>;
  using WP = WPrime<kWTransposed>;
  const dim3 grid(static_cast<unsigned>(sm_count()) * 2), block(kFixupThreads);
  launch_programmatic(fixup_kernel<XR, WP>, grid, block, 0, stream, XR{x, M, K}, WP{{w, N, K}, w_scale}, bias,
                      y, M, N, K, x_exps, x_flags, w_list, w_flags, second);
}
}  // namespace

void launch_fixup_exceptional(const float* x, const float* w, const float* w_scale,
                              const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                              const float* x_exps, const int* x_flags, const int* w_list,
                              const int* w_flags, SecondLevel second, cudaStream_t stream,
                              bool w_transposed, bool x_transposed) {
  if (M <= 0 || N <= 0) return;
  if (x_transposed && !w_transposed)
    throw std::logic_error("CUDA fix-up: x transposed is read with W transposed (dW's case) only");
  if (x_transposed)
    launch_fixup<true, true>(x, w, w_scale, bias, y, M, N, K, x_exps, x_flags, w_list, w_flags, second, stream);
  else if (w_transposed)
    launch_fixup<false, true>(x, w, w_scale, bias, y, M, N, K, x_exps, x_flags, w_list, w_flags, second, stream);
  else
    launch_fixup<false, false>(x, w, w_scale, bias, y, M, N, K, x_exps, x_flags, w_list, w_flags, second, stream);
}

}  // namespace gemmfuse::cuda

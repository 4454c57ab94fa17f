// The row split of an operand stored transposed (split.h, launch_split_f16x2_transposed): dW =
// dVᵀ x reads dV [M, N] as its A [N, M], whose rows are dV's columns. Three passes over many
// CTAs, with no transposed fp32 copy: the columns' statistics (column_stats.cuh: each column's
// exponent from its largest finite magnitude, as the row split takes a row's), then tiles of
// 64 x 64 values split and transposed through shared memory, counting each column's values left
// out, then each column's mark from its counts, as the row split marks a row.
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>

#include "column_stats.cuh"
#include "cuda_check.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kTile = 64;             // a CTA's tile: kTile rows x kTile columns of src
constexpr int kTileThreads = 256;
constexpr int kPitch = kTile + 8;     // halves a column of the transposed tile (16-byte rows)

// Each column's values left out of the parts: tiny ones and infinities (counts [cols], zeroed).
struct LeftOut {
  int tiny, infs;
};

struct TransposedTile {
  __half part[2][kTile][kPitch];  // [plane][column][row]
  int e[kTile];
  bool take[kTile];               // not a NaN column (whose parts are zero) and inside src
  int tiny[kTile], infs[kTile];
};

// Column c's values of tile (r0, c0 + c) scaled by the column's exponent and split
// (split_f16x2_scaled) into the shared tile, transposed: [plane][column][row]. A thread takes
// four float4s (rows t/16 + 16 i, columns 4 (t % 16) ...) and adds what it left out to the
// columns' counts.
__device__ __forceinline__ void split_tile(const float* __restrict__ src, int64_t rows, int64_t cols,
                                           int64_t r0, int64_t c0, TransposedTile& tile) {
  const int t = threadIdx.x, cq = 4 * (t % 16);
  int tiny[4] = {}, infs[4] = {};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = t / 16 + 16 * i;
    const bool in = r0 + r < rows && c0 + cq < cols;  // cols a multiple of 4: a float4 is in or out
    const float4 q = in ? __ldg(reinterpret_cast<const float4*>(src + (r0 + r) * cols + c0 + cq))
                        : make_float4(0.f, 0.f, 0.f, 0.f);
    const float v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = cq + j;
      const bool left = split_f16x2_scaled(v[j], tile.e[c], in && tile.take[c], tile.part[0][c][r],
                                           tile.part[1][c][r]);
      infs[j] += left && isinf(v[j]);
      tiny[j] += left && !isinf(v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (tiny[j]) atomicAdd(&tile.tiny[cq + j], tiny[j]);
    if (infs[j]) atomicAdd(&tile.infs[cq + j], infs[j]);
  }
}

// The shared tile's parts into rows c0 .. of the part planes [2, cols, rows], from row r0 on:
// four 16-byte runs of 8 rows a thread.
__device__ __forceinline__ void store_tile(const TransposedTile& tile, int64_t rows, int64_t cols,
                                           int64_t r0, int64_t c0, __half* __restrict__ parts) {
  const int64_t plane = cols * rows;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int run = threadIdx.x + kTileThreads * i;  // [plane][column][8 runs of 8 rows]
    const int p = run / (8 * kTile), c = run / 8 % kTile, r = 8 * (run % 8);
    if (c0 + c < cols && r0 + r < rows)  // rows a multiple of 8: a run is in or out
      *reinterpret_cast<uint4*>(parts + p * plane + (c0 + c) * rows + r0 + r) =
          *reinterpret_cast<const uint4*>(&tile.part[p][c][r]);
  }
}

// A CTA per kTile columns and a stride of row tiles (grid y): each tile split and stored
// transposed, then the columns' counts of values left out added to `counts`.
__global__ void __launch_bounds__(kTileThreads)
    split_transposed_kernel(const float* __restrict__ src, int64_t rows, int64_t cols,
                            const ColumnStats* __restrict__ stats, __half* __restrict__ parts,
                            LeftOut* __restrict__ counts) {
  __shared__ __align__(16) TransposedTile tile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int t = threadIdx.x;
  if (t < kTile) {
    const bool in = c0 + t < cols;
    const ColumnStats s = in ? stats[c0 + t] : ColumnStats{};
    tile.e[t] = s.exponent();
    tile.take[t] = in && !s.nan;
    tile.tiny[t] = tile.infs[t] = 0;
  }
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile; r0 < rows; r0 += static_cast<int64_t>(gridDim.y) * kTile) {
    __syncthreads();  // the column setup, or the previous tile's stores, are done
    split_tile(src, rows, cols, r0, c0, tile);
    __syncthreads();
    store_tile(tile, rows, cols, r0, c0, parts);
  }
  __syncthreads();
  if (t < kTile && c0 + t < cols && (tile.tiny[t] || tile.infs[t])) {
    atomicAdd(&counts[c0 + t].tiny, tile.tiny[t]);
    atomicAdd(&counts[c0 + t].infs, tile.infs[t]);
  }
}

// Column c's exponent, tiny count and mark, as record_row gives a row of the row split.
__global__ void transposed_marks_kernel(const ColumnStats* __restrict__ stats,
                                        const LeftOut* __restrict__ counts, int64_t rows, int64_t cols,
                                        float* __restrict__ exps, RowMarks marks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const ColumnStats s = stats[c];
  const LeftOut n = counts[c];
  const int tiny = s.nan ? 0 : n.tiny;
  const int mark = split_row_mark(s.nan != 0, tiny, n.infs, correctable_infinities(rows));
  exps[c] = static_cast<float>(s.exponent());
  if (marks.flags) marks.flags[c] = mark;
  if (marks.tiny) marks.tiny[c] = tiny;
  if (marks.list && mark != kRowKept) marks.list[1 + atomicAdd(marks.list, 1)] = static_cast<int>(c);
}

// The scratch: the columns' statistics, then their counts.
size_t counts_offset(int64_t cols) { return (column_stats_bytes(cols) + 15) / 16 * 16; }

}  // namespace

size_t split_f16x2_transposed_scratch_bytes(int64_t cols) {
  return counts_offset(cols) + sizeof(LeftOut) * static_cast<size_t>(cols);
}

void launch_split_f16x2_transposed(const float* src, int64_t rows, int64_t cols, __half* parts, float* exps,
                                   RowMarks marks, void* scratch, cudaStream_t stream) {
  if (rows % 8 != 0 || cols % 4 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(parts) % 16 != 0)
    throw std::logic_error("CUDA fp16 transposed split: rows a multiple of 8, columns of 4, 16-byte aligned buffers");
  if (cols <= 0) return;
  auto* stats = static_cast<ColumnStats*>(scratch);
  auto* counts = reinterpret_cast<LeftOut*>(static_cast<char*>(scratch) + counts_offset(cols));
  GF_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(LeftOut) * static_cast<size_t>(cols), stream));
  launch_column_stats(src, rows, cols, stats, stream);
  if (rows > 0) {
    const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                    static_cast<unsigned>(std::min<int64_t>((rows + kTile - 1) / kTile, 65535)));
    split_transposed_kernel<<<grid, kTileThreads, 0, stream>>>(src, rows, cols, stats, parts, counts);
    GF_LAUNCH_CHECK();
  }
  transposed_marks_kernel<<<static_cast<unsigned>((cols + 255) / 256), 256, 0, stream>>>(stats, counts, rows, cols,
                                                                                         exps, marks);
  GF_LAUNCH_CHECK();
}

}  // namespace gemmfuse::cuda

// The row split of an operand stored transposed (split.h, launch_split_f16x2_transposed): dW =
// dVᵀ x reads dV [M, N] as its A [N, M], whose rows are dV's columns. Three passes over many
// CTAs, with no transposed fp32 copy: the columns' statistics (column_stats.cuh: each column's
// exponent from its largest finite magnitude, as the row split takes a row's), then each
// column's values split and stored as a row of the parts (a thread per column, runs of 16
// rows), counting what each column leaves out, then each column's mark from its counts, as
// the row split marks a row.
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>

#include "column_stats.cuh"
#include "cuda_check.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kThreads = 256;  // a CTA's columns, one a thread
constexpr int kRun = 16;       // rows a thread takes of its column at a time: 32 bytes of each plane

// Each column's values left out of the parts: tiny ones and infinities (counts [cols], zeroed).
struct LeftOut {
  int tiny, infs;
};

// A thread per column c and a stride of runs of kRun rows (grid y): each value scaled by the
// column's exponent and split (split_f16x2_scaled), the run's parts stored as 32 contiguous
// bytes of row c of each plane ([2, cols, rows]), then the column's counts of what it left out
// added to `counts`. A warp's loads of a row are 32 neighbouring columns (128 bytes); no shared
// memory.
__global__ void __launch_bounds__(kThreads)
    split_transposed_kernel(const float* __restrict__ src, int64_t rows, int64_t cols,
                            const ColumnStats* __restrict__ stats, __half* __restrict__ parts,
                            LeftOut* __restrict__ counts) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  const ColumnStats s = stats[c];
  const int e = s.exponent();
  const int64_t plane = cols * rows;
  int tiny = 0, infs = 0;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRun; r0 < rows; r0 += static_cast<int64_t>(gridDim.y) * kRun) {
    float v[kRun];
#pragma unroll
    for (int i = 0; i < kRun; ++i) v[i] = r0 + i < rows ? __ldg(src + (r0 + i) * cols + c) : 0.f;
    __align__(16) __half p[2][kRun];
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      const bool left = split_f16x2_scaled(v[i], e, r0 + i < rows && !s.nan, p[0][i], p[1][i]);
      infs += left && isinf(v[i]);
      tiny += left && !isinf(v[i]);
    }
#pragma unroll
    for (int h = 0; h < kRun; h += 8)  // rows a multiple of 8: eight rows are in or out
      if (r0 + h < rows)
#pragma unroll
        for (int k = 0; k < 2; ++k)
          *reinterpret_cast<uint4*>(parts + k * plane + c * rows + r0 + h) = *reinterpret_cast<const uint4*>(&p[k][h]);
  }
  if (tiny) atomicAdd(&counts[c].tiny, tiny);
  if (infs) atomicAdd(&counts[c].infs, infs);
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
  if (marks.tiny) marks.tiny[c] = tiny;
  write_mark(mark, c, marks);
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
    const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads),
                    static_cast<unsigned>(std::min<int64_t>((rows + kRun - 1) / kRun, 65535)));
    split_transposed_kernel<<<grid, kThreads, 0, stream>>>(src, rows, cols, stats, parts, counts);
    GF_LAUNCH_CHECK();
  }
  transposed_marks_kernel<<<static_cast<unsigned>((cols + 255) / 256), 256, 0, stream>>>(stats, counts, rows, cols,
                                                                                         exps, marks);
  GF_LAUNCH_CHECK();
}

}  // namespace gemmfuse::cuda

// Listing the marked rows of a chunk in row order, by a whole CTA, with no atomics: the fix-up
// and the second-level split walk x's row flags this way, a chunk of kPer * threads rows at a
// time, every CTA in the same order (so every CTA agrees on each row's position in the list).
#pragma once

#include <cstdint>

namespace gemmfuse::cuda {

// Thread t holds the picks of rows first + j (j < kPer, first = chunk base + kPer t). Writes
// the picked rows to out[0 .. count) in row order and returns count (in every thread). Every
// thread of the CTA calls it (block scan, then a barrier: out is complete and `scan` free for
// reuse on return).
template <class Scan, int kPer>
__device__ __forceinline__ int list_picked_rows(const bool (&pick)[kPer], int64_t first, int* out,
                                                typename Scan::TempStorage& scan) {
  int mine = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) mine += pick[j];
  int at = 0, count = 0;
  Scan(scan).ExclusiveSum(mine, at, count);
#pragma unroll
  for (int j = 0; j < kPer; ++j)
    if (pick[j]) out[at++] = static_cast<int>(first + j);
  __syncthreads();
  return count;
}

}  // namespace gemmfuse::cuda

// Heads whose Q, K, V (or dO) hold a NaN or an infinity, or whose magnitudes lie outside the
// split kernels' exponent range, recomputed in plain fp32 as PyTorch's math path computes them
// (attention_nonfinite.cu): enqueued after the split-product kernels (whose CTAs return at once
// for those heads), writing those heads' outputs; every other head's CTAs return at once.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "attention_f16x3.h"
#include "attention_tiles.cuh"

namespace gemmfuse::cuda {

// The bound on head bh's |dS| from which the backward takes dS's split exponent:
// 2 D max|dO| max|V| (amax [4][BH]: Q's, K's, V's, dO's largest magnitudes).
__device__ __forceinline__ float attention_ds_bound(const float* amax, int64_t BH, int64_t bh,
                                                    int D) {
  return 2.f * D * amax[3 * BH + bh] * amax[2 * BH + bh];
}

// Whether head bh's backward is recomputed in plain fp32: its Q, K, V or dO held a non-finite
// value (the per-head largest magnitudes, [4][BH], count a NaN as an infinity), or one of its
// split exponents, dS's from 2 D max|dO| max|V| included, falls outside the kernels' range
// (attention_tiles.cuh, kMaxSplitExp).
__device__ __forceinline__ bool attention_head_unsplit(const float* amax, int64_t BH, int64_t bh,
                                                       int D) {
  const float ds = attention_ds_bound(amax, BH, bh, D);
  return !(attention::splits_within_range(amax[bh]) &&
           attention::splits_within_range(amax[BH + bh]) &&
           attention::splits_within_range(amax[2 * BH + bh]) &&
           attention::splits_within_range(amax[3 * BH + bh]) &&
           attention::splits_within_range(ds));
}

// head_flags [BH]: non-zero where the head's forward is recomputed (V's split kernels set them).
void launch_attention_nonfinite_forward(const AttentionF16x3& a, const int* head_flags,
                                        cudaStream_t stream);
// head_amax [4][BH]: Q's, K's, V's and dO's largest magnitude per head.
void launch_attention_nonfinite_backward(const AttentionF16x3Backward& a, const float* head_amax,
                                         cudaStream_t stream);

}  // namespace gemmfuse::cuda

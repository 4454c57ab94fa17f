// Heads whose Q, K, V (or dO) hold a NaN or an infinity, recomputed in plain fp32 as PyTorch's
// math path computes them (attention_nonfinite.cu): enqueued after the split-product kernels,
// overwriting those heads' outputs; every other head's CTAs return at once.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "attention_f16x3.h"

namespace gemmfuse::cuda {

// Whether head bh's Q, K, V or dO held a non-finite value: the backward's per-head largest
// magnitudes ([4][BH], a NaN counted as an infinity) are then not finite.
__device__ __forceinline__ bool attention_head_nonfinite(const float* amax, int64_t BH,
                                                         int64_t bh) {
  return !(isfinite(amax[bh]) && isfinite(amax[BH + bh]) && isfinite(amax[2 * BH + bh]) &&
           isfinite(amax[3 * BH + bh]));
}

// head_flags [BH]: non-zero where the head's Q, K or V held a non-finite value.
void launch_attention_nonfinite_forward(const AttentionF16x3& a, const int* head_flags,
                                        cudaStream_t stream);
// head_amax [4][BH]: Q's, K's, V's and dO's largest magnitude per head.
void launch_attention_nonfinite_backward(const AttentionF16x3Backward& a, const float* head_amax,
                                         cudaStream_t stream);

}  // namespace gemmfuse::cuda

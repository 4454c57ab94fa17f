// Split precision for `fast` fp32 GEMMs: v = hi + lo with hi = bf16(v), lo = bf16(v - hi).
// Rows are laid out [lo | 0 | hi | 0] for x and [hi | 0 | lo | 0] for W, each half Kh =
// split_half(K) wide (zero padded), so that one GEMM over K' = 2*Kh gives xlo.Whi + xhi.Wlo and a
// second over the hi halves gives xhi.Whi.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gemmfuse::cuda {

// The two bf16 parts of v. A non-finite v keeps its value in hi and a zero lo (so that
// inf - inf does not turn an infinite product into NaN).
__device__ __forceinline__ void split_bf16(float v, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(v);
  const float h = __bfloat162float(hi);
  lo = __float2bfloat16_rn(isfinite(v) && isfinite(h) ? v - h : 0.f);
}

// x[M,K] fp32 -> xs[M, 2*Kh] bf16 as [xlo | 0 | xhi | 0].
void launch_split_x(const float* x, __nv_bfloat16* xs, int64_t M, int64_t K, int64_t Kh,
                    cudaStream_t stream);

}  // namespace gemmfuse::cuda

// Split precision for fp32 GEMMs on tensor cores.
// - `fast`: v = hi + lo with hi = bf16(v), lo = bf16(v - hi). Rows are laid out
//   [lo | 0 | hi | 0] for x and [hi | 0 | lo | 0] for W, each half Kh = split_half(K) wide (zero
//   padded), so that one GEMM over K' = 2*Kh gives xlo.Whi + xhi.Wlo and a second over the hi
//   halves gives xhi.Whi.
// - `fp32` on sm90 (sm90/gemm_bf16x6.h): v = v0 + v1 + v2 in bf16, three planes [rows, K];
//   rows holding an exceptional value are listed and recomputed in fp32 (launch_fixup_exceptional).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gemmfuse::cuda {

#if defined(__CUDACC__)  // the per-value splits (the launchers below are host-callable)

// Two bf16 values as one 32-bit word, a first (lower address).
__device__ __forceinline__ uint32_t pack_bf16x2(__nv_bfloat16 a, __nv_bfloat16 b) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(a)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(b)) << 16);
}

// The two bf16 parts of v. A non-finite v keeps its value in hi and a zero lo (so that
// inf - inf does not turn an infinite product into NaN).
__device__ __forceinline__ void split_bf16(float v, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(v);
  const float h = __bfloat162float(hi);
  lo = __float2bfloat16_rn(isfinite(v) && isfinite(h) ? v - h : 0.f);
}

// v = p0 + p1 + p2, each part the bf16 rounding of what the earlier ones leave (the
// subtractions are exact): 24 significant bits, all of a normal fp32 v, as long as v2 is
// not subnormal. False, with zero parts, for an exceptional v: NaN, infinite, past bf16's
// largest finite value (v0 would round to infinity) or nonzero below 2^-110 (v2 subnormal).
__device__ __forceinline__ bool split_bf16x3(float v, __nv_bfloat16& p0, __nv_bfloat16& p1,
                                             __nv_bfloat16& p2) {
  const float a = fabsf(v);
  if (!(a <= __uint_as_float(0x7f7f0000u)) || (a != 0.f && a < 0x1p-110f)) {
    p0 = p1 = p2 = __float2bfloat16_rn(0.f);
    return false;
  }
  p0 = __float2bfloat16_rn(v);
  const float r1 = v - __bfloat162float(p0);
  p1 = __float2bfloat16_rn(r1);
  p2 = __float2bfloat16_rn(r1 - __bfloat162float(p1));
  return true;
}

#endif  // __CUDACC__

// src [rows, K] fp32 (K a multiple of 8, src 16-byte aligned) -> parts, three bf16 planes of
// [rows, K] (x per call, W' once per weight version). Rows holding an exceptional value are
// appended to `list`: list[0] counts them (the caller zeroes it before), list[1..] are the
// row indices, in no particular order.
void launch_split_bf16x3(const float* src, int64_t rows, int64_t K, __nv_bfloat16* parts,
                         int* list, cudaStream_t stream);

// Y[m, :] for the rows m of x in x_rows and Y[:, n] for the rows n of W in w_rows (lists as
// launch_split_bf16x3 writes them) recomputed as fp32 dot products (+ bias[n]): the values
// the split cannot carry reach Y as in SGEMM (inf, NaN, overflow, tiny values). Nothing to do
// costs one launch that reads the two counts.
void launch_fixup_exceptional(const float* x, const float* w, const float* bias, float* y,
                              int64_t M, int64_t N, int64_t K, const int* x_rows,
                              const int* w_rows, cudaStream_t stream);

// x[M,K] fp32 -> xs[M, 2*Kh] bf16 as [xlo | 0 | xhi | 0].
void launch_split_x(const float* x, __nv_bfloat16* xs, int64_t M, int64_t K, int64_t Kh,
                    cudaStream_t stream);

}  // namespace gemmfuse::cuda

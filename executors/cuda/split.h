// Split precision for fp32 GEMMs on tensor cores.
// - `fast`: v = hi + lo with hi = bf16(v), lo = bf16(v - hi). Rows are laid out in segments
//   Kh = split_segment_width(K) wide (zero padded): [lo | hi | hi] for x and [hi | lo | hi] for W, so
//   that one GEMM over K' = 3*Kh sums xlo.Whi + xhi.Wlo first, then xhi.Whi (gemm_cublas.cu).
// - `fp32` on sm90 (sm90/gemm_f16x3.h): each row scaled by a power of two, then
//   v 2^e = p0 + 2^-11 p1 in fp16, two planes [rows, K] and the rows' exponents.
// Both splits list the rows holding a value they cannot carry and zero their parts;
// launch_fixup_exceptional recomputes those rows and columns of Y in fp32. For `fast` that is
// split_exceptional below; for `fp32`, NaN, infinities and nonzero values more than ~2^29
// below their row's largest (the row scale keeps every other value in fp16's normal range).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gemmfuse::cuda {

// Where the splits mark the rows holding an exceptional value (either may be nullptr):
// `flags[r]` is written for every row, 1 or 0 (no zeroing needed: x, per call); `list` gets
// the marked rows appended, list[0] counting them (zeroed by the caller: W', at prepare).
struct RowMarks {
  int* flags = nullptr;
  int* list = nullptr;
};

#if defined(__CUDACC__)  // the per-value splits (the launchers below are host-callable)

// Two bf16 values as one 32-bit word, a first (lower address).
__device__ __forceinline__ uint32_t pack_bf16x2(__nv_bfloat16 a, __nv_bfloat16 b) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(a)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(b)) << 16);
}

// Eight bf16 values as one 16-byte word, p[0] first.
__device__ __forceinline__ uint4 pack_bf16x8(const __nv_bfloat16 (&p)[8]) {
  return make_uint4(pack_bf16x2(p[0], p[1]), pack_bf16x2(p[2], p[3]), pack_bf16x2(p[4], p[5]),
                    pack_bf16x2(p[6], p[7]));
}

// A value `fast`'s bf16 split cannot carry: NaN, infinite, past bf16's largest finite value (the
// leading part would round to infinity) or nonzero below 2^-110 (the last part would be
// subnormal). Its parts are zero and its row is recomputed in fp32 (launch_fixup_exceptional):
// a zero part times an infinite one would be NaN where fp32 gives an infinity.
__device__ __forceinline__ bool split_exceptional(float v) {
  const float a = fabsf(v);
  return !(a <= __uint_as_float(0x7f7f0000u)) || (a != 0.f && a < 0x1p-110f);
}

// v = hi + lo (16 significant bits), hi = bf16(v), lo = bf16(v - hi) (`fast`). False, with
// zero parts, for an exceptional v.
__device__ __forceinline__ bool split_bf16(float v, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  if (split_exceptional(v)) {
    hi = lo = __float2bfloat16_rn(0.f);
    return false;
  }
  hi = __float2bfloat16_rn(v);
  lo = __float2bfloat16_rn(v - __bfloat162float(hi));
  return true;
}

// The end of a CTA's row r in the splits: marks the row if any thread saw an exceptional
// value (every thread of the CTA calls it).
__device__ __forceinline__ void mark_row(bool exceptional, int64_t r, RowMarks marks) {
  const bool any = __syncthreads_or(exceptional);
  if (threadIdx.x == 0) {
    if (marks.flags) marks.flags[r] = any;
    if (marks.list && any) marks.list[1 + atomicAdd(marks.list, 1)] = static_cast<int>(r);
  }
}

#endif  // __CUDACC__

// The fp32 mode's split (sm90/gemm_f16x3.h), x per call and W' once per weight version: each
// row r of src [rows, K] fp32 (K a multiple of 8, src 16-byte aligned) scaled by 2^e[r],
// e[r] = 14 - floor(log2 max_k |src[r, k]|) (0 for a zero row), so that its largest value lies
// in [2^14, 2^15), below fp16's largest; then v 2^e = p0 + 2^-11 p1 with p0 = fp16(v 2^e) and
// p1 = fp16((v 2^e - p0) 2^11): 22 significant bits, |v 2^e - p0 - 2^-11 p1| <= 2^-22 |v 2^e|
// for every |v 2^e| >= 2^-14 (fp16's least normal value). parts: two fp16 planes [rows, K];
// exps[r] = e[r] as a float. Marked (RowMarks): rows holding a NaN or an infinity (their parts
// zero, e = 0), and rows holding a nonzero |v 2^e| < 2^-14, more than 2^28-2^29 below the
// row's largest (their parts unused: the fix-up rewrites the row's outputs). Such a value
// would lose its low bits, which matters where the other operand is large at its k (x = [1e30,
// 1] against w = [0, 1]: the 1 would vanish beside 1e30).
void launch_split_f16x2(const float* src, int64_t rows, int64_t K, __half* parts, float* exps,
                        RowMarks marks, cudaStream_t stream);

// Y[m, :] for the rows m of x with x_flags[m] != 0 and Y[:, n] for the rows n of W' in w_list
// (as the splits mark them) recomputed as fp32 dot products (+ bias[n]), W'[n, k] = w[n, k] *
// w_scale[n] (w_scale may be nullptr: W' = w): the values the split cannot carry reach Y as in
// SGEMM (inf, NaN, overflow, tiny values). Nothing to do costs one launch whose CTAs read the
// M flags and the list's count.
void launch_fixup_exceptional(const float* x, const float* w, const float* w_scale,
                              const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                              const int* x_flags, const int* w_list, cudaStream_t stream);

// The `fast` split of src [rows, K] fp32 (times scale[r] per row when scale is not nullptr)
// into out [rows, 3 * Kh] bf16, three segments of the row's parts, each zero padded to Kh, in
// the order named: [lo | hi | hi] (x, per call) or [hi | lo | hi] (W', once per weight
// version). Rows with an exceptional value are marked (RowMarks).
enum class HiLoOrder { LoHiHi, HiLoHi };
constexpr int kFastSplitSegments = 3;
void launch_split_hilo(const float* src, const float* scale, int64_t rows, int64_t K, int64_t Kh,
                       HiLoOrder order, __nv_bfloat16* out, RowMarks marks, cudaStream_t stream);

}  // namespace gemmfuse::cuda

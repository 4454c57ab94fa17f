// The pieces the attention kernels share (attention_f16x3.cu, attention_f16x3_backward.cu):
// the split of a value into fp16 parts, tiles of parts in shared memory, and warp-level
// products of split operands with mma.sync m16n8k16 (fp16 in, fp32 accumulate).
//
// A warp's product covers 16 rows of A: lane (g = lane / 4, t = lane % 4) holds, of each
// 16 x 8 output tile n, c[n][0..1] at row g, columns 8n + 2t and 8n + 2t + 1, and c[n][2..3]
// at row g + 8 (PTX's m16n8k16 fragment layout). A is read from shared rows (k along a row)
// or from registers (a previous product's output, as FlashAttention-2 keeps P); B is read as
// B[k][n] = b[n][k] from shared rows of b, so pairs of neighbouring k are one 32-bit load.
//
// A product of split operands is hi·hi + 2^-11 (hi·lo + lo·hi) (the lo parts 2^11 too large):
// the large product and the two small ones into two fresh accumulators, each B fragment loaded
// once for both of its uses, then added in fp32; a running sum (O, dK, dV) takes each tile's
// product by fp32 adds.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "split.h"

namespace gemmfuse::cuda::attention {

constexpr int kTile = 64;       // query rows and keys per tile
constexpr int kThreads = 128;   // 4 warps, 16 rows each
constexpr int kPad = 8;         // halves of padding per shared row (bank spread, 16-byte rows)
constexpr float kSmall = 0x1p-11f;

// The exponent e that puts amax 2^e just under 2^15 (0 for 0 and non-finite amax).
__device__ __forceinline__ int split_exponent(float amax) {
  if (!(amax > 0.f) || !isfinite(amax)) return 0;
  int e;
  frexpf(amax, &e);  // amax = f 2^e, f in [0.5, 1)
  return 15 - e;
}

// The split exponents the kernels take: within ±kMaxSplitExp (largest magnitudes within about
// [2^-45, 2^75]) a scale 2^-e, and 2^-(e1 + e2) for a product, is a normal float, so the
// kernels undo it by multiplying by that power of two (exact, as ldexpf, without its range
// checks in the inner loops). A head with an exponent outside, or with a non-finite value, is
// recomputed in plain fp32 (attention_nonfinite.cu).
constexpr int kMaxSplitExp = 60;

__device__ __forceinline__ bool split_exponent_fits(int e) {
  return e >= -kMaxSplitExp && e <= kMaxSplitExp;
}

// amax is finite and its split exponent fits.
__device__ __forceinline__ bool splits_within_range(float amax) {
  return isfinite(amax) && split_exponent_fits(split_exponent(amax));
}

// |v|, a NaN counted as an infinity: the largest magnitudes the splits take (a head or column
// holding a non-finite value then has amax +inf and is recomputed).
__device__ __forceinline__ float abs_or_inf(float v) { return isnan(v) ? INFINITY : fabsf(v); }

// A largest magnitude gathered over many CTAs: *bits (a float's bits, zeroed before) becomes the
// larger of itself and m >= 0, by atomicMax on the bits (non-negative floats order as their bits).
__device__ __forceinline__ void fold_max_magnitude(int* bits, float m) {
  atomicMax(bits, __float_as_int(m));
}

// The shared memory of a kernel whose Shared<D> holds its tiles, at head dim D (64, 96 or 128).
template <template <int> class Shared>
constexpr int shared_bytes_at(int D) {
  return D == 64 ? sizeof(Shared<64>) : D == 96 ? sizeof(Shared<96>) : sizeof(Shared<128>);
}

// 2^n for |n| <= 2 kMaxSplitExp: a normal float, exact (its exponent field written directly).
__device__ __forceinline__ float pow2(int n) { return __int_as_float((n + 127) << 23); }

// 2^-e for a split's exponent e as its workspace stores it (a float): the factor that undoes it.
__device__ __forceinline__ float unscale_of(float e) { return pow2(-static_cast<int>(e)); }

// 2^x as the SFU computes it (exp2f's own approximation, without exp2f's handling of results
// below 2^-126, which come out 0): for the softmax's p = 2^(s - max) in (0, 1], where such a p
// lies below the split's fp16 parts (P's parts carry nothing under ~2^-25) and below fp32's
// resolution of the row's sum (at least 1), and the running sums' rescaling factor.
__device__ __forceinline__ float exp2_flushed(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// v scaled by 2^e into its two fp16 parts, by split.h's rule. Attention keeps every value: a
// head holding a NaN or an infinity is recomputed in fp32 (attention_nonfinite.cu).
__device__ __forceinline__ void split_one(float v, int e, __half* hi, __half* lo) {
  split_f16x2_value(ldexpf(v, e), *hi, *lo);
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pair(const __half* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ uint32_t pack(__half a, __half b) {
  const __half2 h = __halves2half2(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two neighbouring values' high and low parts, as one A-fragment register each.
__device__ __forceinline__ void split_pair(float p0, float p1, uint32_t& hi, uint32_t& lo) {
  const __half h0 = __float2half_rn(p0), h1 = __float2half_rn(p1);
  hi = pack(h0, h1);
  lo = pack(__float2half_rn((p0 - __half2float(h0)) * 2048.f),
            __float2half_rn((p1 - __half2float(h1)) * 2048.f));
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// 16 bytes from global to shared memory without passing through registers (cp.async .cg:
// cached in L2 only), or 16 zero bytes where !valid (src is then not read). Complete only after
// wait_async_copies() and, for the other threads' copies, a barrier.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :
               : "r"(at), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// Waits for this thread's copy16_async copies.
__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Rows [r0, r0 + kTile) of a [rows, D] part into a shared [kTile][D + kPad] tile, zeros past
// `rows`, by copy16_async (the caller waits). The CTA's kThreads threads together, each a fixed
// count of 16-byte pieces (unrolled, 32-bit offsets from the tile's first row: with the
// runtime's loop bounds the compiler ran the parts one after another, with 64-bit address
// arithmetic for each piece).
template <int D>
__device__ void load_rows(const __half* src, int64_t r0, int64_t rows, __half (*dst)[D + kPad]) {
  constexpr int kPieces = kTile * D / 8;
  static_assert(kPieces % kThreads == 0, "whole pieces per thread");
  const __half* base = src + r0 * D;
  const int n = rows - r0 < kTile ? static_cast<int>(rows - r0) : kTile;  // rows within x
#pragma unroll
  for (int it = 0; it < kPieces / kThreads; ++it) {
    const int i = static_cast<int>(threadIdx.x) + it * kThreads;
    const int r = i / (D / 8), c = (i % (D / 8)) * 8;
    copy16_async(&dst[r][c], r < n ? base + r * D + c : base, r < n);
  }
}

// Columns [c0, c0 + kTile) of D rows of a transposed part (rows ld halves apart; ld and c0
// multiples of 8, the part zero past its keys) into a shared [D][kTile + kPad] tile, as
// load_rows.
template <int D>
__device__ void load_columns(const __half* src, int64_t ld, int64_t c0,
                             __half (*dst)[kTile + kPad]) {
  constexpr int kPieces = D * kTile / 8;
  static_assert(kPieces % kThreads == 0, "whole pieces per thread");
  const __half* base = src + c0;
#pragma unroll
  for (int it = 0; it < kPieces / kThreads; ++it) {
    const int i = static_cast<int>(threadIdx.x) + it * kThreads;
    const int r = i / (kTile / 8), c = (i % (kTile / 8)) * 8;
    copy16_async(&dst[r][c], base + r * ld + c, true);
  }
}

// How a shared tile holds an mma's B[k][n]: as b[n][k] (rows along k: pairs of neighbouring k
// are one 32-bit load) or as b[k][n] (rows along n, e.g. a tile of Q's or dO's rows read as the
// B of dK += dSᵀ Q: ldmatrix .trans gathers the pairs along k), so no transposed copy is kept.
enum class BTile { kRowsAlongK, kRowsAlongN };

// B's two fragment registers for k in [k0, k0 + 16), n in [n0, n0 + 8) from a tile with rows
// along n (lane = 4 g + t): lanes 0-15 give rows k0 .. k0 + 15, two 8 x 8 matrices transposed
// on the way (ldmatrix .x2 .trans).
__device__ __forceinline__ void b_fragment_trans(uint32_t& b0, uint32_t& b1, const __half* b, int ldb,
                                                 int k0, int n0, int g, int t) {
  const __half* row = b + (k0 + ((4 * g + t) & 15)) * ldb + n0;
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(b0), "=r"(b1)
               : "r"(at));
}

// Four 8 x 8 matrices of 16-bit values from shared memory (ldmatrix .x4): lanes 8 j .. 8 j + 7
// give the 16-byte-aligned addresses of matrix j's rows, and r[j] holds values 2t, 2t + 1 of
// its row g (lane = 4 g + t): one instruction for what four 32-bit loads a lane gather.
__device__ __forceinline__ void load_matrices_x4(uint32_t (&r)[4], const __half* row) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}

// B's fragment registers of both parts for k in [k0, k0 + 16), n in [n0, n0 + 8): h0, h1 of
// the high part, l0, l1 of the low one. Rows along k: one ldmatrix .x4 (matrices: high part
// k0.., k0 + 8..; low part k0.., k0 + 8..); rows along n: b_fragment's ldmatrix .trans each.
template <BTile L>
__device__ __forceinline__ void b_fragments(uint32_t& h0, uint32_t& h1, uint32_t& l0, uint32_t& l1,
                                            const __half* bh, const __half* bl, int ldb, int k0,
                                            int n0, int g, int t) {
  if constexpr (L == BTile::kRowsAlongK) {
    const int lane = 4 * g + t;
    uint32_t r[4];
    load_matrices_x4(r, (lane & 16 ? bl : bh) + (n0 + (lane & 7)) * ldb + k0 + (lane & 8));
    h0 = r[0], h1 = r[1], l0 = r[2], l1 = r[3];
  } else {
    b_fragment_trans(h0, h1, bh, ldb, k0, n0, g, t);
    b_fragment_trans(l0, l1, bl, ldb, k0, n0, g, t);
  }
}

// Where output tile n0 (8 columns) of B starts in its shared tile.
template <BTile L>
__device__ __forceinline__ const __half* b_columns(const __half* b, int ldb, int n0) {
  return L == BTile::kRowsAlongK ? b + 8 * n0 * ldb : b + 8 * n0;
}

// A's fragment of k-step [k0, k0 + 16) for the warp's 16 rows of a shared tile (rows lda apart,
// 16-byte aligned): one ldmatrix .x4, matrices rows 0-7 and 8-15 at k0, then both at k0 + 8,
// so that af = {A[g][k0 + 2t..], A[g + 8][k0 + 2t..], A[g][k0 + 8 + 2t..], A[g + 8][k0 + 8 + 2t..]}.
__device__ __forceinline__ void a_fragment(uint32_t (&af)[4], const __half* a, int lda, int k0,
                                           int g, int t) {
  const int lane = 4 * g + t;
  load_matrices_x4(af, a + ((lane & 7) + (lane & 8)) * lda + k0 + (lane & 16 ? 8 : 0));
}

// One k-step of a product of split operands over NT output tiles: big += A_hi B_hi and
// small += A_hi B_lo + A_lo B_hi, each B fragment pair loaded once for both of its uses (the
// products share shared memory's bandwidth, which bounds these kernels before the tensor cores).
template <int NT, BTile L>
__device__ __forceinline__ void mma3_step(float (&big)[NT][4], float (&small)[NT][4],
                                          const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                          const __half* bh, const __half* bl, int ldb, int k0,
                                          int g, int t) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    uint32_t h0, h1, l0, l1;
    b_fragments<L>(h0, h1, l0, l1, bh, bl, ldb, k0, 8 * n, g, t);
    mma(small[n], ah, l0, l1);
    mma(small[n], al, h0, h1);
    mma(big[n], ah, h0, h1);
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&c)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
}

// c = A B on split operands, both from shared rows: hi·hi + 2^-11 (hi·lo + lo·hi), the two
// sums in their own fresh accumulators, added in fp32.
template <int K, int NT, BTile L = BTile::kRowsAlongK>
__device__ __forceinline__ void product3_rows(float (&c)[NT][4], const __half* ah,
                                              const __half* al, int lda, const __half* bh,
                                              const __half* bl, int ldb, int g, int t) {
  float small[NT][4];
  zero(c), zero(small);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t fh[4], fl[4];
    a_fragment(fh, ah, lda, 16 * kk, g, t);
    a_fragment(fl, al, lda, 16 * kk, g, t);
    mma3_step<NT, L>(c, small, fh, fl, bh, bl, ldb, 16 * kk, g, t);
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) c[n][i] += small[n][i] * kSmall;
}

// A's k-step fragments from a previous product's output x (KT k-steps of 16 columns: 2 KT
// output tiles), each value times `mul`, split into parts.
template <int KT>
__device__ __forceinline__ void to_a_parts(const float (&x)[2 * KT][4], float mul,
                                           uint32_t (&hi)[KT][4], uint32_t (&lo)[KT][4]) {
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    split_pair(x[2 * kk][0] * mul, x[2 * kk][1] * mul, hi[kk][0], lo[kk][0]);
    split_pair(x[2 * kk][2] * mul, x[2 * kk][3] * mul, hi[kk][1], lo[kk][1]);
    split_pair(x[2 * kk + 1][0] * mul, x[2 * kk + 1][1] * mul, hi[kk][2], lo[kk][2]);
    split_pair(x[2 * kk + 1][2] * mul, x[2 * kk + 1][3] * mul, hi[kk][3], lo[kk][3]);
  }
}

// c += A B on split operands, A in registers, into an accumulator holding a sum: each group of
// Chunk output tiles is a fresh product (product3_rows's sums), then added to c in fp32. The
// tensor core's adds truncate, so a running sum fed back through every mma as C would lose low
// bits at the size of the whole sum, biased toward zero (the split GEMM moves its sum into fp32
// registers for the same reason: sm90/split_products_mainloop.h). Each B fragment is loaded
// once whatever Chunk is; a smaller Chunk holds fewer registers (the backward's 2 keep it from
// spilling its dK and dV sums).
template <int KT, int NT, BTile L = BTile::kRowsAlongK, int Chunk = 4>
__device__ __forceinline__ void accumulate3_regs(float (&c)[NT][4], const uint32_t (&ah)[KT][4],
                                                 const uint32_t (&al)[KT][4], const __half* bh,
                                                 const __half* bl, int ldb, int g, int t) {
  constexpr int kChunk = NT < Chunk ? NT : Chunk;
  static_assert(NT % kChunk == 0, "output tiles in whole groups");
#pragma unroll
  for (int n0 = 0; n0 < NT; n0 += kChunk) {
    float big[kChunk][4], small[kChunk][4];
    zero(big), zero(small);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
      mma3_step<kChunk, L>(big, small, ah[kk], al[kk], b_columns<L>(bh, ldb, n0),
                           b_columns<L>(bl, ldb, n0), ldb, 16 * kk, g, t);
#pragma unroll
    for (int n = 0; n < kChunk; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[n0 + n][i] += big[n][i] + small[n][i] * kSmall;
  }
}

}  // namespace gemmfuse::cuda::attention

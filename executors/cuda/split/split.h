// Split precision for fp32 GEMMs on tensor cores.
// - `fast`: v = hi + lo with hi = bf16(v), lo = bf16(v - hi). Rows are laid out in segments
//   Kh = split_segment_width(K) wide (zero padded): [lo | hi | hi] for x and [hi | lo | hi] for W, so
//   that one GEMM over K' = 3*Kh sums xlo.Whi + xhi.Wlo first, then xhi.Whi (gemm_cublas.cu).
// - `fp32` on sm90 (sm90/gemm_f16x3.h, run end to end by fp32_gemm_f16x3.h): each row scaled
//   by a power of two, then v 2^e = p0 + 2^-11 p1 in fp16, two planes [rows, K] and the rows'
//   exponents.
// Both splits mark the rows holding a value they cannot carry; launch_fixup_exceptional then
// mends those rows and columns of Y in fp32. A row holding a NaN has every output NaN, which
// the fix-up writes without computing. Otherwise, for `fast`, split_exceptional below (the row
// is recomputed); for `fp32`, infinities and nonzero values more than ~2^28 below their row's
// largest ("tiny": the row scale keeps every other value in fp16's normal range). Both are
// left out of the parts ("left out": left_out_at), and their products come back one of two
// ways, chosen on the device per call by how many there are (second_level_pays):
// - few: the fix-up adds each one's products to Y in fp32 (a gather of W' per value);
// - many: x's rows holding them are split again with the exponent of their tiny values alone
//   (launch_split_second_level), and a second GEMM over those rows adds their products.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gemmfuse::cuda {

// What the splits write for a row of x (flags) and whether W's rows enter the list.
enum RowMark : int {
  kRowKept = 0,       // the parts carry the row
  kRowRecompute = 1,  // the fix-up recomputes the row's outputs
  kRowTiny = 2,       // `fp32` only: the parts leave out the row's tiny values and infinities,
                      // whose products the fix-up or the second level adds to the row's outputs
  kRowNaN = 3,        // the row holds a NaN: every output it enters is NaN (NaN times any value
                      // is NaN), written so by the fix-up; the row's parts are zero
};

// Where the splits mark rows (any may be nullptr): `flags[r]` is written for every row, a
// RowMark (no zeroing needed); `list` gets every marked row appended, list[0] counting them
// (zeroed by the caller: W', at prepare). The fix-up recomputes Y's columns for W's listed
// rows. `tiny[r]` (`fp32`'s split) is written for every row: how many tiny values it holds
// (infinities not counted; 0 for a kRowNaN row).
struct RowMarks {
  int* flags = nullptr;
  int* list = nullptr;
  int* tiny = nullptr;
};

// The fix-up lists a row's values left out by kind, at most 1024 of each (its list holds 2048:
// fixup_exceptional.cu), so every limit below is capped there.
__host__ __device__ constexpr int64_t at_most_1024(int64_t n) { return n < 1024 ? n : 1024; }

// The most values still tiny at the second level (with the row's infinities) that a slot's row
// may hold for the fix-up to correct them (a list of them) rather than recompute the row:
// K/256, at most 1024. A correction gathers a 32-byte sector of W' per value and output
// column, from all over W' when the values' k are spread; the tiled recompute costs N K FMAs a
// row, shared by many rows: past about K/200 values recomputing the row by tiles is cheaper
// (docs/measurements.md, "Fix-up limits"). Below the second level, second_level_pays bounds
// every row's list.
__host__ __device__ constexpr int64_t correctable_tiny_values(int64_t K) {
  return at_most_1024(K / 256);
}

// The most infinities a row of x may hold for the fix-up to correct them rather than recompute
// the row: K/512, at most 1024. Each infinity of a row adds a pass of gathers over W' for
// every output column, so the corrections' cost grows with the count while recomputing the
// rows by tiles does not: past about K/430 the tiles are cheaper (docs/measurements.md,
// "Fix-up limits").
__host__ __device__ constexpr int64_t correctable_infinities(int64_t K) {
  return at_most_1024(K / 512);
}

// Whether x's tiny values, `values` in all, go through the second level rather than the fix-up's
// corrections. A correction gathers a 32-byte sector of W' per value and output column; the
// second level costs a pass of the GEMM's mainloop over the rows holding them (one wave of
// tiles per 256 rows at the seed shape) and its split, whatever the count. At most K/32
// values in all (256 at the seed shape) stay with the fix-up (docs/measurements.md,
// "Fix-up limits").
__host__ __device__ constexpr bool second_level_pays(int64_t values, int64_t K) {
  return values > at_most_1024(K / 32);
}

// fp32's second level, in the workspace of a call: x's rows marked kRowTiny, when
// second_level_pays, each split again (slot s holding the s-th such row in row order) with the
// exponent of its tiny values alone, so that values ~2^28 to ~2^56 below the row's largest are
// carried as the first level carries the rest; a GEMM over the slots (sm90 F16x3Problem::rows)
// writes their products with W' to `y`, and the fix-up adds them to Y's rows.
struct SecondLevel {
  int* rows = nullptr;       // [1]: slots in use; 0 where the fix-up corrects every kRowTiny row
  int* slot_row = nullptr;   // [M]: x's row in each slot
  int* slot_tiny = nullptr;  // [M]: values left out at the second level too, tiny there or
                             // infinite (corrected or, past correctable_tiny_values, the row
                             // recomputed, by the fix-up)
  float* exps = nullptr;     // [M]: each slot's exponent
  __half* parts = nullptr;   // [2, M, K]: each slot's parts, as launch_split_f16x2's
  float* y = nullptr;        // [M, N]: each slot's products with W', the row scales undone
  int64_t ldy = 0;           // y's row stride (0: N; rows padded to a multiple of 4 where the
                             // GEMM's N is not one: GemmChoice::ldy)
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

// A value `fp32`'s split leaves out of its parts ("tiny"): nonzero, below fp16's normal range
// once scaled (s = v 2^e), also where the scale took it to zero. The splits and the fix-up's
// list of a row's tiny values all ask this.
__device__ __forceinline__ bool tiny_once_scaled(float v, float s) {
  return v != 0.f && fabsf(s) < 0x1p-14f;
}

// Whether v is tiny in a row (or second-level slot) scaled by 2^e.
__device__ __forceinline__ bool tiny_at(float v, int e) { return tiny_once_scaled(v, ldexpf(v, e)); }

// Whether `fp32`'s split leaves v out of a row's (or slot's) parts, v scaled being s: tiny there,
// or infinite. An infinity's products are infinities (or NaN where W' is 0) whatever the finite
// rest of the row sums to, so adding them after the parts' GEMM gives what SGEMM gives.
__device__ __forceinline__ bool left_out_once_scaled(float v, float s) {
  return isinf(v) || tiny_once_scaled(v, s);
}

// The same at exponent e: the values whose products the fix-up adds.
__device__ __forceinline__ bool left_out_at(float v, int e) { return left_out_once_scaled(v, ldexpf(v, e)); }

// `fp32`'s parts of a scaled value s (|s| < 2^15): s = p0 + 2^-11 p1, p0 = fp16(s),
// p1 = fp16((s - p0) 2^11) (the difference is exact).
__device__ __forceinline__ void split_f16x2_value(float s, __half& p0, __half& p1) {
  p0 = __float2half_rn(s);
  p1 = __float2half_rn((s - __half2float(p0)) * 0x1p11f);
}

// v scaled by 2^e into `fp32`'s parts (zero where not taken, or left out: tiny once scaled, or
// infinite); whether a taken value was left out. Every fp32 split stores its values so.
__device__ __forceinline__ bool split_f16x2_scaled(float v, int e, bool take, __half& p0, __half& p1) {
  const float s = take ? ldexpf(v, e) : 0.f;
  const bool left = take && left_out_once_scaled(v, s);
  split_f16x2_value(left ? 0.f : s, p0, p1);
  return left;
}

// A row's exponent in `fp32`'s split from its largest finite magnitude `top`: 14 - floor(log2
// top), so that the row's largest finite value lies in [2^14, 2^15); 0 where it holds a NaN or
// no finite nonzero value.
__device__ __forceinline__ int split_exponent_of(float top, bool nan) {
  return nan || top == 0.f ? 0 : 14 - ilogbf(top);
}

// Row r's mark into marks.flags, and r into marks.list where it is marked (by one thread).
__device__ __forceinline__ void write_mark(int mark, int64_t r, RowMarks marks) {
  if (marks.flags) marks.flags[r] = mark;
  if (marks.list && mark != kRowKept) marks.list[1 + atomicAdd(marks.list, 1)] = static_cast<int>(r);
}

// Thread 0 of a split's CTA records row r's mark (block-uniform).
__device__ __forceinline__ void record_mark(int mark, int64_t r, RowMarks marks) {
  if (threadIdx.x == 0) write_mark(mark, r, marks);
}

// The end of a CTA's row r in `fast`'s split: kRowNaN if any thread saw a NaN, else
// recomputed if any saw an exceptional value (every thread of the CTA calls it; a barrier).
__device__ __forceinline__ void mark_row(bool nan, bool exceptional, int64_t r, RowMarks marks) {
  nan = __syncthreads_or(nan);
  exceptional = __syncthreads_or(exceptional);
  record_mark(nan ? kRowNaN : exceptional ? kRowRecompute : kRowKept, r, marks);
}

#endif  // __CUDACC__

// `fp32`'s mark of a row from what its split saw: a NaN, `tiny` values left out for being tiny
// and `infs` infinities, past `most_infinities` of which the row is recomputed.
__host__ __device__ constexpr int split_row_mark(bool nan, int64_t tiny, int64_t infs, int64_t most_infinities) {
  return nan ? kRowNaN : infs > most_infinities ? kRowRecompute : tiny + infs > 0 ? kRowTiny : kRowKept;
}

// The fp32 mode's split (sm90/gemm_f16x3.h), x per call and W' once per weight version: each
// row r of src [rows, K] fp32 (K a multiple of 8, src 16-byte aligned) scaled by 2^e[r],
// e[r] = 14 - floor(log2 max_k |src[r, k]|) over finite values (0 where none is nonzero), so
// that its largest finite value lies
// in [2^14, 2^15), below fp16's largest; then v 2^e = p0 + 2^-11 p1 with p0 = fp16(v 2^e) and
// p1 = fp16((v 2^e - p0) 2^11): 22 significant bits, |v 2^e - p0 - 2^-11 p1| <= 2^-22 |v 2^e|
// for every |v 2^e| >= 2^-14 (fp16's least normal value). parts: two fp16 planes [rows, K];
// exps[r] = e[r] as a float. A nonzero v with |v 2^e| < 2^-14 (more than 2^28-2^29 below the
// row's largest, or lost to fp32's range when scaled) is "tiny": its parts are zero. Such a
// value would lose its low bits, which matters where the other operand is large at its k
// (x = [1e30, 1] against w = [0, 1]: the 1 would vanish beside 1e30). Infinities are left out
// too. Marks (RowMarks): kRowNaN for rows holding a NaN (their parts zero, e = 0);
// kRowRecompute for rows holding more than correctable_infinities(K) infinities; kRowTiny for
// rows holding values left out (how many are tiny in marks.tiny).
void launch_split_f16x2(const float* src, int64_t rows, int64_t K, __half* parts, float* exps,
                        RowMarks marks, cudaStream_t stream);

// The same split by columns, for an operand read MN-major (dx = dV W reads W [N, K] as B with
// K, its output columns, contiguous): each column c of src [rows, cols] (cols a multiple of 8)
// scaled by 2^exps[c] from the column's largest finite value, parts [2, rows, cols] in src's
// layout. Marks per column: kRowNaN (its parts zero), kRowTiny where it holds a value left out
// (tiny or infinite; no count kept), listed in marks.list (zeroed by the caller) with every
// other mark; marks.flags is required. `scratch` holds split_f16x2_columns_scratch_bytes(cols).
size_t split_f16x2_columns_scratch_bytes(int64_t cols);
void launch_split_f16x2_columns(const float* src, int64_t rows, int64_t cols, __half* parts, float* exps,
                                RowMarks marks, void* scratch, cudaStream_t stream);

// The row split of srcᵀ without forming it, for an operand stored transposed (dW = dVᵀ x reads
// dV [M, N] as its A [N, M]): row c of srcᵀ is column c of src [rows, cols]. Writes what
// launch_split_f16x2(srcᵀ, cols, rows, parts, exps, marks) would, bit for bit: parts [2, cols,
// rows], and per column of src its exponent, mark, tiny count and list entry. rows a multiple of
// 8 and cols of 4, src 16-byte aligned; `scratch` holds split_f16x2_transposed_scratch_bytes(cols).
size_t split_f16x2_transposed_scratch_bytes(int64_t cols);
void launch_split_f16x2_transposed(const float* src, int64_t rows, int64_t cols, __half* parts, float* exps,
                                   RowMarks marks, void* scratch, cudaStream_t stream);

// The second level of x [M, K] after launch_split_f16x2 (its exps, flags and tiny counts):
// whether second_level_pays for this x, and if so each kRowTiny row's slot (SecondLevel), its
// exponent from its largest tiny value (the row's own where it holds only infinities).
// Writes second.rows always; the slots' data only when it pays.
void launch_split_second_level(const float* x, int64_t M, int64_t K, const float* x_exps,
                               const int* x_flags, const int* x_tiny, SecondLevel second,
                               cudaStream_t stream);

// Without a second level (its buffers not given: fp32_gemm_f16x3.h): x's kRowTiny rows holding
// more tiny values than the fix-up corrects (correctable_tiny_values) become kRowRecompute.
void launch_recompute_crowded_rows(int* x_flags, const int* x_tiny, int64_t M, int64_t K,
                                   cudaStream_t stream);

// Mends Y after a split GEMM, as the splits mark (fp32 FMA, so the values a split cannot
// carry reach Y as in SGEMM: inf, NaN, overflow, tiny values), W'[n, k] = w[n, k] * w_scale[n]
// (w_scale may be nullptr: W' = w). w_flags (W's rows' marks) and w_list are given in every
// mode; every output of Y is written by one path:
// - the columns n of W's listed rows (w_list), for every m: Y[m, n] = x[m, :] . W'[n, :] (+ bias[n]),
//   or NaN for a row marked kRowNaN;
// - rows m of x marked kRowNaN: NaN, for every n not in w_list (w_flags[n] == kRowKept);
// - rows m of x marked kRowRecompute: the dot product, for every n not in w_list, k in order
//   per output (more than four rows in a chunk of flags: by tiles);
// - rows m marked kRowTiny (`fp32` only; x_exps then given), for every n not in w_list:
//   - without second-level slots (*second.rows == 0, or second.rows null): Y[m, n] += the sum
//     over the row's values left out (left_out_at x_exps[m], as launch_split_f16x2 left them
//     out) of x[m, k] W'[n, k], in k order;
//   - in slot s: Y[m, n] += second.y[s, n], then the same sum over the values left out at the
//     second level (from second.exps[s]); or, with more than correctable_tiny_values(K) of
//     them, the row is recomputed as a kRowRecompute row.
// Nothing to do costs one launch whose CTAs read the M flags and the list's count.
// With w_transposed, w is stored [K, N] (W'[n, k] = w[k * N + n] * w_scale[n]); with
// x_transposed, x is stored [K, M] (x[m, k] = x[k * M + m]; then w_transposed too: dW's case).
void launch_fixup_exceptional(const float* x, const float* w, const float* w_scale,
                              const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                              const float* x_exps, const int* x_flags, const int* w_list,
                              const int* w_flags, SecondLevel second, cudaStream_t stream,
                              bool w_transposed = false, bool x_transposed = false);

// The `fast` split of src [rows, K] fp32 (times scale[r] per row when scale is not nullptr)
// into out [rows, 3 * Kh] bf16, three segments of the row's parts, each zero padded to Kh, in
// the order named: [lo | hi | hi] (x, per call) or [hi | lo | hi] (W', once per weight
// version). Rows with an exceptional value are marked (RowMarks).
enum class HiLoOrder { LoHiHi, HiLoHi };
constexpr int kFastSplitSegments = 3;
void launch_split_hilo(const float* src, const float* scale, int64_t rows, int64_t K, int64_t Kh,
                       HiLoOrder order, __nv_bfloat16* out, RowMarks marks, cudaStream_t stream);

}  // namespace gemmfuse::cuda

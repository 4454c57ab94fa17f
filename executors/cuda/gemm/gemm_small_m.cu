// The fp32 Gemm step for M <= 32 rows of x: Y[M,N] = x[M,K] W[N,K]^T (+ bias).
//
// Why a kernel of our own: with so few rows the GEMM is bound by reading W once (N·K·4 bytes;
// 268 MB at the seed's K = N = 8192), and cuBLASLt's choice there (a split-K SGEMM) sums each
// output in a longer fp32 chain than eager's cuBLAS kernel: its error against float64 is
// above eager's, more so with K % 4 != 0 or x off a 16-byte boundary, outside the fp32
// promise (docs/measurements.md, "The small-M GEMM").
//
// How: each warp owns 4 rows of W (4 columns of Y) and all M rows of x, and walks K in
// chunks of 4 elements per lane: one 16-byte vector per row (512 contiguous bytes per row per
// warp load). W is read from the 16-byte boundary at or before each row's start, whatever K
// and W's alignment, and x from a copy shifted to match (at most 4 copies, M·K each, in the
// scratch; a copy with x's own rows where only x is off a 16-byte boundary). Reading such rows
// with 4-byte loads instead runs slower than eager at M = 17-32, where cuBLASLt, faster, is
// less accurate. Two chunks of each W row are in flight, not kept in L1; x hits L1 (the
// CTA's 16 warps read the same x). A CTA takes 64 rows of W and holds a whole SM, so x crosses
// from L2 half as often as with 8-warp CTAs (docs/measurements.md, "The small-M GEMM").
// Summation: each output's sum in a lane is a chain of 4-product sums, one per chunk
// (K/128 adds at M <= 8; K/64 at M <= 16 and K/32 at M <= 32, where 2 or 4 groups of lanes
// take 8 rows of x each; at M = 9-16 the main loop sums two chunks at a time, 8 products):
// 64-256 at K = 8192, against 512 when each product is added to the sum (whose error is
// above eager's; with the chunks' sums it is below). The warp then adds its lanes' sums in a
// tree (reduce-scatter by shuffles: no shared memory). When N / 64 CTAs leave half the SMs idle,
// K is split across CTAs too; their partial sums are added in split order by a second kernel.
// Every order is fixed: results are reproducible.
#include "gemm_small_m.h"

#include <algorithm>
#include <stdexcept>

#include "cuda_check.h"
#include "device_info.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 4;  // rows of W (columns of Y) per warp
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int64_t kMinChunksPerSplit = 8;  // a split of K gives each lane at least this many

// W is read once: loads that bypass L1, which keeps x.
__device__ __forceinline__ float4 load_once(const float4* p) {
  float4 v;
  asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ float load_once(const float* p) {
  float v;
  asm("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// Where a CTA's operands start. Its rows of W lie `shift` elements past a 16-byte boundary
// (the same for all: see the kernel), so it reads them as 16-byte vectors from that boundary
// on, element e of a chunk being row element e - shift; x is read as rows of `pitch`
// elements (16-byte aligned) holding x shifted the same way, zeros before `shift` and from
// K + shift on: x itself where shift == 0 and x's rows are aligned, else a copy.
struct ShiftedX {
  const float* x;
  int shift;
};
struct SmallMOperands {
  ShiftedX by_class[4];  // by the shift class of the CTA's rows (see the kernel)
  int pitch;
  int row_step;  // 1: consecutive rows share a shift (K % 4 == 0); 4: rows 4 apart do
};

// a[i] for i < 4 by selects: a runtime index into a kernel parameter's array would copy the
// array to the stack.
template <class T>
__device__ __forceinline__ T pick4(const T (&a)[4], int i) {
  return i == 0 ? a[0] : i == 1 ? a[1] : i == 2 ? a[2] : a[3];
}

// Lane kl's 4 elements of chunk c (4·L elements, L lanes along K) of each of its W rows and
// its x rows: elements e .. e + 3, e = 4(cL + kl), in the shifted coordinates above (ws[r]:
// row r's first element less the shift, a 16-byte boundary).
// A full chunk lies wholly inside every row: 16-byte loads. A partial one (the first where
// shift > 0, the last ones where K + shift is not a multiple of 4L) reads W element by element
// and only inside the row, so no load leaves W and nothing past K enters a sum (x's padding is
// zero, W's masked elements too: Inf or NaN beyond the row never meet a zero).
template <int L, bool Full>
__device__ __forceinline__ void load_w(float4 (&a)[kRowsPerWarp],
                                       const float* (&ws)[kRowsPerWarp], int c, int kl, int K,
                                       int shift) {
  const int e = 4 * (c * L + kl);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if constexpr (Full) {
      a[r] = load_once(reinterpret_cast<const float4*>(ws[r] + e));
    } else {
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = e + j - shift;  // the row's element
        v[j] = k >= 0 && k < K ? load_once(ws[r] + e + j) : 0.f;
      }
      a[r] = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
}

// x . w over 4 elements: one product, then 3 fused adds (sums of 4 products: see above).
__device__ __forceinline__ float dot4(const float4& x, const float4& w) {
  float t = x.x * w.x;
  t = fmaf(x.y, w.y, t);
  t = fmaf(x.z, w.z, t);
  return fmaf(x.w, w.w, t);
}
// t + x . w over 4 elements, as 4 fused adds.
__device__ __forceinline__ float add_dot4(float t, const float4& x, const float4& w) {
  t = fmaf(x.x, w.x, t);
  t = fmaf(x.y, w.y, t);
  t = fmaf(x.z, w.z, t);
  return fmaf(x.w, w.w, t);
}

// acc[i][r] += (lane's 4 elements of chunk c of x row m0 + i) . w[r], for its MTL rows of x.
template <int MTL, int L, bool Full>
__device__ __forceinline__ void accumulate(float (&acc)[MTL][kRowsPerWarp],
                                           const float* __restrict__ x, int pitch, int m0,
                                           int M, int x_end, int c, int kl,
                                           const float4 (&w)[kRowsPerWarp]) {
  const int e = 4 * (c * L + kl);
#pragma unroll
  for (int i = 0; i < MTL; ++i) {
    // Rows past M read row M - 1 (valid memory); their sums are never stored.
    const int m = min(m0 + i, M - 1);
    const float4 xv = !Full && e >= x_end ? make_float4(0.f, 0.f, 0.f, 0.f)
                                          : __ldg(reinterpret_cast<const float4*>(x + m * pitch + e));
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[i][r] += dot4(xv, w[r]);  // 4 products, one add
  }
}

// acc[i][r] += (lane's 8 elements of chunks c and c + 1 of x row m0 + i) . (wa[r], wb[r]):
// two chunks in one sum of 8 products (9 instructions for 8 products, against 10 for two
// sums of 4: the loop is bound by instruction issue at M > 8). Taken with 2 lane groups
// (M = 9-16), where it is faster; with 4 groups the loop is slower, and with 1 its general
// form, so those keep sums of 4 (docs/measurements.md, "The small-M GEMM").
template <int MTL, int L>
__device__ __forceinline__ void accumulate_pair(float (&acc)[MTL][kRowsPerWarp],
                                                const float* __restrict__ x, int pitch, int m0,
                                                int M, int c, int kl,
                                                const float4 (&wa)[kRowsPerWarp],
                                                const float4 (&wb)[kRowsPerWarp]) {
  const int e = 4 * (c * L + kl);
#pragma unroll
  for (int i = 0; i < MTL; ++i) {
    const int m = min(m0 + i, M - 1);
    const float4 xa = __ldg(reinterpret_cast<const float4*>(x + m * pitch + e));
    const float4 xb = __ldg(reinterpret_cast<const float4*>(x + m * pitch + e + 4 * L));
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[i][r] += add_dot4(dot4(xa, wa[r]), xb, wb[r]);
  }
}

// Sums the first `Held` of v over the lanes that differ in bits O, O/2, .., 1 of the lane id.
// A level with two or more values halves them: the lane with bit O set keeps the upper half
// and receives its partner's upper half; with one value left the level is a plain butterfly.
// From V values, lane l ends with sums j = l·V/32 + i (V >= 32) or, with fewer values than
// lanes, sum l >> log2(32/V) (in every lane of its group).
template <int Held, int O, int V>
__device__ __forceinline__ void warp_reduce_scatter(float (&v)[V], int lane) {
  if constexpr (O > 0) {
    if constexpr (Held >= 2) {
      constexpr int h = Held / 2;
      const bool upper = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < h; ++i) {
        const float send = upper ? v[i] : v[i + h];
        const float keep = upper ? v[i + h] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      warp_reduce_scatter<h, O / 2>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
      warp_reduce_scatter<1, O / 2>(v, lane);
    }
  }
}

constexpr int log2_int(int v) { return v <= 1 ? 0 : 1 + log2_int(v / 2); }

// Warp `warp` of CTA bx: its first W row n0, the stride between its rows, and their shift
// class (the grid's row classes below).
struct WarpRows {
  int step, cls;
  int64_t n0;
};
template <bool Shifted>
__device__ __forceinline__ WarpRows warp_rows(const SmallMOperands& ops, int bx, int warp) {
  const int step = Shifted ? ops.row_step : 1;
  const int cls = step == 1 ? 0 : bx % 4;
  const int64_t n0 = (step == 1 ? static_cast<int64_t>(bx) * kRowsPerCta
                                : static_cast<int64_t>(bx / 4) * 4 * kRowsPerCta + cls) +
                     static_cast<int64_t>(step) * warp * kRowsPerWarp;
  return {step, cls, n0};
}

// The warp's W rows n0 + step r from their 16-byte boundaries (shift elements before each
// row; never read before the row). Rows past N read the warp's last row before N (the same
// shift); their sums are never stored.
__device__ __forceinline__ void row_starts(const float* (&ws)[kRowsPerWarp], const float* __restrict__ w,
                                           int64_t n0, int step, int64_t N, int K, int shift) {
  const int64_t n_last = n0 + (N - 1 - n0) / step * step;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    ws[r] = w + (min(n0 + static_cast<int64_t>(step) * r, n_last) * K - shift);
}

// Grid: (ctas_n, splits). CTA (bx, s) computes 64 columns of Y over the chunks
// [s·chunks_per_split, (s+1)·chunks_per_split) into out + s·M·N (bias only when unsplit).
// Its W rows all start at one shift from a 16-byte boundary, so the CTA reads x (in place or
// one copy) at one shift, a value uniform over the CTA (chosen per warp instead, it takes
// registers that slow the main loop at M = 16-32; docs/measurements.md, "The small-M GEMM").
// Shifted = false: every shift is 0.
//   row_step 1 (K % 4 == 0: every row at W's own shift): rows 64 bx .. 64 bx + 63;
//   row_step 4 (rows 4 apart share a shift): rows 256 (bx / 4) + bx % 4 + 4j, j < 64.
// Warp w takes rows j = 4w .. 4w + 3 of its CTA. A warp's lanes form G groups along M, each
// with MTL rows of x and 32/G lanes along K: the W loads of a group are the same addresses
// (one transaction), and a lane's M·4/G sums fit in registers (128 at 512 threads per SM).
template <int MTL, int G, bool Shifted>
__global__ void __launch_bounds__(kThreads, 1)
    small_m_gemm_kernel(const SmallMOperands ops, const float* __restrict__ w,
                        const float* __restrict__ bias, float* __restrict__ out, int M,
                        int64_t N, int K, int chunks, int chunks_per_split) {
  constexpr int L = 32 / G;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kl = lane % L, m0 = (lane / L) * MTL;
  const WarpRows rows = warp_rows<Shifted>(ops, static_cast<int>(blockIdx.x), warp);
  const int step = rows.step;
  const int64_t n0 = rows.n0;
  if (n0 >= N) return;  // no rows here (no CTA-wide barrier follows)
  const ShiftedX op = pick4(ops.by_class, rows.cls);
  const float* __restrict__ x = op.x;
  const int shift = Shifted ? op.shift : 0, pitch = Shifted ? ops.pitch : K, x_end = K + shift;
  const int c_begin = static_cast<int>(blockIdx.y) * chunks_per_split;
  const int c_end = min(chunks, c_begin + chunks_per_split);
  const int c_full = min(c_end, x_end / (4 * L));  // chunks [1 or 0, c_full) are full
  const float* ws[kRowsPerWarp];
  row_starts(ws, w, n0, step, N, K, shift);

  float acc[MTL][kRowsPerWarp] = {};
  const int head = c_begin == 0 && shift > 0 ? 1 : 0;  // chunk 0 holds the rows' first elements
  int c = c_begin + head;
  float4 a[kRowsPerWarp], b[kRowsPerWarp];
  for (; c + 1 < c_full; c += 2) {  // two chunks of each W row in flight
    load_w<L, true>(a, ws, c, kl, K, shift);
    load_w<L, true>(b, ws, c + 1, kl, K, shift);
    if constexpr (G == 2) {
      accumulate_pair<MTL, L>(acc, x, pitch, m0, M, c, kl, a, b);
    } else {  // 1 or 4 lane groups: the pair's registers cost the loop more than it saves
      accumulate<MTL, L, true>(acc, x, pitch, m0, M, x_end, c, kl, a);
      accumulate<MTL, L, true>(acc, x, pitch, m0, M, x_end, c + 1, kl, b);
    }
  }
  if (c < c_full) {
    load_w<L, true>(a, ws, c, kl, K, shift);
    accumulate<MTL, L, true>(acc, x, pitch, m0, M, x_end, c++, kl, a);
  }
  // The partial chunks: K's tail (two where this CTA's shift is below others'), then chunk 0
  // where it is partial (one piece of code for both; the order is fixed all the same).
  for (; c < c_end + head; ++c) {
    const int cp = c < c_end ? c : 0;
    load_w<L, false>(a, ws, cp, kl, K, shift);
    accumulate<MTL, L, false>(acc, x, pitch, m0, M, x_end, cp, kl, a);
  }

  constexpr int V = MTL * kRowsPerWarp;
  float v[V];
#pragma unroll
  for (int i = 0; i < MTL; ++i)
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) v[i * kRowsPerWarp + r] = acc[i][r];
  warp_reduce_scatter<V, L / 2>(v, lane);  // over the group's lanes

  constexpr int kPer = V >= L ? V / L : 1;                  // sums a lane stores
  constexpr int kLanesLog2 = V >= L ? 0 : log2_int(L / V);  // log2 of the lanes per sum
  if ((kl & ((1 << kLanesLog2) - 1)) != 0) return;
  float* o = out + static_cast<int64_t>(blockIdx.y) * M * N;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int j = (kl >> kLanesLog2) * kPer + i;
    const int m = m0 + j / kRowsPerWarp;
    const int64_t n = n0 + static_cast<int64_t>(step) * (j % kRowsPerWarp);
    if (m < M && n < N) o[m * N + n] = bias ? v[i] + __ldg(bias + n) : v[i];
  }
}

// y = sum over s of part[s] (in split order) + bias.
__global__ void sum_splits_kernel(const float* __restrict__ part, const float* __restrict__ bias,
                                  float* __restrict__ y, int64_t MN, int64_t N, int splits) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < MN;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = part[i];
    for (int p = 1; p < splits; ++p) s += part[p * MN + i];
    y[i] = bias ? s + __ldg(bias + i % N) : s;
  }
}

// dst[i][m][s] = x[m][s - shift[i]] for 0 <= s - shift[i] < K, else 0 (rows `pitch` apart).
// Grid: (pitch / 256 rounded up, count · M), a block per stretch of one copy's row.
struct ShiftedCopies {
  float* dst[4];
  int shift[4];
};
__global__ void shifted_copies_kernel(const float* __restrict__ x, const ShiftedCopies copies,
                                      int M, int K, int pitch) {
  const int copy = static_cast<int>(blockIdx.y) / M, m = static_cast<int>(blockIdx.y) % M;
  const int s = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= pitch) return;
  const int k = s - pick4(copies.shift, copy);
  pick4(copies.dst, copy)[static_cast<int64_t>(m) * pitch + s] =
      k >= 0 && k < K ? x[static_cast<int64_t>(m) * K + k] : 0.f;
}

template <int MTL, int G>
void launch_rows(dim3 grid, bool shifted, const SmallMOperands& ops, const float* w, const float* bias,
                 float* out, int M, int64_t N, int K, int chunks, int chunks_per_split,
                 cudaStream_t stream) {
  // Rows at no shift (the common case) compile to a kernel without the shift's code and
  // registers, faster at M = 17-32 than the general form (docs/measurements.md,
  // "The small-M GEMM").
  if (shifted)
    small_m_gemm_kernel<MTL, G, true>
        <<<grid, kThreads, 0, stream>>>(ops, w, bias, out, M, N, K, chunks, chunks_per_split);
  else
    small_m_gemm_kernel<MTL, G, false>
        <<<grid, kThreads, 0, stream>>>(ops, w, bias, out, M, N, K, chunks, chunks_per_split);
  GF_LAUNCH_CHECK();
}

// Lane groups along M (the kernel's G): up to 8 rows of x per group.
int lane_groups(int64_t M) { return M > 16 ? 4 : M > 8 ? 2 : 1; }

constexpr size_t kCopyAlign = 256;

// How the CTAs read x: shift[t] is how far past a 16-byte boundary the W rows n with
// n % 4 == t start. Where every shift is 0 (K % 4 == 0, W 16-byte aligned) x is read in
// place, or from one copy with the same rows where x is not 16-byte aligned; otherwise from
// one shifted copy per distinct shift. `copies` of them, each `copy_bytes` long, in the scratch.
struct XPlan {
  int shift[4];
  int copy_of[4];  // which copy rows n % 4 == t read
  bool shifted = false;  // some shift is not 0: the kernel's general form
  int copies = 0;
  int64_t pitch = 0;
  size_t copy_bytes = 0;
};
XPlan plan_x(int64_t M, int64_t K, const void* x, const void* w) {
  XPlan p;
  const int64_t w_at = static_cast<int64_t>(reinterpret_cast<uintptr_t>(w) % 16 / 4);
  for (int t = 0; t < 4; ++t) {
    p.shift[t] = static_cast<int>((w_at + t * K) % 4);
    p.shifted = p.shifted || p.shift[t] != 0;
  }
  for (int t = 0; t < 4; ++t) p.copy_of[t] = -1;
  if (!p.shifted && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    p.pitch = K;
    return p;
  }
  p.pitch = p.shifted ? (K + 3 + 3) / 4 * 4 : K;  // room for a shift of 3, whole 16-byte vectors
  p.copy_bytes = (static_cast<size_t>(M * p.pitch) * sizeof(float) + kCopyAlign - 1) / kCopyAlign * kCopyAlign;
  for (int t = 0; t < 4; ++t) {
    for (int u = 0; u < t && p.copy_of[t] < 0; ++u)
      if (p.shift[u] == p.shift[t]) p.copy_of[t] = p.copy_of[u];
    if (p.copy_of[t] < 0) p.copy_of[t] = p.copies++;
  }
  return p;
}

// The shapes and pointers the kernel takes, before the scratch: offsets into x (and its
// copies) are 32-bit, M · (K + 6) < 2^31; fp32 tensors start on 4-byte boundaries (any other
// start is not an fp32 array).
bool in_domain(int64_t M, int64_t N, int64_t K, const void* x, const void* w) {
  return M >= 1 && M <= kSmallMMaxRows && N >= 1 && K >= 1 && K <= kSmallMMaxK &&
         reinterpret_cast<uintptr_t>(x) % 4 == 0 && reinterpret_cast<uintptr_t>(w) % 4 == 0;
}
bool copies_fit(const XPlan& p, size_t scratch_bytes) { return p.copies * p.copy_bytes <= scratch_bytes; }

}  // namespace

bool small_m_gemm_fits(int64_t M, int64_t N, int64_t K, const void* x, const void* w,
                       size_t scratch_bytes) {
  return in_domain(M, N, K, x, w) && copies_fit(plan_x(M, K, x, w), scratch_bytes);
}

void launch_small_m_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M,
                         int64_t N, int64_t K, void* scratch, size_t scratch_bytes,
                         cudaStream_t stream) {
  if (!in_domain(M, N, K, x, w))
    throw std::logic_error("CUDA small-M gemm: problem outside the kernel's domain");
  const XPlan xp = plan_x(M, K, x, w);
  if (!copies_fit(xp, scratch_bytes))
    throw std::logic_error("CUDA small-M gemm: no room in the scratch for x's copies");
  const int m = static_cast<int>(M), k = static_cast<int>(K);
  // x shifted to each W shift, in the scratch's first bytes (copy_of[t] < 0: x in place).
  auto x_of = [&](int t) -> float* {
    return reinterpret_cast<float*>(static_cast<char*>(scratch) + xp.copy_of[t] * xp.copy_bytes);
  };
  SmallMOperands ops;
  ops.pitch = static_cast<int>(xp.pitch);
  ops.row_step = K % 4 == 0 ? 1 : 4;
  for (int t = 0; t < 4; ++t) ops.by_class[t] = {xp.copies > 0 ? x_of(t) : x, xp.shift[t]};
  if (xp.copies > 0) {
    ShiftedCopies copies{};
    for (int t = 0; t < 4; ++t) {
      copies.dst[xp.copy_of[t]] = x_of(t);
      copies.shift[xp.copy_of[t]] = xp.shift[t];
    }
    const dim3 grid(static_cast<unsigned>((xp.pitch + 255) / 256), static_cast<unsigned>(xp.copies * M));
    shifted_copies_kernel<<<grid, 256, 0, stream>>>(x, copies, m, k, ops.pitch);
    GF_LAUNCH_CHECK();
  }
  const size_t used = xp.copies * xp.copy_bytes;
  scratch = static_cast<char*>(scratch) + used;
  scratch_bytes -= used;

  const int groups = lane_groups(M), lanes_k = 32 / groups;
  const int max_shift = *std::max_element(xp.shift, xp.shift + 4);
  const int64_t chunks = (K + max_shift + 4 * lanes_k - 1) / (4 * lanes_k);
  const int64_t ctas_n = ops.row_step == 1 ? (N + kRowsPerCta - 1) / kRowsPerCta
                                           : 4 * ((N + 4 * kRowsPerCta - 1) / (4 * kRowsPerCta));
  if (ctas_n > 0x7fffffffLL) throw std::logic_error("CUDA small-M gemm: N too large");
  // Split K while the CTAs still fit one wave (one per SM: a second, partial wave costs more
  // than a few idle SMs; docs/measurements.md, "The small-M GEMM"), each lane keeping enough
  // loads in flight, and as far as the scratch holds the partial sums.
  int64_t splits = 1;
  if (const int sms = sm_count(); ctas_n < sms) {
    splits = std::min<int64_t>(sms / ctas_n,
                               std::max<int64_t>(1, chunks / kMinChunksPerSplit));
    splits = std::min<int64_t>(splits, static_cast<int64_t>(scratch_bytes / (4 * M * N)));
    splits = std::clamp<int64_t>(splits, 1, 65535);
  }
  const int64_t chunks_per_split = (chunks + splits - 1) / splits;
  splits = (chunks + chunks_per_split - 1) / chunks_per_split;  // no empty split
  float* out = splits > 1 ? static_cast<float*>(scratch) : y;
  const float* b = splits > 1 ? nullptr : bias;
  const dim3 grid(static_cast<unsigned>(ctas_n), static_cast<unsigned>(splits));
  const int ch = static_cast<int>(chunks), cps = static_cast<int>(chunks_per_split);
  const bool shifted = xp.shifted;
  if (groups == 4) launch_rows<8, 4>(grid, shifted, ops, w, b, out, m, N, k, ch, cps, stream);
  else if (groups == 2) launch_rows<8, 2>(grid, shifted, ops, w, b, out, m, N, k, ch, cps, stream);
  else if (M > 4) launch_rows<8, 1>(grid, shifted, ops, w, b, out, m, N, k, ch, cps, stream);
  else if (M > 2) launch_rows<4, 1>(grid, shifted, ops, w, b, out, m, N, k, ch, cps, stream);
  else if (M == 2) launch_rows<2, 1>(grid, shifted, ops, w, b, out, m, N, k, ch, cps, stream);
  else launch_rows<1, 1>(grid, shifted, ops, w, b, out, m, N, k, ch, cps, stream);
  if (splits > 1) {
    const int64_t MN = M * N;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((MN + 255) / 256, 4096));
    sum_splits_kernel<<<blocks, 256, 0, stream>>>(out, bias, y, MN, N, static_cast<int>(splits));
    GF_LAUNCH_CHECK();
  }
}

}  // namespace gemmfuse::cuda

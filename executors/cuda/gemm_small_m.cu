// The fp32 Gemm step for M <= 32 rows of x: Y[M,N] = x[M,K] W[N,K]^T (+ bias).
//
// Why a kernel of our own: with so few rows the GEMM is bound by reading W once (N·K·4 bytes;
// 268 MB, 90 µs at the seed's K = N = 8192), and cuBLASLt's choice there (a split-K SGEMM,
// 0.166 ms at M = 16) sums each output in a longer fp32 chain than eager's cuBLAS kernel:
// 1.5x eager's error against float64, and 1.7-2.6x with K % 4 != 0 or x off a 16-byte
// boundary (bench/NOTES.md): outside the fp32 promise.
//
// How: each warp owns 4 rows of W (4 columns of Y) and all M rows of x, and walks K in
// chunks of 4 elements per lane: one 16-byte vector per row (512 contiguous bytes per row per
// warp load) where K % 4 == 0 and x, W are 16-byte aligned, else 4 elements a warp-width
// apart (4-byte loads, 128 contiguous bytes each). Two chunks of each W row are in flight,
// not kept in L1; x hits L1 (the CTA's 16 warps read the same x). A CTA takes 64 rows of W
// and holds a whole SM, so x crosses from L2 half as often as with 8-warp CTAs (3 µs less at
// M = 16).
// Summation: each output's sum in a lane is a chain of 4-product sums, one per chunk
// (K/128 adds at M <= 8; K/64 at M <= 16 and K/32 at M <= 32, where 2 or 4 groups of lanes
// take 8 rows of x each): 64-256 at K = 8192, against 512 when each product is added to the sum (that error was
// 1.4x eager's at M = 16; now 0.7-0.8x). The warp then adds its lanes' sums in a tree
// (reduce-scatter by shuffles: no shared memory). When N / 64 CTAs leave half the SMs idle,
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

// The 4 elements of K that lane `kl` takes from chunk c of a row, a chunk being 4·L elements
// (L lanes along K):
//   Vec = 4: one 16-byte vector, elements 4(cL + kl) .. 4(cL + kl) + 3 (rows 16-byte aligned);
//   Vec = 1: elements 4cL + kl + {0, L, 2L, 3L}, one 4-byte load each (any row alignment).
// Elements past K read as 0 when Masked (the last chunk only).
template <int Vec, int L, bool Once, bool Masked>
__device__ __forceinline__ float4 load_chunk(const float* __restrict__ row, int c, int kl, int K) {
  const int e = c * 4 * L + (Vec == 4 ? 4 * kl : kl);
  if constexpr (Vec == 4) {
    if (Masked && e >= K) return make_float4(0.f, 0.f, 0.f, 0.f);  // K % 4 == 0 here
    const float4* p = reinterpret_cast<const float4*>(row + e);
    return Once ? load_once(p) : __ldg(p);
  } else {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float* p = row + e + j * L;
      v[j] = (Masked && e + j * L >= K) ? 0.f : Once ? load_once(p) : __ldg(p);
    }
    return make_float4(v[0], v[1], v[2], v[3]);
  }
}

// acc[i][r] += (lane's 4 elements of chunk c of x row m0 + i) . w[r], for its MTL rows of x.
template <int MTL, int Vec, int L, bool Masked>
__device__ __forceinline__ void accumulate(float (&acc)[MTL][kRowsPerWarp],
                                           const float* __restrict__ x, int m0, int M, int K,
                                           int c, int kl, const float4 (&w)[kRowsPerWarp]) {
#pragma unroll
  for (int i = 0; i < MTL; ++i) {
    // Rows past M read row M - 1 (valid memory); their sums are never stored.
    const int m = min(m0 + i, M - 1);
    const float4 xv = load_chunk<Vec, L, false, Masked>(x + m * K, c, kl, K);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {  // the chunk's 4 products, then one add
      float t = xv.x * w[r].x;
      t = fmaf(xv.y, w[r].y, t);
      t = fmaf(xv.z, w[r].z, t);
      t = fmaf(xv.w, w[r].w, t);
      acc[i][r] += t;
    }
  }
}

// The lane's 4 elements of chunk c of each of its W rows.
template <int Vec, int L, bool Masked>
__device__ __forceinline__ void load_w(float4 (&a)[kRowsPerWarp],
                                       const float* (&wr)[kRowsPerWarp], int c, int kl, int K) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) a[r] = load_chunk<Vec, L, true, Masked>(wr[r], c, kl, K);
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

// Grid: (ceil(N / 64), splits). CTA (bx, s) computes Y[:, 64 bx .. 64 bx + 64) over the
// chunks [s·chunks_per_split, (s+1)·chunks_per_split) into out + s·M·N (bias only when
// unsplit). A warp's lanes form G groups along M, each with MTL rows of x and 32/G lanes
// along K: the W loads of a group are the same addresses (one transaction), and a lane's
// M·4/G sums fit in registers (128 at 512 threads per SM).
template <int MTL, int G, int Vec>
__global__ void __launch_bounds__(kThreads, 1)
    small_m_gemm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                        const float* __restrict__ bias, float* __restrict__ out, int M,
                        int64_t N, int K, int chunks_per_split) {
  constexpr int L = 32 / G;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kl = lane % L, m0 = (lane / L) * MTL;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + warp * kRowsPerWarp;
  const int c_begin = static_cast<int>(blockIdx.y) * chunks_per_split;
  const int c_end = min((K + 4 * L - 1) / (4 * L), c_begin + chunks_per_split);
  const int c_full = min(c_end, K / (4 * L));  // chunks wholly inside K
  const float* wr[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)  // rows past N read row N - 1; never stored
    wr[r] = w + min(n0 + r, N - 1) * static_cast<int64_t>(K);

  float acc[MTL][kRowsPerWarp] = {};
  int c = c_begin;
  float4 a[kRowsPerWarp], b[kRowsPerWarp];
  for (; c + 1 < c_full; c += 2) {  // two chunks of each W row in flight
    load_w<Vec, L, false>(a, wr, c, kl, K);
    load_w<Vec, L, false>(b, wr, c + 1, kl, K);
    accumulate<MTL, Vec, L, false>(acc, x, m0, M, K, c, kl, a);
    accumulate<MTL, Vec, L, false>(acc, x, m0, M, K, c + 1, kl, b);
  }
  if (c < c_full) {
    load_w<Vec, L, false>(a, wr, c, kl, K);
    accumulate<MTL, Vec, L, false>(acc, x, m0, M, K, c++, kl, a);
  }
  if (c < c_end) {  // K's tail
    load_w<Vec, L, true>(a, wr, c, kl, K);
    accumulate<MTL, Vec, L, true>(acc, x, m0, M, K, c, kl, a);
  }

  constexpr int V = MTL * kRowsPerWarp;
  float v[V];
#pragma unroll
  for (int i = 0; i < MTL; ++i)
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) v[i * kRowsPerWarp + r] = acc[i][r];
  warp_reduce_scatter<V, L / 2>(v, lane);  // over the group's lanes

  constexpr int kPer = V >= L ? V / L : 1;                  // sums a lane stores
  constexpr int kShift = V >= L ? 0 : log2_int(L / V);      // lanes per sum, as a shift
  if ((kl & ((1 << kShift) - 1)) != 0) return;
  float* o = out + static_cast<int64_t>(blockIdx.y) * M * N;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int j = (kl >> kShift) * kPer + i;
    const int m = m0 + j / kRowsPerWarp;
    const int64_t n = n0 + j % kRowsPerWarp;
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

template <int MTL, int G>
void launch_rows(dim3 grid, bool vec4, const float* x, const float* w, const float* bias,
                 float* out, int M, int64_t N, int K, int chunks_per_split,
                 cudaStream_t stream) {
  if (vec4)
    small_m_gemm_kernel<MTL, G, 4>
        <<<grid, kThreads, 0, stream>>>(x, w, bias, out, M, N, K, chunks_per_split);
  else
    small_m_gemm_kernel<MTL, G, 1>
        <<<grid, kThreads, 0, stream>>>(x, w, bias, out, M, N, K, chunks_per_split);
  GF_LAUNCH_CHECK();
}

// 16-byte loads when every row of x and W starts on a 16-byte boundary.
bool rows_16b_aligned(int64_t K, const void* x, const void* w) {
  return K % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

// Lane groups along M (the kernel's G): up to 8 rows of x per group.
int lane_groups(int64_t M) { return M > 16 ? 4 : M > 8 ? 2 : 1; }

}  // namespace

bool small_m_gemm_fits(int64_t M, int64_t N, int64_t K, const void* x, const void* w) {
  // x offsets are 32-bit: M·K < 2^31. With 4 lane groups (M > 16) 4-byte loads bring 32
  // bytes per row per warp load: 0.82-0.99x eager at M = 17-32, so those need 16-byte loads.
  return M >= 1 && M <= kSmallMMaxRows && N >= 1 && K >= 1 && K < (int64_t(1) << 26) &&
         (M <= 16 || rows_16b_aligned(K, x, w));
}

void launch_small_m_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M,
                         int64_t N, int64_t K, void* scratch, size_t scratch_bytes,
                         cudaStream_t stream) {
  if (!small_m_gemm_fits(M, N, K, x, w))
    throw std::logic_error("CUDA small-M gemm: problem outside the kernel's domain");
  const bool vec4 = rows_16b_aligned(K, x, w);
  const int groups = lane_groups(M), lanes_k = 32 / groups;
  const int64_t chunks = (K + 4 * lanes_k - 1) / (4 * lanes_k);
  const int64_t ctas_n = (N + kRowsPerCta - 1) / kRowsPerCta;
  if (ctas_n > 0x7fffffffLL) throw std::logic_error("CUDA small-M gemm: N too large");
  // Split K while the CTAs still fit one wave (one per SM: a second, partial wave costs more
  // than a few idle SMs, 3 µs at N = 8192), each lane keeping enough loads in flight, and as
  // far as the scratch holds the partial sums.
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
  const int m = static_cast<int>(M), k = static_cast<int>(K);
  const int cps = static_cast<int>(chunks_per_split);
  if (groups == 4) launch_rows<8, 4>(grid, vec4, x, w, b, out, m, N, k, cps, stream);
  else if (groups == 2) launch_rows<8, 2>(grid, vec4, x, w, b, out, m, N, k, cps, stream);
  else if (M > 4) launch_rows<8, 1>(grid, vec4, x, w, b, out, m, N, k, cps, stream);
  else if (M > 2) launch_rows<4, 1>(grid, vec4, x, w, b, out, m, N, k, cps, stream);
  else if (M == 2) launch_rows<2, 1>(grid, vec4, x, w, b, out, m, N, k, cps, stream);
  else launch_rows<1, 1>(grid, vec4, x, w, b, out, m, N, k, cps, stream);
  if (splits > 1) {
    const int64_t MN = M * N;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((MN + 255) / 256, 4096));
    sum_splits_kernel<<<blocks, 256, 0, stream>>>(out, bias, y, MN, N, static_cast<int>(splits));
    GF_LAUNCH_CHECK();
  }
}

}  // namespace gemmfuse::cuda

// The backward of fp32 attention on split fp16 products (attention_f16x3.h), FlashAttention-2's
// order: a CTA per 64 keys (a warp per 16 of them) loops over the query tiles, recomputes
// Sᵀ = K Qᵀ and Pᵀ = exp(Sᵀ − LSE), and accumulates
//   dV += Pᵀ dO,   dPᵀ = V dOᵀ,   dSᵀ = Pᵀ ∘ (dPᵀ − δ),   dK += dSᵀ Q,   dQ += dS K (atomics)
// with δ_q = Σ_d dO·O. Q, K, V and dO each contract along both of their dims here, so each is
// split with one exponent per head; dS with one per head taken from |dS| ≤ 2 D max|dO| max|V|
// (bench/micro/attention_split_study.py: unscaled, training-sized gradients underflow fp16).
// Head dims 64, 96 and 128: a CTA's dK, dV (and its share of dQ) hold Cols<D>::kWidth of the D
// columns, so D = 96 and 128 run two CTAs per key tile, each recomputing P and dP over all of
// D, with the registers of D = 64's sums.
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "attention_f16x3.h"
#include "attention_nonfinite.h"
#include "attention_tiles.cuh"
#include "cuda_check.h"
#include "device_info.h"
#include "buffer_layout.h"

namespace gemmfuse::cuda {
namespace {

using namespace attention;
constexpr int kL = kTile + kPad;  // dS's shared rows (a query's keys)
constexpr float kLog2e = 1.4426950408889634f;

// The columns of dK, dV and dQ one CTA accumulates for head dim D (a multiple of 16 wide, as the
// products' k-steps of dQ and their output tiles take), and how many CTAs share a key tile.
template <int D>
struct Cols {
  static constexpr int kWidth = D == 96 ? 48 : 64;
  static constexpr int kCtas = D / kWidth;
  static_assert(D % kWidth == 0 && kWidth % 16 == 0, "whole column groups");
};

// The four operands' per-head largest magnitudes (amax [4][BH]: Q's, K's, V's, dO's; zeroed
// before) in one launch over many CTAs: grid (BH, chunks, 4), a CTA per kAmaxChunk values of one
// head of one operand, folded in by fold_max_magnitude. A NaN counts as an infinity (its head is then recomputed by attention_nonfinite.cu).
constexpr int kAmaxThreads = 256;
constexpr int64_t kAmaxChunk = 16384;  // values a CTA: 16 float4 loads a thread

struct HeadOperands {
  const float* x[4];  // [BH, S, D] each
  int64_t n[4];       // a head's values, S·D (whole float4s)
};

__global__ void __launch_bounds__(kAmaxThreads) heads_amax_kernel(HeadOperands ops, int64_t BH,
                                                                  int* amax_bits) {
  __shared__ float red[kAmaxThreads / 32];
  const int z = blockIdx.z;
  const int64_t n = ops.n[z], c0 = static_cast<int64_t>(blockIdx.y) * kAmaxChunk;
  if (c0 >= n) return;  // (the whole CTA: a shorter operand's chunks end sooner)
  const int64_t end = n < c0 + kAmaxChunk ? n : c0 + kAmaxChunk;
  const float4* h = reinterpret_cast<const float4*>(ops.x[z] + static_cast<int64_t>(blockIdx.x) * n);
  float m = 0.f;
  for (int64_t i = c0 / 4 + threadIdx.x; i < end / 4; i += kAmaxThreads) {
    const float4 v = h[i];
    m = fmaxf(fmaxf(m, fmaxf(abs_or_inf(v.x), abs_or_inf(v.y))),
              fmaxf(abs_or_inf(v.z), abs_or_inf(v.w)));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kAmaxThreads / 32; ++w) m = fmaxf(m, red[w]);
    fold_max_magnitude(amax_bits + z * BH + blockIdx.x, fmaxf(m, red[0]));
  }
}

// x [BH, n] into parts with its head's exponent, four values a thread (n = S·D: whole float4s;
// 16-byte loads, 8-byte stores).
__global__ void split_head_kernel(const float* x, int64_t n, int64_t total, const float* amax,
                                  __half* hi, __half* lo) {
  const int64_t i = 4 * (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  if (i >= total) return;
  const int e = split_exponent(amax[i / n]);
  const float4 v = *reinterpret_cast<const float4*>(x + i);
  __align__(8) __half h[4], l[4];
  split_one(v.x, e, &h[0], &l[0]);
  split_one(v.y, e, &h[1], &l[1]);
  split_one(v.z, e, &h[2], &l[2]);
  split_one(v.w, e, &h[3], &l[3]);
  *reinterpret_cast<uint2*>(hi + i) = *reinterpret_cast<const uint2*>(h);
  *reinterpret_cast<uint2*>(lo + i) = *reinterpret_cast<const uint2*>(l);
}

// δ_r = Σ_d dO_rd O_rd, a warp per row (fp64 sum).
__global__ void delta_kernel(const float* dout, const float* o, int64_t R, int D, float* delta) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= R) return;
  double s = 0;
  for (int d = lane; d < D; d += 32) s += static_cast<double>(dout[r * D + d]) * o[r * D + d];
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) delta[r] = static_cast<float>(s);
}

struct Parts {
  const __half *qh, *ql, *kh, *kl, *vh, *vl, *dh, *dl;  // dh, dl: dO's
  const float *amax;   // [4][BH]: Q's, K's, V's, dO's largest magnitude per head
  const float *delta;  // [BH S]
};

// The per-head factors that undo the splits' exponents: exact powers of two (the head's
// exponents fit kMaxSplitExp, else attention_nonfinite.cu computes it and this kernel returns).
struct Unscale {
  float qk;   // Sᵀ's 2^-(e_q + e_k)
  float vo;   // dPᵀ's 2^-(e_v + e_o)
  float ds;   // dS's 2^e_ds (its split's scale)
  float dsk;  // dQ's 2^-(e_ds + e_k)
  float dsq;  // dK's 2^-(e_ds + e_q)
  float o;    // dV's 2^-e_o
};

__device__ Unscale head_unscale(const float* amax, int64_t BH, int64_t bh, int D) {
  const int q = split_exponent(amax[bh]), k = split_exponent(amax[BH + bh]);
  const int v = split_exponent(amax[2 * BH + bh]), o = split_exponent(amax[3 * BH + bh]);
  const int ds = split_exponent(attention_ds_bound(amax, BH, bh, D));
  return {pow2(-(q + k)), pow2(-(v + o)), pow2(ds), pow2(-(ds + k)), pow2(-(ds + q)), pow2(-o)};
}

// Row tiles only: where a product reads one as B[k][n] with k along its rows (dV's dO, dK's Q,
// dQ's K), ldmatrix .trans gathers the fragments (BTile::kRowsAlongN). D = 64: ~92 KB, two
// CTAs a multiprocessor; 96: ~125 KB and 128: ~158 KB, one.
template <int D>
struct Shared {
  static constexpr int kLd = D + kPad;  // the K, V, Q and dO tiles' rows
  __half kh[kTile][kLd], kl[kTile][kLd], vh[kTile][kLd], vl[kTile][kLd];
  __half qh[kTile][kLd], ql[kTile][kLd];
  __half doh[kTile][kLd], dol[kTile][kLd];
  __half dsh[kTile][kL], dsl[kTile][kL];  // dS [query][key], scaled, for dQ's A
  float lse[kTile], delta[kTile];
  Unscale u;  // in shared memory: the kernel holds ~255 registers without these six
};

// The query tile's operands into shared memory (qhead = bh Sq: the head's first query row).
template <int D>
__device__ void load_query_tile(Shared<D>& sm, const Parts& pt, const AttentionF16x3Backward& a,
                                int64_t qhead, int64_t bh, int64_t q0) {
  const int64_t off = qhead * D;
  load_rows<D>(pt.qh + off, q0, a.Sq, sm.qh);
  load_rows<D>(pt.ql + off, q0, a.Sq, sm.ql);
  load_rows<D>(pt.dh + off, q0, a.Sq, sm.doh);
  load_rows<D>(pt.dl + off, q0, a.Sq, sm.dol);
  for (int i = threadIdx.x; i < kTile; i += kThreads) {
    const bool in = q0 + i < a.Sq;
    sm.lse[i] = in ? a.lse[bh * a.lse_stride + q0 + i] * kLog2e : 0.f;
    sm.delta[i] = in ? pt.delta[qhead + q0 + i] : 0.f;
  }
  wait_async_copies();  // this tile's (and, the first time, K's and V's)
}

// Pᵀ in place of Sᵀ (the warp's keys x the tile's queries): unscaled (one rounding: u.qk is a
// power of two), plus the additive mask, exponentiated against each query's LSE, masked (keys
// or queries past S; causal) where the warp's part of the tile holds such entries. The masks
// compare offsets within the tile: key0 + kl is masked from kl = klim on, q0 + ql from
// ql = qlim on, and under the causal mask where kl > ql + diag (diag = q0 - key0, clamped).
template <int D>
__device__ void probabilities(float (&s)[8][4], const Shared<D>& sm, const AttentionF16x3Backward& a,
                              const Unscale& u, int64_t bh, int64_t key0, int64_t q0, int g, int t) {
  const float mul = u.qk * (a.scale * kLog2e);
  const int klim = static_cast<int>(std::min<int64_t>(a.Sk - key0, 16));
  const int qlim = static_cast<int>(std::min<int64_t>(a.Sq - q0, kTile));
  const int diag = a.causal ? static_cast<int>(std::clamp<int64_t>(q0 - key0, -kTile, kTile))
                            : kTile;
  auto masked = [&](int kl, int ql) { return kl >= klim || ql >= qlim || kl > ql + diag; };
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] *= mul;
  if (a.mask.data != nullptr) {
    const float* m0 = a.mask.row(bh, q0) + key0 * a.mask.sj;  // the tile's first query, the warp's first key
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int kl = g + 8 * (i >> 1), ql = 8 * n + 2 * t + (i & 1);
        if (!masked(kl, ql)) s[n][i] += m0[ql * a.mask.si + kl * a.mask.sj] * kLog2e;
      }
  }
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] = exp2_flushed(s[n][i] - sm.lse[8 * n + 2 * t + (i & 1)]);
  if (klim < 16 || qlim < kTile || diag < 15) {  // (kl <= 15 and ql >= 0: no causal mask below)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (masked(g + 8 * (i >> 1), 8 * n + 2 * t + (i & 1))) s[n][i] = 0.f;
  }
}

// dSᵀ = Pᵀ ∘ (dPᵀ − δ), times 2^e_ds (its split's scale), into dp.
template <int D>
__device__ void score_grads(float (&dp)[8][4], const float (&p)[8][4], const Shared<D>& sm,
                            const Unscale& u, int t) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float dpv = dp[n][i] * u.vo;
      dp[n][i] = p[n][i] * (dpv - sm.delta[8 * n + 2 * t + (i & 1)]) * u.ds;
    }
}

// The warp's dSᵀ (scaled) into shared dS [query][key] parts, for dQ: the halves of its parts
// as dK's A fragments hold them (to_a_parts: value [n][i] is half i & 1 of register
// 2 (n % 2) + (i >> 1) of k-step n / 2), so dS is split once.
template <int D>
__device__ void store_ds(Shared<D>& sm, const uint32_t (&hi)[4][4], const uint32_t (&lo)[4][4], int w,
                         int g, int t) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = 16 * w + g + 8 * (i >> 1), ql = 8 * n + 2 * t + (i & 1);
      const int r = 2 * (n % 2) + (i >> 1), shift = 16 * (i & 1);
      sm.dsh[ql][key] = __ushort_as_half(static_cast<unsigned short>(hi[n / 2][r] >> shift));
      sm.dsl[ql][key] = __ushort_as_half(static_cast<unsigned short>(lo[n / 2][r] >> shift));
    }
}

// dQ's share of this key tile for the warp's 16 queries, columns [d0, d0 + kWidth), added to
// dq with atomics.
template <int D>
__device__ void add_dq(const Shared<D>& sm, const AttentionF16x3Backward& a, const Unscale& u,
                       int64_t qhead, int64_t q0, int d0, int w, int g, int t) {
  constexpr int kNt = Cols<D>::kWidth / 8;
  float c[kNt][4];
  product3_rows<kTile, kNt, BTile::kRowsAlongN>(c, &sm.dsh[16 * w][0], &sm.dsl[16 * w][0], kL,
                                                &sm.kh[0][d0], &sm.kl[0][d0], Shared<D>::kLd, g, t);
#pragma unroll
  for (int n = 0; n < kNt; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t q = q0 + 16 * w + g + 8 * (i >> 1);
      if (q < a.Sq)
        atomicAdd(a.dq + (qhead + q) * D + d0 + 8 * n + 2 * t + (i & 1),
                  c[n][i] * u.dsk * a.scale);
    }
}

// The warp's rows of dK and dV (its 16 keys), columns [d0, d0 + kWidth), unscaled.
template <int D, int kNt = Cols<D>::kWidth / 8>
__device__ void store_key_grads(const AttentionF16x3Backward& a, const float (&dk)[kNt][4],
                                const float (&dv)[kNt][4], const Unscale& u, int64_t khead,
                                int64_t key0, int d0, int g, int t) {
#pragma unroll
  for (int n = 0; n < kNt; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t key = key0 + g + 8 * (i >> 1);
      if (key >= a.Sk) continue;
      const int64_t at = (khead + key) * D + d0 + 8 * n + 2 * t + (i & 1);
      a.dk[at] = dk[n][i] * u.dsq * a.scale;
      a.dv[at] = dv[n][i] * u.o;
    }
}

// A CTA per (head, 64 keys, column group): the key tile's dK and dV columns
// [d0, d0 + kWidth) over every query tile that sees it, and those columns of dQ.
template <int D>
__global__ void __launch_bounds__(kThreads) attention_backward_kernel(AttentionF16x3Backward a,
                                                                      Parts pt) {
  constexpr int kLd = Shared<D>::kLd, kNt = Cols<D>::kWidth / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Shared<D>& sm = *reinterpret_cast<Shared<D>*>(smem_raw);
  const int64_t bh = blockIdx.x, k0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int d0 = Cols<D>::kCtas == 1 ? 0 : static_cast<int>(blockIdx.z) * Cols<D>::kWidth;
  const int64_t qhead = bh * a.Sq, khead = bh * a.Sk;  // the head's first query and key rows
  const int w = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (attention_head_unsplit(pt.amax, a.BH, bh, D)) return;  // attention_nonfinite.cu's
  if (threadIdx.x == 0) sm.u = head_unscale(pt.amax, a.BH, bh, D);
  __syncthreads();  // (the loop below may not run: a causal tile of keys no query sees)
  const Unscale& u = sm.u;
  load_rows<D>(pt.kh + khead * D, k0, a.Sk, sm.kh);
  load_rows<D>(pt.kl + khead * D, k0, a.Sk, sm.kl);
  load_rows<D>(pt.vh + khead * D, k0, a.Sk, sm.vh);
  load_rows<D>(pt.vl + khead * D, k0, a.Sk, sm.vl);
  const int64_t key0 = k0 + 16 * w;  // the warp's first key
  float dk[kNt][4] = {}, dv[kNt][4] = {};
  // (causal: queries before k0 see none of the tile's keys)
  for (int64_t q0 = a.causal ? k0 : 0; q0 < a.Sq; q0 += kTile) {
    __syncthreads();  // the previous tile's readers are done (dS included)
    load_query_tile(sm, pt, a, qhead, bh, q0);
    __syncthreads();
    float p[8][4], dp[8][4];
    product3_rows<D, 8>(p, &sm.kh[16 * w][0], &sm.kl[16 * w][0], kLd, &sm.qh[0][0], &sm.ql[0][0],
                        kLd, g, t);
    probabilities(p, sm, a, u, bh, key0, q0, g, t);
    uint32_t xh[4][4], xl[4][4];
    to_a_parts<4>(p, 1.f, xh, xl);
    accumulate3_regs<4, kNt, BTile::kRowsAlongN, 2>(dv, xh, xl, &sm.doh[0][d0], &sm.dol[0][d0],
                                                    kLd, g, t);
    product3_rows<D, 8>(dp, &sm.vh[16 * w][0], &sm.vl[16 * w][0], kLd, &sm.doh[0][0],
                        &sm.dol[0][0], kLd, g, t);
    score_grads(dp, p, sm, u, t);
    to_a_parts<4>(dp, 1.f, xh, xl);
    store_ds(sm, xh, xl, w, g, t);
    accumulate3_regs<4, kNt, BTile::kRowsAlongN, 2>(dk, xh, xl, &sm.qh[0][d0], &sm.ql[0][d0],
                                                    kLd, g, t);
    __syncthreads();
    add_dq(sm, a, u, qhead, q0, d0, w, g, t);
  }
  wait_async_copies();  // K's and V's, where the loop did not run
  store_key_grads<D>(a, dk, dv, u, khead, key0, d0, g, t);
}

// The workspace: Q's, K's, V's and dO's parts [2][BH Sq D], [2][BH Sk D], [2][BH Sk D],
// [2][BH Sq D] fp16, the heads' largest magnitudes [4][BH], δ [BH Sq], each on a 256-byte
// boundary (buffer_layout.h).
struct Layout {
  size_t part[4], amax, delta, total;
  Layout(int64_t BH, int64_t Sq, int64_t Sk, int D) {
    const size_t q = 2 * static_cast<size_t>(BH) * Sq * D * sizeof(__half);
    const size_t k = 2 * static_cast<size_t>(BH) * Sk * D * sizeof(__half);
    Cursor c;
    part[0] = c.take(q), part[1] = c.take(k), part[2] = c.take(k), part[3] = c.take(q);
    amax = c.take(4 * static_cast<size_t>(BH) * sizeof(float));
    delta = c.take(static_cast<size_t>(BH) * Sq * sizeof(float));
    total = c.end();
  }
};

// Q's, K's, V's and dO's per-head largest magnitudes (amax [4][BH]), then each one's parts (hi,
// then lo, [BH S D]: hi[i]).
void split_heads(const AttentionF16x3Backward& a, float* amax, __half* const (&hi)[4],
                 cudaStream_t stream) {
  HeadOperands ops{{a.q, a.k, a.v, a.dout}, {a.Sq * a.D, a.Sk * a.D, a.Sk * a.D, a.Sq * a.D}};
  GF_CUDA_CHECK(cudaMemsetAsync(amax, 0, 4 * a.BH * sizeof(float), stream));
  const int64_t n_max = std::max(ops.n[0], ops.n[1]);
  const dim3 grid(static_cast<unsigned>(a.BH), static_cast<unsigned>((n_max + kAmaxChunk - 1) / kAmaxChunk), 4);
  heads_amax_kernel<<<grid, kAmaxThreads, 0, stream>>>(ops, a.BH, reinterpret_cast<int*>(amax));
  GF_LAUNCH_CHECK();
  for (int i = 0; i < 4; ++i) {
    const int64_t total = a.BH * ops.n[i];
    split_head_kernel<<<static_cast<unsigned>((total / 4 + 255) / 256), 256, 0, stream>>>(
        ops.x[i], ops.n[i], total, amax + i * a.BH, hi[i], hi[i] + total);
    GF_LAUNCH_CHECK();
  }
}

template <int D>
void launch_backward_kernel(const AttentionF16x3Backward& a, const Parts& pt, cudaStream_t stream) {
  static std::atomic<uint64_t> opted{0};
  allow_dynamic_shared(reinterpret_cast<const void*>(attention_backward_kernel<D>),
                       sizeof(Shared<D>), opted);
  const dim3 grid(static_cast<unsigned>(a.BH), static_cast<unsigned>((a.Sk + kTile - 1) / kTile),
                  Cols<D>::kCtas);
  attention_backward_kernel<D><<<grid, kThreads, sizeof(Shared<D>), stream>>>(a, pt);
  GF_LAUNCH_CHECK();
}

}  // namespace

const char* attention_f16x3_backward_unfit(int D) {
  return D == 64 || D == 96 || D == 128 ? nullptr : "the backward takes head dim 64, 96 or 128";
}

const char* attention_f16x3_backward_device_unfit(int D, int device) {
  return attention_device_unfit(shared_bytes_at<Shared>(D), device);
}

size_t attention_f16x3_backward_workspace_bytes(int64_t BH, int64_t Sq, int64_t Sk, int D) {
  return Layout(BH, Sq, Sk, D).total;
}

void launch_attention_f16x3_backward(const AttentionF16x3Backward& a, cudaStream_t stream) {
  if (attention_f16x3_backward_unfit(a.D)) throw std::logic_error(attention_f16x3_backward_unfit(a.D));
  const size_t nq = static_cast<size_t>(a.BH) * a.Sq * a.D, nk = static_cast<size_t>(a.BH) * a.Sk * a.D;
  if (a.BH == 0 || a.Sk == 0) {
    if (nq) throw std::logic_error("attention over no keys");  // the route declines it
    return;
  }
  if (a.Sq == 0) {  // no queries: zero gradients for the keys and values
    GF_CUDA_CHECK(cudaMemsetAsync(a.dk, 0, nk * sizeof(float), stream));
    GF_CUDA_CHECK(cudaMemsetAsync(a.dv, 0, nk * sizeof(float), stream));
    return;
  }
  const Layout L(a.BH, a.Sq, a.Sk, a.D);
  const LaidOut buf{a.workspace};
  auto* amax = buf.as<float>(L.amax);
  auto* delta = buf.as<float>(L.delta);
  __half* hi[4];
  for (int i = 0; i < 4; ++i) hi[i] = buf.as<__half>(L.part[i]);
  split_heads(a, amax, hi, stream);
  const int64_t rows = a.BH * a.Sq;
  delta_kernel<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, stream>>>(a.dout, a.o, rows, a.D,
                                                                                    delta);
  GF_LAUNCH_CHECK();
  GF_CUDA_CHECK(cudaMemsetAsync(a.dq, 0, nq * sizeof(float), stream));
  const Parts pt{hi[0], hi[0] + nq, hi[1], hi[1] + nk, hi[2], hi[2] + nk,
                 hi[3], hi[3] + nq, amax, delta};
  if (a.D == 64)
    launch_backward_kernel<64>(a, pt, stream);
  else if (a.D == 96)
    launch_backward_kernel<96>(a, pt, stream);
  else
    launch_backward_kernel<128>(a, pt, stream);
  launch_attention_nonfinite_backward(a, amax, stream);
}

}  // namespace gemmfuse::cuda

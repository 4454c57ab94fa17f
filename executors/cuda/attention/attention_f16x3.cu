#include "attention_f16x3.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "attention_nonfinite.h"
#include "attention_tiles.cuh"
#include "cuda_check.h"
#include "device_info.h"
#include "buffer_layout.h"

namespace gemmfuse::cuda {
namespace {

using namespace attention;
constexpr int kRows = kTile, kKeys = kTile;
constexpr float kLog2e = 1.4426950408889634f;

// ---- the splits: v 2^e = hi + 2^-11 lo (attention_tiles.cuh) --------------------------------
// A warp per row of x [R, D] (D <= 128): its exponent (over the row; NaN where the row holds a
// NaN or an infinity or its exponent does not fit kMaxSplitExp: attention_nonfinite.cu
// recomputes that head) and parts, a lane per pair of
// neighbouring values (8-byte loads, 4-byte stores; the row read once).
__global__ void split_rows_kernel(const float* x, int64_t R, int D, __half* hi, __half* lo,
                                  float* exps) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= R) return;
  float2 v[2] = {};
  float amax = 0.f;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int d = 2 * lane + 64 * i;
    if (d >= D) continue;
    v[i] = *reinterpret_cast<const float2*>(x + r * D + d);
    amax = fmaxf(amax, fmaxf(fabsf(v[i].x), fabsf(v[i].y)));
    bad |= !isfinite(v[i].x) || !isfinite(v[i].y);
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const int e = split_exponent(amax);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int d = 2 * lane + 64 * i;
    if (d >= D) continue;
    __align__(4) __half h[2], l[2];
    split_one(v[i].x, e, &h[0], &l[0]);
    split_one(v[i].y, e, &h[1], &l[1]);
    *reinterpret_cast<uint32_t*>(hi + r * D + d) = *reinterpret_cast<const uint32_t*>(h);
    *reinterpret_cast<uint32_t*>(lo + r * D + d) = *reinterpret_cast<const uint32_t*>(l);
  }
  bad |= !split_exponent_fits(e);  // (the same e on every lane)
  if (__any_sync(0xffffffffu, bad) && lane == 0) exps[r] = NAN;
  else if (lane == 0) exps[r] = static_cast<float>(e);
}

// V's parts transposed, [BH][D][Sp] with Sp = S (the keys) rounded up to whole 64-key tiles and
// zeros past S, so that the attention kernel's V tile is D rows of 64 keys (16-byte loads); each
// column with its exponent over the head's keys. Two kernels over many CTAs, each of D x kVRows
// threads: the columns' largest magnitudes per chunk of kVChunk keys, folded into the head's by
// fold_max_magnitude (a NaN or an infinity counts as +inf); then a CTA per 64-key tile, split and transposed through shared memory. The head's
// flag (zeroed before, set by atomicOr): whether its V, or its Q's or K's rows (exponents eq,
// ek: NaN marks), held a non-finite value, or a column's exponent falls outside kMaxSplitExp
// (attention_nonfinite.cu then recomputes the head).
constexpr int kVRows = 8;
constexpr int kVChunk = 128;

template <int D>
__global__ void __launch_bounds__(D * kVRows) v_amax_kernel(const float* v, int64_t Sq, int64_t S,
                                                            int* amax_bits, const float* eq,
                                                            const float* ek, int* flags) {
  __shared__ float red[kVRows][D];
  const int64_t head = blockIdx.x, s0 = static_cast<int64_t>(blockIdx.y) * kVChunk;
  const float* x = v + head * S * D;
  const int d = threadIdx.x, r = threadIdx.y, tid = r * D + d;
  const int64_t s_end = S < s0 + kVChunk ? S : s0 + kVChunk;
  float amax = 0.f;
#pragma unroll 4
  for (int64_t s = s0 + r; s < s_end; s += kVRows) amax = fmaxf(amax, abs_or_inf(x[s * D + d]));
  red[r][d] = amax;
  __syncthreads();
  if (r == 0) {
    for (int i = 1; i < kVRows; ++i) amax = fmaxf(amax, red[i][d]);
    fold_max_magnitude(amax_bits + head * D + d, amax);
  }
  bool bad = false;  // the rows' NaN marks, spread over the head's CTAs
  const int64_t first = static_cast<int64_t>(blockIdx.y) * D * kVRows + tid;
  const int64_t step = static_cast<int64_t>(gridDim.y) * D * kVRows;
  for (int64_t s = first; s < Sq; s += step) bad |= isnan(eq[head * Sq + s]);
  for (int64_t s = first; s < S; s += step) bad |= isnan(ek[head * S + s]);
  if (__syncthreads_or(bad) && tid == 0) atomicOr(flags + head, 1);
}

template <int D>
__global__ void __launch_bounds__(D * kVRows) split_v_kernel(
    const float* v, int64_t S, int64_t Sp, const int* amax_bits, __half* hi, __half* lo,
    float* exps, int* flags) {
  __shared__ __align__(16) __half th[D][kTile + kPad], tl[D][kTile + kPad];
  const int64_t head = blockIdx.x, c = static_cast<int64_t>(blockIdx.y) * kTile;
  const float* x = v + head * S * D;
  const int d = threadIdx.x, r = threadIdx.y, tid = r * D + d;
  const float amax = __int_as_float(amax_bits[head * D + d]);
  const int e = split_exponent(amax);
  if (blockIdx.y == 0 && r == 0) {
    exps[head * D + d] = static_cast<float>(e);
    if (!isfinite(amax) || !split_exponent_fits(e)) atomicOr(flags + head, 1);
  }
#pragma unroll
  for (int s = r; s < kTile; s += kVRows) {
    __half h = __float2half(0.f), l = h;
    if (c + s < S) split_one(x[(c + s) * D + d], e, &h, &l);
    th[d][s] = h, tl[d][s] = l;
  }
  __syncthreads();
  for (int i = tid; i < D * kTile / 8; i += D * kVRows) {
    const int row = i / (kTile / 8), col = (i % (kTile / 8)) * 8;
    const int64_t o = (head * D + row) * Sp + c + col;
    *reinterpret_cast<uint4*>(hi + o) = *reinterpret_cast<const uint4*>(&th[row][col]);
    *reinterpret_cast<uint4*>(lo + o) = *reinterpret_cast<const uint4*>(&tl[row][col]);
  }
}

// ---- the attention kernel -----------------------------------------------------------------
template <int D>
struct Shared {
  static constexpr int kQ = D + kPad, kV = kKeys + kPad;
  __half qh[kRows][kQ], ql[kRows][kQ];
  __half kh[kKeys][kQ], kl[kKeys][kQ];
  __half vh[D][kV], vl[D][kV];  // V's tile transposed: [d][key]
  float fk[kKeys];  // the tile's keys' 2^-ek
};

struct Parts {
  const __half *qh, *ql, *kh, *kl, *vh, *vl;  // V's transposed: [BH][D][sp]
  const float *eq, *ek, *ev;
  const int* flags;  // [BH]: the heads attention_nonfinite.cu recomputes
  int64_t sp;        // S rounded up to whole key tiles
};

// One query row's running softmax state (per thread: its share of the row's columns).
struct RowState {
  float m = -INFINITY, l = 0.f;
};

// The tile's scores unscaled and in log2 units: times the row's factor fq (its 2^-eq times
// scale log2 e: one rounding) and the key's 2^-ek (exact), plus the mask's row from the tile's
// first key (`mrow`; null: none); keys from `limit` on are masked (past S, or after the row
// under the causal mask: only a tile that holds such keys compares). Then exponentiated
// against the row's new maximum; returns the factor the row's earlier sums take.
__device__ __forceinline__ float softmax_step(float (&s)[8][4], int half, float fq,
                                              const float* fk, int limit, const float* mrow,
                                              int64_t sj, int t, RowState& st) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) s[n][2 * half + j] *= fq * fk[8 * n + 2 * t + j];
  if (mrow != nullptr) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = 8 * n + 2 * t + j;
        if (col < limit) s[n][2 * half + j] += mrow[col * sj] * kLog2e;
      }
  }
  if (limit < kKeys) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (8 * n + 2 * t + j >= limit) s[n][2 * half + j] = -INFINITY;
  }
  float mx = -INFINITY;
#pragma unroll
  for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * half], s[n][2 * half + 1]));
  const float m_new = fmaxf(st.m, quad_max(mx));
  const float base = m_new == -INFINITY ? 0.f : m_new;  // a row masked so far stays at 0
  const float corr = exp2_flushed(st.m - base);
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float& v = s[n][2 * half + j];
      v = exp2_flushed(v - base);
      sum += v;
    }
  st.l = st.l * corr + sum;
  st.m = m_new;
  return corr;
}

// One of a thread's two query rows: its index, its scores' factor (2^-eq times scale log2 e),
// its mask row (null: none) and its running softmax state.
struct QueryRow {
  int64_t row;
  float fq;
  const float* mrow;
  RowState st;
};

__device__ QueryRow query_row(const AttentionF16x3& a, const Parts& pt, int64_t bh, int64_t row) {
  const bool in = row < a.Sq;
  return {row, in ? unscale_of(pt.eq[bh * a.Sq + row]) * (a.scale * kLog2e) : 0.f,
          a.mask.data != nullptr && in ? a.mask.row(bh, row) : nullptr, RowState{}};
}

// Key tile k0's parts (V's transposed; copies the caller waits for) and its keys' 2^-ek into
// shared memory.
template <int D>
__device__ void load_key_tile(Shared<D>& sm, const AttentionF16x3& a, const Parts& pt,
                              int64_t bh, int64_t k0) {
  const int64_t head = bh * a.Sk;
  load_rows<D>(pt.kh + head * D, k0, a.Sk, sm.kh);
  load_rows<D>(pt.kl + head * D, k0, a.Sk, sm.kl);
  load_columns<D>(pt.vh + bh * D * pt.sp, pt.sp, k0, sm.vh);
  load_columns<D>(pt.vl + bh * D * pt.sp, pt.sp, k0, sm.vl);
  for (int i = threadIdx.x; i < kKeys; i += kThreads)
    sm.fk[i] = k0 + i < a.Sk ? unscale_of(pt.ek[head + k0 + i]) : 0.f;
}

// The tile's softmax step for both rows (keys from k0), O's rows rescaled by its factors.
template <int D>
__device__ __forceinline__ void softmax_rows(float (&s)[8][4], float (&o)[D / 8][4],
                                             QueryRow (&qr)[2], const float* fk,
                                             const AttentionF16x3& a, int64_t k0, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int limit = static_cast<int>(
        std::min<int64_t>(a.Sk - k0, a.causal ? qr[h].row - k0 + 1 : kKeys));
    const float* mtile = qr[h].mrow != nullptr ? qr[h].mrow + k0 * a.mask.sj : nullptr;
    const float corr = softmax_step(s, h, qr[h].fq, fk, limit, mtile, a.mask.sj, t, qr[h].st);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][2 * h] *= corr, o[n][2 * h + 1] *= corr;
  }
}

// Row h of the thread's O (its sum l over the quad) unscaled by V's 2^-ev, and its LSE.
template <int D>
__device__ void store_row(const AttentionF16x3& a, const Parts& pt, const float (&o)[D / 8][4],
                          int h, const QueryRow& qr, int64_t bh, int t) {
  const float l = quad_sum(qr.st.l);
  if (qr.row >= a.Sq) return;
  float* out = a.o + (bh * a.Sq + qr.row) * D;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int d = 8 * n + 2 * t;
    const float* ev = pt.ev + bh * D + d;
    out[d] = l > 0.f ? o[n][2 * h] / l * unscale_of(ev[0]) : 0.f;
    out[d + 1] = l > 0.f ? o[n][2 * h + 1] / l * unscale_of(ev[1]) : 0.f;
  }
  if (a.lse != nullptr && t == 0)  // a row masked throughout: 0 out, LSE +inf
    a.lse[bh * a.Sq + qr.row] = l > 0.f ? (qr.st.m + log2f(l)) * 0.6931471805599453f : INFINITY;
}

// D = 64 held to 3 CTAs a multiprocessor's registers (168): its shared memory allows 3.
template <int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 3 : 1)
    attention_kernel(AttentionF16x3 a, Parts pt) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Shared<D>& sm = *reinterpret_cast<Shared<D>*>(smem_raw);
  // B·H on grid x (y and z stop at 65535); the query tiles on y, the last first (under a
  // causal mask they see the most keys, so the long CTAs start early).
  const int64_t bh = blockIdx.x, q0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kRows;
  if (pt.flags[bh]) return;  // attention_nonfinite.cu computes this head
  const int w = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  load_rows<D>(pt.qh + bh * a.Sq * D, q0, a.Sq, sm.qh);
  load_rows<D>(pt.ql + bh * a.Sq * D, q0, a.Sq, sm.ql);
  QueryRow qr[2] = {query_row(a, pt, bh, q0 + 16 * w + g),
                    query_row(a, pt, bh, q0 + 16 * w + g + 8)};
  float o[D / 8][4] = {};
  const int64_t key_end = a.causal ? std::min<int64_t>(a.Sk, q0 + kRows) : a.Sk;
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeys) {
    __syncthreads();  // the previous tile's readers are done
    load_key_tile<D>(sm, a, pt, bh, k0);
    wait_async_copies();  // this tile's (and, the first time, Q's)
    __syncthreads();
    float s[8][4];  // S = Q Kᵀ for the warp's 16 rows and the tile's 64 keys
    product3_rows<D, 8>(s, &sm.qh[16 * w][0], &sm.ql[16 * w][0], Shared<D>::kQ, &sm.kh[0][0],
                        &sm.kl[0][0], Shared<D>::kQ, g, t);
    softmax_rows<D>(s, o, qr, sm.fk, a, k0, t);
    uint32_t ph[4][4], pl[4][4];  // P's parts, unscaled (P is in [0, 1])
    to_a_parts<4>(s, 1.f, ph, pl);
    accumulate3_regs<4, D / 8, BTile::kRowsAlongK, 2>(o, ph, pl, &sm.vh[0][0], &sm.vl[0][0],
                                                      Shared<D>::kV, g, t);
  }
  store_row<D>(a, pt, o, 0, qr[0], bh, t);
  store_row<D>(a, pt, o, 1, qr[1], bh, t);
}

// The workspace: Q's parts [2][BH Sq D] and K's [2][BH Sk D] fp16, V's [2][BH D Sp]
// (transposed, Sp = Sk rounded up to whole key tiles), then Q's and K's row exponents [BH Sq]
// and [BH Sk], V's column exponents [BH D], the flags of the heads attention_nonfinite.cu
// recomputes [BH] and V's columns' largest magnitudes [BH D] (as bits; zeroed with the flags),
// each on a 256-byte boundary (buffer_layout.h).
struct Layout {
  int64_t sp;
  size_t q_parts, k_parts, v_parts, exps_q, exps_k, exps_v, flags, v_amax, total;
  Layout(int64_t BH, int64_t Sq, int64_t Sk, int D) : sp((Sk + kTile - 1) / kTile * kTile) {
    const size_t bh = static_cast<size_t>(BH);
    Cursor c;
    q_parts = c.take(2 * bh * Sq * D * sizeof(__half));
    k_parts = c.take(2 * bh * Sk * D * sizeof(__half));
    v_parts = c.take(2 * bh * D * sp * sizeof(__half));
    exps_q = c.take(bh * Sq * sizeof(float));
    exps_k = c.take(bh * Sk * sizeof(float));
    exps_v = c.take(bh * D * sizeof(float));
    flags = c.take(bh * sizeof(int));  // the flags and V's maxima are zeroed together
    v_amax = c.take(bh * D * sizeof(int));
    total = c.end();
  }
};

// V's split (it also sets the heads' flags), then the attention kernel.
template <int D>
void launch_v_and_kernel(const AttentionF16x3& a, const Layout& L, Parts p, unsigned char* ws,
                         cudaStream_t stream) {
  __half *vh = const_cast<__half*>(p.vh), *vl = const_cast<__half*>(p.vl);
  int* flags = const_cast<int*>(p.flags);
  auto* v_amax = LaidOut{ws}.as<int>(L.v_amax);
  GF_CUDA_CHECK(cudaMemsetAsync(flags, 0, L.total - L.flags, stream));  // the flags and V's maxima
  const unsigned bh = static_cast<unsigned>(a.BH);
  v_amax_kernel<D><<<dim3(bh, static_cast<unsigned>((a.Sk + kVChunk - 1) / kVChunk)), dim3(D, kVRows),
                     0, stream>>>(a.v, a.Sq, a.Sk, v_amax, p.eq, p.ek, flags);
  GF_LAUNCH_CHECK();
  split_v_kernel<D><<<dim3(bh, static_cast<unsigned>(L.sp / kTile)), dim3(D, kVRows), 0, stream>>>(
      a.v, a.Sk, L.sp, v_amax, vh, vl, const_cast<float*>(p.ev), flags);
  GF_LAUNCH_CHECK();
  constexpr int bytes = sizeof(Shared<D>);
  static std::atomic<uint64_t> opted{0};
  allow_dynamic_shared(reinterpret_cast<const void*>(attention_kernel<D>), bytes, opted);
  const dim3 grid(static_cast<unsigned>(a.BH), static_cast<unsigned>((a.Sq + kRows - 1) / kRows));
  attention_kernel<D><<<grid, kThreads, bytes, stream>>>(a, p);
  GF_LAUNCH_CHECK();
}

}  // namespace

const char* attention_f16x3_unfit(int D) {
  return D == 64 || D == 96 || D == 128 ? nullptr : "head dim must be 64, 96 or 128";
}

const char* attention_device_unfit(int shared_bytes, int device) {
  const int cc = compute_capability_of(device);
  if (cc == 0) return "a device whose attributes can be read";
  if (cc < 80) return "a GPU of compute capability 8.0 or newer (mma.sync m16n8k16)";
  if (shared_memory_optin_of(device) < shared_bytes)
    return "more shared memory per block than this GPU allows";
  return nullptr;
}

const char* attention_f16x3_device_unfit(int D, int device) {
  return attention_device_unfit(shared_bytes_at<Shared>(D), device);
}

size_t attention_f16x3_workspace_bytes(int64_t BH, int64_t Sq, int64_t Sk, int D) {
  return Layout(BH, Sq, Sk, D).total;
}

void launch_attention_f16x3(const AttentionF16x3& a, cudaStream_t stream) {
  if (attention_f16x3_unfit(a.D)) throw std::logic_error(attention_f16x3_unfit(a.D));
  if (a.BH == 0 || a.Sq == 0) return;
  if (a.Sk == 0) throw std::logic_error("attention over no keys");  // the route declines it
  const Layout L(a.BH, a.Sq, a.Sk, a.D);
  auto* ws = static_cast<unsigned char*>(a.workspace);
  const LaidOut buf{ws};
  const size_t nq = static_cast<size_t>(a.BH) * a.Sq * a.D, nk = static_cast<size_t>(a.BH) * a.Sk * a.D;
  auto* qh = buf.as<__half>(L.q_parts);
  auto* kh = buf.as<__half>(L.k_parts);
  auto* vh = buf.as<__half>(L.v_parts);
  auto exps = [&](size_t off) { return buf.as<float>(off); };
  auto split = [&](const float* x, int64_t rows, __half* hi, float* e) {
    const unsigned blocks = static_cast<unsigned>((rows * 32 + 255) / 256);
    split_rows_kernel<<<blocks, 256, 0, stream>>>(x, rows, a.D, hi, hi + rows * a.D, e);
    GF_LAUNCH_CHECK();
  };
  split(a.q, a.BH * a.Sq, qh, exps(L.exps_q));
  split(a.k, a.BH * a.Sk, kh, exps(L.exps_k));
  auto* flags = buf.as<int>(L.flags);
  const Parts p{qh, qh + nq, kh, kh + nk, vh, vh + a.BH * a.D * L.sp,
                exps(L.exps_q), exps(L.exps_k), exps(L.exps_v), flags, L.sp};
  if (a.D == 64)
    launch_v_and_kernel<64>(a, L, p, ws, stream);
  else if (a.D == 96)
    launch_v_and_kernel<96>(a, L, p, ws, stream);
  else
    launch_v_and_kernel<128>(a, L, p, ws, stream);
  launch_attention_nonfinite_forward(a, flags, stream);
}

}  // namespace gemmfuse::cuda

#include "attention_f16x3.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>

#include "cuda_check.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kRows = 64;        // query rows per CTA (16 per warp)
constexpr int kKeys = 64;        // keys per tile
constexpr int kThreads = 128;
constexpr int kPad = 8;          // halves of padding per shared row (bank spread, 16-byte rows)
constexpr float kSmall = 0x1p-11f;

// ---- the splits: v 2^e = hi + 2^-11 lo, e putting the largest magnitude just under 2^15 ----
__device__ __forceinline__ int split_exponent(float amax) {
  if (!(amax > 0.f) || !isfinite(amax)) return 0;
  int e;
  frexpf(amax, &e);  // amax = f 2^e, f in [0.5, 1)
  return 15 - e;
}

__device__ __forceinline__ void split_one(float v, int e, __half* hi, __half* lo) {
  const float s = ldexpf(v, e);
  const __half h = __float2half_rn(s);
  *hi = h;
  *lo = __float2half_rn((s - __half2float(h)) * 2048.f);
}

// A warp per row of x [R, D]: its exponent (over the row) and parts.
__global__ void split_rows_kernel(const float* x, int64_t R, int D, __half* hi, __half* lo,
                                  float* exps) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= R) return;
  const float* row = x + r * D;
  float amax = 0.f;
  for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(row[d]));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const int e = split_exponent(amax);
  for (int d = lane; d < D; d += 32) split_one(row[d], e, hi + r * D + d, lo + r * D + d);
  if (lane == 0) exps[r] = static_cast<float>(e);
}

// A CTA of D threads per head: v [S, D]'s columns, each with its exponent over the keys.
__global__ void split_columns_kernel(const float* v, int64_t S, int D, __half* hi, __half* lo,
                                     float* exps) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * S * D;
  const int d = threadIdx.x;
  float amax = 0.f;
  for (int64_t s = 0; s < S; ++s) amax = fmaxf(amax, fabsf(v[base + s * D + d]));
  const int e = split_exponent(amax);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t i = base + s * D + d;
    split_one(v[i], e, hi + i, lo + i);
  }
  exps[static_cast<int64_t>(blockIdx.x) * D + d] = static_cast<float>(e);
}

// ---- the attention kernel -----------------------------------------------------------------
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

// p's high and low parts for two neighbouring columns, as one A-fragment register each.
__device__ __forceinline__ void split_pair(float p0, float p1, uint32_t& hi, uint32_t& lo) {
  const __half h0 = __float2half_rn(p0), h1 = __float2half_rn(p1);
  hi = pack(h0, h1);
  lo = pack(__float2half_rn((p0 - __half2float(h0)) * 2048.f),
            __float2half_rn((p1 - __half2float(h1)) * 2048.f));
}

template <int D>
struct Shared {
  static constexpr int kQ = D + kPad, kV = kKeys + kPad;
  __half qh[kRows][kQ], ql[kRows][kQ];
  __half kh[kKeys][kQ], kl[kKeys][kQ];
  __half vh[D][kV], vl[D][kV];  // V's tile transposed: [d][key]
  float ek[kKeys];
};

struct Parts {
  const __half *qh, *ql, *kh, *kl, *vh, *vl;
  const float *eq, *ek, *ev;
};

// Rows [r0, r0 + n) of a [rows, D] part into a shared [n][D + kPad] tile, zeros past `rows`.
template <int D>
__device__ void load_rows(const __half* src, int64_t r0, int64_t rows, __half (*dst)[D + kPad]) {
  for (int i = threadIdx.x; i < kRows * D / 8; i += kThreads) {
    const int r = i / (D / 8), c = (i % (D / 8)) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < rows) v = *reinterpret_cast<const uint4*>(src + (r0 + r) * D + c);
    *reinterpret_cast<uint4*>(&dst[r][c]) = v;
  }
}

// Keys [k0, k0 + kKeys) of V's part, transposed into [D][kKeys + kPad], zeros past S.
template <int D>
__device__ void load_v(const __half* src, int64_t k0, int64_t S, __half (*dst)[kKeys + kPad]) {
  for (int i = threadIdx.x; i < kKeys * D; i += kThreads) {
    const int key = i / D, d = i % D;
    dst[d][key] = k0 + key < S ? src[(k0 + key) * D + d] : __float2half(0.f);
  }
}

// s (a warp's 16 x 64 tile) = Q Kᵀ on the parts: the small products, then the large one.
template <int D>
__device__ void scores(const Shared<D>& sm, int w, int g, int t, float (&s)[8][4]) {
  const int ra = 16 * w + g, rb = ra + 8;
#pragma unroll
  for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int c = 16 * kk + 2 * t;
      const uint32_t ah[4] = {pair(&sm.qh[ra][c]), pair(&sm.qh[rb][c]), pair(&sm.qh[ra][c + 8]),
                              pair(&sm.qh[rb][c + 8])};
      const uint32_t al[4] = {pair(&sm.ql[ra][c]), pair(&sm.ql[rb][c]), pair(&sm.ql[ra][c + 8]),
                              pair(&sm.ql[rb][c + 8])};
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int key = 8 * n + g;
        if (pass == 0) {
          mma(s[n], ah, pair(&sm.kl[key][c]), pair(&sm.kl[key][c + 8]));
          mma(s[n], al, pair(&sm.kh[key][c]), pair(&sm.kh[key][c + 8]));
        } else {
          mma(s[n], ah, pair(&sm.kh[key][c]), pair(&sm.kh[key][c + 8]));
        }
      }
    }
    if (pass == 0)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] *= kSmall;
  }
}

// o += P V on the parts (P in registers as A fragments), the small products through o 2^11.
template <int D>
__device__ void accumulate(const Shared<D>& sm, int g, int t, const float (&p)[8][4],
                           float (&o)[D / 8][4]) {
  uint32_t ph[4][4], pl[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    split_pair(p[2 * kk][0], p[2 * kk][1], ph[kk][0], pl[kk][0]);
    split_pair(p[2 * kk][2], p[2 * kk][3], ph[kk][1], pl[kk][1]);
    split_pair(p[2 * kk + 1][0], p[2 * kk + 1][1], ph[kk][2], pl[kk][2]);
    split_pair(p[2 * kk + 1][2], p[2 * kk + 1][3], ph[kk][3], pl[kk][3]);
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] *= 2048.f;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int c = 16 * kk + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int d = 8 * n + g;
      mma(o[n], ph[kk], pair(&sm.vl[d][c]), pair(&sm.vl[d][c + 8]));
      mma(o[n], pl[kk], pair(&sm.vh[d][c]), pair(&sm.vh[d][c + 8]));
    }
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] *= kSmall;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int c = 16 * kk + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int d = 8 * n + g;
      mma(o[n], ph[kk], pair(&sm.vh[d][c]), pair(&sm.vh[d][c + 8]));
    }
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One query row's running softmax state (per thread: its share of the row's columns).
struct RowState {
  float m = -INFINITY, l = 0.f;
};

// The tile's scores unscaled (2^-(eq + ek), scale, log2 e), masked, then exponentiated
// against the row's new maximum; returns the factor the row's earlier sums take.
__device__ __forceinline__ float softmax_step(float (&s)[8][4], int half, float eq,
                                              const float* ek, float scale_log2, int64_t row,
                                              int64_t k0, int64_t S, bool causal, int t,
                                              RowState& st) {
  float mx = -INFINITY;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = 8 * n + 2 * t + j;
      const int64_t key = k0 + col;
      float& v = s[n][2 * half + j];
      v = ldexpf(v, -static_cast<int>(eq + ek[col])) * scale_log2;
      if (key >= S || (causal && key > row)) v = -INFINITY;
      mx = fmaxf(mx, v);
    }
  const float m_new = fmaxf(st.m, quad_max(mx));
  const float base = m_new == -INFINITY ? 0.f : m_new;  // a row masked so far stays at 0
  const float corr = exp2f(st.m - base);
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float& v = s[n][2 * half + j];
      v = exp2f(v - base);
      sum += v;
    }
  st.l = st.l * corr + sum;
  st.m = m_new;
  return corr;
}

template <int D>
__global__ void __launch_bounds__(kThreads) attention_kernel(AttentionF16x3 a, Parts pt) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Shared<D>& sm = *reinterpret_cast<Shared<D>*>(smem_raw);
  const int64_t bh = blockIdx.y, q0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int w = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t head = bh * a.S;
  load_rows<D>(pt.qh + head * D, q0, a.S, sm.qh);
  load_rows<D>(pt.ql + head * D, q0, a.S, sm.ql);
  const int64_t row[2] = {q0 + 16 * w + g, q0 + 16 * w + g + 8};
  float eq[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) eq[h] = row[h] < a.S ? pt.eq[head + row[h]] : 0.f;
  const float scale_log2 = a.scale * 1.4426950408889634f;
  float o[D / 8][4] = {};
  RowState st[2];
  const int64_t key_end = a.causal ? std::min<int64_t>(a.S, q0 + kRows) : a.S;
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeys) {
    __syncthreads();  // the previous tile's readers are done
    load_rows<D>(pt.kh + head * D, k0, a.S, sm.kh);
    load_rows<D>(pt.kl + head * D, k0, a.S, sm.kl);
    load_v<D>(pt.vh + head * D, k0, a.S, sm.vh);
    load_v<D>(pt.vl + head * D, k0, a.S, sm.vl);
    for (int i = threadIdx.x; i < kKeys; i += kThreads)
      sm.ek[i] = k0 + i < a.S ? pt.ek[head + k0 + i] : 0.f;
    __syncthreads();
    float s[8][4];
    scores<D>(sm, w, g, t, s);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float corr = softmax_step(s, h, eq[h], sm.ek, scale_log2, row[h], k0, a.S, a.causal,
                                      t, st[h]);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) o[n][2 * h] *= corr, o[n][2 * h + 1] *= corr;
    }
    accumulate<D>(sm, g, t, s, o);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(st[h].l);
    if (row[h] >= a.S) continue;
    float* out = a.o + (head + row[h]) * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int d = 8 * n + 2 * t;
      const float* ev = pt.ev + bh * D + d;
      out[d] = ldexpf(o[n][2 * h] / l, -static_cast<int>(ev[0]));
      out[d + 1] = ldexpf(o[n][2 * h + 1] / l, -static_cast<int>(ev[1]));
    }
    if (a.lse != nullptr && t == 0)
      a.lse[head + row[h]] = (st[h].m + log2f(l)) * 0.6931471805599453f;
  }
}

// The workspace: Q's, K's and V's parts [2][BH S D] fp16, then Q's and K's row exponents
// [BH S] and V's column exponents [BH D].
struct Layout {
  size_t parts, exps_q, exps_k, exps_v, total;
  Layout(int64_t BH, int64_t S, int D) {
    const size_t n = static_cast<size_t>(BH) * S * D, rows = static_cast<size_t>(BH) * S;
    parts = 2 * n * sizeof(__half);
    exps_q = 3 * parts;
    exps_k = exps_q + rows * sizeof(float);
    exps_v = exps_k + rows * sizeof(float);
    total = exps_v + static_cast<size_t>(BH) * D * sizeof(float);
  }
};

template <int D>
void launch_kernel(const AttentionF16x3& a, const Parts& p, cudaStream_t stream) {
  constexpr int bytes = sizeof(Shared<D>);
  static std::atomic<uint64_t> opted{0};  // a bit per device id (< 64)
  int dev = 0;
  GF_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (!(opted.load() & bit)) {
    GF_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel<D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    opted.fetch_or(bit);
  }
  const dim3 grid(static_cast<unsigned>((a.S + kRows - 1) / kRows), static_cast<unsigned>(a.BH));
  attention_kernel<D><<<grid, kThreads, bytes, stream>>>(a, p);
  GF_LAUNCH_CHECK();
}

}  // namespace

const char* attention_f16x3_unfit(int D) {
  return D == 64 || D == 128 ? nullptr : "head dim must be 64 or 128";
}

size_t attention_f16x3_workspace_bytes(int64_t BH, int64_t S, int D) {
  return Layout(BH, S, D).total;
}

void launch_attention_f16x3(const AttentionF16x3& a, cudaStream_t stream) {
  if (attention_f16x3_unfit(a.D)) throw std::logic_error(attention_f16x3_unfit(a.D));
  if (a.BH == 0 || a.S == 0) return;
  const Layout L(a.BH, a.S, a.D);
  auto* ws = static_cast<unsigned char*>(a.workspace);
  const size_t n = static_cast<size_t>(a.BH) * a.S * a.D;
  auto parts = [&](int i) { return reinterpret_cast<__half*>(ws + i * L.parts); };
  auto exps = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  const int64_t rows = a.BH * a.S;
  const unsigned row_blocks = static_cast<unsigned>((rows * 32 + 255) / 256);
  split_rows_kernel<<<row_blocks, 256, 0, stream>>>(a.q, rows, a.D, parts(0), parts(0) + n, exps(L.exps_q));
  split_rows_kernel<<<row_blocks, 256, 0, stream>>>(a.k, rows, a.D, parts(1), parts(1) + n, exps(L.exps_k));
  split_columns_kernel<<<static_cast<unsigned>(a.BH), a.D, 0, stream>>>(a.v, a.S, a.D, parts(2),
                                                                        parts(2) + n, exps(L.exps_v));
  GF_LAUNCH_CHECK();
  const Parts p{parts(0), parts(0) + n, parts(1), parts(1) + n, parts(2), parts(2) + n,
                exps(L.exps_q), exps(L.exps_k), exps(L.exps_v)};
  if (a.D == 64)
    launch_kernel<64>(a, p, stream);
  else
    launch_kernel<128>(a, p, stream);
}

}  // namespace gemmfuse::cuda

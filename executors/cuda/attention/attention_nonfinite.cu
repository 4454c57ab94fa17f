// Heads whose inputs hold a NaN or an infinity, recomputed in plain fp32 after the split-product
// kernels ran, as PyTorch's math path computes attention: scores q·k · scale plus the mask's
// 0 or −inf, softmax, then P V over every key (a masked key's p = 0 times an infinite v is
// NaN there too). Split parts cannot carry these values: in hi·inf + lo·inf, lo's sign differs
// from hi's about half the time, so a score that is ±inf comes out NaN. Heads whose finite
// magnitudes lie outside the split kernels' exponent range (attention_tiles.cuh) come here too.
// A head's flag comes from its splits (the forward's per-head flags, the backward's per-head
// largest magnitudes), so nothing waits on the host; every other head's CTAs return at once.
//
// A thread per query row (forward, dQ) or per key (dK, dV; one launch with dQ), two passes
// over the other side:
// O(S² D) per head, at SIMT fp32 speed. Only the heads recomputed pay it.
#include "attention_nonfinite.h"

#include <algorithm>
#include <cmath>

#include "cuda_check.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxD = 128;

__device__ float dot(const float* x, const float* y, int D) {
  float s = 0.f;
  for (int d = 0; d < D; ++d) s = fmaf(x[d], y[d], s);
  return s;
}

// Score (i, j) of head bh as the math path forms it: NaN stays NaN under the mask.
__device__ float score(const float* q, const float* k, int D, int64_t i, int64_t j, float scale,
                       bool causal, const AttentionMask& mask, int64_t bh) {
  float s = dot(q + i * D, k + j * D, D) * scale + (causal && j > i ? -INFINITY : 0.f);
  return mask.data != nullptr ? s + mask.row(bh, i)[j * mask.sj] : s;
}

// torch.max's rule: a NaN anywhere makes the maximum NaN.
__device__ float nan_max(float m, float s) { return (m != m || s != s) ? NAN : fmaxf(m, s); }

__global__ void forward_kernel(AttentionF16x3 a, const int* flags) {
  const int64_t bh = blockIdx.x, i = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (!flags[bh] || i >= a.Sq) return;
  const int64_t head = bh * a.Sq * a.D, kv = bh * a.Sk * a.D;
  const float *q = a.q + head, *k = a.k + kv, *v = a.v + kv;
  float m = -INFINITY;
  for (int64_t j = 0; j < a.Sk; ++j)
    m = nan_max(m, score(q, k, a.D, i, j, a.scale, a.causal, a.mask, bh));
  float l = 0.f, o[kMaxD] = {};
  for (int64_t j = 0; j < a.Sk; ++j) {
    const float p = expf(score(q, k, a.D, i, j, a.scale, a.causal, a.mask, bh) - m);
    l += p;
    for (int d = 0; d < a.D; ++d) o[d] = fmaf(p, v[j * a.D + d], o[d]);
  }
  const bool none = m == -INFINITY;  // masked throughout: 0 out, LSE +inf (as the kernel)
  for (int d = 0; d < a.D; ++d) a.o[head + i * a.D + d] = none ? 0.f : o[d] / l;
  if (a.lse != nullptr) a.lse[bh * a.Sq + i] = none ? INFINITY : m + logf(l);
}

struct Head {
  const float *q, *k, *v, *o, *dout, *lse;
};

__device__ Head head_of(const AttentionF16x3Backward& a, int64_t bh) {
  const int64_t off = bh * a.Sq * a.D, kv = bh * a.Sk * a.D;
  return {a.q + off, a.k + kv, a.v + kv, a.o + off, a.dout + off, a.lse + bh * a.lse_stride};
}

// P_ij and dS_ij = P_ij (dP_ij − δ_i), dP_ij = dO_i·V_j, δ_i = dO_i·O_i (softmax's backward).
__device__ void p_and_ds(const AttentionF16x3Backward& a, const Head& h, int64_t bh, int64_t i,
                         int64_t j, float& p, float& ds) {
  p = expf(score(h.q, h.k, a.D, i, j, a.scale, a.causal, a.mask, bh) - h.lse[i]);
  const float dp = dot(h.dout + i * a.D, h.v + j * a.D, a.D);
  ds = p * (dp - dot(h.dout + i * a.D, h.o + i * a.D, a.D));
}

// dQ_i = scale Σ_j dS_ij K_j for query row i.
__device__ void query_grads(const AttentionF16x3Backward& a, const Head& h, int64_t bh,
                            int64_t i) {
  float acc[kMaxD] = {};
  for (int64_t j = 0; j < a.Sk; ++j) {
    float p, ds;
    p_and_ds(a, h, bh, i, j, p, ds);
    for (int d = 0; d < a.D; ++d) acc[d] = fmaf(ds, h.k[j * a.D + d], acc[d]);
  }
  float* dq = a.dq + bh * a.Sq * a.D + i * a.D;
  for (int d = 0; d < a.D; ++d) dq[d] = acc[d] * a.scale;
}

// dV_j = Σ_i P_ij dO_i and dK_j = scale Σ_i dS_ij Q_i for key j.
__device__ void key_grads(const AttentionF16x3Backward& a, const Head& h, int64_t bh,
                          int64_t j) {
  float dv[kMaxD] = {}, dk[kMaxD] = {};
  for (int64_t i = 0; i < a.Sq; ++i) {
    float p, ds;
    p_and_ds(a, h, bh, i, j, p, ds);
    for (int d = 0; d < a.D; ++d) {
      dv[d] = fmaf(p, h.dout[i * a.D + d], dv[d]);
      dk[d] = fmaf(ds, h.q[i * a.D + d], dk[d]);
    }
  }
  const int64_t off = bh * a.Sk * a.D + j * a.D;
  for (int d = 0; d < a.D; ++d) a.dv[off + d] = dv[d], a.dk[off + d] = dk[d] * a.scale;
}

// One launch for both: a thread per query row (z = 0: dQ) or per key (z = 1: dK, dV).
__global__ void backward_kernel(AttentionF16x3Backward a, const float* amax) {
  const int64_t bh = blockIdx.x, r = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (!attention_head_unsplit(amax, a.BH, bh, a.D) || r >= (blockIdx.z == 0 ? a.Sq : a.Sk)) return;
  const Head h = head_of(a, bh);
  if (blockIdx.z == 0)
    query_grads(a, h, bh, r);
  else
    key_grads(a, h, bh, r);
}

dim3 grid_of(int64_t S, int64_t BH, unsigned z = 1) {
  return dim3(static_cast<unsigned>(BH), static_cast<unsigned>((S + kThreads - 1) / kThreads), z);
}

}  // namespace

void launch_attention_nonfinite_forward(const AttentionF16x3& a, const int* head_flags,
                                        cudaStream_t stream) {
  forward_kernel<<<grid_of(a.Sq, a.BH), kThreads, 0, stream>>>(a, head_flags);
  GF_LAUNCH_CHECK();
}

void launch_attention_nonfinite_backward(const AttentionF16x3Backward& a, const float* head_amax,
                                         cudaStream_t stream) {
  backward_kernel<<<grid_of(std::max(a.Sq, a.Sk), a.BH, 2), kThreads, 0, stream>>>(a, head_amax);
  GF_LAUNCH_CHECK();
}

}  // namespace gemmfuse::cuda

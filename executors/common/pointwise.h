// The scalar math of every pointwise stage, shared by the CPU and CUDA executors so that
// both compute the same function. Formulas follow PyTorch's fp32 kernels (NaN propagates
// through clamp/min/max/relu as it does there).
#pragma once

#include <cmath>

#include "gemmfuse/chain.h"

#if defined(__CUDACC__)
#define GF_HD __host__ __device__ __forceinline__
#define GF_UNROLL _Pragma("unroll")
#else
#define GF_HD inline
#define GF_UNROLL
#endif

namespace gemmfuse {

// The scalar attributes a pointwise op reads, in fp32 (resolved once per plan).
struct PointwiseParams {
  float lo, hi;        // clamp
  float alpha;         // elu alpha, leaky_relu slope, pow exponent
  float beta, threshold;  // softplus
};

inline PointwiseParams pointwise_params(const Node& n) {
  return {static_cast<float>(n.lo), static_cast<float>(n.hi), static_cast<float>(n.alpha),
          static_cast<float>(n.beta), static_cast<float>(n.threshold)};
}

GF_HD bool gf_isnan(float x) { return x != x; }

// min(max(x, lo), hi) as ATen's clamp computes it: NaN stays NaN, a NaN bound is ignored,
// lo > hi gives hi. On the host as two selects, which vectorize (fminf/fmaxf are library
// calls there unless math is finite-only).
GF_HD float gf_clamp(float x, float lo, float hi) {
#if defined(__CUDA_ARCH__)
  return gf_isnan(x) ? x : fminf(fmaxf(x, lo), hi);
#else
  const float t = x < lo ? lo : x;
  return t > hi ? hi : t;
#endif
}

GF_HD float gf_softplus(float x, float beta, float threshold) {
  return (x * beta) > threshold ? x : log1pf(expf(x * beta)) / beta;
}

// Exact-form gelu, 0.5 x (1 + erf(x / sqrt 2)), for |x| <= kGeluPolyRange in 12 fp32
// operations instead of erff's ~28 with its range selects: h + s Q(s), h = x / 2, s = x^2,
// Q a degree-9 fit to 0.5 erf(x / sqrt 2) / x (Chebyshev nodes, Lawson-weighted to minimax
// the absolute error of gelu). Max abs error 6.6e-7 on the range (erff's form in fp32:
// 2.4e-7); tests/cpp/cpu_pointwise_test.cpp checks it against the exact form. For kernels
// whose epilogue is bound by instruction issue (sm90/gemm_softmax_epilogue.cuh); callers check the range.
constexpr float kGeluPolyRange = 2.8284271247461903f;  // 2 sqrt 2
// q = C(t) for n values side by side, C's D coefficients highest degree first, the n Horner
// chains interleaved in the source: one chain alone issues one dependent FMA per FMA
// latency (4 cycles), and ptxas, short of registers, keeps the source order
// (sm90/gemm_softmax_epilogue.cuh's rolled epilogue rounds).
// hook(j, D - 1) runs after Horner step j (0 .. D - 2): independent work placed between the
// steps in the source, for a caller that wants it interleaved with the chains.
struct NoHornerHook {
  GF_HD void operator()(int, int) const {}
};
template <int N, int D, class Hook>
GF_HD void horner_interleaved_n(const float (&t)[N], const float (&kC)[D], float (&q)[N], Hook& hook) {
  GF_UNROLL
  for (int k = 0; k < N; ++k) q[k] = kC[0];
  GF_UNROLL
  for (int j = 1; j < D; ++j) {
    GF_UNROLL
    for (int k = 0; k < N; ++k) q[k] = fmaf(q[k], t[k], kC[j]);
    hook(j - 1, D - 1);
  }
}

// h + s Q(s) for n values in place (h = x / 2, s = x^2), Q's D coefficients highest degree
// first.
template <int N, int D, class Hook = NoHornerHook>
GF_HD void gelu_erf_horner_n(float (&x)[N], const float (&kQ)[D], Hook hook = Hook{}) {
  float s[N], q[N];
  GF_UNROLL
  for (int k = 0; k < N; ++k) s[k] = x[k] * x[k];
  horner_interleaved_n(s, kQ, q, hook);
  GF_UNROLL
  for (int k = 0; k < N; ++k) x[k] = fmaf(s[k], q[k], 0.5f * x[k]);
}

// gelu_erf_poly of n values in place (|x| <= kGeluPolyRange).
template <int N, class Hook = NoHornerHook>
GF_HD void gelu_erf_poly_n(float (&x)[N], Hook hook = Hook{}) {
  constexpr float kQ[10] = {-1.722906019e-11f, 1.033751529e-09f, -3.045461128e-08f,
                            6.032476563e-07f,  -9.201158718e-06f, 1.148166339e-04f,
                            -1.186344773e-03f, 9.972650558e-03f,  -6.648996472e-02f,
                            3.989422023e-01f};
  gelu_erf_horner_n(x, kQ, hook);
}

// The same for |x| <= kGeluNarrowRange with a degree-4 Q (fitted the same way on that
// range): max abs error 8.4e-6, 5 FMAs fewer per value than the degree-9 form. Only for
// epilogues whose results are rounded to 16 bits: the fused sm90 kernel stashes
// exp(v - max) <= 1 as fp16 (rounding error up to 2.4e-4, 29x this) and writes bf16 or fp16.
constexpr float kGeluNarrowRange = 2.0f;
template <int N, class Hook = NoHornerHook>
GF_HD void gelu_erf_poly_narrow_n(float (&x)[N], Hook hook = Hook{}) {
  constexpr float kQ[5] = {4.620103937e-05f, -9.358101524e-04f, 9.521147236e-03f,
                           -6.612268835e-02f, 3.988437653e-01f};
  gelu_erf_horner_n(x, kQ, hook);
}

GF_HD float gelu_erf_poly(float x) {
  float v[1] = {x};
  gelu_erf_poly_n(v);
  return v[0];
}

// Exact-form gelu for every finite x and NaN, in 15 fp32 operations, for the same 16-bit
// epilogues as the narrow form: gelu(x) = relu(x) - g(|x|), g(a) = a Phi(-a) (rises from 0,
// peaks at 0.17, decays like a Gaussian), g a degree-11 polynomial of z = min(2|x| / A - 1, 1)
// (monomials in z are well conditioned on [-1, 1]; powers of |x| are not). Past A = 4.75,
// g < 4.8e-6 is left out. Max abs error 8.4e-6, relative error past |x| = 40 below 1e-7
// (bench/micro/fit_gelu_wide.py fits the coefficients and measures both). NaN stays NaN (the
// clamp is min.NaN); +-inf are not in its domain (-inf would give 0, not PyTorch's NaN).
constexpr float kGeluWideClamp = 4.75f;
GF_HD float gf_min_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a ? a : (a < b ? a : b);
#endif
}
template <int N, class Hook = NoHornerHook>
GF_HD void gelu_erf_wide_n(float (&x)[N], Hook hook = Hook{}) {
  constexpr int D = 12;  // coefficients, highest degree first
  constexpr float kP[D] = {2.390531637e-02f,  -5.972106010e-02f, -5.629895627e-02f,
                           2.540677488e-01f,  -9.759101272e-02f, -3.403275013e-01f,
                           4.522494674e-01f,  -1.192537025e-01f, -2.091010660e-01f,
                           2.443935126e-01f,  -1.131613329e-01f, 2.083532698e-02f};
  float z[N], q[N];
  GF_UNROLL
  for (int k = 0; k < N; ++k) z[k] = gf_min_nan(fmaf(fabsf(x[k]), 2.0f / kGeluWideClamp, -1.0f), 1.0f);
  horner_interleaved_n(z, kP, q, hook);
  GF_UNROLL
  for (int k = 0; k < N; ++k) x[k] = fmaxf(x[k], 0.0f) - q[k];
}

GF_HD float gelu_erf_wide(float x) {
  float v[1] = {x};
  gelu_erf_wide_n(v);
  return v[0];
}

// Max that propagates NaN (as torch.max / amax do); selects on the host (see gf_clamp).
GF_HD float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__)
  return (gf_isnan(a) || gf_isnan(b)) ? (a + b) : fmaxf(a, b);
#else
  return (gf_isnan(a) || gf_isnan(b)) ? (a + b) : (a < b ? b : a);
#endif
}
GF_HD float nan_min(float a, float b) {
#if defined(__CUDA_ARCH__)
  return (gf_isnan(a) || gf_isnan(b)) ? (a + b) : fminf(a, b);
#else
  return (gf_isnan(a) || gf_isnan(b)) ? (a + b) : (b < a ? b : a);
#endif
}

GF_HD float apply_unary(OpCode op, float x, const PointwiseParams& p) {
  switch (op) {
    case OpCode::Neg: return -x;
    case OpCode::Abs: return fabsf(x);
    case OpCode::Square: return x * x;
    case OpCode::Sqrt: return sqrtf(x);
    case OpCode::Rsqrt: return 1.0f / sqrtf(x);
    case OpCode::Exp: return expf(x);
    case OpCode::Log: return logf(x);
    case OpCode::Relu: return gf_isnan(x) ? x : (x > 0.f ? x : 0.f);
    case OpCode::Sigmoid: return 1.0f / (1.0f + expf(-x));
    case OpCode::Tanh: return tanhf(x);
    case OpCode::Silu: return x / (1.0f + expf(-x));
    case OpCode::Mish: {
      // x * tanh(softplus(x)) with tanh(log(1 + e^x)) = n / (n + 2), n = e^x (e^x + 2): one exp
      // and one division instead of exp, log1p and tanh (those three would bind m94's row
      // pass). Above x = 20 the factor is 1 to within 2^-57 (and e^2x would overflow).
      if (x > 20.f) return x;
      const float e = expf(x), n = e * (e + 2.f);
      return x * (n / (n + 2.f));
    }
    case OpCode::GeluErf: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
    case OpCode::GeluTanh: {
      const float k = 0.79788456080286535588f;  // sqrt(2/pi)
      return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
    }
    case OpCode::Softplus: return gf_softplus(x, p.beta, p.threshold);
    case OpCode::Elu: return x > 0.f ? x : p.alpha * expm1f(x);
    case OpCode::LeakyRelu: return x > 0.f ? x : x * p.alpha;
    case OpCode::Clamp: return gf_clamp(x, p.lo, p.hi);
    case OpCode::Pow:  // PyTorch special-cases these exponents
      if (p.alpha == 2.f) return x * x;
      if (p.alpha == 3.f) return x * x * x;
      if (p.alpha == 0.5f) return sqrtf(x);
      if (p.alpha == -0.5f) return 1.0f / sqrtf(x);
      if (p.alpha == -1.f) return 1.0f / x;
      if (p.alpha == -2.f) return 1.0f / (x * x);
      return powf(x, p.alpha);
    case OpCode::Reciprocal: return 1.0f / x;
    default: return x;  // not a unary op: the planner never emits this
  }
}

// x <op> b, or b <op> x when reversed.
GF_HD float apply_binary(OpCode op, float x, float b, bool reversed) {
  const float l = reversed ? b : x, r = reversed ? x : b;
  switch (op) {
    case OpCode::Add: return l + r;
    case OpCode::Sub: return l - r;
    case OpCode::Mul: return l * r;
    case OpCode::Div: return l / r;
    case OpCode::Minimum: return nan_min(l, r);
    case OpCode::Maximum: return nan_max(l, r);
    default: return l;
  }
}

// The shift PyTorch's logsumexp uses: the row max, or 0 when that max is +-inf.
GF_HD float lse_shift(float row_max) { return fabsf(row_max) == HUGE_VALF ? 0.f : row_max; }

}  // namespace gemmfuse

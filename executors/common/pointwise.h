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

// ---- the pointwise ops: forward and derivative, one struct per row of op_table.h ----------
// Unary: fwd(x) and bwd(x, y, g) = g dy/dx at x (y = fwd(x)), as PyTorch's derivative
// formulas compute them (torch/csrc/autograd/FunctionsManual.cpp and derivatives.yaml),
// including their values at 0, at the edges of clamp's range and for NaN.
// Binary (l <op> r): fwd(l, r) and bwd(l, r, g) -> {dl, dr}.
template <OpCode kOp>
struct Pointwise;

struct Grad2 {
  float l, r;
};

GF_HD float gf_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluTanhKappa = 0.044715f;

template <> struct Pointwise<OpCode::Neg> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return -x; }
  GF_HD static float bwd(float, float, float g, const PointwiseParams&) { return -g; }
};
template <> struct Pointwise<OpCode::Abs> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return fabsf(x); }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams&) {  // g sgn(x)
    return gf_isnan(x) ? x : (x > 0.f ? g : (x < 0.f ? -g : 0.f * g));
  }
};
template <> struct Pointwise<OpCode::Square> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return x * x; }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams&) { return g * (2.f * x); }
};
template <> struct Pointwise<OpCode::Sqrt> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return sqrtf(x); }
  GF_HD static float bwd(float, float y, float g, const PointwiseParams&) { return g / (2.f * y); }
};
template <> struct Pointwise<OpCode::Rsqrt> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return 1.0f / sqrtf(x); }
  GF_HD static float bwd(float, float y, float g, const PointwiseParams&) {
    return -0.5f * g * y * y * y;
  }
};
template <> struct Pointwise<OpCode::Exp> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return expf(x); }
  GF_HD static float bwd(float, float y, float g, const PointwiseParams&) { return g * y; }
};
template <> struct Pointwise<OpCode::Log> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return logf(x); }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams&) { return g / x; }
};
template <> struct Pointwise<OpCode::Relu> {
  GF_HD static float fwd(float x, const PointwiseParams&) {
    return gf_isnan(x) ? x : (x > 0.f ? x : 0.f);
  }
  GF_HD static float bwd(float, float y, float g, const PointwiseParams&) {  // threshold_backward
    return y <= 0.f ? 0.f : g;
  }
};
template <> struct Pointwise<OpCode::Sigmoid> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return gf_sigmoid(x); }
  GF_HD static float bwd(float, float y, float g, const PointwiseParams&) {
    return g * (1.f - y) * y;
  }
};
template <> struct Pointwise<OpCode::Tanh> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return tanhf(x); }
  GF_HD static float bwd(float, float y, float g, const PointwiseParams&) {
    return g * (1.f - y * y);
  }
};
template <> struct Pointwise<OpCode::Silu> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return x / (1.0f + expf(-x)); }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams&) {
    const float s = gf_sigmoid(x);
    return g * s * (1.f + x * (1.f - s));
  }
};
template <> struct Pointwise<OpCode::Mish> {
  // x tanh(softplus(x)) with tanh(log(1 + e^x)) = n / (n + 2), n = e^x (e^x + 2): one exp and
  // one division instead of exp, log1p and tanh (those three would bind m94's row pass). Above
  // x = 20 the factor is 1 to within 2^-57 (and e^2x would overflow).
  GF_HD static float fwd(float x, const PointwiseParams&) {
    if (x > 20.f) return x;
    const float e = expf(x), n = e * (e + 2.f);
    return x * (n / (n + 2.f));
  }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams&) {
    float t = 1.f;  // tanh(softplus(x))
    if (!(x > 20.f)) {
      const float e = expf(x), n = e * (e + 2.f);
      t = n / (n + 2.f);
    }
    return g * (t + x * gf_sigmoid(x) * (1.f - t * t));
  }
};
template <> struct Pointwise<OpCode::GeluErf> {
  GF_HD static float fwd(float x, const PointwiseParams&) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
  }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams&) {
    const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752440f));
    const float pdf = expf(-0.5f * x * x) * 0.39894228040143267794f;  // 1/sqrt(2 pi)
    return g * (cdf + x * pdf);
  }
};
template <> struct Pointwise<OpCode::GeluTanh> {
  GF_HD static float fwd(float x, const PointwiseParams&) {
    return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kGeluTanhKappa * x * x * x)));
  }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams&) {
    const float x2 = x * x, t = tanhf(kSqrt2OverPi * (x + kGeluTanhKappa * x2 * x));
    const float left = 0.5f * (1.f + t);
    const float right = 0.5f * x * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluTanhKappa * x2);
    return g * (left + right);
  }
};
template <> struct Pointwise<OpCode::Softplus> {
  GF_HD static float fwd(float x, const PointwiseParams& p) { return gf_softplus(x, p.beta, p.threshold); }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams& p) {
    const float z = expf(x * p.beta);
    return (x * p.beta) > p.threshold ? g : g * z / (z + 1.f);
  }
};
template <> struct Pointwise<OpCode::Elu> {
  GF_HD static float fwd(float x, const PointwiseParams& p) { return x > 0.f ? x : p.alpha * expm1f(x); }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams& p) {
    return x > 0.f ? g : g * p.alpha * expf(x);
  }
};
template <> struct Pointwise<OpCode::LeakyRelu> {
  GF_HD static float fwd(float x, const PointwiseParams& p) { return x > 0.f ? x : x * p.alpha; }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams& p) {
    return x > 0.f ? g : g * p.alpha;
  }
};
template <> struct Pointwise<OpCode::Clamp> {
  GF_HD static float fwd(float x, const PointwiseParams& p) { return gf_clamp(x, p.lo, p.hi); }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams& p) {  // clamp_backward
    return (x >= p.lo && x <= p.hi) ? g : 0.f;
  }
};
template <> struct Pointwise<OpCode::Pow> {
  GF_HD static float fwd(float x, const PointwiseParams& p) {  // PyTorch special-cases these
    if (p.alpha == 2.f) return x * x;
    if (p.alpha == 3.f) return x * x * x;
    if (p.alpha == 0.5f) return sqrtf(x);
    if (p.alpha == -0.5f) return 1.0f / sqrtf(x);
    if (p.alpha == -1.f) return 1.0f / x;
    if (p.alpha == -2.f) return 1.0f / (x * x);
    return powf(x, p.alpha);
  }
  GF_HD static float bwd(float x, float, float g, const PointwiseParams& p) {  // pow_backward
    if (p.alpha == 0.f) return 0.f;
    const PointwiseParams q{p.lo, p.hi, p.alpha - 1.f, p.beta, p.threshold};
    return g * (p.alpha * fwd(x, q));
  }
};
template <> struct Pointwise<OpCode::Reciprocal> {
  GF_HD static float fwd(float x, const PointwiseParams&) { return 1.0f / x; }
  GF_HD static float bwd(float, float y, float g, const PointwiseParams&) { return -g * y * y; }
};

template <> struct Pointwise<OpCode::Add> {
  GF_HD static float fwd(float l, float r) { return l + r; }
  GF_HD static Grad2 bwd(float, float, float g) { return {g, g}; }
};
template <> struct Pointwise<OpCode::Sub> {
  GF_HD static float fwd(float l, float r) { return l - r; }
  GF_HD static Grad2 bwd(float, float, float g) { return {g, -g}; }
};
template <> struct Pointwise<OpCode::Mul> {
  GF_HD static float fwd(float l, float r) { return l * r; }
  GF_HD static Grad2 bwd(float l, float r, float g) { return {g * r, g * l}; }
};
template <> struct Pointwise<OpCode::Div> {
  GF_HD static float fwd(float l, float r) { return l / r; }
  GF_HD static Grad2 bwd(float l, float r, float g) { return {g / r, -g * l / (r * r)}; }
};
// minimum/maximum: the gradient goes to the chosen side, split in two on a tie.
template <> struct Pointwise<OpCode::Minimum> {
  GF_HD static float fwd(float l, float r) { return nan_min(l, r); }
  GF_HD static Grad2 bwd(float l, float r, float g) {
    const float t = l == r ? 0.5f * g : g;
    return {l > r ? 0.f : t, l < r ? 0.f : t};
  }
};
template <> struct Pointwise<OpCode::Maximum> {
  GF_HD static float fwd(float l, float r) { return nan_max(l, r); }
  GF_HD static Grad2 bwd(float l, float r, float g) {
    const float t = l == r ? 0.5f * g : g;
    return {l < r ? 0.f : t, l > r ? 0.f : t};
  }
};

// Runtime dispatch over the table's rows. An op of another family never reaches these (the
// planner emits pointwise instructions for these families only); it gives NaN, not a silent
// identity.
GF_HD float apply_unary(OpCode op, float x, const PointwiseParams& p) {
  switch (op) {
#define GF_CASE(code, name, fam, scalar) \
  case OpCode::code: return Pointwise<OpCode::code>::fwd(x, p);
    GEMMFUSE_UNARY_OPS(GF_CASE)
#undef GF_CASE
    default: return NAN;
  }
}

GF_HD float unary_grad(OpCode op, float x, float y, float g, const PointwiseParams& p) {
  switch (op) {
#define GF_CASE(code, name, fam, scalar) \
  case OpCode::code: return Pointwise<OpCode::code>::bwd(x, y, g, p);
    GEMMFUSE_UNARY_OPS(GF_CASE)
#undef GF_CASE
    default: return NAN;
  }
}

// x <op> b, or b <op> x when reversed.
GF_HD float apply_binary(OpCode op, float x, float b, bool reversed) {
  const float l = reversed ? b : x, r = reversed ? x : b;
  switch (op) {
#define GF_CASE(code, name, fam, scalar) \
  case OpCode::code: return Pointwise<OpCode::code>::fwd(l, r);
    GEMMFUSE_BINARY_OPS(GF_CASE)
#undef GF_CASE
    default: return NAN;
  }
}

// The gradients of x <op> b (or b <op> x when reversed) with respect to x (.l) and b (.r);
// NaN for an op of another family.
GF_HD Grad2 binary_grad(OpCode op, float x, float b, bool reversed, float g) {
  const float l = reversed ? b : x, r = reversed ? x : b;
  Grad2 d{NAN, NAN};
  switch (op) {
#define GF_CASE(code, name, fam, scalar) \
  case OpCode::code: d = Pointwise<OpCode::code>::bwd(l, r, g); break;
    GEMMFUSE_BINARY_OPS(GF_CASE)
#undef GF_CASE
#define GF_OTHER_FAMILY(code, name, fam, scalar) case OpCode::code:
    GEMMFUSE_UNARY_OPS(GF_OTHER_FAMILY)
    GEMMFUSE_REDUCE_OPS(GF_OTHER_FAMILY)
    GEMMFUSE_ROW_NORM_OPS(GF_OTHER_FAMILY)
    GEMMFUSE_OTHER_OPS(GF_OTHER_FAMILY)
#undef GF_OTHER_FAMILY
      break;
  }
  return reversed ? Grad2{d.r, d.l} : d;
}

// The shift PyTorch's logsumexp uses: the row max, or 0 when that max is +-inf.
GF_HD float lse_shift(float row_max) { return fabsf(row_max) == HUGE_VALF ? 0.f : row_max; }

}  // namespace gemmfuse

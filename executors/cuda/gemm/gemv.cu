// Gemv: Y[m] = (x[m,:] . wsum + bsum) * scale (rows with inf/NaN inputs: gemv_nonfinite.h).
// Memory bound: x is read once with 16-byte loads (4 fp32 or 8 bf16/fp16 per load), 8 loads in
// flight per thread (a 32 KB row in one round trip for 256 threads). The products of one
// 16-byte vector are summed in fp32 (fma) and those partial sums in fp64: one fp64 conversion
// per vector instead of two per element (conversions to fp64 issue at 16/clk/SM on sm_90,
// which makes fp64 products compute-bound at ~2 TB/s), at ~1e-7 relative error.
// One CTA per row for long rows, one warp per row otherwise.
#include "gemv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>

#include "cuda_check.h"
#include "gemv_nonfinite.h"
#include "layout.h"
#include "plan_state.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kGemvThreads = 256;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ void store_as(void* out, int64_t i, float v);
template <>
__device__ __forceinline__ void store_as<float>(void* out, int64_t i, float v) {
  static_cast<float*>(out)[i] = v;
}
template <>
__device__ __forceinline__ void store_as<__nv_bfloat16>(void* out, int64_t i, float v) {
  static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ void store_as<__half>(void* out, int64_t i, float v) {
  static_cast<__half*>(out)[i] = __float2half_rn(v);
}

// Dot of one 16-byte vector of x (kVec elements) with wsum[c .. c+kVec), in fp32; `bad` notes
// a non-finite x.
template <class T>
__device__ __forceinline__ float dot_vec(const uint4& q, const float* __restrict__ w, bool& bad) {
  constexpr int kVec = 16 / sizeof(T);
  const T* xs = reinterpret_cast<const T*>(&q);
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < kVec; j += 4) {
    const float4 wv = __ldg(reinterpret_cast<const float4*>(w + j));
    const float x0 = to_f(xs[j]), x1 = to_f(xs[j + 1]), x2 = to_f(xs[j + 2]), x3 = to_f(xs[j + 3]);
    bad |= !(gf_isfinite(x0) && gf_isfinite(x1) && gf_isfinite(x2) && gf_isfinite(x3));
    acc = fmaf(x0, wv.x, acc);
    acc = fmaf(x1, wv.y, acc);
    acc = fmaf(x2, wv.z, acc);
    acc = fmaf(x3, wv.w, acc);
  }
  return acc;
}

// This thread's share (columns t, t + kTpr, ...) of row xr's dot with wsum, in fp64 over fp32
// vector dots; `bad` notes a non-finite x.
template <class T, int kTpr>
__device__ __forceinline__ double partial_dot(const T* __restrict__ xr, const float* __restrict__ wsum,
                                              int64_t K, int t, bool vec, bool& bad) {
  constexpr int kVec = 16 / sizeof(T);
  double acc = 0.0;
  if (!vec) {
    for (int64_t k = t; k < K; k += kTpr) {
      const float xk = to_f(xr[k]);
      bad |= !gf_isfinite(xk);
      acc = fma(static_cast<double>(xk), static_cast<double>(wsum[k]), acc);
    }
    return acc;
  }
  const uint4* xv = reinterpret_cast<const uint4*>(xr);
  const int64_t nv = K / kVec;
  int64_t i = t;
  constexpr int kInFlight = 8;  // independent 16-byte loads issued before any is used
  for (; i + (kInFlight - 1) * kTpr < nv; i += kInFlight * kTpr) {
    uint4 q[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) q[u] = __ldg(xv + i + u * kTpr);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      acc += static_cast<double>(dot_vec<T>(q[u], wsum + (i + u * kTpr) * kVec, bad));
  }
  for (; i < nv; i += kTpr) acc += static_cast<double>(dot_vec<T>(__ldg(xv + i), wsum + i * kVec, bad));
  return acc;
}

// The row's sum of its threads' partials (a warp's shuffles, then the CTA's warps in order).
template <int kTpr>
__device__ __forceinline__ double row_total(double acc, double* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (kTpr > 32) {
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
    __syncthreads();
    double s = 0.0;
    for (int i = 0; i < kTpr / 32; ++i) s += red[i];
    acc = s;
  }
  return acc;
}

// A row with an inf/NaN input: what the unrewritten Linear + sum gives (gemv_nonfinite.h),
// summed through shared memory (no shuffles in this branch); thread t == 0 holds it.
template <class T, int kTpr>
__device__ __forceinline__ float row_nonfinite(const T* __restrict__ xr, const float* __restrict__ colsign,
                                               int64_t K, int t, bool in_range, float* nf) {
  float nonfinite = 0.f;  // sums of infinities and NaNs: the outcome does not depend on the order
  if (in_range)
    for (int64_t k = t; k < K; k += kTpr) nonfinite += gemv_nonfinite_term(to_f(xr[k]), colsign[k]);
  nf[threadIdx.x] = nonfinite;
  if (kTpr > 32) __syncthreads(); else __syncwarp();
  if (t == 0)
    for (int i = 1; i < kTpr; ++i) nonfinite += nf[threadIdx.x + i];
  return nonfinite;
}

// kTpr threads per row (32: a warp; kGemvThreads: the CTA). out_f32: Y buffer, else the
// model's dtype T. A row with an inf/NaN input takes a second, rare pass (row_nonfinite).
template <class T, int kTpr>
__global__ void __launch_bounds__(kGemvThreads)
    gemv_kernel(const T* __restrict__ x, const float* __restrict__ wsum,
                const float* __restrict__ bsum, const float* __restrict__ colsign, int64_t M,
                int64_t K, double scale, void* __restrict__ out, bool out_f32, bool vec) {
  constexpr int kRows = kGemvThreads / kTpr;
  __shared__ double red[kGemvThreads / 32];
  __shared__ float nf[kGemvThreads];
  const int sub = threadIdx.x / kTpr, t = threadIdx.x % kTpr;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + sub;
  const T* xr = x + row * K;
  bool bad = false;
  const double acc = row_total<kTpr>(row < M ? partial_dot<T, kTpr>(xr, wsum, K, t, vec, bad) : 0.0, red);
  // Uniform over the row's threads (the CTA, or the warp).
  const bool row_bad = kTpr > 32 ? __syncthreads_or(bad) != 0 : __any_sync(0xffffffffu, bad);
  const float nonfinite = row_bad ? row_nonfinite<T, kTpr>(xr, colsign, K, t, row < M, nf) : 0.f;
  if (t == 0 && row < M) {
    const float y = row_bad ? static_cast<float>(nonfinite * scale)
                            : static_cast<float>((acc + static_cast<double>(*bsum)) * scale);
    if (out_f32) store_as<float>(out, row, y);
    else store_as<T>(out, row, y);
  }
}

template <class T>
void launch_typed(const void* x, const float* wsum, const float* bsum, const float* colsign,
                  int64_t M, int64_t K, double scale, void* out, bool out_f32,
                  cudaStream_t stream) {
  const bool vec = (K * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(wsum) % 16 == 0;
  const T* xt = static_cast<const T*>(x);
  if (K * static_cast<int64_t>(sizeof(T)) >= 8192) {
    gemv_kernel<T, kGemvThreads><<<static_cast<unsigned>(M), kGemvThreads, 0, stream>>>(
        xt, wsum, bsum, colsign, M, K, scale, out, out_f32, vec);
  } else {
    constexpr int kRows = kGemvThreads / 32;
    gemv_kernel<T, 32><<<static_cast<unsigned>((M + kRows - 1) / kRows), kGemvThreads, 0,
                         stream>>>(xt, wsum, bsum, colsign, M, K, scale, out, out_f32, vec);
  }
  GF_LAUNCH_CHECK();
}

}  // namespace

void launch_gemv(const Plan& plan, const Step& step, const RunArgs& args, const char* prepared,
                 char* workspace, cudaStream_t stream) {
  if (plan.M == 0) return;
  if (plan.M > 0x7fffffffLL) throw Unsupported("CUDA gemv: too many rows");
  const PreparedLayout L = plan_state(plan)->prepared;
  if (L.wsum == kAbsent || prepared == nullptr)
    throw std::logic_error("CUDA gemv: the plan has a Gemv step but no column sums prepared");
  const float* wsum = reinterpret_cast<const float*>(prepared + L.wsum);
  const float* bsum = reinterpret_cast<const float*>(prepared + L.bsum);
  const float* colsign = reinterpret_cast<const float*>(prepared + L.colsign);
  const double scale = step.node.op == OpCode::Mean ? 1.0 / static_cast<double>(plan.N) : 1.0;
  const bool out_f32 = step.output != kOutput || plan.dtype == DType::F32;
  void* out = step.output == kOutput ? args.out : workspace + plan.buffer_offset(step.output);
  switch (plan.dtype) {
    case DType::F32:
      launch_typed<float>(args.x, wsum, bsum, colsign, plan.M, plan.K, scale, out, out_f32,
                                 stream);
      break;
    case DType::BF16:
      launch_typed<__nv_bfloat16>(args.x, wsum, bsum, colsign, plan.M, plan.K, scale, out, out_f32,
                                 stream);
      break;
    case DType::F16:
      launch_typed<__half>(args.x, wsum, bsum, colsign, plan.M, plan.K, scale, out, out_f32,
                                 stream);
      break;
  }
}

}  // namespace gemmfuse::cuda

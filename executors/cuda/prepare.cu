// Weight preparation, once per weight version, on args.stream (layout: PreparedLayout).
//   fold_params: s[n] = gamma[n] / sqrt(running_var[n] + eps), b'[n] = (b[n] - running_mean[n]) s[n]
//                + beta[n] (fp64, rounded once), or the 16-bit bias converted to fp32
//   fold_w:      W'[n,k] = W[n,k] * s[n] in the model dtype          (Gemm without split)
//   w_split:     [W'hi | W'lo | W'hi] bf16 [N, 3 Kh] and W''s exceptional rows (fast, split.h)
//   w_parts:     W' as two scaled fp16 parts [2, N, K], its row exponents and exceptional rows
//                (fp32 on sm90, split.h)
//   colsum:      wsum[k] = sum_n W'[n,k] in fp64, rounded once, and the column signs
//                (executors/common/gemv_nonfinite.h)                   (Gemv)
//   bsum:        sum_n b'[n] in fp64, rounded once                    (Gemv)
#include "prepare.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "layout.h"
#include "plan_state.h"
#include "running_stats.h"
#include "split.h"

namespace gemmfuse::cuda {
namespace {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <class T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

unsigned grid_for(int64_t total, int threads) {
  return static_cast<unsigned>(std::clamp<int64_t>((total + threads - 1) / threads, 1, 132 * 32));
}

template <class T>
__global__ void fold_params_kernel(int64_t N, bool fold, const float* gamma, const float* beta,
                                   RunningStat rmean, RunningStat rvar, double eps,
                                   const T* bias, float* scale, float* bias_f32, T* bias_dt) {
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < N;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double b = bias ? static_cast<double>(to_f(bias[n])) : 0.0;
    double bf = b;
    if (fold) {
      const double s = (gamma ? static_cast<double>(gamma[n]) : 1.0) /
                       sqrt(load_stat(rvar, n) + eps);
      scale[n] = static_cast<float>(s);
      bf = (b - load_stat(rmean, n)) * s + (beta ? static_cast<double>(beta[n]) : 0.0);
    }
    if (bias_f32) bias_f32[n] = static_cast<float>(bf);
    if (bias_dt) bias_dt[n] = from_f<T>(static_cast<float>(bf));
  }
}

template <class T>
__global__ void fold_w_kernel(const T* __restrict__ w, const float* __restrict__ scale, int64_t N,
                              int64_t K, T* __restrict__ out) {
  const int64_t total = N * K;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(to_f(w[i]) * scale[i / K]);
}

// wsum[k] = sum_n W'[n,k], colsign[k] = +1 / -1 when every W'[n,k] is > 0 / < 0, else NaN
// (W' = W * s[n] when folded). CTA = 32 columns x 8 warps, warps stride over n.
template <class T>
__global__ void __launch_bounds__(256)
    colsum_kernel(const T* __restrict__ w, const float* __restrict__ scale, int64_t N, int64_t K,
                  float* __restrict__ wsum, float* __restrict__ colsign) {
  __shared__ double part[8][32];
  __shared__ int flags[8][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  double acc = 0.0;
  int pos = 1, neg = 1;
  if (k < K) {
#pragma unroll 4
    for (int64_t n = warp; n < N; n += 8) {
      float v = to_f(w[n * K + k]);
      if (scale) v *= scale[n];  // W' as the GEMM would see it (rounded once)
      acc += v;
      pos &= v > 0.f;
      neg &= v < 0.f;
    }
  }
  part[warp][lane] = acc;
  flags[warp][lane] = pos | (neg << 1);
  __syncthreads();
  if (warp == 0 && k < K) {
    double s = 0.0;
    int f = 3;
    for (int i = 0; i < 8; ++i) {
      s += part[i][lane];
      f &= flags[i][lane];
    }
    wsum[k] = static_cast<float>(s);
    colsign[k] = (f & 1) ? 1.f : (f & 2) ? -1.f : __int_as_float(0x7fc00000);
  }
}

// bsum = sum_n bias[n] (fp32 bias, may be nullptr: 0). One CTA, fixed order.
__global__ void __launch_bounds__(256) bsum_kernel(const float* __restrict__ bias, int64_t N,
                                                   float* __restrict__ bsum) {
  __shared__ double part[256];
  double acc = 0.0;
  if (bias)
    for (int64_t n = threadIdx.x; n < N; n += 256) acc += bias[n];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) *bsum = static_cast<float>(part[0]);
}

// Region `offset` of the prepared memory as an array of U.
template <class U>
U* region(char* prepared, size_t offset) {
  return reinterpret_cast<U*>(prepared + offset);
}
// The same, or nullptr where the layout has no such region.
template <class U>
U* optional_region(char* prepared, size_t offset) {
  return offset != kAbsent ? region<U>(prepared, offset) : nullptr;
}

// One preparation of a plan's weights: what each stage reads (W, the bias in the model dtype)
// and the folded parameters' regions (nullptr where the layout has none).
template <class T>
struct WeightPrep {
  const Plan& plan;
  const RunArgs& args;
  const PreparedLayout& L;
  char* prepared;
  cudaStream_t stream;
  const T* w;
  const T* bias;
  float* scale;
  float* bias_f32;
  T* bias_dt;
};

// fold_params: the folded BatchNorm's scale and the bias (folded, fp32, model dtype).
template <class T>
void fold_params(const WeightPrep<T>& p) {
  const int64_t N = p.plan.N;
  if (N <= 0 || !(p.scale || p.bias_f32 || p.bias_dt)) return;
  const bool fold = p.plan.prep.fold_batchnorm;
  const Node& bn = p.plan.prep.batchnorm;
  const float* gamma = nullptr;
  const float* beta = nullptr;
  RunningStat rm, rv;
  if (fold) {
    gamma = operand_ptr(bn.weight, p.args);
    beta = operand_ptr(bn.bias, p.args);
    rm = running_stat(p.args, bn.running_mean);
    rv = running_stat(p.args, bn.running_var);
    if (!rm || !rv)
      throw std::logic_error("CUDA prepare: folded batch_norm without running statistics");
  }
  fold_params_kernel<T><<<grid_for(N, 256), 256, 0, p.stream>>>(N, fold, gamma, beta, rm, rv,
                                                                bn.eps, p.bias, p.scale, p.bias_f32,
                                                                p.bias_dt);
  GF_LAUNCH_CHECK();
}

// fold_w: W' = W scaled per row.
template <class T>
void fold_weight(const WeightPrep<T>& p) {
  const int64_t N = p.plan.N, K = p.plan.K;
  if (p.L.w_folded == kAbsent || N * K <= 0) return;
  fold_w_kernel<T><<<grid_for(N * K, 256), 256, 0, p.stream>>>(
      p.w, p.scale, N, K, region<T>(p.prepared, p.L.w_folded));
  GF_LAUNCH_CHECK();
}

// w_split: W' as bf16 [hi | lo | hi] and its exceptional rows.
template <class T>
void split_weight_hilo(const WeightPrep<T>& p) {
  const PreparedLayout& L = p.L;
  if (L.w_split == kAbsent || p.plan.N <= 0) return;
  if (p.plan.dtype != DType::F32) throw std::logic_error("CUDA prepare: split of a 16-bit W");
  int* list = region<int>(p.prepared, L.w_list);
  GF_CUDA_CHECK(cudaMemsetAsync(list, 0, sizeof(int), p.stream));
  launch_split_hilo(reinterpret_cast<const float*>(p.w), p.scale, p.plan.N, p.plan.K, L.Kh,
                    HiLoOrder::HiLoHi, region<__nv_bfloat16>(p.prepared, L.w_split),
                    RowMarks{region<int>(p.prepared, L.w_flags), list}, p.stream);
}

// w_parts: W' as two scaled fp16 parts, their row exponents and exceptional rows. A W off a
// 16-byte boundary (a view with a storage offset) is not split: the GEMM then runs on SGEMM
// (gemm_cublas.cu checks the same pointer).
template <class T>
void split_weight_f16x2(const WeightPrep<T>& p) {
  const PreparedLayout& L = p.L;
  const T* wp = L.w_folded != kAbsent ? region<const T>(p.prepared, L.w_folded) : p.w;
  if (L.w_parts == kAbsent || !aligned16(wp)) return;
  if (p.plan.dtype != DType::F32) throw std::logic_error("CUDA prepare: fp16 split of a 16-bit W");
  int* list = region<int>(p.prepared, L.w_list);
  GF_CUDA_CHECK(cudaMemsetAsync(list, 0, sizeof(int), p.stream));
  launch_split_f16x2(reinterpret_cast<const float*>(wp), p.plan.N, p.plan.K,
                     region<__half>(p.prepared, L.w_parts), region<float>(p.prepared, L.w_exps),
                     RowMarks{region<int>(p.prepared, L.w_flags), list}, p.stream);
}

// colsum and bsum: W's column sums and signs, and the bias's sum (the Gemv's).
template <class T>
void sum_weight_columns(const WeightPrep<T>& p) {
  const PreparedLayout& L = p.L;
  if (L.wsum == kAbsent) return;
  const int64_t N = p.plan.N, K = p.plan.K;
  if (K > 0) {
    colsum_kernel<T><<<static_cast<unsigned>((K + 31) / 32), 256, 0, p.stream>>>(
        p.w, p.scale, N, K, region<float>(p.prepared, L.wsum), region<float>(p.prepared, L.colsign));
    GF_LAUNCH_CHECK();
  }
  const float* bias_as_float = reinterpret_cast<const float*>(p.bias);
  const float* bsrc = p.bias_f32 ? p.bias_f32 : (p.bias ? bias_as_float : nullptr);
  if (bsrc == bias_as_float && p.bias && p.plan.dtype != DType::F32)
    throw std::logic_error("CUDA prepare: 16-bit bias without its fp32 copy");
  bsum_kernel<<<1, 256, 0, p.stream>>>(bsrc, N, region<float>(p.prepared, L.bsum));
  GF_LAUNCH_CHECK();
}

// The stages in this order, on one stream: the later ones read what fold_params writes.
template <class T>
void prepare_typed(const Plan& plan, const RunArgs& args, char* prepared, cudaStream_t stream) {
  const PreparedLayout L = plan_state(plan)->prepared;
  const T* w = static_cast<const T*>(args.weight);
  const T* bias = plan.chain.has_bias ? static_cast<const T*>(args.bias) : nullptr;
  if (plan.chain.has_bias && !bias)
    throw std::invalid_argument("gemmfuse: the chain's Linear has a bias but none was passed");
  if (!w && plan.N * plan.K > 0) throw std::invalid_argument("gemmfuse: no weight passed");

  const WeightPrep<T> p{plan, args, L, prepared, stream, w, bias,
                        optional_region<float>(prepared, L.scale),
                        optional_region<float>(prepared, L.bias_f32),
                        optional_region<T>(prepared, L.bias_dt)};
  fold_params(p);
  fold_weight(p);
  split_weight_hilo(p);
  split_weight_f16x2(p);
  sum_weight_columns(p);
}

}  // namespace

const float* operand_ptr(const Operand& op, const RunArgs& args) {
  switch (op.kind) {
    case Operand::Kind::None: return nullptr;
    case Operand::Kind::Tensor:
      if (op.index < 0 || op.index >= static_cast<int>(args.operands.size()) || !args.operands[op.index])
        throw std::invalid_argument("gemmfuse: operand t" + std::to_string(op.index) + " missing");
      return args.operands[op.index];
    case Operand::Kind::State: {
      const RunningStat s = running_stat(args, op);
      if (s.type != DType::F32)
        throw std::logic_error("CUDA prepare: a 16-bit state tensor where fp32 is read");
      return static_cast<const float*>(s.p);
    }
    default:
      throw Unsupported("CUDA prepare: batch_norm parameters must be tensors");
  }
}

void prepare_weights(const Plan& plan, const RunArgs& args, char* prepared, cudaStream_t stream) {
  const PreparedLayout L = plan_state(plan)->prepared;
  if (L.total == 0) return;
  if (!prepared) throw std::invalid_argument("gemmfuse: prepare() without prepared memory");
  switch (plan.dtype) {
    case DType::F32: prepare_typed<float>(plan, args, prepared, stream); break;
    case DType::BF16: prepare_typed<__nv_bfloat16>(plan, args, prepared, stream); break;
    case DType::F16: prepare_typed<__half>(plan, args, prepared, stream); break;
  }
}

}  // namespace gemmfuse::cuda

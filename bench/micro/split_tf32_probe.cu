// Can fp32 mode run on tensor cores and stay as faithful as SGEMM? fp32 mode runs cuBLAS's
// SGEMM (2.68 ms at the seed shape, ~95% of every fp32 model's time). A split product on TF32
// tensor cores, x = xb + xs and W = Wb + Ws with each part exact in TF32 and
// Y = xb.Wb + xb.Ws + xs.Wb, does 3x the TF32 work (cuBLAS TF32: 0.387 ms) but through
// cuBLAS its error is bound by the tensor core's accumulator (seed-models.md: 1.9e-5 even for
// inputs exact in TF32, against SGEMM's 1.6e-6). CUTLASS's FP8 mainloop adds the tensor-core
// accumulator into fp32 registers every few k-steps ("promotion"); this probe runs it with
// TF32 operands on the K-concatenated split x' = [xb|xb|xs], W' = [Wb|Ws|Wb] (K' = 3K, so
// every promoted chunk holds one product's terms) and reports time and error against a
// float64 GEMM for several promotion intervals, next to SGEMM and cuBLAS TF32 in one process.
//   Built by CMake with -DGEMMFUSE_BUILD_PROBES=ON (target split_tf32_probe).
//   Run: split_tf32_probe [M N K]   (default 1024 8192 8192)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "probe_check.h"

using namespace cute;

// The builder's TF32 mainloop, re-dispatched to the FP8 mainloop (same tiles, copies and
// layouts; the consumer adds its tensor-core accumulator into a second one every
// mma_promotion_interval wgmma k-blocks).
template <class Built, class KernelSchedule>
using Promoting = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<Built::DispatchPolicy::Stages,
                                                         typename Built::DispatchPolicy::ClusterShape,
                                                         KernelSchedule>,
    typename Built::TileShape, typename Built::ElementA, typename Built::StrideA,
    typename Built::ElementB, typename Built::StrideB, typename Built::TiledMma,
    typename Built::GmemTiledCopyA, typename Built::SmemLayoutAtomA, typename Built::SmemCopyAtomA,
    typename Built::TransformA, typename Built::GmemTiledCopyB, typename Built::SmemLayoutAtomB,
    typename Built::SmemCopyAtomB, typename Built::TransformB>;

// D[M,N] (row-major, fp32) = x[M,K] . W[N,K]^T, both row-major fp32 read as TF32.
template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          bool kPromote>
struct TF32Gemm {
  using T = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 4;  // 16 bytes
  using Fusion = cutlass::epilogue::fusion::LinearCombination<T, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, T, LayoutD, kAlign, T,
      LayoutD, kAlign, EpilogueSchedule, Fusion>::CollectiveOp;
  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, LayoutA, kAlign, T, LayoutB,
      kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Mainloop = std::conditional_t<kPromote, Promoting<Built, KernelSchedule>, Built>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  Gemm gemm;
  void* workspace = nullptr;
  int interval = 4;

  typename Gemm::Arguments arguments(int M, int N, int K, const T* x, const T* w, T* d) const {
    using SA = typename Gemm::GemmKernel::StrideA;
    using SB = typename Gemm::GemmKernel::StrideB;
    using SC = typename Gemm::GemmKernel::StrideC;
    using SD = typename Gemm::GemmKernel::StrideD;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {x, cutlass::make_cute_packed_stride(SA{}, {M, K, 1}), w,
         cutlass::make_cute_packed_stride(SB{}, {N, K, 1})},
        {{}, d, cutlass::make_cute_packed_stride(SC{}, {M, N, 1}), d,
         cutlass::make_cute_packed_stride(SD{}, {M, N, 1})}};
    if constexpr (kPromote) args.mainloop.mma_promotion_interval = interval;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return args;
  }
  bool init(int M, int N, int K, const T* x, const T* w, T* d) {
    auto args = arguments(M, N, K, x, w, d);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    CHECK_CUDA(cudaMalloc(&workspace, std::max<size_t>(1, Gemm::get_workspace_size(args))));
    return gemm.initialize(args, workspace) == cutlass::Status::kSuccess;
  }
  bool run(int M, int N, int K, const T* x, const T* w, T* d) {
    if (gemm.initialize(arguments(M, N, K, x, w, d), workspace) != cutlass::Status::kSuccess)
      return false;
    return gemm.run() == cutlass::Status::kSuccess;
  }
};

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingEpi = cutlass::epilogue::TmaWarpSpecialized;

// Plain TF32 (no promotion): the speed of the tensor cores on one product.
using Plain256 = TF32Gemm<Shape<_128, _256, _32>, Shape<_2, _1, _1>, Coop, CoopEpi, false>;
using Plain128 = TF32Gemm<Shape<_128, _128, _32>, Shape<_2, _1, _1>, Coop, CoopEpi, false>;
// Promoting: two accumulators per thread, so a warpgroup holds at most 64x128 of each.
using Prom128 = TF32Gemm<Shape<_128, _128, _32>, Shape<_2, _1, _1>, Coop, CoopEpi, true>;
using Prom128N = TF32Gemm<Shape<_128, _128, _32>, Shape<_1, _2, _1>, Coop, CoopEpi, true>;
using PromPing = TF32Gemm<Shape<_64, _128, _32>, Shape<_2, _1, _1>, Ping, PingEpi, true>;

__global__ void fill(float* p, size_t n, unsigned seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned(i) ^ seed) * 2654435761u;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    unsigned g = (unsigned(i >> 32) + seed * 7919u) * 2246822519u;
    h ^= g;
    p[i] = lo + (hi - lo) * (h >> 8) * (1.0f / 16777216.0f);
  }
}

__global__ void widen(const float* s, double* d, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    d[i] = s[i];
}

// The split of one value: big = v with its low 13 mantissa bits cleared (TF32 by truncation,
// which cannot overflow), small = v - big (exact in fp32) rounded to TF32. A non-finite v
// keeps itself as big (a NaN made quiet, so the tensor core's truncation cannot turn it into
// an infinity) and 0 as small.
__device__ __forceinline__ float2 split_tf32(float v) {
  if (!isfinite(v)) return make_float2(isnan(v) ? __int_as_float(0x7fc00000) : v, 0.f);
  const float big = __uint_as_float(__float_as_uint(v) & 0xffffe000u);
  uint32_t small;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(small) : "f"(v - big));
  return make_float2(big, __uint_as_float(small));
}

// rows x K -> rows x 3K: [big | big | small] (a_side) or [big | small | big] (W side).
__global__ void split_concat(const float* s, float* d, int rows, int K, bool a_side) {
  const size_t n = size_t(rows) * K;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / K, k = i % K;
    const float2 p = split_tf32(s[i]);
    float* row = d + r * 3 * size_t(K);
    row[k] = p.x;
    row[K + k] = a_side ? p.x : p.y;
    row[2 * size_t(K) + k] = a_side ? p.y : p.x;
  }
}

// ||y - ref|| / ||ref|| and max |y - ref| (grid-stride partials, one atomic per block).
__global__ void error_sums(const float* y, const double* ref, size_t n, double* out) {
  double num = 0, den = 0, mx = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const double d = double(y[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    mx = fmax(mx, fabs(d));
  }
  for (int o = 16; o; o >>= 1) {
    num += __shfl_xor_sync(~0u, num, o);
    den += __shfl_xor_sync(~0u, den, o);
    mx = fmax(mx, __shfl_xor_sync(~0u, mx, o));
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(out, num);
    atomicAdd(out + 1, den);
    atomicMax(reinterpret_cast<unsigned long long*>(out + 2), __double_as_longlong(mx));
  }
}

int main(int argc, char** argv) {
  const int M = argc > 3 ? std::atoi(argv[1]) : 1024;
  const int N = argc > 3 ? std::atoi(argv[2]) : 8192;
  const int K = argc > 3 ? std::atoi(argv[3]) : 8192;
  constexpr int kSets = 3, kWarm = 5, kReps = 21;
  std::vector<float*> xs(kSets), xcat(kSets), ds(kSets);
  for (int s = 0; s < kSets; ++s) {
    CHECK_CUDA(cudaMalloc(&xs[s], size_t(M) * K * 4));
    CHECK_CUDA(cudaMalloc(&xcat[s], size_t(M) * K * 12));
    CHECK_CUDA(cudaMalloc(&ds[s], size_t(M) * N * 4));
    fill<<<1024, 256>>>(xs[s], size_t(M) * K, 17u + s, 0.f, 1.f);  // torch.rand
  }
  float *w, *wcat;
  CHECK_CUDA(cudaMalloc(&w, size_t(N) * K * 4));
  CHECK_CUDA(cudaMalloc(&wcat, size_t(N) * K * 12));
  const float bound = 1.0f / std::sqrt(float(K));  // nn.Linear's default init range
  fill<<<1024, 256>>>(w, size_t(N) * K, 99u, -bound, bound);
  split_concat<<<2048, 256>>>(w, wcat, N, K, false);

  // float64 reference of set 0.
  double *x64, *w64, *ref, *sums;
  CHECK_CUDA(cudaMalloc(&x64, size_t(M) * K * 8));
  CHECK_CUDA(cudaMalloc(&w64, size_t(N) * K * 8));
  CHECK_CUDA(cudaMalloc(&ref, size_t(M) * N * 8));
  CHECK_CUDA(cudaMalloc(&sums, 3 * 8));
  widen<<<1024, 256>>>(xs[0], x64, size_t(M) * K);
  widen<<<1024, 256>>>(w, w64, size_t(N) * K);
  cublasHandle_t h;
  cublasCreate(&h);
  {
    const double one = 1, zero = 0;
    cublasDgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w64, K, x64, K, &zero, ref, N);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaFree(x64));
  CHECK_CUDA(cudaFree(w64));

  const float one = 1.f, zero = 0.f;
  auto cublas = [&](int s, cublasComputeType_t ct) {
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_32F, K, xs[s], CUDA_R_32F,
                 K, &zero, ds[s], CUDA_R_32F, N, ct, CUBLAS_GEMM_DEFAULT);
  };
  auto split_x = [&](int s) { split_concat<<<2048, 256>>>(xs[s], xcat[s], M, K, true); };

  struct Variant {
    std::string name;
    std::function<void(int)> run;
  };
  std::vector<Variant> variants;
  variants.push_back({"cuBLAS SGEMM (fp32 mode today)", [&](int s) { cublas(s, CUBLAS_COMPUTE_32F_PEDANTIC); }});
  variants.push_back({"cuBLAS TF32, one product", [&](int s) { cublas(s, CUBLAS_COMPUTE_32F_FAST_TF32); }});
  variants.push_back({"cuBLAS TF32 on [xb|xb|xs].[Wb|Ws|Wb]", [&](int s) {
                        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, 3 * K, &one, wcat, CUDA_R_32F,
                                     3 * K, xcat[s], CUDA_R_32F, 3 * K, &zero, ds[s], CUDA_R_32F, N,
                                     CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
                      }});
  variants.push_back({"split of x alone (M x K -> M x 3K)", [&](int s) { split_x(s); }});

  static Plain256 plain256;
  static Plain128 plain128;
  static Prom128 prom[4];
  static Prom128N prom_n;
  static PromPing prom_ping;
  auto add = [&](auto& g, const std::string& name, int interval, bool concat) {
    g.interval = interval;
    const int k = concat ? 3 * K : K;
    const float* wsrc = concat ? wcat : w;
    if (!g.init(M, N, k, concat ? xcat[0] : xs[0], wsrc, ds[0])) {
      std::printf("%-46s cannot run\n", name.c_str());
      return;
    }
    variants.push_back({name, [&g, M, N, k, wsrc, concat, &xs, &xcat, &ds](int s) {
                          g.run(M, N, k, concat ? xcat[s] : xs[s], wsrc, ds[s]);
                        }});
  };
  add(plain256, "CUTLASS TF32 128x256x32, one product", 0, false);
  add(plain128, "CUTLASS TF32 128x128x32, one product", 0, false);
  add(plain128, "CUTLASS TF32 128x128x32 split, no promotion", 0, true);
  const int intervals[4] = {4, 8, 16, 64};
  for (int i = 0; i < 4; ++i)
    add(prom[i], "split, promoted every " + std::to_string(intervals[i] * 8) + " of K", intervals[i], true);
  add(prom_n, "split, promoted every 32, cluster 1x2", 4, true);
  add(prom_ping, "split, promoted every 32, ping-pong 64x128", 4, true);

  // Error of each variant on set 0 (x split first where needed), output poisoned before.
  std::printf("M=%d N=%d K=%d\n%-46s %10s %10s %10s\n", M, N, K, "variant", "ms", "rel", "max abs");
  for (int s = 0; s < kSets; ++s) split_x(s);
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (auto& v : variants) {
    const bool is_split = v.name.rfind("split of x", 0) == 0;
    CHECK_CUDA(cudaMemset(ds[0], 0xff, size_t(M) * N * 4));  // NaN
    v.run(0);
    CHECK_CUDA(cudaDeviceSynchronize());
    double host[3] = {0, 0, 0};
    if (!is_split) {
      CHECK_CUDA(cudaMemset(sums, 0, 3 * 8));
      error_sums<<<1024, 256>>>(ds[0], ref, size_t(M) * N, sums);
      CHECK_CUDA(cudaMemcpy(host, sums, 3 * 8, cudaMemcpyDeviceToHost));
    }
    std::vector<float> t;
    for (int r = 0; r < kWarm + kReps; ++r) {
      const int s = r % kSets;
      cudaEventRecord(e0);
      v.run(s);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      if (r >= kWarm) t.push_back(ms);
    }
    CHECK_CUDA(cudaGetLastError());
    std::sort(t.begin(), t.end());
    if (is_split)
      std::printf("%-46s %10.4f\n", v.name.c_str(), t[t.size() / 2]);
    else
      std::printf("%-46s %10.4f %10.3e %10.3e\n", v.name.c_str(), t[t.size() / 2],
                  std::sqrt(host[0] / host[1]), host[2]);
  }
  return 0;
}

// Can a CUTLASS Hopper GEMM match cuBLAS at the seed shape? The fused GEMM + softmax kernel
// for bf16 m99 pays only if its mainloop is as fast as cuBLAS's: eager bf16 m99 is cuBLAS
// (168 us) + gelu + softmax, and 1.2x over it leaves ~13 us beyond a cuBLAS-speed GEMM.
// This times, in one process, cuBLAS (the TN call PyTorch's F.linear makes, bf16 in and
// out, fp32 accumulation) against CUTLASS 3 sm90 kernels (TMA + wgmma, warp-specialized,
// persistent) built by CUTLASS's collective builders, and checks each CUTLASS result against
// cuBLAS's. One variant also runs the first part of m99's epilogue inside the kernel (bias +
// exact gelu, CUTLASS's fusion callbacks) to see what an epilogue with erf costs there.
//   Built by CMake with -DGEMMFUSE_BUILD_PROBES=ON (target cutlass_gemm_probe).
//   Run: cutlass_gemm_probe [M N K]   (default 1024 8192 8192)
//   GEMMFUSE_PROBE_ROUNDS=<n>: then every variant is also timed in n rounds as `gemmfuse bench`
//   times a model's variants (20 ms of warm-up, 20 calls timed one by one, order alternated).
//   GEMMFUSE_PROBE_ENERGY_S=<s>: then each variant also runs back to back for s seconds (after
//   1 s of its own), twice in opposite orders, with the GPU's energy per call from NVML. At
//   the power cap a kernel's sustained time follows its energy (docs/measurements.md).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "gemm_softmax.h"  // gemmfuse's fused sm90 kernel (executors/cuda/sm90)
#include "nvml_energy.h"
#include "probe_check.h"

using namespace cute;

// D[M,N] (row-major) = epilogue(x[M,K] (row-major) . W[N,K]^T) (W row-major = K x N
// column-major); the epilogue is D = acc, or gelu(acc + bias[n]) with kGeluBias.
// The builder's mainloop with its two consumer warpgroups split along N instead of M (each
// 128 x N/2, as two m64n128 wgmmas that each read their own copy of B: 96 KB of shared
// memory per 128x256x64 k-step against 80 KB along M).
template <class Built>
using SplitAlongN = cutlass::gemm::collective::CollectiveMma<
    typename Built::DispatchPolicy, typename Built::TileShape, typename Built::ElementA,
    typename Built::StrideA, typename Built::ElementB, typename Built::StrideB,
    decltype(cute::make_tiled_mma(
        cute::GMMA::ss_op_selector<typename Built::ElementA, typename Built::ElementB, float,
                                   Shape<decltype(get<0>(typename Built::TileShape{})),
                                         decltype(get<1>(typename Built::TileShape{}) / _2{}),
                                         decltype(get<2>(typename Built::TileShape{}))>,
                                   cute::GMMA::Major::K, cute::GMMA::Major::K>(),
        Layout<Shape<_1, _2, _1>>{})),
    typename Built::GmemTiledCopyA, typename Built::SmemLayoutAtomA, typename Built::SmemCopyAtomA,
    typename Built::TransformA, typename Built::GmemTiledCopyB, typename Built::SmemLayoutAtomB,
    typename Built::SmemCopyAtomB, typename Built::TransformB>;

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          bool kGeluBias = false, int kStages = 0,  // 0: as many stages as fit
          bool kSplitN = false,                     // consumer warpgroups along N (SplitAlongN)
          bool kSwapAB = false>  // D^T = W x^T, as cuBLAS's TN call (its tile's M along W's rows)
struct CutlassGemm {
  using T = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlign = 8;  // 16 bytes of bf16
  using Fusion = std::conditional_t<
      kGeluBias,
      cutlass::epilogue::fusion::LinCombPerColBiasEltAct<cutlass::epilogue::thread::GELU, T, float>,
      cutlass::epilogue::fusion::LinearCombination<T, float>>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, T, LayoutD, kAlign, T,
      LayoutD, kAlign, EpilogueSchedule, Fusion>::CollectiveOp;
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, LayoutA, kAlign, T, LayoutB,
      kAlign, float, TileShape, ClusterShape,
      std::conditional_t<kStages == 0,
                         cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
                             sizeof(typename Epilogue::SharedStorage))>,
                         cutlass::gemm::collective::StageCount<kStages>>,
      KernelSchedule>::CollectiveOp;
  using Mainloop = std::conditional_t<kSplitN, SplitAlongN<BuiltMainloop>, BuiltMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  Gemm gemm;
  void* workspace = nullptr;
  const T* bias = nullptr;

  typename Gemm::Arguments arguments(int M, int N, int K, const T* x, const T* w, T* d) const {
    if constexpr (kSwapAB) {  // the GEMM's M is W's rows, its N x's rows; D column-major
      std::swap(M, N);
      std::swap(x, w);
    }
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
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    if constexpr (kGeluBias) args.epilogue.thread.bias_ptr = bias;
    return args;
  }
  bool init(int M, int N, int K, const T* x, const T* w, T* d) {
    auto args = arguments(M, N, K, x, w, d);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    CHECK_CUDA(cudaMalloc(&workspace, std::max<size_t>(1, Gemm::get_workspace_size(args))));
    return gemm.initialize(args, workspace) == cutlass::Status::kSuccess;
  }
  // Re-point A and D (rotated inputs); the same shape, so the same workspace.
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

using V1 = CutlassGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi>;
using V2 = CutlassGemm<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, CoopEpi>;
using V3 = CutlassGemm<Shape<_64, _256, _64>, Shape<_1, _2, _1>, Ping, PingEpi>;
using V4 = CutlassGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi, true>;
// The fused kernel's mainloop alone: 3 stages (the rest of its shared memory holds a tile).
using V5 = CutlassGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi, false, 3>;
// Ping-pong with 128x128 tiles per warpgroup: would a kernel that hides each tile's epilogue
// behind the other warpgroup's mainloop keep cuBLAS's mainloop speed?
using V6 = CutlassGemm<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, PingEpi>;
using V7 = CutlassGemm<Shape<_128, _128, _64>, Shape<_1, _2, _1>, Ping, PingEpi>;
// The shared memory left beside a 3-tile stash holds 3 stages of 128x128x64 (or 6 of x32).
using V8 = CutlassGemm<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, PingEpi, false, 3>;
using V9 = CutlassGemm<Shape<_128, _128, _32>, Shape<_2, _1, _1>, Ping, PingEpi, false, 6>;
// Two of four 128x128 tiles stashed in shared memory (the other two held in registers) leave
// room for 4 stages; 5 would not fit.
using V10 = CutlassGemm<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, PingEpi, false, 4>;
using V11 = CutlassGemm<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, PingEpi, false, 5>;
// The consumer warpgroups split along N against along M, 3 stages as in the fused kernel;
// both with the register-direct epilogue (the TMA epilogue's partition assumes warpgroups
// along M).
using NoSmemEpi = cutlass::epilogue::NoSmemWarpSpecialized;
using V12 = CutlassGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, NoSmemEpi, false, 3, true>;
using V13 = CutlassGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, NoSmemEpi, false, 3, false>;
// cuBLAS's choice for F.linear at the seed shape (nsys/ncu name:
// nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT): D^T = W x^T with 256 (W rows) x 128
// (x rows) tiles, 4 stages, clusters of 2 along x's rows. It spends ~4% less energy per call
// than V1 under sustained load (docs/measurements.md): is it the orientation?
using V14 = CutlassGemm<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, CoopEpi, false, 4, false, true>;
using V15 = CutlassGemm<Shape<_256, _128, _64>, Shape<_2, _1, _1>, Coop, CoopEpi, false, 4, false, true>;
using V16 = CutlassGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi, false, 4, false, true>;

// The reference for V4: gelu(y + bias) from cuBLAS's bf16 y (so it carries one more bf16
// rounding than V4's, which applies the epilogue to the fp32 accumulator).
__global__ void gelu_bias_ref(__nv_bfloat16* y, const __nv_bfloat16* bias, size_t n, int N) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = __bfloat162float(y[i]) + __bfloat162float(bias[i % N]);
    y[i] = __float2bfloat16(0.5f * v * (1.f + erff(v * 0.70710678f)));
  }
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = (unsigned(i) ^ seed) * 2654435761u;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(lo + (hi - lo) * (h >> 8) * (1.0f / 16777216.0f));
  }
}

int main(int argc, char** argv) {
  const int M = argc > 3 ? std::atoi(argv[1]) : 1024;
  const int N = argc > 3 ? std::atoi(argv[2]) : 8192;
  const int K = argc > 3 ? std::atoi(argv[3]) : 8192;
  constexpr int kSets = 3, kWarm = 10, kReps = 51;
  using T = cutlass::bfloat16_t;
  std::vector<__nv_bfloat16*> xs(kSets), ds(kSets);
  __nv_bfloat16 *w, *ref;
  for (int s = 0; s < kSets; ++s) {
    CHECK_CUDA(cudaMalloc(&xs[s], size_t(M) * K * 2));
    CHECK_CUDA(cudaMalloc(&ds[s], size_t(M) * N * 2));
    fill<<<1024, 256>>>(xs[s], size_t(M) * K, 17u + s, 0.f, 1.f);  // torch.rand
  }
  CHECK_CUDA(cudaMalloc(&w, size_t(N) * K * 2));
  CHECK_CUDA(cudaMalloc(&ref, size_t(M) * N * 2));
  __nv_bfloat16 *bias, *ref_gelu;
  CHECK_CUDA(cudaMalloc(&bias, size_t(N) * 2));
  CHECK_CUDA(cudaMalloc(&ref_gelu, size_t(M) * N * 2));
  const float bound = 1.0f / std::sqrt(float(K));  // nn.Linear's default init range
  fill<<<1024, 256>>>(w, size_t(N) * K, 99u, -bound, bound);
  fill<<<64, 256>>>(bias, size_t(N), 7u, -bound, bound);

  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1.f, zero = 0.f;
  auto cublas = [&](int s) {
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, xs[s],
                 CUDA_R_16BF, K, &zero, ds[s], CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                 CUBLAS_GEMM_DEFAULT);
  };
  cublas(0);
  CHECK_CUDA(cudaMemcpy(ref, ds[0], size_t(M) * N * 2, cudaMemcpyDeviceToDevice));
  CHECK_CUDA(cudaMemcpy(ref_gelu, ds[0], size_t(M) * N * 2, cudaMemcpyDeviceToDevice));
  gelu_bias_ref<<<1024, 256>>>(ref_gelu, bias, size_t(M) * N, N);
  std::vector<__nv_bfloat16> href(size_t(M) * N), hgelu(size_t(M) * N), hout(size_t(M) * N);
  CHECK_CUDA(cudaMemcpy(href.data(), ref, href.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hgelu.data(), ref_gelu, hgelu.size() * 2, cudaMemcpyDeviceToHost));

  struct Variant {
    std::string name;
    std::function<bool(int)> call;
    const std::vector<__nv_bfloat16>* expect;
  };
  std::vector<Variant> vs{
      {"cuBLAS (F.linear's TN call)", [&](int s) { cublas(s); return true; }, &href}};
  V1 v1; V2 v2; V3 v3; V4 v4; V5 v5; V6 v6; V7 v7; V8 v8; V9 v9; V10 v10; V11 v11; V12 v12; V13 v13;
  V14 v14; V15 v15; V16 v16;
  std::printf("CUTLASS auto stage counts: coop 128x256x64 %d, pingpong 128x128x64 %d\n", int(V1::Mainloop::DispatchPolicy::Stages), int(V6::Mainloop::DispatchPolicy::Stages));
  v4.bias = reinterpret_cast<const T*>(bias);
  auto add = [&](auto& g, const char* name, const std::vector<__nv_bfloat16>* expect) {
    if (!g.init(M, N, K, (T*)xs[0], (T*)w, (T*)ds[0])) {
      std::printf("%-58s cannot run this shape\n", name);
      return;
    }
    vs.push_back({name, [&g, &xs, &ds, w, M, N, K](int s) {
                    return g.run(M, N, K, (T*)xs[s], (T*)w, (T*)ds[s]);
                  }, expect});
  };
  add(v1, "CUTLASS coop 128x256x64, cluster 2x1", &href);
  add(v2, "CUTLASS coop 256x128x64, cluster 1x2", &href);
  add(v3, "CUTLASS pingpong 64x256x64, cluster 1x2", &href);
  add(v4, "CUTLASS coop 128x256x64 + bias + gelu(erf) epilogue", &hgelu);
  add(v5, "CUTLASS coop 128x256x64, cluster 2x1, 3 stages", &href);
  add(v6, "CUTLASS pingpong 128x128x64, cluster 2x1", &href);
  add(v7, "CUTLASS pingpong 128x128x64, cluster 1x2", &href);
  add(v8, "CUTLASS pingpong 128x128x64, cluster 2x1, 3 stages", &href);
  add(v9, "CUTLASS pingpong 128x128x32, cluster 2x1, 6 stages", &href);
  add(v10, "CUTLASS pingpong 128x128x64, cluster 2x1, 4 stages", &href);
  add(v11, "CUTLASS pingpong 128x128x64, cluster 2x1, 5 stages", &href);
  add(v12, "CUTLASS coop 128x256x64, 2x1, 3 st., no-smem epi., warpgroups along N", &href);
  add(v13, "CUTLASS coop 128x256x64, 2x1, 3 st., no-smem epi., warpgroups along M", &href);
  add(v14, "CUTLASS W x^T coop 256x128x64, cluster 1x2, 4 st.", &href);
  add(v15, "CUTLASS W x^T coop 256x128x64, cluster 2x1, 4 st.", &href);
  add(v16, "CUTLASS W x^T coop 128x256x64, cluster 2x1, 4 st.", &href);

  // gemmfuse's fused kernel: softmax(gelu(x W^T + b)) (bf16 out), timed only here; the
  // GPU tests check its results.
  float* bias32;
  CHECK_CUDA(cudaMalloc(&bias32, size_t(N) * 4));
  CHECK_CUDA(cudaMemset(bias32, 0, size_t(N) * 4));
  void* fused_ws;
  CHECK_CUDA(cudaMalloc(&fused_ws, gemmfuse::cuda::sm90::gemm_softmax_workspace_bytes(M, N)));
  // The seed shape's tiles fit on chip wherever the kernel fits at all (the kernel selection
  // decides per shape: executors/cuda/selection.h).
  if (gemmfuse::cuda::sm90::gemm_softmax_max_clusters(gemmfuse::DType::BF16) > 0) {
    vs.push_back({"gemmfuse fused gemm+bias+gelu+softmax (sm90)", [&, M, N, K](int s) {
                    gemmfuse::cuda::sm90::GemmSoftmaxProblem p;
                    p.M = M; p.N = N; p.K = K;
                    p.x = xs[s]; p.w = w; p.bias = bias32; p.out = ds[s];
                    p.act = gemmfuse::cuda::sm90::Activation::GeluErf;
                    return gemmfuse::cuda::sm90::launch_gemm_softmax(p, fused_ws, nullptr);
                  }, nullptr});
    // The same calls replayed from CUDA graphs, one per input set and rotated like the
    // direct calls (no host work between calls, and the same L2 traffic), and one graph of
    // input set 1 replayed every time (its x may stay in L2).
    std::vector<cudaGraphExec_t> graph_exec(kSets);
    {
      cudaStream_t cs;
      CHECK_CUDA(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
      for (int set = 0; set < kSets; ++set) {
        cudaGraph_t g;
        CHECK_CUDA(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
        gemmfuse::cuda::sm90::GemmSoftmaxProblem p;
        p.M = M; p.N = N; p.K = K;
        p.x = xs[set]; p.w = w; p.bias = bias32; p.out = ds[set];
        p.act = gemmfuse::cuda::sm90::Activation::GeluErf;
        if (!gemmfuse::cuda::sm90::launch_gemm_softmax(p, fused_ws, cs)) return 1;
        CHECK_CUDA(cudaStreamEndCapture(cs, &g));
        CHECK_CUDA(cudaGraphInstantiate(&graph_exec[set], g, 0));
      }
    }
    // (The lambdas copy the handles: they outlive this block.)
    vs.push_back({"  the same calls replayed from CUDA graphs", [graph_exec](int s) {
                    CHECK_CUDA(cudaGraphLaunch(graph_exec[s], nullptr));
                    return true;
                  }, nullptr});
    vs.push_back({"  one input set's graph replayed every call", [graph_exec](int) {
                    CHECK_CUDA(cudaGraphLaunch(graph_exec[1], nullptr));
                    return true;
                  }, nullptr});
    // Three traced runs back to back: where the time goes inside the fused kernel (phases
    // per CTA, the SM clock over them) and between two launches; with gelu and without (the
    // epilogue's share), and with the first epilogue run before the second mainloop.
    namespace sm = gemmfuse::cuda::sm90;
    auto traced = [&](sm::Activation act, bool defer, bool evict_first, const char* label, bool per_cta = false) {
      const int ctas = 256, reps = 3, slots = sm::kGemmSoftmaxTraceSlots;
      unsigned long long* trace;
      CHECK_CUDA(cudaMalloc(&trace, reps * ctas * slots * sizeof(unsigned long long)));
      CHECK_CUDA(cudaMemset(trace, 0, reps * ctas * slots * sizeof(unsigned long long)));
      for (int rep = 0; rep < reps; ++rep) {
        sm::GemmSoftmaxProblem p;
        p.M = M; p.N = N; p.K = K;
        p.x = xs[rep]; p.w = w; p.bias = bias32; p.out = ds[rep];
        p.act = act;
        p.defer_epilogues = defer;
        p.w_evict_first = evict_first;
        p.trace = trace + rep * ctas * slots;
        if (!sm::launch_gemm_softmax(p, fused_ws, nullptr)) return;
      }
      CHECK_CUDA(cudaDeviceSynchronize());
      std::printf("%s\n", label);
      std::vector<unsigned long long> all(reps * ctas * slots);
      CHECK_CUDA(cudaMemcpy(all.data(), trace, all.size() * 8, cudaMemcpyDeviceToHost));
      const std::pair<int, const char*> phases[] = {
          {sm::kTraceEntry, "entry"}, {sm::kTraceFirstStage1, "  1st stage 1"},
          {sm::kTraceMainloop1, "mainloop 1"}, {sm::kTraceEpilogue1, "epilogue 1"},
          {sm::kTraceFirstStage2, "  1st stage 2"}, {sm::kTraceMainloop2, "mainloop 2"},
          {sm::kTraceLastSync, "  last sync"}, {sm::kTraceLastPrepare, "  last prepare"},
          {sm::kTraceEpilogue2, "epilogue 2"}, {sm::kTraceBarrier, "row stats in"},
          {sm::kTraceMergeMath, "  merge math"},
          {sm::kTraceMerge, "row merge"}, {sm::kTraceStores, "stores issued"}};
      // SM clock: clock64 cycles per %globaltimer ns between two phase ends.
      const struct { int t0, t1, c0, c1; const char* name; } clocks[] = {
          {sm::kTraceEntry, sm::kTraceMainloop1, sm::kTraceClockEntry, sm::kTraceClockMainloop1, "mainloop 1"},
          {sm::kTraceMainloop1, sm::kTraceMainloop2, sm::kTraceClockMainloop1, sm::kTraceClockMainloop2,
           "epilogue 1 + mainloop 2"},
          {sm::kTraceMainloop2, sm::kTraceEpilogue2, sm::kTraceClockMainloop2, sm::kTraceClockEpilogue2,
           "epilogue 2"},
          {sm::kTraceEpilogue2, sm::kTraceBarrier, sm::kTraceClockEpilogue2, sm::kTraceClockBarrier,
           "row stats wait"},
          {sm::kTraceBarrier, sm::kTraceStores, sm::kTraceClockBarrier, sm::kTraceClockStores,
           "merge + stores"}};
      unsigned long long prev_end = 0;
      for (int rep = 0; rep < reps; ++rep) {
        const unsigned long long* tr = all.data() + rep * ctas * slots;
        auto at = [&](int c, int k) { return tr[c * slots + k]; };
        unsigned long long t0 = ~0ull, t_end = 0;
        int used = 0;
        for (int c = 0; c < ctas; ++c)
          if (at(c, sm::kTraceEntry)) {
            t0 = std::min(t0, at(c, sm::kTraceEntry));
            t_end = std::max(t_end, at(c, sm::kTraceStores));
            ++used;
          }
        std::printf("fused run %d: %d CTAs, first entry to last store %.1f us, gap after the previous run's last store %.1f us\n",
                    rep, used, (t_end - t0) * 1e-3,
                    prev_end ? (static_cast<double>(t0) - static_cast<double>(prev_end)) * 1e-3 : 0.0);
        prev_end = t_end;
        if (rep != reps - 1) continue;
        std::printf("  phase end, us from the first entry: min / median / max over CTAs\n");
        for (const auto& [k, name] : phases) {
          std::vector<double> v;
          for (int c = 0; c < ctas; ++c)
            if (at(c, sm::kTraceEntry) && at(c, k)) v.push_back((at(c, k) - t0) * 1e-3);
          if (v.empty()) continue;
          std::sort(v.begin(), v.end());
          std::printf("  %-14s %8.1f %8.1f %8.1f\n", name, v.front(), v[v.size() / 2], v.back());
        }
        for (const auto& ck : clocks) {
          std::vector<double> ghz;
          for (int c = 0; c < ctas; ++c) {
            const double ns = static_cast<double>(at(c, ck.t1)) - static_cast<double>(at(c, ck.t0));
            if (at(c, sm::kTraceEntry) && at(c, ck.c0) && at(c, ck.c1) && ns > 0)
              ghz.push_back(static_cast<double>(at(c, ck.c1) - at(c, ck.c0)) / ns);
          }
          if (ghz.empty()) continue;
          std::sort(ghz.begin(), ghz.end());
          std::printf("  SM clock over %-24s %.3f / %.3f / %.3f GHz (min / median / max over CTAs)\n",
                      ck.name, ghz.front(), ghz[ghz.size() / 2], ghz.back());
        }
        if (!per_cta) continue;  // is the clock a property of the SM?
        std::vector<int> cs;
        for (int c = 0; c < ctas; ++c)
          if (at(c, sm::kTraceEntry)) cs.push_back(c);
        std::sort(cs.begin(), cs.end(), [&](int a, int b) { return at(a, sm::kTraceSmId) < at(b, sm::kTraceSmId); });
        std::printf("  per CTA, by SM: sm cta mainloop-1-GHz mainloop-2-end-us epilogue-2-end-us\n");
        for (int c : cs) {
          const double ns = static_cast<double>(at(c, sm::kTraceMainloop1) - at(c, sm::kTraceEntry));
          std::printf("  sm %3llu cta %3d %.3f %.1f %.1f\n", at(c, sm::kTraceSmId), c,
                      (at(c, sm::kTraceClockMainloop1) - at(c, sm::kTraceClockEntry)) / ns,
                      (at(c, sm::kTraceMainloop2) - t0) * 1e-3, (at(c, sm::kTraceEpilogue2) - t0) * 1e-3);
        }
      }
      CHECK_CUDA(cudaFree(trace));
    };
    traced(sm::Activation::GeluErf, true, true, "fused kernel, gelu + softmax:", true);
    traced(sm::Activation::GeluErf, true, false, "fused kernel, gelu + softmax, W loads not evict-first:");
    traced(sm::Activation::GeluErf, false, true, "fused kernel, gelu + softmax, epilogues not deferred:");
    traced(sm::Activation::GeluErf, false, false, "fused kernel, gelu + softmax, neither:");
    traced(sm::Activation::Identity, true, true, "fused kernel, softmax only:");
    traced(sm::Activation::GeluErf, true, true, "fused kernel, gelu + softmax (again, per SM):", true);

  } else {
    std::printf("gemmfuse fused kernel: does not fit on this GPU\n");
  }

  // Correctness: every variant's set-0 output against cuBLAS's (poisoned first).
  for (size_t i = 1; i < vs.size(); ++i) {
    if (!vs[i].expect) continue;
    CHECK_CUDA(cudaMemset(ds[0], 0xff, size_t(M) * N * 2));  // NaN poison
    if (!vs[i].call(0)) { std::printf("%s: run failed\n", vs[i].name.c_str()); return 1; }
    CHECK_CUDA(cudaMemcpy(hout.data(), ds[0], hout.size() * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0, worst = 0;
    for (size_t j = 0; j < hout.size(); ++j) {
      const double a = __bfloat162float(hout[j]), b = __bfloat162float((*vs[i].expect)[j]);
      const double d = std::isnan(a) ? 1e30 : a - b;
      num += d * d; den += b * b; worst = std::max(worst, std::fabs(d));
    }
    std::printf("check %-52s rel diff vs reference %.2e, max abs %.2e\n", vs[i].name.c_str(),
                std::sqrt(num / den), worst);
  }

  // Timing: interleaved rounds (variant order rotated); each sample is kBatch back-to-back
  // calls between two CUDA events (no idle GPU between calls), inputs rotated.
  constexpr int kBatch = 5;
  const double flops = 2.0 * M * N * K;
  std::vector<std::vector<float>> ms(vs.size());
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int it = 0; it < kWarm + kReps; ++it) {
    for (size_t i = 0; i < vs.size(); ++i) {
      const size_t v = (i + it) % vs.size();
      cudaEventRecord(a);
      for (int j = 0; j < kBatch; ++j) vs[v].call((it * kBatch + j) % kSets);
      cudaEventRecord(b);
      CHECK_CUDA(cudaEventSynchronize(b));
      float t;
      cudaEventElapsedTime(&t, a, b);
      if (it >= kWarm) ms[v].push_back(t / kBatch);
    }
  }
  std::printf("\nM=%d N=%d K=%d bf16 in/out, fp32 accumulation; median of %d batches of %d calls, "
              "%d input sets\n", M, N, K, kReps, kBatch, kSets);
  auto median = [](std::vector<float> t) { std::sort(t.begin(), t.end()); return t[t.size() / 2]; };
  const double base = median(ms[0]);
  std::vector<double> burst_ms(vs.size());
  for (size_t v = 0; v < vs.size(); ++v) {
    const double med = burst_ms[v] = median(ms[v]);
    std::printf("%-48s %8.1f us  %6.1f TFLOP/s  %.3fx cuBLAS time\n", vs[v].name.c_str(), med * 1e3,
                flops / (med * 1e-3) / 1e12, med / base);
  }

  // Rounds as `gemmfuse bench` times them (GEMMFUSE_PROBE_ROUNDS=<n>): per variant and round,
  // at least 20 ms of untimed calls, then 20 calls each between its own two events; the
  // variants in turn, reversed in odd rounds. The chip's power state then sits between the
  // bursts above (5 calls, below the power cap) and the sustained windows below (at it).
  if (const char* rounds_env = std::getenv("GEMMFUSE_PROBE_ROUNDS")) {
    const int rounds = std::max(1, std::atoi(rounds_env));
    constexpr int kTimed = 20;
    constexpr double kWarmMs = 20;
    std::vector<cudaEvent_t> ev(2 * kTimed);
    for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
    std::vector<std::vector<float>> all(vs.size());
    std::vector<std::vector<double>> round_med(vs.size());
    for (int r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < vs.size(); ++i) {
        const size_t v = r % 2 ? vs.size() - 1 - i : i;
        const int warm = std::max(3, static_cast<int>(std::ceil(kWarmMs / burst_ms[v])));
        for (int j = 0; j < warm; ++j) vs[v].call(j % kSets);
        CHECK_CUDA(cudaDeviceSynchronize());
        for (int j = 0; j < kTimed; ++j) {
          cudaEventRecord(ev[2 * j]);
          vs[v].call(j % kSets);
          cudaEventRecord(ev[2 * j + 1]);
        }
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<float> t(kTimed);
        for (int j = 0; j < kTimed; ++j) cudaEventElapsedTime(&t[j], ev[2 * j], ev[2 * j + 1]);
        all[v].insert(all[v].end(), t.begin(), t.end());
        round_med[v].push_back(median(t));
      }
    }
    const double rbase = median(all[0]);
    std::printf("\nbench-like rounds: %d, each variant >= %.0f ms of untimed calls then %d calls timed "
                "one by one, order reversed in odd rounds; median over all timed calls\n", rounds,
                kWarmMs, kTimed);
    for (size_t v = 0; v < vs.size(); ++v) {
      const double med = median(all[v]);
      std::printf("%-48s %8.1f us  %.3fx cuBLAS time  rounds:", vs[v].name.c_str(), med * 1e3, med / rbase);
      for (double x : round_med[v]) std::printf(" %.1f", x * 1e3);
      std::printf("\n");
    }
    for (auto& e : ev) cudaEventDestroy(e);
  }

  // Sustained load: each variant alone for `seconds`, calls queued at most kBatch deep.
  const char* energy_s = std::getenv("GEMMFUSE_PROBE_ENERGY_S");
  const NvmlEnergy nvml;
  if (energy_s && !nvml.ok()) std::printf("\nno NVML energy counter here\n");
  if (energy_s && nvml.ok()) {
    const double seconds = std::atof(energy_s);
    auto window = [&](size_t v, double s, double* mj, double* mhz) {
      CHECK_CUDA(cudaDeviceSynchronize());
      const double e0 = nvml.energy_mj();
      double clock_sum = 0;
      int calls = 0, clock_n = 0;
      cudaEventRecord(a);
      const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(s);
      while (std::chrono::steady_clock::now() < end) {
        for (int j = 0; j < kBatch; ++j, ++calls) vs[v].call(calls % kSets);
        cudaEventRecord(b);
        CHECK_CUDA(cudaEventSynchronize(b));
        if (calls % 50 == 0) clock_sum += nvml.sm_mhz(), ++clock_n;
      }
      float t;
      cudaEventElapsedTime(&t, a, b);
      *mj = (nvml.energy_mj() - e0) / calls;
      *mhz = clock_n ? clock_sum / clock_n : NAN;
      return t / calls;
    };
    std::printf("\nsustained: %.1f s per variant after 1 s of its own, two passes (second reversed)\n"
                "%-48s %9s %9s %7s %8s   (second pass)\n", seconds, "variant", "us/call", "mJ/call",
                "W", "SM MHz");
    std::vector<std::vector<double>> row(vs.size());
    for (int pass = 0; pass < 2; ++pass)
      for (size_t i = 0; i < vs.size(); ++i) {
        const size_t v = pass == 0 ? i : vs.size() - 1 - i;
        double mj, mhz;
        window(v, 1.0, &mj, &mhz);
        const double ms_call = window(v, seconds, &mj, &mhz);
        for (double x : {ms_call * 1e3, mj, mj / ms_call, mhz}) row[v].push_back(x);
      }
    for (size_t v = 0; v < vs.size(); ++v)
      std::printf("%-48s %9.1f %9.2f %7.1f %8.0f   %9.1f %9.2f %7.1f %8.0f\n", vs[v].name.c_str(),
                  row[v][0], row[v][1], row[v][2], row[v][3], row[v][4], row[v][5], row[v][6], row[v][7]);
  }
  return 0;
}

// The fused Linear -> [gelu] -> [scalar] -> softmax kernel for Hopper (see gemm_softmax.h).
//
// Layering as in CUTLASS: the mainloop is CUTLASS's sm90 TMA + wgmma warp-specialized
// collective (a producer warp streams 128x64 x-tiles and 256x64 W-tiles through a 3-stage
// shared-memory pipeline, two consumer warpgroups issue wgmma into 128x256 fp32
// accumulators), its load and mma loops written out in mainloop.h so that W's loads carry an
// L2 hint and a tile's epilogue can run between the next tile's k-steps; this file is the
// kernel around it: the tile schedule, the softmax epilogues and the merge of row
// statistics. The epilogues know the accumulator only as (value, row, column) triples,
// through CuTe's identity-tensor partition.
//
// Epilogues (DeferredTile): right after tile 1's mainloop only its bias, row extremes and
// exp references are computed and its values parked (half in shared memory, half in
// registers); gelu, exp and the fp16 stash run between tile 2's k-steps, hidden under the
// tensor cores' work. The last tile's epilogue runs alone, in the same compact rounds.
// tile_epilogue (the whole epilogue, unrolled) takes the cases DeferredTile leaves out.
//
// Schedule: clusters of 2 CTAs along M share each W tile (TMA multicast). A CTA covers 128
// rows and tpc (1 or 2) adjacent 256-column tiles, computed one after the other; the grid is
// (2 m_pairs) x n_groups CTAs, CTA (x, y) taking m-block x and column group y. The CTAs' first
// tiles run together and cover every other column tile, so x rows and W columns are shared
// through L2 as in a plain GEMM. Covering two tiles of the same rows halves the row partials
// each CTA publishes and reads (one per 512 columns).
//
// Shared memory per CTA (bf16/fp16 operands):
//   pipeline   3 x (128x64 + 256x64) x 2 B = 144 KiB; after the last mainloop it holds the
//              last tile's stash
//   stash      128 x 264 fp16 = 66 KiB: the first tile's exp(v - tile row max) while the
//              second tile's mainloop runs (rows padded by 8 halves: conflict-free writes);
//              DeferredTile parks half of the tile's fp32 values in it until then
#include "gemm_softmax.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "cuda_check.h"
#include "pointwise.h"
#include "row_stats_buffers.h"

#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#include "cute/tensor.hpp"
#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/pipeline/pipeline.hpp"

#include "mainloop.h"
#endif

namespace gemmfuse::cuda::sm90 {

namespace {

constexpr int kTileM = 128, kTileN = 256, kTileK = 64;
constexpr int kClusterM = 2;       // CTAs per cluster (along M)
constexpr int kMaxTilesPerCta = 2;  // the on-chip stash holds two tiles per CTA
constexpr int kThreads = 384;      // producer warpgroup + two consumer warpgroups
constexpr int kConsumers = 256;
constexpr int kStashStride = kTileN + 8;  // halves per stash row

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// The row statistics: two 64-bit words per (column group, row), n_groups <= n_tiles.
size_t row_stats_bytes(int64_t M, int64_t N) {
  const size_t b = 2 * sizeof(unsigned long long) * static_cast<size_t>(ceil_div(N, kTileN)) * M;
  return (b + 255) / 256 * 256;
}

}  // namespace

size_t gemm_softmax_workspace_bytes(int64_t M, int64_t N) { return row_stats_bytes(M, N); }

#if defined(GEMMFUSE_WITH_SM90_KERNELS)

using namespace cute;

}  // namespace gemmfuse::cuda::sm90

// The kernel's parts: types and shared helpers, the tile epilogues, the tail.
#include "gemm_softmax_device.cuh"
#include "gemm_softmax_epilogue.cuh"
#include "gemm_softmax_tail.cuh"

namespace gemmfuse::cuda::sm90 {
namespace {

// The producer warp: TMA loads of each of this CTA's n_work tiles, then the pipeline's tail.
template <class K, class Pipeline, class Tiles, class Problem>
__device__ __forceinline__ void produce_tiles(const typename K::Params& p, Pipeline& pipeline,
                                              Tiles& tiles, int n_work, const Problem& problem) {
  using Mainloop = typename K::Mainloop;
  Mainloop mainloop;
  auto inputs = mainloop.load_init(problem, p.mainloop);
  auto state = cutlass::make_producer_start_state<Pipeline>();
  // W is read once per column group (its CTAs run together) and streams through L2:
  // evict-first, so that x and this kernel's code stay there (see mainloop.h).
  const auto hint_w = p.w_evict_first ? cute::TMA::CacheHintSm90::EVICT_FIRST
                                      : cute::TMA::CacheHintSm90::EVICT_NORMAL;
  for (int j = 0; j < n_work; ++j) {
    const TileCoord t = tile_of(p, j);
    produce_tile<Mainloop>(p.mainloop, pipeline, state, inputs, t.m_blk, t.n_blk, p.k_tiles,
                           cute::block_rank_in_cluster(), tiles,
                           cute::TMA::CacheHintSm90::EVICT_NORMAL, hint_w);
  }
  mainloop.load_tail(pipeline, state);
}

// This CTA's row statistics over its tiles, for the other CTAs of its rows; then theirs,
// merged 16 at a time (the max and the rescaled sum as trees, not one dependent merge per
// part); then exp(tile max - row max) / row sum for each of this CTA's tiles (S.row_scale).
template <class K>
__device__ __forceinline__ void row_scales(const typename K::Params& p, typename K::SharedStorage& S,
                                           int ctid, int n_work) {
  const int row0 = tile_of(p, 0).m_blk * kTileM;
  if (ctid < kTileM && row0 + ctid < p.M) {
    const int row = row0 + ctid;
    float m = -HUGE_VALF, s = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxTilesPerCta; ++j)  // a static bound: no unrolled copies of a runtime loop
      if (j < n_work) merge_stats(m, s, S.tile_max[j][ctid], S.tile_sum[j][ctid]);
    publish_row_stats(p, static_cast<size_t>(group_of(p)) * p.M + row, m, s);
    m = -HUGE_VALF;
    s = 0.f;
    for (int g0 = 0; g0 < p.n_groups; g0 += 16) {
      float2 q[16];
      read_row_stats(p, row, g0, q);
      if (g0 == 0) {
        stamp(p.trace, ctid, kTraceBarrier, q[15].y);
        stamp_clock(p.trace, ctid, kTraceClockBarrier);
      }
      float mc = q[0].x;
#pragma unroll
      for (int k = 1; k < 16; ++k) mc = fmaxf(mc, q[k].x);
      float sc = 0.f;
#pragma unroll
      for (int k = 0; k < 16; ++k) sc += q[k].y * exp_from(q[k].x, mc);
      merge_stats(m, s, mc, sc);
    }
    stamp(p.trace, ctid, kTraceMergeMath, s);
    const float inv_s = __frcp_rn(s);
#pragma unroll
    for (int j = 0; j < kMaxTilesPerCta; ++j)
      if (j < n_work) S.row_scale[j][ctid] = exp_from(S.tile_max[j][ctid], m) * inv_s;
  }
}

// The consumer warpgroups: each tile's mainloop and epilogue (or its deferred parts), the
// tiles' exponent sums and maxima left in S. `last_stash`: where the last tile's stash goes
// (over the pipeline's tiles).
template <class K, class Pipeline, class Tiles>
__device__ __forceinline__ void consume_tiles(const typename K::Params& p, Pipeline& pipeline,
                                              typename K::SharedStorage& S, Tiles& tiles, int ctid,
                                              int n_work, __half* last_stash) {
  using Mainloop = typename K::Mainloop;
  typename K::TiledMma tiled_mma;
  auto thr = tiled_mma.get_slice(ctid);
  Tensor coord = thr.partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
  typename Mainloop::PipelineState state;
  for (int j = 0; j < n_work; ++j) {  // the bias of every tile, read in the epilogues
    const int col = tile_of(p, j).n_blk * kTileN + ctid;
    S.bias[j][ctid] = p.bias != nullptr && col < p.N ? p.bias[col] : 0.f;
  }
  static_assert(kTileN == kConsumers, "one bias column per consumer thread");
  consumer_sync();
  Tensor acc = partition_fragment_C(tiled_mma, take<0, 2>(typename K::TileShape{}));
  auto first_stage = [&](int slot) { return [&p, ctid, slot]() { stamp(p.trace, ctid, slot); }; };
  // One loop over the tiles, so that each piece of epilogue code exists once and its second
  // run finds it in the instruction cache (code run once per launch is fetched from memory
  // while every CTA waits on it; see DeferredTile). Tile j's mainloop finishes tile j-1's
  // deferred epilogue between its k-steps (nothing to do for j = 0, or when not deferred).
  const bool defer = defers_epilogues(p);
  static_assert(kMaxTilesPerCta == 2, "the deferred epilogues cover at most two tiles per CTA");
  using D = DeferredTile<K>;
  D d;
#pragma unroll 1
  for (int j = 0; j < n_work; ++j) {
    consume_tile<Mainloop, D::kRounds, D::kStepsPerRound>(
        pipeline, state, acc, p.k_tiles, ctid, tiles, [&](int u) { d.step(p, u, coord, S.stash); },
        first_stage(j == 0 ? kTraceFirstStage1 : kTraceFirstStage2));
    if (j > 0) d.finish(coord, S.tile_sum[j - 1]);
    // The next kernel of the stream may be launched now (its CTAs take SMs as this grid's
    // exit and wait for its completion before touching memory).
    if (j == n_work - 1) cutlass::arch::launch_dependent_grids();
    stamp(p.trace, ctid, j == 0 ? kTraceMainloop1 : kTraceMainloop2);
    stamp_clock(p.trace, ctid, j == 0 ? kTraceClockMainloop1 : kTraceClockMainloop2);
    // The last tile's stash reuses the pipeline's tiles, so both warpgroups must be done
    // reading them (their final TMA writes landed before the waits that preceded these
    // wgmmas).
    const bool last = j == n_work - 1;
    __half* stash = last ? last_stash : S.stash;
    if (last) {
      consumer_sync();
      stamp(p.trace, ctid, kTraceLastSync);
    }
    // Deferred: only the prepare now, the rest under the next mainloop or (last) below.
    if (defer) d.prepare(p, acc, coord, tile_of(p, j), S.bias[j], stash, S.tile_max[j]);
    if (!d.pending) tile_epilogue<K>(p, acc, coord, tile_of(p, j), j, S, stash, defer);
    stamp(p.trace, ctid, last ? kTraceLastPrepare : kTraceEpilogue1);
  }
  d.run_alone(p, coord, last_stash);
  d.finish(coord, S.tile_sum[n_work - 1]);
  stamp(p.trace, ctid, kTraceEpilogue2);
  stamp_clock(p.trace, ctid, kTraceClockEpilogue2);
}

template <class K>
__global__ void __launch_bounds__(kThreads, 1) gemm_softmax_kernel(const __grid_constant__ typename K::Params p) {
  using Mainloop = typename K::Mainloop;
  using Pipeline = typename K::Pipeline;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& S = *reinterpret_cast<typename K::SharedStorage*>(smem_raw);
  auto& tiles = *reinterpret_cast<typename Mainloop::TensorStorage*>(S.tiles);

  stamp(p.trace, threadIdx.x, kTraceEntry);
  stamp_clock(p.trace, threadIdx.x, kTraceClockEntry);
  stamp_sm(p.trace, threadIdx.x);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int lane = cutlass::canonical_lane_idx();
  if (warp == 0 && lane == 0) Mainloop::prefetch_tma_descriptors(p.mainloop);

  typename Pipeline::Params pp;
  if (warpgroup == 0 && warp == 0) pp.role = Pipeline::ThreadCategory::Producer;
  if (warpgroup > 0) pp.role = Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0;
  pp.num_consumers = kConsumers;
  pp.transaction_bytes = p.mainloop.tma_transaction_bytes;
  Pipeline pipeline(S.pipeline, pp, typename K::ClusterShape{});
  // The pipeline's barriers must be initialised in both CTAs before either uses them.
  cute::cluster_arrive_relaxed();
  cute::cluster_wait();
  // Launched with programmatic stream serialization, this CTA may run while the previous
  // kernel of the stream finishes: everything above touched only this CTA's shared memory
  // (and, in traced runs, its own trace slots); from here on global memory is read and
  // written, so that kernel must be complete (and its writes visible). A no-op for other
  // launches.
  cutlass::arch::wait_on_dependent_grids();

  const int n_work = min(p.tpc, p.n_tiles - p.tpc * group_of(p));
  auto problem = make_shape(p.M, p.N, p.K, 1);

  if (warpgroup == 0) {  // producer: one warp issues the TMA loads
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == 0) produce_tiles<K>(p, pipeline, tiles, n_work, problem);
    return;  // (load_tail: the peer CTA's consumers are done with this CTA's barriers)
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int ctid = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
  __half* last_stash = reinterpret_cast<__half*>(S.tiles);
  consume_tiles<K>(p, pipeline, S, tiles, ctid, n_work, last_stash);

  consumer_sync();
  row_scales<K>(p, S, ctid, n_work);
  consumer_sync();
  stamp(p.trace, ctid, kTraceMerge);
  for (int j = 0; j < n_work; ++j)
    store_tile<K>(p, j == n_work - 1 ? last_stash : S.stash, S.row_scale[j], tile_of(p, j), ctid);
  stamp(p.trace, ctid, kTraceStores);
  stamp_clock(p.trace, ctid, kTraceClockStores);
}

struct Fit {
  int max_clusters = 0;  // clusters of kClusterM CTAs the device holds at once (0: unusable)
  int sms = 0;
  bool mps = false;      // contexts on the device are shared through MPS
};

template <class K>
void set_smem_attribute() {
  GF_CUDA_CHECK(cudaFuncSetAttribute(gemm_softmax_kernel<K>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(sizeof(typename K::SharedStorage))));
}

// The launch configuration of m_pairs x n_groups clusters (see tile_of): attrs[0] is the
// cluster shape (numAttrs 1); launch() adds the cooperative or the programmatic flag as attrs[1].
template <class K>
cudaLaunchConfig_t launch_config(int m_pairs, int n_groups, cudaStream_t stream,
                                 cudaLaunchAttribute (&attrs)[2]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kClusterM * m_pairs, n_groups, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = sizeof(typename K::SharedStorage);
  cfg.stream = stream;
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = kClusterM;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = 1;
  return cfg;
}

template <class K>
int max_active_clusters() {
  set_smem_attribute<K>();
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = launch_config<K>(64, 1, nullptr, attrs);
  int n = 0;
  GF_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, gemm_softmax_kernel<K>, &cfg));
  return n;
}

const Fit& device_fit(DType dtype) {
  static std::mutex mu;
  static std::unordered_map<int, Fit> fits;  // key: device * 2 + (dtype == F16)
  int dev = 0;
  GF_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  const int key = dev * 2 + (dtype == DType::F16 ? 1 : 0);
  auto it = fits.find(key);
  if (it != fits.end()) return it->second;
  Fit f;
  cudaDeviceProp prop;
  GF_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  f.sms = prop.multiProcessorCount;
  int mps = 0;
  GF_CUDA_CHECK(cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, dev));
  f.mps = mps != 0;
  if (prop.major == 9 && prop.minor == 0)
    f.max_clusters = dtype == DType::F16 ? max_active_clusters<Kernel<cutlass::half_t>>()
                                         : max_active_clusters<Kernel<cutlass::bfloat16_t>>();
  return fits.emplace(key, f).first->second;
}

// Column tiles per CTA: 1 when a cluster per (m-block pair, column tile) fits on the GPU at
// once, else kMaxTilesPerCta (0: the problem does not fit).
int tiles_per_cta(int64_t M, int64_t N, int max_clusters) {
  const int64_t m_pairs = ceil_div(ceil_div(M, kTileM), kClusterM), n_tiles = ceil_div(N, kTileN);
  if (m_pairs * n_tiles <= max_clusters) return 1;
  if (m_pairs * ceil_div(n_tiles, kMaxTilesPerCta) <= max_clusters) return kMaxTilesPerCta;
  return 0;
}

// The stream of a direct launch: its device and id (ids are never reused).
struct StreamKey {
  int dev = 0;
  unsigned long long id = 0;
};

// Programmatic launches (below) are not cooperative, so nothing in the driver keeps two of
// them from sharing the GPU, each with part of its CTAs resident and waiting for the rest.
// Within a stream they are ordered; across streams a launch waits for the device's last
// programmatic launch when that was on another stream (one event per device, recorded
// after each). Only a stream switch costs a wait. (Replays of captured launches, which are
// cooperative, are outside this order.)
class LaunchOrder {
 public:
  static LaunchOrder& of_device(int dev) {
    static std::mutex mu;
    static std::map<int, LaunchOrder> orders;
    std::lock_guard<std::mutex> lock(mu);
    return orders[dev];
  }
  // Enqueues launch() on the stream `id` after the last launch when that was on another
  // stream, and marks it as the last.
  template <class Launch>
  void run(cudaStream_t stream, unsigned long long id, Launch&& launch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (event_ == nullptr) GF_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    if (any_ && id != last_id_) GF_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
    launch();
    GF_CUDA_CHECK(cudaEventRecord(event_, stream));
    last_id_ = id;
    any_ = true;
  }

 private:
  std::mutex mu_;
  cudaEvent_t event_ = nullptr;
  unsigned long long last_id_ = 0;
  bool any_ = false;
};

template <class K>
bool launch(const GemmSoftmaxProblem& pr, void* workspace, cudaStream_t stream, const Fit& fit) {
  using Mainloop = typename K::Mainloop;
  using T = typename K::Element;
  typename K::Params p;
  p.M = static_cast<int>(pr.M);
  p.N = static_cast<int>(pr.N);
  p.K = static_cast<int>(pr.K);
  p.n_tiles = ceil_div(pr.N, kTileN);
  p.k_tiles = ceil_div(pr.K, kTileK);
  p.m_pairs = ceil_div(ceil_div(pr.M, kTileM), kClusterM);
  p.tpc = tiles_per_cta(pr.M, pr.N, fit.max_clusters);
  p.n_groups = ceil_div(p.n_tiles, p.tpc);
  typename Mainloop::Arguments args{
      static_cast<const T*>(pr.x), cute::make_stride(int64_t(pr.K), Int<1>{}, int64_t(pr.M * pr.K)),
      static_cast<const T*>(pr.w), cute::make_stride(int64_t(pr.K), Int<1>{}, int64_t(pr.N * pr.K))};
  p.mainloop = Mainloop::to_underlying_arguments(make_shape(p.M, p.N, p.K, 1), args, nullptr);
  p.bias = pr.bias;
  p.out = pr.out;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  GF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool captured = capture != cudaStreamCaptureStatusNone;
  StreamKey key;
  if (!captured) {
    GF_CUDA_CHECK(cudaGetDevice(&key.dev));
    GF_CUDA_CHECK(cudaStreamGetId(stream, &key.id));
  }
  // Where the CTAs exchange row statistics, and the epoch that marks this launch's words
  // (see publish_row_stats): a direct launch uses its stream's buffer (row_stats_buffers.h);
  // a launch captured into a graph is replayed with the epoch it was captured with, so it
  // uses the graph's workspace, cleared before it in the graph (replays run one at a time).
  std::optional<RowStatsLease> lease;
  if (captured) {
    GF_CUDA_CHECK(cudaMemsetAsync(workspace, 0, row_stats_bytes(pr.M, pr.N), stream));
    p.row_stats = static_cast<unsigned long long*>(workspace);
    p.epoch = 1;
  } else {
    lease.emplace(stream, key.dev, key.id, row_stats_bytes(pr.M, pr.N));
    p.row_stats = lease->stats().words;
    p.epoch = lease->stats().epoch;
  }
  p.act = static_cast<int>(pr.act);
  p.scale = pr.scale;
  p.trace = pr.trace;
  p.defer = pr.defer_epilogues;
  p.w_evict_first = pr.w_evict_first;

  // How every CTA is made resident at once (each waits for the statistics of the others
  // of its rows). A direct launch: programmatic (PDL), so that it starts as the stream's
  // previous kernel ends (docs/measurements.md, "The fused softmax kernel"); the grid
  // fits on the idle GPU (tiles_per_cta), and other kernels on the GPU finish in time. Under
  // MPS, other processes' kernels may hold SMs for good, and a launch captured into a graph
  // replays at times this code does not see: there, cooperative (the driver refuses a grid
  // the GPU cannot hold, and serializes the launch; no programmatic overlap).
  const bool programmatic = pr.programmatic && !captured && !fit.mps;
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t cfg = launch_config<K>(p.m_pairs, p.n_groups, stream, attrs);
  cfg.numAttrs = 2;
  if (programmatic) {
    attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[1].val.programmaticStreamSerializationAllowed = 1;
    LaunchOrder::of_device(key.dev).run(stream, key.id, [&] {
      GF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemm_softmax_kernel<K>, p));
    });
    return true;
  }
  attrs[1].id = cudaLaunchAttributeCooperative;
  attrs[1].val.cooperative = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, gemm_softmax_kernel<K>, p);
  if (e == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // not sticky: the caller runs the plan step by step instead
    return false;
  }
  GF_CUDA_CHECK(e);
  return true;
}

}  // namespace

bool gemm_softmax_built() { return true; }

int gemm_softmax_max_clusters(DType dtype) { return device_fit(dtype).max_clusters; }

bool launch_gemm_softmax(const GemmSoftmaxProblem& p, void* workspace, cudaStream_t stream) {
  // The selection checked the problem; only what the launch itself relies on is re-checked.
  const Fit& fit = device_fit(p.dtype);
  if (fit.max_clusters == 0 || tiles_per_cta(p.M, p.N, fit.max_clusters) == 0)
    throw std::logic_error("gemm_softmax: launched for a problem that does not fit (the selection's)");
  if (p.dtype == DType::F16) return launch<Kernel<cutlass::half_t>>(p, workspace, stream, fit);
  return launch<Kernel<cutlass::bfloat16_t>>(p, workspace, stream, fit);
}

#else  // built without the sm90 kernels (no CUTLASS headers)

bool gemm_softmax_built() { return false; }

int gemm_softmax_max_clusters(DType) { return 0; }
bool launch_gemm_softmax(const GemmSoftmaxProblem&, void*, cudaStream_t) {
  throw std::logic_error("gemm_softmax: built without the sm90 kernels");
}

#endif

}  // namespace gemmfuse::cuda::sm90

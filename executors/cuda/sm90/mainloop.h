// Both sides of one tile's mainloop for CUTLASS's sm90 TMA + wgmma warp-specialized
// collective (SS: both operands from shared memory), written out so the kernel can add to
// them. They issue what the collective's load() and mma() + mma_tail() issue, with:
// - produce_tile: an L2 eviction hint per operand. The fused softmax kernel streams W
//   (128 MB at the seed shape) through a 50 MB L2 once: marked evict-first, it does not
//   push out x (and, likely, the kernel's code, whose once-per-launch parts run
//   fetch-bound), which shortens every call (docs/measurements.md, "The fused softmax
//   kernel").
// - consume_tile: one k-step's wgmma batch in flight, each stage released to the producer
//   once the batch after it is issued. After each of the first kRounds * kStepsPerRound
//   steady k-steps, while that step's batch runs on the tensor cores, `between(u)` runs
//   with u the step's place in its round. The rounds are a loop and the steps of a round
//   are unrolled, so the hook may index register arrays with u. The hook runs for every
//   step of every round even where k_tiles (>= 1) has fewer k-steps. The fused softmax
//   kernel finishes a tile's epilogue there, under the next tile's mainloop.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace gemmfuse::cuda::sm90 {

// Where a CTA's TMA loads of a tile go, as CUTLASS's sm90 collectives place them: the CTA's
// (m, n) in the cluster, which picks its slices of the A and B copies (A split along the
// cluster's N, B along its M), and the CTAs each load lands in (A multicast along N, B along
// M, where the copy is the multicast one).
template <class ClusterShape, class GmemTiledCopyA, class GmemTiledCopyB>
struct ClusterLoads {
  uint32_t block_x = 0, block_y = 0;
  uint16_t mcast_a = 0, mcast_b = 0;
  CUTLASS_DEVICE explicit ClusterLoads(uint32_t block_rank_in_cluster) {
    using namespace cute;
    constexpr uint32_t cluster_x = get<0>(ClusterShape{});
    block_x = block_rank_in_cluster % cluster_x;
    block_y = block_rank_in_cluster / cluster_x;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>)
      for (int n = 0; n < size<1>(block_layout); ++n) mcast_a |= uint16_t(1) << block_layout(block_x, n, Int<0>{});
    if constexpr (is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>)
      for (int m = 0; m < size<0>(block_layout); ++m) mcast_b |= uint16_t(1) << block_layout(m, block_y, Int<0>{});
  }
};

// The producer warp's loads of one tile (m_blk, n_blk): k_tiles stages from `write` on,
// which every lane leaves k_tiles stages later. One elected lane issues them; x tiles are
// multicast along the cluster's N and W tiles along its M, as in the collective.
template <class Mainloop, class Inputs>
__device__ __forceinline__ void produce_tile(const typename Mainloop::Params& params,
                                             typename Mainloop::MainloopPipeline& pipeline,
                                             typename Mainloop::PipelineState& write,
                                             const Inputs& inputs, int m_blk, int n_blk,
                                             int k_tiles, uint32_t block_rank_in_cluster,
                                             typename Mainloop::TensorStorage& tiles,
                                             cute::TMA::CacheHintSm90 hint_a,
                                             cute::TMA::CacheHintSm90 hint_b) {
  using namespace cute;
  using ClusterShape = typename Mainloop::DispatchPolicy::ClusterShape;
  auto w = write;
  write.advance(k_tiles);
  if (!cute::elect_one_sync()) return;
  Tensor sA = make_tensor(make_smem_ptr(tiles.smem_A.data()), typename Mainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(tiles.smem_B.data()), typename Mainloop::SmemLayoutB{});
  const ClusterLoads<ClusterShape, typename Mainloop::GmemTiledCopyA,
                     typename Mainloop::GmemTiledCopyB>
      at(block_rank_in_cluster);
  auto tma_a = params.tma_load_a.get_slice(at.block_y);
  auto tma_b = params.tma_load_b.get_slice(at.block_x);
  Tensor tAgA = tma_a.partition_S(get<0>(inputs)(_, _, m_blk, _, 0));  // (TMA, TMA_M, TMA_K, k)
  Tensor tAsA = tma_a.partition_D(sA);                                  // (TMA, TMA_M, TMA_K, PIPE)
  Tensor tBgB = tma_b.partition_S(get<1>(inputs)(_, _, n_blk, _, 0));
  Tensor tBsB = tma_b.partition_D(sB);
#pragma unroll 1
  for (int k = 0; k < k_tiles; ++k, ++w) {
    pipeline.producer_acquire(w);
    auto* barrier = pipeline.producer_get_barrier(w);
    const int stage = w.index();
    copy(params.tma_load_a.with(*barrier, at.mcast_a, hint_a), tAgA(_, _, _, k), tAsA(_, _, _, stage));
    copy(params.tma_load_b.with(*barrier, at.mcast_b, hint_b), tBgB(_, _, _, k), tBsB(_, _, _, stage));
  }
}

struct NoHook {
  __device__ void operator()(int) const {}
};

// `read` enters at the tile's first stage and leaves k_tiles stages later. `on_first_stage`
// runs once the first stage has landed (a trace stamp).
template <class Mainloop, int kRounds, int kStepsPerRound, class Acc, class Hook, class FirstStage>
__device__ __forceinline__ void consume_tile(typename Mainloop::MainloopPipeline& pipeline,
                                             typename Mainloop::PipelineState& read, Acc& acc,
                                             int k_tiles, int ctid,
                                             typename Mainloop::TensorStorage& tiles,
                                             Hook&& between, FirstStage&& on_first_stage) {
  using namespace cute;
  using TiledMma = typename Mainloop::TiledMma;
  Tensor sA = make_tensor(make_smem_ptr(tiles.smem_A.data()), typename Mainloop::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(tiles.smem_B.data()), typename Mainloop::SmemLayoutB{});
  TiledMma tiled_mma;
  // Operand descriptors are per warpgroup (every thread of one sees the same tiles).
  const int warpgroup = __shfl_sync(0xffffffffu, ctid / cutlass::NumThreadsPerWarpGroup, 0);
  auto thr = tiled_mma.get_slice(warpgroup * cutlass::NumThreadsPerWarpGroup);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)

  auto release = read;
  // First k-step: the accumulators start from zero.
  warpgroup_fence_operand(acc);
  {
    pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
    on_first_stage();
    const int stage = read.index();
    warpgroup_arrive();
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTLASS_PRAGMA_UNROLL
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    ++read;
  }
  warpgroup_fence_operand(acc);

  // Steady k-steps: issue this stage's batch, wait for the previous batch, release its stage.
  auto step = [&]() {
    pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
    const int stage = read.index();
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    cute::gemm(tiled_mma, tCrA(_, _, _, stage), tCrB(_, _, _, stage), acc);
    warpgroup_commit_batch();
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    pipeline.consumer_release(release);
    ++read;
    ++release;
  };
  int left = k_tiles - 1;
#pragma unroll 1
  for (int round = 0; round < kRounds; ++round) {
#pragma unroll
    for (int u = 0; u < kStepsPerRound; ++u) {
      if (left > 0) {
        step();
        --left;
      }
      between(u);
    }
  }
#pragma unroll 1
  for (; left > 0; --left) step();

  // Drain: the last batch done, its stage released.
  warpgroup_fence_operand(acc);
  warpgroup_wait<0>();
  pipeline.consumer_release(release);
}

}  // namespace gemmfuse::cuda::sm90

// The mainloop of the fp32 GEMM on fp16 tensor cores (gemm_f16x3.cu): CUTLASS's sm90
// TMA + wgmma warp-specialized collective for FP8, on 16-bit operands, with its stages and
// consumer rewritten.
//
// 1. Promotion. The tensor core's fp32 accumulator loses low bits on every k-step (cuBLAS
//    TF32 on inputs exact in TF32, whose error is the accumulator's alone, is well short of
//    SGEMM's accuracy: docs/measurements.md, "The GEMM variants at the reference shape").
//    As CUTLASS's FP8 mainloop does, the large product's tensor-core sum is added into a
//    second, fp32 register accumulator ("promotion") after every 64 of K.
// 2. Several products per stage. With x and W split into parts (split.h), Y is the sum of
//    kProducts part products x_i.w_j. Each pipeline stage holds one k-tile of every part of
//    x and of W (kParts shared-memory slots each), and the consumer runs all products on it,
//    so each W part is read once per call (against once per product when the products run
//    one after another, which is slower, most at few rows; docs/measurements.md, "The f16x3
//    kernel's mainloop"). The kernel's K' is k_tiles(K) * BLK_K.
// 3. The small products (all but the last) carry a factor (the split's 2^11) that
//    `small_scale` undoes when their sum joins the fp32 accumulator at the end (mma()).
// The large product must come last (f16x3_kernel.cuh). `Built` must be the builder's
// collective with kParts * kStages pipeline stages: its shared memory is reused as kParts
// slots per stage of this mainloop's kStages-stage pipeline.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/pipeline/pipeline.hpp"

#include "mainloop.h"  // ClusterLoads

namespace gemmfuse::cuda::sm90 {

// The builder's 16-bit collective `Built`, re-dispatched to the promoting (FP8) mainloop.
template <class Built, class KernelSchedule>
using PromotingMainloop = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<
        Built::DispatchPolicy::Stages, typename Built::DispatchPolicy::ClusterShape, KernelSchedule>,
    typename Built::TileShape, typename Built::ElementA, typename Built::StrideA,
    typename Built::ElementB, typename Built::StrideB, typename Built::TiledMma,
    typename Built::GmemTiledCopyA, typename Built::SmemLayoutAtomA, typename Built::SmemCopyAtomA,
    typename Built::TransformA, typename Built::GmemTiledCopyB, typename Built::SmemLayoutAtomB,
    typename Built::SmemCopyAtomB, typename Built::TransformB>;

// kProducts products of parts: product p is x_{part_a[p]} . w_{part_b[p]}.
template <class Built, class KernelSchedule, int kParts, int kProducts>
struct SplitProductsMainloop : PromotingMainloop<Built, KernelSchedule> {
  using Base = PromotingMainloop<Built, KernelSchedule>;
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TileShape;
  using typename Base::TensorStorage;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  using typename Base::TiledMma;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  static constexpr int kSlots = Built::DispatchPolicy::Stages;
  static_assert(kSlots % kParts == 0 && kSlots / kParts >= 2, "kParts slots per stage, two stages at least");
  static constexpr int kStages = kSlots / kParts;

  using MainloopPipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
  using PipelineParams = typename MainloopPipeline::Params;
  using PipelineStorage = typename MainloopPipeline::SharedStorage;

  // The kernel's problem shape has K' = k_prime(k); `k` is the real K.
  struct Arguments {
    const ElementA* x[kParts];  // [M, K] each, strides dA
    StrideA dA;
    const ElementB* w[kParts];  // [N, K] each, strides dB
    StrideB dB;
    int8_t part_a[kProducts];   // product p = x[part_a[p]] . w[part_b[p]], the large one last
    int8_t part_b[kProducts];
    float small_scale = 1.f;    // the small products' sum is added into fp32 times this
    int k = 0;
  };

  struct Params : Base::Params {
    typename Base::Params::TMA_A tma_a[kParts - 1];  // parts 1.. (part 0: the base's)
    typename Base::Params::TMA_B tma_b[kParts - 1];
    int8_t part_a[kProducts];
    int8_t part_b[kProducts];
    float small_scale;
  };

  static int k_tiles(int k) { return (k + kBlockK - 1) / kBlockK; }
  static int k_prime(int k) { return k_tiles(k) * kBlockK; }

  // The base's arguments for part i (its promotion interval is not used: mma() below).
  static typename Base::Arguments part_arguments(Arguments const& a, int i) {
    return typename Base::Arguments{a.x[i], a.dA, a.w[i], a.dB, /*mma_promotion_interval=*/4};
  }

  // Each stage's transaction bytes are those of kParts tiles of x and of W.
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& a, void* ws) {
    auto [M, N, Kp, L] = cute::append<4>(shape, 1);
    (void)Kp;
    const auto part = cute::make_shape(M, N, a.k, L);
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(part, part_arguments(a, 0), ws);
    for (int i = 1; i < kParts; ++i) {
      const auto s = Base::to_underlying_arguments(part, part_arguments(a, i), ws);
      p.tma_a[i - 1] = s.tma_load_a;
      p.tma_b[i - 1] = s.tma_load_b;
    }
    for (int i = 0; i < kProducts; ++i) {
      p.part_a[i] = a.part_a[i];
      p.part_b[i] = a.part_b[i];
    }
    p.small_scale = a.small_scale;
    p.tma_transaction_bytes = kParts * Base::TmaTransactionBytes;
    p.tma_transaction_bytes_mk = kParts * Base::TmaTransactionBytesMK;
    p.tma_transaction_bytes_nk = kParts * Base::TmaTransactionBytesNK;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, Kp, L] = cute::append<4>(shape, 1);
    const auto part = cute::make_shape(M, N, a.k, L);
    bool ok = a.k > 0 && int(Kp) == k_prime(a.k) && Base::can_implement(part, part_arguments(a, 0));
    for (int i = 0; i < kProducts; ++i)
      ok = ok && a.part_a[i] >= 0 && a.part_a[i] < kParts && a.part_b[i] >= 0 && a.part_b[i] < kParts;
    return ok;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) {
    Base::prefetch_tma_descriptors(p);
    for (int i = 0; i < kParts - 1; ++i) {
      cute::prefetch_tma_descriptor(p.tma_a[i].get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_b[i].get_tma_descriptor());
    }
  }

  // The producer: for each k-tile, every part of x and of W into the stage's slots (x tiles
  // multicast along the cluster's N, W tiles along its M). Every part's descriptor tiles the
  // same coordinates: partitioned with part 0's.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int /*thread_idx*/, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    using namespace cute;
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,slot)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    const ClusterLoads<ClusterShape, GmemTiledCopyA, GmemTiledCopyB> at(block_rank_in_cluster);
    auto tma_a = params.tma_load_a.get_slice(at.block_y);
    auto tma_b = params.tma_load_b.get_slice(at.block_x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));  // (TMA,TMA_M,TMA_K,k)
    Tensor tAsA = tma_a.partition_D(sA);                                              // (TMA,TMA_M,TMA_K,slot)
    Tensor tBgB = tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = tma_b.partition_D(sB);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++k_tile_iter, ++smem_pipe_write) {
      const int k = *k_tile_iter;
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int slot = smem_pipe_write.index() * kParts;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kParts; ++i) {
        const auto& a = i == 0 ? params.tma_load_a : params.tma_a[i - 1];
        const auto& b = i == 0 ? params.tma_load_b : params.tma_b[i - 1];
        copy(a.with(*barrier, at.mcast_a), tAgA(_, _, _, k), tAsA(_, _, _, slot + i));
        copy(b.with(*barrier, at.mcast_b), tBgB(_, _, _, k), tBsB(_, _, _, slot + i));
      }
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    if (cute::elect_one_sync()) pipeline.producer_tail(smem_pipe_write);
  }

  // The consumer. Per stage: the large product (the last) as a chain of BLK_K / 16 wgmma
  // k-blocks into a fresh tensor-core sum `large`, then the small products continuing one
  // tensor-core sum `small` that runs over all of K; then, once `large` is done (the small
  // chain may still run), `large` is added into the fp32 accumulator and the previous stage
  // released. At the end accum += small * small_scale.
  // Why this way: the tensor core's adds truncate, so the large product's sum is promoted
  // every BLK_K of K (bf16 parts in one chain shared by all products per stage miss the
  // test's norm bound at K = 8). The small products' sum is ~2^-11 of the large one's, so its
  // truncation over all of K stays far below 2^-24 of Y; keeping it out of the per-stage wait
  // lets each promotion overlap tensor-core work (faster than both chains promoted and waited
  // on per stage; docs/measurements.md, "The f16x3 kernel's mainloop").
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const& params) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const Layout warp_groups = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_groups(warp_group));
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,slot)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    constexpr int kBlocks = size<2>(tCrA);
    Tensor large = make_fragment_like(accum);
    Tensor small = make_fragment_like(accum);

    // Products [first, last) of the stage at `slot` into `acc`, as one wgmma batch.
    auto chain = [&](auto& acc, int slot, int first, int last, bool fresh) {
      tiled_mma.accumulate_ = fresh ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int p = first; p < last; ++p) {
        const int sa = slot + params.part_a[p], sb = slot + params.part_b[p];
        CUTLASS_PRAGMA_UNROLL
        for (int kb = 0; kb < kBlocks; ++kb) {
          cute::gemm(tiled_mma, tCrA(_, _, kb, sa), tCrB(_, _, kb, sb), acc);
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(acc);
    };
    PipelineState smem_pipe_release = smem_pipe_read;
    bool first = true;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int slot = smem_pipe_read.index() * kParts;
      chain(large, slot, kProducts - 1, kProducts, true);
      chain(small, slot, 0, kProducts - 1, first);
      warpgroup_wait<1>();  // this stage's large chain, and every earlier batch
      warpgroup_fence_operand(large);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += large(i);
      warpgroup_fence_operand(large);
      if (!first) {  // the previous stage's small chain is done
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      first = false;
      ++smem_pipe_read;
    }
    warpgroup_wait<0>();
    if (!first) pipeline.consumer_release(smem_pipe_release);
    warpgroup_fence_operand(small);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) accum(i) += small(i) * params.small_scale;
    warpgroup_fence_operand(accum);
  }

  // mma() released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

}  // namespace gemmfuse::cuda::sm90

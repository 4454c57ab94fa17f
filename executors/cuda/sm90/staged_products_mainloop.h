// A variant of SplitProductsMainloop (split_products_mainloop.h) for GEMMs bound by reading
// W: each pipeline stage holds one k-tile of every part of x and of W (kParts slots each), and
// the consumer runs all kProducts part products on it before releasing it. Product-major
// order reads each W part once per product that uses it (six reads of 128 MB parts at
// N = K = 8192); staged, each once. The kernel's K' is then k_tiles(K) * BLK_K: one kernel
// k-tile is one k-tile of K across all parts.
//
// `Built` must be the builder's collective with kParts * kStages pipeline stages: its shared
// memory is reused as kParts slots per stage of this mainloop's own kStages-stage pipeline.
// Promotion: per stage, the tensor-core sum of the small products (all but the last), then
// that of the last, large one, each added into the fp32 accumulator
// (Arguments::mma_promotion_interval is not used). The products must come smallest first.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/fp8_accumulation.hpp"
#include "cutlass/pipeline/pipeline.hpp"

#include "mainloop.h"                 // ClusterLoads
#include "split_products_mainloop.h"  // SplitProductsMainloop: arguments, params, descriptors

namespace gemmfuse::cuda::sm90 {

template <class Built, class KernelSchedule, int kParts, int kProducts>
struct StagedProductsMainloop : SplitProductsMainloop<Built, KernelSchedule, kParts, kProducts> {
  using Split = SplitProductsMainloop<Built, KernelSchedule, kParts, kProducts>;
  using Promoting = typename Split::Base;
  using typename Split::Arguments;
  using typename Split::Params;
  using typename Split::TensorStorage;
  using typename Split::SmemLayoutA;
  using typename Split::SmemLayoutB;
  using typename Split::GmemTiledCopyA;
  using typename Split::GmemTiledCopyB;
  using typename Split::TiledMma;
  using ClusterShape = typename Split::ClusterShape;
  static constexpr int kBlockK = Split::kBlockK;
  static constexpr int kSlots = Built::DispatchPolicy::Stages;
  static_assert(kSlots % kParts == 0 && kSlots / kParts >= 2, "kParts slots per stage, two stages at least");
  static constexpr int kStages = kSlots / kParts;

  using MainloopPipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
  using PipelineParams = typename MainloopPipeline::Params;
  using PipelineStorage = typename MainloopPipeline::SharedStorage;

  static int k_tiles(int k) { return Split::k_tiles(k); }
  static int k_prime(int k) { return k_tiles(k) * kBlockK; }

  // As SplitProductsMainloop's, with each stage's transaction bytes those of kParts tiles of
  // x and of W.
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& a, void* ws) {
    Params p = Split::to_underlying_arguments(shape, a, ws);
    p.tma_transaction_bytes = kParts * Promoting::TmaTransactionBytes;
    p.tma_transaction_bytes_mk = kParts * Promoting::TmaTransactionBytesMK;
    p.tma_transaction_bytes_nk = kParts * Promoting::TmaTransactionBytesNK;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, Kp, L] = cute::append<4>(shape, 1);
    const auto part = cute::make_shape(M, N, a.k, L);
    const typename Promoting::Arguments b{a.x[0], a.dA, a.w[0], a.dB, 4};
    bool ok = a.k > 0 && int(Kp) == k_prime(a.k) && Promoting::can_implement(part, b);
    for (int i = 0; i < kProducts; ++i)
      ok = ok && a.part_a[i] >= 0 && a.part_a[i] < kParts && a.part_b[i] >= 0 && a.part_b[i] < kParts;
    return ok;
  }

  // The producer: for each k-tile, every part of x and of W into the stage's slots.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int /*thread_idx*/, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    if (!cute::elect_one_sync()) return;
    auto [tAgA, tAsA, tBgB, tBsB, at] =
        Split::tile_loads(params, load_inputs, blk_coord, block_rank_in_cluster, shared_tensors);
    using cute::_;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++k_tile_iter, ++smem_pipe_write) {
      const int k = *k_tile_iter;
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int slot = smem_pipe_write.index() * kParts;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kParts; ++i) {
        cute::copy(Split::tma_a_of(params, i).with(*barrier, at.mcast_a), tAgA(_, _, _, k), tAsA(_, _, _, slot + i));
        cute::copy(Split::tma_b_of(params, i).with(*barrier, at.mcast_b), tBgB(_, _, _, k), tBsB(_, _, _, slot + i));
      }
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    if (cute::elect_one_sync()) pipeline.producer_tail(smem_pipe_write);
  }

  // The consumer: per stage, the small products in order (each a run of BLK_K / 16 wgmma
  // k-blocks reading its parts' slots) into the tensor-core accumulator, added into the fp32
  // one (which waits for the batch); then the last, large product alone, added the same way;
  // then the stage is released. As in product-major order, the tensor core never adds the
  // small products onto the large one's sum (its adds truncate: 1.2x SGEMM's error at K = 8
  // when they shared one chain), and each chain is at most BLK_K long per product.
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

    // Products [first, last) of this stage's slots into a fresh tensor-core sum, then into accum.
    using Accumulation = cutlass::gemm::collective::GmmaFP8Accumulation<typename FrgTensorC::engine_type,
                                                                        typename FrgTensorC::layout_type>;
    auto run = [&](Accumulation& acc, int slot, int first, int last) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(acc());
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int p = first; p < last; ++p) {
        const int sa = slot + params.part_a[p], sb = slot + params.part_b[p];
        CUTLASS_PRAGMA_UNROLL
        for (int kb = 0; kb < kBlocks; ++kb) {
          cute::gemm(tiled_mma, tCrA(_, _, kb, sa), tCrB(_, _, kb, sb), acc());
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
      }
      warpgroup_commit_batch();
      acc.promote_if_needed();  // an interval of one call: waits for the batch, adds it into accum
      warpgroup_fence_operand(acc());
    };
    Accumulation accumulation(accum, 1, 1);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int slot = smem_pipe_read.index() * kParts;
      run(accumulation, slot, 0, kProducts - 1);
      run(accumulation, slot, kProducts - 1, kProducts);
      pipeline.consumer_release(smem_pipe_read);
      ++smem_pipe_read;
    }
    warpgroup_fence_operand(accumulation());
  }

  // mma() released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) { cute::warpgroup_wait<0>(); }
};

}  // namespace gemmfuse::cuda::sm90

// The mainloop of the fp32 GEMM on bf16 tensor cores (gemm_bf16x6.cu): CUTLASS's sm90
// TMA + wgmma warp-specialized collective with two changes.
//
// 1. Promotion. The tensor core's fp32 accumulator loses low bits on every k-step (cuBLAS
//    TF32 on inputs exact in TF32: 1.9e-5 relative error against SGEMM's 1.6e-6,
//    seed-models.md). CUTLASS's FP8 mainloop adds the tensor-core accumulator into a second,
//    fp32 register accumulator every few k-steps ("promotion"); it is used here as is, on
//    bf16 operands, so each chain the tensor core sums is at most 128 of K long.
// 2. Several products over one pipeline. With x = x0 + x1 + x2 and W = w0 + w1 + w2 in bf16
//    (split.h), Y is the sum of kProducts part products x_i.w_j: the kernel's K' is
//    kProducts * k_tiles(K) * BLK_K, product p taking the p-th run of k_tiles(K) k-tiles, and
//    the producer picks the parts' TMA descriptors per k-tile. The consumer runs the
//    collective's own mma() over all of them; promoted chunks never straddle two products
//    when a product's k-tile count is a multiple of the chunk (gemm_bf16x6.cu).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

#include "mainloop.h"  // ClusterLoads

namespace gemmfuse::cuda::sm90 {

// The builder's bf16 collective `Built`, re-dispatched to the promoting (FP8) mainloop.
template <class Built, class KernelSchedule>
using PromotingMainloop = cutlass::gemm::collective::CollectiveMma<
    cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<
        Built::DispatchPolicy::Stages, typename Built::DispatchPolicy::ClusterShape, KernelSchedule>,
    typename Built::TileShape, typename Built::ElementA, typename Built::StrideA,
    typename Built::ElementB, typename Built::StrideB, typename Built::TiledMma,
    typename Built::GmemTiledCopyA, typename Built::SmemLayoutAtomA, typename Built::SmemCopyAtomA,
    typename Built::TransformA, typename Built::GmemTiledCopyB, typename Built::SmemLayoutAtomB,
    typename Built::SmemCopyAtomB, typename Built::TransformB>;

// kProducts products of parts: product p is x_{kPartA[p]} . w_{kPartB[p]}.
template <class Built, class KernelSchedule, int kParts, int kProducts>
struct SplitProductsMainloop : PromotingMainloop<Built, KernelSchedule> {
  using Base = PromotingMainloop<Built, KernelSchedule>;
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TileShape;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  static constexpr int kBlockK = cute::size<2>(TileShape{});

  // The kernel's problem shape has K' = k_prime(k); `k` is the real K.
  struct Arguments {
    const ElementA* x[kParts];  // [M, K] each, strides dA
    StrideA dA;
    const ElementB* w[kParts];  // [N, K] each, strides dB
    StrideB dB;
    int8_t part_a[kProducts];   // product p = x[part_a[p]] . w[part_b[p]]
    int8_t part_b[kProducts];
    int k = 0;
    uint32_t mma_promotion_interval = 8;  // wgmma k-blocks per promoted chunk
  };

  struct Params : Base::Params {
    typename Base::Params::TMA_A tma_a[kParts - 1];  // parts 1.. (part 0: the base's)
    typename Base::Params::TMA_B tma_b[kParts - 1];
    int8_t part_a[kProducts];
    int8_t part_b[kProducts];
    int k_tiles = 0;  // per product
  };

  static int k_tiles(int k) { return (k + kBlockK - 1) / kBlockK; }
  static int k_prime(int k) { return kProducts * k_tiles(k) * kBlockK; }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& a, void* ws) {
    auto [M, N, Kp, L] = cute::append<4>(shape, 1);
    (void)Kp;
    const auto part = cute::make_shape(M, N, a.k, L);
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(
        part, typename Base::Arguments{a.x[0], a.dA, a.w[0], a.dB, a.mma_promotion_interval}, ws);
    for (int i = 1; i < kParts; ++i) {
      const auto s = Base::to_underlying_arguments(
          part, typename Base::Arguments{a.x[i], a.dA, a.w[i], a.dB, a.mma_promotion_interval}, ws);
      p.tma_a[i - 1] = s.tma_load_a;
      p.tma_b[i - 1] = s.tma_load_b;
    }
    for (int i = 0; i < kProducts; ++i) {
      p.part_a[i] = a.part_a[i];
      p.part_b[i] = a.part_b[i];
    }
    p.k_tiles = k_tiles(a.k);
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& a) {
    auto [M, N, Kp, L] = cute::append<4>(shape, 1);
    const auto part = cute::make_shape(M, N, a.k, L);
    const typename Base::Arguments b{a.x[0], a.dA, a.w[0], a.dB, a.mma_promotion_interval};
    bool ok = a.k > 0 && int(Kp) == k_prime(a.k) && Base::can_implement(part, b);
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

  // Part i's TMA descriptors.
  CUTLASS_DEVICE static auto const& tma_a_of(Params const& p, int i) { return i == 0 ? p.tma_load_a : p.tma_a[i - 1]; }
  CUTLASS_DEVICE static auto const& tma_b_of(Params const& p, int i) { return i == 0 ? p.tma_load_b : p.tma_b[i - 1]; }

  // One tile's TMA views, (global k-tiles, shared-memory slots) of x then W, and where the
  // loads go in the cluster. Every part's descriptor tiles the same coordinates: partitioned
  // with part 0's.
  template <class TensorA, class TensorB, class BlockCoord>
  CUTLASS_DEVICE static auto tile_loads(Params const& params, cute::tuple<TensorA, TensorB> const& load_inputs,
                                        BlockCoord const& blk_coord, uint32_t block_rank_in_cluster,
                                        TensorStorage& shared_tensors) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    const ClusterLoads<ClusterShape, GmemTiledCopyA, GmemTiledCopyB> at(block_rank_in_cluster);
    auto tma_a = params.tma_load_a.get_slice(at.block_y);
    auto tma_b = params.tma_load_b.get_slice(at.block_x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    return cute::make_tuple(tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord)),  // (TMA,TMA_M,TMA_K,k)
                            tma_a.partition_D(sA),                                              // (TMA,TMA_M,TMA_K,slot)
                            tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord)),
                            tma_b.partition_D(sB), at);
  }

  // The producer: the collective's load() with each k-tile's descriptors chosen by product.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int /*thread_idx*/, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    if (!cute::elect_one_sync()) return;
    auto [tAgA, tAsA, tBgB, tBsB, at] =
        tile_loads(params, load_inputs, blk_coord, block_rank_in_cluster, shared_tensors);
    using cute::_;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++k_tile_iter, ++smem_pipe_write) {
      const int kp = *k_tile_iter;
      const int product = kp / params.k_tiles, k = kp - product * params.k_tiles;
      const int pa = params.part_a[product], pb = params.part_b[product];
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      cute::copy(tma_a_of(params, pa).with(*barrier, at.mcast_a), tAgA(_, _, _, k), tAsA(_, _, _, stage));
      cute::copy(tma_b_of(params, pb).with(*barrier, at.mcast_b), tBgB(_, _, _, k), tBsB(_, _, _, stage));
    }
  }
};

}  // namespace gemmfuse::cuda::sm90

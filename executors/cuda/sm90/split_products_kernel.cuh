// fp32 GEMMs on bf16 tensor cores as CUTLASS kernels: Y = sum over products p of
// x_{a(p)} . w_{b(p)}^T (+ bias), from bf16 parts of x and of W (split.h), fp32 out. Used for
// `fp32` on sm90 (three parts, six products: gemm_bf16x6.h) and for `fast` with few rows (two
// parts, three products: gemm_split_k.h). Included by the two files that instantiate the
// kernels, gemm_bf16x6.cu (wide) and gemm_split_k.cu (split-K), only when the build has
// CUTLASS's headers.
//
// Tiles: 128x128x64. Two kernels from the one mainloop and epilogue:
// - wide: 2-CTA clusters along M (W tiles multicast), persistent over the output tiles;
// - split-K: 1-CTA clusters, each tile's K' cut into `splits` ranges run by different CTAs
//   and summed in fp32 through the workspace (CUTLASS's stream-K scheduler in split-K mode),
//   for GEMMs whose tiles would leave most SMs idle (128 rows x 8192 columns: 64 tiles).
// The promoting mainloop (split_products_mainloop.h) keeps two accumulators per thread, so a
// consumer warpgroup holds at most 64x128 of each (the 128x256 tiles of the bf16 GEMMs would
// need 256 registers for them alone). CUTLASS's epilogue adds the bias per column.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "cuda_check.h"
#include "device_info.h"
#include "gemm_bf16x6.h"  // kBf16x6TileMN
#include "split_products_mainloop.h"

namespace gemmfuse::cuda::sm90 {
namespace {  // each including file instantiates its own kernels
using namespace cute;

using TileShape = Shape<Int<kBf16x6TileMN>, Int<kBf16x6TileMN>, _64>;
using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
constexpr int kAlignIn = 8, kAlignOut = 4;  // bf16 / fp32 elements per 16 bytes
using Bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

template <class ClusterShape, class TileScheduler, int kParts_, int kProducts_>
struct SplitProductsKernel {
  static constexpr int kParts = kParts_, kProducts = kProducts_;
  static constexpr bool kSplitK = std::is_same_v<TileScheduler, cutlass::gemm::StreamKScheduler>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, RowMajor, kAlignOut,
      float, RowMajor, kAlignOut, EpilogueSchedule,
      cutlass::epilogue::fusion::LinCombPerColBias<float, float, float>>::CollectiveOp;
  // x [M,K] row-major is A K-major; W [N,K] row-major is B K-major ("column-major" K x N).
  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, kAlignIn, Bf16,
      ColumnMajor, kAlignIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Mainloop = SplitProductsMainloop<Built, Schedule, kParts, kProducts>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
template <int kParts, int kProducts>
using WideKernel = SplitProductsKernel<Shape<_2, _1, _1>, void, kParts, kProducts>;
template <int kParts, int kProducts>
using SplitKKernel = SplitProductsKernel<Shape<_1, _1, _1>, cutlass::gemm::StreamKScheduler, kParts, kProducts>;

// One GEMM's operands: part i of x is [M, K] with rows ldx apart (16-byte aligned), of W
// [N, K] with rows ldw apart; product p is x_{part_a[p]} . w_{part_b[p]}, smallest first
// (each promoted chunk is one product's; the large ones then add onto a sum that already
// holds the small ones).
template <int kParts, int kProducts>
struct PartProducts {
  int64_t M = 0, N = 0, K = 0;
  const void* x[kParts] = {};
  int64_t ldx = 0;
  const void* w[kParts] = {};
  int64_t ldw = 0;
  int8_t part_a[kProducts] = {}, part_b[kProducts] = {};
  const float* bias = nullptr;  // [N] or null
  float* y = nullptr;           // [M, N] row-major
};

// wgmma k-blocks per k-tile (bf16 wgmma takes 16 of K).
constexpr int kMmasPerKTile = size<2>(TileShape{}) / 16;
constexpr int kBlockK = size<2>(TileShape{});

// Promote every 2 k-tiles (128 of K: the least error among 32 to 512 in the TF32 probe,
// bench/NOTES.md session 18), or every k-tile so that chunks end where a product's k-tiles do.
int promotion_k_tiles(int64_t k) { return ((k + kBlockK - 1) / kBlockK) % 2 == 0 ? 2 : 1; }

// The stride of a row-major [rows, cols] operand with rows `ld` apart (batch of one).
template <class Stride>
Stride row_major(int64_t rows, int64_t ld) {
  static_assert(cute::is_static<cute::tuple_element_t<1, Stride>>::value, "unit stride along cols");
  Stride s{};
  get<0>(s) = ld;
  get<2>(s) = rows * ld;
  return s;
}

template <class Variant>
typename Variant::Gemm::Arguments arguments(const PartProducts<Variant::kParts, Variant::kProducts>& p,
                                            int splits) {
  using Kernel = typename Variant::Kernel;
  using Mainloop = typename Variant::Mainloop;
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N), K = static_cast<int>(p.K);
  typename Variant::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.hw_info.sm_count = sm_count();  // CUTLASS would query device 0 on every call
  args.problem_shape = {M, N, Mainloop::k_prime(K), 1};
  for (int i = 0; i < Variant::kParts; ++i) {
    args.mainloop.x[i] = static_cast<const Bf16*>(p.x[i]);
    args.mainloop.w[i] = static_cast<const Bf16*>(p.w[i]);
  }
  args.mainloop.dA = row_major<typename Kernel::StrideA>(M, p.ldx);
  args.mainloop.dB = row_major<typename Kernel::StrideB>(N, p.ldw);
  for (int i = 0; i < Variant::kProducts; ++i) {
    args.mainloop.part_a[i] = p.part_a[i];
    args.mainloop.part_b[i] = p.part_b[i];
  }
  args.mainloop.k = K;
  args.mainloop.mma_promotion_interval = static_cast<uint32_t>(promotion_k_tiles(K) * kMmasPerKTile);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = row_major<typename Kernel::StrideC>(M, N);
  args.epilogue.ptr_D = p.y;
  args.epilogue.dD = row_major<typename Kernel::StrideD>(M, N);
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.thread.bias_ptr = p.bias;
  if constexpr (Variant::kSplitK) {
    args.scheduler.splits = splits;
    args.scheduler.decomposition_mode = decltype(args.scheduler.decomposition_mode)::SplitK;
  }
  return args;
}

template <class Variant>
size_t workspace_size(const PartProducts<Variant::kParts, Variant::kProducts>& p, int splits) {
  return Variant::Gemm::get_workspace_size(arguments<Variant>(p, splits));
}

// Enqueues the GEMM; false (nothing enqueued) when the workspace is too small. With `pdl`
// the launch is programmatic: the file must be built with CUTLASS_ENABLE_GDC_FOR_SM90, so
// that the kernel's load warps wait for the x split before reading (programmatic_launch.h).
template <class Variant>
bool launch(const PartProducts<Variant::kParts, Variant::kProducts>& p, int splits, void* workspace,
            size_t workspace_bytes, cudaStream_t stream, bool pdl) {
  using Gemm = typename Variant::Gemm;
  const auto args = arguments<Variant>(p, splits);
  if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    throw std::logic_error("split-products GEMM: CUTLASS cannot implement an accepted shape");
  // The split-K kernel's initialize clears its reduction flags (a memset on `stream`).
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
    throw std::runtime_error("split-products GEMM: initialize failed");
  if (gemm.run(stream, nullptr, pdl) != cutlass::Status::kSuccess)
    throw std::runtime_error("split-products GEMM: launch failed");
  GF_LAUNCH_CHECK();
  return true;
}

// `fp32`'s six products of three parts (split.h's bf16x3 planes, [3, rows, K] each).
using Bf16x6Operands = PartProducts<3, 6>;
inline Bf16x6Operands bf16x6_operands(const Bf16x6Problem& p) {
  Bf16x6Operands o;
  o.M = p.M;
  o.N = p.N;
  o.K = p.K;
  for (int i = 0; i < 3; ++i) {
    o.x[i] = p.x_parts + i * p.M * p.K;
    o.w[i] = p.w_parts + i * p.N * p.K;
  }
  o.ldx = o.ldw = p.K;
  constexpr int8_t a[6] = {1, 0, 2, 0, 1, 0}, b[6] = {1, 2, 0, 1, 0, 0};  // x1.w1, x0.w2, x2.w0, x0.w1, x1.w0, x0.w0
  for (int i = 0; i < 6; ++i) {
    o.part_a[i] = a[i];
    o.part_b[i] = b[i];
  }
  o.bias = p.bias;
  o.y = p.y;
  return o;
}

}  // namespace
}  // namespace gemmfuse::cuda::sm90

// The fp32 GEMM on bf16 tensor cores as CUTLASS kernels (see gemm_bf16x6.h): the types of
// its two variants and their launch. Included by the two files that instantiate them,
// gemm_bf16x6.cu (wide) and gemm_bf16x6_split_k.cu (split-K), only when the build has
// CUTLASS's headers.
//
// Tiles: 128x128x64; the mainloop (split_products_mainloop.h) holds one k-tile of every
// part per stage, two stages, and runs all six products on it. Two kernels:
// - wide: 2-CTA clusters along M (W tiles multicast), persistent over the output tiles;
// - split-K: 1-CTA clusters, each tile's K cut into `splits` ranges run by different CTAs
//   and summed in fp32 through the workspace (CUTLASS's stream-K scheduler in split-K mode),
//   for GEMMs whose tiles would leave most SMs idle (128 rows x 8192 columns: 64 tiles).
// The promoting mainloop keeps two accumulators per thread, so a consumer warpgroup holds at
// most 64x128 of each (the 128x256 tiles of the bf16 GEMMs would need 256 registers for them
// alone). CUTLASS's epilogue adds the bias per column; it has no source C (ElementC void),
// which leaves the mainloop room for two stages of three slots.
//
// The products, smallest first (the large one last, summed apart: split_products_mainloop.h):
// x1.w1, x0.w2, x2.w0, x0.w1, x1.w0, x0.w0.
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
#include "gemm_bf16x6.h"
#include "split_products_mainloop.h"

namespace gemmfuse::cuda::sm90 {
namespace {  // each including file instantiates its own variant
using namespace cute;

using TileShape = Shape<Int<kBf16x6TileMN>, Int<kBf16x6TileMN>, _64>;
using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
constexpr int kAlignIn = 8, kAlignOut = 4;  // bf16 / fp32 elements per 16 bytes
using Bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
constexpr int kParts = 3, kProducts = 6;
constexpr int8_t kPartA[kProducts] = {1, 0, 2, 0, 1, 0};
constexpr int8_t kPartB[kProducts] = {1, 2, 0, 1, 0, 0};

template <class ClusterShape, class TileScheduler>
struct Bf16x6Kernel {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, kAlignOut,
      float, RowMajor, kAlignOut, EpilogueSchedule,
      cutlass::epilogue::fusion::LinCombPerColBias<float, float, float>>::CollectiveOp;
  // x [M,K] row-major is A K-major; W [N,K] row-major is B K-major ("column-major" K x N).
  // Two stages of kParts slots (the mainloop's layout of the builder's stages).
  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, kAlignIn, Bf16,
      ColumnMajor, kAlignIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCount<2 * kParts>, Schedule>::CollectiveOp;
  using Mainloop = SplitProductsMainloop<Built, Schedule, kParts, kProducts>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(sizeof(typename Kernel::SharedStorage) <= 227 * 1024, "an sm90 CTA's shared memory");
};
// The wide kernel (gemm_bf16x6.cu) and the split-K one (gemm_bf16x6_split_k.cu).
using Wide = Bf16x6Kernel<Shape<_2, _1, _1>, void>;
using SplitK = Bf16x6Kernel<Shape<_1, _1, _1>, cutlass::gemm::StreamKScheduler>;

// The stride of a packed row-major [rows, cols] operand (batch of one): (cols, 1, rows*cols).
template <class Stride>
Stride packed(int64_t rows, int64_t cols) {
  static_assert(cute::is_static<cute::tuple_element_t<1, Stride>>::value, "unit stride along cols");
  Stride s{};
  get<0>(s) = cols;
  get<2>(s) = rows * cols;
  return s;
}

template <class Variant>
typename Variant::Gemm::Arguments arguments(const Bf16x6Problem& p, int splits) {
  using Kernel = typename Variant::Kernel;
  using SA = typename Kernel::StrideA;
  using SB = typename Kernel::StrideB;
  using SC = typename Kernel::StrideC;
  using SD = typename Kernel::StrideD;
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N), K = static_cast<int>(p.K);
  typename Variant::Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.hw_info.sm_count = sm_count();  // CUTLASS would query device 0 on every call
  args.problem_shape = {M, N, Variant::Mainloop::k_prime(K), 1};
  const auto* xp = reinterpret_cast<const Bf16*>(p.x_parts);
  const auto* wp = reinterpret_cast<const Bf16*>(p.w_parts);
  for (int i = 0; i < kParts; ++i) {
    args.mainloop.x[i] = xp + i * p.M * p.K;
    args.mainloop.w[i] = wp + i * p.N * p.K;
  }
  args.mainloop.dA = packed<SA>(M, K);
  args.mainloop.dB = packed<SB>(N, K);
  for (int i = 0; i < kProducts; ++i) {
    args.mainloop.part_a[i] = kPartA[i];
    args.mainloop.part_b[i] = kPartB[i];
  }
  args.mainloop.k = K;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = packed<SC>(M, N);
  args.epilogue.ptr_D = p.y;
  args.epilogue.dD = packed<SD>(M, N);
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.thread.bias_ptr = p.bias;
  if constexpr (std::is_same_v<Variant, SplitK>) {
    args.scheduler.splits = splits;
    args.scheduler.decomposition_mode = decltype(args.scheduler.decomposition_mode)::SplitK;
  }
  return args;
}

template <class Variant>
size_t workspace_size(const Bf16x6Problem& p, int splits) {
  return Variant::Gemm::get_workspace_size(arguments<Variant>(p, splits));
}

// Enqueues the GEMM; false (nothing enqueued) when the workspace is too small. With `pdl`
// the launch is programmatic: the file must be built with CUTLASS_ENABLE_GDC_FOR_SM90, so
// that the kernel's load warps wait for the x split before reading (programmatic_launch.h).
template <class Variant>
bool launch(const Bf16x6Problem& p, int splits, void* workspace, size_t workspace_bytes,
            cudaStream_t stream, bool pdl) {
  using Gemm = typename Variant::Gemm;
  const auto args = arguments<Variant>(p, splits);
  if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    throw std::logic_error("bf16x6 GEMM: CUTLASS cannot implement an accepted shape");
  // The split-K kernel's initialize clears its reduction flags (a memset on `stream`).
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
    throw std::runtime_error("bf16x6 GEMM: initialize failed");
  if (gemm.run(stream, nullptr, pdl) != cutlass::Status::kSuccess)
    throw std::runtime_error("bf16x6 GEMM: launch failed");
  GF_LAUNCH_CHECK();
  return true;
}

}  // namespace
}  // namespace gemmfuse::cuda::sm90

// The fp32 GEMM on fp16 tensor cores as CUTLASS kernels (see gemm_f16x3.h): the types of
// its two variants and their launch. Included by the two files that instantiate them,
// gemm_f16x3.cu (wide) and gemm_f16x3_split_k.cu (split-K), only when the build has
// CUTLASS's headers.
//
// Tiles: 128x128x64; the mainloop (split_products_mainloop.h) holds one k-tile of both parts
// of x and of W per stage, three stages, and runs the three products on it. Three kernels:
// - wide: 2-CTA clusters along M (W tiles multicast), persistent over the output tiles;
// - counted: the wide kernel over the first *rows rows only (counted_rows_scheduler.h);
// - split-K: 1-CTA clusters, each tile's K cut into `splits` ranges run by different CTAs
//   and summed in fp32 through the workspace (CUTLASS's stream-K scheduler in split-K mode),
//   for GEMMs whose tiles would leave most SMs idle (128 rows x 8192 columns: 64 tiles).
// The promoting mainloop keeps three accumulators per thread (the fp32 sum, the large
// product's chain, the small products' sum), so a consumer warpgroup holds 64x128 of each
// (192 registers; the 128x256 tiles of the bf16 GEMMs would need 384). The epilogue (an EVT: Unscale below) undoes the
// row scales and adds the bias per column; it has no source C (ElementC void), which leaves
// the mainloop room for three stages of two slots.
//
// The products, small ones first (the large one last, summed apart: split_products_mainloop.h):
// x1.w0, x0.w1 (each 2^11 too large: the split's p1), x0.w0.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "counted_rows_scheduler.h"
#include "cuda_check.h"
#include "device_info.h"
#include "gemm_f16x3.h"
#include "split_products_mainloop.h"

namespace gemmfuse::cuda::sm90 {
namespace {  // each including file instantiates its own variant
using namespace cute;

using TileShape = Shape<Int<kF16x3TileMN>, Int<kF16x3TileMN>, _64>;
using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
constexpr int kAlignIn = 8, kAlignOut = 4;  // fp16 / fp32 elements per 16 bytes
using Part = cutlass::half_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
constexpr int kParts = 2, kProducts = 3, kStages = 3;
constexpr int8_t kPartA[kProducts] = {1, 0, 0};
constexpr int8_t kPartB[kProducts] = {0, 1, 0};
constexpr float kSmallScale = 0x1p-11f;  // the small products' 2^11 undone

// The epilogue's arithmetic: Y = acc 2^-(ex + ew) + bias, the split's row scales undone
// exactly (ldexpf: no intermediate overflow or underflow whatever the two exponents).
template <class T>
struct Unscale {
  CUTLASS_HOST_DEVICE T operator()(T const& acc, T const& ex, T const& ew, T const& bias) const {
    return ldexpf(acc, -static_cast<int>(ex + ew)) + bias;
  }
};
template <int N>
struct Unscale<cutlass::Array<float, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<float, N> operator()(
      cutlass::Array<float, N> const& acc, cutlass::Array<float, N> const& ex,
      cutlass::Array<float, N> const& ew, cutlass::Array<float, N> const& bias) const {
    cutlass::Array<float, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) y[i] = Unscale<float>{}(acc[i], ex[i], ew[i], bias[i]);
    return y;
  }
};
namespace fusion = cutlass::epilogue::fusion;
using RowExps = fusion::Sm90ColBroadcast<0, TileShape, float, float, Stride<_1, _0, int64_t>>;  // x's, per m
using ColVector = fusion::Sm90RowBroadcast<0, TileShape, float, float, Stride<_0, _1, int64_t>>;  // per n
using UnscaleBias = fusion::Sm90EVT<
    fusion::Sm90Compute<Unscale, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
    fusion::Sm90AccFetch, RowExps, ColVector /* W's exps */, ColVector /* bias */>;

template <class ClusterShape, class TileScheduler, class LayoutB = ColumnMajor>
struct F16x3Kernel {
  static constexpr bool kSplitK = std::is_same_v<TileScheduler, cutlass::gemm::StreamKScheduler>;
  static constexpr bool kCounted = std::is_same_v<TileScheduler, CountedRows>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, kAlignOut,
      float, RowMajor, kAlignOut, EpilogueSchedule, UnscaleBias>::CollectiveOp;
  // x [M,K] row-major is A K-major; W [N,K] row-major is B K-major ("column-major" K x N),
  // or, with LayoutB RowMajor, W stored [K,N] is B MN-major (wgmma reads 16-bit operands
  // either way). kStages stages of kParts slots (the mainloop's layout of the builder's stages).
  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Part, RowMajor, kAlignIn, Part,
      LayoutB, kAlignIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCount<kStages * kParts>, Schedule>::CollectiveOp;
  using Mainloop = SplitProductsMainloop<Built, Schedule, kParts, kProducts>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(sizeof(typename Kernel::SharedStorage) <= 227 * 1024, "an sm90 CTA's shared memory");
};
// The wide kernel (gemm_f16x3.cu), the split-K one (gemm_f16x3_split_k.cu), the wide one
// over a row count read on the device (gemm_f16x3_counted.cu), and the wide, counted and
// split-K ones reading W MN-major (gemm_f16x3_mn_major.cu, gemm_f16x3_split_k_mn.cu).
using Wide = F16x3Kernel<Shape<_2, _1, _1>, void>;
using SplitK = F16x3Kernel<Shape<_1, _1, _1>, cutlass::gemm::StreamKScheduler>;
using Counted = F16x3Kernel<Shape<_2, _1, _1>, CountedRows>;
using WideMN = F16x3Kernel<Shape<_2, _1, _1>, void, RowMajor>;
using SplitKMN = F16x3Kernel<Shape<_1, _1, _1>, cutlass::gemm::StreamKScheduler, RowMajor>;
using CountedMN = F16x3Kernel<Shape<_2, _1, _1>, CountedRows, RowMajor>;

// The strides (rows, cols, batch) of a packed operand of `rows` by `cols` (batch of one):
// (cols, 1, rows*cols) where cols is the contiguous mode (row-major), else (1, rows, rows*cols).
template <class Stride>
Stride packed(int64_t rows, int64_t cols) {
  Stride s{};
  if constexpr (cute::is_static<cute::tuple_element_t<1, Stride>>::value) {
    get<0>(s) = cols;
  } else {
    static_assert(cute::is_static<cute::tuple_element_t<0, Stride>>::value, "a unit-stride mode");
    get<1>(s) = rows;
  }
  get<2>(s) = rows * cols;
  return s;
}

template <class Variant>
typename Variant::Gemm::Arguments arguments(const F16x3Problem& p, int splits) {
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
  const auto* xp = reinterpret_cast<const Part*>(p.x_parts);
  const auto* wp = reinterpret_cast<const Part*>(p.w_parts);
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
  args.mainloop.small_scale = kSmallScale;
  args.mainloop.k = K;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = packed<SC>(M, N);
  args.epilogue.ptr_D = p.y;
  args.epilogue.dD = packed<SD>(M, p.ldy > 0 ? p.ldy : N);  // (ldy, 1, M ldy): rows ldy apart
  args.epilogue.thread = {
      {},                                                    // acc
      {p.x_exps, 0.f, {_1{}, _0{}, int64_t(M)}},             // x's row exponents, per m
      {p.w_exps, 0.f, {_0{}, _1{}, int64_t(N)}},             // W's row exponents, per n
      {p.bias, 0.f, {_0{}, _1{}, int64_t(N)}},               // bias, per n (null: 0)
      {}};
  if constexpr (Variant::kSplitK) {
    args.scheduler.splits = splits;
    args.scheduler.decomposition_mode = decltype(args.scheduler.decomposition_mode)::SplitK;
  }
  if constexpr (Variant::kCounted) args.scheduler.rows = p.rows;
  return args;
}

// The arguments CUTLASS's can_implement is asked about: with a padded Y (ldy > N), N rounded
// up to ldy. Its check of D's alignment reads N as the extent of D's rows in memory, which is
// ldy there; the kernel runs with the true N, its TMA store clipping the padding.
template <class Args>
Args implementable_shape(Args args, const F16x3Problem& p) {
  if (p.ldy > p.N) get<1>(args.problem_shape) = static_cast<int>(p.ldy);
  return args;
}

template <class Variant>
size_t workspace_size(const F16x3Problem& p, int splits) {
  return Variant::Gemm::get_workspace_size(arguments<Variant>(p, splits));
}

// Enqueues the GEMM; false (nothing enqueued) when the workspace is too small. With `pdl`
// the launch is programmatic: the file must be built with CUTLASS_ENABLE_GDC_FOR_SM90, so
// that the kernel's load warps wait for the x split before reading (programmatic_launch.h).
// Opt the kernel into its dynamic shared memory on the current device, once per device.
template <class Kernel>
void allow_shared_storage() {
  constexpr int kBytes = Kernel::SharedStorageSize;
  if constexpr (kBytes >= (48 << 10)) {
    static std::atomic<uint64_t> done{0};  // a bit per device id (< 64)
    int dev = 0;
    GF_CUDA_CHECK(cudaGetDevice(&dev));
    const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
    if (bit && (done.load(std::memory_order_acquire) & bit)) return;
    GF_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    done.fetch_or(bit, std::memory_order_release);
  }
}

template <class Variant>
bool launch(const F16x3Problem& p, int splits, void* workspace, size_t workspace_bytes,
            cudaStream_t stream, bool pdl) {
  using Gemm = typename Variant::Gemm;
  using Kernel = typename Gemm::GemmKernel;
  const auto args = arguments<Variant>(p, splits);
  if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
  if (Gemm::can_implement(implementable_shape(args, p)) != cutlass::Status::kSuccess)
    throw std::logic_error("f16x3 GEMM: CUTLASS cannot implement an accepted shape");
  // What Gemm::initialize does, but the kernel's shared-memory opt-in (a driver call, several
  // µs of host time: docs/measurements.md, "Host cost per fused chain call") once per device
  // instead of on every launch. The split-K kernel's workspace initialization clears its
  // reduction flags (a memset on `stream`).
  allow_shared_storage<Kernel>();
  if (Kernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess)
    throw std::runtime_error("f16x3 GEMM: initialize failed");
  auto params = Kernel::to_underlying_arguments(args, workspace);
  if (Gemm::run(params, stream, nullptr, pdl) != cutlass::Status::kSuccess)
    throw std::runtime_error("f16x3 GEMM: launch failed");
  GF_LAUNCH_CHECK();
  return true;
}

}  // namespace
}  // namespace gemmfuse::cuda::sm90

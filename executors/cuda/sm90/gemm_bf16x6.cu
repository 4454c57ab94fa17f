// The fp32 GEMM on bf16 tensor cores (see gemm_bf16x6.h). CUTLASS's persistent cooperative
// kernel (GemmUniversal) with our mainloop (split_products_mainloop.h) and CUTLASS's TMA
// epilogue adding the bias per column.
//
// Tiles: 128x128x64, 2-CTA clusters along M (W tiles multicast). The promoting mainloop keeps
// two accumulators per thread, so a consumer warpgroup holds at most 64x128 of each (the
// 128x256 tiles of the bf16 GEMMs would need 256 registers for them alone).
//
// The products, smallest first (each promoted chunk is one product's; the large ones then
// add onto a sum that already holds the small ones): x1.w1, x0.w2, x2.w0, x0.w1, x1.w0, x0.w0.
#include "gemm_bf16x6.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cuda_check.h"
#include "device_info.h"
#include "env_switch.h"
#include "layout.h"

#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "split_products_mainloop.h"
#endif

namespace gemmfuse::cuda::sm90 {

// The kernel's output tiles are kTileMN x kTileMN (bf16x6_slower_than_sgemm counts them).
constexpr int kTileMN = 128;

#if defined(GEMMFUSE_WITH_SM90_KERNELS)

namespace {
using namespace cute;

using TileShape = Shape<Int<kTileMN>, Int<kTileMN>, _64>;
using ClusterShape = Shape<_2, _1, _1>;
using Schedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
constexpr int kAlignIn = 8, kAlignOut = 4;  // bf16 / fp32 elements per 16 bytes
using Bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, RowMajor, kAlignOut, float,
    RowMajor, kAlignOut, EpilogueSchedule,
    cutlass::epilogue::fusion::LinCombPerColBias<float, float, float>>::CollectiveOp;
// x [M,K] row-major is A K-major; W [N,K] row-major is B K-major ("column-major" K x N).
using Built = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, kAlignIn, Bf16,
    ColumnMajor, kAlignIn, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    Schedule>::CollectiveOp;
constexpr int kParts = 3, kProducts = 6;
constexpr int8_t kPartA[kProducts] = {1, 0, 2, 0, 1, 0};
constexpr int8_t kPartB[kProducts] = {1, 2, 0, 1, 0, 0};
using Mainloop = SplitProductsMainloop<Built, Schedule, kParts, kProducts>;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

// wgmma k-blocks per k-tile (bf16 wgmma takes 16 of K).
constexpr int kMmasPerKTile = size<2>(TileShape{}) / 16;

// Promote every 2 k-tiles (128 of K: the least error among 32 to 512 in the TF32 probe,
// bench/NOTES.md session 18), or every k-tile so that chunks end where a product's k-tiles do.
uint32_t promotion_interval(int k) {
  const int g = Mainloop::k_tiles(k) % 2 == 0 ? 2 : 1;
  return static_cast<uint32_t>(g * kMmasPerKTile);
}

// The stride of a packed row-major [rows, cols] operand (batch of one): (cols, 1, rows*cols).
template <class Stride>
Stride packed(int64_t rows, int64_t cols) {
  static_assert(cute::is_static<cute::tuple_element_t<1, Stride>>::value, "unit stride along cols");
  Stride s{};
  get<0>(s) = cols;
  get<2>(s) = rows * cols;
  return s;
}

typename Gemm::Arguments arguments(const Bf16x6Problem& p) {
  using SA = typename Kernel::StrideA;
  using SB = typename Kernel::StrideB;
  using SC = typename Kernel::StrideC;
  using SD = typename Kernel::StrideD;
  const int M = static_cast<int>(p.M), N = static_cast<int>(p.N), K = static_cast<int>(p.K);
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {M, N, Mainloop::k_prime(K), 1};
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
  args.mainloop.mma_promotion_interval = promotion_interval(K);
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = packed<SC>(M, N);
  args.epilogue.ptr_D = p.y;
  args.epilogue.dD = packed<SD>(M, N);
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.thread.bias_ptr = p.bias;
  return args;
}

}  // namespace

bool bf16x6_built() { return true; }

const char* bf16x6_unfit(int64_t M, int64_t N, int64_t K) {
  // GEMMFUSE_BF16X6=0 in the environment leaves fp32 GEMMs on SGEMM (A/B timing).
  static const bool enabled = !env_switched_off("GEMMFUSE_BF16X6");
  static_assert(kBf16x6MinRows == 256, "update the message below");
  if (!enabled) return "switched off (GEMMFUSE_BF16X6=0)";
  if (M < kBf16x6MinRows) return "fewer than 256 rows (SGEMM is faster there)";
  if (K % 8 != 0 || N % 4 != 0) return "K must be a multiple of 8 and N of 4 (16-byte TMA rows)";
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX / 8)  // K' = 6K (rounded up) is an int
    return "a dimension past the kernel's 32-bit problem shape";
  if (compute_capability() != 90) return "needs an sm_90 GPU (an H100 or H200)";
  return nullptr;
}

bool launch_bf16x6_gemm(const Bf16x6Problem& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  if (!aligned16(p.x_parts) || !aligned16(p.w_parts) || !aligned16(p.y) || !aligned16(workspace) ||
      (p.bias != nullptr && !aligned16(p.bias)))
    return false;
  const auto args = arguments(p);
  if (Gemm::get_workspace_size(args) > workspace_bytes) return false;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    throw std::logic_error("bf16x6 GEMM: CUTLASS cannot implement an accepted shape");
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
    throw std::runtime_error("bf16x6 GEMM: initialize failed");
  // Programmatic (PDL): the kernel is built with CUTLASS_ENABLE_GDC_FOR_SM90, so its load
  // warps wait for the x split before reading, and it lets the fix-up be scheduled at its
  // last tile (programmatic_launch.h). No CTA waits for another, so capture is safe too.
  if (gemm.run(stream, nullptr, /*launch_with_pdl=*/true) != cutlass::Status::kSuccess)
    throw std::runtime_error("bf16x6 GEMM: launch failed");
  GF_LAUNCH_CHECK();
  return true;
}

#else  // built without the sm90 kernels (no CUTLASS headers)

bool bf16x6_built() { return false; }

const char* bf16x6_unfit(int64_t, int64_t, int64_t) {
  return "built without the sm90 kernels (the nvidia-cutlass package was not found)";
}

bool launch_bf16x6_gemm(const Bf16x6Problem&, void*, size_t, cudaStream_t) {
  throw std::logic_error("bf16x6 GEMM: built without the sm90 kernels");
}

#endif

const char* bf16x6_slower_than_sgemm(int64_t M, int64_t N, int64_t K, int sms) {
  const double m = double(M), n = double(N), k = double(K);
  const double tiles = std::ceil(m / kTileMN) * std::ceil(n / kTileMN);
  const double waves = std::ceil(tiles / std::max(sms, 1));
  const double bf16x6_s = 10 * m * k / 2.2e12 + waves * k * 38e-9 + 5e-6;
  const double flops = 2 * m * n * k, sgemm_s = flops / 45e12;
  // Smaller GEMMs are bound by host work, and the kernel's (three launches, CUTLASS's TMA
  // descriptors) is the larger: 0.87x eager at 256 x 8192 x 256 on an H100.
  if (bf16x6_s < sgemm_s && flops > kHostBoundGemmFlops) return nullptr;
  return "SGEMM is faster at this shape (the kernel's 128x128 tiles would leave SMs idle, or "
         "its split of x, launches and host work outweigh the GEMM)";
}

const char* bf16x6_declines(int64_t M, int64_t N, int64_t K) {
  if (const char* why = bf16x6_unfit(M, N, K)) return why;
  return bf16x6_slower_than_sgemm(M, N, K, sm_count());
}

}  // namespace gemmfuse::cuda::sm90

// The f16x3 kernel's rules (selection.h): which shapes it takes here, how many ranges K is
// cut into, and the cost model against SGEMM. The model's constants are fitted to H100
// measurements: docs/measurements.md, "Planner rules and the measurements they rest on"
// (`fp32` GEMM kernel choice; bench/micro/fp32_path_sweep.py times both paths over shapes,
// bench/micro/f16x3_probe.cu the kernel's phases).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "selection.h"

namespace gemmfuse::cuda {

namespace {

// The cost model's throughputs (the section named above).
constexpr double kSplitBytesPerSecond = 1.8e12;  // the x split: 8 bytes per x value
constexpr double kTileProductSecondsPerK = 17e-9;  // one 128x128 tile's three products per unit of K
constexpr double kPartsBytesPerSecond = 2.2e12;  // reading W's fp16 parts: 4 bytes per W value
constexpr double kFixedSeconds = 5e-6;           // the fix-up and launch gaps
constexpr double kSgemmFlopsPerSecond = 45e12;   // SGEMM, M rounded up to its 64-row tiles
constexpr double kCopyBytesPerSecond = 2.6e12;   // the padded Y's copy into place (read + write)
constexpr int64_t kSgemmTileRows = 64;

}  // namespace

int f16x3_splits(int64_t M, int64_t N, int sms) {
  const int64_t m_tiles = (M + kF16x3TileMN - 1) / kF16x3TileMN;
  const int64_t tiles = m_tiles * ((N + kF16x3TileMN - 1) / kF16x3TileMN);
  if (2 * tiles > sms && m_tiles > 1) return 1;
  return static_cast<int>(std::clamp<int64_t>(sms / tiles, 2, kF16x3MaxSplits));
}

F16x3Cost f16x3_cost(int64_t M, int64_t N, int64_t K, int sms, int64_t ldy) {
  F16x3Cost c;
  const double m = double(M), n = double(N), k = double(K);
  const double m_tiles = std::ceil(m / kF16x3TileMN), n_tiles = std::ceil(n / kF16x3TileMN);
  c.splits = f16x3_splits(M, N, sms);
  // The wide kernel's 2-CTA clusters pad M to an even number of tiles.
  const double ctas = c.splits > 1 ? m_tiles * n_tiles * c.splits : std::ceil(m_tiles / 2) * 2 * n_tiles;
  const double waves = std::ceil(ctas / std::max(sms, 1));
  const double products_s = waves * k * kTileProductSecondsPerK / c.splits;
  const double w_reads_s = 4 * n * k / kPartsBytesPerSecond;
  c.f16x3_s = 8 * m * k / kSplitBytesPerSecond + std::max(products_s, w_reads_s) + kFixedSeconds;
  if (ldy > 0) c.f16x3_s += 8 * m * n / kCopyBytesPerSecond;
  c.flops = 2 * m * n * k;
  const double sgemm_rows = std::ceil(m / kSgemmTileRows) * kSgemmTileRows;
  c.sgemm_s = 2 * sgemm_rows * n * k / kSgemmFlopsPerSecond;
  return c;
}

const char* f16x3_slower_than_sgemm(int64_t M, int64_t N, int64_t K, int sms, int64_t ldy) {
  return f16x3_slower_than_sgemm(f16x3_cost(M, N, K, sms, ldy));
}

const char* f16x3_slower_than_sgemm(const F16x3Cost& c) {
  // Smaller GEMMs are bound by host work, and the kernel's (three launches, CUTLASS's TMA
  // descriptors) is the larger (kHostBoundGemmFlops, gemmfuse/plan.h).
  if (c.f16x3_s < c.sgemm_s && c.flops > kHostBoundGemmFlops) return nullptr;
  return "SGEMM is faster at this shape (the kernel's 128x128 tiles would leave SMs idle, reading "
         "W's two fp16 parts outweighs the products, or its split of x, launches and host work "
         "outweigh the GEMM)";
}

const char* f16x3_unfit(int64_t M, int64_t N, int64_t K, const DeviceFacts& d, const Overrides& o,
                        bool padded_n) {
  static_assert(kF16x3MinRows == 33 && kF16x3MinK == 128, "update the messages below");
  if (!d.sm90_kernels) return "built without the sm90 kernels (the nvidia-cutlass package was not found)";
  if (!o.f16x3) return "switched off (GEMMFUSE_F16X3=0)";
  if (M < kF16x3MinRows)
    return "at most 32 rows (bound by reading W: the small-M GEMM reads it once in fp32)";
  if (K < kF16x3MinK)
    return "K below 128 (the fp16 parts' rounding would not stay well under SGEMM's own error)";
  if (K % 8 != 0) return "K must be a multiple of 8 (16-byte TMA rows of x's and W's parts)";
  if (N % 4 != 0 && !padded_n)
    return o.f16x3_padded_n ? "N must be a multiple of 4 (16-byte TMA rows of the output)"
                            : "N must be a multiple of 4 (16-byte TMA rows of the output; "
                              "GEMMFUSE_F16X3_PADDED_N=1 writes padded rows and copies them)";
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX / 8)  // CUTLASS's int problem shape
    return "a dimension past the kernel's 32-bit problem shape";
  if (d.compute_capability != 90) return "needs an sm_90 GPU (an H100 or H200)";
  return nullptr;
}

int64_t f16x3_padded_ldy(int64_t N, const Overrides& o) {
  return N % 4 != 0 && o.f16x3_padded_n ? (N + 3) / 4 * 4 : 0;
}

const char* f16x3_declines(int64_t M, int64_t N, int64_t K, const DeviceFacts& d, const Overrides& o) {
  if (const char* why = f16x3_unfit(M, N, K, d, o)) return why;
  return f16x3_slower_than_sgemm(M, N, K, d.sms);
}

const char* f16x3_declines_mn_major(int64_t M, int64_t N, int64_t K, const DeviceFacts& d,
                                    const Overrides& o) {
  if (const char* why = f16x3_unfit(M, N, K, d, o)) return why;
  if (N % 8 != 0) return "N must be a multiple of 8 (16-byte TMA rows of W read MN-major)";
  return f16x3_slower_than_sgemm(M, N, K, d.sms);
}

const char* f16x3_weight_grad_declines(int64_t M, int64_t N, int64_t K, const DeviceFacts& d,
                                       const Overrides& o) {
  if (const char* why = f16x3_declines_mn_major(N, K, M, d, o)) return why;
  return N % 4 != 0 ? "N must be a multiple of 4 (dV's rows read as 16-byte vectors by its transposed split)"
                    : nullptr;
}

int64_t fast_min_rows(int64_t M, int64_t N, int64_t K, const DeviceFacts& d, const Overrides& o) {
  const int64_t rows = kF16x3TileMN;
  if (M > rows || M < kF16x3MinRows || f16x3_declines(M, N, K, d, o) != nullptr)
    return PlanRequest{}.fast_min_rows;
  return rows;
}

}  // namespace gemmfuse::cuda

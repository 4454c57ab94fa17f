// The fp32 GEMM on fp16 tensor cores (see gemm_f16x3.h): which shapes it takes, how many
// ranges K is split into, and the wide kernel (f16x3_kernel.cuh; the split-K kernel is
// instantiated in gemm_f16x3_split_k.cu).
#include "gemm_f16x3.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "device_info.h"
#include "env_switch.h"
#include "layout.h"

#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#include "f16x3_kernel.cuh"
#include "gemm_f16x3_counted.h"
#include "gemm_f16x3_mn_major.h"
#include "gemm_f16x3_split_k.h"
#endif

namespace gemmfuse::cuda::sm90 {

#if defined(GEMMFUSE_WITH_SM90_KERNELS)

namespace {

int splits_of(const F16x3Problem& p) {
  return p.splits > 0 ? p.splits : f16x3_splits(p.M, p.N, sm_count());
}

}  // namespace

bool f16x3_built() { return true; }

const char* f16x3_unfit(int64_t M, int64_t N, int64_t K) {
  // GEMMFUSE_F16X3=0 in the environment leaves fp32 GEMMs on SGEMM (A/B timing).
  static const bool enabled = !env_switched_off("GEMMFUSE_F16X3");
  static_assert(kF16x3MinRows == 33 && kF16x3MinK == 128, "update the messages below");
  if (!enabled) return "switched off (GEMMFUSE_F16X3=0)";
  if (M < kF16x3MinRows)
    return "at most 32 rows (bound by reading W: the small-M GEMM reads it once in fp32)";
  if (K < kF16x3MinK)
    return "K below 128 (the fp16 parts' rounding would not stay well under SGEMM's own error)";
  if (K % 8 != 0 || N % 4 != 0) return "K must be a multiple of 8 and N of 4 (16-byte TMA rows)";
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX / 8)  // CUTLASS's int problem shape
    return "a dimension past the kernel's 32-bit problem shape";
  if (compute_capability() != 90) return "needs an sm_90 GPU (an H100 or H200)";
  return nullptr;
}

size_t f16x3_workspace_bytes(int64_t M, int64_t N, int64_t K, bool w_mn_major) {
  F16x3Problem p;
  p.M = M;
  p.N = N;
  p.K = K;
  const int splits = splits_of(p);
  if (w_mn_major) return f16x3_mn_major_workspace_bytes(p, splits);
  return splits > 1 ? f16x3_split_k_workspace_bytes(p, splits) : workspace_size<Wide>(p, 1);
}

bool launch_f16x3_gemm(const F16x3Problem& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  if (!aligned16(p.x_parts) || !aligned16(p.w_parts) || !aligned16(p.x_exps) || !aligned16(p.w_exps) ||
      !aligned16(p.y) || !aligned16(workspace) || (p.bias != nullptr && !aligned16(p.bias)))
    return false;
  if (p.w_mn_major) {
    if (p.N % 8 != 0) return false;
    return launch_f16x3_mn_major(p, splits_of(p), workspace, workspace_bytes, stream);
  }
  if (p.rows) return launch_f16x3_counted(p, workspace, workspace_bytes, stream);
  const int splits = splits_of(p);
  if (splits > 1) return launch_f16x3_split_k(p, splits, workspace, workspace_bytes, stream);
  // Programmatic (PDL): this file is built with CUTLASS_ENABLE_GDC_FOR_SM90, so the kernel's
  // load warps wait for the x split before reading, and it lets the fix-up be scheduled at
  // its last tile (programmatic_launch.h). No CTA waits for another, so capture is safe too.
  return launch<Wide>(p, 1, workspace, workspace_bytes, stream, /*pdl=*/true);
}

#else  // built without the sm90 kernels (no CUTLASS headers)

bool f16x3_built() { return false; }

const char* f16x3_unfit(int64_t, int64_t, int64_t) {
  return "built without the sm90 kernels (the nvidia-cutlass package was not found)";
}

size_t f16x3_workspace_bytes(int64_t, int64_t, int64_t, bool) { return 0; }

bool launch_f16x3_gemm(const F16x3Problem&, void*, size_t, cudaStream_t) {
  throw std::logic_error("f16x3 GEMM: built without the sm90 kernels");
}

#endif

int f16x3_splits(int64_t M, int64_t N, int sms) {
  const int64_t m_tiles = (M + kF16x3TileMN - 1) / kF16x3TileMN;
  const int64_t tiles = m_tiles * ((N + kF16x3TileMN - 1) / kF16x3TileMN);
  if (2 * tiles > sms && m_tiles > 1) return 1;
  return static_cast<int>(std::clamp<int64_t>(sms / tiles, 2, kF16x3MaxSplits));
}

const char* f16x3_slower_than_sgemm(int64_t M, int64_t N, int64_t K, int sms) {
  const double m = double(M), n = double(N), k = double(K);
  const double m_tiles = std::ceil(m / kF16x3TileMN), n_tiles = std::ceil(n / kF16x3TileMN);
  const int splits = f16x3_splits(M, N, sms);
  // The wide kernel's 2-CTA clusters pad M to an even number of tiles.
  const double ctas = splits > 1 ? m_tiles * n_tiles * splits : std::ceil(m_tiles / 2) * 2 * n_tiles;
  const double waves = std::ceil(ctas / std::max(sms, 1));
  const double products_s = waves * k * 17e-9 / splits, w_reads_s = 4 * n * k / 2.2e12;
  const double f16x3_s = 8 * m * k / 1.8e12 + std::max(products_s, w_reads_s) + 5e-6;
  // SGEMM's tiles are at least 64 rows: 0.218 ms at both 32 and 64 rows of 8192 x 8192.
  const double flops = 2 * m * n * k, sgemm_s = 2 * std::ceil(m / 64) * 64 * n * k / 45e12;
  // Smaller GEMMs are bound by host work, and the kernel's (three launches, CUTLASS's TMA
  // descriptors) is the larger: 0.87x eager at 256 x 8192 x 256 on an H100, 0.77x SGEMM at
  // 256 x 1024 x 1024, 0.97x at 256 x 256 x 8192 (docs/measurements.md).
  if (f16x3_s < sgemm_s && flops > kHostBoundGemmFlops) return nullptr;
  return "SGEMM is faster at this shape (the kernel's 128x128 tiles would leave SMs idle, reading "
         "W's two fp16 parts outweighs the products, or its split of x, launches and host work "
         "outweigh the GEMM)";
}

const char* f16x3_declines(int64_t M, int64_t N, int64_t K) {
  if (const char* why = f16x3_unfit(M, N, K)) return why;
  return f16x3_slower_than_sgemm(M, N, K, sm_count());
}

const char* f16x3_declines_mn_major(int64_t M, int64_t N, int64_t K) {
  if (const char* why = f16x3_unfit(M, N, K)) return why;
  if (N % 8 != 0) return "N must be a multiple of 8 (16-byte TMA rows of W read MN-major)";
  return f16x3_slower_than_sgemm(M, N, K, sm_count());
}

}  // namespace gemmfuse::cuda::sm90

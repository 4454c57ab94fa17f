// The fp32 GEMM on bf16 tensor cores (see gemm_bf16x6.h): which shapes it takes, how many
// ranges K is split into, and the wide kernel (bf16x6_kernel.cuh; the split-K kernel is
// instantiated in gemm_bf16x6_split_k.cu).
#include "gemm_bf16x6.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "device_info.h"
#include "env_switch.h"
#include "layout.h"

#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#include "bf16x6_kernel.cuh"
#include "gemm_bf16x6_split_k.h"
#endif

namespace gemmfuse::cuda::sm90 {

#if defined(GEMMFUSE_WITH_SM90_KERNELS)

namespace {

int splits_of(const Bf16x6Problem& p) {
  return p.splits > 0 ? p.splits : bf16x6_splits(p.M, p.N, sm_count());
}

}  // namespace

bool bf16x6_built() { return true; }

const char* bf16x6_unfit(int64_t M, int64_t N, int64_t K) {
  // GEMMFUSE_BF16X6=0 in the environment leaves fp32 GEMMs on SGEMM (A/B timing).
  static const bool enabled = !env_switched_off("GEMMFUSE_BF16X6");
  static_assert(kBf16x6MinRows == 33, "update the message below");
  if (!enabled) return "switched off (GEMMFUSE_BF16X6=0)";
  if (M < kBf16x6MinRows)
    return "at most 32 rows (bound by reading W: the small-M GEMM reads it once in fp32)";
  if (K % 8 != 0 || N % 4 != 0) return "K must be a multiple of 8 and N of 4 (16-byte TMA rows)";
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX / 8)  // CUTLASS's int problem shape
    return "a dimension past the kernel's 32-bit problem shape";
  if (compute_capability() != 90) return "needs an sm_90 GPU (an H100 or H200)";
  return nullptr;
}

size_t bf16x6_workspace_bytes(int64_t M, int64_t N, int64_t K) {
  Bf16x6Problem p;
  p.M = M;
  p.N = N;
  p.K = K;
  const int splits = splits_of(p);
  return splits > 1 ? bf16x6_split_k_workspace_bytes(p, splits) : workspace_size<Wide>(p, 1);
}

bool launch_bf16x6_gemm(const Bf16x6Problem& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  if (!aligned16(p.x_parts) || !aligned16(p.w_parts) || !aligned16(p.y) || !aligned16(workspace) ||
      (p.bias != nullptr && !aligned16(p.bias)))
    return false;
  const int splits = splits_of(p);
  if (splits > 1) return launch_bf16x6_split_k(p, splits, workspace, workspace_bytes, stream);
  // Programmatic (PDL): this file is built with CUTLASS_ENABLE_GDC_FOR_SM90, so the kernel's
  // load warps wait for the x split before reading, and it lets the fix-up be scheduled at
  // its last tile (programmatic_launch.h). No CTA waits for another, so capture is safe too.
  return launch<Wide>(p, 1, workspace, workspace_bytes, stream, /*pdl=*/true);
}

#else  // built without the sm90 kernels (no CUTLASS headers)

bool bf16x6_built() { return false; }

const char* bf16x6_unfit(int64_t, int64_t, int64_t) {
  return "built without the sm90 kernels (the nvidia-cutlass package was not found)";
}

size_t bf16x6_workspace_bytes(int64_t, int64_t, int64_t) { return 0; }

bool launch_bf16x6_gemm(const Bf16x6Problem&, void*, size_t, cudaStream_t) {
  throw std::logic_error("bf16x6 GEMM: built without the sm90 kernels");
}

#endif

int bf16x6_splits(int64_t M, int64_t N, int sms) {
  const int64_t m_tiles = (M + kBf16x6TileMN - 1) / kBf16x6TileMN;
  const int64_t tiles = m_tiles * ((N + kBf16x6TileMN - 1) / kBf16x6TileMN);
  if (2 * tiles > sms && m_tiles > 1) return 1;
  return static_cast<int>(std::clamp<int64_t>(sms / tiles, 2, kBf16x6MaxSplits));
}

const char* bf16x6_slower_than_sgemm(int64_t M, int64_t N, int64_t K, int sms) {
  const double m = double(M), n = double(N), k = double(K);
  const double m_tiles = std::ceil(m / kBf16x6TileMN), n_tiles = std::ceil(n / kBf16x6TileMN);
  const int splits = bf16x6_splits(M, N, sms);
  // The wide kernel's 2-CTA clusters pad M to an even number of tiles.
  const double ctas = splits > 1 ? m_tiles * n_tiles * splits : std::ceil(m_tiles / 2) * 2 * n_tiles;
  const double waves = std::ceil(ctas / std::max(sms, 1));
  const double products_s = waves * k * 38e-9 / splits, w_reads_s = 6 * n * k / 3.4e12;
  const double bf16x6_s = 10 * m * k / 2.2e12 + std::max(products_s, w_reads_s) + 5e-6;
  const double flops = 2 * m * n * k, sgemm_s = flops / 45e12;
  // Smaller GEMMs are bound by host work, and the kernel's (three launches, CUTLASS's TMA
  // descriptors) is the larger: 0.87x eager at 256 x 8192 x 256 on an H100.
  if (bf16x6_s < sgemm_s && flops > kHostBoundGemmFlops) return nullptr;
  return "SGEMM is faster at this shape (the kernel's 128x128 tiles would leave SMs idle, reading "
         "W's three bf16 parts outweighs the products, or its split of x, launches and host work "
         "outweigh the GEMM)";
}

const char* bf16x6_declines(int64_t M, int64_t N, int64_t K) {
  if (const char* why = bf16x6_unfit(M, N, K)) return why;
  return bf16x6_slower_than_sgemm(M, N, K, sm_count());
}

}  // namespace gemmfuse::cuda::sm90

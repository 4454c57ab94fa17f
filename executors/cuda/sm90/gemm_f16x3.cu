// The fp32 GEMM on fp16 tensor cores (see gemm_f16x3.h): its workspace and launch, and the
// wide kernel (f16x3_kernel.cuh; the split-K kernel is instantiated in gemm_f16x3_split_k.cu).
// Which shapes it takes and how many ranges K is cut into: the kernel selection (selection.h).
#include "gemm_f16x3.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "device_info.h"
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

// The caller's splits; 0 (tests and probes): the selection's rule for this device.
int splits_of(const F16x3Problem& p) {
  return p.splits > 0 ? p.splits : f16x3_splits(p.M, p.N, sm_count());
}

}  // namespace

bool f16x3_built() { return true; }

size_t f16x3_workspace_bytes(int64_t M, int64_t N, int64_t K, bool w_mn_major, int splits_in) {
  F16x3Problem p;
  p.M = M;
  p.N = N;
  p.K = K;
  p.splits = splits_in;
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

size_t f16x3_workspace_bytes(int64_t, int64_t, int64_t, bool, int) { return 0; }

bool launch_f16x3_gemm(const F16x3Problem&, void*, size_t, cudaStream_t) {
  throw std::logic_error("f16x3 GEMM: built without the sm90 kernels");
}

#endif

}  // namespace gemmfuse::cuda::sm90

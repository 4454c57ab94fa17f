// The split-K kernels (split_products_kernel.cuh), in a file of their own because they are
// built without programmatic dependent launch: CUTLASS 4.2's stream-K scheduler does not
// compile with CUTLASS_ENABLE_GDC_FOR_SM90 (its const is_last_tile, which only the GDC path
// calls, binds a member to a non-const reference). Without it the kernels' load warps do not
// wait on the grid before them, so they are launched as ordinary kernels, after the memset
// that clears their reduction flags.
//
// The CTAs of one tile add their partial sums into the workspace in K order, each waiting
// only for the ranges before its own, which run on CTAs of lower index (scheduled first:
// CUTLASS's stream-K design). bf16x6_splits sizes the grid to one CTA per SM besides.
#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#undef CUTLASS_ENABLE_GDC_FOR_SM90
#endif

#include "gemm_split_k.h"

#include <climits>
#include <stdexcept>

#include "device_info.h"
#include "env_switch.h"
#include "layout.h"
#include "split.h"

#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#include "split_products_kernel.cuh"
#endif

namespace gemmfuse::cuda::sm90 {

#if defined(GEMMFUSE_WITH_SM90_KERNELS)

namespace {

using Bf16x6SplitK = SplitKKernel<3, 6>;
using FastSplitK = SplitKKernel<2, 3>;

// x part 0 is xhi (segment 1 of [lo | hi | hi]), part 1 xlo (segment 0); W's part 0 is Whi
// (segment 0 of [hi | lo | hi]), part 1 Wlo (segment 1). Products: xlo.Whi, xhi.Wlo, xhi.Whi.
PartProducts<2, 3> fast_operands(const FastSplitProblem& p) {
  PartProducts<2, 3> o;
  o.M = p.M;
  o.N = p.N;
  o.K = p.Kh;
  o.x[0] = p.x_split + p.Kh;
  o.x[1] = p.x_split;
  o.w[0] = p.w_split;
  o.w[1] = p.w_split + p.Kh;
  o.ldx = o.ldw = kFastSplitSegments * p.Kh;
  constexpr int8_t a[3] = {1, 0, 0}, b[3] = {0, 1, 0};
  for (int i = 0; i < 3; ++i) {
    o.part_a[i] = a[i];
    o.part_b[i] = b[i];
  }
  o.bias = p.bias;
  o.y = p.y;
  return o;
}

}  // namespace

size_t bf16x6_split_k_workspace_bytes(const Bf16x6Problem& p, int splits) {
  return workspace_size<Bf16x6SplitK>(bf16x6_operands(p), splits);
}

bool launch_bf16x6_split_k(const Bf16x6Problem& p, int splits, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  return launch<Bf16x6SplitK>(bf16x6_operands(p), splits, workspace, workspace_bytes, stream,
                              /*pdl=*/false);
}

const char* fast_split_k_declines(int64_t M, int64_t N, int64_t Kh) {
  // GEMMFUSE_FAST_SPLIT_K=0 in the environment leaves `fast` on cuBLAS (A/B timing).
  static const bool enabled = !env_switched_off("GEMMFUSE_FAST_SPLIT_K");
  if (!enabled) return "switched off (GEMMFUSE_FAST_SPLIT_K=0)";
  if (bf16x6_splits(M, N, sm_count()) < 2) return "the output tiles fill the GPU";
  if (M > INT32_MAX || N > INT32_MAX || Kh > INT32_MAX / 4)  // K' = 3 Kh (rounded up) is an int
    return "a dimension past the kernel's 32-bit problem shape";
  if (compute_capability() != 90) return "needs an sm_90 GPU (an H100 or H200)";
  return nullptr;
}

size_t fast_split_k_workspace_bytes(int64_t M, int64_t N, int64_t Kh) {
  FastSplitProblem p;
  p.M = M;
  p.N = N;
  p.Kh = Kh;
  return workspace_size<FastSplitK>(fast_operands(p), bf16x6_splits(M, N, sm_count()));
}

bool launch_fast_split_k(const FastSplitProblem& p, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) {
  if (!aligned16(p.x_split) || !aligned16(p.w_split) || !aligned16(p.y) || !aligned16(workspace) ||
      (p.bias != nullptr && !aligned16(p.bias)))
    return false;
  return launch<FastSplitK>(fast_operands(p), bf16x6_splits(p.M, p.N, sm_count()), workspace,
                            workspace_bytes, stream, /*pdl=*/false);
}

#else  // built without the sm90 kernels (no CUTLASS headers)

const char* fast_split_k_declines(int64_t, int64_t, int64_t) {
  return "built without the sm90 kernels (the nvidia-cutlass package was not found)";
}

size_t fast_split_k_workspace_bytes(int64_t, int64_t, int64_t) { return 0; }

bool launch_fast_split_k(const FastSplitProblem&, void*, size_t, cudaStream_t) {
  throw std::logic_error("fast split-K GEMM: built without the sm90 kernels");
}

#endif

}  // namespace gemmfuse::cuda::sm90

// When the CUDA executor runs a plan's Gemm and its RowPass as one kernel: a 16-bit model
// whose chain is Linear -> [gelu] -> [* a number] -> softmax goes to the sm90 fused
// kernel (sm90/gemm_softmax.h) when the device and the shape allow; otherwise the plan runs
// step by step (cuBLASLt, then the row program), with the same result to rounding.
#pragma once

#include <string>
#include <string_view>

#include "gemmfuse/plan.h"
#include "gemm_softmax.h"

namespace gemmfuse::cuda {

struct FusedSoftmax {
  bool matches = false;  // the plan has the shape above (independent of the device)
  std::string_view why;  // why not, when !matches (a literal: matching allocates nothing)
  sm90::Activation act = sm90::Activation::Identity;
  float scale = 1.f;
};
FusedSoftmax match_fused_softmax(const Plan& plan);

// "" when run() takes the fused kernel for this plan on the current device, else why not
// (`f`: the plan's match_fused_softmax, when the caller has it).
std::string fused_softmax_unused(const Plan& plan, const FusedSoftmax& f);
std::string fused_softmax_unused(const Plan& plan);

// Process-wide switch, for A/B timing and tests: on unless GEMMFUSE_FUSED_SOFTMAX=0 is set
// in the environment. (The kernel's CTAs wait for each other's row statistics, so it needs
// the whole GPU for itself while it runs: launched only for grids the idle GPU holds, ordered
// after its own launches on other streams, and cooperative under MPS or graph capture, where
// it fails rather than waits when the GPU cannot hold the grid.) Not while other threads run
// plans: a plan's workspace size depends on it (CudaExecutor::workspace_bytes), so
// workspace_bytes and run must see the same setting.
void set_fused_softmax(bool on);
bool fused_softmax_enabled();

}  // namespace gemmfuse::cuda

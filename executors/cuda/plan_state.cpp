// The CUDA executor's per-plan state (plan_state.h).
#include "plan_state.h"

#include <cuda_runtime.h>

#include "device_facts.h"
#include "gemm_softmax.h"

namespace gemmfuse::cuda {

namespace {

PlanState make_state(const Plan& plan, const BackwardPlan* bp, const Overrides& o) {
  PlanState s;
  s.sel = select(plan, bp, device_facts(&plan), o);
  s.prepared = prepared_layout(plan, s.sel);
  s.workspace = workspace_layout(plan, s.sel);
  // Y and cuBLASLt's workspace are not allocated for a call the fused kernel computes.
  if (s.sel.fused.used) s.fused_workspace = sm90::gemm_softmax_workspace_bytes(plan.M, plan.N);
  if (bp != nullptr) s.backward_workspace = backward_layout(plan, *bp, s.sel.backward);
  s.M = plan.M;
  s.N = plan.N;
  s.K = plan.K;
  s.steps = plan.steps.size();
  s.dtype = plan.dtype;
  s.precision = plan.precision;
  return s;
}

}  // namespace

std::shared_ptr<const PlanState> plan_state(const Plan& plan, const BackwardPlan* bp) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    dev = 0;
  }
  const Overrides o = current_overrides();
  auto fresh = [&](const PlanState& s) {
    return s.sel.overrides == o && s.M == plan.M && s.N == plan.N && s.K == plan.K &&
           s.steps == plan.steps.size() && s.dtype == plan.dtype && s.precision == plan.precision;
  };
  const uint64_t key = static_cast<uint64_t>(dev) * 2 + (bp != nullptr ? 1 : 0);
  return plan.memo.get<PlanState>(key, fresh, [&] { return make_state(plan, bp, o); });
}

}  // namespace gemmfuse::cuda

// The CUDA executor's state of one plan on one device: its Selection (selection.h) and the
// memory layouts that follow from it (layout.h; backward_layout.h for the state made with a
// BackwardPlan), made once and kept with the plan
// (Plan::memo), remade where the overrides have changed since (tests switch them). Every
// step of prepare/run/backward reads its choices from here.
#pragma once

#include <memory>

#include "gemmfuse/backward.h"
#include "backward_layout.h"
#include "gemmfuse/plan.h"
#include "layout.h"
#include "selection.h"

namespace gemmfuse::cuda {

struct PlanState {
  Selection sel;
  PreparedLayout prepared;
  WorkspaceLayout workspace;
  size_t fused_workspace = 0;  // the fused kernel's workspace where sel.fused.used, else 0
  BackwardLayout backward_workspace;  // the backward's scratch where made with a BackwardPlan
  // What the state was made from: a plan changed after its first run is selected again.
  int64_t M = 0, N = 0, K = 0;
  size_t steps = 0;
  DType dtype = DType::F32;
  Precision precision = Precision::FP32;
};

// The plan's state on the current device; with `bp`, the Selection covers its backward too.
std::shared_ptr<const PlanState> plan_state(const Plan& plan, const BackwardPlan* bp = nullptr);

}  // namespace gemmfuse::cuda

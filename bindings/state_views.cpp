// BatchNorm state handed to executors: fp32 running stats and int64 counters, converted (and
// copied back after the run) only when the module keeps them in another dtype or layout.
#include <ATen/ATen.h>

#include "run_call.h"

namespace gemmfuse::bindings {

StateViews::StateViews(at::TensorList state) {
  for (const auto& s : state) {
    const bool counter = s.scalar_type() == at::kLong;
    at::Tensor v = counter ? s : s.to(at::kFloat);
    if (!v.is_contiguous()) v = v.contiguous();
    if (!v.is_same(s)) copy_back.emplace_back(s, v);
    views.push_back(v);
    pointers.push_back(v.data_ptr());
  }
}

void StateViews::finish(const Plan& plan, at::TensorList state) {
  for (auto& [orig, conv] : copy_back) orig.copy_(conv);
  bool written = false;
  for (const auto& step : plan.steps) {
    written = written || (step.kind == Step::Kind::ColumnStats && step.input >= 0 &&
                          step.node.running_mean.present());
  }
  if (!written) return;
  for (const auto& s : state) {
    if (!s.is_inference()) s.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace gemmfuse::bindings

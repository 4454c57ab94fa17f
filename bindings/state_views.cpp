// BatchNorm state handed to executors: running stats in fp32 (or bf16/fp16 for an executor
// that reads them natively) and int64 counters, converted (and copied back after the run) only
// when the executor cannot take the module's dtype or layout.
#include <ATen/ATen.h>

#include "run_call.h"

namespace gemmfuse::bindings {

StateViews::StateViews(at::TensorList state, Native16Bit native) {
  for (const auto& s : state) {
    const auto st = s.scalar_type();
    const bool counter = st == at::kLong;
    const bool keep = counter || st == at::kFloat ||
                      (native == Native16Bit::Yes && (st == at::kBFloat16 || st == at::kHalf));
    at::Tensor v = keep ? s : s.to(at::kFloat);
    if (!v.is_contiguous()) v = v.contiguous();
    if (!v.is_same(s)) copy_back.emplace_back(s, v);
    views.push_back(v);
    pointers.push_back(v.data_ptr());
    dtypes.push_back(v.scalar_type() == at::kBFloat16 ? DType::BF16
                     : v.scalar_type() == at::kHalf   ? DType::F16
                                                       : DType::F32);
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

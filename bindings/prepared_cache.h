// Prepared weights (column sums, folded BatchNorm, split-precision parts), built once per
// weight version. A version is the tensor's storage object and its autograd version counter,
// which every in-place update bumps: optimizer steps, load_state_dict, `with no_grad: w.mul_()`.
// (Writes through `w.data` bypass the counter — PyTorch gives them a fresh one — and are not
// seen; docs/design.md says so.)
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "gemmfuse/executor.h"

namespace gemmfuse::bindings {

// Returns the prepared bytes for this plan and these tensors, preparing them (on the
// executor's stream) when missing or when any tensor they were built from has changed.
// An empty tensor when the plan needs no preparation. With `keep` false (a weight that
// changes every call) the bytes are prepared for this call alone and not kept.
at::Tensor prepared_for(const Plan& plan, Executor& executor,
                        const RunArgs& args, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, at::TensorList operands,
                        at::TensorList state, bool keep = true);

// The prepared bytes of this plan and weight for the caller to overwrite (the backward's
// Executor::backward_weight_bytes), when they exist and hold at least `bytes`; the entry is
// then stale, and the next prepared_for prepares it again. Else an undefined tensor.
at::Tensor borrow_prepared(const Plan& plan, const at::Tensor& weight, size_t bytes);

}  // namespace gemmfuse::bindings

// From a call's tensors to a Plan, cached: parsing and planning run once per
// (spec, shapes, dtype, precision, device type), a map lookup after that.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "gemmfuse/backward.h"
#include "gemmfuse/chain.h"
#include "gemmfuse/plan.h"

namespace gemmfuse::bindings {

// The parsed spec (cached by text). Throws c10::Error on a malformed spec.
std::shared_ptr<const Chain> chain_for(const std::string& spec);

// Checks the call as PyTorch's F.linear would (same messages where PyTorch has one), then
// returns its plan. Plans are cached per (spec, shapes, dtype, precision, device) and never
// freed, so the reference stays valid. Refused chains raise "gemmfuse unsupported: <reason>".
// `for_training`: the plan of gemmfuse::train_forward / train_backward (PlanRequest's).
const Plan& plan_for(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias, at::TensorList operands,
                     at::TensorList state, c10::string_view precision, bool for_training = false);

// The backward plan of a training plan (plan_for(..., true)), made once per plan and kept as
// long as it. Throws Unsupported where gemmfuse builds no backward.
const BackwardPlan& backward_plan_for(const Plan& plan);

// Output shape of the chain for input x (leading dims of x, then the output width unless a
// keepdim=false reduction dropped it). Used by the Meta kernel and by run.
std::vector<int64_t> output_shape(const Chain& chain, at::IntArrayRef x_sizes);

DType dtype_of(const at::Tensor& t);

}  // namespace gemmfuse::bindings

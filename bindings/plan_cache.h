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

// The same for sizes that may be symbolic (the fake kernels under torch.compile's dynamic
// shapes).
c10::SymDimVector output_sym_shape(const Chain& chain, c10::SymIntArrayRef x_sizes);

// A tensor of t's dtype on the meta device whose symbolic sizes are replaced by `stand_in`
// (t itself where every size is known): plans are made for concrete shapes only.
at::Tensor concrete_stand_in(const at::Tensor& t, int64_t stand_in);

DType dtype_of(const at::Tensor& t);

// Fused calls per spec text in this process: counted by each forward the host issues
// (`training`: the forward of a call autograd records); replays of a CUDA graph are not seen.
void count_call(const Plan& plan, bool training);
std::vector<int64_t> calls_of(const std::string& spec);  // {forward calls, training calls}

}  // namespace gemmfuse::bindings

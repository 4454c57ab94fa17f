// One call of gemmfuse::run on a device: tensors in, the executor's RunArgs, the output.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include <functional>
#include <vector>

#include "gemmfuse/executor.h"
#include "gemmfuse/plan.h"

namespace gemmfuse::bindings {

// Prepared bytes a caller keeps across the products of one call that share a weight tensor
// and a plan (linear_cross_entropy's chunks): made by the first, read by the others.
struct PreparedSlot {
  const Plan* plan = nullptr;
  at::Tensor bytes;
};

// The op's arguments, by reference: a CallInputs lives only for the call that made it.
struct CallInputs {
  c10::string_view spec;
  const at::Tensor& x;
  const at::Tensor& weight;
  const c10::optional<at::Tensor>& bias;
  at::TensorList operands, state;
  c10::string_view precision;
  bool for_training = false;  // gemmfuse::train_forward: the training plan, args.saved filled
  // false: the weight changes every call (gemmfuse::linear with keep_weight=False), so its
  // preparation is made for this call and not kept (prepared_cache.h).
  bool keep_prepared = true;
  // Where the output goes (contiguous, of the output's shape and dtype: a batch's slice,
  // gemmfuse::bmm), or null: a new tensor.
  const at::Tensor* out = nullptr;
  // With keep_prepared false: where the call's prepared bytes are kept for the caller's next
  // product with the same weight tensor (unchanged meanwhile) and plan, or null.
  PreparedSlot* prepared_slot = nullptr;
};

// The call's tensors as an executor wants them (dtype, contiguity).
struct CallTensors {
  at::Tensor x, weight, bias;
  std::vector<at::Tensor> operands;
};

// The state tensors as executors want them (running statistics in fp32, or also bf16/fp16
// where the executor reads those natively; int64 counters), with a copy-back for any that
// had to be converted.
struct StateViews {
  enum class Native16Bit { No, Yes };
  std::vector<at::Tensor> views;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (original, converted)
  std::vector<void*> pointers;
  std::vector<DType> dtypes;
  StateViews(at::TensorList state, Native16Bit native);
  // Copies converted state back and bumps the version counters of state the plan wrote
  // (custom ops get no ADInplaceOrView kernel, so nobody else does; caches keyed on
  // _version, such as the eval BatchNorm fold, depend on it).
  void finish(const Plan& plan, at::TensorList state);
};

// What every device does the same way: plan, output shape, RunArgs, prepared weights,
// workspace, run, state write-back. `convert` gives the tensors in the executor's form;
// `args` comes with the device's own fields set (stream, cpu_gemm); `native` says whether
// the executor reads 16-bit running statistics itself.
at::Tensor execute(Executor& executor, const CallInputs& in,
                   const std::function<CallTensors()>& convert, RunArgs args,
                   StateViews::Native16Bit native);

// With in.for_training (train_forward): `saved` (BackwardPlan::saved) is filled for the
// backward and the running statistics are left alone.
at::Tensor run_on_cpu(const CallInputs& in, float* saved = nullptr);
#ifdef GEMMFUSE_WITH_CUDA
at::Tensor run_on_cuda(const CallInputs& in, float* saved = nullptr);
#endif

// The gradients of a training plan on the inputs' device (train_ops.cpp).
std::vector<at::Tensor> backward_on_device(const CallInputs& in, const at::Tensor& grad_out,
                                           const at::Tensor& saved, const std::vector<bool>& needs);

}  // namespace gemmfuse::bindings

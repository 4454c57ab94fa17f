#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include "plan_cache.h"
#include "prepared_cache.h"
#include "run_call.h"

namespace gemmfuse::bindings {
namespace {

// The call's prepared bytes: the caller's slot's where it holds this plan's, else made
// (prepared_cache.h) and, with a slot, left there for the caller's next product.
at::Tensor prepared_bytes(const Plan& plan, Executor& executor, const RunArgs& args,
                          const CallInputs& in) {
  PreparedSlot* slot = in.keep_prepared ? nullptr : in.prepared_slot;
  if (slot != nullptr && slot->plan == &plan) return slot->bytes;
  at::Tensor bytes = prepared_for(plan, executor, args, in.weight, in.bias, in.operands, in.state,
                                  in.keep_prepared);
  if (slot != nullptr) *slot = {&plan, bytes};
  return bytes;
}

}  // namespace

at::Tensor execute(Executor& executor, const CallInputs& in,
                   const std::function<CallTensors()>& convert, RunArgs args,
                   StateViews::Native16Bit native) {
  const Plan& plan = plan_for(in.spec, in.x, in.weight, in.bias, in.operands, in.state,
                              in.precision, in.for_training);
  count_call(plan, in.for_training);
  c10::SmallVector<int64_t, 5> shape(in.x.sizes().begin(), in.x.sizes().end() - 1);
  if (plan.out_has_feature_dim) shape.push_back(plan.out_width);
  if (plan.M == 0) return at::empty(shape, in.x.options());

  const CallTensors t = convert();
  StateViews state(in.state, native);
  // [M, out_width] in memory, allocated in the caller's shape (no view op per call), or the
  // caller's.
  at::Tensor out = in.out ? *in.out : at::empty(shape, t.x.options());
  TORCH_INTERNAL_ASSERT(!in.out || (out.is_contiguous() && out.sizes() == c10::IntArrayRef(shape) &&
                                    out.scalar_type() == t.x.scalar_type()),
                        "gemmfuse: a caller's output of another shape, dtype or layout");
  args.x = t.x.data_ptr();
  args.weight = t.weight.data_ptr();
  args.bias = t.bias.defined() ? t.bias.data_ptr() : nullptr;
  for (const auto& o : t.operands) args.operands.push_back(o.data_ptr<float>());
  args.state = state.pointers;
  args.state_dtypes = state.dtypes;
  args.out = out.data_ptr();
  args.update_state = !in.for_training;
  if (args.saved) args.backward = &backward_plan_for(plan);

  at::Tensor prepared = prepared_bytes(plan, executor, args, in);
  const auto ws_bytes = static_cast<int64_t>(executor.workspace_bytes(plan));
  at::Tensor workspace =
      ws_bytes > 0 ? at::empty({ws_bytes}, t.x.options().dtype(at::kByte)) : at::Tensor();
  executor.run(plan, args, prepared.defined() ? prepared.data_ptr() : nullptr,
               workspace.defined() ? workspace.data_ptr() : nullptr);
  if (args.update_state) state.finish(plan, in.state);
  // The CPU computes 16-bit models in fp32; CUDA writes the model's dtype.
  return out.scalar_type() == in.x.scalar_type() ? out : out.to(in.x.scalar_type());
}

}  // namespace gemmfuse::bindings

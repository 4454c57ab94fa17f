// gemmfuse::run on CUDA tensors: the CUDA executor on the current stream, no host sync.
#ifdef GEMMFUSE_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_executor.h"
#include "plan_cache.h"
#include "prepared_cache.h"
#include "run_call.h"

namespace gemmfuse::bindings {

at::Tensor run_on_cuda(const CallInputs& in) {
  static CudaExecutor executor;
  auto cp = plan_for(in.spec, in.x, in.weight, in.bias, in.operands, in.state, in.precision);
  const Plan& plan = *cp.plan;
  std::vector<int64_t> shape(in.x.sizes().begin(), in.x.sizes().end() - 1);
  if (plan.out_has_feature_dim) shape.push_back(plan.out_width);
  if (plan.M == 0) return at::empty(shape, in.x.options());

  c10::cuda::CUDAGuard guard(in.x.device());
  // x, W, b, out in the model's dtype; operands fp32 (a no-op for fp32 parameters).
  at::Tensor x = in.x.contiguous(), w = in.weight.contiguous();
  at::Tensor b = in.bias.has_value() ? in.bias->contiguous() : at::Tensor();
  std::vector<at::Tensor> operands;
  for (const auto& t : in.operands) operands.push_back(t.to(at::kFloat).contiguous());
  StateViews state(in.state);
  at::Tensor out = at::empty({plan.M, plan.out_width}, x.options());

  RunArgs args;
  args.x = x.data_ptr();
  args.weight = w.data_ptr();
  args.bias = b.defined() ? b.data_ptr() : nullptr;
  for (const auto& t : operands) args.operands.push_back(t.data_ptr<float>());
  args.state = state.pointers;
  args.out = out.data_ptr();
  args.stream = c10::cuda::getCurrentCUDAStream(in.x.device().index()).stream();

  at::Tensor prepared =
      prepared_for(plan, executor, args, in.weight, in.bias, in.operands, in.state);
  const auto ws_bytes = static_cast<int64_t>(executor.workspace_bytes(plan));
  at::Tensor workspace =
      ws_bytes > 0 ? at::empty({ws_bytes}, x.options().dtype(at::kByte)) : at::Tensor();
  executor.run(plan, args, prepared.defined() ? prepared.data_ptr() : nullptr,
               workspace.defined() ? workspace.data_ptr() : nullptr);
  state.finish(plan, in.state);
  return out.view(shape);
}

}  // namespace gemmfuse::bindings
#endif  // GEMMFUSE_WITH_CUDA

// gemmfuse::run on CPU tensors: the CPU executor (fp32 throughout), with PyTorch's BLAS for
// the GEMM.
#include <ATen/ATen.h>

#include "cpu_executor.h"
#include "plan_cache.h"
#include "prepared_cache.h"
#include "run_call.h"

namespace gemmfuse::bindings {

namespace {

void blas_gemm(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y) {
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto X = at::from_blob(const_cast<float*>(x), {M, K}, opts);
  auto W = at::from_blob(const_cast<float*>(w), {N, K}, opts);
  auto Y = at::from_blob(y, {M, N}, opts);
  at::mm_out(Y, X, W.t());
}

}  // namespace

at::Tensor run_on_cpu(const CallInputs& in) {
  static CpuExecutor executor;
  auto cp = plan_for(in.spec, in.x, in.weight, in.bias, in.operands, in.state, in.precision);
  const Plan& plan = *cp.plan;
  std::vector<int64_t> shape(in.x.sizes().begin(), in.x.sizes().end() - 1);
  if (plan.out_has_feature_dim) shape.push_back(plan.out_width);
  if (plan.M == 0) return at::empty(shape, in.x.options());

  // The CPU executor computes in fp32 on contiguous tensors.
  auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  at::Tensor x = f32(in.x), w = f32(in.weight);
  at::Tensor b = in.bias.has_value() ? f32(*in.bias) : at::Tensor();
  std::vector<at::Tensor> operands;
  for (const auto& t : in.operands) operands.push_back(f32(t));
  StateViews state(in.state);
  at::Tensor out = at::empty({plan.M, plan.out_width}, x.options());

  RunArgs args;
  args.x = x.data_ptr();
  args.weight = w.data_ptr();
  args.bias = b.defined() ? b.data_ptr() : nullptr;
  for (const auto& t : operands) args.operands.push_back(t.data_ptr<float>());
  args.state = state.pointers;
  args.out = out.data_ptr();
  args.cpu_gemm = blas_gemm;

  at::Tensor prepared =
      prepared_for(plan, executor, args, in.weight, in.bias, in.operands, in.state);
  const auto ws_bytes = static_cast<int64_t>(executor.workspace_bytes(plan));
  at::Tensor workspace =
      ws_bytes > 0 ? at::empty({ws_bytes}, x.options().dtype(at::kByte)) : at::Tensor();
  executor.run(plan, args, prepared.defined() ? prepared.data_ptr() : nullptr,
               workspace.defined() ? workspace.data_ptr() : nullptr);
  state.finish(plan, in.state);
  return out.to(in.x.scalar_type()).view(shape);
}

}  // namespace gemmfuse::bindings

// The differentiable form of a chain (autograd glue: python/gemmfuse/autograd.py):
//   train_forward(...) -> (out, saved)    the forward of the training plan, functional: it also
//                                         returns what the backward needs, and leaves the
//                                         BatchNorm running statistics alone
//   train_backward(..., grad_out, saved, needs) -> [dx, dW, db, d operand 0, ...]
//                                         (an empty tensor where `needs` says no)
//   update_running_stats(..., state, saved)   the running-statistics update the forward left
//                                         out, as PyTorch's BatchNorm does it (in place)
// All three take the forward's arguments, so they find the same (training) plan.
#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef GEMMFUSE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_executor.h"
#endif

#include <tuple>
#include <vector>

#include "cpu_executor.h"
#include "gemmfuse/backward.h"
#include "plan_cache.h"
#include "prepared_cache.h"
#include "run_call.h"

namespace gemmfuse::bindings {
namespace {

CallInputs training_inputs(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias, at::TensorList operands,
                           at::TensorList state, c10::string_view precision) {
  return CallInputs{spec, x, weight, bias, operands, state, precision, /*for_training=*/true};
}

const Plan& training_plan(const CallInputs& in) {
  return plan_for(in.spec, in.x, in.weight, in.bias, in.operands, in.state, in.precision, true);
}

std::tuple<at::Tensor, at::Tensor> train_forward(c10::string_view spec, const at::Tensor& x,
                                                 const at::Tensor& weight,
                                                 const c10::optional<at::Tensor>& bias,
                                                 at::TensorList operands, at::TensorList state,
                                                 c10::string_view precision) {
  const CallInputs in = training_inputs(spec, x, weight, bias, operands, state, precision);
  const Plan& plan = training_plan(in);
  const BackwardPlan* bp = nullptr;
  try {
    bp = &backward_plan_for(plan);
  } catch (const Unsupported& e) {
    TORCH_CHECK(false, "gemmfuse unsupported: ", e.what());
  }
  at::Tensor saved = at::empty({bp->saved.total}, x.options().dtype(at::kFloat));
  float* s = saved.numel() ? saved.data_ptr<float>() : nullptr;
#ifdef GEMMFUSE_WITH_CUDA
  if (x.is_cuda()) {
    return {run_on_cuda(in, s), saved};
  }
#endif
  return {run_on_cpu(in, s), saved};
}

// The saved tensor's length is M * v_cols + the batch statistics' (BackwardPlan::saved), so
// for symbolic sizes it comes from the plan of a stand-in with concrete ones.
std::tuple<at::Tensor, at::Tensor> train_forward_meta(
    c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
    const c10::optional<at::Tensor>& bias, at::TensorList operands, at::TensorList state,
    c10::string_view precision) {
  constexpr int64_t kStandIn = 64;
  const at::Tensor xc = concrete_stand_in(x, kStandIn);
  std::vector<at::Tensor> ops;
  for (const auto& o : operands) ops.push_back(concrete_stand_in(o, kStandIn));
  const CallInputs in = training_inputs(spec, xc, weight, bias, ops, state, precision);
  const Plan& plan = training_plan(in);
  const BackwardPlan& bp = backward_plan_for(plan);
  auto chain = chain_for(std::string(spec.data(), spec.size()));
  c10::SymInt M(1);
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M = M * x.sym_size(d);
  const c10::SymInt saved = M * bp.saved.v_cols + (bp.saved.total - plan.M * bp.saved.v_cols);
  return {at::empty_symint(output_sym_shape(*chain, x.sym_sizes()), x.options()),
          at::empty_symint({saved}, x.options().dtype(at::kFloat))};
}

std::vector<at::Tensor> train_backward(c10::string_view spec, const at::Tensor& grad_out,
                                       const at::Tensor& x, const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias,
                                       at::TensorList operands, at::TensorList state,
                                       const at::Tensor& saved, c10::string_view precision,
                                       const c10::List<bool>& needs) {
  const CallInputs in = training_inputs(spec, x, weight, bias, operands, state, precision);
  return backward_on_device(in, grad_out, saved, needs.vec());
}

std::vector<at::Tensor> train_backward_meta(c10::string_view, const at::Tensor&,
                                            const at::Tensor& x, const at::Tensor& weight,
                                            const c10::optional<at::Tensor>& bias,
                                            at::TensorList operands, at::TensorList,
                                            const at::Tensor&, c10::string_view,
                                            const c10::List<bool>& needs) {
  std::vector<at::Tensor> out;
  auto like = [&](size_t i, const at::Tensor& t) {
    out.push_back(i < needs.size() && needs.get(i) ? at::empty_like(t) : at::empty({0}, t.options()));
  };
  like(0, x);
  like(1, weight);
  if (bias) like(2, *bias);
  else out.push_back(at::empty({0}, x.options()));
  for (size_t i = 0; i < operands.size(); ++i) like(3 + i, operands[i]);
  return out;
}

void update_running_stats(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias, at::TensorList operands,
                          at::TensorList state, const at::Tensor& saved,
                          c10::string_view precision) {
  const CallInputs in = training_inputs(spec, x, weight, bias, operands, state, precision);
  const Plan& plan = training_plan(in);
  const BackwardPlan& bp = backward_plan_for(plan);
  at::NoGradGuard no_grad;
  for (const auto& [node, off] : bp.saved.batch_stats) {
    const Node& n = plan.chain.nodes[node];
    if (!n.training || !n.running_mean.present() || !n.running_var.present()) continue;
    const int64_t w = plan.chain.width_of(node);
    const at::Tensor mean = saved.narrow(0, off, w), var = saved.narrow(0, off + 2 * w, w);
    at::Tensor rm = state[n.running_mean.index], rv = state[n.running_var.index];
    double m = n.momentum;
    if (n.num_batches.present()) {
      at::Tensor nb = state[n.num_batches.index];
      nb.add_(1);
      if (m < 0) m = 1.0 / nb.item<double>();
    }
    TORCH_CHECK(m >= 0, "gemmfuse: BatchNorm with momentum=None needs num_batches_tracked");
    const double unbias = plan.M > 1 ? double(plan.M) / double(plan.M - 1) : 0.0;
    rm.mul_(1 - m).add_(mean.to(rm.scalar_type()), m);
    rv.mul_(1 - m).add_(var.to(rv.scalar_type()), m * unbias);
  }
}

}  // namespace

namespace {

// The tensors one backward call reads and writes, alive until the executor has run.
struct BackwardTensors {
  at::Tensor go, x, w, b, dx, dw, db, workspace, weight_scratch;
  std::vector<at::Tensor> ops, dops;
};

// C = op(A) op(B) with PyTorch's CPU GEMM, for the CPU executor's backward.
void aten_matmul(int64_t M, int64_t N, int64_t K, const float* pa, bool ta, const float* pb,
                 bool tb, float* pc) {
  auto o = at::TensorOptions().dtype(at::kFloat);
  at::Tensor A = at::from_blob(const_cast<float*>(pa), ta ? at::IntArrayRef{K, M} : at::IntArrayRef{M, K}, o);
  at::Tensor B = at::from_blob(const_cast<float*>(pb), tb ? at::IntArrayRef{N, K} : at::IntArrayRef{K, N}, o);
  at::Tensor C = at::from_blob(pc, {M, N}, o);
  at::mm_out(C, ta ? A.t() : A, tb ? B.t() : B);
}

void* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The inputs as the executor reads them (fp32, or the model's dtype for a GPU GEMM: `native`)
// and the gradients it writes (fp32; those not needed left undefined).
void bind_tensors(const CallInputs& in, const at::Tensor& grad_out, bool native,
                  const std::vector<bool>& needs, BackwardTensors& t) {
  auto f32 = [](const at::Tensor& v) { return v.to(at::kFloat).contiguous(); };
  auto model = [&](const at::Tensor& v) { return native ? v.contiguous() : f32(v); };
  auto need = [&](size_t i) { return i < needs.size() && needs[i]; };
  t.go = f32(grad_out);
  t.x = model(in.x);
  t.w = model(in.weight);
  t.b = in.bias ? model(*in.bias) : at::Tensor();
  for (const auto& o : in.operands) t.ops.push_back(f32(o));
  const auto f32_options = in.x.options().dtype(at::kFloat);
  if (need(0)) t.dx = at::empty(t.x.sizes(), f32_options);
  if (need(1)) t.dw = at::empty(t.w.sizes(), f32_options);
  if (need(2) && t.b.defined()) t.db = at::empty(t.b.sizes(), f32_options);
  for (size_t i = 0; i < t.ops.size(); ++i)
    t.dops.push_back(need(3 + i) ? at::empty(t.ops[i].sizes(), t.ops[i].options()) : at::Tensor());
}

BackwardArgs backward_args(const BackwardTensors& t, const StateViews& state, const at::Tensor& saved) {
  BackwardArgs a;
  a.grad_out = t.go.data_ptr();
  a.x = t.x.data_ptr();
  a.weight = t.w.data_ptr();
  a.bias = ptr(t.b);
  for (const auto& o : t.ops) {
    a.operands.push_back(o.data_ptr<float>());
    a.operand_numel.push_back(o.numel());
  }
  a.state = state.pointers;
  a.saved = saved.numel() ? saved.data_ptr<float>() : nullptr;
  a.grad_x = ptr(t.dx);
  a.grad_w = ptr(t.dw);
  a.grad_b = ptr(t.db);
  for (const auto& d : t.dops) a.grad_operands.push_back(d.defined() ? d.data_ptr<float>() : nullptr);
  a.cpu_matmul = aten_matmul;
  return a;
}

// The executor's workspace, and the scratch for what it builds from W for dx: over the
// forward's prepared W where there is one (the next forward prepares it again; in training
// W has changed by then anyway).
void attach_scratch(Executor& executor, const Plan& plan, const BackwardPlan& bp,
                    const CallInputs& in, bool needs_dx, BackwardTensors& t, BackwardArgs& a) {
  const auto bytes = in.x.options().dtype(at::kByte);
  const int64_t ws_bytes = static_cast<int64_t>(executor.backward_workspace_bytes(plan, bp));
  if (ws_bytes > 0) t.workspace = at::empty({ws_bytes}, bytes);
  a.workspace = ptr(t.workspace);
  const size_t weight_bytes = needs_dx ? executor.backward_weight_bytes(plan, bp) : 0;
  if (weight_bytes == 0) return;
  t.weight_scratch = borrow_prepared(plan, in.weight, weight_bytes);
  if (!t.weight_scratch.defined())
    t.weight_scratch = at::empty({static_cast<int64_t>(weight_bytes)}, bytes);
  a.weight_scratch = t.weight_scratch.data_ptr();
}

// The gradients in the dtypes of what they are gradients of (an empty tensor where none).
std::vector<at::Tensor> gradients_out(const CallInputs& in, const BackwardTensors& t) {
  auto back = [](const at::Tensor& g, const at::Tensor& like) {
    return g.defined() ? g.to(like.scalar_type()) : at::empty({0}, like.options());
  };
  std::vector<at::Tensor> out{back(t.dx, in.x), back(t.dw, in.weight),
                              in.bias ? back(t.db, *in.bias) : at::empty({0}, in.x.options())};
  for (size_t i = 0; i < t.ops.size(); ++i) out.push_back(back(t.dops[i], in.operands[i]));
  return out;
}

}  // namespace

// The backward on the inputs' device: grad_out, operands and state in fp32 (and on the CPU
// x, W, b too; on CUDA those stay in the model's dtype); gradients computed in fp32 and
// returned in the inputs' dtypes.
std::vector<at::Tensor> backward_on_device(const CallInputs& in, const at::Tensor& grad_out,
                                           const at::Tensor& saved, const std::vector<bool>& needs) {
  static CpuExecutor cpu;
  const bool gpu = in.x.is_cuda();
#ifdef GEMMFUSE_WITH_CUDA
  static CudaExecutor cuda;
  c10::cuda::OptionalCUDAGuard guard;
  if (gpu) guard.set_device(in.x.device());
  Executor& executor = gpu ? static_cast<Executor&>(cuda) : cpu;
#else
  Executor& executor = cpu;
#endif
  const Plan& plan = training_plan(in);
  const BackwardPlan& bp = backward_plan_for(plan);
  // The GEMV's backward reads x and W in fp32 (a rank-one update: memory-bound, no GEMM).
  BackwardTensors t;
  bind_tensors(in, grad_out, gpu && !bp.gemv, needs, t);
  StateViews state(in.state, StateViews::Native16Bit::No);
  BackwardArgs a = backward_args(t, state, saved);
  attach_scratch(executor, plan, bp, in, !needs.empty() && needs[0], t, a);
#ifdef GEMMFUSE_WITH_CUDA
  if (gpu) a.stream = c10::cuda::getCurrentCUDAStream(in.x.device().index()).stream();
#endif
  try {
    executor.backward(plan, bp, a);
  } catch (const Unsupported& e) {
    TORCH_CHECK(false, "gemmfuse unsupported: ", e.what());
  }
  return gradients_out(in, t);
}

TORCH_LIBRARY_IMPL(gemmfuse, CPU, m) {
  m.impl("train_forward", &train_forward);
  m.impl("train_backward", &train_backward);
  m.impl("update_running_stats", &update_running_stats);
}
TORCH_LIBRARY_IMPL(gemmfuse, Meta, m) {
  m.impl("train_forward", &train_forward_meta);
  m.impl("train_backward", &train_backward_meta);
  m.impl("update_running_stats", [](c10::string_view, const at::Tensor&, const at::Tensor&,
                                    const c10::optional<at::Tensor>&, at::TensorList,
                                    at::TensorList, const at::Tensor&, c10::string_view) {});
}
#ifdef GEMMFUSE_WITH_CUDA
TORCH_LIBRARY_IMPL(gemmfuse, CUDA, m) {
  m.impl("train_forward", &train_forward);
  m.impl("train_backward", &train_backward);
  m.impl("update_running_stats", &update_running_stats);
}
#endif

}  // namespace gemmfuse::bindings

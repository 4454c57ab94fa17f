// gemmfuse::run is differentiable: its Autograd kernel. Where autograd records and an input
// requires grad, one C++ autograd node runs the training plan (train_forward, then the
// running-statistics update the forward leaves out) and takes train_backward as its
// derivative; otherwise the call goes straight to the device kernel (`stateless` where the
// chain has no state). All three are called
// through the dispatcher, so torch.compile's AOTAutograd traces them as the opaque ops they
// are (fake kernels in ops_registry.cpp and train_ops.cpp) and eager calls pay a C++ node,
// not a Python autograd.Function.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

namespace gemmfuse::bindings {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;

using RunFn = at::Tensor(c10::string_view, const at::Tensor&, const at::Tensor&, const OptTensor&,
                         at::TensorList, at::TensorList, c10::string_view);
using StatelessFn = at::Tensor(c10::string_view, const at::Tensor&, const at::Tensor&,
                               const OptTensor&, at::TensorList, c10::string_view);
using TrainForwardFn = std::tuple<at::Tensor, at::Tensor>(c10::string_view, const at::Tensor&,
                                                          const at::Tensor&, const OptTensor&,
                                                          at::TensorList, at::TensorList,
                                                          c10::string_view);
using UpdateStatsFn = void(c10::string_view, const at::Tensor&, const at::Tensor&, const OptTensor&,
                           at::TensorList, at::TensorList, const at::Tensor&, c10::string_view);
using TrainBackwardFn = std::vector<at::Tensor>(c10::string_view, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&,
                                                const OptTensor&, at::TensorList, at::TensorList,
                                                const at::Tensor&, c10::string_view,
                                                const c10::List<bool>&);

template <class Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

struct Handles {
  c10::TypedOperatorHandle<RunFn> run = op<RunFn>("gemmfuse::run");
  c10::TypedOperatorHandle<StatelessFn> stateless = op<StatelessFn>("gemmfuse::stateless");
  c10::TypedOperatorHandle<TrainForwardFn> train_forward = op<TrainForwardFn>("gemmfuse::train_forward");
  c10::TypedOperatorHandle<UpdateStatsFn> update_stats = op<UpdateStatsFn>("gemmfuse::update_running_stats");
  c10::TypedOperatorHandle<TrainBackwardFn> train_backward = op<TrainBackwardFn>("gemmfuse::train_backward");
};

const Handles& handles() {
  static const Handles h;
  return h;
}

std::vector<at::Tensor> list_of(const c10::IValue& v) { return v.toTensorVector(); }

// The chain's differentiable node. Variables, in order: x, weight, bias (when given),
// operands..., state... (state receives no gradient).
struct FusedChain : torch::autograd::Function<FusedChain> {
  static at::Tensor forward(AutogradContext* ctx, c10::string_view spec, const at::Tensor& x,
                            const at::Tensor& weight, const OptTensor& bias,
                            at::TensorList operands, at::TensorList state,
                            c10::string_view precision) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, saved] = handles().train_forward.call(spec, x, weight, bias, operands, state, precision);
    // The running statistics: updated after the forward, as BatchNorm does (a no-op for chains
    // without a training BatchNorm).
    if (!state.empty())
      handles().update_stats.call(spec, x, weight, bias, operands, state, saved, precision);
    ctx->saved_data["spec"] = std::string(spec.data(), spec.size());
    ctx->saved_data["precision"] = std::string(precision.data(), precision.size());
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["n_operands"] = static_cast<int64_t>(operands.size());
    // Running statistics (an eval BatchNorm's backward reads them) stay out of
    // save_for_backward: a training BatchNorm's update would trip its version check.
    ctx->saved_data["state"] = state.vec();
    std::vector<at::Tensor> keep{x, weight, bias.has_value() ? *bias : at::Tensor(), saved};
    keep.insert(keep.end(), operands.begin(), operands.end());
    ctx->save_for_backward(keep);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list keep = ctx->get_saved_variables();
    const std::string spec = ctx->saved_data["spec"].toStringRef();
    const std::string precision = ctx->saved_data["precision"].toStringRef();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const int64_t n_ops = ctx->saved_data["n_operands"].toInt();
    const std::vector<at::Tensor> state = list_of(ctx->saved_data["state"]);
    const std::vector<at::Tensor> operands(keep.begin() + 4, keep.end());
    // needs_input_grad counts variables: x 0, weight 1, bias 2 (when given), then operands.
    const size_t op0 = has_bias ? 3 : 2;
    std::vector<bool> needs(3 + n_ops);
    needs[0] = ctx->needs_input_grad(0);
    needs[1] = ctx->needs_input_grad(1);
    needs[2] = has_bias && ctx->needs_input_grad(2);
    for (int64_t i = 0; i < n_ops; ++i) needs[3 + i] = ctx->needs_input_grad(op0 + i);
    c10::List<bool> needs_list;
    for (bool n : needs) needs_list.push_back(n);
    const OptTensor bias = has_bias ? OptTensor(keep[2]) : OptTensor();
    const std::vector<at::Tensor> g = handles().train_backward.call(
        spec, grad_outputs[0], keep[0], keep[1], bias, operands, state, keep[3], precision,
        needs_list);
    // One entry per forward argument: spec, x, weight, bias, operands, state, precision.
    variable_list out{at::Tensor(), needs[0] ? g[0] : at::Tensor(), needs[1] ? g[1] : at::Tensor()};
    out.push_back(needs[2] ? g[2] : at::Tensor());
    for (int64_t i = 0; i < n_ops; ++i) out.push_back(needs[3 + i] ? g[3 + i] : at::Tensor());
    for (size_t i = 0; i < state.size(); ++i) out.emplace_back();
    out.emplace_back();
    return out;
  }
};

bool any_requires_grad(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                       at::TensorList operands) {
  if (x.requires_grad() || weight.requires_grad()) return true;
  if (bias.has_value() && bias->defined() && bias->requires_grad()) return true;
  for (const auto& t : operands)
    if (t.requires_grad()) return true;
  return false;
}

at::Tensor run_autograd(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                        const OptTensor& bias, at::TensorList operands, at::TensorList state,
                        c10::string_view precision) {
  if (at::GradMode::is_enabled() && any_requires_grad(x, weight, bias, operands))
    return FusedChain::apply(spec, x, weight, bias, operands, state, precision);
  at::AutoDispatchBelowADInplaceOrView below;
  // Without state the op mutates nothing: graphs get the op whose schema says so.
  if (state.empty()) return handles().stateless.call(spec, x, weight, bias, operands, precision);
  return handles().run.call(spec, x, weight, bias, operands, state, precision);
}

}  // namespace

TORCH_LIBRARY_IMPL(gemmfuse, Autograd, m) { m.impl("run", &run_autograd); }

}  // namespace gemmfuse::bindings

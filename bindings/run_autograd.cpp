// gemmfuse::run is differentiable: its Autograd kernel. Where autograd records and an input
// requires grad, the call runs the training plan (train_forward, then the
// running-statistics update the forward leaves out) and takes train_backward as its
// derivative; otherwise the call goes straight to the device kernel (`stateless` where the
// chain has no state). All three are called
// through the dispatcher, so torch.compile's AOTAutograd traces them as the opaque ops they
// are (fake kernels in ops_registry.cpp and train_ops.cpp) and eager calls pay a C++ node,
// not a Python autograd.Function.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

namespace gemmfuse::bindings {
namespace {

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

// The chain's backward node, as PyTorch's generated ones are written: edges to x, weight,
// bias (an empty edge where there is none) and the operands, in that order; what the
// backward reads kept as SavedVariables (version-checked). State (running statistics) is
// kept as plain tensors: a training BatchNorm's update after the forward would trip the
// version check, and an eval BatchNorm's backward reads them.
struct FusedChainBackward : torch::autograd::Node {
  std::string spec, precision;
  torch::autograd::SavedVariable x, weight, bias, saved;
  std::vector<torch::autograd::SavedVariable> operands;
  std::vector<at::Tensor> state;
  bool has_bias = false;

  std::string name() const override { return "GemmfuseChainBackward"; }

  variable_list apply(variable_list&& grads) override {
    const auto self = shared_from_this();
    std::vector<at::Tensor> ops;
    for (auto& o : operands) ops.push_back(o.unpack(self));
    c10::List<bool> needs;
    for (size_t i = 0; i < 3 + ops.size(); ++i) needs.push_back(task_should_compute_output(i));
    const OptTensor b = has_bias ? OptTensor(bias.unpack(self)) : OptTensor();
    std::vector<at::Tensor> g = handles().train_backward.call(
        spec, grads[0], x.unpack(self), weight.unpack(self), b, ops, state, saved.unpack(self),
        precision, needs);
    variable_list out(3 + ops.size());
    for (size_t i = 0; i < out.size(); ++i)
      if (needs.get(i) && (i != 2 || has_bias)) out[i] = std::move(g[i]);
    return out;
  }

  void release_variables() override {
    x.reset_data();
    weight.reset_data();
    bias.reset_data();
    saved.reset_data();
    for (auto& o : operands) o.reset_data();
    state.clear();
  }
};

// The forward of a call autograd records: the training plan, the running-statistics update,
// and the node.
at::Tensor run_recorded(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                        const OptTensor& bias, at::TensorList operands, at::TensorList state,
                        c10::string_view precision) {
  at::Tensor out, saved;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    std::tie(out, saved) = handles().train_forward.call(spec, x, weight, bias, operands, state, precision);
    if (!state.empty())  // as BatchNorm: after the forward (a no-op without a training one)
      handles().update_stats.call(spec, x, weight, bias, operands, state, saved, precision);
  }
  const at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  auto node = std::shared_ptr<FusedChainBackward>(new FusedChainBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, b, operands));
  node->spec.assign(spec.data(), spec.size());
  node->precision.assign(precision.data(), precision.size());
  node->has_bias = b.defined();
  node->x = torch::autograd::SavedVariable(x, false);
  node->weight = torch::autograd::SavedVariable(weight, false);
  node->bias = torch::autograd::SavedVariable(b, false);
  node->saved = torch::autograd::SavedVariable(saved, false);
  for (const auto& o : operands) node->operands.emplace_back(o, false);
  node->state = state.vec();
  torch::autograd::set_history(out, node);
  return out;
}

at::Tensor run_autograd(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                        const OptTensor& bias, at::TensorList operands, at::TensorList state,
                        c10::string_view precision) {
  if (torch::autograd::compute_requires_grad(x, weight, bias, operands))
    return run_recorded(spec, x, weight, bias, operands, state, precision);
  at::AutoDispatchBelowADInplaceOrView below;
  // Without state the op mutates nothing: graphs get the op whose schema says so.
  if (state.empty()) return handles().stateless.call(spec, x, weight, bias, operands, precision);
  return handles().run.call(spec, x, weight, bias, operands, state, precision);
}

}  // namespace

TORCH_LIBRARY_IMPL(gemmfuse, Autograd, m) { m.impl("run", &run_autograd); }

}  // namespace gemmfuse::bindings

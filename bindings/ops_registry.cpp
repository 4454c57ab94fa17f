// TORCH_LIBRARY(gemmfuse): the operators the Python front calls.
//   run       the chain on x (CPU, CUDA; Meta gives the shape for torch.compile/export);
//             differentiable (run_autograd.cpp)
//   stateless the same for chains without state (no running statistics): what `run` calls
//             below autograd for them, so that graphs see an op that mutates nothing
//   linear    one Linear, no stages, its spec from the weight's shape (gemmfuse.fp32_matmul);
//             keep_weight=False for a weight that changes every call: its preparation (the
//             split parts) is made for the call and not kept
//   bmm       a batch of products a[i] @ b[i], each one `linear` with keep_weight=False
//             (batched_linear.cpp; gemmfuse.fp32_matmul's bmm and baddbmm)
//   bmm_route "" where gemmfuse should run such a batch, else why PyTorch's at::bmm runs it
//   sdpa_f16x3 fp32 attention's forward on split fp16 products, with the outputs of PyTorch's
//             memory-efficient attention (attention.cpp; gemmfuse.fp32_matmul); sdpa_f16x3_route
//             says where it takes its operands; sdpa_f16x3_backward (and its route) the
//             gradients, from that op's outputs or PyTorch's
//   mm_route  "" where gemmfuse should run a @ b (+ bias), else why PyTorch's mm runs it
//             (product_route.cpp: both routes and the LM head's products share its rule)
//   linear_cross_entropy  F.cross_entropy(F.linear(x, W, b), target) in chunks of rows, without
//             the [M, V] logits, and with with_grads (mean, sum) the gradients for a unit
//             grad_output, from the same loop (linear_cross_entropy.cpp; gemmfuse.lm_head)
//   linear_cross_entropy_backward  the gradients for any grad_loss ([M] for reduction none),
//             each chunk's logits computed again
//   linear_cross_entropy_describe  the chunks and where each of their products runs, and why
//   describe  the plan as text (for gemmfuse.explain), or "gemmfuse unsupported: ..." raised
//   route     "" where the plan (inference or training) runs fused, else why PyTorch is faster
//   check     "" when a spec parses, else the reason
//   train_forward, train_backward, update_running_stats: the differentiable form (train_ops.cpp)
//   ops       the op table, one "<name> <family>" a line (the Python capture checks its names)
//   calls     [forward calls, training calls] of a spec in this process (explain)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <sstream>
#include <stdexcept>

#ifdef GEMMFUSE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "cuda_executor.h"
#endif
#include "attention.h"
#include "batched_linear.h"
#include "linear_cross_entropy.h"
#include "gemmfuse/backward.h"
#include "plan_cache.h"
#include "product_route.h"
#include "run_call.h"

namespace gemmfuse::bindings {

// The spec of one Linear with the weight [out, in] and the bias, if any (batched_linear.h:
// gemmfuse::bmm builds each product's spec with it too).
std::string linear_spec(const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2, "gemmfuse::linear: the weight must be 2-D, got ", weight.dim(),
              "-D");
  return "linear in=" + std::to_string(weight.size(1)) + " out=" +
         std::to_string(weight.size(0)) + " bias=" + (bias.has_value() ? "1" : "0");
}

namespace {

std::string str(c10::string_view s) { return std::string(s.data(), s.size()); }

CallInputs inputs(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias, at::TensorList operands,
                  at::TensorList state, c10::string_view precision) {
  return CallInputs{spec, x, weight, bias, operands, state, precision};
}

at::Tensor run_cpu(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& bias, at::TensorList operands,
                   at::TensorList state, c10::string_view precision) {
  return run_on_cpu(inputs(spec, x, weight, bias, operands, state, precision));
}

#ifdef GEMMFUSE_WITH_CUDA
at::Tensor run_cuda(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                    const c10::optional<at::Tensor>& bias, at::TensorList operands,
                    at::TensorList state, c10::string_view precision) {
  return run_on_cuda(inputs(spec, x, weight, bias, operands, state, precision));
}
#endif

// `run` with no state, for each device.
template <at::Tensor (*Run)(c10::string_view, const at::Tensor&, const at::Tensor&,
                            const c10::optional<at::Tensor>&, at::TensorList, at::TensorList,
                            c10::string_view)>
at::Tensor stateless(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias, at::TensorList operands,
                     c10::string_view precision) {
  return Run(spec, x, weight, bias, operands, {}, precision);
}

// gemmfuse::linear on a device (RunOn: run_on_cpu, run_on_cuda).
template <at::Tensor (*RunOn)(const CallInputs&, float*)>
at::Tensor linear_on(const at::Tensor& x, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias, c10::string_view precision,
                     bool keep_weight) {
  const std::string spec = linear_spec(weight, bias);
  CallInputs in{spec, x, weight, bias, {}, {}, precision};
  in.keep_prepared = keep_weight;
  return RunOn(in, nullptr);
}

// Shape only: what torch.compile's fake tensors and torch.export need (sizes may be symbolic).
at::Tensor run_meta(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                    const c10::optional<at::Tensor>&, at::TensorList, at::TensorList,
                    c10::string_view) {
  auto chain = chain_for(str(spec));
  TORCH_CHECK(x.dim() >= 1 && x.sym_size(-1) == chain->in_features,
              "mat1 and mat2 shapes cannot be multiplied");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(),
              "expected m1 and m2 to have the same dtype, but got: ", x.scalar_type(), " != ",
              weight.scalar_type());
  return at::empty_symint(output_sym_shape(*chain, x.sym_sizes()), x.options());
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, c10::string_view precision, bool) {
  return run_meta(linear_spec(weight, bias), x, weight, bias, {}, {}, precision);
}

// The training plan and its backward (what runs while autograd records), or why the chain
// then runs in PyTorch.
std::string describe_training(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias, at::TensorList operands,
                              at::TensorList state, c10::string_view precision) {
  std::ostringstream os;
  os << "while autograd records (training):";
  try {
    const Plan& plan = plan_for(spec, x, weight, bias, operands, state, precision, /*for_training=*/true);
    const BackwardPlan& bp = backward_plan_for(plan);
    for (const std::string& r : plan.rewrites) os << "\n  rewrite: " << r;
    os << '\n' << bp.describe(plan);
#ifdef GEMMFUSE_WITH_CUDA
    if (x.is_cuda()) {
      c10::cuda::CUDAGuard guard(x.device());
      os << '\n' << CudaExecutor::describe_backward(plan, bp);
    }
#endif
  } catch (const Unsupported& e) {
    os << " the chain runs in PyTorch (" << e.what() << ")";
  } catch (const c10::Error& e) {
    os << " the chain runs in PyTorch (" << e.what_without_backtrace() << ")";
  }
  return os.str();
}

std::string describe(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias, at::TensorList operands,
                     at::TensorList state, c10::string_view precision) {
  const Plan& plan = plan_for(spec, x, weight, bias, operands, state, precision);
  std::ostringstream os;
  os << "executor: " << (x.is_cuda() ? "cuda" : "cpu");
  if (!x.is_cuda() && plan.precision != Precision::FP32)
    os << " (computes every precision mode in fp32)";
  os << '\n' << plan.describe();
#ifdef GEMMFUSE_WITH_CUDA
  if (x.is_cuda()) {
    c10::cuda::CUDAGuard guard(x.device());
    const std::string k = CudaExecutor::describe_kernels(plan);
    if (!k.empty()) os << '\n' << k;
  }
#endif
  if (weight.requires_grad()) os << '\n' << describe_training(spec, x, weight, bias, operands, state, precision);
  return os.str();
}

// "" where the plan runs fused, else why PyTorch runs this call faster (Plan::pytorch_faster).
std::string route(c10::string_view spec, const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias, at::TensorList operands,
                  at::TensorList state, c10::string_view precision, bool for_training) {
  return plan_for(spec, x, weight, bias, operands, state, precision, for_training).pytorch_faster;
}

std::string ops() { return op_table_text(); }

std::vector<int64_t> calls(c10::string_view spec) { return calls_of(str(spec)); }

std::string check(c10::string_view spec) {
  try {
    parse_chain(str(spec));
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace

TORCH_LIBRARY(gemmfuse, m) {
  m.def(
      "run(str spec, Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, "
      "Tensor(a!)[] state, str precision) -> Tensor");
  m.def(
      "stateless(str spec, Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, "
      "str precision) -> Tensor");
  m.def(
      "describe(str spec, Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, "
      "Tensor[] state, str precision) -> str",
      &describe);
  m.def(
      "route(str spec, Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, "
      "Tensor[] state, str precision, bool for_training=False) -> str",
      &route);
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, str precision, bool keep_weight=True) "
        "-> Tensor");
  m.def("bmm(Tensor a, Tensor b, str precision) -> Tensor");
  m.def("bmm_route(Tensor a, Tensor b, str precision) -> str", &bmm_route);
  m.def("mm_route(Tensor a, Tensor b, Tensor? bias, str precision) -> str", &mm_route);
  m.def("sdpa_f16x3(Tensor q, Tensor k, Tensor v, Tensor? attn_bias, bool is_causal, "
        "float scale) -> (Tensor out, Tensor lse)");
  m.def("sdpa_f16x3_route(Tensor q, Tensor k, Tensor v, Tensor? attn_bias=None) -> str",
        &sdpa_f16x3_route);
  m.def("sdpa_f16x3_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? attn_bias, "
        "Tensor out, Tensor lse, bool is_causal, float scale) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("sdpa_f16x3_backward_route(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
        "Tensor? attn_bias, Tensor out, Tensor lse) -> str", &sdpa_f16x3_backward_route);
  m.def(
      "linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor target, "
      "int ignore_index, float label_smoothing, str reduction, str precision, int chunk_rows, "
      "bool with_grads) -> (Tensor loss, Tensor dx, Tensor dweight, Tensor dbias)");
  m.def(
      "linear_cross_entropy_backward(Tensor grad_loss, Tensor x, Tensor weight, Tensor? bias, "
      "Tensor target, int ignore_index, float label_smoothing, str reduction, str precision, "
      "int chunk_rows) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  m.def(
      "linear_cross_entropy_describe(Tensor x, Tensor weight, Tensor? bias, str precision, "
      "int chunk_rows=0) -> str",
      &linear_cross_entropy_describe);
  m.def(
      "train_forward(str spec, Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, "
      "Tensor[] state, str precision) -> (Tensor, Tensor)");
  m.def(
      "train_backward(str spec, Tensor grad_out, Tensor x, Tensor weight, Tensor? bias, "
      "Tensor[] operands, Tensor[] state, Tensor saved, str precision, bool[] needs) -> Tensor[]");
  m.def(
      "update_running_stats(str spec, Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, "
      "Tensor(a!)[] state, Tensor saved, str precision) -> ()");
  m.def("check(str spec) -> str", &check);
  m.def("ops() -> str", &ops);
  m.def("calls(str spec) -> int[]", &calls);
}

TORCH_LIBRARY_IMPL(gemmfuse, CPU, m) {
  m.impl("run", &run_cpu);
  m.impl("stateless", &stateless<&run_cpu>);
  m.impl("linear", &linear_on<&run_on_cpu>);
  m.impl("bmm", &bmm_cpu);
  m.impl("linear_cross_entropy", &linear_cross_entropy);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward);
}
TORCH_LIBRARY_IMPL(gemmfuse, Meta, m) {
  m.impl("run", &run_meta);
  m.impl("stateless", &stateless<&run_meta>);
  m.impl("linear", &linear_meta);
  m.impl("bmm", &bmm_meta);
  m.impl("sdpa_f16x3", &sdpa_f16x3_meta);
  m.impl("sdpa_f16x3_backward", &sdpa_f16x3_backward_meta);
  m.impl("linear_cross_entropy", &linear_cross_entropy_meta);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward_meta);
}
#ifdef GEMMFUSE_WITH_CUDA
TORCH_LIBRARY_IMPL(gemmfuse, CUDA, m) {
  m.impl("run", &run_cuda);
  m.impl("sdpa_f16x3", &sdpa_f16x3);
  m.impl("sdpa_f16x3_backward", &sdpa_f16x3_backward);
  m.impl("stateless", &stateless<&run_cuda>);
  m.impl("linear", &linear_on<&run_on_cuda>);
  m.impl("bmm", &bmm_cuda);
  m.impl("linear_cross_entropy", &linear_cross_entropy);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward);
}
#endif

}  // namespace gemmfuse::bindings

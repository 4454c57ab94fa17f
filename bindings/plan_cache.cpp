#include "plan_cache.h"

#include <c10/util/SmallVector.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#ifdef GEMMFUSE_WITH_CUDA
#include "cuda_executor.h"
#endif

namespace gemmfuse::bindings {
namespace {

std::mutex g_mutex;
std::unordered_map<std::string, std::shared_ptr<const Chain>> g_chains;
// Plans by (spec, call signature); never freed (the prepared-weights cache keys on their
// addresses).
std::map<std::pair<std::string, std::vector<int64_t>>, std::unique_ptr<const Plan>> g_plans;

// Calls per plan (by address: plans are never freed), {forward, training}; the counters of
// a plan never move (node-based map), so each thread keeps its last plan's and counts without
// the lock.
using CallCounts = std::array<std::atomic<int64_t>, 2>;
std::unordered_map<const Plan*, CallCounts> g_calls;

}  // namespace

void count_call(const Plan& plan, bool training) {
  thread_local std::pair<const Plan*, CallCounts*> last{nullptr, nullptr};
  if (last.first != &plan) {
    std::lock_guard<std::mutex> lock(g_mutex);
    last = {&plan, &g_calls[&plan]};
  }
  (*last.second)[training ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
}

std::vector<int64_t> calls_of(const std::string& spec) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<int64_t> out{0, 0};
  for (const auto& [key, plan] : g_plans) {
    if (key.first != spec) continue;
    auto it = g_calls.find(plan.get());
    if (it == g_calls.end()) continue;
    out[0] += it->second[0].load(std::memory_order_relaxed);
    out[1] += it->second[1].load(std::memory_order_relaxed);
  }
  return out;
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    default:
      throw Unsupported(std::string("dtype ") + c10::toString(t.scalar_type()) +
                        " is not fused (fp32, bf16 and fp16 are): runs in PyTorch");
  }
}

std::shared_ptr<const Chain> chain_for(const std::string& spec) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_chains.find(spec);
    if (it != g_chains.end()) return it->second;
  }
  std::shared_ptr<const Chain> chain;
  try {
    chain = std::make_shared<const Chain>(parse_chain(spec));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "gemmfuse: bad chain spec: ", e.what());
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_chains.emplace(spec, chain).first->second;
}

std::vector<int64_t> output_shape(const Chain& chain, at::IntArrayRef x_sizes) {
  std::vector<int64_t> shape(x_sizes.begin(), x_sizes.end() - 1);
  if (chain.output_has_feature_dim()) shape.push_back(chain.output_width());
  return shape;
}

c10::SymDimVector output_sym_shape(const Chain& chain, c10::SymIntArrayRef x_sizes) {
  c10::SymDimVector shape(x_sizes.begin(), x_sizes.end() - 1);
  if (chain.output_has_feature_dim()) shape.push_back(c10::SymInt(chain.output_width()));
  return shape;
}

at::Tensor concrete_stand_in(const at::Tensor& t, int64_t stand_in) {
  if (!t.defined()) return t;
  bool symbolic = false;
  std::vector<int64_t> sizes;
  for (const c10::SymInt& s : t.sym_sizes()) {
    const auto v = s.maybe_as_int();
    symbolic = symbolic || !v.has_value();
    sizes.push_back(v.has_value() ? *v : stand_in);
  }
  return symbolic ? at::empty(sizes, t.options().device(at::kMeta)) : t;
}

namespace {

// Each BatchNorm's running statistics hold one value per column of its input (and the batch
// counter one): the executors read that many, so a state tensor of another size is refused.
void check_state_sizes(const Chain& chain, at::TensorList state) {
  for (size_t i = 0; i < chain.nodes.size(); ++i) {
    const Node& n = chain.nodes[i];
    if (n.op != OpCode::BatchNorm) continue;
    const int64_t w = chain.width_of(static_cast<int>(i));
    const std::pair<const Operand*, int64_t> held[] = {
        {&n.running_mean, w}, {&n.running_var, w}, {&n.num_batches, 1}};
    for (const auto& [o, numel] : held) {
      if (!o->present() || o->kind != Operand::Kind::State) continue;
      TORCH_CHECK(o->index < static_cast<int>(state.size()), "gemmfuse: the chain reads state s",
                  o->index, " but ", state.size(), " state tensors were passed");
      TORCH_CHECK(state[o->index].numel() == numel, "gemmfuse: state s", o->index, " of shape ",
                  state[o->index].sizes(), " does not fit the BatchNorm over ", w,
                  " columns (expected ", numel, " values)");
    }
  }
}

// The F.linear checks and same-device checks of one call against its chain.
void check_call(const Chain& chain, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias, at::TensorList operands,
                at::TensorList state) {
  // The checks F.linear makes, with PyTorch's wording, so a wrong call fails the same way.
  TORCH_CHECK(x.dim() >= 1, "gemmfuse: input must have at least one dimension");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == chain.out_features &&
                  weight.size(1) == chain.in_features,
              "gemmfuse: weight of shape ", weight.sizes(), " does not match the chain's Linear(",
              chain.in_features, ", ", chain.out_features, ")");
  TORCH_CHECK(x.size(-1) == weight.size(1), "mat1 and mat2 shapes cannot be multiplied (",
              x.numel() / std::max<int64_t>(x.size(-1), 1), "x", x.size(-1), " and ",
              weight.size(1), "x", weight.size(0), ")");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(),
              "expected m1 and m2 to have the same dtype, but got: ", x.scalar_type(), " != ",
              weight.scalar_type());
  auto same_device = [&](const at::Tensor& t) {
    TORCH_CHECK(t.device() == x.device(),
                "Expected all tensors to be on the same device, but found at least two "
                "devices, ", x.device(), " and ", t.device(), "!");
  };
  same_device(weight);
  if (bias.has_value()) {
    same_device(*bias);
    TORCH_CHECK(chain.has_bias, "gemmfuse: a bias was passed to a chain without one");
    // The executors read one value per output: a broadcasting bias would be read past its end.
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == chain.out_features, "gemmfuse: bias of shape ",
                bias->sizes(), " does not match the chain's Linear(", chain.in_features, ", ",
                chain.out_features, "): one value per output");
  } else {
    TORCH_CHECK(!chain.has_bias, "gemmfuse: the chain's Linear has a bias but none was passed");
  }
  for (const auto& t : operands) same_device(t);
  for (const auto& t : state) same_device(t);
  check_state_sizes(chain, state);
}

// What selects a plan besides the spec: x's sizes, the operands' sizes, dtype, precision,
// device. On the stack for the usual ranks (this runs on every call).
using Signature = c10::SmallVector<int64_t, 24>;
Signature call_signature(const at::Tensor& x, at::TensorList operands,
                         c10::string_view precision, bool for_training) {
  Signature sig(x.sizes().begin(), x.sizes().end());
  sig.push_back(for_training ? -4 : -3);
  for (const auto& t : operands) {
    sig.push_back(-1);
    sig.insert(sig.end(), t.sizes().begin(), t.sizes().end());
  }
  sig.push_back(-2);
  sig.push_back(static_cast<int64_t>(x.scalar_type()));
  for (char c : precision) sig.push_back(c);
  sig.push_back(static_cast<int64_t>(x.device().type()));
  sig.push_back(x.device().index());
  return sig;
}

}  // namespace

const Plan& plan_for(c10::string_view spec_view, const at::Tensor& x, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias, at::TensorList operands,
                     at::TensorList state, c10::string_view precision_view, bool for_training) {
  // The last call's chain and plan, per thread: a repeated call (the common case: one model
  // called again and again) skips the chain lookup and the plan map.
  struct LastCall {
    std::string spec;
    Signature signature;
    const Chain* chain = nullptr;
    const Plan* plan = nullptr;
  };
  thread_local LastCall last;
  Signature signature = call_signature(x, operands, precision_view, for_training);
  if (last.plan != nullptr && last.signature == signature && c10::string_view(last.spec) == spec_view) {
    check_call(*last.chain, x, weight, bias, operands, state);
    return *last.plan;
  }
  std::string spec(spec_view);
  const std::shared_ptr<const Chain> chain = chain_for(spec);  // cached, never freed
  check_call(*chain, x, weight, bias, operands, state);
  auto remember = [&](const Plan& plan) -> const Plan& {
    last = LastCall{spec, std::move(signature), chain.get(), &plan};
    return plan;
  };

  // The plan map's key is the memo's: the spec and the call signature.
  std::pair<std::string, std::vector<int64_t>> key{spec, {signature.begin(), signature.end()}};
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_plans.find(key);
    if (it != g_plans.end()) return remember(*it->second);
  }

  PlanRequest req;
  req.chain = *chain;
  req.batch_sizes.assign(x.sizes().begin(), x.sizes().end() - 1);
  for (const auto& t : operands) req.operand_sizes.emplace_back(t.sizes().vec());
  req.device = x.is_cuda() ? Device::CUDA : Device::CPU;
  req.for_training = for_training;
#ifdef GEMMFUSE_WITH_CUDA
  if (x.is_cuda()) {
    int64_t M = 1;
    for (int64_t d : req.batch_sizes) M *= d;
    req.fast_min_rows = CudaExecutor::fast_min_rows(M, chain->out_features, chain->in_features);
  }
#endif
  try {
    req.dtype = dtype_of(x);
  } catch (const Unsupported& e) {
    TORCH_CHECK(false, "gemmfuse unsupported: ", e.what());
  }
  const std::string precision(precision_view);
  if (!precision_from_name(precision, &req.precision)) {
    TORCH_CHECK(false, "gemmfuse: unknown precision '", precision,
                "' (expected fp32, fast or tf32)");
  }
  std::unique_ptr<const Plan> plan;
  try {
    plan = std::make_unique<const Plan>(make_plan(req));
#ifdef GEMMFUSE_WITH_CUDA
    if (x.is_cuda()) CudaExecutor::check(*plan);  // e.g. a row program too long
#endif
  } catch (const Unsupported& e) {
    TORCH_CHECK(false, "gemmfuse unsupported: ", e.what());
  } catch (const std::invalid_argument& e) {
    // What PyTorch itself rejects (e.g. training BatchNorm on one row): PyTorch raises
    // ValueError there, so do we.
    TORCH_CHECK_VALUE(false, e.what());
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  // Another thread may have planned the same call meanwhile: keep the first plan.
  return remember(*g_plans.emplace(std::move(key), std::move(plan)).first->second);
}

const BackwardPlan& backward_plan_for(const Plan& plan) {
  static std::mutex mutex;
  static std::map<const Plan*, std::unique_ptr<const BackwardPlan>> plans;  // plans are never freed
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = plans.find(&plan);
    if (it != plans.end()) return *it->second;
  }
  auto bp = std::make_unique<const BackwardPlan>(make_backward_plan(plan));
  std::lock_guard<std::mutex> lock(mutex);
  return *plans.emplace(&plan, std::move(bp)).first->second;
}

}  // namespace gemmfuse::bindings

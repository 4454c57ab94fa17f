#include "prepared_cache.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "cache_memory.h"
#include "graph_capture.h"
#include "tensor_identity.h"

namespace gemmfuse::bindings {
namespace {

struct Entry {
  at::Tensor data;
  std::vector<TensorIdentity> sources;
  c10::optional<c10::Stream> stream;  // where data was last prepared (and read)
};

c10::Stream current_stream(const at::Tensor& t) {
  return c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device());
}

std::mutex g_mutex;
// Keyed by the plan (plans are cached and never freed, so the pointer identifies one) and the
// weight's data pointer: no string building on the per-call path. A different tensor at the
// same address finds the entry but not its sources, and rebuilds it. Never destroyed
// (cache_memory.h).
auto& g_entries = *new std::map<std::pair<const Plan*, const void*>, Entry>();

// What the preparation reads, in a fixed order: W and b always; the BatchNorm tensors when it
// is folded.
template <class F>
void for_each_source(const Plan& plan, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias, at::TensorList operands,
                     at::TensorList state, F&& f) {
  f(weight);
  if (bias.has_value()) f(*bias);
  if (plan.prep.fold_batchnorm) {
    for (const auto& t : operands) f(t);
    for (const auto& t : state) f(t);
  }
}

}  // namespace

at::Tensor prepared_for(const Plan& plan, Executor& executor,
                        const RunArgs& args, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, at::TensorList operands,
                        at::TensorList state, bool keep) {
  const size_t bytes = executor.prepared_bytes(plan);
  if (bytes == 0) return at::Tensor();
  // Prepared for this call alone: inside a graph being captured (on every replay), or a
  // weight that changes every call (the caching allocator frees it after the call's work).
  if (!keep || graph_capturing(weight)) {
    at::Tensor data = at::empty({static_cast<int64_t>(bytes)}, weight.options().dtype(at::kByte));
    executor.prepare(plan, args, data.data_ptr());
    return data;
  }

  // One entry per plan and weight tensor: a model's weights replaced by new storage get a new
  // entry (the old one stays until the process ends).
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& entry = g_entries[{&plan, weight.data_ptr()}];
  if (entry.data.defined()) {
    size_t i = 0;
    bool fresh = true;
    for_each_source(plan, weight, bias, operands, state, [&](const at::Tensor& t) {
      fresh = fresh && i < entry.sources.size() && entry.sources[i].matches(t);
      ++i;
    });
    if (fresh && i == entry.sources.size()) return entry.data;
  }

  std::vector<TensorIdentity> sources;
  for_each_source(plan, weight, bias, operands, state,
                  [&](const at::Tensor& t) { sources.emplace_back(t); });
  // Rebuilt in place on the stream that read it last (stream order keeps earlier readers
  // first); new memory otherwise (the caching allocator then frees the old after its readers).
  const c10::Stream stream = current_stream(weight);
  if (!entry.data.defined() || static_cast<size_t>(entry.data.numel()) < bytes ||
      entry.stream != stream) {
    entry.data = cache_empty({static_cast<int64_t>(bytes)}, weight.options().dtype(at::kByte));
    entry.stream = stream;
  }
  executor.prepare(plan, args, entry.data.data_ptr());
  entry.sources = std::move(sources);
  return entry.data;
}

at::Tensor borrow_prepared(const Plan& plan, const at::Tensor& weight, size_t bytes) {
  if (graph_capturing(weight)) return at::Tensor();  // replays would write it behind the cache
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_entries.find({&plan, weight.data_ptr()});
  if (it == g_entries.end() || !it->second.data.defined() ||
      static_cast<size_t>(it->second.data.numel()) < bytes)
    return at::Tensor();
  it->second.sources.clear();  // matches nothing: rebuilt on its next use
  return it->second.data;
}

}  // namespace gemmfuse::bindings

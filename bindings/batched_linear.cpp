// gemmfuse::bmm: a batch of fp32 products a[i] @ b[i], each run as one gemmfuse::linear
// (x = a[i], W = b[i]ᵀ) on the device's executor, for gemmfuse.fp32_matmul's aten.bmm and
// aten.baddbmm; and gemmfuse::bmm_route, which says whether such a batch should run there
// or in PyTorch's at::bmm (one batched call).
#include "batched_linear.h"

#include <sstream>
#include <vector>

#ifdef GEMMFUSE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif
#include "product_route.h"
#include "run_call.h"

namespace gemmfuse::bindings {
namespace {

// Why gemmfuse::bmm rejects a and b, or "" where it takes them. Sizes are read as SymInts,
// so the Meta kernel checks with it too.
std::string bmm_rejects(const at::Tensor& a, const at::Tensor& b) {
  std::ostringstream os;
  if (a.dim() != 3 || b.dim() != 3)
    os << "both operands must be 3-D, got " << a.dim() << "-D and " << b.dim() << "-D";
  else if (a.sym_size(0) != b.sym_size(0))
    os << "batch sizes differ (" << a.sym_size(0) << " and " << b.sym_size(0) << ")";
  else if (a.sym_size(2) != b.sym_size(1))
    os << "shapes cannot be multiplied (" << a.sym_sizes() << " and " << b.sym_sizes() << ")";
  else if (a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat)
    os << "expected fp32 operands, got " << a.scalar_type() << " and " << b.scalar_type();
  else if (a.device() != b.device())
    os << "operands on different devices, " << a.device() << " and " << b.device();
  return os.str();
}

void check_bmm(const at::Tensor& a, const at::Tensor& b) {
  const std::string why = bmm_rejects(a, b);
  TORCH_CHECK(why.empty(), "gemmfuse::bmm: ", why);
}

// The batch on a device (RunOn: run_on_cpu, run_on_cuda): product i exactly as
// gemmfuse::linear with keep_weight=False runs one Linear, written into slice i of the
// output where each slice starts 256-byte aligned (as an allocation would: the kernels'
// vector stores and TMA want 16 bytes), else into its own tensor, the results stacked.
template <at::Tensor (*RunOn)(const CallInputs&, float*)>
at::Tensor bmm_on(const at::Tensor& a, const at::Tensor& b, c10::string_view precision) {
  check_bmm(a, b);
  const int64_t B = a.size(0), M = a.size(1), N = b.size(2);
  // An empty batch or product: nothing to multiply (K = 0 sums nothing, so zeros).
  if (a.numel() == 0 || b.numel() == 0) return at::zeros({B, M, N}, a.options());
  // Every product's W = b[i]ᵀ [N, K], from one contiguous copy for the whole batch.
  const at::Tensor weights = b.transpose(1, 2).contiguous();
  const std::string spec = linear_spec(weights[0], c10::nullopt);
  const c10::optional<at::Tensor> no_bias;
  const bool in_place = (M * N) % 64 == 0;
  at::Tensor out = in_place ? at::empty({B, M, N}, a.options()) : at::Tensor();
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < B; ++i) {
    const at::Tensor x = a[i].contiguous(), w = weights[i];
    CallInputs in{spec, x, w, no_bias, {}, {}, precision};
    in.keep_prepared = false;  // W changes every call: its preparation is for this call alone
    const at::Tensor slice = in_place ? out[i] : at::Tensor();
    if (in_place) in.out = &slice;
    at::Tensor y = RunOn(in, nullptr);
    if (!in_place) outs.push_back(std::move(y));
  }
  return in_place ? out : at::stack(outs);
}

// bmm_route for a batch bmm takes (3-D fp32 of matching shapes, one device, not empty): the
// place of its first product says; every product has the same shapes, so the same plan.
std::string route_of_batch(const at::Tensor& a, const at::Tensor& b, c10::string_view precision) {
  return switch_route(product_place(a[0], b[0].t(), c10::nullopt, precision), a, precision,
                      "at::bmm (one batched call)");
}

}  // namespace

at::Tensor bmm_cpu(const at::Tensor& a, const at::Tensor& b, c10::string_view precision) {
  return bmm_on<&run_on_cpu>(a, b, precision);
}

#ifdef GEMMFUSE_WITH_CUDA
at::Tensor bmm_cuda(const at::Tensor& a, const at::Tensor& b, c10::string_view precision) {
  c10::cuda::CUDAGuard guard(a.device());
  return bmm_on<&run_on_cuda>(a, b, precision);
}
#endif

at::Tensor bmm_meta(const at::Tensor& a, const at::Tensor& b, c10::string_view) {
  check_bmm(a, b);
  return at::empty_symint({a.sym_size(0), a.sym_size(1), b.sym_size(2)}, a.options());
}

// Never throws for operands bmm would reject or an empty batch: it returns why, so the
// caller runs PyTorch's bmm, which then raises PyTorch's own errors.
std::string bmm_route(const at::Tensor& a, const at::Tensor& b, c10::string_view precision) {
  const std::string why = bmm_rejects(a, b);
  if (!why.empty()) return why;
  if (a.numel() == 0 || b.numel() == 0) return "an empty product";
  return route_of_batch(a, b, precision);  // never throws (product_place)
}

}  // namespace gemmfuse::bindings

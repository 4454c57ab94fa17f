#include "product_route.h"

#include <cstdlib>

#ifdef GEMMFUSE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "cuda_executor.h"
#endif
#include "batched_linear.h"
#include "plan_cache.h"

namespace gemmfuse::bindings {
namespace {

// Whether PyTorch's own fp32 GEMM on CUDA keeps `precision`'s promise as it is set now: plain
// fp32 for "fp32" and "fast" (TF32 off), TF32 for "tf32". Where it does not, a product off
// the split kernel stays on gemmfuse's cuBLAS path, which sets its own math mode.
bool pytorch_gemm_keeps(c10::string_view precision) {
  const at::Float32Precision p =
      at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL);
  if (precision == "tf32") return p == at::Float32Precision::TF32;
  return p != at::Float32Precision::TF32 && p != at::Float32Precision::BF16;
}

// GEMMFUSE_ALWAYS_FUSE=1: every product the planner takes runs on gemmfuse (the tests use it
// to run gemmfuse's paths at any shape), as every chain the planner takes runs fused.
bool always_fuse() {
  const char* v = std::getenv("GEMMFUSE_ALWAYS_FUSE");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

ProductPlace product_place(const at::Tensor& x, const at::Tensor& w,
                           const c10::optional<at::Tensor>& b, c10::string_view precision) {
  using Where = ProductPlace::Where;
  try {
#ifdef GEMMFUSE_WITH_CUDA
    c10::optional<c10::cuda::CUDAGuard> guard;  // the plan's kernel selection is per device
    if (x.is_cuda()) guard.emplace(x.device());
#endif
    const Plan& plan = plan_for(linear_spec(w, b), x, w, b, {}, {}, precision);
    if (!plan.pytorch_faster.empty()) return {Where::PyTorch, plan.pytorch_faster};
#ifdef GEMMFUSE_WITH_CUDA
    if (x.is_cuda() && CudaExecutor::gemm_on_split_kernel(plan)) return {Where::SplitKernel, ""};
#endif
    return {Where::OtherGemm, ""};
  } catch (const c10::Error& e) {  // e.g. "gemmfuse unsupported: ..." from the planner
    return {Where::PyTorch, e.what_without_backtrace()};
  }
}

std::string switch_route(const ProductPlace& place, const at::Tensor& x,
                         c10::string_view precision, const char* pytorch_call) {
  if (place.where == ProductPlace::Where::PyTorch) return place.why;
  if (place.where == ProductPlace::Where::OtherGemm && x.is_cuda() && !always_fuse() &&
      pytorch_gemm_keeps(precision))
    return std::string("not on the split kernel at this shape: gemmfuse would run cuBLAS's GEMM ") +
           "or its small-M kernel, and " + pytorch_call + " runs it without gemmfuse's per-call work";
  return "";
}

std::string mm_route(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                     c10::string_view precision) {
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0))
    return "not a matrix product of matching shapes";
  if (a.numel() == 0 || b.numel() == 0) return "an empty product";
  return switch_route(product_place(a, b.t(), bias, precision), a, precision, "PyTorch's mm");
}

}  // namespace gemmfuse::bindings

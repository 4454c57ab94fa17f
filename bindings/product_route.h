// Where one fp32 product y = x Wᵀ (+ b) runs when gemmfuse plans it as one Linear: in PyTorch
// (the planner refuses it or expects PyTorch to be faster), on a split tensor-core kernel, or
// on another GEMM of gemmfuse's (cuBLAS's SGEMM or the small-M kernel; on the CPU, the CPU
// executor). The one rule behind gemmfuse::mm_route and gemmfuse::bmm_route (the matmul
// switch) and linear_cross_entropy's products, each of which reads its own answer from it.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace gemmfuse::bindings {

struct ProductPlace {
  enum class Where { PyTorch, SplitKernel, OtherGemm };
  Where where = Where::PyTorch;
  std::string why;  // PyTorch: the planner's reason
};

// Reads x's and w's shapes, dtypes and devices only (x [M, K], w [N, K]; views will do).
// Never throws for a product the planner refuses: that is PyTorch's, with the reason.
ProductPlace product_place(const at::Tensor& x, const at::Tensor& w,
                           const c10::optional<at::Tensor>& b, c10::string_view precision);

// The matmul switch's rule for a product at `place` (x: its left operand): "" where gemmfuse
// runs it, on a split kernel (CUDA) or the CPU executor (the CPU's reference path); else why
// `pytorch_call` runs it: the planner refuses it, or gemmfuse's cuBLAS or small-M path would
// only add its per-call work to the same GEMM (unless PyTorch's GEMM is set to a math mode
// that breaks `precision`'s promise, such as TF32 for fp32, or GEMMFUSE_ALWAYS_FUSE=1).
std::string switch_route(const ProductPlace& place, const at::Tensor& x,
                         c10::string_view precision, const char* pytorch_call);

// switch_route for a @ b (+ bias) (a [M, K], b [K, N]), PyTorch's mm the other way; never
// throws.
std::string mm_route(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                     c10::string_view precision);

}  // namespace gemmfuse::bindings

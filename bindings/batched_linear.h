// gemmfuse::bmm and gemmfuse::bmm_route (batched_linear.cpp), which ops_registry.cpp
// registers, and the Linear spec both files build (ops_registry.cpp).
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace gemmfuse::bindings {

// The spec of one Linear with the weight [out, in] and the bias, if any.
std::string linear_spec(const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// a [B, M, K] @ b [B, K, N] -> [B, M, N], fp32: each product one gemmfuse::linear.
at::Tensor bmm_cpu(const at::Tensor& a, const at::Tensor& b, c10::string_view precision);
#ifdef GEMMFUSE_WITH_CUDA
at::Tensor bmm_cuda(const at::Tensor& a, const at::Tensor& b, c10::string_view precision);
#endif
// Shape only, [B, M, N] (torch.compile's fake tensors).
at::Tensor bmm_meta(const at::Tensor& a, const at::Tensor& b, c10::string_view precision);

// "" where gemmfuse::bmm should run the batch, else why PyTorch's at::bmm runs it.
std::string bmm_route(const at::Tensor& a, const at::Tensor& b, c10::string_view precision);

}  // namespace gemmfuse::bindings

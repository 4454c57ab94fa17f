// gemmfuse::sdpa_f16x3: fp32 attention's forward on split fp16 products (CUDA; executors/cuda/
// attention/attention_f16x3.h), with the outputs of PyTorch's memory-efficient attention
// (aten._scaled_dot_product_efficient_attention), so that gemmfuse.fp32_matmul can run that
// op's forward while PyTorch's backward, which recomputes P from Q, K and the LSE, stays.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace gemmfuse::bindings {

// "" where sdpa_f16x3 takes q [B, H, Sq, D] and k, v [B, H, Sk, D] (fp32, CUDA, one device,
// D 64, 96 or 128, Sk > 0) and the additive mask `bias` (none; or fp32, no gradient,
// broadcasting to [B, H, Sq, Sk]), else why not.
std::string sdpa_f16x3_route(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& bias);

#ifdef GEMMFUSE_WITH_CUDA
// (out [B, H, Sq, D], lse [B, H, Sq rounded up to 32]: log Σ_j exp(s_ij), the padding 0).
std::tuple<at::Tensor, at::Tensor> sdpa_f16x3(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v,
                                              const c10::optional<at::Tensor>& bias,
                                              bool is_causal, double scale);

// (dq, dk, dv) from grad_out, the forward's operands, out and lse (sdpa_f16x3's, or PyTorch's
// memory-efficient attention's: the same LSE), head dims as the forward's.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sdpa_f16x3_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& bias, const at::Tensor& out, const at::Tensor& lse,
    bool is_causal, double scale);
#endif

// The outputs' shapes and dtypes alone (the Meta kernels: fake tensors, torch.compile's tracing).
std::tuple<at::Tensor, at::Tensor> sdpa_f16x3_meta(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   const c10::optional<at::Tensor>& bias,
                                                   bool is_causal, double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> sdpa_f16x3_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& bias, const at::Tensor& out, const at::Tensor& lse,
    bool is_causal, double scale);

// "" where sdpa_f16x3_backward takes these operands, else why not.
std::string sdpa_f16x3_backward_route(const at::Tensor& grad_out, const at::Tensor& q,
                                      const at::Tensor& k, const at::Tensor& v,
                                      const c10::optional<at::Tensor>& bias,
                                      const at::Tensor& out, const at::Tensor& lse);

}  // namespace gemmfuse::bindings

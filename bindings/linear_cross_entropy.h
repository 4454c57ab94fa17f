// gemmfuse::linear_cross_entropy, its backward and its description (linear_cross_entropy.cpp),
// which ops_registry.cpp registers: an LM head's Linear and cross-entropy loss without the
// [M, V] logits.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace gemmfuse::bindings {

// (loss, dx, dweight, dbias) and (dx, dweight, dbias); a gradient not computed is a tensor of
// no elements.
using LceForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using LceGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The ops' signatures: each declares the device kernel (CPU and CUDA: the inputs' device) and
// its Meta kernel (shapes only, for torch.compile's fake tensors).
using LceForwardFn = LceForward(const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, const at::Tensor& target,
                                int64_t ignore_index, double label_smoothing,
                                c10::string_view reduction, c10::string_view precision,
                                int64_t chunk_rows, bool with_grads);
using LceBackwardFn = LceGrads(const at::Tensor& grad_loss, const at::Tensor& x,
                               const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               const at::Tensor& target, int64_t ignore_index,
                               double label_smoothing, c10::string_view reduction,
                               c10::string_view precision, int64_t chunk_rows);

// F.cross_entropy(F.linear(x, weight, bias), target, ...) for x [M, K], weight [V, K], target
// [M] (int64), fp32; with `with_grads` and a mean or sum reduction also the loss's gradients
// for a unit grad_output. chunk_rows 0: chosen from V.
LceForwardFn linear_cross_entropy, linear_cross_entropy_meta;

// The gradients for grad_loss (a scalar for mean and sum, [M] for none), each chunk's logits
// computed again.
LceBackwardFn linear_cross_entropy_backward, linear_cross_entropy_backward_meta;

// The chunks' size and where each of the three products of the first chunk runs, and why.
std::string linear_cross_entropy_describe(const at::Tensor& x, const at::Tensor& weight,
                                          const c10::optional<at::Tensor>& bias,
                                          c10::string_view precision, int64_t chunk_rows);

}  // namespace gemmfuse::bindings

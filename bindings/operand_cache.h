// fp32 copies of a 16-bit model's operands (BatchNorm weight and bias, scale parameters): the
// executors read operands in fp32, and converting them on every call costs a bf16 m84 three
// conversion kernels per call (docs/measurements.md, "Host cost per fused chain call").
// Converted once per tensor version (TensorIdentity) and reused on the same stream; inference
// tensors, which have no version counter, are converted on every call.
#pragma once

#include <ATen/ATen.h>

namespace gemmfuse::bindings {

// `t` itself when it is fp32 and contiguous, else its fp32 contiguous copy.
at::Tensor fp32_operand(const at::Tensor& t);

}  // namespace gemmfuse::bindings

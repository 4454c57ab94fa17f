// A weight's gradient on fp32 mode's split kernel (the backward's dW, backward.cu): dW [N, K] =
// dVᵀ x for dV [M, N] and x [M, K], both read where they lie. dV's columns split as rows of
// dVᵀ (launch_split_f16x2_transposed), x split by columns (launch_split_f16x2_columns: each
// column of x is a column of dW, so its exponent factors out of the output) and read MN-major;
// then the GEMM N x K x M and the fix-up reading both transposed (fp32_gemm_f16x3.h). No
// second level: rows of dVᵀ crowded with tiny values are recomputed by the fix-up. Which
// shapes it takes: selection.h's f16x3_weight_grad_declines.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace gemmfuse::cuda {

struct WeightGradF16x3 {
  int64_t M = 0, N = 0, K = 0;  // dV [M, N], x [M, K], dW [N, K]: fp32, contiguous, 16-byte aligned
  const float* dv = nullptr;
  const float* x = nullptr;
  float* dw = nullptr;
  int splits = 0;               // the GEMM's (f16x3_splits(N, K, sms))
  void* workspace = nullptr;    // weight_grad_f16x3_workspace_bytes(M, N, K, splits)
};

size_t weight_grad_f16x3_workspace_bytes(int64_t M, int64_t N, int64_t K, int splits);
// Enqueues the splits, the GEMM and the fix-up on `stream`; no host sync.
void launch_weight_grad_f16x3(const WeightGradF16x3& g, cudaStream_t stream);

}  // namespace gemmfuse::cuda

// The split-K kernels of split_products_kernel.cuh, instantiated in gemm_split_k.cu: fp32's
// bf16x6 GEMM where its tiles would leave most SMs idle (dispatched from gemm_bf16x6.cu), and
// `fast`'s GEMM in the same case (from gemm_cublas.cu, instead of cuBLAS).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gemm_bf16x6.h"

namespace gemmfuse::cuda::sm90 {

size_t bf16x6_split_k_workspace_bytes(const Bf16x6Problem& p, int splits);

// As launch_bf16x6_gemm, with each output tile's K' cut into `splits` (> 1) ranges.
bool launch_bf16x6_split_k(const Bf16x6Problem& p, int splits, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream);

// `fast`'s GEMM, Y = xlo.Whi + xhi.Wlo + xhi.Whi (+ bias) in fp32, from the rows of the fast
// split (split.h: x as [lo | hi | hi], W' as [hi | lo | hi], segments Kh wide and zero padded),
// the two small products first; the tensor-core sums added into fp32 every 128 of K.
struct FastSplitProblem {
  int64_t M = 0, N = 0, Kh = 0;
  const __nv_bfloat16* x_split = nullptr;  // [M, 3 Kh]
  const __nv_bfloat16* w_split = nullptr;  // [N, 3 Kh]
  const float* bias = nullptr;             // [N], or null
  float* y = nullptr;                      // [M, N] row-major
};

// nullptr when `fast`'s GEMM runs on the split-K kernel here, else why not: an sm_90 GPU, the
// kernel built, output tiles that fill less than half the SMs (bf16x6_splits > 1: there
// cuBLAS's bf16 GEMM of the split, K' = 3 Kh, reached ~0.7x of it at 128 x 8192 x 8192 on an
// H100, bench/NOTES.md session 27), shapes within 32 bits, and GEMMFUSE_FAST_SPLIT_K not set to
// 0 in the environment (for A/B timing).
const char* fast_split_k_declines(int64_t M, int64_t N, int64_t Kh);

size_t fast_split_k_workspace_bytes(int64_t M, int64_t N, int64_t Kh);

// Enqueues it on `stream` for a shape fast_split_k_declines accepted; false (nothing
// enqueued) when a pointer is not 16-byte aligned or the workspace is too small.
bool launch_fast_split_k(const FastSplitProblem& p, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

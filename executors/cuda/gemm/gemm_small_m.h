// The fp32 Gemm step for a few rows of x (M <= 32): Y[M,N] = x[M,K] W[N,K]^T (+ bias), bound
// by reading W once, with a shorter summation chain than cuBLASLt's SGEMM (gemm_small_m.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "selection.h"

namespace gemmfuse::cuda {

// kSmallMMaxRows and kSmallMMaxK (x offsets are 32-bit) are the kernel selection's
// (selection.h), which gives this kernel the plans it takes.

// Whether the kernel takes this problem: 1 <= M <= 32, N >= 1, 1 <= K <= kSmallMMaxK, fp32
// arrays (4-byte aligned), and, unless the rows of x and W all start on 16-byte boundaries,
// room in the scratch for x shifted to W's alignment (at most 4 copies of M·(K + 6) floats).
bool small_m_gemm_fits(int64_t M, int64_t N, int64_t K, const void* x, const void* w,
                       size_t scratch_bytes);

// Row-major fp32 x[M,K], W[N,K], bias[N] (or nullptr), y[M,N]. `scratch` (stream-ordered,
// scratch_bytes long) holds x's shifted copies where needed and per-split partial sums when
// N is too small to fill the GPU with whole-K CTAs; with no room for the latter the kernel
// runs with fewer splits.
void launch_small_m_gemm(const float* x, const float* w, const float* bias, float* y, int64_t M,
                         int64_t N, int64_t K, void* scratch, size_t scratch_bytes,
                         cudaStream_t stream);

}  // namespace gemmfuse::cuda

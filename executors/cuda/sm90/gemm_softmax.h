// One Hopper kernel for Linear -> [gelu] -> [* a number] -> softmax over the last dim,
// for bf16/fp16 models: out = softmax(alpha * act(x W^T + b)), fp32 accumulation and an fp32
// epilogue, the output written once in the model's dtype.
//
// Why one kernel: a separate pass over Y costs >= 11 us at the seed shape (bench/NOTES.md),
// so the softmax must finish on chip. The kernel is persistent and holds every output tile
// on chip until its rows are complete: each CTA computes at most two 128x256 tiles (CUTLASS's
// TMA + wgmma cooperative mainloop), keeps exp(v - tile row max) of each in shared memory as
// fp16, publishes per-tile row (max, sum of exp) partials, meets the other CTAs at a grid
// barrier, merges the partials of its rows and writes out = e * exp(m_tile - m_row) / s_row.
// That needs every CTA resident at once, so a problem fits only when its tiles number at
// most twice the CTAs the GPU can hold (1024 x 8192 is 256 tiles for 128 CTAs on an H100).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "gemmfuse/plan.h"

namespace gemmfuse::cuda::sm90 {

enum class Activation : int { Identity = 0, GeluErf = 1 };

struct GemmSoftmaxProblem {
  int64_t M = 0, N = 0, K = 0;
  DType dtype = DType::BF16;  // x, W and out (BF16 or F16)
  const void* x = nullptr;    // [M, K] row-major
  const void* w = nullptr;    // [N, K] row-major
  const float* bias = nullptr;  // [N] fp32, or null
  void* out = nullptr;        // [M, N] row-major
  Activation act = Activation::Identity;
  float scale = 1.f;          // v = act(y) * scale
  // Optional timeline for the micro-benchmark: 16 %globaltimer slots (ns) per CTA, written by
  // its first thread (entry) and first consumer thread: entry, after each tile's mainloop
  // and epilogue (2 tiles),
  // after the grid barrier, after the row merge, end; 8: the first row-merge loads landed,
  // 9: the row merge computed; 10-12: the SM's clock64 at entry and after each mainloop.
  // Null in normal runs.
  unsigned long long* trace = nullptr;
};

// Whether this build has the kernel (it needs CUTLASS's headers at build time).
bool gemm_softmax_built();

// "" when the kernel can run this problem on the current device, else why not (for
// explain and the executor's fallback). Checks the device (sm_90, the kernel built), the
// alignment TMA needs (K and N multiples of 8) and that all tiles fit on chip at once.
std::string gemm_softmax_unfit(int64_t M, int64_t N, int64_t K, DType dtype);

// Workspace: the row partials (float2 [N/256][M]).
size_t gemm_softmax_workspace_bytes(int64_t M, int64_t N);

// Enqueues the kernel on `stream` for a problem gemm_softmax_unfit accepted (x, w, out and
// the workspace 16-byte aligned).
// The launch is cooperative: false (nothing enqueued) when the driver finds that the GPU
// cannot hold the whole grid now (e.g. an MPS limit on SMs); the caller then computes the
// chain another way.
bool launch_gemm_softmax(const GemmSoftmaxProblem& p, void* workspace, cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

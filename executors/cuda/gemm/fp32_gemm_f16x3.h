// fp32 mode's GEMM on fp16 tensor cores, end to end, as the executor runs it and as tests and
// probes time it: x's split (split.h) and its second level, the GEMM (sm90/gemm_f16x3.h), the
// second level's GEMM over the rows it took (none in the common case: CTAs that start, read a
// zero count and leave), and the fp32 fix-up; in stream order, programmatic launches, no
// host sync.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "split.h"

namespace gemmfuse::cuda {

// Per-call buffers (the executor's workspace, layout.h).
struct F16x3Scratch {
  __half* x_parts = nullptr;  // [2, M, K]
  float* x_exps = nullptr;    // [M]
  int* x_flags = nullptr;     // [M]
  int* x_tiny = nullptr;      // [M]
  SecondLevel second;         // second.y may alias x_parts: x's parts are dead by then.
                              // Without second.parts there is no second level: rows with more
                              // tiny values than the fix-up corrects are recomputed by it (fp32
                              // FMA: slower where many rows have them, as exact)
  void* x_stats = nullptr;    // x transposed: split_f16x2_transposed_scratch_bytes(M)
};

struct Fp32GemmF16x3 {
  int64_t M = 0, N = 0, K = 0;
  const float* x = nullptr;        // [M, K]
  const float* w = nullptr;        // [N, K]: W' in fp32, for the fix-up
  const __half* w_parts = nullptr; // W's split (prepared once per weight version)
  const float* w_exps = nullptr;
  const int* w_list = nullptr;
  const int* w_flags = nullptr;
  const float* bias = nullptr;     // [N], or null
  float* y = nullptr;              // [M, N]
  // N not a multiple of 4 (the kernel's TMA store needs 16-byte rows): the GEMMs write
  // y_padded [M, ldy] (ldy = N rounded up to 4; the second level's products too), which is
  // copied into y before the fix-up. Null: they write y.
  float* y_padded = nullptr;
  int64_t ldy = 0;
  F16x3Scratch scratch;
  void* gemm_workspace = nullptr;  // the kernel's (sm90::f16x3_workspace_bytes)
  size_t gemm_workspace_bytes = 0;
  int splits = 0;                  // as sm90::F16x3Problem's (tests and probes)
  // w and w_parts stored [K, N] (W read MN-major, as dx = dV W reads the weight), w_exps per
  // n from launch_split_f16x2_columns.
  bool w_transposed = false;
  // x stored [K, M] (dW = dVᵀ x reads dV [M_lin, N_lin] so): split by
  // launch_split_f16x2_transposed into the same parts, no second level; w_transposed too.
  bool x_transposed = false;
};

// Where W's split by columns goes: its parts [2, K, N] fp16, exponents and marks [N], the
// marked columns' list [1 + N] and launch_split_f16x2_columns's scratch.
struct ColumnSplitBuffers {
  __half* parts;
  float* exps;
  int* flags;
  int* list;
  void* stats;
};

// W stored [K, N] (g.K, g.N set) split by columns into b, and g's W read MN-major from them
// (w, w_parts, w_exps, w_list, w_flags, w_transposed): as dx = dV W reads the weight and
// dW = dVᵀ x reads x. Stream-ordered.
void split_w_by_columns(Fp32GemmF16x3& g, const float* w, const ColumnSplitBuffers& b, cudaStream_t stream);

// Enqueues the whole GEMM on `stream`. Throws std::logic_error where the kernel declines the
// call (unaligned pointers, too little workspace): the kernel selection gave it the shape
// (selection.h's f16x3_unfit).
void launch_fp32_gemm_f16x3(const Fp32GemmF16x3& g, cudaStream_t stream);

}  // namespace gemmfuse::cuda

// fp32 GEMM on Hopper's fp16 tensor cores, at SGEMM's accuracy or better from K = 128:
// Y[M,N] = x[M,K] W[N,K]^T + bias[N], fp32 in and out. Each row of x and of W is scaled by a
// power of two (2^e, exact) that puts its largest value just below fp16's largest, and split
// into two fp16 parts, v 2^e = v0 + 2^-11 v1 (split.h: 22 significant bits, within 2^-22 of
// each value). Y is the sum of the three part products x0.w0 + 2^-11 (x1.w0 + x0.w1) (the one
// left out, x1.w1, is below 2^-22 of each term), the large product's tensor-core sum added
// into fp32 registers every 64 of K and the small ones' apart (split_products_mainloop.h),
// then the row scales undone in the epilogue: Y = acc 2^-(ex[m] + ew[n]) + bias[n].
// Three fp16 products are the tensor-core time of three bf16 ones (`fast`) or of 1.5 TF32
// GEMMs. The fp16 rounding of the parts costs ~2^-24 of each value, a fixed error where a
// plain fp32 dot product's grows with K: from K = 128 on (kF16x3MinK) the kernel's error
// is below SGEMM's, and at K = 8 above it (docs/measurements.md, "The GEMM variants at the
// reference shape").
//
// Why: cuBLAS's SGEMM takes almost all of the seed models' time in fp32, bound by the FP32
// cores; three fp16 products on the tensor cores take a fraction of it, and half the time of
// six bf16 ones (docs/measurements.md, "The f16x3 kernel's mainloop").
//
// Values the split cannot carry: NaN and infinities (a part product would make 0 * inf = NaN
// where fp32 gives inf), and nonzero values more than ~2^28 below their row's largest ("tiny":
// scaled, they fall below fp16's normal range and lose their low bits, which matters where the
// other operand is large at their k). The split passes mark the rows of x and of W that hold
// one (split.h): rows and columns with a NaN are written NaN; W's rows with infinities or tiny
// values, and x's with many infinities, are recomputed in plain fp32 as SGEMM does; x's other
// infinities and tiny values come back through the fix-up's corrections (few) or, for tiny
// values, a second level of the split and a second pass of this kernel over the rows holding
// them (many: softmax-like data), all launched by fp32_gemm_f16x3.h. torch.rand's and
// nn.Linear's grids never reach that range (2^-24).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "selection.h"

namespace gemmfuse::cuda::sm90 {

struct F16x3Problem {
  int64_t M = 0, N = 0, K = 0;
  const __half* x_parts = nullptr;  // 2 planes of [M, K]: x0, x1 (launch_split_f16x2)
  const __half* w_parts = nullptr;  // 2 planes of [N, K]: w0, w1 (w_mn_major: of [K, N])
  const float* x_exps = nullptr;    // [M]: x's row exponents
  const float* w_exps = nullptr;    // [N]: W's row exponents
  const float* bias = nullptr;      // [N], or null
  float* y = nullptr;               // [M, N] row-major, rows ldy apart
  // Y's row stride (0: N), a multiple of 4 (the TMA store's 16-byte rows): an N that is not
  // one writes into rows padded to the next multiple of 4.
  int64_t ldy = 0;
  // 1: the wide kernel (2-CTA clusters, one CTA per output tile); more: the split-K kernel with
  // each tile's K cut into that many ranges (the executor: the Selection's); 0: f16x3_splits's
  // choice for this device (tests and probes).
  int splits = 0;
  // Device memory, or null: with it, only Y's first *rows rows are computed (clamped to
  // [0, M]; the wide kernel, whatever `splits` says), the count read when the kernel starts,
  // after the kernel before it on the stream has finished (fp32's second level, split.h).
  const int* rows = nullptr;
  // W's parts stored [K, N] and read MN-major (with w_exps per n, a column split: split.h's
  // launch_split_f16x2_columns); N a multiple of 8.
  bool w_mn_major = false;
};

// Which shapes the kernel takes, how many ranges K is cut into and the cost model against
// SGEMM are the kernel selection's (selection.h: f16x3_unfit, f16x3_splits, f16x3_cost).
using cuda::f16x3_slower_than_sgemm;
using cuda::f16x3_splits;
using cuda::kF16x3MaxSplits;
using cuda::kF16x3MinK;
using cuda::kF16x3MinRows;
using cuda::kF16x3TileMN;

// Whether this build has the kernel (it needs CUTLASS's headers at build time).
bool f16x3_built();

// The workspace launch_f16x3_gemm needs for this shape on the current device (the split-K
// kernel keeps its partial tiles there), W read K-major or (w_mn_major) MN-major, K cut into
// `splits` ranges (0: f16x3_splits's choice for this device).
size_t f16x3_workspace_bytes(int64_t M, int64_t N, int64_t K, bool w_mn_major = false, int splits = 0);

// Enqueues the GEMM on `stream` for a shape the selection's f16x3_unfit accepted. False (nothing enqueued)
// when a pointer is not 16-byte aligned or the kernel needs more workspace than given.
bool launch_f16x3_gemm(const F16x3Problem& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

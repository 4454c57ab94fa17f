// fp32 GEMM on Hopper's bf16 tensor cores, at SGEMM's accuracy or better:
// Y[M,N] = x[M,K] W[N,K]^T + bias[N], fp32 in and out. Each value is split into three bf16
// parts, v = v0 + v1 + v2 (split.h: exact for all but the exceptional values below), and Y is
// the sum of the six part products x_i.w_j with i + j <= 2 (the three left out are below
// 2^-24 of each term), the tensor-core accumulator added into fp32 registers every 64 of K
// (split_products_mainloop.h). Six bf16 products are the tensor-core time of three TF32 ones.
//
// Why: fp32 mode ran cuBLAS's SGEMM, 2.7 ms of the seed models' ~2.75 ms on an H100,
// bound by the FP32 cores (bench/NOTES.md, session 18).
//
// Exceptional values (NaN, infinities, |v| above bf16's largest finite value or nonzero
// below 2^-110, whose third part would be subnormal) have no exact split: a part product
// would make 0 * inf = NaN where fp32 gives inf, or lose v's low bits. The split passes mark
// the rows of x and of W that hold one (their parts are zeroed), and launch_fixup_exceptional
// recomputes those rows and columns of Y in plain fp32, as SGEMM does (split.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace gemmfuse::cuda::sm90 {

struct Bf16x6Problem {
  int64_t M = 0, N = 0, K = 0;
  const __nv_bfloat16* x_parts = nullptr;  // 3 planes of [M, K]: x0, x1, x2
  const __nv_bfloat16* w_parts = nullptr;  // 3 planes of [N, K]: w0, w1, w2
  const float* bias = nullptr;             // [N], or null
  float* y = nullptr;                      // [M, N] row-major
  // 1: the wide kernel (2-CTA clusters, one CTA per output tile); more: the split-K kernel with
  // each tile's K cut into that many ranges; 0: bf16x6_splits's choice. Tests and probes set it.
  int splits = 0;
};

// The kernel's output tiles are kBf16x6TileMN x kBf16x6TileMN.
constexpr int kBf16x6TileMN = 128;

// Whether this build has the kernel (it needs CUTLASS's headers at build time).
bool bf16x6_built();

// Rows from which the kernel may run; bf16x6_slower_than_sgemm decides above it. With up to
// 32 rows fp32 GEMMs run on gemm_small_m.h's kernel, which reads W once in fp32. At N = K =
// 8192 on an H100 the split-K kernel ran 1.16x SGEMM at 64 rows, 2.05x at 128 (bench/NOTES.md,
// session 27).
constexpr int64_t kBf16x6MinRows = 33;

// The most ranges the split-K kernel cuts K into.
constexpr int kBf16x6MaxSplits = 8;

// How many ranges each output tile's K is cut into on a GPU with `sms` SMs: 1 (the wide
// kernel) when the 128x128 tiles fill at least half the SMs, else as many as keep every
// CTA on an SM of its own (at most kBf16x6MaxSplits); and at least 2 where all tiles are in
// one row (M <= 128), whose 2-CTA clusters would leave half the wide kernel's CTAs empty.
int bf16x6_splits(int64_t M, int64_t N, int sms);

// The workspace launch_bf16x6_gemm needs for this shape on the current device (the split-K
// kernel keeps its partial tiles there).
size_t bf16x6_workspace_bytes(int64_t M, int64_t N, int64_t K);

// nullptr when the kernel runs this shape on the current device, else why not (a string
// that lives as long as the process; no allocation per call): an sm_90 GPU, the kernel
// built, K a multiple of 8 and N of 4 (16-byte TMA rows), at least kBf16x6MinRows rows, and
// GEMMFUSE_BF16X6 not set to 0 in the environment (for A/B timing).
const char* bf16x6_unfit(int64_t M, int64_t N, int64_t K);

// nullptr when the kernel is expected to beat SGEMM at this shape on an H100-class GPU with
// `sms` SMs, else why not. A cost model fitted to H100 measurements (bench/NOTES.md, session
// 20: fp32 mode ran 0.36-0.97x eager at shapes whose tiles leave most SMs idle or whose
// GEMM is too small for the split's fixed costs; session 27 added the split-K kernel and
// W's reads). The kernel's time: the x split, 10 bytes per x value at ~2.2 TB/s; then the
// larger of one 128x128 tile's six products, ~38 ns per unit of K divided by the splits,
// per wave of the CTAs over the SMs, and one read of W's bf16 parts (6 bytes per W value) at
// ~3.4 TB/s; ~5 us of fix-up and launch gaps. SGEMM's: 2MNK at ~45 TFLOP/s.
// GEMMs under kHostBoundGemmFlops (gemmfuse/plan.h) stay on SGEMM: their calls are bound by
// host work.
const char* bf16x6_slower_than_sgemm(int64_t M, int64_t N, int64_t K, int sms);

// nullptr when an fp32-mode GEMM of this shape runs on the kernel here: bf16x6_unfit
// accepts it and bf16x6_slower_than_sgemm (for this device's SMs) does not rule it out;
// else the reason, for explain.
const char* bf16x6_declines(int64_t M, int64_t N, int64_t K);

// Enqueues the GEMM on `stream` for a shape bf16x6_unfit accepted. False (nothing enqueued)
// when a pointer is not 16-byte aligned or the kernel needs more workspace than given.
bool launch_bf16x6_gemm(const Bf16x6Problem& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

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
// is 0.67x SGEMM's or less (0.15x at K = 8192), at K = 8 1.6x (docs/measurements.md).
//
// Why: cuBLAS's SGEMM takes 2.7 ms of the seed models' ~2.75 ms in fp32 on an H100, bound
// by the FP32 cores; six bf16 products take 1.06 ms at the seed shape, these three 0.58
// (docs/measurements.md).
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

namespace gemmfuse::cuda::sm90 {

struct F16x3Problem {
  int64_t M = 0, N = 0, K = 0;
  const __half* x_parts = nullptr;  // 2 planes of [M, K]: x0, x1 (launch_split_f16x2)
  const __half* w_parts = nullptr;  // 2 planes of [N, K]: w0, w1 (w_mn_major: of [K, N])
  const float* x_exps = nullptr;    // [M]: x's row exponents
  const float* w_exps = nullptr;    // [N]: W's row exponents
  const float* bias = nullptr;      // [N], or null
  float* y = nullptr;               // [M, N] row-major
  // 1: the wide kernel (2-CTA clusters, one CTA per output tile); more: the split-K kernel with
  // each tile's K cut into that many ranges; 0: f16x3_splits's choice. Tests and probes set it.
  int splits = 0;
  // Device memory, or null: with it, only Y's first *rows rows are computed (clamped to
  // [0, M]; the wide kernel, whatever `splits` says), the count read when the kernel starts,
  // after the kernel before it on the stream has finished (fp32's second level, split.h).
  const int* rows = nullptr;
  // W's parts stored [K, N] and read MN-major (with w_exps per n, a column split: split.h's
  // launch_split_f16x2_columns); N a multiple of 8.
  bool w_mn_major = false;
};

// The kernel's output tiles are kF16x3TileMN x kF16x3TileMN.
constexpr int kF16x3TileMN = 128;

// Whether this build has the kernel (it needs CUTLASS's headers at build time).
bool f16x3_built();

// Rows from which the kernel may run; f16x3_slower_than_sgemm decides above it. With up to
// 32 rows fp32 GEMMs run on gemm_small_m.h's kernel, which reads W once in fp32 (as many
// bytes as W's two fp16 parts). At N = K = 8192 on an H100 the split-K kernel runs 1.61x SGEMM
// at 64 rows, 2.69x at 128 (docs/measurements.md).
constexpr int64_t kF16x3MinRows = 33;

// The least K the kernel takes: below it the parts' fixed rounding error is not well under
// a fp32 dot product's (0.84x SGEMM's at K = 64, 1.0x at 16-32, 1.6x at 8; 0.67x at 128).
constexpr int64_t kF16x3MinK = 128;

// The most ranges the split-K kernel cuts K into.
constexpr int kF16x3MaxSplits = 8;

// How many ranges each output tile's K is cut into on a GPU with `sms` SMs: 1 (the wide
// kernel) when the 128x128 tiles fill at least half the SMs, else as many as keep every
// CTA on an SM of its own (at most kF16x3MaxSplits); and at least 2 where all tiles are in
// one row (M <= 128), whose 2-CTA clusters would leave half the wide kernel's CTAs empty.
int f16x3_splits(int64_t M, int64_t N, int sms);

// The workspace launch_f16x3_gemm needs for this shape on the current device (the split-K
// kernel keeps its partial tiles there), W read K-major or (w_mn_major) MN-major.
size_t f16x3_workspace_bytes(int64_t M, int64_t N, int64_t K, bool w_mn_major = false);

// nullptr when the kernel runs this shape on the current device, else why not (a string
// that lives as long as the process; no allocation per call): an sm_90 GPU, the kernel
// built, K a multiple of 8 and N of 4 (16-byte TMA rows), at least kF16x3MinRows rows and
// kF16x3MinK of K, and GEMMFUSE_F16X3 not set to 0 in the environment (for A/B timing).
const char* f16x3_unfit(int64_t M, int64_t N, int64_t K);

// nullptr when the kernel is expected to beat SGEMM at this shape on an H100-class GPU with
// `sms` SMs, else why not. A cost model fitted to H100 measurements (docs/measurements.md:
// without it fp32 mode runs 0.36-0.97x eager at shapes whose tiles leave most SMs idle or
// whose GEMM is too small for the split's fixed costs). The kernel's time: the x
// split, 8 bytes per x value at ~1.8 TB/s; then the larger of one 128x128 tile's three
// products, ~17 ns per unit of K divided by the splits, per wave of the CTAs over the SMs,
// and one read of W's fp16 parts (4 bytes per W value) at ~2.2 TB/s; ~5 us of fix-up and
// launch gaps. SGEMM's: 2MNK at ~45 TFLOP/s, M rounded up to its 64-row tiles.
// GEMMs under kHostBoundGemmFlops (gemmfuse/plan.h) stay on SGEMM: their calls are bound by
// host work.
const char* f16x3_slower_than_sgemm(int64_t M, int64_t N, int64_t K, int sms);

// nullptr when an fp32-mode GEMM of this shape runs on the kernel here: f16x3_unfit
// accepts it and f16x3_slower_than_sgemm (for this device's SMs) does not rule it out;
// else the reason, for explain.
const char* f16x3_declines(int64_t M, int64_t N, int64_t K);

// The same for the kernel reading W MN-major (F16x3Problem::w_mn_major): N a multiple of 8 too.
const char* f16x3_declines_mn_major(int64_t M, int64_t N, int64_t K);

// Enqueues the GEMM on `stream` for a shape f16x3_unfit accepted. False (nothing enqueued)
// when a pointer is not 16-byte aligned or the kernel needs more workspace than given.
bool launch_f16x3_gemm(const F16x3Problem& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

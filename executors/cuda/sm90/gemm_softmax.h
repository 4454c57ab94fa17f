// One Hopper kernel for Linear -> [gelu] -> [* a number] -> softmax over the last dim,
// for bf16/fp16 models: out = softmax(alpha * act(x W^T + b)), fp32 accumulation and an fp32
// epilogue, the output written once in the model's dtype.
//
// Why one kernel: a separate pass over Y reads and writes it once more, a large share of the
// GEMM's own time at the seed shape (docs/measurements.md, "The fused softmax kernel"), so
// the softmax must finish on chip. The kernel is persistent and holds every output tile
// on chip until its rows are complete: each CTA computes at most two 128x256 tiles (CUTLASS's
// TMA + wgmma cooperative mainloop; the first tile's epilogue runs between the second's
// k-steps), keeps exp(v - tile row max) of each in shared memory as
// fp16, publishes its row (max, sum of exp) partials, reads those of the other CTAs of its
// rows as they arrive (no grid barrier), merges them and writes
// out = e * exp(m_tile - m_row) / s_row.
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
  // Optional timeline for the micro-benchmark: kGemmSoftmaxTraceSlots stamps per CTA (see
  // TraceSlot), written by its first consumer thread; only in a build with
  // GEMMFUSE_KERNEL_TRACE=1 (the probes' build), ignored otherwise. Null in normal runs.
  unsigned long long* trace = nullptr;
  // Whether the tiles' epilogues may go through the kernel's deferred form (the first under
  // the second tile's mainloop; false: each whole after its mainloop, for the
  // micro-benchmark's A/B).
  bool defer_epilogues = true;
  // W's loads marked evict-first in L2 (false: the default policy, for the A/B).
  bool w_evict_first = true;
  // Direct launches programmatic (false: cooperative; FusedSoftmaxChoice::programmatic).
  bool programmatic = true;
};

// GemmSoftmaxProblem::trace: %globaltimer (ns) at the end of each phase, and the SM's
// clock64 at some of them (cycles over ns between two such stamps: the SM clock).
enum TraceSlot : int {
  kTraceEntry = 0,
  kTraceMainloop1 = 1,   // tile 1's mainloop done
  kTraceEpilogue1 = 2,   // its epilogue done (or, deferred, its prepare)
  kTraceMainloop2 = 3,
  kTraceEpilogue2 = 4,
  kTraceBarrier = 5,     // every CTA of its rows has published (thread 0's row)
  kTraceMerge = 6,       // row scales computed
  kTraceStores = 7,      // output stores issued
  kTraceMergeMath = 9,   // the row merge computed
  kTraceFirstStage1 = 10,  // each mainloop's first stage landed
  kTraceFirstStage2 = 11,
  kTraceLastSync = 12,     // the last epilogue: past its consumer sync, its prepare
  kTraceLastPrepare = 13,
  kTraceClockEntry = 16,   // clock64 at entry and at the end of the phases
  kTraceClockMainloop1 = 17,
  kTraceClockMainloop2 = 18,
  kTraceClockEpilogue2 = 19,
  kTraceClockBarrier = 20,
  kTraceClockStores = 21,
  kTraceSmId = 22,         // the SM the CTA ran on (%smid)
};
constexpr int kGemmSoftmaxTraceSlots = 24;

// Whether this build has the kernel (it needs CUTLASS's headers at build time).
bool gemm_softmax_built();

// Clusters of this kernel (for the 16-bit type `dtype`) the current device holds at once: 0
// where it does not fit, on a GPU other than sm_90, or in a build without the kernel. Read
// once per device; the kernel selection (selection.h) decides from it which problems the
// kernel takes (every tile on chip at once).
int gemm_softmax_max_clusters(DType dtype);

// Workspace: where the CTAs exchange row statistics when the launch is captured into a CUDA
// graph (16 bytes per row and 256 columns); direct launches use a buffer kept per stream.
// Nothing to clear before a launch.
size_t gemm_softmax_workspace_bytes(int64_t M, int64_t N);

// Enqueues the kernel on `stream` for a problem the kernel selection gave it (x, w, out and
// the workspace 16-byte aligned).
// Every CTA must be resident at once. Direct launches are programmatic (they start while the
// stream's previous kernel finishes; `programmatic` false makes them cooperative, for A/B
// timing), rely on the grid fitting on the GPU (checked by the selection) and are
// ordered after the last one on another stream;
// under MPS or graph capture the launch is cooperative: false (nothing enqueued) when the
// driver finds that the GPU cannot hold the whole grid now (e.g. an MPS limit on SMs); the
// caller then computes the chain another way.
bool launch_gemm_softmax(const GemmSoftmaxProblem& p, void* workspace, cudaStream_t stream);

}  // namespace gemmfuse::cuda::sm90

// Training BatchNorm statistics over the M rows of an fp32 [M, W] buffer.
//
// Default (W % 4 == 0, aligned, W/32 column slices >= 1.5x the SMs, else W/16 >= the SMs):
// colstats_fused_kernel, one kernel, described where it is defined; faster than the two
// levels below at the reference shape (docs/measurements.md, "Column statistics").
// Otherwise, or with set_fused_colstats(0), two levels:
//
// Level 1 (colstats_partial4_kernel when W % 4 == 0, else colstats_partial_kernel): grid
// (column blocks, R row chunks), 8 warps striding over the chunk's rows; a thread keeps its
// columns' shifted sums s1 = sum(x - x0), s2 = sum((x - x0)^2) in fp64 (x0 = the column's first
// value, which keeps s2 - s1^2/n free of cancellation); the 8 warps combine in a fixed order and
// write [chunk][2][W] fp64 partials to the workspace. The vector kernel reads 4 columns per
// thread with 16-byte loads (a warp: 512 contiguous bytes per row), 8 rows in flight.
// num_batches_tracked += 1 is done by one thread of level 1 (nothing in level 1 reads it).
// Level 2 (colstats_finalize_kernel): a thread per column adds the R partials in order (loads
// unrolled, all in flight): mean, biased var -> [3, W] (mean, invstd, var rows); running_mean/var
// updated with the momentum (or 1/num_batches for momentum=None: the count already includes
// this batch) and the unbiased var.
// Eval (input == -1, a BatchNorm not folded into W): colstats_running_kernel, stats from the
// running statistics, nothing read from the rows, nothing updated.
// Deterministic: no atomics, fixed orders.
#include "column_stats.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "batch_norm_op.h"
#include "cuda_check.h"
#include "layout.h"
#include "prepare.h"
#include "programmatic_launch.h"
#include "running_stats.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kCols = 32, kWarps = 8;
constexpr int64_t kRowsPerChunk = 64;
constexpr int64_t kMaxChunks = 32;

__device__ __forceinline__ void count_batch(int64_t* num_batches) {
  if (num_batches && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *num_batches += 1;
}

// Shifted fp64 sums of 4 columns: sum(x - x0) and sum((x - x0)^2) with x0 the column's first
// value, so the variance stays exact when |mean| >> std. Columns past W keep zeros.
struct ShiftedSums4 {
  double x0[4] = {0.0, 0.0, 0.0, 0.0}, s1[4] = {0.0, 0.0, 0.0, 0.0}, s2[4] = {0.0, 0.0, 0.0, 0.0};
  __device__ __forceinline__ void shift(const float4 first) {
    x0[0] = first.x; x0[1] = first.y; x0[2] = first.z; x0[3] = first.w;
  }
  __device__ __forceinline__ void add(const float4 q) {
    const double d[4] = {q.x - x0[0], q.y - x0[1], q.z - x0[2], q.w - x0[3]};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s1[j] += d[j];
      s2[j] = fma(d[j], d[j], s2[j]);
    }
  }
};

// 4 columns per thread, 128 per CTA; W % 4 == 0 and y 16-byte aligned.
__global__ void __launch_bounds__(kCols * kWarps)
    colstats_partial4_kernel(const float* __restrict__ y, int64_t M, int64_t W,
                             int64_t rows_per_chunk, double* __restrict__ partials,
                             int64_t* num_batches) {
  __shared__ double s1s[kWarps][4 * kCols], s2s[kWarps][4 * kCols];
  count_batch(num_batches);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kCols + lane) * 4;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(M, r0 + rows_per_chunk);
  ShiftedSums4 acc;
  if (c < W) {
    acc.shift(*reinterpret_cast<const float4*>(y + c));
    int64_t r = r0 + warp;
    for (; r + 7 * kWarps < r1; r += 8 * kWarps) {  // 8 loads in flight, added in row order
      float4 q[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) q[j] = __ldcg(reinterpret_cast<const float4*>(y + (r + j * kWarps) * W + c));
#pragma unroll
      for (int j = 0; j < 8; ++j) acc.add(q[j]);
    }
    for (; r < r1; r += kWarps) acc.add(__ldcg(reinterpret_cast<const float4*>(y + r * W + c)));
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // [warp][column within the CTA]: conflict-free
    s1s[warp][4 * lane + j] = acc.s1[j];
    s2s[warp][4 * lane + j] = acc.s2[j];
  }
  __syncthreads();
  // 256 threads, 128 columns: thread i < 128 sums column i's s1, thread 128 + i its s2.
  const int i = threadIdx.x & 127;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 4 * kCols + i;
  if (col < W) {
    const bool second = threadIdx.x >= 128;
    double a = 0.0;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) a += second ? s2s[k][i] : s1s[k][i];
    partials[static_cast<int64_t>(blockIdx.y) * 2 * W + (second ? W : 0) + col] = a;
  }
}

__global__ void __launch_bounds__(kCols * kWarps)
    colstats_partial_kernel(const float* __restrict__ y, int64_t M, int64_t W,
                            int64_t rows_per_chunk, double* __restrict__ partials,
                            int64_t* num_batches) {
  __shared__ double s1s[kWarps][kCols], s2s[kWarps][kCols];
  count_batch(num_batches);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCols + lane;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(M, r0 + rows_per_chunk);
  double s1 = 0.0, s2 = 0.0;
  if (c < W) {
    const double x0 = y[c];
    int64_t r = r0 + warp;
    for (; r + 3 * kWarps < r1; r += 4 * kWarps) {  // 4 loads in flight
      const float a = y[r * W + c], b = y[(r + kWarps) * W + c],
                  d = y[(r + 2 * kWarps) * W + c], e = y[(r + 3 * kWarps) * W + c];
      const double da = a - x0, db = b - x0, dd = d - x0, de = e - x0;
      s1 += (da + db) + (dd + de);
      s2 += (da * da + db * db) + (dd * dd + de * de);
    }
    for (; r < r1; r += kWarps) {
      const double d = static_cast<double>(y[r * W + c]) - x0;
      s1 += d;
      s2 += d * d;
    }
  }
  s1s[warp][lane] = s1;
  s2s[warp][lane] = s2;
  __syncthreads();
  if (warp == 0 && c < W) {
    double a = 0.0, b = 0.0;
    for (int i = 0; i < kWarps; ++i) {
      a += s1s[i][lane];
      b += s2s[i][lane];
    }
    double* p = partials + static_cast<int64_t>(blockIdx.y) * 2 * W;
    p[c] = a;
    p[W + c] = b;
  }
}

// Column c's statistics into stats [3, W] (mean, invstd, var rows), and, where the running
// statistics are given, their update with factor m.
__device__ __forceinline__ void finish_column(int64_t c, int64_t W, BatchNormOp::Stats st, double n,
                                              double eps, double m, float* __restrict__ stats,
                                              RunningStat running_mean, RunningStat running_var) {
  stats[c] = static_cast<float>(st.mean);
  stats[W + c] = BatchNormOp::invstd(st.var, eps);
  stats[2 * W + c] = static_cast<float>(st.var);
  if (running_mean && running_var) {
    store_stat(running_mean, c, BatchNormOp::running_mean(load_stat(running_mean, c), st.mean, m));
    store_stat(running_var, c, BatchNormOp::running_var(load_stat(running_var, c), st.var, n, m));
  }
}

__global__ void colstats_finalize_kernel(const float* __restrict__ y,
                                         const double* __restrict__ partials, int64_t R,
                                         int64_t M, int64_t W, double eps, double momentum,
                                         float* __restrict__ stats, RunningStat running_mean,
                                         RunningStat running_var, const int64_t* num_batches) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= W) return;
  double s1 = 0.0, s2 = 0.0;
  int64_t i = 0;
  for (; i + 8 <= R; i += 8) {  // 16 independent loads in flight, then added in order
    double a[8], b[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      a[j] = partials[(i + j) * 2 * W + c];
      b[j] = partials[(i + j) * 2 * W + W + c];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s1 += a[j];
      s2 += b[j];
    }
  }
  for (; i < R; ++i) {
    s1 += partials[i * 2 * W + c];
    s2 += partials[i * 2 * W + W + c];
  }
  // momentum < 0: None, the cumulative average with factor 1/num_batches_tracked (which level 1
  // already incremented for this batch).
  const double m = momentum >= 0.0 || !(running_mean && running_var)
                       ? momentum : 1.0 / static_cast<double>(*num_batches);
  finish_column(c, W, BatchNormOp::from_shifted_sums(y[c], s1, s2, static_cast<double>(M)),
                static_cast<double>(M), eps, m, stats, running_mean, running_var);
}

// One kernel (fused): a CTA per slice of 4*TC columns streams all M rows: TC threads per row
// (16-byte loads, a row segment of 16*TC contiguous bytes), 256/TC rows per pass, 8 loads in
// flight per thread; shifted fp64 sums as above; the row lanes combine in a fixed order in shared
// memory; one thread per column finalizes (stats and running statistics). No workspace.
// num_batches_tracked: incremented here by one thread when nothing in the kernel reads it
// (momentum given); for momentum=None every CTA reads the old count (m = 1/(count+1)) and
// colstats_count_kernel increments it afterwards.
constexpr int kFusedThreads = 256;

template <int TC>
__global__ void __launch_bounds__(kFusedThreads)
    colstats_fused_kernel(const float* __restrict__ y, int64_t M, int64_t W, double eps,
                          double momentum, float* __restrict__ stats, RunningStat running_mean,
                          RunningStat running_var, int64_t* num_batches, bool increment) {
  constexpr int RP = kFusedThreads / TC, CW = 4 * TC;
  __shared__ double s1s[RP][CW + 1], s2s[RP][CW + 1];
  wait_for_previous_grid();  // launched programmatically
  if (increment && blockIdx.x == 0 && threadIdx.x == 0) *num_batches += 1;
  const int ct = threadIdx.x % TC, rl = threadIdx.x / TC;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * CW + 4 * ct;
  ShiftedSums4 acc;
  if (c < W) {
    acc.shift(__ldg(reinterpret_cast<const float4*>(y + c)));
    const float* base = y + c;
    int64_t r = rl;
    for (; r + 7 * RP < M; r += 8 * RP) {  // 8 loads in flight, added in row order
      float4 q[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) q[j] = __ldcs(reinterpret_cast<const float4*>(base + (r + j * RP) * W));
#pragma unroll
      for (int j = 0; j < 8; ++j) acc.add(q[j]);
    }
    for (; r < M; r += RP) acc.add(__ldcs(reinterpret_cast<const float4*>(base + r * W)));
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    s1s[rl][4 * ct + j] = acc.s1[j];
    s2s[rl][4 * ct + j] = acc.s2[j];
  }
  __syncthreads();
  const int i = threadIdx.x;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * CW + i;
  if (i < CW && col < W) {
    double a = 0.0, b = 0.0;
#pragma unroll 8
    for (int k = 0; k < RP; ++k) {
      a += s1s[k][i];
      b += s2s[k][i];
    }
    const double m = momentum >= 0.0 || !(running_mean && running_var)
                         ? momentum : 1.0 / (static_cast<double>(*num_batches) + 1.0);
    finish_column(col, W, BatchNormOp::from_shifted_sums(y[col], a, b, static_cast<double>(M)),
                  static_cast<double>(M), eps, m, stats, running_mean, running_var);
  }
}

__global__ void colstats_count_kernel(int64_t* num_batches) { *num_batches += 1; }

// Eval BatchNorm that was not folded: stats from the running statistics.
__global__ void colstats_running_kernel(RunningStat running_mean, RunningStat running_var,
                                        int64_t W, double eps, float* __restrict__ stats) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= W) return;
  stats[c] = static_cast<float>(load_stat(running_mean, c));
  stats[W + c] = BatchNormOp::invstd(load_stat(running_var, c), eps);
  stats[2 * W + c] = static_cast<float>(load_stat(running_var, c));
}

}  // namespace

int64_t colstats_chunks(int64_t M) {
  return std::clamp<int64_t>((M + kRowsPerChunk - 1) / kRowsPerChunk, 1, kMaxChunks);
}

size_t colstats_workspace_bytes(int64_t M, int64_t W) {
  return sizeof(double) * 2 * static_cast<size_t>(W) * static_cast<size_t>(colstats_chunks(M));
}

namespace {

// What one ColumnStats step's kernels read and write.
struct ColumnStatsRun {
  const Node& bn;
  int64_t M, W;
  float* stats;                // [3, W]: mean, invstd, var rows
  RunningStat rm, rv;          // the running statistics passed (either may be absent)
  const float* y = nullptr;    // batch statistics: the [M, W] rows
  bool update = false;         // batch statistics: the running statistics are updated
  int64_t* nb = nullptr;       // num_batches_tracked where they are, else nullptr
};

// A thread per column, 256 per CTA (colstats_running_kernel, colstats_finalize_kernel).
unsigned column_grid(int64_t W) { return static_cast<unsigned>((W + 255) / 256); }

// Eval: mean = running_mean, invstd = 1/sqrt(running_var + eps).
void launch_running_stats(const ColumnStatsRun& c, cudaStream_t stream) {
  if (!c.rm || !c.rv)
    throw std::invalid_argument("gemmfuse: eval batch_norm without running statistics");
  colstats_running_kernel<<<column_grid(c.W), 256, 0, stream>>>(c.rm, c.rv, c.W, c.bn.eps, c.stats);
  GF_LAUNCH_CHECK();
}

// One kernel, tc threads per row segment; for momentum=None the count is incremented after it
// (the kernel reads the old count).
void launch_fused_stats(const ColumnStatsRun& c, int tc, cudaStream_t stream) {
  const bool none = c.update && c.bn.momentum < 0;
  const double mom = c.bn.momentum < 0 ? -1.0 : c.bn.momentum;
  const unsigned g = static_cast<unsigned>((c.W + 4 * tc - 1) / (4 * tc));
  const RunningStat urm = c.update ? c.rm : RunningStat{};
  const RunningStat urv = c.update ? c.rv : RunningStat{};
  const bool inc = c.nb != nullptr && !none;
  launch_programmatic(tc == 8 ? colstats_fused_kernel<8> : colstats_fused_kernel<4>, dim3(g),
                      dim3(kFusedThreads), 0, stream, c.y, c.M, c.W, c.bn.eps, mom, c.stats, urm, urv,
                      c.nb, inc);
  if (c.nb != nullptr && none) {
    colstats_count_kernel<<<1, 1, 0, stream>>>(c.nb);
    GF_LAUNCH_CHECK();
  }
}

// Level 1 (the float4 kernel where `vector`, else the scalar one) into `partials`, then level 2.
void launch_two_level_stats(const ColumnStatsRun& c, bool vector, double* partials,
                            cudaStream_t stream) {
  const int64_t M = c.M, W = c.W;
  const int64_t R = colstats_chunks(M);
  const int64_t rows_per_chunk = (M + R - 1) / R;
  if ((W + kCols - 1) / kCols > 0x7fffffffLL)
    throw Unsupported("CUDA column stats: width out of range");
  if (vector) {
    const dim3 grid1(static_cast<unsigned>((W / 4 + kCols - 1) / kCols), static_cast<unsigned>(R));
    colstats_partial4_kernel<<<grid1, kCols * kWarps, 0, stream>>>(c.y, M, W, rows_per_chunk,
                                                                  partials, c.nb);
  } else {
    const dim3 grid1(static_cast<unsigned>((W + kCols - 1) / kCols), static_cast<unsigned>(R));
    colstats_partial_kernel<<<grid1, kCols * kWarps, 0, stream>>>(c.y, M, W, rows_per_chunk,
                                                                 partials, c.nb);
  }
  GF_LAUNCH_CHECK();
  colstats_finalize_kernel<<<column_grid(W), 256, 0, stream>>>(
      c.y, partials, R, M, W, c.bn.eps, c.bn.momentum < 0 ? -1.0 : c.bn.momentum, c.stats,
      c.update ? c.rm : RunningStat{}, c.update ? c.rv : RunningStat{}, c.nb);
  GF_LAUNCH_CHECK();
}

}  // namespace

void launch_column_stats(const Plan& plan, const Step& step, const ColStatsChoice& choice,
                         const RunArgs& args, char* workspace, double* partials, cudaStream_t stream) {
  const int64_t M = plan.M, W = std::max<int64_t>(step.width_in, 1);
  const Node& bn = step.node;
  if (step.output < 0) throw std::logic_error("CUDA column stats: output must be a buffer");
  ColumnStatsRun c{bn, M, W, reinterpret_cast<float*>(workspace + plan.buffer_offset(step.output)),
                   running_stat(args, bn.running_mean), running_stat(args, bn.running_var)};
  if (choice.kind == ColStatsKind::Running) {
    launch_running_stats(c, stream);
    return;
  }

  if (M < 2)
    throw std::invalid_argument("Expected more than 1 value per channel when training, got input size [" +
                                std::to_string(M) + ", " + std::to_string(W) + "]");
  if (partials == nullptr) throw std::logic_error("CUDA column stats: no workspace for partials");
  c.y = reinterpret_cast<const float*>(workspace + plan.buffer_offset(step.input));

  // Running statistics are updated when training with both present (as PyTorch with
  // track_running_stats); num_batches_tracked then counts the batch. A differentiable forward
  // (train_forward) leaves them to gemmfuse::update_running_stats.
  c.update = bn.training && c.rm && c.rv && args.update_state;
  c.nb = c.update ? static_cast<int64_t*>(state_ptr(args, bn.num_batches)) : nullptr;
  if (c.update && bn.momentum < 0 && !c.nb)
    throw Unsupported("batch_norm momentum=None needs num_batches_tracked");

  // The Selection's kernel; y's alignment is the call's (the plan's buffers are 256-byte
  // aligned in a 16-byte aligned workspace): where it fails, the scalar two-level kernels.
  const bool y16 = reinterpret_cast<uintptr_t>(c.y) % 16 == 0;
  if (choice.kind == ColStatsKind::Fused && y16)
    launch_fused_stats(c, choice.threads_per_segment, stream);
  else
    launch_two_level_stats(c, choice.vector && y16, partials, stream);
}

}  // namespace gemmfuse::cuda

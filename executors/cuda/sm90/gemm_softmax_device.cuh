// The fused GEMM + softmax kernel's types (Kernel<T>: CUTLASS mainloop, shared memory,
// parameters) and the small device helpers its phases share: exp2, the consumer barrier,
// trace stamps, the tile schedule (tile_of), quad reductions and the merge of row statistics.
// Part of gemm_softmax.cu, included there once, after its tile constants and the CUTLASS
// headers (internal linkage: anonymous namespace).
#pragma once

#include "gemm_softmax.h"

namespace gemmfuse::cuda::sm90 {
namespace {

using namespace cute;

template <class T>  // cutlass::bfloat16_t or cutlass::half_t
struct Kernel {
  using Element = T;
  using TileShape = Shape<Int<kTileM>, Int<kTileN>, Int<kTileK>>;
  using ClusterShape = Shape<Int<kClusterM>, _1, _1>;
  static constexpr int kStages = 3;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, 8, T,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCount<kStages>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using Pipeline = typename Mainloop::MainloopPipeline;
  static_assert(size(TiledMma{}) == kConsumers, "two consumer warpgroups");

  static constexpr size_t kStashBytes = sizeof(__half) * kTileM * kStashStride;
  static constexpr size_t kTileBytes = sizeof(typename Mainloop::TensorStorage) > kStashBytes
                                           ? sizeof(typename Mainloop::TensorStorage)
                                           : kStashBytes;
  struct SharedStorage {
    alignas(1024) char tiles[kTileBytes];  // mainloop tiles, then the last tile's stash
    alignas(16) __half stash[kTileM * kStashStride];
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    float bias[2][kTileN];                        // fp32 bias of each column tile (0 past N)
    float tile_max[2][kTileM], tile_sum[2][kTileM];  // row stats of each tile
    float row_scale[2][kTileM];                   // exp(tile max - row max) / row sum
  };

  struct Params {
    typename Mainloop::Params mainloop;
    int M, N, K;
    int n_tiles, k_tiles;
    int m_pairs;   // clusters along M (2 CTAs each)
    int tpc;       // column tiles per CTA (1 or 2): a CTA covers 128 rows x tpc * 256 columns
    int n_groups;  // column groups of tpc tiles: ceil(n_tiles / tpc)
    const float* bias;
    void* out;
    // [n_groups][M][2]: (row max, row sum of exp) over one CTA's columns, each a 64-bit
    // word with `epoch` in its high half (see publish_row_stats)
    unsigned long long* row_stats;
    unsigned int epoch;
    int act;
    float scale;
    unsigned long long* trace;  // see GemmSoftmaxProblem::trace
    bool defer;                 // GemmSoftmaxProblem::defer_epilogues
    bool w_evict_first;         // GemmSoftmaxProblem::w_evict_first
  };
};

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}

// This CTA's place in the launch (see tile_of): its trace slots.
__device__ __forceinline__ int cta_index() { return static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x); }

// The timeline stamps below exist only in builds with GEMMFUSE_KERNEL_TRACE=1 (the probes'
// build: -DGEMMFUSE_BUILD_PROBES=ON); elsewhere they compile to nothing and the kernel
// ignores GemmSoftmaxProblem::trace.
#ifndef GEMMFUSE_KERNEL_TRACE
#define GEMMFUSE_KERNEL_TRACE 0
#endif

// GemmSoftmaxProblem::trace: %globaltimer into slot k of this CTA, after `dep` is computed.
__device__ __forceinline__ void stamp(unsigned long long* trace, int ctid, int k, float dep = 0.f) {
#if GEMMFUSE_KERNEL_TRACE
  if (trace != nullptr && ctid == 0) {
    unsigned long long t;
    asm volatile("" ::"f"(dep));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    trace[cta_index() * kGemmSoftmaxTraceSlots + k] = t;
  }
#endif
}

// GemmSoftmaxProblem::trace: the SM's clock64 into slot k (its ratio to %globaltimer is the
// SM clock over a phase).
__device__ __forceinline__ void stamp_clock(unsigned long long* trace, int ctid, int k) {
#if GEMMFUSE_KERNEL_TRACE
  if (trace != nullptr && ctid == 0) trace[cta_index() * kGemmSoftmaxTraceSlots + k] = clock64();
#endif
}

// GemmSoftmaxProblem::trace: the SM this CTA runs on, into its kTraceSmId slot.
__device__ __forceinline__ void stamp_sm(unsigned long long* trace, int ctid) {
#if GEMMFUSE_KERNEL_TRACE
  if (trace != nullptr && ctid == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    trace[cta_index() * kGemmSoftmaxTraceSlots + kTraceSmId] = sm;
  }
#endif
}

template <class T>
__device__ __forceinline__ uint32_t pack_out(float a, float b) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// The tile (m_blk, n_blk) of this CTA's j-th work item. The grid is (2 m_pairs) x n_groups
// CTAs, clusters of 2 along x: CTA (x, y) covers m-block x and column group y (tiles
// tpc * y + j); its linear index, y * 2 m_pairs + x, is the order the CTAs start in. (A 1-d
// grid needs a division by m_pairs at every use, some in the tail: see exp_from.)
struct TileCoord {
  int m_blk, n_blk;
};
template <class P>
__device__ __forceinline__ int group_of(const P&) {
  return static_cast<int>(blockIdx.y);
}
template <class P>
__device__ __forceinline__ TileCoord tile_of(const P& p, int j) {
  return {static_cast<int>(blockIdx.x), p.tpc * static_cast<int>(blockIdx.y) + j};
}

// A row of a warpgroup's accumulator tile sits in the 4 threads of a quad (CuTe's SM90 64xN
// layout): their values of v combined by op (fmaxf, fminf or a sum).
template <class Op>
__device__ __forceinline__ float quad_reduce(float v, Op op) {
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return op(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float min_of(float a, float b) { return fminf(a, b); }

// exp(mj - m): the factor of a part's sum of exp(v - mj) in a sum of exp(v - m), 0 for an
// all -inf part (mj = -inf; m = -inf too stands for 0).
// Branch-free (ex2 flushes results below 2^-126 to 0): the tail's code runs once per launch
// and its warps wait on instruction fetch for much of their time there (docs/measurements.md,
// "The fused softmax kernel"), so every instruction and branch of it counts.
__device__ __forceinline__ float exp_from(float mj, float m) {
  const float e = ex2((mj - (m == -HUGE_VALF ? 0.f : m)) * kLog2e);
  return mj == -HUGE_VALF ? 0.f : e;
}

// (m, s) <- (m, s) merged with (mj, sj), where s = sum of exp(v - m) over a part of a row.
// An all -inf part (m = -inf) adds its sum times 0: nothing, or NaN when its sum is NaN (a
// NaN or +inf in the part), which then spreads to the whole row as in softmax.
__device__ __forceinline__ void merge_stats(float& m, float& s, float mj, float sj) {
  const float mn = fmaxf(m, mj);
  s = s * exp_from(m, mn) + sj * exp_from(mj, mn);
  m = mn;
}

}  // namespace
}  // namespace gemmfuse::cuda::sm90

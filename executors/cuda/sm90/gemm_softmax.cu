// The fused Linear -> [gelu] -> [scalar] -> softmax kernel for Hopper (see gemm_softmax.h).
//
// Layering as in CUTLASS: the mainloop is CUTLASS's sm90 TMA + wgmma warp-specialized
// collective (a producer warp streams 128x64 x-tiles and 256x64 W-tiles through a 3-stage
// shared-memory pipeline, two consumer warpgroups issue wgmma into 128x256 fp32
// accumulators), its load and mma loops written out in mainloop.h so that W's loads carry an
// L2 hint and a tile's epilogue can run between the next tile's k-steps; this file is the
// kernel around it: the tile schedule, the softmax epilogues and the merge of row
// statistics. The epilogues know the accumulator only as (value, row, column) triples,
// through CuTe's identity-tensor partition.
//
// Epilogues (DeferredTile): right after tile 1's mainloop only its bias, row extremes and
// exp references are computed and its values parked (half in shared memory, half in
// registers); gelu, exp and the fp16 stash run between tile 2's k-steps, hidden under the
// tensor cores' work. The last tile's epilogue runs alone, in the same compact rounds.
// tile_epilogue (the whole epilogue, unrolled) takes the cases DeferredTile leaves out.
//
// Schedule: clusters of 2 CTAs along M share each W tile (TMA multicast). A CTA covers 128
// rows and tpc (1 or 2) adjacent 256-column tiles, computed one after the other; the grid is
// (2 m_pairs) x n_groups CTAs, CTA (x, y) taking m-block x and column group y. The CTAs' first
// tiles run together and cover every other column tile, so x rows and W columns are shared
// through L2 as in a plain GEMM. Covering two tiles of the same rows halves the row partials
// each CTA publishes and reads (one per 512 columns).
//
// Shared memory per CTA (bf16/fp16 operands):
//   pipeline   3 x (128x64 + 256x64) x 2 B = 144 KiB; after the last mainloop it holds the
//              last tile's stash
//   stash      128 x 264 fp16 = 66 KiB: the first tile's exp(v - tile row max) while the
//              second tile's mainloop runs (rows padded by 8 halves: conflict-free writes);
//              DeferredTile parks half of the tile's fp32 values in it until then
#include "gemm_softmax.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "cuda_check.h"
#include "env_switch.h"
#include "pointwise.h"
#include "row_stats_buffers.h"

#if defined(GEMMFUSE_WITH_SM90_KERNELS)
#include "cute/tensor.hpp"
#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/pipeline/pipeline.hpp"

#include "mainloop.h"
#endif

namespace gemmfuse::cuda::sm90 {

namespace {

constexpr int kTileM = 128, kTileN = 256, kTileK = 64;
constexpr int kClusterM = 2;       // CTAs per cluster (along M)
constexpr int kMaxTilesPerCta = 2;  // the on-chip stash holds two tiles per CTA
constexpr int kThreads = 384;      // producer warpgroup + two consumer warpgroups
constexpr int kConsumers = 256;
constexpr int kStashStride = kTileN + 8;  // halves per stash row

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// The row statistics: two 64-bit words per (column group, row), n_groups <= n_tiles.
size_t row_stats_bytes(int64_t M, int64_t N) {
  const size_t b = 2 * sizeof(unsigned long long) * static_cast<size_t>(ceil_div(N, kTileN)) * M;
  return (b + 255) / 256 * 256;
}

}  // namespace

size_t gemm_softmax_workspace_bytes(int64_t M, int64_t N) { return row_stats_bytes(M, N); }

#if defined(GEMMFUSE_WITH_SM90_KERNELS)

using namespace cute;

namespace {

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

// GemmSoftmaxProblem::trace: %globaltimer into slot k of this CTA, after `dep` is computed.
__device__ __forceinline__ void stamp(unsigned long long* trace, int ctid, int k, float dep = 0.f) {
  if (trace != nullptr && ctid == 0) {
    unsigned long long t;
    asm volatile("" ::"f"(dep));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    trace[cta_index() * kGemmSoftmaxTraceSlots + k] = t;
  }
}

// GemmSoftmaxProblem::trace: the SM's clock64 into slot k (its ratio to %globaltimer is the
// SM clock over a phase).
__device__ __forceinline__ void stamp_clock(unsigned long long* trace, int ctid, int k) {
  if (trace != nullptr && ctid == 0) trace[cta_index() * kGemmSoftmaxTraceSlots + k] = clock64();
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
// and its warps wait on instruction fetch for half of their time there (bench/NOTES.md,
// session 12), so every instruction and branch of it counts.
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

// The exp2 shift for a reference (row max) ref: exp(v - ref) = 2^(v log2 e - shift). An
// all -inf row part gets 0, so its values give e = 0 and its sum 0 instead of NaN.
__device__ __forceinline__ float exp2_shift(float ref) { return ref == -HUGE_VALF ? 0.f : ref * kLog2e; }

// Whether ref * log2 e overflows although ref is finite (|ref| > 2^126): exp(v - ref) then
// needs v - ref first (tile_epilogue), not one FMA against the shift.
__device__ __forceinline__ bool shift_overflows(float ref) {
  const float a = fabsf(ref);
  return a > 0x1p126f && a <= FLT_MAX;
}

// e = exp(c v - ref) of a value pair (a, b) of one row, mul = c log2 e (c: a scale the
// values have not taken yet, or 1): added to that row's sum and written as an fp16 pair to
// dst (the pair's stash word).
__device__ __forceinline__ void stash_exp_pair(float a, float b, float mul, float shift, float& sum,
                                               void* dst) {
  const float e0 = ex2(fmaf(a, mul, -shift)), e1 = ex2(fmaf(b, mul, -shift));
  sum += e0 + e1;
  *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(e0, e1);
}

// Epilogue of one tile, by the 256 consumer threads: v = act(acc + bias) * scale (columns
// past N are -inf), the row max and sum of exp(v - max) over the tile's columns to
// S.tile_max/tile_sum[j], and e = exp(v - max) as fp16 into `stash` [128][kStashStride].
template <class K, class Acc, class Coord>
__device__ __forceinline__ void tile_epilogue(const typename K::Params& p, Acc& acc,
                                              const Coord& coord, TileCoord t, int j,
                                              typename K::SharedStorage& S, __half* stash,
                                              bool bias_added = false) {
  const int col0 = t.n_blk * kTileN;
  constexpr int kVals = decltype(size(acc))::value;
  static_assert(kVals == 128, "64 rows x 256 columns per warpgroup");
  // Value i of the wgmma accumulator sits in row r0 + 8 * ((i >> 1) & 1) and its pairs
  // (i, i + 1) are adjacent columns (CuTe's SM90 64xN accumulator layout).
  // The epilogue is bound by instruction issue (8 warps, 128 values each, while the tensor
  // cores wait), so every operation per value counts.
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kVals; i += 2) {
    if (!bias_added) {
      const float2 b = *reinterpret_cast<const float2*>(&S.bias[j][get<1>(coord(i))]);
      acc(i) += b.x;
      acc(i + 1) += b.y;
    }
    amax = fmaxf(amax, fmaxf(fabsf(acc(i)), fabsf(acc(i + 1))));
  }
  if (p.act == static_cast<int>(Activation::GeluErf)) {
    // The 12-operation polynomial where the whole warp is in its range (NaN fails the test
    // and takes erff too), else the erff form.
    if (__all_sync(0xffffffffu, amax <= kGeluPolyRange)) {
#pragma unroll
      for (int i = 0; i < kVals; ++i) acc(i) = gelu_erf_poly(acc(i));
    } else {
      const PointwiseParams pp{};
#pragma unroll
      for (int i = 0; i < kVals; ++i) acc(i) = apply_unary(OpCode::GeluErf, acc(i), pp);
    }
  }
  if (p.scale != 1.f) {
#pragma unroll
    for (int i = 0; i < kVals; ++i) acc(i) = acc(i) * p.scale;
  }
  if (col0 + kTileN > p.N) {  // the last column tile of a ragged N: columns past N are -inf
#pragma unroll
    for (int i = 0; i < kVals; ++i)
      if (col0 + get<1>(coord(i)) >= p.N) acc(i) = -HUGE_VALF;
  }
  // Plain max: a NaN is dropped here but makes the tile's sum NaN, which the row merge
  // propagates to the whole row (as softmax does).
  float mx[2] = {-HUGE_VALF, -HUGE_VALF};
#pragma unroll
  for (int i = 0; i < kVals; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], acc(i));
  float shift[2], sum[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = quad_reduce(mx[h], max_of);
    shift[h] = exp2_shift(mx[h]);
  }
  // A finite row maximum past 2^126 (its shift would overflow): v - max first, as PyTorch's
  // softmax computes it. Rare (the deferred path sends such warps here), so a branch.
  if (__any_sync(0xffffffffu, shift_overflows(mx[0]) || shift_overflows(mx[1]))) {
    float off[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      off[h] = shift_overflows(mx[h]) ? mx[h] : 0.f;
      shift[h] = exp2_shift(mx[h] - off[h]);
    }
#pragma unroll
    for (int i = 0; i < kVals; ++i) acc(i) -= off[(i >> 1) & 1];
  }
#pragma unroll
  for (int i = 0; i < kVals; i += 2) {
    const int h = (i >> 1) & 1;
    stash_exp_pair(acc(i), acc(i + 1), kLog2e, shift[h], sum[h],
                   stash + get<0>(coord(i)) * kStashStride + get<1>(coord(i)));
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) sum[h] = quad_reduce(sum[h], add);
  if ((threadIdx.x & 3) == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = get<0>(coord(2 * h));
      S.tile_max[j][r] = mx[h];
      S.tile_sum[j][r] = sum[h];
    }
  }
}

// The epilogue of a CTA's first tile when it has a second, finished under the second tile's
// mainloop (while the tensor cores work) instead of between the two mainloops.
// - Right after the first mainloop, only the cheap part runs (prepare): the bias, each row's
//   largest value u (and, rarely, its smallest), and from them the row's reference for exp;
//   then the even value of each pair (i, i + 1) is parked as fp32 in the stash word where the
//   pair's fp16 result goes, and the odd one stays in a register (keep). The 128
//   accumulators are then free for the second tile.
// - Between the second mainloop's k-steps, step(u) finishes two pairs: act, exp, the row sum,
//   the fp16 pair written over the parked value. Each thread touches only its own words.
//   The steps run in kRounds rounds of kStepsPerRound, a loop, not unrolled: code run once
//   per tile is fetched while the mainloop loads L2 heavily, and 32 unrolled steps (~60 KB of
//   instructions) slowed the mainloop by 13 us on an H100. A register array can only be
//   indexed statically, so each round takes keep[0 .. kPairsPerRound) and shifts the rest down.
// The reference must be the row part's max of v = act(u) * scale, scale >= 0. It comes from
// the extremes: the identity's is at the largest u; gelu falls on (-inf, -0.75] and rises
// after, so over any set of u its largest value is at the smallest or the largest u (at the
// largest when that is >= 0). defers_epilogues() says when; otherwise tile_epilogue runs for
// every tile.
// The gelu form is chosen per warp, the cheapest whose range holds all of its values (Gelu:
// 7, 12 or 15 operations per value); with the full-range form any finite data stays on
// this path (it ran 10-20 us slower per call on tile_epilogue's erff form, bench/NOTES.md
// session 15). A warp with an infinity or a row reference past 2^126 (see shift_overflows),
// and a tile with columns past N, run tile_epilogue at once (pending false): the erff form,
// the subtraction and the masking stay out of the loop.
// The last tile, with no next mainloop, takes the same prepare and then run_alone: every
// round at once. Not tile_epilogue: its ~40 KB of unrolled code, run once per launch, is
// fetched from memory then and took 6.5-11 us on an H100 against 4.1 us when run a second
// time; the rounds' loop stays in the instruction cache.
template <class K>
struct DeferredTile {
  static constexpr int kPairs = 64;          // value pairs per thread (128 values)
  static constexpr int kPairsPerStep = 2;
  static constexpr int kStepsPerRound = 4;
  static constexpr int kPairsPerRound = kPairsPerStep * kStepsPerRound;
  static constexpr int kRounds = kPairs / kPairsPerRound;
  float keep[kPairs];  // the odd value u of each pair not yet finished, in order
  float shift[2];      // reference * log2 e of the thread's two rows
  float mul;           // scale * log2 e: the scale is applied in the exp (stash_exp_pair)
  float sum[2];        // sum of exp(v - reference) over the thread's values of each row
  int round = 0;         // rounds finished
  bool pending = false;  // warp-uniform: this warp's values wait for the steps
  // Warp-uniform: the gelu form, the cheapest whose range holds all of the warp's values:
  // |u| < kGeluNarrowRange, |u| <= kGeluPolyRange, or any finite u (and NaN).
  enum class Gelu : uint8_t { Narrow, Poly, Wide } form = Gelu::Narrow;

  // v = act(u) for n values, one branch for all (so their chains interleave); hook(j, steps)
  // runs between the polynomial's steps (all of it at once for the identity), inside each
  // branch, so that independent work can interleave with the chains. Read from the kernel's
  // parameters (constant memory), not kept in registers.
  template <int n, class Hook = NoHornerHook>
  __device__ __forceinline__ void act(const typename K::Params& p, float (&v)[n], Hook hook = Hook{}) const {
    if (p.act == static_cast<int>(Activation::GeluErf)) {
      if (form == Gelu::Narrow) gelu_erf_poly_narrow_n(v, hook);
      else if (form == Gelu::Poly) gelu_erf_poly_n(v, hook);
      else gelu_erf_wide_n(v, hook);
    } else {
      hook(0, 1);
    }
  }

  // v = act(u) * scale, for the row extremes (the reference must be a value's own max).
  template <int n>
  __device__ __forceinline__ void act_scaled(const typename K::Params& p, float (&v)[n]) const {
    act(p, v);
    if (p.scale != 1.f) {
#pragma unroll
      for (int k = 0; k < n; ++k) v[k] *= p.scale;
    }
  }

  // acc: the tile's accumulators, left with the bias added. A tile with columns past N
  // leaves them all to tile_epilogue (pending false), which masks them.
  template <class Acc, class Coord>
  __device__ void prepare(const typename K::Params& p, Acc& acc, const Coord& coord, TileCoord t,
                          const float* bias, __half* stash, float* tile_max) {
    static_assert(decltype(size(acc))::value == 2 * kPairs, "64 rows x 256 columns per warpgroup");
    const bool gelu = p.act == static_cast<int>(Activation::GeluErf);
    round = 0;
    // Value i sits in row r0 + 8 * ((i >> 1) & 1); pair q = (2q, 2q + 1) in row half q & 1.
    // One pass: the bias, each row's largest u, and the OR of every value's bits (bit 30
    // clear in all of them: |u| < 2, the narrow polynomial's range) - a max and a 3-input OR
    // per pair where a min and a max cost twice the ALU issue (the prepares are exposed).
    float hi[2] = {-HUGE_VALF, -HUGE_VALF};
    uint32_t bits[4] = {0, 0, 0, 0};  // four OR chains, not one 64 deep
#pragma unroll
    for (int q = 0; q < kPairs; ++q) {
      const float2 b = *reinterpret_cast<const float2*>(&bias[get<1>(coord(2 * q))]);
      acc(2 * q) += b.x;
      acc(2 * q + 1) += b.y;
      hi[q & 1] = fmaxf(hi[q & 1], fmaxf(acc(2 * q), acc(2 * q + 1)));
      bits[q & 3] |= __float_as_uint(acc(2 * q)) | __float_as_uint(acc(2 * q + 1));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) hi[h] = quad_reduce(hi[h], max_of);
    const uint32_t all_bits = bits[0] | bits[1] | bits[2] | bits[3];
    // gelu's largest value over a row part is at its largest u when that is >= 0 (gelu(u) < 0
    // for every u < 0), else at its smallest or largest u; a warp out of the narrow range needs
    // max |u| too. Both are rare: the smallest u only then, in a second pass.
    float lo[2] = {hi[0], hi[1]};
    const bool narrow = gelu && __all_sync(0xffffffffu, (all_bits & 0x40000000u) == 0);
    if (gelu && (!narrow || __any_sync(0xffffffffu, hi[0] < 0.f || hi[1] < 0.f))) {
      lo[0] = lo[1] = HUGE_VALF;
#pragma unroll
      for (int q = 0; q < kPairs; ++q) lo[q & 1] = fminf(lo[q & 1], fminf(acc(2 * q), acc(2 * q + 1)));
#pragma unroll
      for (int h = 0; h < 2; ++h) lo[h] = quad_reduce(lo[h], min_of);
    }
    // The cheapest form whose range holds the whole warp's values; a warp with an infinity
    // goes to tile_epilogue (the erff form: gelu(-inf) is NaN there, as in PyTorch). fminf
    // and fmaxf drop NaN from the extremes; every form gives NaN for it.
    const float amax = fmaxf(fmaxf(-lo[0], hi[0]), fmaxf(-lo[1], hi[1]));
    form = narrow ? Gelu::Narrow
                  : __all_sync(0xffffffffu, amax <= kGeluPolyRange) ? Gelu::Poly : Gelu::Wide;
    pending = (t.n_blk + 1) * kTileN <= p.N &&
              (!gelu || form != Gelu::Wide || __all_sync(0xffffffffu, amax <= FLT_MAX));
    if (!pending) return;
    mul = p.scale * kLog2e;
    bool overflows = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // An all-NaN row part has hi = -inf (fmaxf drops NaN): its sum is NaN whatever the
      // reference.
      float ends[2] = {lo[h], hi[h]};
      act_scaled(p, ends);
      const float ref = fmaxf(ends[0], ends[1]);
      shift[h] = exp2_shift(ref);
      overflows |= shift_overflows(ref);
      sum[h] = 0.f;
      if ((threadIdx.x & 3) == 0) tile_max[get<0>(coord(2 * h))] = ref;
    }
    // A reference past 2^126: tile_epilogue, which subtracts it first (it rewrites tile_max).
    pending = !__any_sync(0xffffffffu, overflows);
    if (!pending) return;
#pragma unroll
    for (int q = 0; q < kPairs; ++q) {
      *word(coord, stash, q) = acc(2 * q);
      keep[q] = acc(2 * q + 1);
    }
  }

  template <class Coord>
  static __device__ __forceinline__ float* word(const Coord& coord, __half* stash, int q) {
    return reinterpret_cast<float*>(stash + get<0>(coord(2 * q)) * kStashStride + get<1>(coord(2 * q)));
  }

  // Pairs q0 .. q0 + n - 1 of round `rnd` (q0 static): their stash words w and values
  // (u, from the word and keep[q0 + k]; call before that round's shift). Pair q of round r
  // sits r rounds' column stride after pair q of round 0 (same row).
  template <int n, class Coord>
  __device__ __forceinline__ void words(const Coord& coord, __half* stash, int q0, int rnd,
                                        float* (&w)[n]) const {
    const auto round_offset = rnd * (word(coord, stash, kPairsPerRound) - word(coord, stash, 0));
#pragma unroll
    for (int k = 0; k < n; ++k) w[k] = word(coord, stash, q0 + k) + round_offset;
  }
  template <int n>
  __device__ __forceinline__ void load_pairs(float* const (&w)[n], int q0, float (&v)[2 * n]) const {
#pragma unroll
    for (int k = 0; k < n; ++k) {
      v[2 * k] = *w[k];
      v[2 * k + 1] = keep[q0 + k];
    }
  }
  // Pairs k0 .. k1 - 1 of n finished ones (v = act(u)), pair k in row half (q0 + k) & 1: exp,
  // the row sums, the fp16 pairs written over the parked values.
  template <int n>
  __device__ __forceinline__ void exp_pairs(float* const (&w)[n], int q0, const float (&v)[2 * n],
                                            int k0, int k1) {
#pragma unroll
    for (int k = k0; k < k1; ++k) {
      const int h = (q0 + k) & 1;  // kPairsPerRound is even
      stash_exp_pair(v[2 * k], v[2 * k + 1], mul, shift[h], sum[h], w[k]);
    }
  }

  // Pairs q0 .. q0 + n - 1 of the current round (q0 static): act, exp, the row sums, the
  // fp16 pairs written over the parked values. Loads first, so that the n pairs' chains
  // interleave (a store would order later loads after it).
  template <int n, class Coord>
  __device__ __forceinline__ void finish_pairs(const typename K::Params& p, int q0, const Coord& coord,
                                               __half* stash) {
    float* w[n];
    float v[2 * n];
    words(coord, stash, q0, round, w);
    load_pairs(w, q0, v);
    act(p, v);
    exp_pairs(w, q0, v, 0, n);
  }

  // The round is done: the next round's pairs to the front.
  template <int kRoundsDone = 1>
  __device__ __forceinline__ void next_round() {
    constexpr int kShift = kRoundsDone * kPairsPerRound;
#pragma unroll
    for (int q = 0; q + kShift < kPairs; ++q) keep[q] = keep[q + kShift];
    round += kRoundsDone;
  }

  // Step u of the current round (u static), after a k-step of the next mainloop. The shift
  // is unconditional: taken on one branch only, it would keep both versions of keep alive
  // (and spill).
  template <class Coord>
  __device__ __forceinline__ void step(const typename K::Params& p, int u, const Coord& coord,
                                       __half* stash) {
    if (pending) finish_pairs<kPairsPerStep>(p, kPairsPerStep * u, coord, stash);
    if (u == kStepsPerRound - 1) next_round();
  }

  // For the last tile, which has no next mainloop: every round at once, two rounds' pairs
  // per pass (16 chains to interleave, half the shifts of keep; 0.4 us less per call on an
  // H100 than one round per pass, bench/NOTES.md session 10), software-pipelined: a pass
  // evaluates its pairs' polynomials with the previous pass's exps placed between the
  // steps, so that the MUFU works while the FMA pipe does (one pass alone issues its 32
  // ex2 after all of its polynomials, with little else to issue beside them).
  template <class Coord>
  __device__ void run_alone(const typename K::Params& p, const Coord& coord, __half* stash) {
    if (!pending) return;
    constexpr int kMerged = 2;  // rounds per pass
    constexpr int n = kMerged * kPairsPerRound;
    float* w[n];
    float v[2 * n];
    words(coord, stash, 0, round, w);
    load_pairs(w, 0, v);
    act(p, v);
    next_round<kMerged>();
#pragma unroll 1
    for (int r = kMerged; r < kRounds; r += kMerged) {
      float* wn[n];
      float vn[2 * n];
      words(coord, stash, 0, round, wn);
      load_pairs(wn, 0, vn);
      act(p, vn, [&](int j, int steps) { exp_pairs(w, 0, v, j * n / steps, (j + 1) * n / steps); });
#pragma unroll
      for (int k = 0; k < n; ++k) {
        w[k] = wn[k];
        v[2 * k] = vn[2 * k];
        v[2 * k + 1] = vn[2 * k + 1];
      }
      next_round<kMerged>();
    }
    exp_pairs(w, 0, v, 0, n);
  }

  // The tile's row sums (prepare wrote the row maxes), once every step has run.
  template <class Coord>
  __device__ void finish(const Coord& coord, float* tile_sum) {
    if (!pending) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) sum[h] = quad_reduce(sum[h], add);
    if ((threadIdx.x & 3) == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) tile_sum[get<0>(coord(2 * h))] = sum[h];
    }
  }
};

// out = e * exp(m_tile - m_row) / s_row for one stashed tile, 16-byte stores along rows.
// Each thread keeps one 8-column chunk and walks down the tile's rows, 8 apart (a warp
// writes 512 contiguous bytes of a row per store). Address arithmetic stays out of the loop
// (pointer steps, no per-element bounds checks for whole tiles): ~28 instructions per chunk.
// The phase is exposed after the row merge and bound by memory (16 MB in ~3.7 us on an
// H100 at the seed shape, with ~48 instructions per chunk as with 28).
template <class K>
__device__ __forceinline__ void store_tile(const typename K::Params& p, const __half* stash,
                                           const float* row_scale, TileCoord t, int ctid) {
  using T = typename K::Element;
  constexpr int kChunks = kTileN / 8;                 // 16-byte chunks per tile row
  constexpr int kRowStep = kConsumers / kChunks;      // rows between a thread's chunks
  const int row0 = t.m_blk * kTileM;
  const int c8 = ctid % kChunks, r = ctid / kChunks;
  const int col = t.n_blk * kTileN + 8 * c8;
  if (col >= p.N) return;  // N is a multiple of 8: a chunk is wholly inside or outside
  auto* out = static_cast<uint4*>(p.out) + (static_cast<size_t>(row0 + r) * p.N + col) / 8;
  const size_t out_step = static_cast<size_t>(kRowStep) * p.N / 8;
  const __half* src = stash + r * kStashStride + 8 * c8;
  const float* scale = row_scale + r;
  auto one = [&](int i) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src + i * kRowStep * kStashStride);
    const __half2* e = reinterpret_cast<const __half2*>(&raw);
    const float s = scale[i * kRowStep];
    uint4 o;
    uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(e[k]);
      ow[k] = pack_out<T>(f.x * s, f.y * s);
    }
    out[i * out_step] = o;
  };
  const int rows = min(kTileM, p.M - row0);
  if (rows == kTileM) {
#pragma unroll
    for (int i = 0; i < kTileM / kRowStep; ++i) one(i);
  } else {
#pragma unroll 1
    for (int i = 0; r + i * kRowStep < rows; ++i) one(i);
  }
}

// The CTAs of one m-block exchange their row statistics without a barrier: each word holds
// one value in its low half and the launch's epoch in its high half; each 64-bit element of
// the v2 accesses is single-copy atomic, so a reader that sees the epoch sees the value (no fence, no flag:
// one trip to L2 each way). Every epoch is used once per buffer: a direct launch takes the
// next one of its stream's buffer, a captured graph clears its buffer before each replay.
// Every CTA is resident at once (see launch()), so each wait ends.
template <class P>
__device__ __forceinline__ void publish_row_stats(const P& p, size_t slot, float m, float s) {
  const unsigned long long tag = static_cast<unsigned long long>(p.epoch) << 32;
  asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" ::"l"(p.row_stats + 2 * slot),
               "l"(tag | __float_as_uint(m)), "l"(tag | __float_as_uint(s))
               : "memory");
}

// (max, sum) of row `row` over column groups g0 .. g0 + 15 (past n_groups: (-inf, 0)),
// waiting until each has this launch's epoch. The pending ones are re-read together.
template <class P>
__device__ __forceinline__ void read_row_stats(const P& p, int row, int g0, float2 (&q)[16]) {
  // Group g0 + k's word of this row: src + k * stride (one 64-bit add each, not a product).
  const unsigned long long* src = p.row_stats + 2 * (static_cast<size_t>(g0) * p.M + row);
  const size_t stride = 2 * static_cast<size_t>(p.M);
  uint32_t pending = (1u << min(16, p.n_groups - g0)) - 1u;
#pragma unroll
  for (int k = 0; k < 16; ++k) q[k] = make_float2(-HUGE_VALF, 0.f);
  unsigned long long w[16][2] = {};  // (read by the selects below even where not loaded)
  do {  // (g0 < n_groups: at least one is pending)
#pragma unroll
    for (int k = 0; k < 16; ++k)
      if (pending & (1u << k))
        asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];"
                     : "+l"(w[k][0]), "+l"(w[k][1])
                     : "l"(src + k * stride)
                     : "memory");
    // Selects, not branches (the tail's code: see exp_from).
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const bool in = ((pending >> k) & 1u) & ((w[k][0] >> 32) == p.epoch) & ((w[k][1] >> 32) == p.epoch);
      q[k].x = in ? __uint_as_float(static_cast<uint32_t>(w[k][0])) : q[k].x;
      q[k].y = in ? __uint_as_float(static_cast<uint32_t>(w[k][1])) : q[k].y;
      pending &= in ? ~(1u << k) : ~0u;
    }
  } while (pending != 0);
}

// Whether the epilogues go through DeferredTile (else tile_epilogue for each tile): the
// reference for exp must come from a row's extremes (see DeferredTile).
template <class P>
__device__ __forceinline__ bool defers_epilogues(const P& p) {
  return p.defer && p.scale >= 0.f;
}

template <class K>
__global__ void __launch_bounds__(kThreads, 1) gemm_softmax_kernel(const __grid_constant__ typename K::Params p) {
  using Mainloop = typename K::Mainloop;
  using Pipeline = typename K::Pipeline;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& S = *reinterpret_cast<typename K::SharedStorage*>(smem_raw);
  auto& tiles = *reinterpret_cast<typename Mainloop::TensorStorage*>(S.tiles);

  stamp(p.trace, threadIdx.x, kTraceEntry);
  stamp_clock(p.trace, threadIdx.x, kTraceClockEntry);
  if (p.trace != nullptr && threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    p.trace[cta_index() * kGemmSoftmaxTraceSlots + kTraceSmId] = sm;
  }
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int lane = cutlass::canonical_lane_idx();
  if (warp == 0 && lane == 0) Mainloop::prefetch_tma_descriptors(p.mainloop);

  typename Pipeline::Params pp;
  if (warpgroup == 0 && warp == 0) pp.role = Pipeline::ThreadCategory::Producer;
  if (warpgroup > 0) pp.role = Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x % cutlass::NumThreadsPerWarpGroup == 0;
  pp.num_consumers = kConsumers;
  pp.transaction_bytes = p.mainloop.tma_transaction_bytes;
  Pipeline pipeline(S.pipeline, pp, typename K::ClusterShape{});
  // The pipeline's barriers must be initialised in both CTAs before either uses them.
  cute::cluster_arrive_relaxed();
  cute::cluster_wait();
  // Launched with programmatic stream serialization, this CTA may run while the previous
  // kernel of the stream finishes: everything above touched only this CTA's shared memory
  // (and, in traced runs, its own trace slots); from here on global memory is read and
  // written, so that kernel must be complete (and its writes visible). A no-op for other
  // launches.
  cutlass::arch::wait_on_dependent_grids();

  const int n_work = min(p.tpc, p.n_tiles - p.tpc * group_of(p));
  auto problem = make_shape(p.M, p.N, p.K, 1);

  if (warpgroup == 0) {  // producer: one warp issues the TMA loads
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp == 0) {
      Mainloop mainloop;
      auto inputs = mainloop.load_init(problem, p.mainloop);
      auto state = cutlass::make_producer_start_state<Pipeline>();
      // W is read once per column group (its CTAs run together) and streams through L2:
      // evict-first, so that x and this kernel's code stay there (see mainloop.h).
      const auto hint_w = p.w_evict_first ? cute::TMA::CacheHintSm90::EVICT_FIRST
                                          : cute::TMA::CacheHintSm90::EVICT_NORMAL;
      for (int j = 0; j < n_work; ++j) {
        const TileCoord t = tile_of(p, j);
        produce_tile<Mainloop>(p.mainloop, pipeline, state, inputs, t.m_blk, t.n_blk, p.k_tiles,
                               cute::block_rank_in_cluster(), tiles,
                               cute::TMA::CacheHintSm90::EVICT_NORMAL, hint_w);
      }
      mainloop.load_tail(pipeline, state);
    }
    return;  // (load_tail: the peer CTA's consumers are done with this CTA's barriers)
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int ctid = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
  typename K::TiledMma tiled_mma;
  auto thr = tiled_mma.get_slice(ctid);
  Tensor coord = thr.partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kTileN>{})));
  typename Mainloop::PipelineState state;
  __half* last_stash = reinterpret_cast<__half*>(S.tiles);
  for (int j = 0; j < n_work; ++j) {  // the bias of every tile, read in the epilogues
    const int col = tile_of(p, j).n_blk * kTileN + ctid;
    S.bias[j][ctid] = p.bias != nullptr && col < p.N ? p.bias[col] : 0.f;
  }
  static_assert(kTileN == kConsumers, "one bias column per consumer thread");
  consumer_sync();
  Tensor acc = partition_fragment_C(tiled_mma, take<0, 2>(typename K::TileShape{}));
  auto first_stage = [&](int slot) { return [&p, ctid, slot]() { stamp(p.trace, ctid, slot); }; };
  // One loop over the tiles, so that each piece of epilogue code exists once and its second
  // run finds it in the instruction cache (code run once per launch is fetched from memory
  // while every CTA waits on it; see DeferredTile). Tile j's mainloop finishes tile j-1's
  // deferred epilogue between its k-steps (nothing to do for j = 0, or when not deferred).
  const bool defer = defers_epilogues(p);
  static_assert(kMaxTilesPerCta == 2, "the deferred epilogues cover at most two tiles per CTA");
  using D = DeferredTile<K>;
  D d;
#pragma unroll 1
  for (int j = 0; j < n_work; ++j) {
    consume_tile<Mainloop, D::kRounds, D::kStepsPerRound>(
        pipeline, state, acc, p.k_tiles, ctid, tiles, [&](int u) { d.step(p, u, coord, S.stash); },
        first_stage(j == 0 ? kTraceFirstStage1 : kTraceFirstStage2));
    if (j > 0) d.finish(coord, S.tile_sum[j - 1]);
    // The next kernel of the stream may be launched now (its CTAs take SMs as this grid's
    // exit and wait for its completion before touching memory).
    if (j == n_work - 1) cutlass::arch::launch_dependent_grids();
    stamp(p.trace, ctid, j == 0 ? kTraceMainloop1 : kTraceMainloop2);
    stamp_clock(p.trace, ctid, j == 0 ? kTraceClockMainloop1 : kTraceClockMainloop2);
    // The last tile's stash reuses the pipeline's tiles, so both warpgroups must be done
    // reading them (their final TMA writes landed before the waits that preceded these
    // wgmmas).
    const bool last = j == n_work - 1;
    __half* stash = last ? last_stash : S.stash;
    if (last) {
      consumer_sync();
      stamp(p.trace, ctid, kTraceLastSync);
    }
    // Deferred: only the prepare now, the rest under the next mainloop or (last) below.
    if (defer) d.prepare(p, acc, coord, tile_of(p, j), S.bias[j], stash, S.tile_max[j]);
    if (!d.pending) tile_epilogue<K>(p, acc, coord, tile_of(p, j), j, S, stash, defer);
    stamp(p.trace, ctid, last ? kTraceLastPrepare : kTraceEpilogue1);
  }
  d.run_alone(p, coord, last_stash);
  d.finish(coord, S.tile_sum[n_work - 1]);
  stamp(p.trace, ctid, kTraceEpilogue2);
  stamp_clock(p.trace, ctid, kTraceClockEpilogue2);

  // This CTA's row statistics over its tpc tiles, for the other CTAs of its rows; then
  // theirs, merged 16 at a time (the max and the rescaled sum as trees, not one dependent
  // merge per part); then exp(tile max - row max) / row sum for each of this CTA's tiles.
  consumer_sync();
  const int row0 = tile_of(p, 0).m_blk * kTileM;
  if (ctid < kTileM && row0 + ctid < p.M) {
    const int row = row0 + ctid;
    float m = -HUGE_VALF, s = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxTilesPerCta; ++j)  // a static bound: no unrolled copies of a runtime loop
      if (j < n_work) merge_stats(m, s, S.tile_max[j][ctid], S.tile_sum[j][ctid]);
    publish_row_stats(p, static_cast<size_t>(group_of(p)) * p.M + row, m, s);
    m = -HUGE_VALF;
    s = 0.f;
    for (int g0 = 0; g0 < p.n_groups; g0 += 16) {
      float2 q[16];
      read_row_stats(p, row, g0, q);
      if (g0 == 0) {
        stamp(p.trace, ctid, kTraceBarrier, q[15].y);
        stamp_clock(p.trace, ctid, kTraceClockBarrier);
      }
      float mc = q[0].x;
#pragma unroll
      for (int k = 1; k < 16; ++k) mc = fmaxf(mc, q[k].x);
      float sc = 0.f;
#pragma unroll
      for (int k = 0; k < 16; ++k) sc += q[k].y * exp_from(q[k].x, mc);
      merge_stats(m, s, mc, sc);
    }
    stamp(p.trace, ctid, kTraceMergeMath, s);
    const float inv_s = __frcp_rn(s);
#pragma unroll
    for (int j = 0; j < kMaxTilesPerCta; ++j)
      if (j < n_work) S.row_scale[j][ctid] = exp_from(S.tile_max[j][ctid], m) * inv_s;
  }
  consumer_sync();
  stamp(p.trace, ctid, kTraceMerge);
  for (int j = 0; j < n_work; ++j)
    store_tile<K>(p, j == n_work - 1 ? last_stash : S.stash, S.row_scale[j], tile_of(p, j), ctid);
  stamp(p.trace, ctid, kTraceStores);
  stamp_clock(p.trace, ctid, kTraceClockStores);
}

struct Fit {
  int max_clusters = 0;  // clusters of kClusterM CTAs the device holds at once (0: unusable)
  int sms = 0;
  bool mps = false;      // contexts on the device are shared through MPS
  std::string why;       // why the kernel is unusable on this device
};

template <class K>
void set_smem_attribute() {
  GF_CUDA_CHECK(cudaFuncSetAttribute(gemm_softmax_kernel<K>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(sizeof(typename K::SharedStorage))));
}

// The launch configuration of m_pairs x n_groups clusters (see tile_of): attrs[0] is the
// cluster shape (numAttrs 1); launch() adds the cooperative or the programmatic flag as attrs[1].
template <class K>
cudaLaunchConfig_t launch_config(int m_pairs, int n_groups, cudaStream_t stream,
                                 cudaLaunchAttribute (&attrs)[2]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kClusterM * m_pairs, n_groups, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = sizeof(typename K::SharedStorage);
  cfg.stream = stream;
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = kClusterM;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = 1;
  return cfg;
}

template <class K>
int max_active_clusters() {
  set_smem_attribute<K>();
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t cfg = launch_config<K>(64, 1, nullptr, attrs);
  int n = 0;
  GF_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, gemm_softmax_kernel<K>, &cfg));
  return n;
}

const Fit& device_fit(DType dtype) {
  static std::mutex mu;
  static std::unordered_map<int, Fit> fits;  // key: device * 2 + (dtype == F16)
  int dev = 0;
  GF_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  const int key = dev * 2 + (dtype == DType::F16 ? 1 : 0);
  auto it = fits.find(key);
  if (it != fits.end()) return it->second;
  Fit f;
  cudaDeviceProp prop;
  GF_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  f.sms = prop.multiProcessorCount;
  int mps = 0;
  GF_CUDA_CHECK(cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, dev));
  f.mps = mps != 0;
  if (prop.major != 9 || prop.minor != 0) {
    f.why = "needs an sm_90 GPU (this is sm_" + std::to_string(prop.major * 10 + prop.minor) + ")";
  } else {
    f.max_clusters = dtype == DType::F16 ? max_active_clusters<Kernel<cutlass::half_t>>()
                                         : max_active_clusters<Kernel<cutlass::bfloat16_t>>();
    if (f.max_clusters == 0) f.why = "the kernel does not fit on this GPU's SMs";
  }
  return fits.emplace(key, f).first->second;
}

// Column tiles per CTA: 1 when a cluster per (m-block pair, column tile) fits on the GPU at
// once, else kMaxTilesPerCta (0: the problem does not fit).
int tiles_per_cta(int64_t M, int64_t N, int max_clusters) {
  const int64_t m_pairs = ceil_div(ceil_div(M, kTileM), kClusterM), n_tiles = ceil_div(N, kTileN);
  if (m_pairs * n_tiles <= max_clusters) return 1;
  if (m_pairs * ceil_div(n_tiles, kMaxTilesPerCta) <= max_clusters) return kMaxTilesPerCta;
  return 0;
}

// The stream of a direct launch: its device and id (ids are never reused).
struct StreamKey {
  int dev = 0;
  unsigned long long id = 0;
};

// Programmatic launches (below) are not cooperative, so nothing in the driver keeps two of
// them from sharing the GPU, each with part of its CTAs resident and waiting for the rest.
// Within a stream they are ordered; across streams a launch waits for the device's last
// programmatic launch when that was on another stream (one event per device, recorded
// after each). Only a stream switch costs a wait. (Replays of captured launches, which are
// cooperative, are outside this order, as two cooperative launches were before.)
class LaunchOrder {
 public:
  static LaunchOrder& of_device(int dev) {
    static std::mutex mu;
    static std::map<int, LaunchOrder> orders;
    std::lock_guard<std::mutex> lock(mu);
    return orders[dev];
  }
  // Enqueues launch() on the stream `id` after the last launch when that was on another
  // stream, and marks it as the last.
  template <class Launch>
  void run(cudaStream_t stream, unsigned long long id, Launch&& launch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (event_ == nullptr) GF_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    if (any_ && id != last_id_) GF_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
    launch();
    GF_CUDA_CHECK(cudaEventRecord(event_, stream));
    last_id_ = id;
    any_ = true;
  }

 private:
  std::mutex mu_;
  cudaEvent_t event_ = nullptr;
  unsigned long long last_id_ = 0;
  bool any_ = false;
};

// Programmatic launches, unless GEMMFUSE_SM90_PDL=0 (cooperative ones, for A/B timing).
bool programmatic_allowed() {
  static const bool off = env_switched_off("GEMMFUSE_SM90_PDL");
  return !off;
}

// The first tile's epilogue deferred under the second tile's mainloop, unless
// GEMMFUSE_SM90_DEFER=0 (each epilogue whole after its mainloop, for A/B timing).
bool defer_allowed() {
  static const bool off = env_switched_off("GEMMFUSE_SM90_DEFER");
  return !off;
}

template <class K>
bool launch(const GemmSoftmaxProblem& pr, void* workspace, cudaStream_t stream, const Fit& fit) {
  using Mainloop = typename K::Mainloop;
  using T = typename K::Element;
  typename K::Params p;
  p.M = static_cast<int>(pr.M);
  p.N = static_cast<int>(pr.N);
  p.K = static_cast<int>(pr.K);
  p.n_tiles = ceil_div(pr.N, kTileN);
  p.k_tiles = ceil_div(pr.K, kTileK);
  p.m_pairs = ceil_div(ceil_div(pr.M, kTileM), kClusterM);
  p.tpc = tiles_per_cta(pr.M, pr.N, fit.max_clusters);
  p.n_groups = ceil_div(p.n_tiles, p.tpc);
  typename Mainloop::Arguments args{
      static_cast<const T*>(pr.x), cute::make_stride(int64_t(pr.K), Int<1>{}, int64_t(pr.M * pr.K)),
      static_cast<const T*>(pr.w), cute::make_stride(int64_t(pr.K), Int<1>{}, int64_t(pr.N * pr.K))};
  p.mainloop = Mainloop::to_underlying_arguments(make_shape(p.M, p.N, p.K, 1), args, nullptr);
  p.bias = pr.bias;
  p.out = pr.out;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  GF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool captured = capture != cudaStreamCaptureStatusNone;
  StreamKey key;
  if (!captured) {
    GF_CUDA_CHECK(cudaGetDevice(&key.dev));
    GF_CUDA_CHECK(cudaStreamGetId(stream, &key.id));
  }
  // Where the CTAs exchange row statistics, and the epoch that marks this launch's words
  // (see publish_row_stats): a direct launch uses its stream's buffer (row_stats_buffers.h);
  // a launch captured into a graph is replayed with the epoch it was captured with, so it
  // uses the graph's workspace, cleared before it in the graph (replays run one at a time).
  std::optional<RowStatsLease> lease;
  if (captured) {
    GF_CUDA_CHECK(cudaMemsetAsync(workspace, 0, row_stats_bytes(pr.M, pr.N), stream));
    p.row_stats = static_cast<unsigned long long*>(workspace);
    p.epoch = 1;
  } else {
    lease.emplace(stream, key.dev, key.id, row_stats_bytes(pr.M, pr.N));
    p.row_stats = lease->stats().words;
    p.epoch = lease->stats().epoch;
  }
  p.act = static_cast<int>(pr.act);
  p.scale = pr.scale;
  p.trace = pr.trace;
  p.defer = pr.defer_epilogues && defer_allowed();
  p.w_evict_first = pr.w_evict_first;

  // How every CTA is made resident at once (each waits for the statistics of the others
  // of its rows). A direct launch: programmatic (PDL), so that it starts as the stream's
  // previous kernel ends (~1-1.5 us per call on an H100, bench/NOTES.md session 10); the grid
  // fits on the idle GPU (tiles_per_cta), and other kernels on the GPU finish in time. Under
  // MPS, other processes' kernels may hold SMs for good, and a launch captured into a graph
  // replays at times this code does not see: there, cooperative (the driver refuses a grid
  // the GPU cannot hold, and serializes the launch; no programmatic overlap).
  const bool programmatic = programmatic_allowed() && !captured && !fit.mps;
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t cfg = launch_config<K>(p.m_pairs, p.n_groups, stream, attrs);
  cfg.numAttrs = 2;
  if (programmatic) {
    attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[1].val.programmaticStreamSerializationAllowed = 1;
    LaunchOrder::of_device(key.dev).run(stream, key.id, [&] {
      GF_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemm_softmax_kernel<K>, p));
    });
    return true;
  }
  attrs[1].id = cudaLaunchAttributeCooperative;
  attrs[1].val.cooperative = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, gemm_softmax_kernel<K>, p);
  if (e == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // not sticky: the caller runs the plan step by step instead
    return false;
  }
  GF_CUDA_CHECK(e);
  return true;
}

}  // namespace

bool gemm_softmax_built() { return true; }

std::string gemm_softmax_unfit(int64_t M, int64_t N, int64_t K, DType dtype) {
  if (dtype != DType::BF16 && dtype != DType::F16) return "fp32 models use the cuBLAS GEMM";
  if (K % 8 != 0 || N % 8 != 0) return "K and N must be multiples of 8 (16-byte TMA rows)";
  if (M <= 0 || K <= 0) return "empty problem";
  const Fit& f = device_fit(dtype);
  if (f.max_clusters == 0) return f.why;
  const int64_t tiles = ceil_div(M, kTileM) * ceil_div(N, kTileN);
  if (2 * tiles < f.sms)  // fewer tiles than half the SMs: cuBLAS does better
    return "too few 128x256 tiles (" + std::to_string(tiles) + ") to fill the GPU";
  if (tiles_per_cta(M, N, f.max_clusters) == 0)
    return "too many 128x256 tiles (" + std::to_string(tiles) + ") to keep on chip at once (at most " +
           std::to_string(kClusterM * kMaxTilesPerCta * f.max_clusters) + ")";
  return "";
}

bool launch_gemm_softmax(const GemmSoftmaxProblem& p, void* workspace, cudaStream_t stream) {
  // The caller checked gemm_softmax_unfit; only what the launch itself relies on is re-checked.
  const Fit& fit = device_fit(p.dtype);
  if (fit.max_clusters == 0 || tiles_per_cta(p.M, p.N, fit.max_clusters) == 0)
    throw std::logic_error("gemm_softmax: launched for a problem that does not fit (gemm_softmax_unfit)");
  if (p.dtype == DType::F16) return launch<Kernel<cutlass::half_t>>(p, workspace, stream, fit);
  return launch<Kernel<cutlass::bfloat16_t>>(p, workspace, stream, fit);
}

#else  // built without the sm90 kernels (no CUTLASS headers)

bool gemm_softmax_built() { return false; }

std::string gemm_softmax_unfit(int64_t, int64_t, int64_t, DType) {
  return "built without the sm90 kernels (the nvidia-cutlass package was not found)";
}
bool launch_gemm_softmax(const GemmSoftmaxProblem&, void*, cudaStream_t) {
  throw std::logic_error("gemm_softmax: built without the sm90 kernels");
}

#endif

}  // namespace gemmfuse::cuda::sm90

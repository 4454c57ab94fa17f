// The register-mode row kernel (row_register_kernel): a row that fits the CTA's registers is
// read once, run through its program in registers and stored once.
// Part of row_program.cu, included there once (internal linkage: anonymous namespace).
#pragma once

#include "programmatic_launch.h"
#include "row_device_ops.cuh"
#include "row_program_format.cuh"

namespace gemmfuse::cuda {
namespace {

// ---- register mode ------------------------------------------------------------------------
// Rows of width w (w % 4 == 0, 256 < w <= kRegMaxWidth) whose program has no Pool and whose
// GroupNorms have groups of 4q columns, q a power of two <= 32: the row never leaves
// registers. Thread t of nt holds the float4 chunks ci = k*nt + t (k < VPT) of its CTA's row:
// the row is read with one coalesced 16-byte load per chunk (all in flight at once, streaming
// cache hint), every instruction is applied in registers, and the row is stored once.
// Barriers: one per team-wide reduction (softmax 2, logsumexp 2, sum/max 1); a GroupNorm has
// none: a group is q consecutive lanes of one warp (chunk ci belongs to group ci / q and nt is a
// multiple of 32), its sums are segmented butterfly shuffles (bitwise equal in every lane).
// After a Reduce the row is one value held by every thread; thread 0 finishes it.

// Every thread gets the reduction of v over the CTA, combined in a fixed order
// (deterministic). red: two slots of 32 used alternately (`parity`), so no trailing barrier
// is needed: a slot is rewritten two reductions later, after a barrier every thread reached
// only once it had read the slot.
template <class T, class Op>
__device__ __forceinline__ T cta_allreduce2(T v, Op op, T* red, int& parity) {
  v = warp_allreduce(v, op);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  T* slot = red + 32 * parity;
  if (lane == 0) slot[warp] = v;
  __syncthreads();
  T r = slot[0];
  for (int i = 1; i < nw; ++i) r = op(r, slot[i]);
  parity ^= 1;
  return r;
}

__device__ __forceinline__ void ld4(const float* p, float (&v)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

// Row data is read once: streaming loads (evict-first). Per-column vectors use plain loads.
// (No L1 residency hints for those vectors: the pass is bound by bytes in flight per SM, not
// by L2 traffic, and runs no faster with them; docs/measurements.md, "The row pass".)
__device__ __forceinline__ void ldrow4(const float* p, float (&v)[4]) {
  const float4 q = __ldcs(reinterpret_cast<const float4*>(p));
  v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

// v = v * weight[c..c+4) + bias[c..c+4); either vector may be absent (nullptr).
__device__ __forceinline__ void affine4(float (&v)[4], const float* weight, const float* bias,
                                        int c) {
  float a[4];
  if (weight) {
    ld4(weight + c, a);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] *= a[j];
  }
  if (bias) {
    ld4(bias + c, a);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] += a[j];
  }
}

// Segmented butterfly over q consecutive lanes (q a power of two <= 32).
__device__ __forceinline__ float seg_sum(float s, int q) {
  for (int o = 1; o < q; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// Chunk k of thread t holds row values: always when the row fills every thread's VPT chunks
// (kFull, checked at launch), else when k * nt + t < nch.
template <bool kFull>
__device__ __forceinline__ bool chunk_valid(int k, int t, int nt, int nch) {
  return kFull || k * nt + t < nch;
}

// The extremum `op` (MaxF, MinF, ShiftMaxF) of the thread's values of valid chunks, starting
// from `init` (op's identity).
template <int VPT, bool kFull, class Op>
__device__ __forceinline__ float thread_extremum(const float (&v)[VPT][4], int t, int nt, int nch,
                                                 float init, Op op) {
  float m = init;
#pragma unroll
  for (int k = 0; k < VPT; ++k)
    if (chunk_valid<kFull>(k, t, nt, nch))
#pragma unroll
      for (int j = 0; j < 4; ++j) m = op(m, v[k][j]);
  return m;
}

// Sum of f(value) over the thread's valid chunks in fp32, pairwise (chunk (a+b)+(c+d), then a
// tree over the chunks): the terms of softmax and logsumexp sums are positive, so this costs at
// most a few ulps on the thread's share; the team-wide sum is then in fp64.
template <int VPT, bool kFull, class F>
__device__ __forceinline__ float thread_tree_sum(const float (&v)[VPT][4], F f, int t, int nt,
                                                 int nch) {
  float acc[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
    acc[k] = chunk_valid<kFull>(k, t, nt, nch)
                 ? (f(v[k][0]) + f(v[k][1])) + (f(v[k][2]) + f(v[k][3]))
                 : 0.f;
#pragma unroll
  for (int s = 1; s < VPT; s <<= 1)
#pragma unroll
    for (int k = 0; k + s < VPT; k += 2 * s) acc[k] += acc[k + s];
  return acc[0];
}

// A GroupNorm group of this kernel's row (GroupNormOp's team): chunk k of q consecutive lanes
// (4q columns), each lane holding its 4 values v; sums by segmented butterfly shuffles in fp32
// (bitwise equal in every lane of the group). Every lane folds (the shuffles need the whole
// warp); a map skips the chunks past the row. map_affine takes the row's vectors, indexed by
// `col`, the chunk's first column in the row.
struct RegisterGroup {
  using Acc = float;
  float (&v)[4];
  int q, col;
  bool valid;

  __device__ __forceinline__ int width() const { return 4 * q; }
  template <class F>
  __device__ __forceinline__ float sum(F f) const {
    return seg_sum((f(v[0]) + f(v[1])) + (f(v[2]) + f(v[3])), q);
  }
  template <class F>
  __device__ __forceinline__ void map_affine(const float* weight, const float* bias, F f) {
    if (!valid) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = f(v[j]);
    affine4(v, weight, bias, col);
  }
};

// The row team of this kernel (row_team.h): the CTA over a row in registers, thread t holding
// chunks k * nt + t; one per kernel (its reduction slots alternate across the program). Folds
// skip the chunks past the row; maps run on every chunk (those past the row are never stored). Sums of positive terms add the thread's share in fp32, pairwise
// (thread_tree_sum); other sums add every term in fp64.
template <int VPT, bool kFull>
struct RegisterRow {
  float (&v)[VPT][4];
  int w, t, nt, nch;
  double* red_d;
  float* red_f;
  int par_d = 0, par_f = 0;  // cta_allreduce2's slots

  __device__ __forceinline__ int width() const { return w; }
  __device__ __forceinline__ bool valid(int k) const { return chunk_valid<kFull>(k, t, nt, nch); }

  template <class Op>
  __device__ __forceinline__ float extremum(float init, Op op) {
    return cta_allreduce2(thread_extremum<VPT, kFull>(v, t, nt, nch, init, op), op, red_f, par_f);
  }
  template <class F>
  __device__ __forceinline__ double sum(F f) {
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      if (valid(k))
#pragma unroll
        for (int j = 0; j < 4; ++j) s += f(v[k][j]);
    return cta_allreduce2(s, SumD(), red_d, par_d);
  }
  template <class F>
  __device__ __forceinline__ double sum_positive(F f) {
    return cta_allreduce2(static_cast<double>(thread_tree_sum<VPT, kFull>(v, f, t, nt, nch)),
                          SumD(), red_d, par_d);
  }
  template <class F>
  __device__ __forceinline__ double map_sum_positive(F f) {
    map(f);
    return sum_positive([](float e) { return e; });
  }
  template <class F>
  __device__ __forceinline__ void map(F f) {
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int j = 0; j < 4; ++j) v[k][j] = f(v[k][j]);
  }

  // ---- the program's steps on row r (the kernel's loop dispatches to them) ----------------
  __device__ __forceinline__ int col(int k) const { return 4 * (k * nt + t); }

  __device__ __forceinline__ void load(const DevProgram& P, int64_t r) {
    const float* src = P.in + r * static_cast<int64_t>(P.win);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if (k * nt + t < nch) {
        ldrow4(src + col(k), v[k]);
      } else {
        v[k][0] = v[k][1] = v[k][2] = v[k][3] = 0.f;
      }
    }
  }

  __device__ __forceinline__ void pointwise(const DevInstr& in, int64_t r) {
    const OpCode op = static_cast<OpCode>(in.op);
    if (!(in.flags & kFlagBinary)) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) apply_unary4(op, v[k], in.pp);
      return;
    }
    const bool rev = (in.flags & kFlagReversed) != 0;
    if (in.opnd == kOpCol || in.opnd == kOpFull) {
      const float* base = in.b + (in.opnd == kOpFull ? r * static_cast<int64_t>(w) : 0);
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        if (valid(k)) {
          float b[4];
          if (in.opnd == kOpFull) ldrow4(base + col(k), b);
          else ld4(base + col(k), b);
          apply_binary4(op, v[k], b, rev);
        }
      }
      return;
    }
    float b[4];
    load_operand4(in, r, 0, 4, b);  // one value for the row
#pragma unroll
    for (int k = 0; k < VPT; ++k) apply_binary4(op, v[k], b, rev);
  }

  __device__ __forceinline__ void bn_apply(const DevInstr& in) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if (valid(k)) {
        float mu[4], is[4];
        ld4(in.p0 + col(k), mu);
        ld4(in.p0 + in.win + col(k), is);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[k][j] = BatchNormOp::normalize(v[k][j], mu[j], is[j]);
        affine4(v[k], in.p1, in.p2, col(k));
      }
    }
  }

  __device__ __forceinline__ void save(const DevInstr& in, int64_t r) {
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      if (valid(k))
        *reinterpret_cast<float4*>(in.save + r * static_cast<int64_t>(w) + col(k)) =
            make_float4(v[k][0], v[k][1], v[k][2], v[k][3]);
  }

  // Groups of 4q columns: chunk k of q consecutive lanes is a group (RegisterGroup).
  __device__ __forceinline__ void group_norm(const DevInstr& in) {
    const int q = (w / in.groups) >> 2;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      RegisterGroup grp{v[k], q, col(k), valid(k)};
      GroupNormOp::forward(grp, in.p1, in.p2, in.eps);
    }
  }

  __device__ __forceinline__ void store(const DevProgram& P, int64_t r) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if (!valid(k)) continue;
      if (P.out_type == kOutF32) {
        __stcs(reinterpret_cast<float4*>(static_cast<float*>(P.out) + r * static_cast<int64_t>(P.wout) + col(k)),
               make_float4(v[k][0], v[k][1], v[k][2], v[k][3]));
      } else {
        store_out(P, r, col(k), 4, v[k]);
      }
    }
  }
};

// One row per CTA (grid = M). A persistent variant that prefetches the next row with cp.async
// into shared memory while computing the current one is slower on H100, as is one fed by
// bulk copies, 3 rows in flight per CTA, so the row is loaded straight into registers
// (streaming hint, all loads in flight). The pass is bound by instruction issue (Nsight
// Compute), so what helps is more warps: VPT = 4 (512 threads) is capped at 40 registers for
// 3 CTAs (48 warps) per SM instead of 2 at 59 (24 bytes of loop-invariant values spill to
// L1, and the pass is still faster), and fewer instructions: kFull (no per-chunk bounds) and
// the exponent shift's fmaxf (docs/measurements.md, "The row pass").
// Launched programmatically (programmatic_launch.h): it waits before its first load.
template <int VPT, bool kFull>
__global__ void __launch_bounds__(VPT >= 8 ? 256 : 512, VPT == 4 ? 3 : 1)
    row_register_kernel(const __grid_constant__ DevProgram P) {
  __shared__ double red_d[64];
  __shared__ float red_f[64];
  const int t = threadIdx.x, nt = blockDim.x;
  const int64_t r = blockIdx.x;
  float v[VPT][4];
  RegisterRow<VPT, kFull> row{v, P.win, t, nt, P.win >> 2, red_d, red_f};
  wait_for_previous_grid();  // launched programmatically: the row is the previous kernel's
  row.load(P, r);

#pragma unroll 1
  for (int pc = 0; pc < P.n; ++pc) {
    const DevInstr& in = P.ins[pc];
    if (row.w == 1) {  // after a Reduce (only elementwise instructions follow)
      if (t == 0) apply_elementwise(in, v[0], 1, r, 0);
      continue;
    }
    const OpCode op = static_cast<OpCode>(in.op);
    switch (in.kind) {
      case kPointwise: row.pointwise(in, r); break;
      case kBnApply: row.bn_apply(in); break;
      case kSave: row.save(in, r); break;
      case kReduce:
        v[0][0] = reduce_forward(op, row);
        row.w = 1;
        break;
      case kSoftmax: softmax_forward(op, row); break;
      case kGroupNorm: row.group_norm(in); break;
      case kPool: break;  // never selected for this kernel (register_stage_refusal)
    }
  }

  if (row.w == 1) {
    if (t == 0) store_out(P, r, 0, 1, v[0]);
    return;
  }
  row.store(P, r);
}

}  // namespace
}  // namespace gemmfuse::cuda

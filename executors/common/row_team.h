// A row team: the threads that hold one row between them, and how they combine values. The
// row ops (row_ops.h) are written once over this interface; every executor that runs them
// gives a team of its own shape:
//   - the CPU executor: one thread, the whole row (StridedRow<Alone>);
//   - the CUDA row interpreter: a warp or the CTA over a row in shared memory
//     (StridedRow<WarpCombine> / StridedRow<BlockCombine>);
//   - the CUDA row backward: the CTA over rows in global scratch (StridedRow<BlockCombine>);
//   - the CUDA register kernel: the CTA over a row in registers (RegisterRow,
//     rowpass/row_register_kernel.cuh).
//
// The interface (every member of the team calls each function; results reach every member):
//   int width()                    the row's width
//   float extremum(init, op)       op (MaxF, MinF, ShiftMaxF) folded over the row
//   Acc sum(f)                     the row's sum of f(v), each term added in Acc (fp64, or
//                                  fp32 for a warp's GroupNorm group)
//   Acc sum_positive(f)            the same for f >= 0: a member may add its share in fp32
//   Acc map_sum_positive(f)        v = f(v) in place, then sum_positive of the new values
//   void map(f)                    v = f(v) in place
//   void map_affine(wt, bs, f)     v = f(v) wt[c] + bs[c] in place (either vector nullptr: none)
// and, for rows in memory (the backward's formulas read several rows by column):
//   Acc sum_cols(f)                the row's sum of f(c) over its columns c, in Acc
//   void each_col(f)               f(c) for each of the member's columns
//   int first_col(pred)            the smallest column c with pred(c), or width() if none
// A map reads the team's source row and writes its destination (the same row, in place, or
// another: the first map moves the row there), so a forward can run x -> y without a copy.
#pragma once

#include "pointwise.h"

namespace gemmfuse {

// ---- reduction operators (functors: both a fold's step and the team's combine) ---------
template <class T>
struct SumOf {
  GF_HD T operator()(T a, T b) const { return a + b; }
};
using SumD = SumOf<double>;
using SumF = SumOf<float>;
struct MaxF {
  GF_HD float operator()(float a, float b) const { return nan_max(a, b); }
  GF_HD static float identity() { return -HUGE_VALF; }
};
struct MinF {
  GF_HD float operator()(float a, float b) const { return nan_min(a, b); }
  GF_HD static float identity() { return HUGE_VALF; }
};
// The max that shifts softmax's, log_softmax's and logsumexp's exponents: fmaxf (one
// instruction, NaN dropped) where a Max reduce needs nan_max (four). Dropping NaN here is
// exact: a NaN in the row is also in the sum of exponents, so every output is NaN, as in
// PyTorch; without NaN, fmaxf and nan_max agree (+-inf included).
struct ShiftMaxF {
  GF_HD float operator()(float a, float b) const { return fmaxf(a, b); }
};

// ---- combines: how a member's partial becomes the team's -------------------------------
// One thread is the whole team.
struct Alone {
  template <class T, class Op>
  GF_HD T all(T v, Op) const { return v; }
};

#if defined(__CUDACC__)
// v combined over aligned teams of kLanes lanes (a power of two; 32: the warp). Every lane of
// the warp takes part.
template <int kLanes = 32, class T, class Op>
__device__ __forceinline__ T warp_allreduce(T v, Op op) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// kLanes neighbouring lanes of a warp (aligned); WarpCombine: all 32.
template <int kLanes>
struct LanesCombine {
  template <class T, class Op>
  __device__ __forceinline__ T all(T v, Op op) const { return warp_allreduce<kLanes>(v, op); }
};
using WarpCombine = LanesCombine<32>;

// The whole CTA, combined in a fixed order (deterministic). red_d and red_f hold a slot per
// warp; the trailing barrier lets the next combine reuse them at once.
struct BlockCombine {
  double* red_d;
  float* red_f;
  __device__ __forceinline__ double* slots(double) const { return red_d; }
  __device__ __forceinline__ float* slots(float) const { return red_f; }
  template <class T, class Op>
  __device__ __forceinline__ T all(T v, Op op) const {
    v = warp_allreduce(v, op);
    T* red = slots(T());
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    T r = red[0];
    for (int i = 1; i < nw; ++i) r = op(r, red[i]);
    __syncthreads();
    return r;
  }
};
#endif

// ---- a row in memory, member t of nt taking columns t, t + nt, ... ------------------------
// Sums add their terms in AccT (fp64; fp32 for a warp's GroupNorm group, warp_group).
template <class Combine, class AccT = double>
struct StridedRow {
  using Acc = AccT;
  const float* src;  // the row the next fold or map reads
  float* dst;        // where a map writes (src == dst: in place)
  int w, t, nt;
  Combine comb;

  GF_HD int width() const { return w; }

  template <class Op>
  GF_HD float extremum(float init, Op op) const {
    float m = init;
    for (int c = t; c < w; c += nt) m = op(m, src[c]);
    return comb.all(m, op);
  }
  template <class F>
  GF_HD Acc sum(F f) const {
    Acc s = 0;
    for (int c = t; c < w; c += nt) s += f(src[c]);
    return comb.all(s, SumOf<Acc>());
  }
  template <class F>
  GF_HD Acc sum_positive(F f) const { return sum(f); }
  template <class F>
  GF_HD Acc map_sum_positive(F f) {
    Acc s = 0;
    for (int c = t; c < w; c += nt) {
      const float y = f(src[c]);
      dst[c] = y;
      s += y;
    }
    src = dst;
    return comb.all(s, SumOf<Acc>());
  }
  template <class F>
  GF_HD void map(F f) {
    for (int c = t; c < w; c += nt) dst[c] = f(src[c]);
    src = dst;
  }
  // v = f(v), times weight[c], plus bias[c] (either absent: nullptr).
  template <class F>
  GF_HD void map_affine(const float* weight, const float* bias, F f) {
    for (int c = t; c < w; c += nt) {
      float y = f(src[c]);
      if (weight) y *= weight[c];
      if (bias) y += bias[c];
      dst[c] = y;
    }
    src = dst;
  }

  template <class F>
  GF_HD Acc sum_cols(F f) const {
    Acc s = 0;
    for (int c = t; c < w; c += nt) s += f(c);
    return comb.all(s, SumOf<Acc>());
  }
  template <class F>
  GF_HD void each_col(F f) const {
    for (int c = t; c < w; c += nt) f(c);
  }
  // Column indices as floats (exact below 2^24) share the float combine.
  template <class P>
  GF_HD int first_col(P pred) const {
    float first = static_cast<float>(w);
    for (int c = t; c < w; c += nt)
      if (pred(c)) {
        first = static_cast<float>(c);
        break;
      }
    return static_cast<int>(comb.all(first, MinF()));
  }
};

// One thread as the team of the whole row (the CPU executor's): src read, dst written by maps.
inline StridedRow<Alone> alone_row(const float* src, float* dst, int64_t w) {
  return {src, dst, static_cast<int>(w), 0, 1, {}};
}

#if defined(__CUDACC__)
// The teams of one GroupNorm group of gs columns in memory: a warp's lanes with fp32 sums (the
// many-small-groups case, where fp64 sums would take most of the pass), or the CTA's nt
// threads with fp64 sums (large groups).
__device__ __forceinline__ StridedRow<WarpCombine, float> warp_group(const float* src, float* dst,
                                                                     int gs, int lane) {
  return {src, dst, gs, lane, 32, {}};
}
// The same over kLanes lanes (lane: its index among them), a warp holding 32 / kLanes groups.
template <int kLanes>
__device__ __forceinline__ StridedRow<LanesCombine<kLanes>, float> lanes_group(const float* src, float* dst,
                                                                               int gs, int lane) {
  return {src, dst, gs, lane, kLanes, {}};
}
__device__ __forceinline__ StridedRow<BlockCombine, double> cta_group(const float* src, float* dst,
                                                                      int gs, int t, int nt,
                                                                      double* red_d) {
  return {src, dst, gs, t, nt, {red_d, nullptr}};
}
#endif

}  // namespace gemmfuse

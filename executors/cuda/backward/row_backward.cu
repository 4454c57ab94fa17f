// The CUDA row backward (row_backward.h). A CTA per row at a time, 256 threads over the
// columns; the row's values live in the CTA's slot of global scratch (one row of each value,
// reused by its next row: L2-resident), reductions go through the CTA's row team
// (executors/common/row_team.h). Reduce, Softmax, GroupNorm and Pool stages run their ops of
// row_ops.h, as every executor does; the pointwise ones run pointwise.h's.
#include "row_backward.h"

#include <algorithm>
#include <stdexcept>

#include "batch_norm_op.h"
#include "cuda_check.h"
#include "row_ops.h"

namespace gemmfuse::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Row {
  const BwSegment& s;
  int64_t r;     // the row
  int64_t slot;  // the CTA's scratch and sink rows
  BlockCombine comb;  // the CTA's reductions (row_team.h)
  // The CTA as the row team over w columns of src (maps write dst).
  __device__ StridedRow<BlockCombine> team(const float* src, float* dst, int w) const {
    return {src, dst, w, static_cast<int>(threadIdx.x), kThreads, comb};
  }
  __device__ const float* value(int j) const {
    return j == 0 ? s.v0 + r * s.w0 : s.vals + s.val_off[j] + slot * width(j);
  }
  __device__ float* value_w(int j) const { return s.vals + s.val_off[j] + slot * width(j); }
  __device__ int width(int j) const { return j == 0 ? s.w0 : s.ins[j - 1].wout; }

  __device__ float operand(const BwInstr& in, int64_t c) const {
    switch (in.opnd) {
      case kBwImm: return in.imm;
      case kBwScalar: return in.b[0];
      case kBwCol: return in.b[c];
      case kBwRow: return in.b[r];
      case kBwFull: return in.b[r * in.win + c];
      case kBwValue: {
        const int wj = width(in.value);
        return value(in.value)[wj == 1 ? 0 : c];
      }
      default: return NAN;
    }
  }

  // A pointwise stage on one element (forward and forward_run compute alike).
  __device__ float pointwise_fwd(const BwInstr& in, float v, int64_t c) const {
    return (in.flags & kBwBinary)
               ? apply_binary(static_cast<OpCode>(in.op), v, operand(in, c), in.flags & kBwReversed)
               : apply_unary(static_cast<OpCode>(in.op), v, in.pp);
  }

  // ---- a run of pointwise stages [a, b) (run_first): value b from value a, per element -------
  __device__ void forward_run(int a, int b) {
    const float* x = value(a);
    float* y = value_w(b);
    const int w = s.ins[a].win;
    for (int c = threadIdx.x; c < w; c += kThreads) {
      float v = x[c];
      for (int i = a; i < b; ++i) v = pointwise_fwd(s.ins[i], v, c);
      y[c] = v;
    }
    __syncthreads();
  }

  // The gradient at value a (gi) from the one at value b (g) through the run [a, b): each
  // element's values recomputed in registers, then the stages' derivatives in reverse, as
  // backward() computes them stage by stage (the same operations in the same order).
  __device__ void backward_run(int a, int b, const float* g, float* gi) {
    const int w = s.ins[a].win;
    float part[kMaxPointwiseRun] = {};  // Scalar / Row operands and one-wide values: the row's sum
    for (int c = threadIdx.x; c < w; c += kThreads) {
      float v[kMaxPointwiseRun + 1];
      v[0] = value(a)[c];
#pragma unroll
      for (int k = 0; k < kMaxPointwiseRun; ++k)
        if (a + k < b) v[k + 1] = pointwise_fwd(s.ins[a + k], v[k], c);
      float gc = g[c];
#pragma unroll
      for (int k = kMaxPointwiseRun - 1; k >= 0; --k) {
        if (a + k >= b) continue;
        const BwInstr& in = s.ins[a + k];
        const OpCode op = static_cast<OpCode>(in.op);
        if (!(in.flags & kBwBinary)) {
          gc = unary_grad(op, v[k], v[k + 1], gc, in.pp);
          continue;
        }
        const Grad2 d = binary_grad(op, v[k], operand(in, c), in.flags & kBwReversed, gc);
        gc = d.l;
        sink_operand_grad(in, c, w, d.r, part[k]);
      }
      gi[c] = gc;
    }
#pragma unroll
    for (int k = 0; k < kMaxPointwiseRun; ++k) {
      if (a + k >= b) break;
      if (s.ins[a + k].flags & kBwBinary) sink_row_sum(s.ins[a + k], part[k]);
    }
    __syncthreads();
  }

  // A binary stage's gradient d at column c for its operand: into the operand's sink (a Col or
  // Full operand's, a wider value's accumulator), or into part where the operand takes the
  // row's sum (a Scalar or Row operand, a one-wide value; an immediate takes none).
  __device__ __forceinline__ void sink_operand_grad(const BwInstr& in, int c, int w, float d, float& part) {
    switch (in.opnd) {
      case kBwCol:
        if (in.b_grad) in.b_grad[slot * w + c] += d;
        break;
      case kBwFull:
        if (in.b_grad) in.b_grad[r * w + c] += d;
        break;
      case kBwValue:
        if (width(in.value) != 1) s.acc[in.value][r * w + c] += d;
        else part += d;
        break;
      case kBwNone:
      case kBwImm:
      case kBwScalar:
      case kBwRow:
        part += d;
        break;
    }
  }

  // The row's sum of a binary stage's parts (sink_operand_grad's) into the operand's sink,
  // where the operand takes one. Every thread of the CTA calls it (a block reduction).
  __device__ void sink_row_sum(const BwInstr& in, float part) {
    const bool one_wide = in.opnd == kBwValue && width(in.value) == 1;
    if (!(in.opnd == kBwScalar || in.opnd == kBwRow || one_wide)) return;
    const float t = comb.all(part, SumF());
    if (threadIdx.x == 0) {
      if (one_wide) s.acc[in.value][r] += t;
      else if (in.b_grad) in.b_grad[in.opnd == kBwRow ? r : slot] += t;
    }
  }

  // ---- forward: value i+1 from value i ------------------------------------------------------
  __device__ void forward(int i) {
    const BwInstr& in = s.ins[i];
    const float* x = value(i);
    float* y = value_w(i + 1);
    const int w = in.win;
    switch (in.kind) {
      case kBwPointwise:
        for (int c = threadIdx.x; c < w; c += kThreads)
          y[c] = (in.flags & kBwBinary)
                     ? apply_binary(static_cast<OpCode>(in.op), x[c], operand(in, c), in.flags & kBwReversed)
                     : apply_unary(static_cast<OpCode>(in.op), x[c], in.pp);
        break;
      case kBwReduce: {
        auto row = team(x, y, w);
        const float res = reduce_forward(static_cast<OpCode>(in.op), row);
        if (threadIdx.x == 0) y[0] = res;
        break;
      }
      case kBwSoftmax: {  // x into y
        auto row = team(x, y, w);
        softmax_forward(static_cast<OpCode>(in.op), row);
        break;
      }
      case kBwGroupNorm: group_norm(in, x, y, nullptr, nullptr); break;
      case kBwPool:
        for (int o = threadIdx.x; o < in.wout; o += kThreads)
          y[o] = PoolOp::forward(in.pool, x, in.win, o);
        break;
      case kBwBatchNorm:
        for (int c = threadIdx.x; c < w; c += kThreads)
          y[c] = BatchNormOp::apply(x[c], in.stats, w, in.weight, in.bias, c);
        break;
    }
    __syncthreads();
  }

  // GroupNorm forward (g == nullptr: y from x) or backward (gi from g; the affine parameters'
  // gradients into the row's sinks), by GroupNormOp over group teams: 8 lanes a group where the
  // segment asks for it (gn_lanes) and groups are at most kGroupLanesMaxWidth wide; else a warp
  // a group where the groups are many and small, else the CTA a group.
  __device__ void group_norm(const BwInstr& in, const float* x, float* y, const float* g, float* gi) {
    const int w = in.win, gs = w / in.groups;
    auto run = [&](auto&& team, int grp) {
      const int c0 = grp * gs;
      if (g == nullptr) {
        GroupNormOp::forward(team, from_col(in.weight, c0), from_col(in.bias, c0), in.eps);
        return;
      }
      const GroupGrad d{x + c0, g + c0, from_col(in.weight, c0), gi + c0};
      GroupNormOp::backward(team, d, in.eps, [&](int c, float dw, float db) {
        if (in.weight_grad) in.weight_grad[slot * w + c0 + c] += dw;
        if (in.bias_grad) in.bias_grad[slot * w + c0 + c] += db;
      });
    };
    const int t = threadIdx.x;
    if (s.gn_lanes == 8 && gs <= kGroupLanesMaxWidth) {
      // Four groups a warp at once, 8 lanes each. Every lane runs each round, so that the
      // shuffles of its warp meet: lanes past the last group run over no columns.
      for (int first = (t >> 5) * 4; first < in.groups; first += kWarps * 4) {
        const int grp = first + ((t & 31) >> 3);
        const bool live = grp < in.groups;
        const int c0 = live ? grp * gs : 0;
        run(lanes_group<8>(x + c0, y ? y + c0 : nullptr, live ? gs : 0, t & 7), live ? grp : 0);
      }
    } else if (in.groups >= kWarps && gs <= 1024) {
      for (int grp = t >> 5; grp < in.groups; grp += kWarps)
        run(warp_group(x + grp * gs, y ? y + grp * gs : nullptr, gs, t & 31), grp);
    } else {
      for (int grp = 0; grp < in.groups; ++grp)
        run(cta_group(x + grp * gs, y ? y + grp * gs : nullptr, gs, t, kThreads, comb.red_d), grp);
    }
  }

  // ---- backward: the gradient at value i (gi) from the one at value i+1 (g) --------------
  __device__ void backward(int i, const float* g, float* gi) {
    const BwInstr& in = s.ins[i];
    const float* x = value(i);
    const float* y = value(i + 1);
    switch (in.kind) {
      case kBwPointwise: pointwise_backward(in, x, y, g, gi); break;
      case kBwReduce: {
        auto row = team(x, nullptr, in.win);
        reduce_backward(static_cast<OpCode>(in.op), row, {x, y, g, gi}, in.first_index);
        break;
      }
      case kBwSoftmax: {
        auto row = team(y, nullptr, in.win);
        softmax_backward(static_cast<OpCode>(in.op), row, {x, y, g, gi});
        break;
      }
      case kBwGroupNorm: group_norm(in, x, nullptr, g, gi); break;
      case kBwPool: pool_backward(in, x, g, gi); break;
      case kBwBatchNorm: batch_norm_backward(in, x, g, gi); break;
    }
    __syncthreads();
  }

  __device__ void pointwise_backward(const BwInstr& in, const float* x, const float* y, const float* g,
                                     float* gi) {
    const int w = in.win;
    const OpCode op = static_cast<OpCode>(in.op);
    if (!(in.flags & kBwBinary)) {
      for (int c = threadIdx.x; c < w; c += kThreads) gi[c] = unary_grad(op, x[c], y[c], g[c], in.pp);
      return;
    }
    float part = 0.f;  // Scalar / Row operands and one-wide values: the row's sum
    for (int c = threadIdx.x; c < w; c += kThreads) {
      const Grad2 d = binary_grad(op, x[c], operand(in, c), in.flags & kBwReversed, g[c]);
      gi[c] = d.l;
      sink_operand_grad(in, c, w, d.r, part);
    }
    sink_row_sum(in, part);
  }

  // Each column c gathers g from the windows that hold it (PoolOp::backward).
  __device__ void pool_backward(const BwInstr& in, const float* x, const float* g, float* gi) {
    for (int c = threadIdx.x; c < in.win; c += kThreads)
      gi[c] = PoolOp::backward(in.pool, x, g, in.win, in.wout, c);
  }

  // An eval BatchNorm (running statistics; batch ones cut the segments): g times weight and
  // invstd, and the affine parameters' gradients into the row's sinks.
  __device__ void batch_norm_backward(const BwInstr& in, const float* x, const float* g, float* gi) {
    const int w = in.win;
    for (int c = threadIdx.x; c < w; c += kThreads) {
      const float xh = BatchNormOp::normalize(x[c], in.stats[c], in.stats[w + c]);
      gi[c] = BatchNormOp::eval_grad(g[c], in.weight ? in.weight[c] : 1.f, in.stats[w + c]);
      if (in.weight_grad) in.weight_grad[slot * w + c] += g[c] * xh;
      if (in.bias_grad) in.bias_grad[slot * w + c] += g[c];
    }
  }
};

// Four CTAs per SM (at most 64 registers): without the bound the row team's fp64 sums take the
// kernel to 80 registers and 3 CTAs, and fp32 training of GroupNorm chains runs slower
// (docs/measurements.md, "Row ops declared once").
__global__ void __launch_bounds__(kThreads, 4) row_backward_kernel(const BwSegment s) {
  __shared__ double red_d[kWarps];
  __shared__ float red_f[kWarps];
  const int64_t slot = blockIdx.x;  // gridDim.x == s.slots
  for (int64_t r = slot; r < s.M; r += gridDim.x) {
    Row row{s, r, slot, BlockCombine{red_d, red_f}};
    for (int i = 0; i < s.n;) {
      int b = i + 1;
      while (b < s.n && s.run_first[b] == i) ++b;
      if (b - i > 1)
        row.forward_run(i, b);
      else
        row.forward(i);
      i = b;
    }
    const int top = s.n;
    const int wt = row.width(top);
    float* g = s.g_scratch + slot * s.w_max;
    float* g2 = s.g_scratch + (s.slots + slot) * s.w_max;
    if (s.bn_top >= 0) {  // the top value is a batch-statistics BatchNorm's input
      const BwInstr& in = s.ins[s.bn_top];
      const float* x = row.value(top);
      const float n = static_cast<float>(s.M);
      for (int c = threadIdx.x; c < wt; c += kThreads) {
        const float xh = BatchNormOp::normalize(x[c], in.stats[c], in.stats[wt + c]);
        g[c] = BatchNormOp::batch_grad(s.g_top[r * wt + c], xh, in.weight ? in.weight[c] : 1.f,
                                       in.stats[wt + c], n, s.bn_sum_g[c], s.bn_sum_gx[c]);
      }
    } else {
      for (int c = threadIdx.x; c < wt; c += kThreads) g[c] = s.g_top[r * wt + c];
    }
    __syncthreads();
    auto add_acc = [&](int j) {
      if (!s.acc[j]) return;
      const int wj = row.width(j);
      for (int c = threadIdx.x; c < wj; c += kThreads) g[c] += s.acc[j][r * wj + c];
      __syncthreads();
    };
    add_acc(top);
    for (int i = s.n - 1; i >= s.lo;) {
      const int a = s.run_first[i];  // runs start at lo or above (plan_pointwise_runs)
      if (a < i)
        row.backward_run(a, i + 1, g, g2);
      else
        row.backward(i, g, g2);
      float* t = g;
      g = g2;
      g2 = t;
      add_acc(a);
      i = a - 1;
    }
    const int wl = row.width(s.lo);
    if (s.bn_below >= 0) {  // g is at a batch-statistics BatchNorm's output
      const BwInstr& in = s.ins[s.bn_below];
      const float* x = row.value(s.bn_below);
      for (int c = threadIdx.x; c < wl; c += kThreads) {
        s.out[r * wl + c] = g[c];
        s.out_gx[r * wl + c] = g[c] * (x[c] - in.stats[c]) * in.stats[wl + c];
      }
    } else {
      for (int c = threadIdx.x; c < wl; c += kThreads) s.out[r * wl + c] = g[c];
    }
    __syncthreads();
  }
}

// A CTA sums kSumCols columns over every row: kSumRowGroups groups of threads each take every
// kSumRowGroups-th row in fp64, then the groups' sums are added in a fixed order (the result
// does not depend on scheduling). fp64 keeps the sum of ~1e6 fp32 terms (a scalar's gradient
// over every element) at fp32's last bit, as PyTorch's cascaded sums do.
constexpr int kSumCols = 32, kSumRowGroups = 8;

__global__ void __launch_bounds__(kSumCols * kSumRowGroups)
    column_sums_kernel(const float* __restrict__ in, int64_t rows, int64_t cols,
                       float* __restrict__ out, float scale, bool accumulate) {
  __shared__ double part[kSumRowGroups][kSumCols];
  const int lane = threadIdx.x % kSumCols, group = threadIdx.x / kSumCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSumCols + lane;
  double t = 0.0;
  if (c < cols)
    for (int64_t r = group; r < rows; r += kSumRowGroups) t += in[r * cols + c];
  part[group][lane] = t;
  __syncthreads();
  if (group != 0 || c >= cols) return;
  for (int g = 1; g < kSumRowGroups; ++g) t += part[g][lane];
  const float sum = static_cast<float>(scale * t);
  out[c] = accumulate ? out[c] + sum : sum;
}

// One column (a scalar's per-row sinks): the CTA's threads stride the rows.
__global__ void __launch_bounds__(kSumCols * kSumRowGroups)
    column_sum_one_kernel(const float* __restrict__ in, int64_t rows, float* __restrict__ out,
                          float scale, bool accumulate) {
  __shared__ double part[kSumCols * kSumRowGroups];
  double t = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) t += in[r];
  part[threadIdx.x] = t;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int i = 1; i < kSumCols * kSumRowGroups; ++i) t += part[i];
  const float sum = static_cast<float>(scale * t);
  *out = accumulate ? *out + sum : sum;
}

}  // namespace

void plan_pointwise_runs(BwSegment& seg) {
  const int n = seg.n;
  bool keep[kMaxBackwardInstrs + 1] = {};  // values held in scratch
  keep[0] = keep[n] = true;
  if (seg.lo <= n) keep[seg.lo] = true;
  if (seg.bn_below >= 0) keep[seg.bn_below] = keep[seg.bn_below + 1] = true;
  for (int i = 0; i < n; ++i) {
    const BwInstr& in = seg.ins[i];
    if (in.kind != kBwPointwise) keep[i] = keep[i + 1] = true;
    if (in.opnd == kBwValue && in.value >= 0 && in.value <= n) keep[in.value] = true;
  }
  for (int j = 0; j <= n; ++j)
    if (seg.acc[j]) keep[j] = true;
  for (int i = 0; i < n; ++i) {
    const int first = i > 0 ? seg.run_first[i - 1] : 0;
    const bool joins = i > 0 && !keep[i] && seg.ins[i].kind == kBwPointwise &&
                       seg.ins[i - 1].kind == kBwPointwise && i - first < kMaxPointwiseRun;
    seg.run_first[i] = static_cast<int8_t>(joins ? first : i);
  }
}


void launch_row_backward(const BwSegment& seg, cudaStream_t stream) {
  if (seg.M <= 0) return;
  if (seg.n > kMaxBackwardInstrs) throw Unsupported("CUDA backward: the chain is too long");
  if (seg.slots <= 0 || seg.slots > seg.M) throw std::logic_error("CUDA backward: slots out of range");
  row_backward_kernel<<<static_cast<unsigned>(seg.slots), kThreads, 0, stream>>>(seg);
  GF_LAUNCH_CHECK();
}

void launch_column_sums(const float* in, int64_t rows, int64_t cols, float* out, float scale,
                        bool accumulate, cudaStream_t stream) {
  if (cols <= 0) return;
  if (cols == 1)
    column_sum_one_kernel<<<1, kSumCols * kSumRowGroups, 0, stream>>>(in, rows, out, scale, accumulate);
  else
    column_sums_kernel<<<static_cast<unsigned>((cols + kSumCols - 1) / kSumCols), kSumCols * kSumRowGroups,
                         0, stream>>>(in, rows, cols, out, scale, accumulate);
  GF_LAUNCH_CHECK();
}

}  // namespace gemmfuse::cuda

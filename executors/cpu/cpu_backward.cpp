// The CPU executor's backward (backward.h): the reference the CUDA backward is tested against.
//
// The chain is cut at BatchNorms that normalise with batch statistics (their input's gradient
// needs column sums over all rows); each segment [lo, hi) runs row by row: the chain's values
// v_start .. v_hi recomputed from the saved v_start (BatchNorms with their saved statistics),
// the gradient at v_hi taken from the segment above (or the output's gradient), then every
// stage's derivative in reverse. Reads of an earlier value v<j> add their share to v<j>'s
// gradient, in the row when v<j> lies in the segment, else through a [M, w] buffer. Operand
// tensors' gradients are summed per thread in double, then over threads.
#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <vector>

#include "batch_norm_op.h"
#include "cpu_executor.h"
#include "pointwise.h"
#include "cpu_rows.h"
#include "row_attrs.h"
#include "row_ops.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gemmfuse {

namespace {

void matmul_loop(int64_t M, int64_t N, int64_t K, const float* a, bool ta, const float* b,
                 bool tb, float* c) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += double(ta ? a[k * M + i] : a[i * K + k]) * double(tb ? b[j * K + k] : b[k * N + j]);
      c[i * N + j] = static_cast<float>(s);
    }
}

// Sums of operand gradients that many rows add to (Scalar, Col operands; norms' affine
// parameters), per thread.
struct Partials {
  std::vector<std::vector<double>> sums;  // per operand, its numel (empty: not accumulated)
};

struct Backward {
  const BackwardPlan& bp;
  const BackwardArgs& a;
  const Chain& ch;
  int64_t M;
  int n;
  // Gradients of values read through v<j> by stages in a later segment: j -> [M, w_j].
  std::map<int, std::vector<float>> pending;
  // The gradient at each batch-statistics BatchNorm's output, [M, w], and its column sums.
  std::map<int, std::vector<float>> bn_grad;
  std::map<int, std::vector<double>> bn_sum_g, bn_sum_gx;

  // Eval BatchNorms' [2, w] mean and invstd from their running statistics.
  std::map<int, std::vector<float>> running_stats;

  Backward(const Plan& p, const BackwardPlan& b, const BackwardArgs& args)
      : bp(b), a(args), ch(p.chain), M(p.M), n(static_cast<int>(p.chain.nodes.size())) {
    for (int i = bp.start; i < n; ++i) {
      if (instr(i).kind != Instr::Kind::BatchNormApply || bp.saved.batch_stats.count(i)) continue;
      const Node& nd = ch.nodes[i];
      const int64_t w = instr(i).width_in;
      std::vector<float>& st = running_stats[i];
      st.resize(2 * w);
      running_stats_row(static_cast<const float*>(a.state[nd.running_mean.index]),
                        static_cast<const float*>(a.state[nd.running_var.index]), nd.eps, w, st.data());
    }
  }

  const Instr& instr(int i) const { return bp.program[i - bp.start]; }

  // The operand value of a binary stage at (row, col); `vals` holds the row's values.
  float operand(const Instr& in, const std::vector<std::vector<float>>& vals, int64_t r,
                int64_t c) const {
    const Node& nd = in.node;
    if (nd.b.kind == Operand::Kind::Value) {
      const std::vector<float>& v = vals[nd.b.index];
      return v.size() == 1 ? v[0] : v[c];
    }
    const OperandRef& o = in.b;
    switch (o.kind) {
      case OperandRef::Kind::Imm: return o.imm;
      case OperandRef::Kind::Scalar: return a.operands[o.index][0];
      case OperandRef::Kind::Col: return a.operands[o.index][c];
      case OperandRef::Kind::Row: return a.operands[o.index][r];
      case OperandRef::Kind::Full: return a.operands[o.index][r * in.width_in + c];
      default: throw std::logic_error("cpu backward: operand kind");
    }
  }

  const float* col_param(const OperandRef& o) const {
    return o.kind == OperandRef::Kind::Col ? a.operands[o.index] : nullptr;
  }
  const float* saved_stats(int node) const { return a.saved + bp.saved.batch_stats.at(node); }

  // A BatchNorm's [2, w] mean and invstd: its saved batch statistics, or its running ones.
  const float* bn_stats(int node) const {
    auto it = bp.saved.batch_stats.find(node);
    return it != bp.saved.batch_stats.end() ? a.saved + it->second : running_stats.at(node).data();
  }

  // ---- the forward of one stage on one row (the executors' formulas) ---------------------

  void forward(int i, std::vector<std::vector<float>>& vals, int64_t r) const {
    const Instr& in = instr(i);
    const Node& nd = in.node;
    const std::vector<float>& x = vals[i];
    std::vector<float>& y = vals[i + 1];
    const int64_t w = static_cast<int64_t>(x.size());
    const PointwiseParams pp = pointwise_params(nd);
    switch (in.kind) {
      case Instr::Kind::Pointwise:
        y.resize(w);
        if (family(nd.op) == OpFamily::Binary)
          for (int64_t c = 0; c < w; ++c)
            y[c] = apply_binary(nd.op, x[c], operand(in, vals, r, c), nd.reversed);
        else
          for (int64_t c = 0; c < w; ++c) y[c] = apply_unary(nd.op, x[c], pp);
        break;
      case Instr::Kind::Reduce:
        y.assign(1, reduce_row(nd.op, x.data(), w));
        break;
      case Instr::Kind::Softmax:
        y = x;
        softmax_row(nd.op, y.data(), w);
        break;
      case Instr::Kind::GroupNorm:
        y = x;
        group_norm_row(nd, y.data(), w, col_param(in.weight), col_param(in.bias));
        break;
      case Instr::Kind::Pool:
        y.resize(in.width_out);
        pool_row(nd, x.data(), w, y.data(), in.width_out);
        break;
      case Instr::Kind::BatchNormApply:
        y = x;
        batch_norm_row(y.data(), w, bn_stats(i), col_param(in.weight), col_param(in.bias));
        break;
      case Instr::Kind::Save: throw std::logic_error("cpu backward: a Save among the stages");
    }
  }

  // ---- the derivative of one stage on one row ----------------------------------------------
  // g: the gradient at v_{i+1} in, the gradient at v_i out; v<j> operands add to local[j]
  // (this row) or pending[j] (an earlier segment).

  void backward(int i, std::vector<std::vector<float>>& vals, std::vector<float>& g, int64_t r,
                int lo, std::map<int, std::vector<float>>& local, Partials& part) {
    const Instr& in = instr(i);
    const Node& nd = in.node;
    const std::vector<float>& x = vals[i];
    const std::vector<float>& y = vals[i + 1];
    std::vector<float> gi(x.size(), 0.f);
    switch (in.kind) {
      case Instr::Kind::Pointwise: pointwise_backward(in, vals, i, g, gi, r, lo, local, part); break;
      case Instr::Kind::Reduce: {
        auto row = alone_row(x.data(), nullptr, static_cast<int64_t>(x.size()));
        gemmfuse::reduce_backward(nd.op, row, {x.data(), y.data(), g.data(), gi.data()}, nd.first_index);
        break;
      }
      case Instr::Kind::Softmax: {
        auto row = alone_row(y.data(), nullptr, static_cast<int64_t>(y.size()));
        gemmfuse::softmax_backward(nd.op, row, {x.data(), y.data(), g.data(), gi.data()});
        break;
      }
      case Instr::Kind::GroupNorm: group_norm_backward(in, x, g, gi, part); break;
      case Instr::Kind::Pool: pool_backward(nd, in.width_out, x, g, gi); break;
      case Instr::Kind::BatchNormApply: batch_norm_backward(i, in, x, g, gi, part); break;
      case Instr::Kind::Save: throw std::logic_error("cpu backward: a Save among the stages");
    }
    g.swap(gi);
  }

  void pointwise_backward(const Instr& in, std::vector<std::vector<float>>& vals, int i,
                          const std::vector<float>& g, std::vector<float>& gi, int64_t r, int lo,
                          std::map<int, std::vector<float>>& local, Partials& part) {
    const Node& nd = in.node;
    const std::vector<float>& x = vals[i];
    const std::vector<float>& y = vals[i + 1];
    const int64_t w = static_cast<int64_t>(x.size());
    const PointwiseParams pp = pointwise_params(nd);
    if (family(nd.op) != OpFamily::Binary) {
      for (int64_t c = 0; c < w; ++c) gi[c] = unary_grad(nd.op, x[c], y[c], g[c], pp);
      return;
    }
    for (int64_t c = 0; c < w; ++c) {
      const Grad2 d = binary_grad(nd.op, x[c], operand(in, vals, r, c), nd.reversed, g[c]);
      gi[c] = d.l;
      operand_grad(in, r, c, d.r, lo, local, part);
    }
  }

  void group_norm_backward(const Instr& in, const std::vector<float>& x,
                           const std::vector<float>& g, std::vector<float>& gi, Partials& part) {
    const Node& nd = in.node;
    const float* wt = col_param(in.weight);
    const int64_t gs = static_cast<int64_t>(x.size()) / nd.groups;
    for (int64_t c0 = 0; c0 < static_cast<int64_t>(x.size()); c0 += gs) {
      StridedRow<Alone> grp = alone_row(x.data() + c0, nullptr, gs);
      const GroupGrad d{x.data() + c0, g.data() + c0, from_col(wt, static_cast<int>(c0)), gi.data() + c0};
      GroupNormOp::backward(grp, d, nd.eps, [&](int c, float dw, float db) {
        add_col(part, in.weight, c0 + c, dw);
        add_col(part, in.bias, c0 + c, db);
      });
    }
  }

  static void pool_backward(const Node& nd, int64_t width_out, const std::vector<float>& x,
                            const std::vector<float>& g, std::vector<float>& gi) {
    const PoolWindows p = pool_windows(nd);
    const int w = static_cast<int>(x.size()), wout = static_cast<int>(width_out);
    for (int c = 0; c < w; ++c) gi[c] = PoolOp::backward(p, x.data(), g.data(), w, wout, c);
  }

  // Running statistics (batch ones cut the rows into segments).
  void batch_norm_backward(int i, const Instr& in, const std::vector<float>& x,
                           const std::vector<float>& g, std::vector<float>& gi, Partials& part) {
    const int64_t w = static_cast<int64_t>(x.size());
    const float* wt = col_param(in.weight);
    const float* st = bn_stats(i);
    for (int64_t c = 0; c < w; ++c) {
      const double xh = BatchNormOp::normalize<double>(x[c], st[c], st[w + c]);
      gi[c] = static_cast<float>(BatchNormOp::eval_grad<double>(g[c], wt ? wt[c] : 1.f, st[w + c]));
      add_col(part, in.weight, c, double(g[c]) * xh);
      add_col(part, in.bias, c, g[c]);
    }
  }

  void add_col(Partials& part, const OperandRef& o, int64_t c, double v) const {
    if (o.kind != OperandRef::Kind::Col || !a.grad_operands[o.index]) return;
    part.sums[o.index][c] += v;
  }

  // A binary stage's gradient for its operand at (r, c).
  void operand_grad(const Instr& in, int64_t r, int64_t c, float d, int lo,
                    std::map<int, std::vector<float>>& local, Partials& part) {
    const Node& nd = in.node;
    if (nd.b.kind == Operand::Kind::Value) {  // in this segment (backward_far takes the rest)
      const int j = nd.b.index;
      if (j < lo) throw std::logic_error("cpu backward: a far value read outside backward_far");
      std::vector<float>& dst = local[j];
      if (dst.empty()) dst.assign(ch.row_width(j), 0.f);
      dst[dst.size() == 1 ? 0 : c] += d;
      return;
    }
    const OperandRef& o = in.b;
    if (o.kind == OperandRef::Kind::Imm || !a.grad_operands[o.index]) return;
    float* out = a.grad_operands[o.index];
    switch (o.kind) {
      case OperandRef::Kind::Scalar: part.sums[o.index][0] += d; break;
      case OperandRef::Kind::Col: part.sums[o.index][c] += d; break;
      case OperandRef::Kind::Row: out[r] += d; break;  // rows belong to one thread each
      case OperandRef::Kind::Full: out[r * in.width_in + c] += d; break;
      case OperandRef::Kind::None:
      case OperandRef::Kind::Imm:
      case OperandRef::Kind::Buffer:  // a saved value: nd.b is a Value, handled above
        throw std::logic_error("cpu backward: a binary stage's operand without a gradient");
    }
  }

  // ---- one segment [lo, hi) over all rows ---------------------------------------------------

  void segment(int lo, int hi, std::vector<float>& dv_start) {
    const int bn_below = lo > bp.start ? lo - 1 : -1;  // the BatchNorm whose output is v_lo
    const int64_t w_lo = ch.row_width(lo);
    prepare_segment(lo, hi, bn_below, w_lo);
    const int threads = max_threads();
    std::vector<Partials> parts(threads);
    for (Partials& p : parts) {
      p.sums.resize(a.operands.size());
      for (size_t t = 0; t < a.operands.size(); ++t)
        if (a.grad_operands[t]) p.sums[t].assign(a.operand_numel[t], 0.0);
    }
    std::vector<std::vector<double>> sg(threads), sgx(threads);

#if defined(_OPENMP)
#pragma omp parallel for schedule(static)
#endif
    for (int64_t r = 0; r < M; ++r) {
#if defined(_OPENMP)
      const int t = omp_get_thread_num();
#else
      const int t = 0;
#endif
      std::vector<std::vector<float>> vals(n + 1);
      vals[bp.start].assign(a.saved + bp.saved.v + r * bp.saved.v_cols,
                            a.saved + bp.saved.v + (r + 1) * bp.saved.v_cols);
      for (int i = bp.start; i < hi; ++i) forward(i, vals, r);
      std::vector<float> g = top_gradient(hi, vals, r);
      backward_rows(lo, hi, vals, g, r, parts[t]);
      if (bn_below >= 0) {  // g is at the BatchNorm's output: keep it and its column sums
        if (sg[t].empty()) {
          sg[t].assign(w_lo, 0.0);
          sgx[t].assign(w_lo, 0.0);
        }
        keep_batch_norm_gradient(bn_below, vals[bn_below], g, r, sg[t], sgx[t], parts[t]);
      } else {
        std::copy(g.begin(), g.end(), dv_start.begin() + r * w_lo);
      }
    }
    for (int t = 0; t < threads; ++t) {
      for (size_t o = 0; o < parts[t].sums.size(); ++o)
        for (size_t e = 0; e < parts[t].sums[o].size(); ++e)
          a.grad_operands[o][e] += static_cast<float>(parts[t].sums[o][e]);
      if (bn_below >= 0 && !sg[t].empty())
        for (int64_t c = 0; c < w_lo; ++c) {
          bn_sum_g[bn_below][c] += sg[t][c];
          bn_sum_gx[bn_below][c] += sgx[t][c];
        }
    }
  }

  // The buffers a segment [lo, hi) writes: `pending` rows for the values below it that it
  // reads through v<j>, and the gradient and column sums at the BatchNorm below it.
  void prepare_segment(int lo, int hi, int bn_below, int64_t w_lo) {
    for (int i = lo; i < hi; ++i) {
      const Node& nd = ch.nodes[i];
      const bool far = family(nd.op) == OpFamily::Binary && nd.b.kind == Operand::Kind::Value &&
                       nd.b.index < lo;
      if (far && !pending.count(nd.b.index))
        pending[nd.b.index].assign(M * ch.row_width(nd.b.index), 0.f);
    }
    if (bn_below >= 0) {
      bn_grad[bn_below].assign(M * w_lo, 0.f);
      bn_sum_g[bn_below].assign(w_lo, 0.0);
      bn_sum_gx[bn_below].assign(w_lo, 0.0);
    }
  }

  // The gradient at v_hi for row r: the output's, or where v_hi is a batch-statistics
  // BatchNorm's input, that BatchNorm's backward from its statistics and column sums.
  std::vector<float> top_gradient(int hi, const std::vector<std::vector<float>>& vals,
                                  int64_t r) const {
    const int64_t w_hi = ch.row_width(hi);
    if (hi == n) {
      const float* go = static_cast<const float*>(a.grad_out) + r * w_hi;
      return std::vector<float>(go, go + w_hi);
    }
    const Instr& in = instr(hi);
    const float* wt = col_param(in.weight);
    const float* s = saved_stats(hi);
    const std::vector<float>& x = vals[hi];
    const std::vector<float>& gb = bn_grad.at(hi);
    std::vector<float> g(w_hi);
    for (int64_t c = 0; c < w_hi; ++c) {
      const double xh = BatchNormOp::normalize<double>(x[c], s[c], s[w_hi + c]);
      g[c] = static_cast<float>(BatchNormOp::batch_grad<double>(
          gb[r * w_hi + c], xh, wt ? wt[c] : 1.0, s[w_hi + c], double(M), bn_sum_g.at(hi)[c],
          bn_sum_gx.at(hi)[c]));
    }
    return g;
  }

  // Row r's gradient from v_hi down to v_lo, adding what later stages and earlier segments
  // sent to each value read through v<j>.
  void backward_rows(int lo, int hi, std::vector<std::vector<float>>& vals, std::vector<float>& g,
                     int64_t r, Partials& part) {
    std::map<int, std::vector<float>> local;  // in-segment reads of v<j>: their gradients
    auto add_pending = [&](int j) {
      auto it = pending.find(j);
      if (it != pending.end()) {
        const int64_t wj = ch.row_width(j);
        for (int64_t c = 0; c < wj; ++c) g[c] += it->second[r * wj + c];
      }
      auto lt = local.find(j);
      if (lt != local.end()) {
        for (size_t c = 0; c < g.size(); ++c) g[c] += lt->second[lt->second.size() == 1 ? 0 : c];
        local.erase(lt);
      }
    };
    add_pending(hi);
    for (int i = hi - 1; i >= lo; --i) {
      backward_far(i, vals, g, r, lo, local, part);
      add_pending(i);
    }
  }

  // Row r's gradient g at a batch-statistics BatchNorm's output: kept for the segment below,
  // with this thread's column sums and the BatchNorm's weight and bias gradients.
  void keep_batch_norm_gradient(int b, const std::vector<float>& x, const std::vector<float>& g,
                                int64_t r, std::vector<double>& sg, std::vector<double>& sgx,
                                Partials& part) {
    const Instr& in = instr(b);
    const float* s = saved_stats(b);
    const int64_t w = static_cast<int64_t>(g.size());
    for (int64_t c = 0; c < w; ++c) {
      const double xh = (x[c] - double(s[c])) * s[w + c];
      bn_grad.at(b)[r * w + c] = g[c];
      sg[c] += g[c];
      sgx[c] += double(g[c]) * xh;
      add_col(part, in.weight, c, double(g[c]) * xh);
      add_col(part, in.bias, c, g[c]);
    }
  }

  // backward() with reads of values below the segment going to `pending` (a row of its own).
  void backward_far(int i, std::vector<std::vector<float>>& vals, std::vector<float>& g,
                    int64_t r, int lo, std::map<int, std::vector<float>>& local, Partials& part) {
    const Node& nd = ch.nodes[i];
    if (family(nd.op) == OpFamily::Binary && nd.b.kind == Operand::Kind::Value && nd.b.index < lo) {
      const int j = nd.b.index;
      const Instr& in = instr(i);
      const std::vector<float>& x = vals[i];
      const int64_t w = static_cast<int64_t>(x.size()), wj = ch.row_width(j);
      std::vector<float> gi(w);
      float* dst = pending.at(j).data() + r * wj;
      for (int64_t c = 0; c < w; ++c) {
        const Grad2 d = binary_grad(nd.op, x[c], operand(in, vals, r, c), nd.reversed, g[c]);
        gi[c] = d.l;
        dst[wj == 1 ? 0 : c] += d.r;
      }
      g.swap(gi);
      return;
    }
    backward(i, vals, g, r, lo, local, part);
  }

  static int max_threads() {
#if defined(_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
  }
};

}  // namespace

namespace {

// dV: the gradient at the value the GEMM (GEMV) produced, through the row stages.
std::vector<float> gradient_at_gemm(const Plan& plan, const BackwardPlan& bp, const BackwardArgs& a) {
  const Chain& ch = plan.chain;
  const int n = static_cast<int>(ch.nodes.size());
  const int64_t M = plan.M, wv = ch.row_width(bp.start);
  std::vector<float> dv(static_cast<size_t>(M * wv), 0.f);
  if (M == 0) return dv;
  if (bp.start == n) {
    const float* go = static_cast<const float*>(a.grad_out);
    std::copy(go, go + M * wv, dv.begin());
    return dv;
  }
  Backward b(plan, bp, a);
  int hi = n;
  for (auto it = bp.batch_norms.rbegin(); it != bp.batch_norms.rend(); ++it) {
    std::vector<float> unused;
    b.segment(*it + 1, hi, unused);
    hi = *it;
  }
  b.segment(bp.start, hi, dv);
  return dv;
}

// The GEMM's gradients: dx = dV W, dW = dVᵀ x, db = the column sums of dV.
void gemm_backward(const Plan& plan, const BackwardArgs& a, const std::vector<float>& dv) {
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  const float* x = static_cast<const float*>(a.x);
  const float* w = static_cast<const float*>(a.weight);
  const CpuMatmul mm = a.cpu_matmul ? a.cpu_matmul : CpuMatmul(matmul_loop);
  if (a.grad_x) mm(M, K, N, dv.data(), false, w, false, static_cast<float*>(a.grad_x));
  if (a.grad_w) mm(N, K, M, dv.data(), true, x, false, static_cast<float*>(a.grad_w));
  if (a.grad_b) {
    float* db = static_cast<float*>(a.grad_b);
    for (int64_t c = 0; c < N; ++c) {
      double s = 0;
      for (int64_t r = 0; r < M; ++r) s += dv[r * N + c];
      db[c] = static_cast<float>(s);
    }
  }
}

// The GEMV: v1[m] = s (x[m] . colsum(W) + sum(b)), so dx = s dv1 (x) colsum(W),
// dW[n] = s dv1ᵀ x for every n, db[n] = s sum(dv1).
void gemv_backward(const Plan& plan, const BackwardPlan& bp, const BackwardArgs& a,
                   const std::vector<float>& dv) {
  const int64_t M = plan.M, N = plan.N, K = plan.K;
  const float* x = static_cast<const float*>(a.x);
  const float* w = static_cast<const float*>(a.weight);
  const double s = bp.gemv_scale;
  if (a.grad_x) {
    std::vector<double> cs(K, 0.0);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t k = 0; k < K; ++k) cs[k] += w[r * K + k];
    float* dx = static_cast<float*>(a.grad_x);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) dx[m * K + k] = static_cast<float>(s * dv[m] * cs[k]);
  }
  if (a.grad_w) {
    std::vector<double> row(K, 0.0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) row[k] += double(dv[m]) * x[m * K + k];
    float* dw = static_cast<float*>(a.grad_w);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t k = 0; k < K; ++k) dw[r * K + k] = static_cast<float>(s * row[k]);
  }
  if (a.grad_b) {
    double t = 0;
    for (int64_t m = 0; m < M; ++m) t += dv[m];
    float* db = static_cast<float*>(a.grad_b);
    for (int64_t c = 0; c < N; ++c) db[c] = static_cast<float>(s * t);
  }
}

}  // namespace

void CpuExecutor::backward(const Plan& plan, const BackwardPlan& bp, const BackwardArgs& a) {
  if (a.grad_operands.size() != a.operands.size() || a.operand_numel.size() != a.operands.size())
    throw std::invalid_argument("cpu backward: one gradient slot and size per operand");
  for (size_t t = 0; t < a.grad_operands.size(); ++t)
    if (a.grad_operands[t]) std::fill(a.grad_operands[t], a.grad_operands[t] + a.operand_numel[t], 0.f);
  const std::vector<float> dv = gradient_at_gemm(plan, bp, a);
  if (bp.gemv) gemv_backward(plan, bp, a, dv);
  else gemm_backward(plan, a, dv);
}

}  // namespace gemmfuse

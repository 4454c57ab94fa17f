// The CPU executor (see cpu_executor.h). Step by step as the plan says; every row pass runs
// its program on one row at a time in a scratch copy of the row.
#include "cpu_executor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "batch_norm_op.h"
#include "gemv_nonfinite.h"
#include "pointwise.h"
#include "cpu_rows.h"

namespace gemmfuse {

namespace {

// Loops over rows or columns run in parallel only where `work` (elements touched) pays for a
// parallel region: starting one costs microseconds, and far more while another process
// holds a core (the threads spin-wait for it), which a call of a few thousand elements
// would pay on every call. The test is a plain branch: an `omp parallel ... if (false)`
// region still enters the OpenMP runtime (a futex call).
constexpr int64_t kParallelWork = int64_t(1) << 16;

enum class Schedule { Static, Dynamic };

// body(i) for i in [0, n): iterations in parallel where `work` pays for it.
template <class Body>
void parallel_for(int64_t n, int64_t work, Schedule schedule, const Body& body) {
#if defined(_OPENMP)
  if (work >= kParallelWork) {
    if (schedule == Schedule::Dynamic) {
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; ++i) body(i);
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) body(i);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) body(i);
}

int64_t chunks(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of the prepared parts (see prepared_bytes).
struct PreparedLayout {
  size_t w = 0, b = 0, colsum = 0, sumb = 0, colsign = 0, total = 0;
  explicit PreparedLayout(const Plan& p) {
    size_t off = 0;
    if (p.prep.fold_batchnorm) {
      w = off;
      off += align_up(sizeof(float) * static_cast<size_t>(p.N * p.K));
      b = off;
      off += align_up(sizeof(float) * static_cast<size_t>(p.N));
    }
    if (p.prep.column_sums) {
      colsum = off;
      off += align_up(sizeof(float) * static_cast<size_t>(p.K));
      sumb = off;
      off += align_up(sizeof(float));
      colsign = off;  // for rows with inf/NaN inputs: executors/common/gemv_nonfinite.h
      off += align_up(sizeof(float) * static_cast<size_t>(p.K));
    }
    total = off;
  }
};

template <typename T>
T* at(void* base, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + off);
}
template <typename T>
const T* at(const void* base, size_t off) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + off);
}

const float* operand_ptr(const RunArgs& a, const OperandRef& r) {
  if (r.index < 0 || r.index >= static_cast<int>(a.operands.size()) || !a.operands[r.index])
    throw std::invalid_argument("cpu executor: operand t" + std::to_string(r.index) +
                                " missing");
  return a.operands[r.index];
}

template <typename T>
T* state_ptr(const RunArgs& a, const Operand& o) {
  if (o.kind != Operand::Kind::State) return nullptr;
  if (o.index < 0 || o.index >= static_cast<int>(a.state.size()) || !a.state[o.index])
    throw std::invalid_argument("cpu executor: state s" + std::to_string(o.index) + " missing");
  return static_cast<T*>(a.state[o.index]);
}

const float* affine_ptr(const RunArgs& a, const Operand& o) {
  if (o.kind != Operand::Kind::Tensor) return nullptr;
  OperandRef r;
  r.index = o.index;
  return operand_ptr(a, r);
}

// Where the run's buffers live.
struct Memory {
  const Plan& plan;
  const RunArgs& args;
  void* workspace;
  float* buffer(int id) const {
    if (id == kOutput) return static_cast<float*>(args.out);
    return at<float>(workspace, plan.buffer_offset(id));
  }
};

// One instruction's operand, resolved to a base pointer once per pass.
struct BoundRef {
  OperandRef::Kind kind = OperandRef::Kind::None;
  float imm = 0.f;
  const float* p = nullptr;
  int64_t cols = 0;  // Buffer: row stride; Full: the value's width
  float get(int64_t row, int64_t col) const {
    switch (kind) {
      case OperandRef::Kind::Imm: return imm;
      case OperandRef::Kind::Scalar: return p[0];
      case OperandRef::Kind::Col: return p[col];
      case OperandRef::Kind::Row: return p[row];
      case OperandRef::Kind::Full: return p[row * cols + col];
      case OperandRef::Kind::Buffer: return p[row * cols + (cols == 1 ? 0 : col)];
      case OperandRef::Kind::None: break;
    }
    return 0.f;
  }
};

// The operand's values along row `row` when they vary by column (nullptr: one value for the
// whole row, BoundRef::get(row, 0)).
const float* row_values(const BoundRef& b, int64_t row) {
  switch (b.kind) {
    case OperandRef::Kind::Col: return b.p;
    case OperandRef::Kind::Full: return b.p + row * b.cols;
    case OperandRef::Kind::Buffer: return b.cols == 1 ? nullptr : b.p + row * b.cols;
    default: return nullptr;
  }
}

BoundRef bind(const Memory& mem, const OperandRef& r, int64_t width) {
  BoundRef b;
  b.kind = r.kind;
  switch (r.kind) {
    case OperandRef::Kind::Imm: b.imm = r.imm; break;
    case OperandRef::Kind::Scalar: case OperandRef::Kind::Col: case OperandRef::Kind::Row:
      b.p = operand_ptr(mem.args, r);
      break;
    case OperandRef::Kind::Full:
      b.p = operand_ptr(mem.args, r);
      b.cols = width;
      break;
    case OperandRef::Kind::Buffer:
      b.p = mem.buffer(r.index);
      b.cols = r.cols;
      break;
    case OperandRef::Kind::None: break;
  }
  return b;
}

// ---- row-program stages ----------------------------------------------------------------

// Pointwise ops over a row with the op a compile-time constant, so that each loop is the op's
// own (vectorized where its formula allows; docs/measurements.md, "The CPU executor's row
// loops").
template <OpCode Op>
void unary_row(float* x, int64_t w, const PointwiseParams& p) {
  for (int64_t c = 0; c < w; ++c) x[c] = Pointwise<Op>::fwd(x[c], p);
}

template <OpCode Op>
void binary_row(float* x, int64_t w, const BoundRef& b, int64_t row, bool reversed) {
  if (const float* v = row_values(b, row)) {
    for (int64_t c = 0; c < w; ++c) x[c] = apply_binary(Op, x[c], v[c], reversed);  // Op constant
  } else {
    const float s = b.get(row, 0);
    for (int64_t c = 0; c < w; ++c) x[c] = apply_binary(Op, x[c], s, reversed);
  }
}

void pointwise_row(const Node& n, float* x, int64_t w, const BoundRef& b, int64_t row,
                   const PointwiseParams& p) {
  switch (n.op) {
#define GF_UNARY(code, name, fam, scalar) \
  case OpCode::code: return unary_row<OpCode::code>(x, w, p);
#define GF_BINARY(code, name, fam, scalar) \
  case OpCode::code: return binary_row<OpCode::code>(x, w, b, row, n.reversed);
    GEMMFUSE_UNARY_OPS(GF_UNARY)
    GEMMFUSE_BINARY_OPS(GF_BINARY)
#undef GF_UNARY
#undef GF_BINARY
    default: throw std::logic_error(std::string("cpu executor: ") + op_name(n.op) + " is not pointwise");
  }
}

// ---- steps -----------------------------------------------------------------------------

void run_row_pass(const Step& st, const Memory& mem) {
  const Plan& plan = mem.plan;
  const int64_t M = plan.M;
  const float* in = mem.buffer(st.input);
  float* out = mem.buffer(st.output);

  // Resolve everything per instruction once; the row loop only reads.
  struct Bound {
    BoundRef b;
    const float *wt = nullptr, *bs = nullptr, *stats = nullptr;
    float* save = nullptr;
    PointwiseParams pp{};
  };
  std::vector<Bound> bound(st.program.size());
  int64_t max_w = std::max(st.width_in, st.width_out);
  for (size_t i = 0; i < st.program.size(); ++i) {
    const Instr& ins = st.program[i];
    Bound& b = bound[i];
    b.b = bind(mem, ins.b, ins.width_in);
    if (ins.weight.kind == OperandRef::Kind::Col) b.wt = operand_ptr(mem.args, ins.weight);
    if (ins.bias.kind == OperandRef::Kind::Col) b.bs = operand_ptr(mem.args, ins.bias);
    if (ins.kind == Instr::Kind::BatchNormApply) b.stats = mem.buffer(ins.stats);
    if (ins.kind == Instr::Kind::Save) b.save = mem.buffer(ins.buffer);
    b.pp = pointwise_params(ins.node);
    max_w = std::max({max_w, ins.width_in, ins.width_out});
  }

  const int64_t work = M * max_w * static_cast<int64_t>(st.program.size());
  parallel_for(chunks(M, 16), work, Schedule::Dynamic, [&](int64_t blk) {
    std::vector<float> row(static_cast<size_t>(max_w)), tmp(static_cast<size_t>(max_w));
    for (int64_t r = blk * 16; r < std::min(M, blk * 16 + 16); ++r) {
      int64_t w = st.width_in;
      std::copy(in + r * w, in + r * w + w, row.begin());
      float* x = row.data();
      for (size_t i = 0; i < st.program.size(); ++i) {
        const Instr& ins = st.program[i];
        const Bound& b = bound[i];
        const Node& n = ins.node;
        switch (ins.kind) {
          case Instr::Kind::Pointwise:
            pointwise_row(n, x, w, b.b, r, b.pp);
            break;
          case Instr::Kind::Reduce:
            x[0] = reduce_row(n.op, x, w);
            w = 1;
            break;
          case Instr::Kind::Softmax:
            softmax_row(n.op, x, w);
            break;
          case Instr::Kind::GroupNorm:
            group_norm_row(n, x, w, b.wt, b.bs);
            break;
          case Instr::Kind::Pool:
            pool_row(n, x, w, tmp.data(), ins.width_out);
            std::copy(tmp.begin(), tmp.begin() + ins.width_out, row.begin());
            w = ins.width_out;
            break;
          case Instr::Kind::BatchNormApply:
            batch_norm_row(x, w, b.stats, b.wt, b.bs);
            break;
          case Instr::Kind::Save:
            std::copy(x, x + w, b.save + r * w);
            break;
        }
      }
      std::copy(x, x + w, out + r * st.width_out);
    }
  });
}

// Mean, invstd and biased var per column into buffer `output` ([3, w]); training updates the
// running state unless the run only computes (train_forward: RunArgs::update_state).
void run_column_stats(const Step& st, const Memory& mem) {
  const Node& n = st.node;
  const int64_t w = st.width_in, M = mem.plan.M;
  float* stats = mem.buffer(st.output);
  float* rm = state_ptr<float>(mem.args, n.running_mean);
  float* rv = state_ptr<float>(mem.args, n.running_var);

  if (st.input < 0) {  // eval BatchNorm: the running statistics
    if (!rm || !rv) throw std::invalid_argument("cpu executor: eval BatchNorm without running stats");
    running_stats_row(rm, rv, n.eps, w, stats);
    return;
  }

  const float* x = mem.buffer(st.input);
  // Sums of (x - x0) and (x - x0)^2 per column (x0: the first row's, BatchNormOp's shift),
  // in column chunks per thread; each chunk walks the rows (row-major, so stays in cache).
  std::vector<double> s1(static_cast<size_t>(w)), s2(static_cast<size_t>(w));
  const int64_t chunk = 256;
  parallel_for(chunks(w, chunk), M * w, Schedule::Static, [&](int64_t ci) {
    const int64_t c0 = ci * chunk, c1 = std::min(w, c0 + chunk);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = c0; c < c1; ++c) {
        const double d = static_cast<double>(x[r * w + c]) - x[c];
        s1[c] += d;
        s2[c] += d * d;
      }
  });
  std::vector<BatchNormOp::Stats> col(static_cast<size_t>(w));
  for (int64_t c = 0; c < w; ++c) {
    const double x0 = M > 0 ? x[c] : 0.0;  // an empty batch: NaN statistics, as PyTorch's
    col[c] = BatchNormOp::from_shifted_sums(x0, s1[c], s2[c], static_cast<double>(M));
    stats[c] = static_cast<float>(col[c].mean);
    stats[w + c] = BatchNormOp::invstd(col[c].var, n.eps);
    stats[2 * w + c] = static_cast<float>(col[c].var);
  }

  if (!n.training || !rm || !rv) return;  // eval without running stats: nothing to update
  if (!mem.args.update_state) return;     // a differentiable forward: update_running_stats does it
  int64_t* nb = state_ptr<int64_t>(mem.args, n.num_batches);
  if (nb) *nb += 1;
  double m = n.momentum;
  if (m < 0) {
    if (!nb) throw std::invalid_argument("cpu executor: momentum=none needs num_batches");
    m = 1.0 / static_cast<double>(*nb);
  }
  for (int64_t c = 0; c < w; ++c) {
    rm[c] = static_cast<float>(BatchNormOp::running_mean(rm[c], col[c].mean, m));
    rv[c] = static_cast<float>(BatchNormOp::running_var(rv[c], col[c].var, static_cast<double>(M), m));
  }
}

void run_gemm(const Step& st, const Memory& mem, const void* prepared) {
  const Plan& plan = mem.plan;
  const RunArgs& a = mem.args;
  const PreparedLayout lay(plan);
  const float* w = static_cast<const float*>(a.weight);
  const float* b = static_cast<const float*>(a.bias);
  if (plan.prep.fold_batchnorm) {
    if (!prepared) throw std::invalid_argument("cpu executor: plan needs prepared weights");
    w = at<float>(prepared, lay.w);
    b = at<float>(prepared, lay.b);
  }
  float* y = mem.buffer(st.output);
  if (a.cpu_gemm) a.cpu_gemm(plan.M, plan.N, plan.K, static_cast<const float*>(a.x), w, y);
  else cpu_gemm_blocked(plan.M, plan.N, plan.K, static_cast<const float*>(a.x), w, y);
  if (b) {
    parallel_for(plan.M, plan.M * plan.N, Schedule::Static, [&](int64_t r) {
      for (int64_t c = 0; c < plan.N; ++c) y[r * plan.N + c] += b[c];
    });
  }
}

void run_gemv(const Step& st, const Memory& mem, const void* prepared) {
  const Plan& plan = mem.plan;
  if (!prepared) throw std::invalid_argument("cpu executor: Gemv needs prepared column sums");
  const PreparedLayout lay(plan);
  const float* cs = at<float>(prepared, lay.colsum);
  const double sumb = *at<float>(prepared, lay.sumb);
  const float* x = static_cast<const float*>(mem.args.x);
  float* y = mem.buffer(st.output);
  const double scale = st.node.op == OpCode::Mean ? 1.0 / static_cast<double>(plan.N) : 1.0;
  const float* sign = at<float>(prepared, lay.colsign);
  parallel_for(plan.M, plan.M * plan.K, Schedule::Static, [&](int64_t r) {
    double s = 0;
    float nonfinite = 0.f;
    bool any_nonfinite = false;
    for (int64_t k = 0; k < plan.K; ++k) {
      const float xk = x[r * plan.K + k];
      s += static_cast<double>(xk) * cs[k];
      nonfinite += gemv_nonfinite_term(xk, sign[k]);
      any_nonfinite = any_nonfinite || !gf_isfinite(xk);
    }
    y[r] = any_nonfinite ? static_cast<float>(nonfinite * scale)
                         : static_cast<float>((s + sumb) * scale);
  });
}

// What the backward reads, copied out of the workspace: the value the GEMM (GEMV) produced,
// which the first row pass read from buffer 0, and each batch-statistics BatchNorm's stats.
void save_for_backward(const Plan& plan, const Memory& mem) {
  const BackwardPlan& bp = *mem.args.backward;
  float* saved = mem.args.saved;
  if (bp.saved.v >= 0) {
    const float* v = mem.buffer(0);
    std::copy(v, v + plan.M * bp.saved.v_cols, saved + bp.saved.v);
  }
  for (const auto& [node, off] : bp.saved.batch_stats) {
    const Instr& in = bp.program[node - bp.start];
    const int64_t w = in.width_in;
    const float* stats = mem.buffer(in.stats);
    std::copy(stats, stats + 3 * w, saved + off);
  }
}

}  // namespace

void cpu_gemm_blocked(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y) {
  // Blocks of W (kNB rows x kKB columns, 64 KB) stay in cache while a row of x sweeps them.
  constexpr int64_t kNB = 64, kKB = 256;
  parallel_for(M, M * N * K, Schedule::Static, [&](int64_t m) {
    float* yr = y + m * N;
    std::fill(yr, yr + N, 0.f);
    const float* xr = x + m * K;
    for (int64_t k0 = 0; k0 < K; k0 += kKB) {
      const int64_t k1 = std::min(K, k0 + kKB);
      for (int64_t n0 = 0; n0 < N; n0 += kNB) {
        const int64_t n1 = std::min(N, n0 + kNB);
        for (int64_t n = n0; n < n1; ++n) {
          const float* wr = w + n * K;
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 lanes: lets the compiler vectorize
          int64_t k = k0;
          for (; k + 8 <= k1; k += 8)
            for (int j = 0; j < 8; ++j) acc[j] += xr[k + j] * wr[k + j];
          float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
          for (; k < k1; ++k) s += xr[k] * wr[k];
          yr[n] += s;
        }
      }
    }
  });
}

size_t CpuExecutor::prepared_bytes(const Plan& plan) const { return PreparedLayout(plan).total; }

size_t CpuExecutor::workspace_bytes(const Plan& plan) const { return plan.buffers_bytes(); }

void CpuExecutor::prepare(const Plan& plan, const RunArgs& args, void* prepared) {
  const PreparedLayout lay(plan);
  if (lay.total == 0) return;
  const int64_t N = plan.N, K = plan.K;
  const float* w = static_cast<const float*>(args.weight);
  const float* b = static_cast<const float*>(args.bias);

  if (plan.prep.fold_batchnorm) {
    // W' = W*s[n], b' = (b - running_mean)*s + beta, s = gamma / sqrt(running_var + eps).
    const Node& bn = plan.prep.batchnorm;
    const float* rm = state_ptr<float>(args, bn.running_mean);
    const float* rv = state_ptr<float>(args, bn.running_var);
    if (!rm || !rv) throw std::invalid_argument("cpu executor: folded BatchNorm without running stats");
    const float* gamma = affine_ptr(args, bn.weight);
    const float* beta = affine_ptr(args, bn.bias);
    float* wf = at<float>(prepared, lay.w);
    float* bf = at<float>(prepared, lay.b);
    parallel_for(N, N * plan.K, Schedule::Static, [&](int64_t n) {
      const double s = (gamma ? gamma[n] : 1.0) / std::sqrt(static_cast<double>(rv[n]) + bn.eps);
      for (int64_t k = 0; k < K; ++k) wf[n * K + k] = static_cast<float>(w[n * K + k] * s);
      bf[n] = static_cast<float>(((b ? b[n] : 0.0) - rm[n]) * s + (beta ? beta[n] : 0.0));
    });
    w = wf;
    b = bf;
  }
  if (plan.prep.column_sums) {
    float* cs = at<float>(prepared, lay.colsum);
    parallel_for(chunks(K, 256), N * K, Schedule::Static, [&](int64_t ki) {
      const int64_t k0 = ki * 256, k1 = std::min(K, k0 + 256);
      std::vector<double> acc(static_cast<size_t>(k1 - k0), 0.0);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = k0; k < k1; ++k) acc[k - k0] += w[n * K + k];
      for (int64_t k = k0; k < k1; ++k) cs[k] = static_cast<float>(acc[k - k0]);
    });
    // Column signs, row by row through W (contiguous reads).
    std::vector<char> pos(static_cast<size_t>(K), 1), neg(static_cast<size_t>(K), 1);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        pos[k] &= w[n * K + k] > 0.f;
        neg[k] &= w[n * K + k] < 0.f;
      }
    float* sign = at<float>(prepared, lay.colsign);
    for (int64_t k = 0; k < K; ++k) sign[k] = pos[k] ? 1.f : (neg[k] ? -1.f : NAN);
    double sb = 0;
    if (b)
      for (int64_t n = 0; n < N; ++n) sb += b[n];
    *at<float>(prepared, lay.sumb) = static_cast<float>(sb);
  }
}

void CpuExecutor::run(const Plan& plan, const RunArgs& args, const void* prepared,
                      void* workspace) {
  if (plan.M == 0) return;
  const Memory mem{plan, args, workspace};
  for (const Step& st : plan.steps) {
    switch (st.kind) {
      case Step::Kind::Gemm: run_gemm(st, mem, prepared); break;
      case Step::Kind::Gemv: run_gemv(st, mem, prepared); break;
      case Step::Kind::RowPass: run_row_pass(st, mem); break;
      case Step::Kind::ColumnStats: run_column_stats(st, mem); break;
    }
  }
  if (args.saved) save_for_backward(plan, mem);
}


}  // namespace gemmfuse

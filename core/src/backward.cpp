// The backward plan (backward.h): the saved layout, the instructions the row backward runs,
// and where it is cut for column statistics.
#include "gemmfuse/backward.h"

#include <cstdio>
#include <sstream>
#include <string>

namespace gemmfuse {

namespace {

[[noreturn]] void unsupported(const std::string& why) { throw Unsupported(why); }

bool batch_statistics(const Node& n) {
  return n.training || !n.running_mean.present() || !n.running_var.present();
}

std::string mb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  return buf;
}

}  // namespace

BackwardPlan make_backward_plan(const Plan& fwd) {
  if (!fwd.for_training)
    throw std::logic_error("make_backward_plan: the forward plan was not made for training");
  BackwardPlan bp;
  const Chain& chain = fwd.chain;
  const int n = static_cast<int>(chain.nodes.size());
  bp.gemv = fwd.prep.column_sums;
  bp.start = bp.gemv ? 1 : 0;
  if (bp.gemv && chain.nodes[0].op == OpCode::Mean) bp.gemv_scale = 1.0 / double(fwd.N);

  // The row passes' instructions in node order (Save instructions are not stages).
  for (const Step& st : fwd.steps)
    for (const Instr& in : st.program)
      if (in.kind != Instr::Kind::Save) bp.program.push_back(in);
  if (static_cast<int>(bp.program.size()) != n - bp.start)
    unsupported("the backward needs one instruction per stage (" +
                std::to_string(bp.program.size()) + " for " + std::to_string(n - bp.start) + ")");
  for (int i = bp.start; i < n; ++i) {
    const Node& node = chain.nodes[i];
    if (family(node.op) == OpFamily::Dropout)
      unsupported("dropout has no backward here (it is removed before planning)");
    if (node.op == OpCode::BatchNorm && batch_statistics(node)) bp.batch_norms.push_back(i);
  }

  SavedLayout& s = bp.saved;
  if (bp.start < n) {
    s.v = 0;
    s.v_cols = chain.row_width(bp.start);
    s.total = fwd.M * s.v_cols;
  }
  for (int i : bp.batch_norms) {
    s.batch_stats[i] = s.total;
    s.total += 3 * chain.width_of(i);
  }
  return bp;
}

std::string BackwardPlan::describe(const Plan& fwd) const {
  std::ostringstream o;
  const double M = double(fwd.M), N = double(fwd.N), K = double(fwd.K);
  o << "backward:\n";
  if (saved.v >= 0)
    o << "  saved by the forward: v" << start << " [" << fwd.M << "x" << saved.v_cols
      << "] fp32 (" << mb(4.0 * M * saved.v_cols) << ")";
  else
    o << "  saved by the forward: nothing (no stage follows the " << (gemv ? "GEMV" : "GEMM") << ")";
  for (const auto& [node, off] : saved.batch_stats)
    o << "; v" << node + 1 << "'s batch mean, invstd, var";
  o << "\n";
  int step = 1;
  const int n = static_cast<int>(fwd.chain.nodes.size());
  int top = n;
  auto rows = [&](int lo, int hi) {
    std::string ops;
    for (int i = hi - 1; i >= lo; --i)
      ops += (ops.empty() ? "" : ", ") + std::string(op_name(fwd.chain.nodes[i].op));
    o << "  " << step++ << ". RowBackward   v" << hi << " -> v" << lo << ": " << ops
      << " (values recomputed from v" << start << ")\n";
  };
  for (auto it = batch_norms.rbegin(); it != batch_norms.rend(); ++it) {
    if (*it + 1 < top) rows(*it + 1, top);
    o << "  " << step++ << ". ColumnGradStats v" << *it + 1
      << " (BatchNorm): column sums of its gradient over " << fwd.M << " rows\n";
    top = *it + 1;
  }
  if (start < top) rows(start, top);
  if (gemv) {
    o << "  " << step++ << ". GemvBackward  dx = dv1 (x) colsum(W), dW = 1 (x) (dv1ᵀ x), db = Σ dv1"
      << (gemv_scale != 1.0 ? " (each / N)" : "") << "\n";
  } else {
    o << "  " << step++ << ". GemmDX        dx[" << fwd.M << "x" << fwd.K << "] = dY·W   "
      << 2 * M * N * K / 1e9 << " GFLOP (when x needs grad)\n";
    o << "  " << step++ << ". GemmDW        dW[" << fwd.N << "x" << fwd.K << "] = dYᵀ·x   "
      << 2 * M * N * K / 1e9 << " GFLOP\n";
    if (fwd.chain.has_bias) o << "  " << step++ << ". BiasGrad      db = Σ_rows dY\n";
  }
  return o.str();
}

}  // namespace gemmfuse

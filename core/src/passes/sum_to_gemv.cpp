// sum(x W^T + b, dim=-1) = x . colsum(W) + sum(b): one GEMV instead of a GEMM. The column
// sums depend on W only, so they are prepared once per weight version and stay right when
// the weights change (m18: the whole model is this GEMV).
#include "gemmfuse/passes.h"

namespace gemmfuse {

Rewrites sum_to_gemv(Chain& chain, WeightPrep& prep) {
  Rewrites out;
  if (prep.column_sums || chain.nodes.empty()) return out;
  const Node& n = chain.nodes[0];
  if (n.op != OpCode::Sum && n.op != OpCode::Mean) return out;
  if (value_referenced(chain, 0)) return out;  // the full Linear output is needed
  prep.column_sums = true;
  out.push_back("v1 = " + to_spec_line(n) + " of the Linear: GEMV with the column sums of W" +
                std::string(prep.fold_batchnorm ? " (after folding the BatchNorm)" : "") +
                (n.op == OpCode::Mean ? ", scaled by 1/N" : ""));
  return out;
}

}  // namespace gemmfuse

// An eval-mode BatchNorm right after the Linear is an affine map per output column, so it
// folds into the weights: W' = W*s[n], b' = (b - running_mean)*s + beta,
// s = gamma / sqrt(running_var + eps). The executors do the arithmetic once per weight
// version (the bindings key the preparation on the BatchNorm tensors' versions too).
#include "gemmfuse/passes.h"

namespace gemmfuse {

Rewrites fold_eval_batchnorm(Chain& chain, WeightPrep& prep) {
  Rewrites out;
  if (chain.nodes.empty() || prep.fold_batchnorm || prep.column_sums) return out;
  const Node n = chain.nodes[0];
  if (n.op != OpCode::BatchNorm || n.training) return out;
  // Without running stats an eval BatchNorm uses the batch statistics: not foldable.
  if (n.running_mean.kind != Operand::Kind::State || n.running_var.kind != Operand::Kind::State)
    return out;
  auto tensor_or_none = [](const Operand& o) {
    return !o.present() || o.kind == Operand::Kind::Tensor;
  };
  if (!tensor_or_none(n.weight) || !tensor_or_none(n.bias)) return out;
  if (value_referenced(chain, 0)) return out;  // someone reads the un-normalised Linear output
  out.push_back("v1 = " + to_spec_line(n) + ": eval BatchNorm folded into W and b (prepared)");
  prep.fold_batchnorm = true;
  prep.batchnorm = n;
  remove_node(chain, 0);  // readers of v1 read v0, which now is the normalised output
  return out;
}

}  // namespace gemmfuse

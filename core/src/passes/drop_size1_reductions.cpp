// Reductions and softmaxes over a last dim of size 1 (m18: sum -> max -> mean -> logsumexp
// -> logsumexp is just the sum). Each rewrite keeps NaN/inf exactly as PyTorch computes them:
//   sum/mean/max/min/logsumexp of one element x is x (logsumexp: shift 0 for +-inf, else x;
//   log(exp(x - x)) + x = x; NaN stays NaN);
//   softmax of one element is exp(x - x) / exp(x - x): 1, or NaN for +-inf/NaN = x*0 + 1;
//   log_softmax of one element is (x - x) - log(1) = x - x.
#include "gemmfuse/passes.h"

namespace gemmfuse {

namespace {

std::string where(int i, const Node& n) {
  return "v" + std::to_string(i + 1) + " = " + to_spec_line(n);
}

Node binary(OpCode op, Operand b) {
  Node n;
  n.op = op;
  n.b = b;
  return n;
}

}  // namespace

Rewrites drop_size1_reductions(Chain& chain) {
  Rewrites out;
  for (int i = 0; i < static_cast<int>(chain.nodes.size());) {
    const Node n = chain.nodes[i];  // a copy: the vector changes below
    // Input of node i is v<i>; only a real size-1 feature dim counts.
    const bool size1 = chain.has_feature_dim(i) && chain.width_of(i) == 1;
    if (!size1) { ++i; continue; }

    if (family(n.op) == OpFamily::Reduce) {
      if (n.keepdim) {
        out.push_back(where(i, n) + ": reduction over a size-1 dim is the identity: dropped");
        remove_node(chain, i);
        continue;
      }
      // keepdim=0: the size-1 dim must still disappear. If the node before made it with a
      // keepdim=1 reduction whose value nobody else reads, let that one drop the dim.
      if (i > 0 && family(chain.nodes[i - 1].op) == OpFamily::Reduce &&
          chain.nodes[i - 1].keepdim && !value_referenced(chain, i)) {
        out.push_back(where(i, n) + ": reduction over a size-1 dim is the identity: dropped, "
                      "v" + std::to_string(i) + " drops the dim instead (keepdim=0)");
        chain.nodes[i - 1].keepdim = false;
        remove_node(chain, i);
        continue;
      }
      ++i;  // kept: a width-1 reduction that drops the dim is cheap and exact
      continue;
    }
    if (n.op == OpCode::Softmax) {
      out.push_back(where(i, n) + ": softmax over a size-1 dim is x*0 + 1 (NaN for inf/NaN)");
      chain.nodes[i] = binary(OpCode::Mul, Operand::immediate(0.0));
      insert_node(chain, i + 1, binary(OpCode::Add, Operand::immediate(1.0)));
      i += 2;
      continue;
    }
    if (n.op == OpCode::LogSoftmax) {
      out.push_back(where(i, n) + ": log_softmax over a size-1 dim is x - x");
      chain.nodes[i] = binary(OpCode::Sub, Operand::value(i));
      ++i;
      continue;
    }
    ++i;
  }
  return out;
}

}  // namespace gemmfuse

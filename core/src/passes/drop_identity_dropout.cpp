// Dropout is the identity in eval mode and with p = 0 (PyTorch returns the input).
#include "gemmfuse/passes.h"

namespace gemmfuse {

Rewrites drop_identity_dropout(Chain& chain) {
  Rewrites out;
  for (int i = 0; i < static_cast<int>(chain.nodes.size());) {
    const Node& n = chain.nodes[i];
    if (n.op == OpCode::Dropout && (!n.training || n.p == 0.0)) {
      out.push_back("v" + std::to_string(i + 1) + " = " + to_spec_line(n) +
                    (n.training ? ": p = 0" : ": eval mode") + " is the identity: dropped");
      remove_node(chain, i);  // readers of its value read its input (the same values)
    } else {
      ++i;
    }
  }
  return out;
}

}  // namespace gemmfuse

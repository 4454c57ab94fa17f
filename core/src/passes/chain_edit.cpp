// The one place that renumbers value ids when a pass removes or inserts a node.
#include <stdexcept>
#include <string>

#include "gemmfuse/passes.h"

namespace gemmfuse {

namespace {

// Apply `f` to every operand field of a node that may hold a v<i>.
template <typename F>
void for_each_operand(Node& n, F f) {
  f(n.b);
  f(n.weight);
  f(n.bias);
  f(n.running_mean);
  f(n.running_var);
  f(n.num_batches);
}

template <typename F>
void for_each_operand(const Node& n, F f) {
  for_each_operand(const_cast<Node&>(n), [&](Operand& o) { f(static_cast<const Operand&>(o)); });
}

}  // namespace

bool value_referenced(const Chain& chain, int value_id) {
  bool found = false;
  for (const Node& n : chain.nodes)
    for_each_operand(n, [&](const Operand& o) {
      found |= o.kind == Operand::Kind::Value && o.index == value_id;
    });
  return found;
}

void remove_node(Chain& chain, int index) {
  if (index < 0 || index >= static_cast<int>(chain.nodes.size()))
    throw std::out_of_range("remove_node: no node " + std::to_string(index));
  chain.nodes.erase(chain.nodes.begin() + index);
  const int removed = index + 1;  // the value id that no longer exists
  for (size_t i = index; i < chain.nodes.size(); ++i)
    for_each_operand(chain.nodes[i], [&](Operand& o) {
      if (o.kind == Operand::Kind::Value && o.index >= removed) --o.index;
    });
}

void insert_node(Chain& chain, int index, const Node& node) {
  if (index < 0 || index > static_cast<int>(chain.nodes.size()))
    throw std::out_of_range("insert_node: bad position " + std::to_string(index));
  chain.nodes.insert(chain.nodes.begin() + index, node);
  for (size_t i = index + 1; i < chain.nodes.size(); ++i)
    for_each_operand(chain.nodes[i], [&](Operand& o) {
      if (o.kind == Operand::Kind::Value && o.index >= index) ++o.index;
    });
}

}  // namespace gemmfuse

// Scalar affine stages between the Linear and a sum or mean move past it, so that the sum
// meets the Linear and becomes a GEMV (sum_to_gemv): sum(a*v + c) = a*sum(v) + N*c, and
// mean(a*v + c) = a*mean(v) + c. Each stage keeps its order and its operation on the reduced
// value; an added or subtracted constant is multiplied by the row width N for a sum.
// Rounding moves (one product of the sum instead of N products summed), as the GEMV's own
// does; non-finite results stay where eager's come from the inputs. The scalars must be
// finite, a divisor nonzero, and N*c a finite float, so that no inf or NaN appears or
// disappears because of the reordering itself.
#include <cmath>
#include <limits>

#include "gemmfuse/passes.h"

namespace gemmfuse {

namespace {

bool finite_float_imm(const Operand& o) {
  return o.kind == Operand::Kind::Imm && std::isfinite(o.imm) &&
         std::fabs(o.imm) <= static_cast<double>(std::numeric_limits<float>::max());
}

// Whether node n is x -> a*x + c with immediates (it commutes with a sum as described above).
bool scalar_affine(const Node& n) {
  switch (n.op) {
    case OpCode::Neg:
      return true;
    case OpCode::Mul:
    case OpCode::Add:
    case OpCode::Sub:  // reversed: c - x, still affine
      return finite_float_imm(n.b);
    case OpCode::Div:  // x / a; a / x (reversed) is not affine
      return !n.reversed && finite_float_imm(n.b) && n.b.imm != 0.0;
    default:
      return false;
  }
}

// The index of the sum or mean that the scalar affine stages from nodes[0] lead to (-1: none),
// with none of v0 .. its input read elsewhere.
int reduction_after_scalars(const Chain& chain) {
  for (int i = 0; i < static_cast<int>(chain.nodes.size()); ++i) {
    if (value_referenced(chain, i)) return -1;
    const Node& n = chain.nodes[i];
    if (n.op == OpCode::Sum || n.op == OpCode::Mean) return i;
    if (!scalar_affine(n)) return -1;
  }
  return -1;
}

}  // namespace

Rewrites hoist_scalars_over_sum(Chain& chain) {
  Rewrites out;
  const int r = reduction_after_scalars(chain);
  if (r <= 0) return out;  // no reduction, or the sum already follows the Linear
  const Node reduction = chain.nodes[r];
  const double width = static_cast<double>(chain.width_of(r));
  std::vector<Node> scalars(chain.nodes.begin(), chain.nodes.begin() + r);
  for (Node& n : scalars) {
    const bool constant = n.op == OpCode::Add || n.op == OpCode::Sub;
    if (!constant || reduction.op == OpCode::Mean) continue;
    const double c = n.b.imm * width;
    if (!finite_float_imm(Operand::immediate(c))) return out;  // N*c would overflow a float
    n.b = Operand::immediate(c);
  }
  std::string moved;
  for (int i = 0; i < r; ++i) moved += (i ? ", " : "") + to_spec_line(chain.nodes[i]);
  chain.nodes[0] = reduction;
  for (int i = 0; i < r; ++i) chain.nodes[i + 1] = scalars[i];
  out.push_back(std::string(op_name(reduction.op)) + " moved before " + moved +
                ": scalar affine stages commute with it (a*" + op_name(reduction.op) +
                "(v) + " + (reduction.op == OpCode::Sum ? "N*c" : "c") + "), so the " +
                op_name(reduction.op) + " meets the Linear");
  return out;
}

}  // namespace gemmfuse

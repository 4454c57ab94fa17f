// Scalar arithmetic that folds without changing a single bit (m22: x*2 then x + x is x*4):
//   x + x == x * 2 exactly (both round the same exact value; inf/NaN alike);
//   (x * a) * b == x * (a*b) when a and b are powers of two >= 1 and a*b is a finite float:
//   scaling by a power of two >= 1 never rounds, and overflow to inf happens in both or
//   neither. Anything else (x*3*5, x/2/2 near subnormals, ...) may round differently: left.
#include <cmath>
#include <cstdio>
#include <limits>

#include "gemmfuse/passes.h"

namespace gemmfuse {

namespace {

bool pow2_at_least_1(const Operand& o) {
  if (o.kind != Operand::Kind::Imm) return false;
  const double v = o.imm;
  if (!(v >= 1.0) || !std::isfinite(v)) return false;
  if (static_cast<double>(static_cast<float>(v)) != v) return false;  // executors use fp32
  if (v > static_cast<double>(std::numeric_limits<float>::max())) return false;
  int e = 0;
  return std::frexp(v, &e) == 0.5;
}

bool is_mul_imm_pow2(const Node& n) { return n.op == OpCode::Mul && pow2_at_least_1(n.b); }

std::string num(double v) {  // finite here; the spec's number format
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

}  // namespace

Rewrites fold_scalar_chains(Chain& chain) {
  Rewrites out;
  bool changed = true;
  while (changed) {
    changed = false;
    for (int i = 0; i < static_cast<int>(chain.nodes.size()); ++i) {
      Node& n = chain.nodes[i];
      // x + x: the operand is this node's own input v<i>.
      if (n.op == OpCode::Add && n.b.kind == Operand::Kind::Value && n.b.index == i) {
        out.push_back("v" + std::to_string(i + 1) + " = " + to_spec_line(n) +
                      ": x + x is x * 2 (exact)");
        n.op = OpCode::Mul;
        n.b = Operand::immediate(2.0);
        n.reversed = false;
        changed = true;
      }
      if (i + 1 < static_cast<int>(chain.nodes.size()) && is_mul_imm_pow2(chain.nodes[i]) &&
          is_mul_imm_pow2(chain.nodes[i + 1]) && !value_referenced(chain, i + 1)) {
        const double a = chain.nodes[i].b.imm, b = chain.nodes[i + 1].b.imm;
        const double ab = a * b;  // exact in double: both powers of two
        if (ab > static_cast<double>(std::numeric_limits<float>::max())) continue;
        out.push_back("v" + std::to_string(i + 1) + ", v" + std::to_string(i + 2) + " = x * " +
                      num(a) + " * " + num(b) + " is x * " + num(ab) +
                      " (powers of two: exact in fp32)");
        chain.nodes[i].b = Operand::immediate(ab);
        chain.nodes[i].reversed = false;
        remove_node(chain, i + 1);  // nobody read the intermediate value
        changed = true;
      }
    }
  }
  return out;
}

}  // namespace gemmfuse

// Chain IR: a Linear(x[M,K], W[N,K], b[N]?) and the stages that follow it.
//
// The IR is built from a small text format (the "spec") that the Python capture emits and
// that round-trips through to_spec(). One line per stage:
//
//   linear in=<K> out=<N> bias=<0|1>          first line, always
//   <op> [key=value ...]                      one line per stage, in order
//
// Value ids: v0 is the Linear's output; the i-th stage line (1-based) produces v<i>.
// Operand syntax (the `b=` of binary ops, affine weights, BatchNorm state):
//   a number (`2.5`, `-inf`, `nan`)   an immediate scalar
//   t<i>                              operand tensor i (params, buffers, other inputs)
//   s<i>                              state tensor i (mutated in place: BatchNorm stats)
//   v<i>                              an earlier value of the chain
// See docs/chain-spec.md for every op and its keys.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gemmfuse/op_table.h"

namespace gemmfuse {

// Every op, from the op table (op_table.h).
enum class OpCode : uint8_t {
#define GF_OP_ENUM(code, name, family, cpu_scalar) code,
  GEMMFUSE_OPS(GF_OP_ENUM)
#undef GF_OP_ENUM
};

enum class OpFamily : uint8_t { Unary, Binary, Reduce, RowNorm, Pool, ColumnNorm, Dropout };

struct Operand {
  enum class Kind : uint8_t { None, Imm, Tensor, State, Value };
  Kind kind = Kind::None;
  double imm = 0.0;  // Kind::Imm
  int index = -1;    // Tensor: operand index; State: state index; Value: value id

  static Operand none() { return {}; }
  static Operand immediate(double v) { return {Kind::Imm, v, -1}; }
  static Operand tensor(int i) { return {Kind::Tensor, 0.0, i}; }
  static Operand state(int i) { return {Kind::State, 0.0, i}; }
  static Operand value(int i) { return {Kind::Value, 0.0, i}; }
  bool present() const { return kind != Kind::None; }
  bool operator==(const Operand& o) const {
    return kind == o.kind && index == o.index && (kind != Kind::Imm || imm == o.imm ||
                                                  (imm != imm && o.imm != o.imm));
  }
};

// One stage. Only the fields its op uses are meaningful. Which spec key sets which field, and
// the field's default in the spec, is the attribute schema (attributes.h).
struct Node {
  OpCode op = OpCode::Neg;

  // Binary ops.
  Operand b;
  bool reversed = false;  // b <op> x instead of x <op> b

  // Scalar attributes.
  double lo = -std::numeric_limits<double>::infinity();  // clamp lower bound (-inf: none)
  double hi = std::numeric_limits<double>::infinity();   // clamp upper bound (+inf: none)
  double alpha = 1.0;       // elu alpha; leaky_relu negative slope; pow exponent
  double beta = 1.0;        // softplus beta
  double threshold = 20.0;  // softplus threshold
  double eps = 1e-5;        // group/batch norm
  double momentum = 0.1;    // batch norm; negative means None (cumulative average)
  double p = 0.0;           // dropout probability

  // Integer attributes.
  int64_t groups = 1;                      // group norm
  int64_t kernel = 1, stride = 1, padding = 0;  // pooling
  bool keepdim = true;                     // reductions
  bool first_index = false;                // max/min: torch.max(x, dim).values, whose gradient
                                           // goes to the first extreme (amax splits it on ties)
  bool ceil_mode = false;                  // pooling
  bool count_include_pad = true;           // avg pooling
  bool training = false;                   // batch norm, dropout
  bool track_running_stats = true;         // batch norm

  // Affine parameters and running state.
  Operand weight, bias;                                 // group/batch norm (optional)
  Operand running_mean, running_var, num_batches;       // batch norm state (s<i>)
};

struct Chain {
  int64_t in_features = 0;   // K
  int64_t out_features = 0;  // N
  bool has_bias = false;
  std::vector<Node> nodes;   // v<i+1> is nodes[i]'s output

  // Width (size of the last dim) of value v; 0 when a reduction dropped the last dim.
  int64_t width_of(int value_id) const;
  // Whether value v still has the feature dim (false after a keepdim=false reduction).
  bool has_feature_dim(int value_id) const;
  // Row width of value v: its feature width, or 1 per row without a feature dim.
  int64_t row_width(int value_id) const { return has_feature_dim(value_id) ? width_of(value_id) : 1; }
  int64_t output_width() const { return width_of(static_cast<int>(nodes.size())); }
  bool output_has_feature_dim() const { return has_feature_dim(static_cast<int>(nodes.size())); }
};

// Output width of an avg_pool/max_pool node over `width` columns, by PyTorch's formula
// (floor or ceil of (width + 2*padding - kernel) / stride, plus 1; with ceil_mode the last
// window must start inside the input or its left padding). <= 0 when PyTorch would reject it.
int64_t pool_output_width(int64_t width, const Node& pool);

OpFamily family(OpCode op);
const char* op_name(OpCode op);               // the spec's name
bool op_from_name(const std::string& name, OpCode* out);
// The CPU executor computes the op with scalar library calls (op_table.h's cpu_scalar).
bool cpu_scalar(OpCode op);
// The op table as text, one op a line: "<name> <family>" (for the Python capture's check).
std::string op_table_text();

// Parse the spec text (lines end in a newline or a semicolon); throws std::invalid_argument
// with a message naming the line.
Chain parse_chain(const std::string& spec);
// Print a chain back to spec text (parse_chain(to_spec(c)) == c).
std::string to_spec(const Chain& chain);
// One node as a spec line (without the newline).
std::string to_spec_line(const Node& node);

}  // namespace gemmfuse

// The attribute schema (attributes.h): each op's spec keys, their types, members, defaults,
// required keys and printing. A new op with attributes needs rows here and nothing in spec.cpp.
#include "gemmfuse/attributes.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace gemmfuse {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A key of each type: its name, the Node member it sets and its default (`value`).
constexpr Attribute number(const char* key, double Node::*member, double value) {
  Attribute a{key, AttrType::Number};
  a.number = member;
  a.default_value = value;
  return a;
}

// A number >= 0 or `none` (stored as -1; printed for any negative value).
constexpr Attribute number_or_none(const char* key, double Node::*member, double value) {
  Attribute a = number(key, member, value);
  a.type = AttrType::NumberOrNone;
  return a;
}

constexpr Attribute integer(const char* key, int64_t Node::*member, int64_t value) {
  Attribute a{key, AttrType::Integer};
  a.integer = member;
  a.default_value = static_cast<double>(value);
  return a;
}

constexpr Attribute boolean(const char* key, bool Node::*member, bool value) {
  Attribute a{key, AttrType::Bool};
  a.boolean = member;
  a.default_value = value ? 1.0 : 0.0;
  return a;
}

constexpr Attribute operand(const char* key, Operand Node::*member) {
  Attribute a{key, AttrType::Operand};
  a.operand = member;
  return a;
}

// ---- the schema: the keys of a family (printed first), then those of one op ---------------

struct FamilyKeys {
  OpFamily family;
  std::vector<Attribute> keys;
};

struct OpKeys {
  OpCode op;
  std::vector<Attribute> keys;
};

// Function-local tables: built on first use, whatever the order of static initialisation.
const std::vector<FamilyKeys>& family_keys() {
  static const std::vector<FamilyKeys> rows = {
      {OpFamily::Binary,
       {operand("b", &Node::b).required("binary op needs b="),
        boolean("rev", &Node::reversed, false)}},
      {OpFamily::Reduce, {boolean("keepdim", &Node::keepdim, true)}},
      {OpFamily::Pool,
       {integer("kernel", &Node::kernel, 1).required("pooling needs kernel="),
        integer("stride", &Node::stride, 1).defaults_to(&Node::kernel),
        integer("padding", &Node::padding, 0), boolean("ceil", &Node::ceil_mode, false)}},
  };
  return rows;
}

const std::vector<OpKeys>& op_keys() {
  static const std::vector<OpKeys> rows = {
      {OpCode::Softplus,
       {number("beta", &Node::beta, 1.0), number("threshold", &Node::threshold, 20.0)}},
      {OpCode::Elu, {number("alpha", &Node::alpha, 1.0)}},
      {OpCode::LeakyRelu, {number("alpha", &Node::alpha, 0.01)}},  // the negative slope
      {OpCode::Clamp, {number("lo", &Node::lo, -kInf), number("hi", &Node::hi, kInf)}},
      {OpCode::Pow,
       {number("alpha", &Node::alpha, 1.0).required("pow needs alpha= (the exponent)")}},
      // index=1: torch.max(x, dim).values, whose gradient goes to the first extreme.
      {OpCode::Max, {boolean("index", &Node::first_index, false)}},
      {OpCode::Min, {boolean("index", &Node::first_index, false)}},
      {OpCode::GroupNorm,
       {integer("groups", &Node::groups, 1), number("eps", &Node::eps, 1e-5),
        operand("weight", &Node::weight), operand("bias", &Node::bias)}},
      {OpCode::AvgPool, {boolean("include_pad", &Node::count_include_pad, true)}},
      {OpCode::BatchNorm,
       {boolean("training", &Node::training, false).printed_always(),
        number("eps", &Node::eps, 1e-5), number_or_none("momentum", &Node::momentum, 0.1),
        operand("weight", &Node::weight), operand("bias", &Node::bias),
        operand("running_mean", &Node::running_mean),
        operand("running_var", &Node::running_var),
        operand("num_batches", &Node::num_batches)}},
      {OpCode::Dropout,
       {number("p", &Node::p, 0.5).printed_always(),
        boolean("training", &Node::training, false).printed_always()}},
  };
  return rows;
}

constexpr int kOpCount = 0
#define GF_OP_COUNT(code, name, family, cpu_scalar) +1
    GEMMFUSE_OPS(GF_OP_COUNT)
#undef GF_OP_COUNT
    ;

// Every op's keys, indexed by OpCode.
std::vector<std::vector<Attribute>> build_schema() {
  std::vector<std::vector<Attribute>> schema(kOpCount);
  for (int i = 0; i < kOpCount; ++i) {
    const OpCode op = static_cast<OpCode>(i);
    std::vector<Attribute>& keys = schema[i];
    for (const FamilyKeys& row : family_keys())
      if (row.family == family(op)) keys.insert(keys.end(), row.keys.begin(), row.keys.end());
    for (const OpKeys& row : op_keys())
      if (row.op == op) keys.insert(keys.end(), row.keys.begin(), row.keys.end());
  }
  return schema;
}

// The default of an Integer key in node `n`.
int64_t integer_default(const Node& n, const Attribute& a) {
  return a.default_from ? n.*a.default_from : static_cast<int64_t>(a.default_value);
}

}  // namespace

const std::vector<Attribute>& attributes(OpCode op) {
  static const std::vector<std::vector<Attribute>> schema = build_schema();
  return schema.at(static_cast<size_t>(op));
}

const Attribute* find_attribute(OpCode op, const std::string& key) {
  for (const Attribute& a : attributes(op))
    if (key == a.key) return &a;
  return nullptr;
}

bool has_default_value(const Node& n, const Attribute& a) {
  switch (a.type) {
    case AttrType::Number:
    case AttrType::NumberOrNone: {
      const double v = n.*a.number;
      return v == a.default_value || (v != v && a.default_value != a.default_value);
    }
    case AttrType::Integer: return n.*a.integer == integer_default(n, a);
    case AttrType::Bool: return n.*a.boolean == (a.default_value != 0.0);
    case AttrType::Operand: return !(n.*a.operand).present();
  }
  throw std::logic_error("attribute schema: bad type of key " + std::string(a.key));
}

void set_default_value(Node& n, const Attribute& a) {
  switch (a.type) {
    case AttrType::Number:
    case AttrType::NumberOrNone: n.*a.number = a.default_value; return;
    case AttrType::Integer: n.*a.integer = integer_default(n, a); return;
    case AttrType::Bool: n.*a.boolean = a.default_value != 0.0; return;
    case AttrType::Operand: n.*a.operand = Operand::none(); return;
  }
}

void derive_unkeyed_fields(Node& n) {
  if (n.op == OpCode::BatchNorm) n.track_running_stats = n.running_mean.present();
}

Node default_node(OpCode op) {
  Node n;
  n.op = op;
  for (const Attribute& a : attributes(op)) set_default_value(n, a);
  derive_unkeyed_fields(n);
  return n;
}

}  // namespace gemmfuse

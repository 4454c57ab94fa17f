// The chain spec: text <-> Chain IR (docs/chain-spec.md), op names and families, and the
// shape rules of the IR (width_of / has_feature_dim). Each op's keys come from the attribute
// schema (attributes.h): parsing and printing a stage are loops over it.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemmfuse/attributes.h"
#include "gemmfuse/chain.h"

namespace gemmfuse {

namespace {

struct OpInfo {
  OpCode op;
  const char* name;
  OpFamily family;
  bool cpu_scalar;
};

constexpr OpInfo kOps[] = {
#define GF_OP_INFO(code, name, fam, scalar) {OpCode::code, name, OpFamily::fam, scalar},
    GEMMFUSE_OPS(GF_OP_INFO)
#undef GF_OP_INFO
};

const OpInfo& info(OpCode op) {
  const auto i = static_cast<size_t>(op);
  if (i >= sizeof(kOps) / sizeof(kOps[0]) || kOps[i].op != op)
    throw std::logic_error("op table: OpCode " + std::to_string(i) + " out of order");
  return kOps[i];
}

// ---- printing -------------------------------------------------------------------------

std::string fmt_number(double v) {
  if (std::isnan(v)) return "nan";  // printf may say "-nan"; the spec has one spelling
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string fmt_int(int64_t v) { return std::to_string(v); }

std::string fmt_operand(const Operand& o) {
  switch (o.kind) {
    case Operand::Kind::Imm: return fmt_number(o.imm);
    case Operand::Kind::Tensor: return "t" + std::to_string(o.index);
    case Operand::Kind::State: return "s" + std::to_string(o.index);
    case Operand::Kind::Value: return "v" + std::to_string(o.index);
    case Operand::Kind::None: break;
  }
  return "";
}

// Key `a`'s value in node `n` as the spec spells it.
std::string format_value(const Node& n, const Attribute& a) {
  switch (a.type) {
    case AttrType::Number: return fmt_number(n.*a.number);
    case AttrType::NumberOrNone: return n.*a.number < 0 ? "none" : fmt_number(n.*a.number);
    case AttrType::Integer: return fmt_int(n.*a.integer);
    case AttrType::Bool: return n.*a.boolean ? "1" : "0";
    case AttrType::Operand: return fmt_operand(n.*a.operand);
  }
  return "";
}

// ---- parsing --------------------------------------------------------------------------

[[noreturn]] void fail(int line_no, const std::string& line, const std::string& why) {
  throw std::invalid_argument("chain spec line " + std::to_string(line_no) + " (`" + line +
                              "`): " + why);
}

struct LineCtx {
  int line_no;
  const std::string& text;
  [[noreturn]] void fail(const std::string& why) const { gemmfuse::fail(line_no, text, why); }
};

double parse_number(const std::string& s, const LineCtx& ctx, const std::string& key) {
  if (s.empty()) ctx.fail("key '" + key + "' has no value");
  const char* begin = s.c_str();
  char* end = nullptr;
  const double v = std::strtod(begin, &end);
  if (end != begin + s.size()) ctx.fail("key '" + key + "': '" + s + "' is not a number");
  return v;
}

int64_t parse_int(const std::string& s, const LineCtx& ctx, const std::string& key) {
  if (s.empty()) ctx.fail("key '" + key + "' has no value");
  const char* begin = s.c_str();
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(begin, &end, 10);
  if (end != begin + s.size() || errno != 0)
    ctx.fail("key '" + key + "': '" + s + "' is not an integer");
  return static_cast<int64_t>(v);
}

bool parse_bool(const std::string& s, const LineCtx& ctx, const std::string& key) {
  if (s == "0") return false;
  if (s == "1") return true;
  ctx.fail("key '" + key + "': '" + s + "' is not 0 or 1");
}

// A number, t<i>, s<i> or v<i>. `max_value` is the largest value id this line may read.
Operand parse_operand(const std::string& s, const LineCtx& ctx, const std::string& key,
                      int max_value) {
  if (s.size() >= 2 && (s[0] == 't' || s[0] == 's' || s[0] == 'v') &&
      std::isdigit(static_cast<unsigned char>(s[1]))) {
    const int64_t i = parse_int(s.substr(1), ctx, key);
    if (i < 0 || i > (1 << 30)) ctx.fail("key '" + key + "': index out of range in '" + s + "'");
    if (s[0] == 't') return Operand::tensor(static_cast<int>(i));
    if (s[0] == 's') return Operand::state(static_cast<int>(i));
    if (i > max_value)
      ctx.fail("key '" + key + "': " + s + " is not an earlier value (this line reads v0..v" +
               std::to_string(max_value) + ")");
    return Operand::value(static_cast<int>(i));
  }
  return Operand::immediate(parse_number(s, ctx, key));
}

// A number >= 0, or `none` (-1).
double parse_number_or_none(const std::string& s, const LineCtx& ctx, const std::string& key) {
  if (s == "none") return -1.0;
  const double v = parse_number(s, ctx, key);
  if (!(v >= 0)) ctx.fail(key + " must be >= 0 or none");
  return v;
}

// Apply one key=value to a node of op `n.op`; fails for a key outside the op's schema.
void apply_key(Node& n, const std::string& key, const std::string& val, const LineCtx& ctx,
               int max_value) {
  const Attribute* a = find_attribute(n.op, key);
  if (!a) ctx.fail(std::string("unknown key '") + key + "' for " + op_name(n.op));
  switch (a->type) {
    case AttrType::Number: n.*a->number = parse_number(val, ctx, key); return;
    case AttrType::NumberOrNone: n.*a->number = parse_number_or_none(val, ctx, key); return;
    case AttrType::Integer: n.*a->integer = parse_int(val, ctx, key); return;
    case AttrType::Bool: n.*a->boolean = parse_bool(val, ctx, key); return;
    case AttrType::Operand: n.*a->operand = parse_operand(val, ctx, key, max_value); return;
  }
}

// Split "a b=c  d=e" into whitespace-separated tokens.
std::vector<std::string> tokens(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  std::string t;
  while (in >> t) out.push_back(t);
  return out;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

using KeyValues = std::vector<std::pair<std::string, std::string>>;

// The key=value tokens after the first, each key once.
KeyValues key_values(const std::vector<std::string>& tok, const LineCtx& ctx) {
  KeyValues kv;
  for (size_t i = 1; i < tok.size(); ++i) {
    const auto eq = tok[i].find('=');
    if (eq == std::string::npos || eq == 0) ctx.fail("expected key=value, got '" + tok[i] + "'");
    std::string key = tok[i].substr(0, eq);
    for (const auto& e : kv)
      if (e.first == key) ctx.fail("key '" + key + "' given twice");
    kv.emplace_back(std::move(key), tok[i].substr(eq + 1));
  }
  return kv;
}

bool has_key(const KeyValues& kv, const char* key) {
  return std::any_of(kv.begin(), kv.end(), [&](const auto& e) { return e.first == key; });
}

// The first line: `linear in=K out=N bias=0/1`.
void parse_linear(const std::string& name, const KeyValues& kv, const LineCtx& ctx,
                  Chain& chain) {
  if (name != "linear") ctx.fail("the first line must be `linear in=K out=N bias=0/1`");
  for (const auto& [key, val] : kv) {
    if (key == "in") chain.in_features = parse_int(val, ctx, key);
    else if (key == "out") chain.out_features = parse_int(val, ctx, key);
    else if (key == "bias") chain.has_bias = parse_bool(val, ctx, key);
    else ctx.fail("unknown key '" + key + "' for linear");
  }
  if (!has_key(kv, "in") || !has_key(kv, "out")) ctx.fail("linear needs in= and out=");
  if (chain.in_features < 0 || chain.out_features < 0) ctx.fail("negative feature count");
}

// A stage line: its keys, then the schema's defaults for the keys it leaves out (a required
// one is an error). `max_value` is the largest value id the line may read (its input).
Node parse_node(const std::string& name, const KeyValues& kv, const LineCtx& ctx,
                int max_value) {
  Node n;
  if (name == "linear") ctx.fail("only the first line may be linear");
  if (!op_from_name(name, &n.op)) ctx.fail("unknown op '" + name + "'");
  for (const auto& [key, val] : kv) apply_key(n, key, val, ctx, max_value);
  for (const Attribute& a : attributes(n.op)) {
    if (has_key(kv, a.key)) continue;
    if (a.missing_error) ctx.fail(a.missing_error);
    set_default_value(n, a);
  }
  derive_unkeyed_fields(n);
  return n;
}

}  // namespace

// ---- names and families -----------------------------------------------------------------

OpFamily family(OpCode op) { return info(op).family; }

const char* op_name(OpCode op) { return info(op).name; }

bool cpu_scalar(OpCode op) { return info(op).cpu_scalar; }

std::string op_table_text() {
  static const char* kFamilies[] = {"unary", "binary", "reduce", "row_norm", "pool",
                                    "column_norm", "dropout"};
  std::string s;
  for (const OpInfo& o : kOps)
    s += std::string(o.name) + " " + kFamilies[static_cast<int>(o.family)] + "\n";
  return s;
}

bool op_from_name(const std::string& name, OpCode* out) {
  for (const auto& o : kOps)
    if (name == o.name) {
      if (out) *out = o.op;
      return true;
    }
  return false;
}

// ---- shapes ---------------------------------------------------------------------------

int64_t pool_output_width(int64_t width, const Node& pool) {
  // PyTorch's pooling_output_shape with dilation 1.
  const int64_t k = pool.kernel, s = pool.stride, p = pool.padding;
  if (k <= 0 || s <= 0) return 0;
  const int64_t span = width + 2 * p - k;
  if (span < 0) return 0;
  int64_t out = (pool.ceil_mode ? (span + s - 1) / s : span / s) + 1;
  // With ceil_mode the last window must start inside the input or the left padding.
  if (pool.ceil_mode && (out - 1) * s >= width + p) --out;
  return out;
}

int64_t Chain::width_of(int value_id) const {
  if (value_id < 0 || value_id > static_cast<int>(nodes.size()))
    throw std::out_of_range("width_of: no value v" + std::to_string(value_id));
  int64_t w = out_features;
  bool feature = true;
  for (int i = 0; i < value_id; ++i) {
    const Node& n = nodes[i];
    switch (family(n.op)) {
      case OpFamily::Reduce:
        if (feature) {
          w = n.keepdim ? 1 : 0;
          feature = n.keepdim;
        }
        break;
      case OpFamily::Pool:
        if (feature) w = pool_output_width(w, n);
        break;
      default:
        break;
    }
  }
  return feature ? w : 0;
}

bool Chain::has_feature_dim(int value_id) const {
  if (value_id < 0 || value_id > static_cast<int>(nodes.size()))
    throw std::out_of_range("has_feature_dim: no value v" + std::to_string(value_id));
  for (int i = 0; i < value_id; ++i)
    if (family(nodes[i].op) == OpFamily::Reduce && !nodes[i].keepdim) return false;
  return true;
}

// ---- the spec -------------------------------------------------------------------------

Chain parse_chain(const std::string& spec) {
  Chain chain;
  // ';' separates lines too: the one-line form travels inside generated code (Inductor
  // quotes op arguments into comments line by line, where a newline would end the comment).
  std::string text = spec;
  std::replace(text.begin(), text.end(), ';', '\n');
  std::istringstream in(text);
  std::string raw;
  int line_no = 0;
  bool have_linear = false;
  while (std::getline(in, raw)) {
    ++line_no;
    const std::string line = trim(raw);
    if (line.empty()) continue;
    const LineCtx ctx{line_no, line};
    const std::vector<std::string> tok = tokens(line);
    const KeyValues kv = key_values(tok, ctx);
    if (have_linear) {
      chain.nodes.push_back(parse_node(tok[0], kv, ctx, static_cast<int>(chain.nodes.size())));
    } else {
      parse_linear(tok[0], kv, ctx, chain);
      have_linear = true;
    }
  }
  if (!have_linear) throw std::invalid_argument("chain spec: empty (expected a linear line)");
  return chain;
}

// The op's keys in schema order: those printed always, the others when not at their default.
std::string to_spec_line(const Node& n) {
  std::string s = op_name(n.op);
  for (const Attribute& a : attributes(n.op))
    if (a.print == AttrPrint::Always || !has_default_value(n, a))
      s += std::string(" ") + a.key + "=" + format_value(n, a);
  return s;
}

std::string to_spec(const Chain& chain) {
  std::string s = "linear in=" + fmt_int(chain.in_features) + " out=" +
                  fmt_int(chain.out_features) + " bias=" + (chain.has_bias ? "1" : "0") + "\n";
  for (const Node& n : chain.nodes) s += to_spec_line(n) + "\n";
  return s;
}

}  // namespace gemmfuse

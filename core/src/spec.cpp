// The chain spec: text <-> Chain IR (docs/chain-spec.md), op names and families, and the
// shape rules of the IR (width_of / has_feature_dim).
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

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

constexpr double kInf = std::numeric_limits<double>::infinity();

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

// Same value, with NaN equal to NaN (defaults are never NaN, but keep printing exact).
bool same(double a, double b) { return a == b || (a != a && b != b); }

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

// Apply one key=value to a node of op `n.op`; fails for a key the op does not take.
void apply_key(Node& n, const std::string& key, const std::string& val, const LineCtx& ctx,
               int max_value) {
  const OpFamily fam = family(n.op);
  auto num = [&] { return parse_number(val, ctx, key); };
  auto integer = [&] { return parse_int(val, ctx, key); };
  auto boolean = [&] { return parse_bool(val, ctx, key); };
  auto operand = [&] { return parse_operand(val, ctx, key, max_value); };
  switch (n.op) {
    case OpCode::Softplus:
      if (key == "beta") { n.beta = num(); return; }
      if (key == "threshold") { n.threshold = num(); return; }
      break;
    case OpCode::Elu:
    case OpCode::LeakyRelu:
    case OpCode::Pow:
      if (key == "alpha") { n.alpha = num(); return; }
      break;
    case OpCode::Clamp:
      if (key == "lo") { n.lo = num(); return; }
      if (key == "hi") { n.hi = num(); return; }
      break;
    case OpCode::GroupNorm:
      if (key == "groups") { n.groups = integer(); return; }
      if (key == "eps") { n.eps = num(); return; }
      if (key == "weight") { n.weight = operand(); return; }
      if (key == "bias") { n.bias = operand(); return; }
      break;
    case OpCode::AvgPool:
    case OpCode::MaxPool:
      if (key == "kernel") { n.kernel = integer(); return; }
      if (key == "stride") { n.stride = integer(); return; }
      if (key == "padding") { n.padding = integer(); return; }
      if (key == "ceil") { n.ceil_mode = boolean(); return; }
      if (key == "include_pad" && n.op == OpCode::AvgPool) { n.count_include_pad = boolean(); return; }
      break;
    case OpCode::BatchNorm:
      if (key == "training") { n.training = boolean(); return; }
      if (key == "eps") { n.eps = num(); return; }
      if (key == "momentum") {
        if (val == "none") { n.momentum = -1.0; return; }
        n.momentum = num();
        if (!(n.momentum >= 0)) ctx.fail("momentum must be >= 0 or none");
        return;
      }
      if (key == "weight") { n.weight = operand(); return; }
      if (key == "bias") { n.bias = operand(); return; }
      if (key == "running_mean") { n.running_mean = operand(); return; }
      if (key == "running_var") { n.running_var = operand(); return; }
      if (key == "num_batches") { n.num_batches = operand(); return; }
      break;
    case OpCode::Dropout:
      if (key == "p") { n.p = num(); return; }
      if (key == "training") { n.training = boolean(); return; }
      break;
    default:
      if (fam == OpFamily::Binary) {
        if (key == "b") { n.b = operand(); return; }
        if (key == "rev") { n.reversed = boolean(); return; }
      }
      if (fam == OpFamily::Reduce && key == "keepdim") { n.keepdim = boolean(); return; }
      if ((n.op == OpCode::Max || n.op == OpCode::Min) && key == "index") {
        n.first_index = boolean();
        return;
      }
      break;
  }
  ctx.fail(std::string("unknown key '") + key + "' for " + op_name(n.op));
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

    // key=value pairs, each key once.
    std::vector<std::pair<std::string, std::string>> kv;
    for (size_t i = 1; i < tok.size(); ++i) {
      const auto eq = tok[i].find('=');
      if (eq == std::string::npos || eq == 0) ctx.fail("expected key=value, got '" + tok[i] + "'");
      std::string key = tok[i].substr(0, eq);
      for (const auto& e : kv)
        if (e.first == key) ctx.fail("key '" + key + "' given twice");
      kv.emplace_back(std::move(key), tok[i].substr(eq + 1));
    }

    if (!have_linear) {
      if (tok[0] != "linear") ctx.fail("the first line must be `linear in=K out=N bias=0/1`");
      bool got_in = false, got_out = false;
      for (const auto& [key, val] : kv) {
        if (key == "in") { chain.in_features = parse_int(val, ctx, key); got_in = true; }
        else if (key == "out") { chain.out_features = parse_int(val, ctx, key); got_out = true; }
        else if (key == "bias") chain.has_bias = parse_bool(val, ctx, key);
        else ctx.fail("unknown key '" + key + "' for linear");
      }
      if (!got_in || !got_out) ctx.fail("linear needs in= and out=");
      if (chain.in_features < 0 || chain.out_features < 0) ctx.fail("negative feature count");
      have_linear = true;
      continue;
    }

    Node n;
    if (tok[0] == "linear") ctx.fail("only the first line may be linear");
    if (!op_from_name(tok[0], &n.op)) ctx.fail("unknown op '" + tok[0] + "'");
    if (n.op == OpCode::LeakyRelu) n.alpha = 0.01;  // the spec's default slope
    if (n.op == OpCode::Dropout) n.p = 0.5;
    const int max_value = static_cast<int>(chain.nodes.size());  // this line's input
    bool got_b = false, got_kernel = false, got_stride = false, got_alpha = false;
    for (const auto& [key, val] : kv) {
      apply_key(n, key, val, ctx, max_value);
      got_b |= key == "b";
      got_kernel |= key == "kernel";
      got_stride |= key == "stride";
      got_alpha |= key == "alpha";
    }
    if (family(n.op) == OpFamily::Binary && !got_b) ctx.fail("binary op needs b=");
    if (n.op == OpCode::Pow && !got_alpha) ctx.fail("pow needs alpha= (the exponent)");
    if (family(n.op) == OpFamily::Pool) {
      if (!got_kernel) ctx.fail("pooling needs kernel=");
      if (!got_stride) n.stride = n.kernel;
    }
    if (n.op == OpCode::BatchNorm) n.track_running_stats = n.running_mean.present();
    chain.nodes.push_back(n);
  }
  if (!have_linear) throw std::invalid_argument("chain spec: empty (expected a linear line)");
  return chain;
}

std::string to_spec_line(const Node& n) {
  const Node d = [&] {  // the defaults parse_chain starts from
    Node x;
    x.op = n.op;
    if (n.op == OpCode::LeakyRelu) x.alpha = 0.01;
    if (n.op == OpCode::Dropout) x.p = 0.5;
    return x;
  }();
  std::string s = op_name(n.op);
  auto put = [&](const char* key, const std::string& val) {
    s += ' ';
    s += key;
    s += '=';
    s += val;
  };
  auto put_num = [&](const char* key, double v, double dv, bool always = false) {
    if (always || !same(v, dv)) put(key, fmt_number(v));
  };
  auto put_operand = [&](const char* key, const Operand& o) {
    if (o.present()) put(key, fmt_operand(o));
  };
  switch (n.op) {
    case OpCode::Softplus:
      put_num("beta", n.beta, d.beta);
      put_num("threshold", n.threshold, d.threshold);
      break;
    case OpCode::Elu: case OpCode::LeakyRelu:
      put_num("alpha", n.alpha, d.alpha);
      break;
    case OpCode::Pow:
      put_num("alpha", n.alpha, d.alpha, true);
      break;
    case OpCode::Clamp:
      put_num("lo", n.lo, -kInf);
      put_num("hi", n.hi, kInf);
      break;
    case OpCode::GroupNorm:
      if (n.groups != 1) put("groups", fmt_int(n.groups));
      put_num("eps", n.eps, d.eps);
      put_operand("weight", n.weight);
      put_operand("bias", n.bias);
      break;
    case OpCode::AvgPool: case OpCode::MaxPool:
      put("kernel", fmt_int(n.kernel));
      if (n.stride != n.kernel) put("stride", fmt_int(n.stride));
      if (n.padding != 0) put("padding", fmt_int(n.padding));
      if (n.ceil_mode) put("ceil", "1");
      if (n.op == OpCode::AvgPool && !n.count_include_pad) put("include_pad", "0");
      break;
    case OpCode::BatchNorm:
      put("training", n.training ? "1" : "0");
      put_num("eps", n.eps, d.eps);
      if (n.momentum < 0) put("momentum", "none");
      else put_num("momentum", n.momentum, d.momentum);
      put_operand("weight", n.weight);
      put_operand("bias", n.bias);
      put_operand("running_mean", n.running_mean);
      put_operand("running_var", n.running_var);
      put_operand("num_batches", n.num_batches);
      break;
    case OpCode::Dropout:
      put_num("p", n.p, d.p, true);
      put("training", n.training ? "1" : "0");
      break;
    default:
      if (family(n.op) == OpFamily::Binary) {
        put("b", fmt_operand(n.b));
        if (n.reversed) put("rev", "1");
      }
      if (family(n.op) == OpFamily::Reduce && !n.keepdim) put("keepdim", "0");
      if (n.first_index) put("index", "1");
      break;
  }
  return s;
}

std::string to_spec(const Chain& chain) {
  std::string s = "linear in=" + fmt_int(chain.in_features) + " out=" +
                  fmt_int(chain.out_features) + " bias=" + (chain.has_bias ? "1" : "0") + "\n";
  for (const Node& n : chain.nodes) s += to_spec_line(n) + "\n";
  return s;
}

}  // namespace gemmfuse

// The planner: validate a captured chain against the call's shapes, simplify it, and cut it
// into steps (Gemm|Gemv, then row passes, with ColumnStats where a BatchNorm needs the
// statistics of all rows). See plan.h for the plan format and docs/design.md for why.
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemmfuse/passes.h"
#include "gemmfuse/plan.h"

namespace gemmfuse {

// ---- names ---------------------------------------------------------------------------

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::F16: return "fp16";
  }
  return "?";
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::FP32: return "fp32";
    case Precision::Fast: return "fast";
    case Precision::TF32: return "tf32";
  }
  return "?";
}

bool precision_from_name(const std::string& s, Precision* out) {
  for (Precision p : {Precision::FP32, Precision::Fast, Precision::TF32})
    if (s == precision_name(p)) {
      if (out) *out = p;
      return true;
    }
  return false;
}

bool dtype_from_name(const std::string& s, DType* out) {
  for (DType d : {DType::F32, DType::BF16, DType::F16})
    if (s == dtype_name(d)) {
      if (out) *out = d;
      return true;
    }
  return false;
}

// ---- buffers and printing ----------------------------------------------------------------

namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
size_t buffer_bytes(const BufferSpec& b) {
  return align_up(static_cast<size_t>(b.rows) * static_cast<size_t>(b.cols) * sizeof(float));
}

std::string fmt_quantity(double v, const char* unit) {
  static const char* prefixes[] = {"", "K", "M", "G", "T"};
  int p = 0;
  while (v >= 1000.0 && p < 4) {
    v /= 1000.0;
    ++p;
  }
  char buf[48];
  if (p == 0) std::snprintf(buf, sizeof buf, "%.0f %s", v, unit);
  else std::snprintf(buf, sizeof buf, "%.1f %s%s", v, prefixes[p], unit);
  return buf;
}

const char* step_kind_name(Step::Kind k) {
  switch (k) {
    case Step::Kind::Gemm: return "Gemm";
    case Step::Kind::Gemv: return "Gemv";
    case Step::Kind::RowPass: return "RowPass";
    case Step::Kind::ColumnStats: return "ColumnStats";
  }
  return "?";
}

}  // namespace

size_t Plan::buffer_offset(int i) const {
  if (i < 0 || i > static_cast<int>(buffers.size()))
    throw std::out_of_range("buffer_offset: no buffer " + std::to_string(i));
  size_t off = 0;
  for (int j = 0; j < i; ++j) off += buffer_bytes(buffers[j]);
  return off;
}

size_t Plan::buffers_bytes() const { return buffer_offset(static_cast<int>(buffers.size())); }

std::string Plan::describe() const {
  std::ostringstream s;
  if (!pytorch_faster.empty()) s << "route: runs in PyTorch, which is faster here: " << pytorch_faster << "\n";
  for (const std::string& r : rewrites) s << "rewrite: " << r << "\n";
  if (prep.column_sums || prep.fold_batchnorm) {
    s << "prepare (once per weight version):";
    if (prep.fold_batchnorm) s << " eval BatchNorm folded into W and b;";
    if (prep.column_sums) s << " column sums of W" << (prep.fold_batchnorm ? "'" : "") << ";";
    s << "\n";
  }
  int no = 1;
  for (const Step& st : steps) {
    char head[32];
    std::snprintf(head, sizeof head, "%d. %-11s ", no++, step_kind_name(st.kind));
    s << head << st.summary;
    if (st.kind == Step::Kind::Gemm || st.kind == Step::Kind::Gemv)
      s << "   " << fmt_quantity(st.flops, "FLOP");
    s << "  " << fmt_quantity(st.bytes, "B") << "\n";
  }
  return s.str();
}

// ---- validation ------------------------------------------------------------------------

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

[[noreturn]] void unsupported(const std::string& why) { throw Unsupported(why); }
[[noreturn]] void invalid(const std::string& why) { throw std::invalid_argument(why); }

// Everything the planner knows about the call, and the shape rules built on it.
struct Context {
  const PlanRequest& req;
  const Chain& chain;
  int64_t M;

  // Shape of value v (batch dims, then the feature dim when it has one).
  std::vector<int64_t> value_shape(int v) const {
    std::vector<int64_t> s = req.batch_sizes;
    if (chain.has_feature_dim(v)) s.push_back(chain.width_of(v));
    return s;
  }
  int64_t row_width(int v) const { return chain.row_width(v); }
  std::string where(int node) const {
    return "v" + std::to_string(node + 1) + " = " + to_spec_line(chain.nodes[node]);
  }
  const std::vector<int64_t>& tensor_shape(const Operand& o, int node) const {
    if (o.index < 0 || o.index >= static_cast<int>(req.operand_sizes.size()))
      invalid(where(node) + ": operand t" + std::to_string(o.index) + " was not passed (" +
              std::to_string(req.operand_sizes.size()) + " operands)");
    return req.operand_sizes[o.index];
  }

  // How a binary op's tensor operand meets value v (the node's input). Unsupported unless it
  // is a scalar, per column, per row, or the value's full shape (docs/chain-spec.md).
  OperandRef resolve_tensor(const Operand& o, int node) const {
    const int v = node;
    const std::vector<int64_t>& s = tensor_shape(o, node);
    const std::vector<int64_t> vs = value_shape(v);
    const bool feat = chain.has_feature_dim(v);
    const int64_t w = chain.width_of(v);
    OperandRef r;
    r.index = o.index;
    auto fail = [&]() -> OperandRef {
      unsupported(where(node) + ": operand t" + std::to_string(o.index) + " of shape " +
                  shape_str(s) + " does not broadcast as a scalar, per column, per row or "
                  "elementwise against " + shape_str(vs));
    };
    if (s.size() > vs.size()) return fail();  // broadcasting would add dims to the output
    if (numel(s) == 1) { r.kind = OperandRef::Kind::Scalar; return r; }
    if (s == vs) {
      r.kind = feat ? OperandRef::Kind::Full : OperandRef::Kind::Row;
      return r;
    }
    if (feat) {
      // [W], [1,W], [1,1,W]: per column.
      bool col = !s.empty() && s.back() == w;
      for (size_t i = 0; i + 1 < s.size(); ++i) col &= s[i] == 1;
      if (col) { r.kind = OperandRef::Kind::Col; return r; }
      // batch dims then 1: per row.
      std::vector<int64_t> row = req.batch_sizes;
      row.push_back(1);
      if (s == row) { r.kind = OperandRef::Kind::Row; return r; }
    }
    return fail();
  }

  // Affine weight/bias of a norm: absent or a tensor of `w` elements.
  OperandRef resolve_affine(const Operand& o, int node, const char* key, int64_t w) const {
    OperandRef r;
    if (!o.present()) return r;
    if (o.kind != Operand::Kind::Tensor)
      unsupported(where(node) + ": " + key + " must be an operand tensor t<i>");
    const std::vector<int64_t>& s = tensor_shape(o, node);
    if (numel(s) != w)
      invalid(where(node) + ": " + key + " has shape " + shape_str(s) + ", expected [" +
              std::to_string(w) + "]");
    r.kind = OperandRef::Kind::Col;
    r.index = o.index;
    return r;
  }

  // Whether a BatchNorm normalises with the batch statistics (PyTorch: training, or no
  // running stats to use).
  static bool batch_stats(const Node& n) {
    return n.training || !n.running_mean.present() || !n.running_var.present();
  }

  void validate_node(int i) const {
    const Node& n = chain.nodes[i];
    const OpFamily fam = family(n.op);
    const bool needs_feature = fam == OpFamily::Reduce || fam == OpFamily::RowNorm ||
                               fam == OpFamily::Pool || fam == OpFamily::ColumnNorm;
    if (needs_feature && !chain.has_feature_dim(i))
      unsupported(where(i) + ": needs a feature dim, but a keepdim=0 reduction dropped it");
    switch (fam) {
      case OpFamily::Dropout: validate_dropout(i, n); break;
      case OpFamily::Binary: validate_binary_operand(i, n); break;
      case OpFamily::RowNorm:
        if (n.op == OpCode::GroupNorm) validate_group_norm(i, n);
        break;
      case OpFamily::Pool: validate_pool(i, n); break;
      case OpFamily::ColumnNorm: validate_batch_norm(i, n); break;
      case OpFamily::Unary:
      case OpFamily::Reduce:
        break;  // any value of their width
    }
  }

  void validate_dropout(int i, const Node& n) const {
    if (!(n.p >= 0.0 && n.p <= 1.0))
      invalid(where(i) + ": dropout probability has to be between 0 and 1");
    if (n.training && n.p > 0.0) unsupported("dropout in training mode is random: runs in PyTorch");
  }

  void validate_binary_operand(int i, const Node& n) const {
    switch (n.b.kind) {
      case Operand::Kind::Imm: return;
      case Operand::Kind::Tensor: resolve_tensor(n.b, i); return;
      case Operand::Kind::Value: {
        const int j = n.b.index;
        if (j > i) invalid(where(i) + ": v" + std::to_string(j) + " is not an earlier value");
        const bool feat = chain.has_feature_dim(i), fj = chain.has_feature_dim(j);
        const int64_t w = chain.width_of(i), wj = chain.width_of(j);
        const bool fits = (feat && fj && (wj == w || wj == 1)) || (!feat && !fj);
        if (!fits)
          unsupported(where(i) + ": v" + std::to_string(j) + " of shape " +
                      shape_str(value_shape(j)) + " does not broadcast into " +
                      shape_str(value_shape(i)) + " without changing its shape");
        return;
      }
      default:
        unsupported(where(i) + ": the operand of a binary op must be a number, t<i> or v<i>");
    }
  }

  void validate_group_norm(int i, const Node& n) const {
    const int64_t w = chain.width_of(i);
    if (n.groups <= 0 || w % n.groups != 0)
      unsupported(where(i) + ": " + std::to_string(n.groups) + " groups do not divide the width " +
                  std::to_string(w));
    if (n.groups > 1 && req.batch_sizes.size() != 1)
      unsupported(where(i) + ": GroupNorm on a " + std::to_string(req.batch_sizes.size() + 1) +
                  "-d input normalises dim 1, not the last dim");
    resolve_affine(n.weight, i, "weight", w);
    resolve_affine(n.bias, i, "bias", w);
  }

  void validate_pool(int i, const Node& n) const {
    const int64_t w = chain.width_of(i);
    if (n.kernel <= 0 || n.stride <= 0 || n.padding < 0)
      invalid(where(i) + ": kernel and stride must be positive, padding non-negative");
    if (n.padding > n.kernel / 2)
      invalid(where(i) + ": pad should be at most half of effective kernel size");
    if (pool_output_width(w, n) <= 0)
      invalid(where(i) + ": output size is too small for input width " + std::to_string(w));
  }

  void validate_batch_norm(int i, const Node& n) const {
    const int64_t w = chain.width_of(i);
    if (req.batch_sizes.size() != 1)
      unsupported(where(i) + ": BatchNorm1d on a " + std::to_string(req.batch_sizes.size() + 1) +
                  "-d input does not normalise the last dim over the rows");
    const bool rm = n.running_mean.present(), rv = n.running_var.present();
    if (rm != rv) invalid(where(i) + ": running_mean and running_var come together");
    for (const Operand* o : {&n.running_mean, &n.running_var, &n.num_batches})
      if (o->present() && o->kind != Operand::Kind::State)
        unsupported(where(i) + ": running statistics must be state tensors s<i>");
    if (n.training && rm && n.momentum < 0 && !n.num_batches.present())
      unsupported(where(i) + ": momentum=none needs num_batches");
    resolve_affine(n.weight, i, "weight", w);
    resolve_affine(n.bias, i, "bias", w);
    if (batch_stats(n) && M == 1)
      invalid("Expected more than 1 value per channel when training, got input size [1, " +
              std::to_string(w) + "]");
  }
};

// ---- building the steps -----------------------------------------------------------------

std::string operand_text(const Node& n) {
  switch (n.b.kind) {
    case Operand::Kind::Imm: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%g", n.b.imm);
      return buf;
    }
    case Operand::Kind::Tensor: return "t" + std::to_string(n.b.index);
    case Operand::Kind::Value: return "v" + std::to_string(n.b.index);
    default: return "?";
  }
}

std::string instr_text(const Instr& in, const std::vector<BufferSpec>& buffers) {
  const Node& n = in.node;
  switch (in.kind) {
    case Instr::Kind::Save: return "save→" + buffers[in.buffer].name;
    case Instr::Kind::GroupNorm: return "group_norm(" + std::to_string(n.groups) + ")";
    case Instr::Kind::Pool:
      return std::string(op_name(n.op)) + "(" + std::to_string(in.width_in) + "→" +
             std::to_string(in.width_out) + ")";
    case Instr::Kind::Pointwise:
      if (family(n.op) == OpFamily::Binary)
        return std::string(op_name(n.op)) + (n.reversed ? "(rev " : "(") + operand_text(n) + ")";
      return op_name(n.op);
    default: return op_name(n.op);
  }
}

class Builder {
 public:
  Builder(Plan& plan, const Context& ctx) : plan_(plan), ctx_(ctx), chain_(plan.chain) {
    ds_ = plan.dtype == DType::F32 ? 4.0 : 2.0;
    for (int v = 0; v <= static_cast<int>(chain_.nodes.size()); ++v)
      if (value_referenced(chain_, v)) referenced_.insert(v);
  }

  void build() {
    const bool gemv = plan_.prep.column_sums;
    const int start = gemv ? 1 : 0;  // the value the GEMM/GEMV produces
    const int last = static_cast<int>(chain_.nodes.size());
    const double M = static_cast<double>(plan_.M), N = static_cast<double>(plan_.N),
                 K = static_cast<double>(plan_.K);

    Step g;
    g.kind = gemv ? Step::Kind::Gemv : Step::Kind::Gemm;
    g.width_in = plan_.K;
    g.width_out = ctx_.row_width(start);
    if (start == last) {
      g.output = kOutput;  // nothing follows: write the output directly
    } else {
      g.output = add_buffer("Y", plan_.M, g.width_out);
      value_buffer_[start] = g.output;
    }
    const std::string out_name = g.output == kOutput ? "out" : "Y";
    const char* prec = plan_.dtype == DType::F32 ? precision_name(plan_.precision)
                                                  : dtype_name(plan_.dtype);
    const double out_bytes = M * g.width_out * (g.output == kOutput ? ds_ : 4.0);
    if (gemv) {
      g.node = chain_.nodes[0];
      g.summary = "[" + dim(plan_.M) + "x" + dim(plan_.K) + "]·colsum(W" +
                  (plan_.prep.fold_batchnorm ? "'" : "") + ")[" + dim(plan_.K) + "]" +
                  (chain_.has_bias ? " + Σb" : "") +
                  (g.node.op == OpCode::Mean ? ", /" + dim(plan_.N) : "") + " " + prec +
                  " → " + out_name;
      g.flops = 2 * M * K;
      g.bytes = M * K * ds_ + K * 4.0 + out_bytes;
    } else {
      g.summary = "[" + dim(plan_.M) + "x" + dim(plan_.K) + "]·[" + dim(plan_.N) + "x" +
                  dim(plan_.K) + "]ᵀ" + (plan_.prep.fold_batchnorm ? "(BN folded)" : "") +
                  " " + prec + " → " + out_name;
      g.flops = 2 * M * N * K;
      g.bytes = M * K * ds_ + N * K * ds_ + (chain_.has_bias ? N * ds_ : 0.0) + out_bytes;
    }
    plan_.steps.push_back(g);
    if (start == last) return;

    begin_pass(value_buffer_[start], start);
    for (int i = start; i < last; ++i) {
      save_if_read(i);
      const Node& n = chain_.nodes[i];
      if (n.op == OpCode::BatchNorm) {
        batch_norm(i);
        continue;
      }
      pass_.program.push_back(instr(i));
    }
    end_pass(/*to_output=*/true, last);
  }

 private:
  static std::string dim(int64_t v) { return std::to_string(v); }

  int add_buffer(const std::string& name, int64_t rows, int64_t cols) {
    plan_.buffers.push_back({name, rows, cols});
    return static_cast<int>(plan_.buffers.size()) - 1;
  }

  void begin_pass(int input, int value) {
    pass_ = Step();
    pass_.kind = Step::Kind::RowPass;
    pass_.input = input;
    pass_.width_in = ctx_.row_width(value);
  }

  // Close the open row pass; it writes the output tensor, or a new buffer holding v<value>.
  void end_pass(bool to_output, int value) {
    const double M = static_cast<double>(plan_.M);
    int output = kOutput;
    if (!to_output) {
      output = add_buffer("v" + std::to_string(value), plan_.M, ctx_.row_width(value));
      value_buffer_[value] = output;
    }
    Step& s = pass_;
    s.output = output;
    s.width_out = ctx_.row_width(value);
    s.bytes = M * s.width_in * 4.0 + M * s.width_out * (output == kOutput ? ds_ : 4.0);
    std::string ops;
    for (const Instr& in : s.program) {
      s.bytes += operand_bytes(in.b, in.width_in) + operand_bytes(in.weight, in.width_in) +
                 operand_bytes(in.bias, in.width_in);
      if (in.kind == Instr::Kind::Save) s.bytes += M * in.width_in * 4.0;
      if (in.kind == Instr::Kind::BatchNormApply) s.bytes += 2.0 * in.width_in * 4.0;
      s.flops += M * in.width_in * flops_per_element(in);
      ops += (ops.empty() ? "" : ", ") + instr_text(in, plan_.buffers);
    }
    if (ops.empty()) ops = "copy";
    s.summary = plan_.buffers[s.input].name + " → " +
                (output == kOutput ? std::string("out") : plan_.buffers[output].name) + ": " + ops;
    plan_.steps.push_back(s);
  }

  double operand_bytes(const OperandRef& r, int64_t width) const {
    const double M = static_cast<double>(plan_.M);
    switch (r.kind) {
      case OperandRef::Kind::Col: return width * 4.0;
      case OperandRef::Kind::Row: return M * 4.0;
      case OperandRef::Kind::Full: return M * width * 4.0;
      case OperandRef::Kind::Buffer: return M * r.cols * 4.0;
      case OperandRef::Kind::Scalar: return 4.0;
      default: return 0.0;
    }
  }

  static double flops_per_element(const Instr& in) {
    switch (in.kind) {
      case Instr::Kind::Pointwise: return 1;
      case Instr::Kind::Reduce: return in.node.op == OpCode::LogSumExp ? 3 : 1;
      case Instr::Kind::Softmax: return 4;
      case Instr::Kind::GroupNorm: return 5;
      case Instr::Kind::Pool: return 1;
      case Instr::Kind::BatchNormApply: return 4;
      case Instr::Kind::Save: return 0;
    }
    return 0;
  }

  // v<v> is about to be consumed by node v; if someone reads it through an operand and it
  // is not intact in a buffer already, store it now.
  void save_if_read(int v) {
    if (!referenced_.count(v) || value_buffer_.count(v)) return;
    Instr s;
    s.kind = Instr::Kind::Save;
    s.width_in = s.width_out = ctx_.row_width(v);
    s.buffer = add_buffer("v" + std::to_string(v), plan_.M, s.width_in);
    value_buffer_[v] = s.buffer;
    pass_.program.push_back(s);
  }

  Instr instr(int i) const {
    const Node& n = chain_.nodes[i];
    Instr in;
    in.node = n;
    in.width_in = ctx_.row_width(i);
    in.width_out = ctx_.row_width(i + 1);
    switch (family(n.op)) {
      case OpFamily::Unary: in.kind = Instr::Kind::Pointwise; break;
      case OpFamily::Binary:
        in.kind = Instr::Kind::Pointwise;
        in.b = binary_operand(i);
        break;
      case OpFamily::Reduce: in.kind = Instr::Kind::Reduce; break;
      case OpFamily::RowNorm:
        if (n.op == OpCode::GroupNorm) {
          in.kind = Instr::Kind::GroupNorm;
          in.weight = ctx_.resolve_affine(n.weight, i, "weight", in.width_in);
          in.bias = ctx_.resolve_affine(n.bias, i, "bias", in.width_in);
        } else {
          in.kind = Instr::Kind::Softmax;
        }
        break;
      case OpFamily::Pool: in.kind = Instr::Kind::Pool; break;
      default:
        // Dropout is gone (identity) or refused; BatchNorm is handled by batch_norm().
        unsupported(ctx_.where(i) + ": unexpected stage in a row program");
    }
    return in;
  }

  OperandRef binary_operand(int i) const {
    const Node& n = chain_.nodes[i];
    OperandRef r;
    switch (n.b.kind) {
      case Operand::Kind::Imm:
        r.kind = OperandRef::Kind::Imm;
        r.imm = static_cast<float>(n.b.imm);
        return r;
      case Operand::Kind::Tensor: return ctx_.resolve_tensor(n.b, i);
      case Operand::Kind::Value: {
        const int j = n.b.index;
        r.kind = OperandRef::Kind::Buffer;
        r.index = value_buffer_.at(j);  // saved by save_if_read (or a pass input)
        r.cols = ctx_.row_width(j);
        return r;
      }
      default: unsupported(ctx_.where(i) + ": bad operand");
    }
  }

  // BatchNorm at node i. With batch statistics: close the pass (its output holds v<i>),
  // ColumnStats over it, then a new pass starting with the apply. With running statistics
  // (eval, not folded): a ColumnStats step with input -1 turns the running stats into the
  // same [3, width] stats buffer; it reads no rows, so the pass is not cut.
  void batch_norm(int i) {
    const Node& n = chain_.nodes[i];
    const int64_t w = ctx_.row_width(i);
    const double M = static_cast<double>(plan_.M);
    Step cs;
    cs.kind = Step::Kind::ColumnStats;
    cs.node = n;
    cs.width_in = cs.width_out = w;
    const bool batch = Context::batch_stats(n);
    if (batch) {
      if (!pass_.program.empty()) end_pass(/*to_output=*/false, i);
      // With an empty pass the buffer it would read (Y or an earlier cut) holds v<i> already.
      cs.input = value_buffer_.at(i);
    }
    cs.output = add_buffer("bn" + std::to_string(i + 1), 3, w);  // mean, invstd, var
    if (batch) {
      const bool update = n.training && n.running_mean.present();
      cs.summary = plan_.buffers[cs.input].name + " → " + plan_.buffers[cs.output].name +
                   ": batch mean, invstd over " + dim(plan_.M) + " rows" +
                   (update ? "; running stats updated" : "");
      cs.bytes = M * w * 4.0 + 2.0 * w * 4.0 + (update ? 4.0 * w * 4.0 : 0.0);
      cs.flops = 3.0 * M * w;
    } else {
      cs.summary = "running stats → " + plan_.buffers[cs.output].name + ": mean, invstd (eval)";
      cs.bytes = 4.0 * w * 4.0;
      cs.flops = 3.0 * w;
    }
    plan_.steps.push_back(cs);
    if (batch) begin_pass(cs.input, i);  // the rows continue from v<i>

    Instr in;
    in.kind = Instr::Kind::BatchNormApply;
    in.node = n;
    in.width_in = in.width_out = w;
    in.stats = cs.output;
    in.weight = ctx_.resolve_affine(n.weight, i, "weight", w);
    in.bias = ctx_.resolve_affine(n.bias, i, "bias", w);
    pass_.program.push_back(in);
  }

  Plan& plan_;
  const Context& ctx_;
  const Chain& chain_;
  double ds_ = 4.0;                 // bytes per element of x, W, b and the output
  std::set<int> referenced_;        // values read through v<i> operands
  std::map<int, int> value_buffer_; // value id -> buffer holding it intact
  Step pass_;                       // the row pass being built
};

// Why PyTorch runs the plan's chain faster than the plan on the CPU, or "" where it does not.
// The CPU GEMM is PyTorch's own BLAS call, so fusing saves only passes over a result that
// stays in cache, unless a rewrite removes the GEMM (the GEMV); and ops the row loops compute
// by scalar library calls (op_table.h's cpu_scalar) take several times PyTorch's vectorized
// kernels' time per element
// (docs/measurements.md, "Planner rules and the measurements they rest on").
std::string cpu_pytorch_faster(const Plan& plan) {
  if (plan.prep.column_sums) return "";
  if (plan.dtype != DType::F32)
    return std::string("on the CPU gemmfuse computes a ") + dtype_name(plan.dtype) +
           " model's GEMM in fp32, at about half the rate of PyTorch's " +
           dtype_name(plan.dtype) + " GEMM";
  for (const Step& st : plan.steps)
    for (const Instr& in : st.program)
      if (in.kind != Instr::Kind::Save && cpu_scalar(in.node.op))
        return std::string("on the CPU the row pass computes ") + op_name(in.node.op) +
               " one element at a time, several times slower than PyTorch's vectorized kernel";
  return "";
}

// Why `fast` (fp32 data) runs this plan's GEMM in fp32 instead, or "".
// `fast` splits x and W into bf16 parts to run the GEMM on tensor cores. With few rows the
// GEMM is bound by reading W once, which the split makes larger, and fp32 is then as fast
// or faster and more accurate; with little work in all (req.fast_min_flops) the split path is
// bound by its launches; with a long sum (kFastMaxK) its error passes fast's promise.
// Training with `fast`: the derivatives of clamps, max, ReLU-like and other piecewise ops
// switch on the forward's values, so a value within fast's GEMM error of a kink takes the
// other branch's derivative, and the gradient's error grows far past fp32's. fp32's GEMM
// holds them; on sm90 it runs at about fast's speed.
// (docs/measurements.md, "Planner rules and the measurements they rest on").
std::string fast_runs_in_fp32(const Plan& plan, const PlanRequest& req) {
  if (req.for_training)
    return "fast while training: the GEMMs run in fp32, since derivatives of piecewise ops "
           "(clamp, max, ReLU-like) switch on the forward's values and fast's GEMM error would "
           "flip some of them";
  if (plan.prep.column_sums) return "";
  const int64_t M = plan.M;
  const double flops = 2.0 * double(M) * double(plan.N) * double(plan.K);
  if (M <= req.fast_min_rows)
    return "fast with M = " + std::to_string(M) + " <= " + std::to_string(req.fast_min_rows) +
           " rows: fp32's GEMM is as fast or faster there (bound by reading W, or split-K on the "
           "f16x3 kernel) and more accurate";
  if (flops < req.fast_min_flops) {
    char gflop[32];
    std::snprintf(gflop, sizeof gflop, "%.2f", flops * 1e-9);
    return std::string("fast with a GEMM of ") + gflop +
           " GFLOP: the split's launches and host work would outweigh it, so it runs in fp32 "
           "(faster there, more accurate)";
  }
  if (plan.K > kFastMaxK)
    return "fast with K = " + std::to_string(plan.K) + " > " + std::to_string(kFastMaxK) +
           ": the bf16 split's error grows with K and would pass fast's 1e-4 promise, so the "
           "GEMM runs in fp32";
  return "";
}

}  // namespace

Plan make_plan(const PlanRequest& req) {
  Plan plan;
  int64_t M = 1;
  for (int64_t b : req.batch_sizes) {
    if (b < 0) invalid("negative batch size");
    M *= b;
  }
  plan.M = M;
  plan.K = req.chain.in_features;
  plan.N = req.chain.out_features;
  plan.dtype = req.dtype;
  plan.precision = req.precision;
  plan.device = req.device;
  if (plan.K <= 0 || plan.N <= 0) unsupported("a Linear with zero in or out features");

  // Validate the chain as captured: the checks speak about the user's stages.
  {
    const Context ctx{req, req.chain, M};
    for (int i = 0; i < static_cast<int>(req.chain.nodes.size()); ++i) ctx.validate_node(i);
  }

  plan.chain = req.chain;
  plan.for_training = req.for_training;
  plan.rewrites = req.simplify ? simplify(plan.chain, plan.prep, req.for_training)
                               : drop_identity_dropout(plan.chain);
  if (plan.precision == Precision::Fast && plan.dtype == DType::F32) {
    std::string why = fast_runs_in_fp32(plan, req);
    if (!why.empty()) {
      plan.precision = Precision::FP32;
      plan.rewrites.push_back(std::move(why));
    }
  }
  plan.out_width = plan.chain.output_width();
  plan.out_has_feature_dim = plan.chain.output_has_feature_dim();
  if (!plan.out_has_feature_dim) plan.out_width = 1;  // one value per row

  const Context ctx{req, plan.chain, M};
  Builder(plan, ctx).build();
  if (plan.device == Device::CPU) plan.pytorch_faster = cpu_pytorch_faster(plan);
  // 16-bit training on CUDA: the fused backward (its row pass in fp32, dV converted for
  // cuBLAS's 16-bit GEMMs, the scratch it reads and writes) costs more than the GEMMs' time it
  // shares with eager (docs/measurements.md,
  // "Planner rules and the measurements they rest on").
  else if (plan.for_training && plan.dtype != DType::F32)
    plan.pytorch_faster = std::string("while autograd records, a ") + dtype_name(plan.dtype) +
                          " model's fused forward and backward run slower than eager " +
                          dtype_name(plan.dtype) + "'s (0.53-0.84x on an H100 at the seed shapes)";
  return plan;
}

}  // namespace gemmfuse

// The CUDA backward's row stage (backward_stages.h): dV from the output's gradient, and the
// gradients of the chain's operands. The chain's stages become the row backward's
// instructions (row_backward.h's BwInstr) bound to the call's tensors; the row backward runs
// by segments top down, cut at batch-statistics BatchNorms, each segment followed by the
// column sums the segment below reads; last, the operands' sinks are summed over the slots.
// Stream-ordered, no host sync.
#include <stdexcept>
#include <vector>

#include "backward_stages.h"
#include "batch_norm_op.h"
#include "cuda_check.h"
#include "row_backward.h"

namespace gemmfuse::cuda {
namespace {

// An eval BatchNorm's running statistics as the row backward reads them: [3, w] mean, invstd, var.
__global__ void running_to_stats_kernel(const float* rm, const float* rv, int64_t w, float eps,
                                        float* stats) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= w) return;
  stats[c] = rm[c];
  stats[w + c] = BatchNormOp::invstd(rv[c], eps);
  stats[2 * w + c] = rv[c];
}

// The call's operand tensor `o` names (nullptr for none).
const float* operand_of(const BackwardCall& c, const OperandRef& o) {
  return o.kind == OperandRef::Kind::None ? nullptr : c.a.operands.at(o.index);
}

// Where the row backward adds the gradient of operand `o`: its sink where the layout has one
// (summed over the slots at the end), else the gradient itself; nullptr where none is asked for.
float* gradient_of(const BackwardCall& c, const OperandRef& o) {
  if (o.kind == OperandRef::Kind::None || !c.a.grad_operands.at(o.index)) return nullptr;
  auto it = c.L.sinks.find(o.index);
  return it != c.L.sinks.end() ? c.at(it->second) : c.a.grad_operands[o.index];
}

// A pointwise stage; a binary one's other operand: a value (v<j>), an immediate or a tensor.
void encode_pointwise(const BackwardCall& c, const Instr& in, BwInstr& d) {
  const Node& nd = in.node;
  d.kind = kBwPointwise;
  if (family(nd.op) != OpFamily::Binary) return;
  d.flags |= kBwBinary | (nd.reversed ? kBwReversed : 0);
  if (nd.b.kind == Operand::Kind::Value) {
    d.opnd = kBwValue;
    d.value = nd.b.index - c.bp.start;
    if (d.value < 0) throw Unsupported("CUDA backward: a stage reads a value before the GEMM's");
    return;
  }
  switch (in.b.kind) {
    case OperandRef::Kind::Imm: d.opnd = kBwImm; d.imm = in.b.imm; break;
    case OperandRef::Kind::Scalar: d.opnd = kBwScalar; break;
    case OperandRef::Kind::Col: d.opnd = kBwCol; break;
    case OperandRef::Kind::Row: d.opnd = kBwRow; break;
    case OperandRef::Kind::Full: d.opnd = kBwFull; break;
    default: throw Unsupported("CUDA backward: operand kind");
  }
  if (d.opnd != kBwImm) {
    d.b = operand_of(c, in.b);
    d.b_grad = gradient_of(c, in.b);
  }
}

// BatchNorm node i: with batch statistics, the ones the forward saved; in eval, the running
// statistics as [3, w] in the scratch (launched here), and its affine parameters' gradients.
void encode_batch_norm(const BackwardCall& c, int i, const Instr& in, BwInstr& d) {
  const Node& nd = in.node;
  d.kind = kBwBatchNorm;
  d.weight = operand_of(c, in.weight);
  d.bias = operand_of(c, in.bias);
  auto it = c.bp.saved.batch_stats.find(i);
  if (it != c.bp.saved.batch_stats.end()) {
    d.flags |= kBwBatchStats;
    d.stats = c.a.saved + it->second;
    return;
  }
  const float* rm = static_cast<const float*>(c.a.state.at(nd.running_mean.index));
  const float* rv = static_cast<const float*>(c.a.state.at(nd.running_var.index));
  float* st = c.at(c.L.eval_stats.at(i));
  running_to_stats_kernel<<<blocks_of_256(in.width_in), 256, 0, c.stream>>>(rm, rv, in.width_in,
                                                                           static_cast<float>(nd.eps), st);
  GF_LAUNCH_CHECK();
  d.stats = st;
  d.weight_grad = gradient_of(c, in.weight);
  d.bias_grad = gradient_of(c, in.bias);
}

// Node i's instruction for the row backward, bound to the call's tensors.
BwInstr encode_stage(const BackwardCall& c, int i) {
  const Instr& in = c.bp.program[i - c.bp.start];
  BwInstr d;
  static_cast<RowAttrs&>(d) = row_attrs(in, in.width_in, in.width_out);
  switch (in.kind) {
    case Instr::Kind::Pointwise: encode_pointwise(c, in, d); break;
    case Instr::Kind::Reduce: d.kind = kBwReduce; break;
    case Instr::Kind::Softmax: d.kind = kBwSoftmax; break;
    case Instr::Kind::GroupNorm:
      d.kind = kBwGroupNorm;
      d.weight = operand_of(c, in.weight);
      d.bias = operand_of(c, in.bias);
      d.weight_grad = gradient_of(c, in.weight);
      d.bias_grad = gradient_of(c, in.bias);
      break;
    case Instr::Kind::Pool: d.kind = kBwPool; break;
    case Instr::Kind::BatchNormApply: encode_batch_norm(c, i, in, d); break;
    case Instr::Kind::Save: throw std::logic_error("CUDA backward: a Save among the stages");
  }
  return d;
}

// Where segment s (nodes lo .. hi-1) takes its gradient from: the output's (hi the chain's
// end), or the batch-statistics BatchNorm hi above it, with that BatchNorm's column sums.
void connect_top(const BackwardCall& c, const std::vector<BwInstr>& ins, int hi, BwSegment& s) {
  if (hi == static_cast<int>(c.plan.chain.nodes.size())) {
    s.g_top = static_cast<const float*>(c.a.grad_out);
    return;
  }
  s.bn_top = s.n;
  s.ins[s.n] = ins[hi - c.bp.start];
  s.g_top = c.at(c.L.bn_g.at(hi));
  s.bn_sum_g = c.at(c.L.bn_sums.at(hi));
  s.bn_sum_gx = s.bn_sum_g + c.plan.chain.row_width(hi);
}

// Where segment s puts its gradient at value lo: dV (lo the GEMM's value), or the output
// gradient and g x-hat of the batch-statistics BatchNorm below it.
void connect_bottom(const BackwardCall& c, int lo, BwSegment& s) {
  if (lo > c.bp.start) {
    const int b = lo - 1;
    s.bn_below = b - c.bp.start;
    s.out = c.at(c.L.bn_g.at(b));
    s.out_gx = c.at(c.L.bn_gx.at(b));
  } else {
    s.out = c.at(c.L.dv);
  }
}

// The row backward's segment of nodes lo .. hi-1 (instructions from the GEMM's value up to
// hi, for the forward recompute), its scratch, and where its gradient comes from and goes.
BwSegment make_segment(const BackwardCall& c, const std::vector<BwInstr>& ins, int lo, int hi) {
  const int start = c.bp.start;
  BwSegment s;
  s.n = hi - start;
  s.lo = lo - start;
  if (s.n + 1 > kMaxBackwardInstrs) throw Unsupported("CUDA backward: the chain is too long");
  for (int i = 0; i < s.n; ++i) s.ins[i] = ins[i];
  s.M = c.plan.M;
  s.slots = c.L.slots;
  s.gn_lanes = c.choice.group_norm_lanes;
  s.v0 = c.a.saved + c.bp.saved.v;
  s.w0 = static_cast<int32_t>(c.plan.chain.row_width(start));
  s.vals = reinterpret_cast<float*>(c.ws);
  for (int j = start + 1; j <= hi; ++j) s.val_off[j - start] = static_cast<int64_t>(c.L.vals.at(j) / 4);
  for (const auto& [j, off] : c.L.acc)
    if (j - start <= s.n) s.acc[j - start] = c.at(off);
  s.w_max = static_cast<int32_t>(c.L.g_width);
  s.g_scratch = c.at(c.L.g);
  connect_top(c, ins, hi, s);
  connect_bottom(c, lo, s);
  return s;
}

// Below a segment, the batch-statistics BatchNorm b: the column sums of its output's gradient
// (sum g, sum g x-hat) that the segment below reads, and its affine parameters' gradients
// (gamma: sum g x-hat; beta: sum g).
void batch_norm_column_sums(const BackwardCall& c, int b) {
  const int64_t M = c.plan.M, w = c.plan.chain.row_width(b);
  float* sums = c.at(c.L.bn_sums.at(b));
  launch_column_sums(c.at(c.L.bn_g.at(b)), M, w, sums, 1.f, false, c.stream);
  launch_column_sums(c.at(c.L.bn_gx.at(b)), M, w, sums + w, 1.f, false, c.stream);
  const Instr& in = c.bp.program[b - c.bp.start];
  auto add_to = [&](const OperandRef& o, const float* src) {
    if (o.kind == OperandRef::Kind::Col && c.a.grad_operands.at(o.index))
      launch_column_sums(src, 1, w, c.a.grad_operands[o.index], 1.f, true, c.stream);
  };
  add_to(in.weight, sums + w);
  add_to(in.bias, sums);
}

// One segment: the row backward, then what the segment below needs of its output.
void run_segment(const BackwardCall& c, const std::vector<BwInstr>& ins, int lo, int hi) {
  BwSegment s = make_segment(c, ins, lo, hi);
  plan_pointwise_runs(s);
  launch_row_backward(s, c.stream);
  if (lo > c.bp.start) batch_norm_column_sums(c, lo - 1);
}

// The row backward by segments: the gradient accumulators and sinks zeroed, the instructions
// (shared by every segment), the segments top down, then the sinks summed over the slots
// into the operands' gradients (the batch BatchNorms' affine gradients were added by then,
// into gradients the sinks do not touch).
void row_backward_by_segments(const BackwardCall& c) {
  const Chain& ch = c.plan.chain;
  const int n = static_cast<int>(ch.nodes.size()), start = c.bp.start;
  for (const auto& [j, off] : c.L.acc)
    GF_CUDA_CHECK(cudaMemsetAsync(c.at(off), 0, 4 * c.plan.M * ch.row_width(j), c.stream));
  for (const auto& [t, off] : c.L.sinks)
    GF_CUDA_CHECK(cudaMemsetAsync(c.at(off), 0, 4 * c.L.slots * c.L.sink_cols.at(t), c.stream));
  std::vector<BwInstr> ins(n - start);
  for (int i = start; i < n; ++i) ins[i - start] = encode_stage(c, i);
  int hi = n;
  for (auto it = c.bp.batch_norms.rbegin(); it != c.bp.batch_norms.rend(); ++it) {
    run_segment(c, ins, *it + 1, hi);
    hi = *it;
  }
  run_segment(c, ins, start, hi);
  for (const auto& [t, off] : c.L.sinks)
    if (c.a.grad_operands.at(t))
      launch_column_sums(c.at(off), c.L.slots, c.L.sink_cols.at(t), c.a.grad_operands[t], 1.f, true, c.stream);
}

}  // namespace

void backward_rows(const BackwardCall& c) {
  const BackwardArgs& a = c.a;
  for (size_t t = 0; t < a.grad_operands.size(); ++t)
    if (a.grad_operands[t])
      GF_CUDA_CHECK(cudaMemsetAsync(a.grad_operands[t], 0, 4 * a.operand_numel[t], c.stream));
  const int64_t M = c.plan.M;
  if (c.choice.rows == RowBackwardMode::CopyGradient && M > 0) {
    GF_CUDA_CHECK(cudaMemcpyAsync(c.at(c.L.dv), a.grad_out, 4 * M * c.plan.chain.row_width(c.bp.start),
                                  cudaMemcpyDeviceToDevice, c.stream));
  } else if (c.choice.rows == RowBackwardMode::Segments) {
    row_backward_by_segments(c);
  }
}

}  // namespace gemmfuse::cuda

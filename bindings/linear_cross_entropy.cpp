// gemmfuse::linear_cross_entropy: F.cross_entropy(F.linear(x, W, b), target) without the
// [M, V] logits. Rows go in chunks of C (a chunk's fp32 logits within kChunkBytes); a chunk's
// logits are one Linear, their row statistics and losses ATen ops over that chunk alone.
// Where the gradients are wanted the forward computes them in the same loop, as Liger-Kernel's
// fused linear cross entropy does: the logits' gradient is known once their row statistics
// are (softmax minus the target's share), so it goes at once into dx, dW and db, and the
// backward only scales them by grad_output. linear_cross_entropy_backward computes each
// chunk's logits again, for a loss per row (reduction "none"). Each product runs on
// gemmfuse's GEMM or at::mm, as route_product says.
#include "linear_cross_entropy.h"

#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <vector>

#ifdef GEMMFUSE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "cross_entropy_rows.h"
#endif
#include "batched_linear.h"
#include "product_route.h"
#include "run_call.h"

namespace gemmfuse::bindings {
namespace {

using RunOn = at::Tensor (*)(const CallInputs&, float*);
enum class Reduction { Mean, Sum, None };

// A chunk's fp32 logits take at most this many bytes (a chunk holds one row at least).
constexpr int64_t kChunkBytes = int64_t(256) << 20;
// Chosen chunks of this many rows or more are a multiple of it, so that each chunk's rows of x
// and dx start 256-byte aligned, as allocations do (the GEMM kernels' vector loads and stores).
constexpr int64_t kChunkAlign = 64;

// Why the op rejects its tensors' ranks, dtypes or devices, or "".
std::string rejects_kinds(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& b, const at::Tensor& t) {
  std::ostringstream os;
  if (x.dim() != 2 || w.dim() != 2 || t.dim() != 1)
    os << "expected x [M, K], weight [V, K] and target [M], got " << x.dim() << "-D, " << w.dim()
       << "-D and " << t.dim() << "-D";
  else if (x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat ||
           (b && b->scalar_type() != at::kFloat))
    os << "expected fp32 x, weight and bias, got " << x.scalar_type() << ", " << w.scalar_type()
       << " and " << (b ? c10::toString(b->scalar_type()) : "no bias");
  else if (t.scalar_type() != at::kLong)
    os << "expected an int64 target (class indices), got " << t.scalar_type();
  else if (w.device() != x.device() || t.device() != x.device() || (b && b->device() != x.device()))
    os << "tensors on different devices: x on " << x.device() << ", weight on " << w.device()
       << ", target on " << t.device() << (b ? ", bias on " + b->device().str() : "");
  return os.str();
}

// Why the op rejects its tensors, or "". Sizes are read as SymInts, so the Meta kernels check
// with it too.
std::string rejects(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                    const at::Tensor& t) {
  const std::string kinds = rejects_kinds(x, w, b, t);
  if (!kinds.empty()) return kinds;
  std::ostringstream os;
  if (x.sym_size(1) != w.sym_size(1))
    os << "x " << x.sym_sizes() << " and weight " << w.sym_sizes() << " cannot be multiplied";
  else if (t.sym_size(0) != x.sym_size(0))
    os << "target has " << t.sym_size(0) << " rows, x has " << x.sym_size(0);
  else if (w.sym_size(0) == 0)
    os << "the weight has no rows (no classes)";
  else if (b && (b->dim() != 1 || b->sym_size(0) != w.sym_size(0)))
    os << "bias of shape " << b->sym_sizes() << " for " << w.sym_size(0) << " classes";
  return os.str();
}

// The op's options, checked: PyTorch's messages where PyTorch has one.
Reduction checked_options(double label_smoothing, c10::string_view reduction, int64_t chunk_rows) {
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
              "label_smoothing must be between 0.0 and 1.0. Got: ", label_smoothing);
  TORCH_CHECK(chunk_rows >= 0, "gemmfuse::linear_cross_entropy: chunk_rows must be >= 0 (0: ",
              "chosen from the weight's rows), got ", chunk_rows);
  TORCH_CHECK_VALUE(reduction == "mean" || reduction == "sum" || reduction == "none",
                    std::string(reduction), " is not a valid value for reduction");
  return reduction == "mean" ? Reduction::Mean
                             : reduction == "sum" ? Reduction::Sum : Reduction::None;
}

// Rows per chunk: `requested` where given (> 0), else as many as keep a chunk's fp32 logits
// within kChunkBytes, a multiple of kChunkAlign where that many fit; one row at least.
int64_t chunk_rows_for(int64_t V, int64_t requested) {
  if (requested > 0) return requested;
  const int64_t rows = std::max<int64_t>(1, kChunkBytes / (int64_t(sizeof(float)) * V));
  return rows >= kChunkAlign ? rows / kChunkAlign * kChunkAlign : rows;
}

// Targets outside [0, V) that are not ignore_index: PyTorch's IndexError. On the CPU only:
// on CUDA reading them back would wait for the device; there gather's device-side bounds
// check stops the chunk that holds one.
void check_targets(const at::Tensor& safe_target, int64_t V) {
  if (!safe_target.is_cpu() || safe_target.numel() == 0) return;
  const at::Tensor bad = (safe_target < 0) | (safe_target >= V);
  if (!bad.any().item<bool>()) return;
  TORCH_CHECK_INDEX(false, "Target ", safe_target.masked_select(bad)[0].item<int64_t>(),
                    " is out of bounds.");
}

// V rounded up to a multiple of 8. The logits' product has the classes as its N and dx's as
// its K, which the split kernel reads in 16-byte rows: a vocabulary such as GPT-2's 50257
// would send both to SGEMM. So W (and the bias) get zero rows up to it, the logits are made
// [rows, Vp] and the row math reads their first V columns; the added columns are zeroed
// before the gradients' products, which then match the unpadded ones.
int64_t padded_classes(int64_t V) { return (V + 7) / 8 * 8; }

// t [V, ...] with zero rows up to padded_classes(V), contiguous (t itself where V is one).
at::Tensor with_padded_classes(const at::Tensor& t) {
  const int64_t V = t.size(0), Vp = padded_classes(V);
  if (Vp == V) return t.contiguous();
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[0] = Vp;
  at::Tensor out = at::empty(sizes, t.options());
  out.narrow(0, 0, V).copy_(t);
  out.narrow(0, V, Vp - V).zero_();
  return out;
}

// One call's inputs as the chunk loop reads them.
struct Call {
  at::Tensor x, weight;  // contiguous: a chunk is a slice of x's rows; weight [Vp, K]
  c10::optional<at::Tensor> bias;  // [Vp]
  bool callers_weight;  // `weight` is the caller's tensor, not a copy of it (padded or contiguous)
  at::Tensor valid;     // target != ignore_index
  at::Tensor target;    // the target with ignored rows at class 0, for gather and scatter
  double eps;           // label smoothing
  Reduction reduction;
  std::string precision;
  int64_t M, K, V, Vp, chunk;  // Vp: padded_classes(V)
};

Call make_call(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               const at::Tensor& target, int64_t ignore_index, double label_smoothing,
               c10::string_view reduction, c10::string_view precision, int64_t chunk_rows) {
  const std::string why = rejects(x, weight, bias, target);
  TORCH_CHECK(why.empty(), "gemmfuse::linear_cross_entropy: ", why);
  const int64_t V = weight.size(0);
  c10::optional<at::Tensor> padded_bias;
  if (bias) padded_bias = with_padded_classes(*bias);
  Call c{x.contiguous(), with_padded_classes(weight), padded_bias,
         weight.is_contiguous() && padded_classes(V) == V};
  c.reduction = checked_options(label_smoothing, reduction, chunk_rows);
  c.eps = label_smoothing;
  c.precision = std::string(precision);
  c.M = x.size(0);
  c.K = x.size(1);
  c.V = V;
  c.Vp = padded_classes(V);
  c.chunk = chunk_rows_for(c.V, chunk_rows);
  c.valid = target != ignore_index;
  c.target = at::where(c.valid, target, 0);
  check_targets(c.target, c.V);
  return c;
}

// Where one product runs, and why (describe prints it).
struct Route {
  bool gemmfuse;
  std::string why;
};

// y = x wᵀ on gemmfuse's GEMM where the matmul switch's rule would run it there (product_route.h:
// the split kernel; on the CPU the CPU executor); else PyTorch's own at::mm, the call eager's
// F.linear and its backward make (a product the planner refuses, such as one with K = 0, or one
// off the split kernel on CUDA, unless PyTorch's GEMM is set to TF32: then gemmfuse's cuBLAS
// call, which keeps fp32).
Route route_product(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                    c10::string_view precision) {
  const ProductPlace p = product_place(x, w, b, precision);
  const std::string why = switch_route(p, x, precision, "at::mm");
  if (!why.empty()) return {false, "at::mm (" + why + ")"};
  if (p.where == ProductPlace::Where::SplitKernel) return {true, "gemmfuse (the split kernel)"};
  return {true, x.is_cuda() ? "gemmfuse (cuBLAS or the small-M kernel, in fp32 without TF32)"
                            : "gemmfuse (the CPU executor: PyTorch's BLAS)"};
}

// The chunk loop's three products on one device (RunOn: run_on_cpu, run_on_cuda), each on
// gemmfuse's GEMM or at::mm as route_product says:
//   logits z = x_c Wᵀ + b               Linear(x_c, W, b)
//   dx_c = dz W                          Linear(dz, Wᵀ), Wᵀ made contiguous once per call
//   dW  += dzᵀ x_c                       Linear(dzᵀ, x_cᵀ), both made contiguous per chunk
// Preparations (prepared_cache.h: W's split parts on CUDA) are kept only for W itself, the
// caller's tensor, in chunks of the full size: one entry per weight and chunk size, reused by
// every full chunk of this call and of later calls until W's version changes (an optimizer
// step), and then rebuilt. A last, shorter chunk (its own plan) and the operands made here
// (Wᵀ, dzᵀ, x_cᵀ: new tensors every call) are prepared for their call alone, as
// gemmfuse::linear's keep_weight=False does: kept, each would add an entry per size or address.
class Products {
 public:
  Products(RunOn run, const Call& c) : run_(run), c_(c) {}

  Route logits_route(const at::Tensor& xc) const {
    return route_product(xc, c_.weight, c_.bias, c_.precision);
  }
  // dx's route for dz of `rows` rows: shapes alone route a product, so stand-ins that hold no
  // memory take the operands' place.
  Route input_grad_route(int64_t rows) const {
    const at::Tensor one = at::empty({1, 1}, c_.x.options());
    return route_product(one.expand({rows, c_.Vp}), one.expand({c_.K, c_.Vp}), c10::nullopt,
                         c_.precision);
  }
  Route weight_grad_route(const at::Tensor& dz, const at::Tensor& xc) const {
    return route_product(dz.t(), xc.t(), c10::nullopt, c_.precision);
  }

  // [rows, Vp] fp32.
  at::Tensor logits(const at::Tensor& xc) {
    if (!logits_route(xc).gemmfuse)
      return c_.bias ? at::addmm(*c_.bias, xc, c_.weight.t()) : at::mm(xc, c_.weight.t());
    const bool keep = c_.callers_weight && xc.size(0) == c_.chunk;
    return linear(xc, c_.weight, c_.bias, keep, at::Tensor(), &weight_slot_);
  }

  // dz W into dxc (rows of dx).
  void input_grad(const at::Tensor& dz, at::Tensor dxc) {
    if (!input_grad_route(dz.size(0)).gemmfuse) {
      at::mm_out(dxc, dz, c_.weight);
      return;
    }
    if (!weight_t_.defined()) weight_t_ = c_.weight.t().contiguous();
    linear(dz, weight_t_, c10::nullopt, false, dxc, &weight_t_slot_);
  }

  // dzᵀ x_c into dw (the first chunk), or added to it.
  void add_weight_grad(const at::Tensor& dz, const at::Tensor& xc, at::Tensor dw, bool first) {
    if (!first && !scratch_.defined()) scratch_ = at::empty_like(dw);
    at::Tensor into = first ? dw : scratch_;
    if (weight_grad_route(dz, xc).gemmfuse)
      linear(dz.t().contiguous(), xc.t().contiguous(), c10::nullopt, false, into);
    else
      at::mm_out(into, dz.t(), xc);
    if (!first) dw.add_(scratch_);
  }

 private:
  // y = x wᵀ (+ b) as one gemmfuse Linear, exactly as gemmfuse::linear runs it; written into
  // `into` where given and, on CUDA, 256-byte aligned (as gemmfuse::bmm writes a slice), else
  // into a new tensor (copied into `into` where given).
  // With `slot`, a W prepared for the call alone (keep false) is prepared once for the chunks
  // of one plan and kept there for the call.
  at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                    bool keep, at::Tensor into, PreparedSlot* slot = nullptr) {
    const std::string spec = linear_spec(w, b);
    CallInputs in{spec, x, w, b, {}, {}, c_.precision};
    in.keep_prepared = keep;
    in.prepared_slot = slot;
    const bool direct = into.defined() &&
                        (into.is_cpu() || reinterpret_cast<uintptr_t>(into.data_ptr()) % 256 == 0);
    if (direct) in.out = &into;
    at::Tensor y = run_(in, nullptr);
    if (into.defined() && !direct) into.copy_(y);
    return y;
  }

  RunOn run_;
  const Call& c_;
  at::Tensor weight_t_;  // Wᵀ [K, Vp], contiguous, made at the first chunk that needs it
  // The preparations of W (where it is not the caller's: the padded copy) and of Wᵀ, made at
  // the first full chunk and read by the others (prepared_for's per-call path redid them each).
  PreparedSlot weight_slot_, weight_t_slot_;
  at::Tensor scratch_;   // [V, K]: a chunk's dW before it is added
};

// The row math, on a chunk's logits z [rows, V] in place: z̃ = z − max (log_softmax's first
// step, as PyTorch takes it: a row holding NaN stays NaN), e = exp z̃, s = Σ e, and
// log_softmax = z̃ − log s.

// z̃: z minus each row's max.
void shift_by_row_max_(at::Tensor& z) { z.sub_(at::amax(z, {1}, /*keepdim=*/true)); }

// What a row's loss reads of z̃ before it is exponentiated: z̃ at the target and, with label
// smoothing, the row's mean.
struct LossTerms {
  at::Tensor at_target, mean;
};

LossTerms loss_terms(const at::Tensor& shifted, const at::Tensor& target, double eps) {
  return {shifted.gather(1, target.unsqueeze(1)).squeeze(1),
          eps > 0 ? shifted.mean(1) : at::Tensor()};
}

// e = exp z̃ in place; returns s, the rows' sums.
at::Tensor exp_rows_(at::Tensor& z) { return z.exp_().sum(1); }

// Each row's loss, (1−ε)(log s − z̃[t]) + ε(log s − mean z̃): −log_softmax at the target, and ε
// times its mean over the classes (PyTorch's label smoothing); without smoothing the first
// term alone (so that no 0·inf enters). 0 for ignored rows, whatever their logits hold: PyTorch's
// nll_loss skips them.
at::Tensor row_losses(const LossTerms& terms, const at::Tensor& sums, const at::Tensor& valid,
                      double eps) {
  const at::Tensor log_s = sums.log();
  at::Tensor loss = log_s - terms.at_target;
  if (eps > 0) loss = loss * (1 - eps) + (log_s - terms.mean) * eps;
  return at::where(valid, loss, 0.0);
}

// e becomes the logits' gradient for row weights w (the loss's gradient per row, 0 for ignored
// rows): w·(softmax − (1−ε)·onehot(t) − ε/V), which is PyTorch's log_softmax backward of
// nll_loss's and the smoothing term's gradients (a row of NaN logits gives NaN, ignored or not,
// as there).
void logits_grad_(at::Tensor& e, const at::Tensor& sums, const at::Tensor& target,
                  const at::Tensor& w, double eps) {
  e.mul_((w / sums).unsqueeze(1));
  if (eps > 0) e.sub_((w * (eps / static_cast<double>(e.size(1)))).unsqueeze(1));
  e.scatter_add_(1, target.unsqueeze(1), (w * -(1 - eps)).unsqueeze(1));
}

// The loss's gradient per row for grad_loss (a scalar for mean and sum, one value a row for
// none): over the counted rows for mean, 0 for ignored rows. Where every row is ignored,
// mean's 1/0 is dropped with them: zero gradients, as PyTorch's.
at::Tensor row_weights(const at::Tensor& grad_loss, const Call& c) {
  const bool per_row = c.reduction == Reduction::None;
  TORCH_CHECK(per_row ? (grad_loss.dim() == 1 && grad_loss.size(0) == c.M) : grad_loss.numel() == 1,
              "gemmfuse::linear_cross_entropy_backward: grad_loss of shape ", grad_loss.sizes(),
              per_row ? " for one loss per row" : " for a reduced loss");
  TORCH_CHECK(grad_loss.device() == c.x.device(), "gemmfuse::linear_cross_entropy_backward: ",
              "grad_loss on ", grad_loss.device(), ", x on ", c.x.device());
  at::Tensor g = grad_loss.to(at::kFloat).reshape({per_row ? c.M : 1});
  if (c.reduction == Reduction::Mean) g = g / c.valid.sum();
  return at::where(c.valid, g, 0.0).to(at::kFloat);
}

// The loss from the rows' losses: each row's (none), their sum, or their mean over the rows
// not ignored (0/0: NaN where every row is, as PyTorch's mean). Summed in double.
at::Tensor reduce_loss(const at::Tensor& rows, const Call& c) {
  if (c.reduction == Reduction::None) return rows;
  at::Tensor total = rows.sum(at::kDouble);
  if (c.reduction == Reduction::Mean) total = total / c.valid.sum();
  return total.to(at::kFloat);
}

// The gradients the loop fills: dx's rows chunk by chunk, dW and db summed over the chunks
// (db in double: a chunk's column sums are added chunk after chunk, one row at a time where
// chunks hold one row).
struct Grads {
  at::Tensor dx, dw, db;  // db undefined without a bias
};

Grads new_grads(const Call& c) {
  const auto opts = c.x.options();
  // dW is written by the first chunk; with no rows there is none.
  return {at::empty({c.M, c.K}, opts),
          c.M == 0 ? at::zeros({c.Vp, c.K}, opts) : at::empty({c.Vp, c.K}, opts),
          c.bias ? at::zeros({c.V}, opts.dtype(at::kDouble)) : at::Tensor()};
}

// Where a call wants them: the rows' losses (`losses`, [M]) and the gradients for row weights
// `w` ([M]), chunk by chunk.
struct Wanted {
  at::Tensor losses, w;
  Grads* grads = nullptr;
};

// The row math of a chunk's logits zp [rows, Vp] in place, as ATen ops: the rows' losses into
// want.losses (if wanted) and, with gradients wanted, zp becomes the logits' gradient (the
// padded classes 0).
void row_math_aten(const at::Tensor& zp, const Call& c, const Wanted& want, int64_t r0,
                   int64_t rows, const at::Tensor& target) {
  at::Tensor z = zp.narrow(1, 0, c.V);  // the classes; any padded ones follow (padded_classes)
  shift_by_row_max_(z);
  const LossTerms terms = want.losses.defined() ? loss_terms(z, target, c.eps) : LossTerms{};
  const at::Tensor sums = exp_rows_(z);
  if (want.losses.defined())
    want.losses.narrow(0, r0, rows).copy_(row_losses(terms, sums, c.valid.narrow(0, r0, rows), c.eps));
  if (want.grads == nullptr) return;
  logits_grad_(z, sums, target, want.w.narrow(0, r0, rows), c.eps);
  if (c.Vp > c.V) zp.narrow(1, c.V, c.Vp - c.V).zero_();
}

// The same on CUDA in one kernel (lm_head/cross_entropy_rows.h); false elsewhere.
bool row_math_on_cuda(const at::Tensor& zp, const Call& c, const Wanted& want, int64_t r0,
                      int64_t rows, const at::Tensor& target) {
#ifdef GEMMFUSE_WITH_CUDA
  if (!zp.is_cuda()) return false;
  cuda::CrossEntropyRows k;
  k.z = zp.data_ptr<float>();
  k.rows = rows;
  k.V = c.V;
  k.ldz = zp.stride(0);
  k.target = target.data_ptr<int64_t>();
  k.valid = c.valid.narrow(0, r0, rows).data_ptr<bool>();
  k.eps = static_cast<float>(c.eps);
  k.loss = want.losses.defined() ? want.losses.narrow(0, r0, rows).data_ptr<float>() : nullptr;
  k.w = want.grads != nullptr ? want.w.narrow(0, r0, rows).data_ptr<float>() : nullptr;
  cuda::launch_cross_entropy_rows(k, at::cuda::getCurrentCUDAStream(zp.get_device()));
  return true;
#else
  (void)zp, (void)c, (void)want, (void)r0, (void)rows, (void)target;
  return false;
#endif
}

// One chunk, rows [r0, r0 + rows): its logits, their row statistics, its rows' losses and its
// share of the gradients.
void run_chunk(Products& p, const Call& c, const Wanted& want, int64_t r0, int64_t rows) {
  const at::Tensor xc = c.x.narrow(0, r0, rows), target = c.target.narrow(0, r0, rows);
  const at::Tensor zp = p.logits(xc);
  if (!row_math_on_cuda(zp, c, want, r0, rows, target)) row_math_aten(zp, c, want, r0, rows, target);
  if (want.grads == nullptr) return;
  Grads& g = *want.grads;
  p.input_grad(zp, g.dx.narrow(0, r0, rows));
  p.add_weight_grad(zp, xc, g.dw, r0 == 0);
  if (g.db.defined()) g.db.add_(zp.narrow(1, 0, c.V).sum(0, /*keepdim=*/false, at::kDouble));
}

void run_chunks(RunOn run, const Call& c, const Wanted& want) {
  Products p(run, c);
  for (int64_t r0 = 0; r0 < c.M; r0 += c.chunk) run_chunk(p, c, want, r0, std::min(c.chunk, c.M - r0));
}

// The executor for the inputs' device.
RunOn run_on(const at::Tensor& x) {
#ifdef GEMMFUSE_WITH_CUDA
  if (x.is_cuda()) return &run_on_cuda;
#endif
  TORCH_CHECK(x.is_cpu(), "gemmfuse::linear_cross_entropy: tensors on ", x.device(),
              " (expected CPU or CUDA)");
  return &run_on_cpu;
}

// dW's rows of the classes (dropping the padded ones), or an undefined dW as it is.
at::Tensor classes_of(const at::Tensor& dw, const Call& c) {
  return dw.defined() ? dw.narrow(0, 0, c.V) : dw;
}

// A gradient not computed: no elements.
at::Tensor none_like(const at::Tensor& x) { return at::empty({0}, x.options()); }

// An fp32 gradient, or none (the bias's where there is none).
at::Tensor or_none(const at::Tensor& t, const at::Tensor& x) {
  return t.defined() ? t.to(at::kFloat) : none_like(x);
}

}  // namespace

LceForward linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight,
                                const c10::optional<at::Tensor>& bias, const at::Tensor& target,
                                int64_t ignore_index, double label_smoothing,
                                c10::string_view reduction, c10::string_view precision,
                                int64_t chunk_rows, bool with_grads) {
  const c10::DeviceGuard guard(x.device());  // the plans' kernel selection is per device
  const Call c = make_call(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                           precision, chunk_rows);
  Wanted want{at::zeros({c.M}, x.options())};
  Grads g;
  if (with_grads && c.reduction != Reduction::None) {
    g = new_grads(c);
    want.w = row_weights(at::ones({}, x.options()), c);
    want.grads = &g;
  }
  run_chunks(run_on(x), c, want);
  return {reduce_loss(want.losses, c), or_none(g.dx, x), or_none(classes_of(g.dw, c), x),
          or_none(g.db, x)};
}

LceForward linear_cross_entropy_meta(const at::Tensor& x, const at::Tensor& weight,
                                     const c10::optional<at::Tensor>& bias,
                                     const at::Tensor& target, int64_t, double label_smoothing,
                                     c10::string_view reduction, c10::string_view,
                                     int64_t chunk_rows, bool with_grads) {
  const std::string why = rejects(x, weight, bias, target);
  TORCH_CHECK(why.empty(), "gemmfuse::linear_cross_entropy: ", why);
  const Reduction r = checked_options(label_smoothing, reduction, chunk_rows);
  const auto opts = x.options();
  at::Tensor loss = r == Reduction::None ? at::empty_symint({x.sym_size(0)}, opts) : at::empty({}, opts);
  if (!with_grads || r == Reduction::None)
    return {loss, none_like(x), none_like(x), none_like(x)};
  return {loss, at::empty_symint(x.sym_sizes(), opts), at::empty_symint(weight.sym_sizes(), opts),
          bias ? at::empty_symint(bias->sym_sizes(), opts) : none_like(x)};
}

LceGrads linear_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& x,
                                       const at::Tensor& weight,
                                       const c10::optional<at::Tensor>& bias,
                                       const at::Tensor& target, int64_t ignore_index,
                                       double label_smoothing, c10::string_view reduction,
                                       c10::string_view precision, int64_t chunk_rows) {
  const c10::DeviceGuard guard(x.device());
  const Call c = make_call(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                           precision, chunk_rows);
  Grads g = new_grads(c);
  run_chunks(run_on(x), c, Wanted{at::Tensor(), row_weights(grad_loss, c), &g});
  return {g.dx, classes_of(g.dw, c), or_none(g.db, x)};
}

LceGrads linear_cross_entropy_backward_meta(const at::Tensor&, const at::Tensor& x,
                                            const at::Tensor& weight,
                                            const c10::optional<at::Tensor>& bias,
                                            const at::Tensor& target, int64_t,
                                            double label_smoothing, c10::string_view reduction,
                                            c10::string_view, int64_t chunk_rows) {
  const std::string why = rejects(x, weight, bias, target);
  TORCH_CHECK(why.empty(), "gemmfuse::linear_cross_entropy: ", why);
  checked_options(label_smoothing, reduction, chunk_rows);
  const auto opts = x.options();
  return {at::empty_symint(x.sym_sizes(), opts), at::empty_symint(weight.sym_sizes(), opts),
          bias ? at::empty_symint(bias->sym_sizes(), opts) : none_like(x)};
}

std::string linear_cross_entropy_describe(const at::Tensor& x, const at::Tensor& weight,
                                          const c10::optional<at::Tensor>& bias,
                                          c10::string_view precision, int64_t chunk_rows) {
  const c10::DeviceGuard guard(x.device());
  const at::Tensor stand_in = at::zeros({x.dim() == 2 ? x.size(0) : 0}, x.options().dtype(at::kLong));
  const Call c = make_call(x, weight, bias, stand_in, -100, 0.0, "mean", precision, chunk_rows);
  std::ostringstream os;
  const int64_t rows = std::min(c.chunk, c.M);
  os << "chunks of " << c.chunk << " rows: " << (c.M + c.chunk - 1) / c.chunk << " for " << c.M
     << " rows, " << c.V << " classes";
  if (rows == 0) return os.str();
  const Products p(run_on(x), c);
  // Shapes alone route a product: the logits' gradient is a stand-in that holds no memory.
  const at::Tensor xc = c.x.narrow(0, 0, rows), dz = at::empty({1, 1}, x.options()).expand({rows, c.Vp});
  os << "\nlogits = x Wᵀ + b: " << p.logits_route(xc).why << "\ndx = dlogits W: "
     << p.input_grad_route(rows).why << "\ndW = dlogitsᵀ x: " << p.weight_grad_route(dz, xc).why;
  return os.str();
}

}  // namespace gemmfuse::bindings

#include "attention.h"

#include <ATen/ExpandUtils.h>

#include <sstream>

#ifdef GEMMFUSE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "attention_f16x3.h"
#endif

namespace gemmfuse::bindings {

// Why the forward kernel does not take head dim D (null: it does).
static const char* cuda_unfit(int64_t D) {
#ifdef GEMMFUSE_WITH_CUDA
  return cuda::attention_f16x3_unfit(static_cast<int>(D));
#else
  (void)D;
  return "this build has no CUDA executor";
#endif
}

// Why the forward kernel of head dim D does not run on this device (null: it does).
static const char* cuda_device_unfit(int64_t D, int device) {
#ifdef GEMMFUSE_WITH_CUDA
  return cuda::attention_f16x3_device_unfit(static_cast<int>(D), device);
#else
  (void)D, (void)device;
  return "this build has no CUDA executor";
#endif
}

// Why the backward kernel of head dim D does not run on this device (null: it does).
static const char* cuda_backward_unfit(int64_t D, int device) {
#ifdef GEMMFUSE_WITH_CUDA
  return cuda::attention_f16x3_backward_device_unfit(static_cast<int>(D), device);
#else
  (void)D, (void)device;
  return "this build has no CUDA executor";
#endif
}

// Why an additive mask does not fit q [B, H, Sq, D] and k [B, H, Sk, D] ("" where it does):
// fp32 on q's device, no gradient wanted, broadcasting to [B, H, Sq, Sk].
static std::string bias_unfit(const at::Tensor& q, const at::Tensor& k,
                              const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return "";
  const at::Tensor& b = *bias;
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2);
  if (b.scalar_type() != at::kFloat || b.device() != q.device())
    return "an attention mask that is not fp32 on q's device";
  if (b.requires_grad()) return "an attention mask that needs a gradient";
  if (b.dim() > 4 || !at::is_expandable_to(b.sizes(), {B, H, Sq, Sk}))
    return "an attention mask that does not broadcast to [B, H, Sq, Sk]";
  return "";
}

// Whether k and v fit q [B, H, Sq, D]: [B, H, Sk, D], one Sk, and Sk > 0 where Sq > 0.
static bool kv_fit(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.dim() != 4 || k.dim() != 4 || k.sizes() != v.sizes()) return false;
  if (k.size(0) != q.size(0) || k.size(1) != q.size(1) || k.size(3) != q.size(3)) return false;
  return k.size(2) > 0 || q.numel() == 0;
}

std::string sdpa_f16x3_route(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& bias) {
  std::ostringstream os;
  if (!kv_fit(q, k, v))
    os << "q [B, H, Sq, D] with k and v [B, H, Sk, D] (Sk > 0), got " << q.sizes() << ", "
       << k.sizes() << " and " << v.sizes();
  else if (q.scalar_type() != at::kFloat || k.scalar_type() != at::kFloat ||
           v.scalar_type() != at::kFloat)
    os << "fp32 q, k and v, got " << q.scalar_type();
  else if (!q.is_cuda() || k.device() != q.device() || v.device() != q.device())
    os << "q, k and v on one CUDA device";
  else if (const char* unfit = cuda_unfit(q.size(3)))
    os << "head dim " << q.size(3) << " (" << unfit << ")";
  else if (const char* unfit_here = cuda_device_unfit(q.size(3), q.get_device()))
    os << unfit_here;
  else
    os << bias_unfit(q, k, bias);
  return os.str();
}

#ifdef GEMMFUSE_WITH_CUDA
// The mask as the kernels read it: expanded to [B, H, Sq, Sk] (a view: broadcast dims stride 0).
static cuda::AttentionMask mask_of(const c10::optional<at::Tensor>& bias, const at::Tensor& q,
                                   const at::Tensor& k) {
  cuda::AttentionMask m;
  if (!bias.has_value() || !bias->defined()) return m;
  const at::Tensor e = bias->expand({q.size(0), q.size(1), q.size(2), k.size(2)});
  m.data = e.data_ptr<float>(), m.heads = q.size(1);
  m.sb = e.stride(0), m.sh = e.stride(1), m.si = e.stride(2), m.sj = e.stride(3);
  return m;
}
#endif

// t contiguous with its first element on a 16-byte boundary, as the kernels' vector loads and
// 16-byte copies read it: a contiguous view whose storage offset breaks that is copied.
static at::Tensor contiguous_aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

// The log-sum-exp's rows: S rounded up to 32, as PyTorch's memory-efficient attention pads them.
static int64_t lse_columns(int64_t S) { return (S + 31) / 32 * 32; }

std::tuple<at::Tensor, at::Tensor> sdpa_f16x3_meta(const at::Tensor& q, const at::Tensor&,
                                                   const at::Tensor&,
                                                   const c10::optional<at::Tensor>&, bool,
                                                   double) {
  TORCH_CHECK(q.dim() == 4, "gemmfuse::sdpa_f16x3: expected q of [B, H, S, D], got ", q.sizes());
  return {at::empty(q.sizes(), q.options()),
          at::empty({q.size(0), q.size(1), lse_columns(q.size(2))}, q.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sdpa_f16x3_backward_meta(
    const at::Tensor&, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, bool, double) {
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options()),
          at::empty(v.sizes(), v.options())};
}

#ifdef GEMMFUSE_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> sdpa_f16x3(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v,
                                              const c10::optional<at::Tensor>& bias,
                                              bool is_causal, double scale) {
  const std::string why = sdpa_f16x3_route(q, k, v, bias);
  TORCH_CHECK(why.empty(), "gemmfuse::sdpa_f16x3: expected ", why);
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), Sk = k.size(2), D = q.size(3);
  const at::Tensor qc = contiguous_aligned(q), kc = contiguous_aligned(k),
                   vc = contiguous_aligned(v);
  at::Tensor out = at::empty({B, H, S, D}, q.options());
  at::Tensor lse = at::zeros({B, H, lse_columns(S)}, q.options());
  at::Tensor lse_rows = at::empty({B, H, S}, q.options());
  at::Tensor ws = at::empty({static_cast<int64_t>(cuda::attention_f16x3_workspace_bytes(
                                B * H, S, Sk, static_cast<int>(D)))},
                            q.options().dtype(at::kByte));
  cuda::AttentionF16x3 a;
  a.BH = B * H, a.Sq = S, a.Sk = Sk, a.D = static_cast<int>(D);
  a.q = qc.data_ptr<float>(), a.k = kc.data_ptr<float>(), a.v = vc.data_ptr<float>();
  a.o = out.data_ptr<float>(), a.lse = lse_rows.data_ptr<float>();
  a.scale = static_cast<float>(scale), a.causal = is_causal, a.workspace = ws.data_ptr();
  a.mask = mask_of(bias, q, k);
  cuda::launch_attention_f16x3(a, at::cuda::getCurrentCUDAStream());
  lse.narrow(2, 0, S).copy_(lse_rows);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sdpa_f16x3_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& bias, const at::Tensor& out, const at::Tensor& lse,
    bool is_causal, double scale) {
  const std::string why = sdpa_f16x3_backward_route(grad_out, q, k, v, bias, out, lse);
  TORCH_CHECK(why.empty(), "gemmfuse::sdpa_f16x3_backward: expected ", why);
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const at::Tensor qc = contiguous_aligned(q), kc = contiguous_aligned(k),
                   vc = contiguous_aligned(v), oc = contiguous_aligned(out),
                   gc = contiguous_aligned(grad_out), lc = lse.contiguous();
  at::Tensor dq = at::empty_like(qc), dk = at::empty_like(kc), dv = at::empty_like(vc);
  at::Tensor ws = at::empty({static_cast<int64_t>(cuda::attention_f16x3_backward_workspace_bytes(
                                B * H, S, k.size(2), static_cast<int>(D)))},
                            q.options().dtype(at::kByte));
  cuda::AttentionF16x3Backward a;
  a.BH = B * H, a.Sq = S, a.Sk = k.size(2), a.D = static_cast<int>(D), a.causal = is_causal;
  a.scale = static_cast<float>(scale);
  a.q = qc.data_ptr<float>(), a.k = kc.data_ptr<float>(), a.v = vc.data_ptr<float>();
  a.o = oc.data_ptr<float>(), a.dout = gc.data_ptr<float>();
  a.lse = lc.data_ptr<float>(), a.lse_stride = lc.size(2);
  a.dq = dq.data_ptr<float>(), a.dk = dk.data_ptr<float>(), a.dv = dv.data_ptr<float>();
  a.workspace = ws.data_ptr();
  a.mask = mask_of(bias, q, k);
  cuda::launch_attention_f16x3_backward(a, at::cuda::getCurrentCUDAStream());
  return {dq, dk, dv};
}
#endif

std::string sdpa_f16x3_backward_route(const at::Tensor& grad_out, const at::Tensor& q,
                                      const at::Tensor& k, const at::Tensor& v,
                                      const c10::optional<at::Tensor>& bias,
                                      const at::Tensor& out, const at::Tensor& lse) {
  std::string why = sdpa_f16x3_route(q, k, v, bias);
  if (!why.empty()) return why;
  if (const char* unfit = cuda_backward_unfit(q.size(3), q.get_device())) return unfit;
  if (grad_out.sizes() != q.sizes() || out.sizes() != q.sizes() ||
      grad_out.scalar_type() != at::kFloat || out.scalar_type() != at::kFloat)
    return "grad_out and out of q's shape and dtype";
  if (lse.dim() != 3 || lse.size(0) != q.size(0) || lse.size(1) != q.size(1) ||
      lse.size(2) < q.size(2) || lse.scalar_type() != at::kFloat)
    return "a log-sum-exp of [B, H, at least S] in fp32";
  return "";
}

}  // namespace gemmfuse::bindings

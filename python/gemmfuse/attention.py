"""fp32 attention in captured graphs: ``F.scaled_dot_product_attention(q, k, v, attn_mask=...,
is_causal=..., scale=...)`` (no dropout) as one differentiable call on gemmfuse's split-product
kernels (``gemmfuse::sdpa_f16x3`` and its backward), which optimize() and the torch.compile
backend put in place of the model's own call (capture/attention.py finds them).

Each direction runs where C++'s route takes its operands (fp32 CUDA q [B, H, Sq, D] and k, v
[B, H, Sk, D], D 64, 96 or 128, both directions; a mask fp32 or bool, broadcasting to
[B, H, Sq, Sk], needing no gradient), else as PyTorch's memory-efficient attention runs it.
Where autograd records, a call runs on gemmfuse only where both directions do, and a backward
runs on the side its forward ran: each backward recomputes the scores S as its own forward did,
so that P = exp(S - LSE) is a consistent softmax. The kernels' S carries ~2^-22 of |S| where
fp32 carries ~2^-24, so a backward reading the other side's LSE would err by that much in P
where scores are large (docs/measurements.md, "fp32 attention's backward with one large row").
Elsewhere (the CPU, other dtypes, no operator library) PyTorch's own SDPA runs the call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _lib

aten = torch.ops.aten


def forward_route(q, k, v, mask=None) -> str:
    """'' where gemmfuse's forward kernel takes q, k, v (and the additive mask), else why
    PyTorch's runs."""
    if not _lib.available():
        return "the gemmfuse operator library is not available"
    return _lib.ops().sdpa_f16x3_route(q, k, v, mask)


def _backward_route(go, q, k, v, mask, out, lse) -> str:
    return _lib.ops().sdpa_f16x3_backward_route(go, q, k, v, mask, out, lse)


def additive_mask(mask):
    """An attn_mask as the kernels read it (PyTorch's rule): a float one as it is, a boolean
    one as 0 where True (attend) and -inf where False; None stays None."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


class _Attention(torch.autograd.Function):
    """softmax(q kᵀ · scale [+ mask] [+ causal mask]) v for fp32 CUDA q [B, H, Sq, D] and k, v
    [B, H, Sk, D]; `mask` additive (additive_mask) or None."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        ctx.ours = not forward_route(q, k, v, mask)
        if ctx.ours:
            out, lse = torch.ops.gemmfuse.sdpa_f16x3(q, k, v, mask, is_causal, scale)
        else:
            out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, True, 0.0, is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, go):
        q, k, v, mask, out, lse = ctx.saved_tensors
        go = go.contiguous()
        if not ctx.ours or _backward_route(go, q, k, v, mask, out, lse):
            empty = torch.empty((), dtype=torch.long)  # no dropout: no RNG state to pass
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                go, q, k, v, mask, out, lse, empty, empty, 0.0, [True, True, True, False],
                ctx.is_causal, scale=ctx.scale)
        else:
            dq, dk, dv = torch.ops.gemmfuse.sdpa_f16x3_backward(go, q, k, v, mask, out, lse,
                                                                ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None, None


def runs_on_gemmfuse(q, k, v, mask=None) -> bool:
    """Whether scaled_dot_product_attention takes this call to gemmfuse's kernels (what PyTorch
    runs otherwise is its own SDPA, the model's call as it was): fp32 CUDA tensors, not
    DTensors (tensor parallelism shards them: DTensor's own SDPA rule runs them), that the
    kernels' route takes, and the backward's route too where autograd records (the module
    docstring says why both)."""
    from .tensor_parallel import is_dtensor
    if not (all(isinstance(t, torch.Tensor) and not is_dtensor(t) and t.is_cuda
                and t.dtype == torch.float32 for t in (q, k, v))
            and _lib.available() and not forward_route(q, k, v, mask)):
        return False
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return True
    return not _shape_backward_route(q, k, mask)


def _shape_backward_route(q, k, mask) -> str:
    """'' where gemmfuse's backward kernel takes a call of q's and k's shapes with this mask
    (or none), else why."""
    return _backward_route(q, q, k, k, mask, q, q.select(-1, 0))


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=is_causal, scale=scale,
    enable_gqa=enable_gqa)`` with both products of the forward and of the backward on split fp16
    tensor-core products where the kernels take the call (fp32 CUDA q [B, H, Sq, D] and k, v
    [B, H, Sk, D], D 64, 96 or 128; a mask fp32 or bool broadcasting to [B, H, Sq, Sk];
    grouped-query k and v repeated to q's heads, their gradients summed back by autograd); else
    PyTorch's SDPA."""
    mask = additive_mask(attn_mask) if isinstance(attn_mask, torch.Tensor) else attn_mask
    kq, vq = k, v
    if enable_gqa and k.dim() == 4 and q.dim() == 4 and 0 < k.shape[1] < q.shape[1]:
        group = q.shape[1] // k.shape[1]
        kq, vq = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if not runs_on_gemmfuse(q, kq, vq, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    k, v = kq, vq
    s = float(scale) if scale is not None else q.shape[-1] ** -0.5
    return _Attention.apply(q, k, v, mask, bool(is_causal), s)


def _kv_shape(shape, kv_heads=0, kv_len=0) -> tuple:
    """k's and v's shape for q's `shape` [B, H, S, D]: kv_heads heads and kv_len keys where
    they are not 0."""
    return (shape[0], kv_heads or shape[1], kv_len or shape[2], shape[3])


def _random_operands(shape, device, training, mask=(), kv_heads=0, kv_len=0):
    """q, k, v, dout of `shape` (k and v of _kv_shape), and a mask of `mask` = (shape, dtype)
    (about one score in ten masked) or None."""
    g = torch.Generator(device=device).manual_seed(0)
    kv = _kv_shape(shape, kv_heads, kv_len)
    ops = [torch.randn(s, device=device, generator=g).requires_grad_(training)
           for s in (shape, kv, kv, shape)]
    if not mask:
        return ops + [None]
    keep = torch.rand(mask[0], device=device, generator=g) > 0.1
    return ops + [keep if mask[1] == torch.bool else additive_mask(keep)]


def timed_choice(shape, device, is_causal: bool, scale, training: bool, mask=(),
                 kv_heads: int = 0, kv_len: int = 0) -> str:
    """'' where gemmfuse's attention timed at least as fast as PyTorch's SDPA for q, k, v of
    `shape` on `device` (the forward, and the backward where the graph trains), else why PyTorch
    runs the call (route_timer.timed_choice: once per signature, on fresh random operands)."""
    from . import route_timer
    if not route_timer.timed_routes_on(device):
        return ""
    q, k, v, go, m = _random_operands(shape, device, training, mask, kv_heads, kv_len)

    def call(fn):
        def run():
            with torch.set_grad_enabled(training):
                out = fn(q, k, v, attn_mask=m, is_causal=is_causal, scale=scale,
                         enable_gqa=bool(kv_heads))
                return torch.autograd.grad(out, (q, k, v), go) if training else out
        return run
    key = ("captured sdpa", tuple(shape), device, bool(is_causal), scale, bool(training), mask,
           kv_heads, kv_len)
    why = route_timer.timed_choice(key, call(scaled_dot_product_attention),
                                   call(F.scaled_dot_product_attention), q)
    return why + (" (forward and backward)" if why and training else "")


def choice(shape, device, is_causal: bool, scale, training: bool, precision: str,
           mask=(), kv_heads: int = 0, kv_len: int = 0) -> str:
    """'' where a captured SDPA call of q of `shape`, k and v of _kv_shape (and a mask of
    `mask` = (shape, dtype), or ()) runs as scaled_dot_product_attention here, else why the
    model's own call stays: the precision, the device, the kernels' routes, then (on a GPU)
    the timing."""
    from .runtime import always_fuse
    if precision == "tf32":
        return "tf32 precision (PyTorch's SDPA is as fast and as accurate)"
    if device.type != "cuda":
        return "" if always_fuse() else f"attention on {device.type} (gemmfuse's kernels are CUDA's)"
    q = torch.empty(shape, device=device, requires_grad=training)
    k = torch.empty(_kv_shape(shape, 0, kv_len), device=device)  # (grouped k and v: repeated)
    m = additive_mask(torch.ones(mask[0], dtype=torch.bool, device=device)) if mask else None
    why = forward_route(q, k, k, m)
    back = _shape_backward_route(q, k, m) if not why and training else ""
    if back:
        why = f"a backward gemmfuse's kernel does not take ({back})"
    return why or timed_choice(shape, device, is_causal, scale, training, mask, kv_heads, kv_len)

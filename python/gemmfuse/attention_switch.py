"""fp32 attention inside ``gemmfuse.fp32_matmul()``: PyTorch's memory-efficient attention
(``aten._scaled_dot_product_efficient_attention`` and its backward op, what
``F.scaled_dot_product_attention`` runs for fp32 CUDA tensors) on split fp16 products
(``gemmfuse::sdpa_f16x3``, ``gemmfuse::sdpa_f16x3_backward``). The forward returns that op's
outputs, the log-sum-exp in its layout, so either backward reads either forward's. An additive
mask (``attn_bias``, what SDPA makes of attn_mask) is read in place. What the kernels do not take
yet runs as PyTorch runs it, with the reason: dropout, a mask that needs a gradient, values of
another head dim than the keys', no keys, head dims other than 64, 96 and 128. Queries and
keys may be of different lengths.
Each direction is timed against PyTorch's op once per signature on a GPU
(route_timer.timed_choice), and the faster one runs."""
from __future__ import annotations

import torch

from . import _lib, route_timer

aten = torch.ops.aten


def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def efficient_attention(mode, args, kwargs):
    """The mode's handler: ((out, lse, seed, offset), "") where gemmfuse runs the forward, else
    (None, why)."""
    q, k, v, bias = args[0], args[1], args[2], _arg(args, kwargs, 3, "attn_bias", None)
    compute_lse = _arg(args, kwargs, 4, "compute_log_sumexp", False)
    dropout = _arg(args, kwargs, 5, "dropout_p", 0.0)
    causal = _arg(args, kwargs, 6, "is_causal", False)
    scale = kwargs.get("scale")
    s = float(scale) if scale is not None else q.shape[-1] ** -0.5
    why = _declines(mode, q, dropout) or _lib.ops().sdpa_f16x3_route(q, k, v, bias)
    ours = lambda: _lib.ops().sdpa_f16x3(q, k, v, bias, bool(causal), s)  # noqa: E731
    theirs = lambda: aten._scaled_dot_product_efficient_attention(*args, **kwargs)  # noqa: E731
    why = why or route_timer.timed_choice(_key("forward", q, k, bias, causal, s), ours, theirs, q)
    if why:
        return None, why
    out, lse = ours()
    if not compute_lse:
        lse = lse.new_empty((q.shape[0], q.shape[1], 0))
    # No dropout: PyTorch's op returns empty CPU scalars for its RNG state then.
    seed, offset = torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)
    return (out, lse, seed, offset), ""


def _declines(mode, q, dropout) -> str:
    why = "" if q.device.type in mode.devices else f"attention on {q.device.type}"
    if not why and mode.precision == "tf32":
        why = "tf32 precision (PyTorch's kernel is as fast and as accurate)"
    if not why and dropout:
        why = "dropout (not yet on gemmfuse's kernel)"
    return why


def efficient_attention_backward(mode, args, kwargs):
    """The mode's handler for the backward op: ((dq, dk, dv, None), "") where gemmfuse runs
    it, else (None, why)."""
    go, q, k, v, bias, out, lse = args[:7]
    dropout = _arg(args, kwargs, 9, "dropout_p", 0.0)
    wanted = _arg(args, kwargs, 10, "grad_input_mask", [True] * 4)
    causal = _arg(args, kwargs, 11, "is_causal", False)
    scale = kwargs.get("scale")
    s = float(scale) if scale is not None else q.shape[-1] ** -0.5
    why = _declines(mode, q, dropout) or _lib.ops().sdpa_f16x3_backward_route(
        go, q, k, v, bias, out, lse)
    if not why and bias is not None and len(wanted) > 3 and wanted[3]:
        why = "the mask's gradient (gemmfuse's backward gives none)"
    ours = lambda: _lib.ops().sdpa_f16x3_backward(go, q, k, v, bias, out, lse, bool(causal), s)  # noqa: E731
    theirs = lambda: aten._scaled_dot_product_efficient_attention_backward(*args, **kwargs)  # noqa: E731
    why = why or route_timer.timed_choice(_key("backward", q, k, bias, causal, s), ours, theirs, q)
    if why:
        return None, why
    dq, dk, dv = ours()
    return (dq, dk, dv, None), ""


def _key(direction, q, k, bias, causal, scale) -> tuple:
    """A timed choice's signature: the direction, q's device, shape and strides, k's shape (its
    keys' count may differ from q's), the masks."""
    mask = None if bias is None else (tuple(bias.shape), bias.stride())
    return ("sdpa", direction, q.device, q.shape, q.stride(), k.shape, mask, bool(causal), scale)

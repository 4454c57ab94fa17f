"""fp32 attention inside ``gemmfuse.fp32_matmul()``: PyTorch's memory-efficient attention
(``aten._scaled_dot_product_efficient_attention`` and its backward op, what
``F.scaled_dot_product_attention`` runs for fp32 CUDA tensors) on split fp16 products
(``gemmfuse::sdpa_f16x3``, ``gemmfuse::sdpa_f16x3_backward``). The forward returns that op's
outputs, the log-sum-exp in its layout. A backward runs on the side its forward ran (the
forward's choice is kept per signature): each side's backward recomputes the scores as its own
forward did, so that P = exp(S - LSE) is a consistent softmax (attention.py's module docstring
says what a mixed pair would cost). An additive mask (``attn_bias``, what SDPA makes of
attn_mask) is read in place. What the kernels do not take yet runs as PyTorch runs it, with the
reason: dropout, a mask that needs a gradient, values of another head dim than the keys', no
keys, head dims other than 64, 96 and 128. Queries and keys may be of different lengths.
The forward is timed against PyTorch's op once per signature on a GPU
(route_timer.timed_choice), with its backward where it returns a log-sum-exp (autograd records
it), and the faster side runs."""
from __future__ import annotations

import torch

from . import _lib, route_timer

aten = torch.ops.aten


def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


# Whether each forward signature (_key("side", ...)) ran on gemmfuse's kernel: its backward
# runs on the same side.
_FORWARD_OURS: dict[tuple, bool] = {}


def efficient_attention(mode, args, kwargs):
    """The mode's handler: ((out, lse, seed, offset), "") where gemmfuse runs the forward, else
    (None, why). With a log-sum-exp asked for (autograd records the call), gemmfuse runs it only
    where its backward takes the call too, timed with it."""
    q, k, v, bias = args[0], args[1], args[2], _arg(args, kwargs, 3, "attn_bias", None)
    compute_lse = _arg(args, kwargs, 4, "compute_log_sumexp", False)
    dropout = _arg(args, kwargs, 5, "dropout_p", 0.0)
    causal = _arg(args, kwargs, 6, "is_causal", False)
    scale = kwargs.get("scale")
    s = float(scale) if scale is not None else q.shape[-1] ** -0.5
    why = _declines(mode, q, dropout) or _lib.ops().sdpa_f16x3_route(q, k, v, bias)
    if not why and compute_lse:
        back = _lib.ops().sdpa_f16x3_backward_route(q, q, k, v, bias, q, q.select(-1, 0))
        why = back and f"its backward: {back}"
    ours = lambda: _lib.ops().sdpa_f16x3(q, k, v, bias, bool(causal), s)  # noqa: E731
    theirs = lambda: aten._scaled_dot_product_efficient_attention(*args, **kwargs)  # noqa: E731
    if not why:
        direction = "forward and backward" if compute_lse else "forward"
        timed = _with_backward(q, k, v, bias, causal, s) if compute_lse else (ours, theirs)
        why = route_timer.timed_choice(_key(direction, q, k, bias, causal, s), *timed, q)
    _FORWARD_OURS[_key("side", q, k, bias, causal, s)] = not why
    if why:
        return None, why
    out, lse = ours()
    if not compute_lse:
        lse = lse.new_empty((q.shape[0], q.shape[1], 0))
    # No dropout: PyTorch's op returns empty CPU scalars for its RNG state then.
    seed, offset = torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)
    return (out, lse, seed, offset), ""


def _with_backward(q, k, v, bias, causal, s):
    """Each side's forward then its backward, as the route timer times them (q stands in for
    the output's gradient: random values of its shape)."""
    def ours():
        out, lse = _lib.ops().sdpa_f16x3(q, k, v, bias, bool(causal), s)
        return _lib.ops().sdpa_f16x3_backward(q, q, k, v, bias, out, lse, bool(causal), s)

    def theirs():
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, bool(causal), scale=s)
        return aten._scaled_dot_product_efficient_attention_backward(
            q, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False],
            bool(causal), scale=s)
    return ours, theirs


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
    why = _declines(mode, q, dropout)
    if not why and not _FORWARD_OURS.get(_key("side", q, k, bias, causal, s), False):
        why = "its forward ran in PyTorch (a backward reads its own side's log-sum-exp)"
    why = why or _lib.ops().sdpa_f16x3_backward_route(go, q, k, v, bias, out, lse)
    if not why and bias is not None and len(wanted) > 3 and wanted[3]:
        why = "the mask's gradient (gemmfuse's backward gives none)"
    if why:
        return None, why
    dq, dk, dv = _lib.ops().sdpa_f16x3_backward(go, q, k, v, bias, out, lse, bool(causal), s)
    return (dq, dk, dv, None), ""


def _key(direction, q, k, bias, causal, scale) -> tuple:
    """A timed choice's signature: the direction, q's device, shape and strides, k's shape (its
    keys' count may differ from q's), the masks."""
    mask = None if bias is None else (tuple(bias.shape), bias.stride())
    return ("sdpa", direction, q.device, q.shape, q.stride(), k.shape, mask, bool(causal), scale)

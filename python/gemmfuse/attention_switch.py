"""fp32 attention inside ``gemmfuse.fp32_matmul()``: the forward of PyTorch's memory-efficient
attention (``aten._scaled_dot_product_efficient_attention``, what ``F.scaled_dot_product_
attention`` runs for fp32 CUDA tensors) on split fp16 products (``gemmfuse::sdpa_f16x3``). It
returns that op's outputs, the log-sum-exp in its layout, so PyTorch's backward, which
recomputes the probabilities from Q, K and the LSE, runs unchanged. What the kernel does not
take yet runs as PyTorch runs it, with the reason: an attention mask, dropout, queries and
keys of different lengths, head dims other than 64 and 128."""
from __future__ import annotations

import torch

from . import _lib


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
    why = ("" if q.device.type in mode.devices else f"attention on {q.device.type}")
    if not why and mode.precision == "tf32":
        why = "tf32 precision (PyTorch's kernel is as fast and as accurate)"
    if not why and bias is not None:
        why = "an attention mask (not yet on gemmfuse's kernel)"
    if not why and dropout:
        why = "dropout (not yet on gemmfuse's kernel)"
    why = why or _lib.ops().sdpa_f16x3_route(q, k, v)
    if why:
        return None, why
    out, lse = _lib.ops().sdpa_f16x3(q, k, v, bool(causal),
                                     float(scale) if scale is not None else q.shape[-1] ** -0.5)
    if not compute_lse:
        lse = lse.new_empty((q.shape[0], q.shape[1], 0))
    # No dropout: PyTorch's op returns empty CPU scalars for its RNG state then.
    seed, offset = torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)
    return (out, lse, seed, offset), ""

"""An LM head's Linear and cross-entropy loss without the [M, V] logits:

    loss = gemmfuse.linear_cross_entropy(hidden, lm_head.weight, target)   # [..., K], [V, K], [...]
    loss.backward()

computes ``F.cross_entropy(F.linear(x, weight, bias).view(-1, V), target.view(-1), ...)``
(reduction "none": one loss per element of ``target``, in its shape), forward and backward,
with the logits made a chunk of rows at a time (a chunk's fp32 logits within 256 MiB). Where
autograd records, the forward also computes the gradients of x, weight and bias in the same
loop (the logits' gradient is known there), and the backward scales them by grad_output; for
reduction "none" the backward computes each chunk's logits again. Everything that computes is
C++ (``gemmfuse::linear_cross_entropy``, bindings/linear_cross_entropy.cpp): each chunk's
products run on gemmfuse's GEMM in the given precision. fp32 inputs only: other dtypes, and
calls without the operator library, run as PyTorch runs them.

W's preparation is kept between calls, per version of W: in-place updates (optimizer steps,
fused ones included, load_state_dict) are seen; writes through ``W.data`` are not (call
``torch.autograd.graph.increment_version(W)`` after them).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import _lib
from .runtime import PRECISIONS, _watch_optimizer_steps

REDUCTIONS = ("mean", "sum", "none")


class _LinearCrossEntropy(torch.autograd.Function):
    """The differentiable op over 2-D x and 1-D target (linear_cross_entropy flattens)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, label_smoothing, reduction,
                precision, chunk_rows):
        ops = torch.ops.gemmfuse  # loaded: linear_cross_entropy checked it
        with_grads = reduction != "none"
        loss, dx, dw, db = ops.linear_cross_entropy(x, weight, bias, target, ignore_index,
                                                    label_smoothing, reduction, precision,
                                                    chunk_rows, with_grads)
        ctx.args = (ignore_index, label_smoothing, reduction, precision, chunk_rows)
        ctx.has_bias = bias is not None
        if with_grads:  # the gradients for a unit grad_output
            ctx.save_for_backward(dx, dw, db)
        else:
            ctx.save_for_backward(x, weight, bias, target)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if ctx.args[2] != "none":
            dx, dw, db = (t * grad for t in ctx.saved_tensors)
        else:
            x, weight, bias, target = ctx.saved_tensors
            dx, dw, db = torch.ops.gemmfuse.linear_cross_entropy_backward(
                grad, x, weight, bias, target, *ctx.args)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dw if need[1] else None,
                db if need[2] and ctx.has_bias else None, None, None, None, None, None, None)


def _rows(x):
    """x [..., K] as [M, K] (reshape(-1, K) is ambiguous for K = 0)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _checked(x, weight, target, reduction, precision):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if precision not in PRECISIONS:
        raise ValueError(f"gemmfuse.linear_cross_entropy: precision must be one of {PRECISIONS}, "
                         f"got {precision!r}")
    if x.dim() < 1 or tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"gemmfuse.linear_cross_entropy: target of shape {tuple(target.shape)} "
                         f"for x of shape {tuple(x.shape)} (expected x's shape without its last dim)")


@torch._dynamo.assume_constant_result
def _library_ready() -> bool:
    """Whether the operator library is loaded (loading it on first use), with gemmfuse's
    optimizer-step hook installed: W's preparation (its split parts on CUDA) is kept per version
    of W, and fused optimizers write parameters without bumping it, so the hook does. Under
    torch.compile it runs once, while tracing, and the graph holds its answer."""
    if not _lib.available():
        return False
    _watch_optimizer_steps()
    return True


def _fused(x, weight, bias) -> bool:
    """Whether the C++ op takes the call: fp32 tensors and the library loaded."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return all(t.dtype == torch.float32 for t in tensors) and _library_ready()


def linear_cross_entropy(x, weight, target, bias=None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean",
                         precision: str = "fp32", chunk_rows: int | None = None):
    """``F.cross_entropy(F.linear(x, weight, bias), target, ...)`` for x [..., K], weight
    [V, K], bias [V] or None and int64 class indices ``target`` [...], without the [M, V]
    logits. ``precision``: "fp32" (default), "fast" or "tf32", as elsewhere in gemmfuse.
    ``chunk_rows``: rows per chunk (default: as many as keep a chunk's fp32 logits within
    256 MiB). Not taken (PyTorch runs it): other dtypes, or no operator library."""
    _checked(x, weight, target, reduction, precision)
    x2, t1 = _rows(x), target.reshape(-1)
    if not _fused(x, weight, bias):
        loss = F.cross_entropy(F.linear(x2, weight, bias), t1, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction=reduction)
    else:
        args = (ignore_index, float(label_smoothing), reduction, precision, int(chunk_rows or 0))
        records = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias))
        if records:
            loss = _LinearCrossEntropy.apply(x2, weight, bias, t1, *args)
        else:
            loss = torch.ops.gemmfuse.linear_cross_entropy(x2, weight, bias, t1, *args, False)[0]
    return loss.reshape(target.shape) if reduction == "none" else loss


def describe(x, weight, bias=None, precision: str = "fp32", chunk_rows: int | None = None) -> str:
    """How linear_cross_entropy runs for these inputs: its chunks, and where each product of a
    chunk runs (gemmfuse's GEMM or at::mm) and why."""
    return _lib.ops().linear_cross_entropy_describe(_rows(x), weight, bias,
                                                    precision, int(chunk_rows or 0))

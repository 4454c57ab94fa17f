"""Autograd for the fused op. ``gemmfuse::train_forward`` (the forward of a chain's training
plan, which also returns what its backward needs) has ``gemmfuse::train_backward`` as its
derivative, registered with torch.library: to autograd, torch.compile, torch.export and
DistributedDataParallel it is an ordinary differentiable op. The chain runtime calls it while
autograd records; under ``torch.no_grad()`` it calls ``gemmfuse::run``, which saves nothing.
"""
from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register the derivative once the operator library is loaded."""
    global _registered
    if _registered:
        return
    with _lock:
        if not _registered:
            torch.library.register_autograd("gemmfuse::train_forward", _backward,
                                            setup_context=_setup_context)
            _registered = True


def _setup_context(ctx, inputs, output):
    spec, x, weight, bias, operands, state, precision = inputs
    _, saved = output
    ctx.spec, ctx.precision = spec, precision
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias, saved, *operands)
    # The running statistics: an eval BatchNorm's backward reads them; kept out of
    # save_for_backward, whose version check a training BatchNorm's update (after this forward)
    # would trip.
    ctx.state = list(state)


def _backward(ctx, grad_out, _grad_saved):
    x, weight, bias, saved, *operands = ctx.saved_tensors
    state = ctx.state
    need = ctx.needs_input_grad  # (spec, x, weight, bias, [operands], [state], precision)
    needs = [bool(need[1]), bool(need[2]), bool(ctx.has_bias and need[3])] + [bool(n) for n in need[4]]
    grads = torch.ops.gemmfuse.train_backward(ctx.spec, grad_out.contiguous(), x, weight, bias,
                                              list(operands), list(state), saved,
                                              ctx.precision, needs)
    dx, dw, db, *dops = [g if n else None for g, n in zip(grads, needs)]
    return (None, dx, dw, db, dops, [None] * len(state), None)


def train_forward(spec, x, weight, bias, operands, state, precision):
    """(out, saved) of the fused op, differentiable."""
    return torch.ops.gemmfuse.train_forward(spec, x, weight, bias, operands, state, precision)

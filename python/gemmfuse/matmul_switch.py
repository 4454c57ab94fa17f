"""fp32 matrix products of code that is not captured, on gemmfuse's fp32 GEMM:

    with gemmfuse.fp32_matmul():              # or gemmfuse.set_fp32_matmul(True)
        loss = model(x).sum(); loss.backward()

Inside it, every 2-D fp32 ``mm`` and ``addmm`` (what ``nn.Linear``, ``F.linear``, ``@`` and
``torch.matmul`` on matrices come to at PyTorch's dispatcher, and what their backward
formulas call) on a chosen device type is a candidate for ``gemmfuse::linear``: a Linear with
W = bᵀ, whose kernel the C++ planner and executor pick as for a captured chain. The switch is
a ``TorchDispatchMode``: it sits below autograd, so the gradients' products run through it
too, and it changes no code. W's preparation (its split parts) is kept per weight version
where W is a parameter; any other right operand (an activation, a gradient) is prepared for
its call alone (``keep_weight=False``).

Batched fp32 products, ``bmm`` and ``baddbmm`` (what ``torch.matmul`` and ``@`` with batch
dimensions on both operands and two-operand ``einsum`` come to, and what bmm's backward
calls), are candidates for ``gemmfuse::bmm``: each product one such Linear, prepared for its
call alone.

Which way a candidate runs: C++ decides first (``gemmfuse::mm_route``, ``gemmfuse::bmm_route``,
product_route.cpp): gemmfuse where the product runs on the split kernel; PyTorch's own call
where gemmfuse would run cuBLAS's GEMM or its small-M kernel, unless PyTorch's GEMM is set to
TF32 (fp32's promise keeps it on gemmfuse's fp32 cuBLAS call then). Then, on a GPU, the first
call of each signature (shapes, strides, precision, whether W is a kept parameter) times both
ways (route_timer) and the faster runs from then on.

What it does not take runs as PyTorch runs it, counted with the reason (``counts()``):
other dtypes, ``addmm`` and ``baddbmm`` with ``beta`` or ``alpha`` other than 1, an
``addmm`` bias that is not one row, products off the split kernel or timed slower there
(CUDA), empty products.
"""
from __future__ import annotations

import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _lib, attention_switch, route_timer
from .runtime import PRECISIONS, _watch_optimizer_steps

aten = torch.ops.aten
FUSED = "gemmfuse"

_counts: Counter = Counter()
_counts_lock = threading.Lock()


def counts() -> dict:
    """Products seen inside the switch so far, by where they ran: ``"gemmfuse"``, or
    ``"PyTorch: <reason>"``."""
    with _counts_lock:
        return dict(_counts)


def reset_counts() -> None:
    with _counts_lock:
        _counts.clear()


def _count(where: str) -> None:
    with _counts_lock:
        _counts[where] += 1


def _operands_decline(a, b, devices) -> str:
    """'' when a and b are fp32 on one device of a chosen type, else why the switch leaves
    their product to PyTorch."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        return f"{a.dtype} operands (the switch is for fp32)"
    if a.device.type not in devices or b.device != a.device:
        return f"operands on {a.device.type} (the switch covers {', '.join(devices)})"
    return ""


def _declines(a, b, devices) -> str:
    """'' when gemmfuse takes the product a @ b (2-D, fp32, on a chosen device), else why not."""
    why = _operands_decline(a, b, devices)
    if why:
        return why
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return "not a matrix product of matching shapes"
    if a.numel() == 0 or b.numel() == 0:
        return "an empty product"
    return ""


def _is_parameter_transpose(b) -> bool:
    """Whether b is W.T for a contiguous 2-D parameter W (an nn.Parameter, frozen or not, or
    a leaf that requires grad)."""
    w = b._base
    if w is None or not (isinstance(w, torch.nn.Parameter) or (w.is_leaf and w.requires_grad)):
        return False
    return (w.dim() == 2 and w.is_contiguous() and b.t().is_contiguous()
            and b.t().data_ptr() == w.data_ptr() and b.t().shape == w.shape)


def _linear(a, b, bias, precision, keep):
    """a @ b (+ bias) as gemmfuse's Linear: x = a, W = bᵀ ([N, K], contiguous: a weight that
    F.linear passed transposed is already), one row of bias. W's preparation is kept only
    where W is a parameter (`keep`: _is_parameter_transpose(b); the executor keeps one per
    weight, and a right operand that changes every call would add one each call). A kept one
    is keyed on the parameter itself: a view made here, below autograd, has a version counter
    of its own that no update bumps."""
    w = b._base if keep else b.t().contiguous()
    return _lib.ops().linear(a.contiguous(), w, bias, precision, keep)


def _signature(func, precision, *tensors) -> tuple:
    return (func, precision) + tuple(
        (t.device, t.shape, t.stride()) if t is not None else None for t in tensors)


def _product(mode, func, args, kwargs, a, b, bias):
    """a @ b (+ bias) on gemmfuse where C++'s mm_route sends it there and, on a GPU, it timed
    faster at this signature (a kept W's preparation, a parameter's, is part of it); else
    (None, why)."""
    why = _lib.ops().mm_route(a, b, bias, mode.precision)
    if why:
        return None, why
    keep = _is_parameter_transpose(b)
    ours = lambda: _linear(a, b, bias, mode.precision, keep)  # noqa: E731
    key = _signature(func, mode.precision, a, b, bias) + (keep,)
    why = route_timer.timed_choice(key, ours, lambda: func(*args, **kwargs), a)
    return (None, why) if why else (ours(), "")


def _mm(mode, args, kwargs):
    a, b = args[0], args[1]
    why = _declines(a, b, mode.devices)
    return (None, why) if why else _product(mode, aten.mm.default, args, kwargs, a, b, None)


def _addmm(mode, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    why = _declines(a, b, mode.devices)
    if not why and (beta != 1 or alpha != 1):
        why = "addmm with beta or alpha other than 1"
    if not why and not (bias.dtype == torch.float32 and bias.device == a.device
                        and bias.shape in ((b.shape[1],), (1, b.shape[1]))):
        why = "addmm's added term is not one fp32 row of the output's width"
    if why:
        return None, why
    return _product(mode, aten.addmm.default, args, kwargs, a, b, bias.reshape(-1).contiguous())


def _batch_declines(a, b, devices) -> str:
    """'' when a @ b is a batch of products of fp32 operands on a chosen device (3-D), else
    why not: the cheap checks, before C++'s bmm_route."""
    why = _operands_decline(a, b, devices)
    if not why and (a.dim() != 3 or b.dim() != 3):
        why = "not a batch of matrix products"
    return why


def _route(a, b, precision) -> str:
    """C++'s rule (gemmfuse::bmm_route): '' where each product runs on the split kernel, else
    why PyTorch's batched GEMM runs the batch. It also declines shapes gemmfuse::bmm would
    reject and empty batches, so PyTorch runs them (and raises its own errors)."""
    return _lib.ops().bmm_route(a, b, precision)


def _batch(mode, func, args, kwargs, a, b, ours):
    """`ours` (the batch on gemmfuse) where C++'s bmm_route sends it there and, on a GPU, it
    timed faster at this signature; else (None, why)."""
    why = _route(a, b, mode.precision) or route_timer.timed_choice(
        _signature(func, mode.precision, *[t for t in args if isinstance(t, torch.Tensor)]),
        ours, lambda: func(*args, **kwargs), a)
    return (None, why) if why else (ours(), "")


def _bmm(mode, args, kwargs):
    a, b = args[0], args[1]
    why = _batch_declines(a, b, mode.devices)
    if why:
        return None, why
    return _batch(mode, aten.bmm.default, args, kwargs, a, b,
                  lambda: _lib.ops().bmm(a, b, mode.precision))


def _adds_to_batch(added, a, b) -> bool:
    """Whether baddbmm's added term is fp32 on the batches' device and broadcasts to their
    product's shape [B, M, N] (torch.add would broadcast a larger one further)."""
    out = (a.shape[0], a.shape[1], b.shape[2])
    return (added.dtype == torch.float32 and added.device == a.device and added.dim() <= 3
            and all(s in (1, o) for s, o in zip(reversed(added.shape), reversed(out))))


def _baddbmm(mode, args, kwargs):
    """input + b1 @ b2 as the batch on gemmfuse, then torch.add (the mode is off inside
    __torch_dispatch__, so it runs as PyTorch's add, broadcasting input as baddbmm does)."""
    added, a, b = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    why = _batch_declines(a, b, mode.devices)
    if not why and (beta != 1 or alpha != 1):
        why = "baddbmm with beta or alpha other than 1"
    if not why and not _adds_to_batch(added, a, b):
        why = "baddbmm's added term is not fp32 broadcasting to the product's shape"
    if why:
        return None, why
    return _batch(mode, aten.baddbmm.default, args, kwargs, a, b,
                  lambda: torch.add(added, _lib.ops().bmm(a, b, mode.precision)))


_HANDLERS = {aten._scaled_dot_product_efficient_attention.default:
             attention_switch.efficient_attention,
             aten._scaled_dot_product_efficient_attention_backward.default:
             attention_switch.efficient_attention_backward,
             aten.mm.default: _mm, aten.addmm.default: _addmm,
             aten.bmm.default: _bmm, aten.baddbmm.default: _baddbmm}


class Fp32MatmulMode(TorchDispatchMode):
    """The dispatch mode behind ``fp32_matmul``: matrix products go to gemmfuse where it takes
    them, everything else runs as it would."""

    def __init__(self, precision: str = "fp32", devices=("cuda",)):
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"gemmfuse.fp32_matmul: precision must be one of {PRECISIONS}, "
                             f"got {precision!r}")
        self.precision, self.devices = precision, tuple(devices)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **kwargs)
        out, why = handler(self, args, kwargs)
        _count(FUSED if out is not None else f"PyTorch: {why}")
        return out if out is not None else func(*args, **kwargs)


def fp32_matmul(precision: str = "fp32", devices=("cuda",)) -> Fp32MatmulMode:
    """A context manager: fp32 matrix products inside it run on gemmfuse's fp32 GEMM
    (``precision``: "fp32", "fast" or "tf32"; ``devices``: the device types it covers)."""
    _lib.load()
    # A parameter's prepared W is kept across calls, keyed on its version: fused optimizers
    # write parameters without bumping it, so the step hook does.
    _watch_optimizer_steps()
    return Fp32MatmulMode(precision, devices)


_global: list = []  # the mode set_fp32_matmul entered, if any


def set_fp32_matmul(enabled: bool, precision: str = "fp32", devices=("cuda",)) -> None:
    """The global form: from now on (True) or no longer (False), as ``fp32_matmul`` does for
    a block. Turning it off must happen with no other dispatch mode entered after it."""
    if _global:
        _global.pop().__exit__(None, None, None)
    if enabled:
        mode = fp32_matmul(precision, devices)
        mode.__enter__()
        _global.append(mode)

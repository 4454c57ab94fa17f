"""Matrix products of two activations in captured graphs (``a @ b``, ``torch.matmul``,
``torch.bmm``, ``torch.mm``, ``torch.baddbmm``/``addmm``, two-operand ``torch.einsum``: no
weight operand, so no chain starts there) in the graph's precision mode: optimize() and the
torch.compile backend put ``matmul(a, b, ...)`` (or ``einsum``, ``baddbmm``, which call it) in
place of the model's product where gemmfuse's batched product (``gemmfuse::bmm``) timed
faster, and explain says which ran and why.

Each of the three products (the forward's a @ b, the backward's dA = dC bᵀ and dB = aᵀ dC) is
chosen once, at capture, for the captured shapes (C++'s bmm_route, then on a GPU the forward
and backward timed against PyTorch's): the call carries the choices, so nothing is decided
while it runs or while AOTAutograd traces it (gemmfuse::bmm has a Meta kernel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _lib


@dataclass
class ProductSite:
    """One product of two activations: on gemmfuse's GEMM ("fused") or why not."""
    node: str
    form: str
    status: str = "pytorch"
    reason: str = ""
    backward: str = ""  # where the backward's products run, for a fused one
    call: str = "matmul"  # the gemmfuse.products function that runs a fused one


def _bmm(a, b, precision: str, ours: bool):
    return torch.ops.gemmfuse.bmm(a, b, precision) if ours else torch.bmm(a, b)


class _Batched(torch.autograd.Function):
    """a [B, M, K] @ b [B, K, N]; `ours`: (forward, dA, dB) on gemmfuse::bmm or torch.bmm."""

    @staticmethod
    def forward(ctx, a, b, precision, ours):
        ctx.save_for_backward(a, b)
        ctx.precision, ctx.ours = precision, ours
        return _bmm(a, b, precision, ours[0])

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        da = _bmm(g, b.transpose(1, 2), ctx.precision, ctx.ours[1]) if need[0] else None
        db = _bmm(a.transpose(1, 2), g, ctx.precision, ctx.ours[2]) if need[1] else None
        return da, db, None, None


def as_batches(a, b):
    """(a, b, batch) with a as [B, M, K] and b as [B, K, N] over the broadcast batch dims
    `batch` (an operand that broadcasts is expanded and copied: its gradient sums back through
    autograd), else None (a vector, or batch dims that do not broadcast)."""
    if a.dim() < 2 or b.dim() < 2:
        return None
    try:
        batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except RuntimeError:
        return None
    lead = math.prod(batch)
    return (a.expand(*batch, *a.shape[-2:]).reshape(lead, *a.shape[-2:]),
            b.expand(*batch, *b.shape[-2:]).reshape(lead, *b.shape[-2:]), batch)


def matmul(a, b, precision: str = "fp32", ours=(True, True, True)):
    """``a @ b`` for fp32 a [..., M, K] and b [..., K, N] whose leading dims broadcast, each of
    the forward's and the backward's products on gemmfuse::bmm where `ours` says so."""
    batches = as_batches(a, b)
    if batches is None or not _lib.available():
        return torch.matmul(a, b)
    a3, b3, batch = batches
    out = _Batched.apply(a3, b3, precision, tuple(ours))
    return out.reshape(*batch, a.shape[-2], b.shape[-1])


def einsum(equation: str, a, b, precision: str = "fp32", ours=(True, True, True)):
    """``torch.einsum(equation, a, b)`` as one batched product (einsum_plan), each of its
    three products on gemmfuse::bmm where `ours` says so; torch.einsum where the plan declines."""
    from . import einsum_plan
    if einsum_plan.why_not(equation, a.shape, b.shape):
        return torch.einsum(equation, a, b)
    p = einsum_plan.plan(equation, a.dim(), b.dim())
    a3, b3, ap, bp = p.operands(a, b)
    return p.output(matmul(a3, b3, precision, ours), ap, bp)


def baddbmm(input, b1, b2, beta=1, alpha=1, precision: str = "fp32", ours=(True, True, True)):
    """``torch.baddbmm`` and ``torch.addmm`` of two activations: beta input + alpha (b1 @ b2),
    the product by ``matmul`` (beta = 0 ignores input, NaN included, as PyTorch does)."""
    out = matmul(b1, b2, precision, ours)
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    return out + (input if beta == 1 else input * beta)


def routes(a, b, precision: str) -> tuple:
    """C++'s rule (gemmfuse::bmm_route) for the forward's product and the backward's two: ''
    where it runs on gemmfuse, else why torch.bmm does."""
    a3, b3, _ = as_batches(a, b)
    g = torch.empty(a3.shape[0], a3.shape[1], b3.shape[2], device=a.device)
    ops = _lib.ops()
    return (ops.bmm_route(a3, b3, precision), ops.bmm_route(g, b3.transpose(1, 2), precision),
            ops.bmm_route(a3.transpose(1, 2), g, precision))


def choice(a_shape, b_shape, device, training: bool, precision: str):
    """('', ours) where the captured product of these shapes runs as ``matmul(..., ours)``, else
    (why the model's own product stays, None): the precision, the shapes, the device, C++'s
    route of the forward's product, then on a GPU the call timed against torch.matmul."""
    from . import route_timer
    from .runtime import always_fuse
    if precision == "tf32":
        return "tf32 precision (PyTorch's GEMM at TF32 is the mode's product)", None
    a = torch.randn(a_shape, device=device, requires_grad=training)
    b = torch.randn(b_shape, device=device, requires_grad=training)
    if as_batches(a, b) is None:
        return "a vector operand, or batch dims that do not broadcast", None
    if device.type == "cpu" and not always_fuse():
        return "on the CPU (PyTorch's GEMM is the same BLAS there)", None
    why = routes(a, b, precision)
    if why[0]:
        return why[0], None
    ours = tuple(not w for w in why)

    def call(fn):
        def run():
            with torch.set_grad_enabled(training):
                out = fn(a, b)
                return torch.autograd.grad(out, (a, b), torch.ones_like(out)) if training else out
        return run
    key = ("captured product", tuple(a_shape), tuple(b_shape), device, precision, training)
    slower = route_timer.timed_choice(key, call(lambda x, y: matmul(x, y, precision, ours)),
                                      call(torch.matmul), a)
    return (slower, None) if slower else ("", ours)

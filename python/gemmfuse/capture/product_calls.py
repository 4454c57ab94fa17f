"""Reading a captured product of two activations: which gemmfuse.products call takes its place
and the batched product [B, M, K] @ [B, K, N] it runs (the shapes its choice is made for).

Forms: ``a @ b``, ``torch.matmul``/``bmm``/``mm`` (and the methods); a two-operand
``torch.einsum`` the einsum plan takes; ``torch.baddbmm``/``addmm`` (and the methods) with
constant beta and alpha and an input that broadcasts to the product."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from .linear_forms import _MATMUL_FUNCS, _MATMUL_METHODS
from .values import TInfo, node_info

_MATMULS = _MATMUL_FUNCS | {torch.bmm}  # the matrix products of linear_forms, and bmm
_MATMUL_OR_BMM_METHODS = _MATMUL_METHODS | {"bmm"}


@dataclass
class ProductCall:
    target: Callable   # the gemmfuse.products function the node becomes
    args: tuple        # its arguments before precision and ours
    operands: tuple    # the tensor nodes, all fp32
    shapes: tuple      # (a, b) of the batched product its choice is timed on


def _sizes(n) -> list:
    return [torch.fx.experimental.symbolic_shapes.size_hint(d) for d in node_info(n).shape]


def read_product(node: fx.Node):
    """(ProductCall, '') for a product gemmfuse.products runs, else (None, why not)."""
    from .. import products
    fn = node.op == "call_function"
    if (fn and node.target in _MATMULS) or (not fn and node.target in _MATMUL_OR_BMM_METHODS):
        if len(node.args) != 2 or node.kwargs:
            return None, "a product with extra arguments"
        return _checked(ProductCall(products.matmul, node.args, node.args, ()))
    if fn and node.target is torch.einsum:
        return _einsum(node, products.einsum)
    if (fn and node.target in (torch.baddbmm, torch.addmm)) or node.target in ("baddbmm", "addmm"):
        return _baddbmm(node, products.baddbmm)
    return None, "not a product gemmfuse.products runs"


def _checked(call: ProductCall):
    infos = [node_info(t) for t in call.operands]
    if not all(isinstance(t, fx.Node) and isinstance(i, TInfo) and i.dtype == torch.float32
               for t, i in zip(call.operands, infos)):
        return None, "operands that are not all fp32 tensors with known shapes"
    if not call.shapes:
        call.shapes = tuple(_sizes(n) for n in call.operands)
    return call, ""


def _einsum(node: fx.Node, target):
    from .. import einsum_plan
    eq, *ops = node.args
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or len(ops) != 2 or node.kwargs:
        return None, "an einsum of other than two operands"
    call, why = _checked(ProductCall(target, (eq, *ops), tuple(ops), ()))
    if why:
        return None, why
    a, b = call.shapes
    why = einsum_plan.why_not(eq, a, b)
    if why:
        return None, why
    p = einsum_plan.plan(eq, len(a), len(b))
    a3, b3, _, _ = p.operands(torch.empty(a, device="meta"), torch.empty(b, device="meta"))
    call.shapes = (list(a3.shape), list(b3.shape))
    return call, ""


def _baddbmm(node: fx.Node, target):
    if len(node.args) != 3 or set(node.kwargs) - {"beta", "alpha"}:
        return None, "a baddbmm/addmm with extra arguments"
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    if not all(isinstance(v, (int, float)) for v in (beta, alpha)):
        return None, "beta or alpha computed at run time"
    inp, b1, b2 = node.args
    call, why = _checked(ProductCall(target, (inp, b1, b2, beta, alpha), (inp, b1, b2), ()))
    if why:
        return None, why
    i, a, b = call.shapes
    out = [*a[:-1], b[-1]]
    try:
        fits = len(a) == len(b) and a[:-2] == b[:-2] and list(torch.broadcast_shapes(i, out)) == out
    except RuntimeError:
        fits = False
    if not fits:
        return None, "operands whose shapes PyTorch's baddbmm/addmm would broadcast or refuse"
    call.shapes = (a, b)
    return call, ""

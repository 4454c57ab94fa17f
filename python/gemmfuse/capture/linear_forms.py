"""Every way a model writes a Linear, as the start of a chain: ``nn.Linear``, ``F.linear``,
``x @ W.t()`` / ``torch.matmul`` / ``torch.mm`` with the weight transposed (``W.t()``,
``W.T``, ``W.transpose(0, 1)``, ``W.permute(1, 0)``, ...), ``torch.addmm(b, x, W.t())``, and a
weight stored as [in, out] (``x @ W``)."""
from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .chain import Unsupported, bind
from .values import AttrRef, Source, TInfo, node_info

LINEAR_FUNCS = {F.linear}
_MATMUL_FUNCS = {operator.matmul, torch.matmul, torch.mm}
_MATMUL_METHODS = {"matmul", "mm", "__matmul__"}
_MM_ONLY = {torch.mm, "mm"}  # 2-d inputs only (torch.mm raises on others)
# Every matrix product a graph can hold (explain lists those that start no chain).
_PRODUCT_FUNCS = _MATMUL_FUNCS | {torch.bmm, torch.baddbmm, torch.addmm, torch.einsum}
_PRODUCT_METHODS = _MATMUL_METHODS | {"bmm", "baddbmm", "addmm"}


@dataclass
class LinearParts:
    x: fx.Node
    weight: Source          # [N, K], or [K, N] when weight_kn
    bias: Optional[Source]
    module: Optional[str]   # the nn.Linear's qualified name
    weight_kn: bool = False  # the weight is stored [in, out]: the chain reads its transpose
    form: str = "nn.Linear"


def _dims(v, rank=2):
    return tuple(d % rank if isinstance(d, int) else d for d in v)


def untransposed(node) -> Optional[fx.Node]:
    """The 2-d tensor that `node` transposes (W for W.t(), W.T, W.transpose(0, 1), ...), or
    None when `node` is not such a transpose."""
    if not isinstance(node, fx.Node) or not node.args:
        return None
    src, rest = node.args[0], tuple(node.args[1:])
    if not isinstance(src, fx.Node):
        return None
    inf = node_info(src)
    if not isinstance(inf, TInfo) or inf.rank != 2 or node.kwargs:
        return None
    if node.op == "call_method":
        return src if _transposes_method(node.target, rest) else None
    if node.op == "call_function":
        return src if _transposes_function(node.target, rest) else None
    return None


def _swaps(rest: tuple) -> bool:
    return len(rest) == 2 and set(_dims(rest)) == {0, 1}


def _transposes_method(t, rest: tuple) -> bool:
    """Whether Tensor.<t>(*rest) transposes a 2-d tensor."""
    if t == "t":
        return not rest
    if t in ("transpose", "swapaxes", "swapdims"):
        return _swaps(rest)
    if t == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        return _dims(dims) == (1, 0)
    return False


def _transposes_function(t, rest: tuple) -> bool:
    """Whether t(tensor, *rest) transposes a 2-d tensor (getattr(W, "T") included)."""
    if t is builtins.getattr:
        return rest in (("T",), ("mT",))
    if t is torch.t:
        return not rest
    if t in (torch.transpose, torch.swapaxes, torch.swapdims):
        return _swaps(rest)
    return t is torch.permute and len(rest) == 1 and _dims(rest[0]) == (1, 0)


def _weight(w, what: str):
    """(weight source, weight_kn) for the second operand of a matrix product."""
    if not isinstance(w, fx.Node):
        raise Unsupported(f"{what}: the weight is not a tensor")
    src = untransposed(w)
    if src is not None:
        return src, False
    inf = node_info(w)
    if not isinstance(inf, TInfo) or inf.rank != 2:
        return None, False  # a batched product, not a Linear
    return w, True


def linear_parts(node: fx.Node, gm: fx.GraphModule) -> Optional[LinearParts]:
    """The parts of a Linear that `node` computes, None when it is no Linear, or raise
    Unsupported when it is one gemmfuse cannot take (with the reason)."""
    if node.op == "call_module":
        return _module_parts(node, gm)
    if node.op == "call_function" and node.target in LINEAR_FUNCS:
        return _functional_parts(node)
    return _matmul_parts(node)


def _module_parts(node: fx.Node, gm: fx.GraphModule) -> Optional[LinearParts]:
    mod = gm.get_submodule(node.target)
    if type(mod) is not nn.Linear:
        return None
    if len(node.args) != 1 or node.kwargs:
        raise Unsupported("Linear called with extra arguments")
    q = node.target
    return LinearParts(node.args[0], AttrRef(f"{q}.weight"),
                       AttrRef(f"{q}.bias") if mod.bias is not None else None, q)


def _functional_parts(node: fx.Node) -> LinearParts:
    a = bind(node, ["input", "weight", "bias"], {"bias": None})
    x, w, b = a["input"], a["weight"], a["bias"]
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
        raise Unsupported("F.linear with non-tensor arguments")
    if b is not None and not isinstance(b, fx.Node):
        raise Unsupported("F.linear bias is not a tensor")
    return LinearParts(x, w, b, None, form="F.linear")


def _product_name(node: fx.Node) -> str:
    """How a product node reads in messages: '@', 'torch.bmm', 'Tensor.mm'."""
    if node.target is operator.matmul:
        return "@"
    prefix = "torch." if node.op == "call_function" else "Tensor."
    return prefix + getattr(node.target, "__name__", node.target)


def product_form(node: fx.Node) -> str:
    """'torch.bmm [2, 8, 32] x [2, 32, 8]' for a matrix product node (its operands' shapes
    where known), '' for any other node."""
    if not ((node.op == "call_function" and node.target in _PRODUCT_FUNCS)
            or (node.op == "call_method" and node.target in _PRODUCT_METHODS)):
        return ""
    shapes = [list(i.shape) for a in node.args
              if isinstance(a, fx.Node) and isinstance(i := node_info(a), TInfo)]
    return _product_name(node) + (" " + " x ".join(map(str, shapes)) if shapes else "")


def _matmul_parts(node: fx.Node) -> Optional[LinearParts]:
    """x @ W.T, torch.mm/matmul, Tensor.mm/matmul and addmm with a 2-d weight (transposed
    or stored [in, out])."""
    is_matmul = ((node.op == "call_function" and node.target in _MATMUL_FUNCS)
                 or (node.op == "call_method" and node.target in _MATMUL_METHODS))
    is_addmm = ((node.op == "call_function" and node.target is torch.addmm)
                or (node.op == "call_method" and node.target == "addmm"))
    if not (is_matmul or is_addmm):
        return None
    name = _product_name(node)
    x, w, b = _addmm_operands(node, name) if is_addmm else _matmul_operands(node, name)
    xinf = node_info(x)
    if not isinstance(x, fx.Node) or not isinstance(xinf, TInfo):
        return None
    if (is_addmm or node.target in _MM_ONLY) and xinf.rank != 2:
        return None  # PyTorch raises for these: leave the call to it
    if xinf.rank < 1:
        return None
    weight, kn = _weight(w, name)
    if weight is None:
        return None
    return LinearParts(x, weight, b, None, weight_kn=kn,
                       form=f"{name} with the weight {'[in, out]' if kn else 'transposed'}")


def _matmul_operands(node: fx.Node, name: str) -> tuple:
    if len(node.args) != 2 or node.kwargs:
        raise Unsupported(f"{name} with extra arguments")
    x, w = node.args
    return x, w, None


def _addmm_operands(node: fx.Node, name: str) -> tuple:
    a = bind(node, ["input", "mat1", "mat2"], {"beta": 1, "alpha": 1})
    if a["beta"] != 1 or a["alpha"] != 1:
        raise Unsupported(f"{name} with beta or alpha other than 1")
    b, x, w = a["input"], a["mat1"], a["mat2"]
    binf = node_info(b)
    if not isinstance(b, fx.Node) or not isinstance(binf, TInfo) or binf.rank != 1:
        raise Unsupported(f"{name}: the added tensor is not a 1-d bias")
    return x, w, b

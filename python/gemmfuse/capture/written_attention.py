"""Attention written out, as minGPT writes it:

    att = (q @ k.transpose(-2, -1)) * scale          # or / d, or no scale (scale 1)
    att = att.masked_fill(causal_mask, float("-inf"))  # optional
    att = F.softmax(att, dim=-1)                     # then dropout of a constant p = 0, optional
    y = att @ v

is the same function as ``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)``.
Matched from the softmax: each intermediate value read only by the next step. The mask is
taken where it is causal: a value of the module's own state (a buffer, an attribute) and
constants only, evaluated once here, equal to ``triu(ones(T, T), 1)`` (broadcast over batch and
heads). A mask that reads the inputs, or another mask, is not taken (the reason says so)."""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .chain import Unsupported, bind
from .values import TInfo, node_info

_SOFTMAX_FUNCS = {F.softmax, torch.softmax}
_MATMUL_FUNCS = {operator.matmul, torch.matmul}
_DROPOUT_FUNCS = {F.dropout, torch.dropout}


def is_softmax_last(node: fx.Node) -> bool:
    """Whether node is a softmax over its input's last dim (no dtype change)."""
    if not (node.op == "call_function" and node.target in _SOFTMAX_FUNCS
            or node.op == "call_method" and node.target == "softmax"):
        return False
    try:
        a = _softmax_args(node)
    except Unsupported:
        return False
    inf = node_info(a["input"])
    return (isinstance(inf, TInfo) and a["dtype"] is None and isinstance(a["dim"], int)
            and a["dim"] % max(inf.rank, 1) == inf.rank - 1)


def _softmax_args(node: fx.Node) -> dict:
    return bind(node, ["input", "dim", "_stacklevel", "dtype"], {"_stacklevel": 3, "dtype": None})


def match_written(gm: fx.GraphModule, softmax: fx.Node, values) -> dict:
    """The parts of written-out attention around `softmax`: {q, k, v, scale, is_causal, out,
    nodes (to erase once `out` is replaced, last first)}; raise Unsupported where it is not
    attention gemmfuse takes, or return None where it is not attention at all."""
    pv = _probabilities_use(softmax)
    if pv is None:
        return None
    scores, mask = _softmax_args(softmax)["input"], None
    nodes = [pv[0], *pv[1], softmax]
    if _is_masked_fill(scores):
        nodes.append(scores)
        mask, scores = scores.args[1], scores.args[0]
    scale, qk = _scale_of(scores)
    if qk is not scores:
        nodes.append(scores)
    q, kt = _matmul_operands(qk)
    if q is None or _transposed_source(kt) is None:
        return None
    nodes.append(qk)
    for n in nodes[1:]:
        if len(n.users) != 1:
            raise Unsupported(f"{n.name} is read elsewhere too (its value would be needed)")
    is_causal = mask is not None and _causal(mask, gm, values, node_info(qk))
    return {"q": q, "k": _transposed_source(kt), "v": pv[2], "scale": scale,
            "is_causal": is_causal, "out": pv[0], "nodes": nodes, "kt": kt}


def _probabilities_use(softmax: fx.Node):
    """(P @ v node, [dropouts between], v) where the softmax's output P reaches one product
    P @ v through dropouts of p = 0 only, else None."""
    between, cur = [], softmax
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if _is_zero_dropout(user) and user.args and user.args[0] is cur:
            between.append(user)
            cur = user
            continue
        a, b = _matmul_operands(user)
        return (user, between[::-1], b) if a is cur else None
    return None


def _is_zero_dropout(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _DROPOUT_FUNCS:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        return isinstance(p, (int, float)) and p == 0
    return False


def _matmul_operands(node: fx.Node):
    if (node.op == "call_function" and node.target in _MATMUL_FUNCS
            or node.op == "call_method" and node.target in ("matmul", "__matmul__")):
        if len(node.args) == 2 and not node.kwargs:
            return node.args
    return None, None


def _transposed_source(node) -> Optional[fx.Node]:
    """k where node is k's last two dims swapped (transpose(-2, -1) and its spellings, .mT)."""
    if not isinstance(node, fx.Node):
        return None
    inf = node_info(node)
    rank = inf.rank if isinstance(inf, TInfo) else 0
    if node.op == "call_method" and node.target == "transpose" or (
            node.op == "call_function" and node.target is torch.transpose):
        dims = {d % rank for d in node.args[1:3] if isinstance(d, int)} if rank else set()
        return node.args[0] if len(node.args) == 3 and dims == {rank - 2, rank - 1} else None
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
        return node.args[0]
    return None


def _is_masked_fill(node: fx.Node) -> bool:
    is_op = (node.op == "call_method" and node.target == "masked_fill"
             or node.op == "call_function" and node.target is torch.masked_fill)
    return is_op and len(node.args) == 3 and node.args[2] == -math.inf


def _scale_of(node: fx.Node):
    """(the scores' scale, the node before it): x * c, c * x, x / c with a constant c, or 1."""
    if node.op == "call_function" and node.target in (operator.mul, operator.truediv, torch.mul,
                                                      torch.div) and len(node.args) == 2:
        a, b = node.args
        div = node.target in (operator.truediv, torch.div)
        if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, fx.Node):
            return (1.0 / b if div else float(b)), a
        if not div and isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, fx.Node):
            return float(a), b
    return 1.0, node


def _causal(mask: fx.Node, gm: fx.GraphModule, values, scores: TInfo) -> bool:
    """True where mask (True: masked out) is the causal mask of the scores' [T, T], else raise."""
    m = evaluate(mask, gm, values)
    T = scores.shape[-1] if isinstance(scores, TInfo) else -1
    if (not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() < 2
            or tuple(m.shape[-2:]) != (T, T) or scores.shape[-2] != T):
        raise Unsupported("a mask that is not a [T, T] bool value of the module's state")
    want = torch.ones(T, T, dtype=torch.bool, device=m.device).triu(1)
    if not bool((m == want).all()):
        raise Unsupported("a mask that is not causal (the kernels take causal masks only)")
    return True


def evaluate(node, gm: fx.GraphModule, values, depth: int = 0):
    """node's value from the module's state and constants alone: get_attr, dynamo's buffer and
    parameter placeholders (`values`: placeholder -> example value), numbers, and ops on them;
    raise Unsupported where it reads anything else (the model's inputs)."""
    if not isinstance(node, fx.Node):
        if isinstance(node, (tuple, list)):
            return type(node)(evaluate(a, gm, values, depth) for a in node)
        if isinstance(node, slice):
            return slice(*(evaluate(x, gm, values, depth) for x in (node.start, node.stop, node.step)))
        return node
    if depth > 12:
        raise Unsupported("a mask computed in too many steps")
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return obj
    if node.op == "placeholder":
        if node not in values:
            raise Unsupported("a mask that reads the model's inputs")
        return values[node]
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if str(name).endswith("_") and not str(name).endswith("__"):
        raise Unsupported(f"a mask computed by an in-place op ({name})")
    args = evaluate(tuple(node.args), gm, values, depth + 1)
    kwargs = {k: evaluate(v, gm, values, depth + 1) for k, v in node.kwargs.items()}
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    raise Unsupported(f"a mask computed by {node.op} {node.target}")

"""LM heads: a Linear whose logits go only to a cross-entropy loss, found before the chain
finder runs (optimize(), "fx" flavour) so that the Linear and the loss become one
``gemmfuse.lm_head.linear_cross_entropy`` call and the [M, V] logits are never made.

Taken: ``F.cross_entropy(L, T, ...)``, an ``nn.CrossEntropyLoss`` module, and
``F.nll_loss(F.log_softmax(L, dim=-1), T, ...)`` (or an ``nn.NLLLoss`` module), where L is a
Linear in any form linear_forms.py reads, maybe flattened to rows first (``.view(-1, V)``,
``.reshape(-1, V)``, ``.flatten(0, -2)``, with ``logits.size(-1)`` / ``logits.shape[-1]`` read
for the view); T holds class indices, one per row. Not taken (with the reason): a class
``weight``, legacy ``size_average``/``reduce``, probability (float) targets, classes on a dim
other than the last, logits (or the log-probabilities) used by anything else, a Linear that
is not fp32."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .chain import Unsupported, bind
from .linear_forms import LinearParts, linear_parts
from .values import AttrRef, TInfo, node_info

_FLATTEN_METHODS = {"view", "reshape", "flatten"}
_FLATTEN_FUNCS = {torch.reshape, torch.flatten}
_LOG_SOFTMAX_FUNCS = {F.log_softmax, torch.log_softmax}
_CE_ARGS = ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
            "label_smoothing"]
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None,
                "reduction": "mean", "label_smoothing": 0.0}


@dataclass
class LMHead:
    """One Linear whose logits reach a cross-entropy loss: fused or why not."""
    linear: str                  # the Linear's node name
    loss: str                    # how the model wrote the loss
    form: str = ""               # how the model wrote the Linear
    in_features: int = 0
    out_features: int = 0
    status: str = "pytorch"      # "fused" | "pytorch"
    reason: str = ""
    plan: str = ""               # lm_head.describe at optimize time (its chunks)


@dataclass
class _Match:
    head: LMHead
    loss: fx.Node
    linear: fx.Node
    parts: LinearParts
    target: fx.Node
    options: dict                # ignore_index, label_smoothing, reduction
    nodes: list = field(default_factory=list)  # erased, in graph order (the loss last)


# On the CPU the chunk loop's transposes and copies cost more than they save (the CPU's
# GEMM is PyTorch's own BLAS either way): the head runs unfused there, in both flavours.
CPU_LM_HEAD = ("on the CPU, F.linear and cross-entropy run it faster unfused (the CPU's "
               "GEMM is PyTorch's BLAS either way; GEMMFUSE_ALWAYS_FUSE=1 fuses it)")


def left_unfused_on(device: torch.device) -> str:
    """Why an LM head whose Linear reads an input on `device` is not fused there ('' if it
    is): the CPU, unless GEMMFUSE_ALWAYS_FUSE=1."""
    from ..runtime import always_fuse
    return CPU_LM_HEAD if device.type == "cpu" and not always_fuse() else ""


def find_lm_heads(gm: fx.GraphModule) -> list:
    """[(LMHead, _Match or None)] for every cross-entropy loss of a Linear's logits in gm,
    in graph order; the match is None where the head is not taken (LMHead.reason)."""
    out = []
    for node in list(gm.graph.nodes):
        loss = _loss_kind(node, gm)
        if loss is None:
            continue
        found = _match(gm, node, *loss)
        if found is not None:
            out.append(found)
    return out


def _loss_kind(node: fx.Node, gm: fx.GraphModule):
    """(what the loss is called, whether its input must be log-probabilities) for a
    cross-entropy or NLL loss node, else None."""
    if node.op == "call_function" and node.target is F.cross_entropy:
        return "F.cross_entropy", False
    if node.op == "call_function" and node.target is F.nll_loss:
        return "F.nll_loss", True
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, nn.CrossEntropyLoss):
            return f"nn.CrossEntropyLoss '{node.target}'", False
        if isinstance(mod, nn.NLLLoss):
            return f"nn.NLLLoss '{node.target}'", True
    return None


def _match(gm: fx.GraphModule, loss: fx.Node, name: str, nll: bool):
    """(LMHead, _Match or None) for a loss node whose input comes from a Linear, else None."""
    try:
        args = _loss_args(gm, loss, nll)
    except Unsupported as e:
        args, why = None, str(e)
    inp = loss.args[0] if loss.args else loss.kwargs.get("input")
    if not isinstance(inp, fx.Node):
        return None
    lin, path, why_path = _logits_path(inp, nll)
    try:
        parts = linear_parts(lin, gm)
    except Unsupported as e:
        return LMHead(lin.name, name, reason=str(e)), None
    if parts is None:
        return None
    head = _head(gm, lin, parts, name)
    if args is not None:
        why = why_path or _check(gm, loss, lin, parts, args, path)
    if why:
        head.reason = why
        return head, None
    shape_reads = _shape_reads(lin, set(path) | {loss})
    return head, _Match(head, loss, lin, parts, args["target"], _options(args),
                        [lin, *shape_reads, *path, loss])


def _head(gm, lin: fx.Node, parts: LinearParts, name: str) -> LMHead:
    w = _tensor(gm, parts.weight)
    shape = tuple(w.shape) if isinstance(w, torch.Tensor) else ()
    n, k = (shape[::-1] if parts.weight_kn else shape) if len(shape) == 2 else (0, 0)
    return LMHead(lin.name, name, parts.form, int(k), int(n))


def _loss_args(gm: fx.GraphModule, loss: fx.Node, nll: bool) -> dict:
    """The loss's arguments by name (a module's from its attributes); raise Unsupported for
    the ones linear_cross_entropy cannot take (a class weight, legacy reductions, numbers that
    are not constants)."""
    if loss.op == "call_module":
        mod = gm.get_submodule(loss.target)
        a = bind(loss, ["input", "target"], {})
        a.update(weight=mod.weight, ignore_index=mod.ignore_index, reduction=mod.reduction,
                 label_smoothing=getattr(mod, "label_smoothing", 0.0))
    else:
        names = _CE_ARGS[:-1] if nll else _CE_ARGS
        a = bind(loss, names, {k: v for k, v in _CE_DEFAULTS.items() if k in names})
        if a["size_average"] is not None or a["reduce"] is not None:
            raise Unsupported("the legacy size_average/reduce arguments are given")
        a.setdefault("label_smoothing", 0.0)
    if a["weight"] is not None:
        raise Unsupported("a class weight is given (linear_cross_entropy has none)")
    if isinstance(a["ignore_index"], bool) or not isinstance(a["ignore_index"], int):
        raise Unsupported(f"ignore_index {a['ignore_index']!r} is not a constant int")
    if not isinstance(a["label_smoothing"], (int, float)) or isinstance(a["label_smoothing"], bool):
        raise Unsupported(f"label_smoothing {a['label_smoothing']!r} is not a constant number")
    if a["reduction"] not in ("mean", "sum", "none"):
        raise Unsupported(f"reduction {a['reduction']!r} is not 'mean', 'sum' or 'none'")
    return a


def _options(args: dict) -> dict:
    return {"ignore_index": int(args["ignore_index"]),
            "label_smoothing": float(args["label_smoothing"]), "reduction": args["reduction"]}


def _logits_path(inp: fx.Node, nll: bool):
    """(the node the loss's input comes from, the nodes between it and the loss, '') through
    at most one flatten to rows and, for an NLL loss, one log_softmax over the last dim; or
    (inp, [], why) for an NLL loss whose input is not a log_softmax."""
    path, cur, seen_flat, seen_ls = [], inp, False, False
    while True:
        if not seen_flat and _is_row_flatten(cur):
            path.insert(0, cur)
            seen_flat = True
            cur = cur.args[0]
        elif nll and not seen_ls and _is_log_softmax_last(cur):
            path.insert(0, cur)
            seen_ls = True
            cur = cur.args[0] if cur.args else cur.kwargs.get("input")
        else:
            break
        if not isinstance(cur, fx.Node):
            return inp, [], "the logits are not a graph value"
    if nll and not seen_ls:
        return cur, path, "the NLL loss's input is not log_softmax over the last dim"
    return cur, path, ""


def _is_row_flatten(node: fx.Node) -> bool:
    """Whether node flattens a [..., V] tensor to [M, V] rows (view/reshape/flatten), from the
    shapes it saw on the example inputs."""
    is_op = ((node.op == "call_method" and node.target in _FLATTEN_METHODS)
             or (node.op == "call_function" and node.target in _FLATTEN_FUNCS))
    if not is_op or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = node_info(node.args[0]), node_info(node)
    if not isinstance(src, TInfo) or not isinstance(out, TInfo) or src.rank < 1 or out.rank != 2:
        return False
    rows = 1
    for d in src.shape[:-1]:
        rows *= d
    return tuple(out.shape) == (rows, src.shape[-1])


def _is_log_softmax_last(node: fx.Node) -> bool:
    """Whether node is log_softmax over its input's last dim (no dtype change)."""
    if node.op == "call_function" and node.target in _LOG_SOFTMAX_FUNCS:
        pass
    elif not (node.op == "call_method" and node.target == "log_softmax"):
        return False
    try:
        a = bind(node, ["input", "dim", "_stacklevel", "dtype"], {"_stacklevel": 3, "dtype": None})
    except Unsupported:
        return False
    inf = node_info(a["input"])
    return (isinstance(inf, TInfo) and a["dtype"] is None and isinstance(a["dim"], int)
            and a["dim"] % max(inf.rank, 1) == inf.rank - 1)


def _check(gm, loss: fx.Node, lin: fx.Node, parts: LinearParts, args: dict, path: list) -> str:
    """Why the matched Linear and loss cannot be one linear_cross_entropy call ('' if they can)."""
    inp, tgt = node_info(path[-1] if path else lin), node_info(args["target"])
    if not isinstance(inp, TInfo) or not isinstance(tgt, TInfo):
        return "no shape information for the logits or the target"
    if inp.rank != 2:
        return (f"the loss reads {inp.rank}-d logits: classes on dim 1 of them, not rows of "
                f"[M, V] (flatten them with .view(-1, V))")
    if not isinstance(args["target"], fx.Node) or tgt.dtype != torch.int64 or tgt.rank != 1:
        return ("the target is not one class index per row (probability targets, or not int64: "
                f"{tgt.dtype}, {tgt.rank}-d)")
    w = _tensor(gm, parts.weight)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return "the weight is not a 2-d tensor"
    b = _tensor(gm, parts.bias) if parts.bias is not None else None
    if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (inp.shape[1],)):
        return "the bias is not one value per class"
    xinf = node_info(parts.x)
    if not isinstance(xinf, TInfo):
        return "no shape information for the Linear's input"
    lin_out = node_info(lin)  # autocast (dynamo's graph): the Linear computes in another dtype
    dtypes = ({t.dtype for t in (w, b) if isinstance(t, torch.Tensor)} | {xinf.dtype}
              | ({lin_out.dtype} if isinstance(lin_out, TInfo) else set()))
    if dtypes != {torch.float32}:
        return (f"the Linear is {', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}"
                f": linear_cross_entropy fuses fp32 only")
    return _private(lin, path, loss)


def _private(lin: fx.Node, path: list, loss: fx.Node) -> str:
    """Why the logits (or a value between them and the loss) are needed elsewhere ('' if not)."""
    inside = set(path) | {loss}
    reads = set(_shape_reads(lin, inside))
    for n in [lin, *path]:
        for u in n.users:
            if u in inside or u in reads:
                continue
            where = "returned" if u.op == "output" else f"read by {u.name}"
            return f"{'the logits' if n is lin else n.name} also {where}, outside the loss"
    return ""


def _shape_reads(lin: fx.Node, inside: set) -> list:
    """The users of lin that only read its size (logits.size(-1), logits.shape[-1]) for nodes
    in `inside` (the view), with the nodes between: they go with the logits."""
    out = []
    for u in lin.users:
        chain = [u]
        if u.op == "call_function" and u.target is getattr and u.args[1:] == ("shape",):
            if not all(g.op == "call_function" and g.target is operator.getitem for g in u.users):
                continue
            chain += list(u.users)
        elif not (u.op == "call_method" and u.target == "size"):
            continue
        ends = chain[1:] if len(chain) > 1 else chain
        if all(v in inside for e in ends for v in e.users):
            out.extend(chain)
    return out


def _tensor(gm: fx.GraphModule, src) -> Optional[torch.Tensor]:
    """The tensor a weight or bias source holds (attributes), or a stand-in with its dtype and
    shape (other graph values)."""
    from .find import _attr_tensor
    if isinstance(src, AttrRef):
        return _attr_tensor(gm, src.qualname)
    if src.op == "get_attr":
        return _attr_tensor(gm, src.target)
    inf = node_info(src)
    return torch.empty(inf.shape, dtype=inf.dtype, device="meta") if isinstance(inf, TInfo) else None

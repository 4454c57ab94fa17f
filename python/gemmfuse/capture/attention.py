"""Attention that gemmfuse's fp32 attention kernels can take, found in a graph (optimize()'s
"fx" flavour and dynamo's): ``F.scaled_dot_product_attention(q, k, v, ...)`` with no dropout (a
constant 0), ``is_causal`` and ``scale`` constants, an attention mask that is a bool or fp32
graph value broadcasting to [B, H, Sq, Sk] and needing no gradient, fp32 q [B, H, Sq, D] and
k, v [B, H, Sk, D] (Sk may differ from Sq; grouped-query k and v may have fewer heads); and
attention written out (written_attention.py: q @ kᵀ, a scale, a causal mask, softmax, @ v),
whose q, k, v are of one shape [B, H, S, D]. The rest stay the model's own calls, with the
reason (explain shows both)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .chain import Unsupported, bind
from .values import TInfo, node_info
from .written_attention import is_softmax_last, match_written

_SDPA_ARGS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}


@dataclass
class AttentionSite:
    """One attention call of the model: taken by gemmfuse ("fused") or why not."""
    node: str                    # the call's node name
    form: str                    # how the model wrote it
    shape: tuple = ()            # q's [B, H, S, D]
    kv_len: int = 0              # the keys' count where it is not S (0: S)
    is_causal: bool = False
    mask: tuple = ()             # the attention mask's (shape, dtype), () for none
    kv_heads: int = 0            # grouped-query heads: k's and v's head count (0: q's)
    status: str = "pytorch"      # "fused" | "pytorch"
    reason: str = ""


@dataclass
class AttentionMatch:
    site: AttentionSite
    node: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: Optional[float]
    erase: list = field(default_factory=list)  # written-out attention: its nodes, last first
    mask: Optional[fx.Node] = None             # SDPA's attn_mask


def find_attention(gm: fx.GraphModule, example_inputs=()) -> list:
    """[(AttentionSite, AttentionMatch or None)] for every SDPA call and written-out attention
    in gm, in graph order; the match is None where it is not taken (AttentionSite.reason says
    why). `example_inputs`: a dynamo graph's, for masks held in the module's buffers."""
    out, state = [], None
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            out.append(_match_sdpa(node))
        elif is_softmax_last(node):
            state = _module_state(gm, example_inputs) if state is None else state
            found = _match_written(gm, node, state)
            if found is not None:
                out.append(found)
    return out


def _module_state(gm: fx.GraphModule, example_inputs) -> dict:
    """A dynamo graph's placeholders that are the module's buffers or parameters (their
    sources say so), with their example values."""
    out = {}
    for node, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
        arg = node.meta.get("grapharg")
        name = str(getattr(getattr(arg, "source", None), "name", ""))
        if "._buffers[" in name or "._parameters[" in name:
            out[node] = v
    return out


def _match_written(gm: fx.GraphModule, softmax: fx.Node, state: dict):
    """(site, match or None) for written-out attention around `softmax`, or None."""
    site = AttentionSite(softmax.name, "written out: q @ kᵀ, softmax, @ v")
    try:
        m = match_written(gm, softmax, state)
        if m is None:
            return None
        site.node = m["out"].name
        site.shape, site.is_causal = _operand_shape(m["q"], m["k"], m["v"]), m["is_causal"]
    except Unsupported as e:
        site.reason = str(e)
        return site, None
    return site, AttentionMatch(site, m["out"], m["q"], m["k"], m["v"], m["scale"],
                                m["nodes"] + [m["kt"]])


def _match_sdpa(node: fx.Node):
    site = AttentionSite(node.name, "F.scaled_dot_product_attention")
    try:
        args = bind(node, _SDPA_ARGS, dict(_SDPA_DEFAULTS))
        _check_sdpa_args(args)
        q, k, v = args["query"], args["key"], args["value"]
        gqa = bool(args["enable_gqa"])
        site.shape, site.is_causal = (_operand_shape(q, k, v, gqa, any_keys=True),
                                      bool(args["is_causal"]))
        hint = torch.fx.experimental.symbolic_shapes.size_hint
        kv_len = hint(node_info(k).shape[2])
        site.kv_len = kv_len if kv_len != hint(site.shape[2]) else 0
        site.mask = _mask_of(args["attn_mask"], site.shape, site.is_causal, kv_len)
        kv = node_info(k).shape[1]
        site.kv_heads = kv if gqa and kv != site.shape[1] else 0
    except Unsupported as e:
        site.reason = str(e)
        return site, None
    return site, AttentionMatch(site, node, q, k, v, args["scale"], mask=args["attn_mask"])


def _check_sdpa_args(a: dict) -> None:
    """Raise Unsupported for arguments the kernels do not take, or that are not constants."""
    if not isinstance(a["dropout_p"], (int, float)) or a["dropout_p"] != 0:
        raise Unsupported(f"dropout_p {a['dropout_p']!r} (the kernels take a constant 0)")
    if not isinstance(a["enable_gqa"], bool):
        raise Unsupported(f"enable_gqa {a['enable_gqa']!r} is not a constant bool")
    if not isinstance(a["is_causal"], bool):
        raise Unsupported(f"is_causal {a['is_causal']!r} is not a constant bool")
    s = a["scale"]
    if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))):
        raise Unsupported(f"scale {s!r} is not a constant number")


def _mask_of(mask, shape: tuple, is_causal: bool, kv_len: int) -> tuple:
    """The mask's (shape, dtype) where the kernels take it (none: ()), else raise: a bool or
    fp32 graph value that needs no gradient, broadcasting to [B, H, Sq, Sk] (Sk = kv_len); not
    with is_causal (PyTorch raises for both: its call stays, to raise as it does)."""
    if mask is None:
        return ()
    inf = node_info(mask) if isinstance(mask, fx.Node) else None
    if not isinstance(inf, TInfo):
        raise Unsupported("an attention mask that is not a tensor of known shape")
    if is_causal:
        raise Unsupported("an attention mask with is_causal (PyTorch raises for both)")
    if inf.dtype not in (torch.bool, torch.float32) or inf.requires_grad:
        raise Unsupported(f"an attention mask of {inf.dtype}"
                          f"{' that needs a gradient' if inf.requires_grad else ''} "
                          "(the kernels take bool or fp32 masks, without gradients)")
    hint = torch.fx.experimental.symbolic_shapes.size_hint
    full = (*(hint(d) for d in shape[:3]), kv_len)
    mshape = tuple(hint(d) for d in inf.shape)
    try:
        fits = len(mshape) <= 4 and tuple(torch.broadcast_shapes(mshape, full)) == full
    except RuntimeError:
        fits = False
    if not fits:
        raise Unsupported(f"an attention mask of shape {tuple(inf.shape)} that does not broadcast "
                          f"to [B, H, Sq, Sk] {list(full)}")
    return mshape, inf.dtype


def _operand_shape(q, k, v, gqa: bool = False, any_keys: bool = False) -> tuple:
    """q's shape where q, k and v are fp32 graph values of one 4-D shape [B, H, S, D] (with
    grouped-query heads, k's and v's heads may divide q's; with any_keys, k's and v's S may
    differ from q's), else raise."""
    infos = [node_info(t) for t in (q, k, v)]
    if not all(isinstance(i, TInfo) for i in infos):
        raise Unsupported("q, k or v has no known shape")
    if any(i.dtype != torch.float32 for i in infos):
        raise Unsupported(f"q, k, v of {infos[0].dtype}, not fp32 (gemmfuse's attention is fp32's)")
    qs, ks, vs = (tuple(i.shape) for i in infos)
    ok = len(qs) == 4 and len(ks) == 4 and ks == vs and (qs[0], qs[3]) == (ks[0], ks[3])
    heads = ok and (qs[1] == ks[1] or (gqa and ks[1] != 0 and qs[1] % ks[1] == 0))
    if not (heads and (any_keys or qs[2] == ks[2])):
        what = ("q [B, H, Sq, D] and k, v [B, H, Sk, D]" if any_keys
                else "q, k and v of one shape [B, H, S, D]")
        raise Unsupported(f"{what} ({', '.join(str(tuple(i.shape)) for i in infos)})")
    return qs

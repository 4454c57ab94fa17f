"""Graph values as the capture sees them: tensor facts (shape, dtype, device) from the
graph's metadata, and references to where a chain's inputs come from."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.fx as fx

# --------------------------------------------------------------------------------------------
# Tensor facts about graph values (shape, dtype, device), from whatever metadata the graph has.


@dataclass(frozen=True)
class TInfo:
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool = False

    @property
    def rank(self) -> int:
        return len(self.shape)


def info_of_value(v: Any) -> Any:
    """TInfo for a tensor, a tuple of those for a tuple/list, else None."""
    if isinstance(v, torch.Tensor):
        return TInfo(tuple(v.shape), v.dtype, v.device, bool(v.requires_grad))
    if isinstance(v, (tuple, list)):
        return tuple(info_of_value(e) for e in v)
    return None


def node_info(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta
    if "gemmfuse_info" in meta:
        return meta["gemmfuse_info"]
    for key in ("example_value", "val"):
        if key in meta:
            return info_of_value(meta[key])
    tm = meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return TInfo(tuple(tm.shape), tm.dtype, torch.device("cpu"), bool(tm.requires_grad))
    return None


def is_number_node(node: Any) -> bool:
    """Whether the graph's metadata says this node computes a number, not a tensor (dynamo's
    `.item()` of an unspecialized float, a size)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method" and node.target == "item":
        return True
    for key in ("example_value", "val"):
        if key in node.meta:
            return isinstance(node.meta[key], (int, float, torch.SymInt, torch.SymFloat))
    return False


class InfoProp(fx.Interpreter):
    """Run the graph once on example inputs and record TInfo for every node
    (``node.meta['gemmfuse_info']``). Values are not kept."""

    def run_node(self, n):
        result = super().run_node(n)
        n.meta["gemmfuse_info"] = info_of_value(result)
        return result

    def call_module(self, target, args, kwargs):
        # The module's forward without its hooks: learning shapes must not run user hooks;
        # but a module parallelize_module prepared (DTensor parameters) needs its hooks to
        # turn its inputs into DTensors and its output back into the local tensor.
        from ..tensor_parallel import has_dtensor_params, settled
        mod = self.fetch_attr(target)
        if has_dtensor_params(mod):
            return settled(mod(*args, **kwargs))
        return mod.forward(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Operand references inside a stage.


@dataclass(frozen=True)
class AttrRef:
    """A module attribute (parameter, buffer or the module itself) to read with get_attr."""
    qualname: str


Source = Union[fx.Node, AttrRef]


@dataclass(frozen=True)
class Ref:
    kind: str          # 'imm' | 't' | 's' | 'v'
    value: Any         # float for imm, Source for t/s, fx.Node (a chain value) for v
    # imm only: the graph node that computes this number at run time when the graph has one
    # (dynamo's unspecialized floats); the spec holds its compile-time value, and the chain
    # checks on every call that the node still gives it (Chain.guards).
    guard: Any = None


def _imm(x, guard=None) -> Ref:
    return Ref("imm", float(x), guard)


def fmt_number(x: float) -> str:
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x)
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return "%.17g" % x


def source_key(src: Source):
    return ("attr", src.qualname) if isinstance(src, AttrRef) else ("node", src)


def source_name(src: Source) -> str:
    return f"self.{src.qualname}" if isinstance(src, AttrRef) else src.name

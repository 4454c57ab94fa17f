"""Stages, chains and the capture report: what capture builds from graph nodes, and how
a node's arguments are bound to parameter names."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Optional

import torch
import torch.fx as fx

from .values import Ref, Source, fmt_number, source_key

# --------------------------------------------------------------------------------------------
# Stages and chains.


@dataclass
class Stage:
    """One spec line (or none: identities), from one or more graph nodes.

    ``variants`` maps a training flag to ``(op, keys)``; static stages have one variant under
    the key None. A mode-dependent stage (call_module BatchNorm/Dropout) has variants for
    False and True and names its module in ``mode_module``; the spec is generated from the
    module's ``.training`` at call time.
    """
    nodes: list                     # graph nodes replaced (the last one produces the value)
    variants: dict                  # {None|False|True: (op, {key: value|Ref}) | None (identity)}
    mode_module: Optional[str] = None
    note: str = ""                  # e.g. "BatchNorm1d 'bn'"

    @property
    def value_node(self) -> fx.Node:
        return self.nodes[-1]

    def line(self, flags: dict):
        if self.mode_module is None:
            return self.variants[None]
        return self.variants[bool(flags[self.mode_module])]

    def refs(self):
        for v in self.variants.values():
            if v is None:
                continue
            for val in v[1].values():
                if isinstance(val, Ref):
                    yield val


@dataclass
class Chain:
    index: int
    linear: fx.Node
    x: fx.Node
    weight: Source
    bias: Optional[Source]
    in_features: int
    out_features: int
    stages: list = field(default_factory=list)
    stop: str = ""                  # why the chain ends where it does
    values: dict = field(default_factory=dict)  # fx.Node -> value id
    linear_module: Optional[str] = None         # call_module Linear: its qualname
    weight_kn: bool = False                     # the weight is stored [in, out] (x @ W)
    form: str = "nn.Linear"                     # how the model wrote the Linear

    # Filled by finish():
    operands: list = field(default_factory=list)   # [Source] for t<i>
    state: list = field(default_factory=list)      # [Source] for s<i>
    mode_modules: list = field(default_factory=list)  # [qualname] whose .training picks the spec
    # Numbers the graph computes at run time that the spec holds as constants: fx.Node ->
    # compile-time value (see Ref.guard).
    guards: dict = field(default_factory=dict)

    @property
    def nodes(self) -> list:
        out = [self.linear]
        for s in self.stages:
            out.extend(s.nodes)
        return out

    @property
    def output(self) -> fx.Node:
        return self.stages[-1].value_node if self.stages else self.linear

    def finish(self):
        """Number the operands and state (stable across training flags) and the values."""
        t_idx, s_idx, modes = {}, {}, []
        for st in self.stages:
            if st.mode_module is not None and st.mode_module not in modes:
                modes.append(st.mode_module)
            for r in st.refs():
                if r.kind == "t" and source_key(r.value) not in t_idx:
                    t_idx[source_key(r.value)] = len(t_idx)
                    self.operands.append(r.value)
                elif r.kind == "s" and source_key(r.value) not in s_idx:
                    s_idx[source_key(r.value)] = len(s_idx)
                    self.state.append(r.value)
                elif r.kind == "imm" and r.guard is not None:
                    self.guards[r.guard] = r.value
        self._t_idx, self._s_idx = t_idx, s_idx
        self.mode_modules = modes

    def flag_combos(self):
        return [tuple(c) for c in product((False, True), repeat=len(self.mode_modules))]

    def spec(self, flags=()) -> str:
        """The spec text for the given training flags (a tuple in ``mode_modules`` order or a
        dict qualname -> bool)."""
        if not isinstance(flags, dict):
            flags = dict(zip(self.mode_modules, flags))
        lines = [f"linear in={self.in_features} out={self.out_features} bias={int(self.bias is not None)}"]
        vid = {self.linear: 0}
        for st in self.stages:
            line = st.line(flags)
            if line is None:  # identity: the value keeps the id of the stage's input
                vid[st.value_node] = vid[self._input_of(st)]
                continue
            op, keys = line
            parts = [op]
            for k, v in keys.items():
                parts.append(f"{k}={self._fmt(v, vid)}")
            lines.append(" ".join(parts))
            vid[st.value_node] = len(lines) - 1
        return "\n".join(lines) + "\n"

    def one_line_spec(self, flags=()) -> str:
        """The spec with its lines joined by "; " (the C++ parser takes both forms): the form a
        graph node carries, since Inductor copies node arguments into generated comments line
        by line and a newline there would end the comment."""
        return "; ".join(self.spec(flags).splitlines())

    def _input_of(self, st: Stage) -> fx.Node:
        return st.input_node  # set by the builder

    def _fmt(self, v, vid) -> str:
        if isinstance(v, Ref):
            if v.kind == "imm":
                return fmt_number(v.value)
            if v.kind == "t":
                return f"t{self._t_idx[source_key(v.value)]}"
            if v.kind == "s":
                return f"s{self._s_idx[source_key(v.value)]}"
            if v.kind == "v":
                return f"v{vid[v.value]}"
            raise AssertionError(v)
        if v is None:
            return "none"
        if isinstance(v, bool):
            return "1" if v else "0"
        if isinstance(v, (int, float)):
            return fmt_number(v)
        return str(v)

    def describe_nodes(self) -> list:
        return [n.format_node() or n.name for n in self.nodes]


@dataclass
class CaptureReport:
    chains: list = field(default_factory=list)
    rejected: list = field(default_factory=list)   # (node name, reason) for linears not captured
    # (node name, form) for matrix products with no weight operand (two activations): no chain
    # starts there, and they run where the rest of the graph runs
    products: list = field(default_factory=list)
    flavor: str = "fx"


class Unsupported(Exception):
    """This node cannot be a stage of the chain (the message says why)."""


# --------------------------------------------------------------------------------------------
# Argument binding.


def bind(node: fx.Node, names: list, defaults: dict, skip_first: bool = False) -> dict:
    """Map a node's args/kwargs onto parameter names (positional order = names)."""
    args = list(node.args)
    out = {}
    for i, a in enumerate(args):
        if i >= len(names):
            raise Unsupported(f"unexpected extra arguments to {target_name(node)}")
        out[names[i]] = a
    for k, v in node.kwargs.items():
        if k not in names and not k.startswith("_"):
            raise Unsupported(f"unexpected keyword {k!r} to {target_name(node)}")
        out[k] = v
    for k, v in defaults.items():
        out.setdefault(k, v)
    missing = [n for n in names if n not in out]
    if missing:
        raise Unsupported(f"missing argument {missing[0]!r} of {target_name(node)}")
    return out


def target_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op == "call_module":
        return f"module '{t}'"
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", None) or str(t)
    if mod in ("torch._C._nn", "torch.nn.functional"):
        return f"F.{name}"
    if mod.startswith("torch") or mod == "" and hasattr(torch, name):
        return f"torch.{name}"
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    return f"{mod}.{name}" if mod else name


def _number(v, what: str):
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.requires_grad:
        return float(v.item())
    raise Unsupported(f"{what} is not a constant number ({type(v).__name__})")


def _int_or_single(v, what: str) -> int:
    if isinstance(v, (list, tuple)):
        if len(v) != 1:
            raise Unsupported(f"{what} {v!r} is not one dim")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise Unsupported(f"{what} {v!r} is not a constant int")
    return v

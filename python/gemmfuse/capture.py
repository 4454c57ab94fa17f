"""Capture: find ``Linear -> stages`` chains in a torch.fx graph and write them as chain specs.

Two graph flavours are read:
  * ``torch.fx.symbolic_trace`` graphs: ``call_module`` leaves (Linear, BatchNorm1d, GroupNorm,
    LayerNorm, Dropout, activations, pools, Softmax, ...), ``call_function`` torch.* / F.* /
    operator.*, ``call_method`` tensor methods, ``get_attr`` parameters;
  * torch.compile (dynamo) graphs: modules inlined into F.* calls, parameters and buffers as
    placeholders, ``torch.max(x, dim)`` results read through ``getitem``.

A chain is a linear node followed by nodes that each consume the current value (and maybe
earlier values of the chain: residuals), whose other inputs are scalars or tensors produced
outside the chain (operands ``t<i>``; BatchNorm running statistics are state ``s<i>``). Every
intermediate value must be used only inside the chain; the last may be used anywhere. Only the
last dim is fusable: reductions, softmax, norms and pools over any other dim end the chain.

Nothing here computes; the spec text goes to the C++ core (docs/chain-spec.md). For every
linear node the capture also records why its chain stopped where it did (``Chain.stop``) and,
for linear nodes it could not start a chain at, why (``CaptureReport.rejected``).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

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


class InfoProp(fx.Interpreter):
    """Run the graph once on example inputs and record TInfo for every node
    (``node.meta['gemmfuse_info']``). Values are not kept."""

    def run_node(self, n):
        result = super().run_node(n)
        n.meta["gemmfuse_info"] = info_of_value(result)
        return result


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


def _imm(x) -> Ref:
    return Ref("imm", float(x))


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

    # Filled by finish():
    operands: list = field(default_factory=list)   # [Source] for t<i>
    state: list = field(default_factory=list)      # [Source] for s<i>
    mode_modules: list = field(default_factory=list)  # [qualname] whose .training picks the spec

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


# --------------------------------------------------------------------------------------------
# Target tables.

_UNARY_FUNCS = {
    torch.relu: "relu", F.relu: "relu",
    torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", torch.special.expit: "sigmoid",
    torch.tanh: "tanh", F.tanh: "tanh",
    torch.exp: "exp", torch.log: "log", torch.sqrt: "sqrt", torch.rsqrt: "rsqrt",
    torch.abs: "abs", torch.absolute: "abs", operator.abs: "abs",
    torch.neg: "neg", torch.negative: "neg", operator.neg: "neg",
    torch.square: "square", torch.reciprocal: "reciprocal",
    F.silu: "silu", torch._C._nn.silu: "silu",
    F.mish: "mish", torch._C._nn.mish: "mish",
}
_UNARY_METHODS = {
    "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "exp": "exp", "log": "log",
    "sqrt": "sqrt", "rsqrt": "rsqrt", "abs": "abs", "absolute": "abs", "neg": "neg",
    "negative": "neg", "square": "square", "reciprocal": "reciprocal",
}
_UNARY_MODULES = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.SiLU: "silu",
                  nn.Mish: "mish"}

_BINARY_FUNCS = {
    operator.add: "add", torch.add: "add",
    operator.sub: "sub", torch.sub: "sub", torch.subtract: "sub",
    operator.mul: "mul", torch.mul: "mul", torch.multiply: "mul",
    operator.truediv: "div", torch.div: "div", torch.divide: "div", torch.true_divide: "div",
    torch.minimum: "minimum", torch.maximum: "maximum",
    torch.rsub: "rsub",
}
_BINARY_METHODS = {
    "add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul",
    "div": "div", "divide": "div", "true_divide": "div", "minimum": "minimum",
    "maximum": "maximum", "rsub": "rsub",
}

_REDUCE_FUNCS = {torch.sum: "sum", torch.mean: "mean", torch.amax: "max", torch.amin: "min",
                 torch.logsumexp: "logsumexp"}
_REDUCE_METHODS = {"sum": "sum", "mean": "mean", "amax": "max", "amin": "min",
                   "logsumexp": "logsumexp"}

_SOFTMAX_FUNCS = {torch.softmax: "softmax", F.softmax: "softmax",
                  torch.log_softmax: "log_softmax", F.log_softmax: "log_softmax"}
_SOFTMAX_METHODS = {"softmax": "softmax", "log_softmax": "log_softmax"}

_CLAMP_FUNCS = {torch.clamp: "clamp", torch.clip: "clamp", torch.clamp_min: "clamp_min",
                torch.clamp_max: "clamp_max"}
_CLAMP_METHODS = {"clamp": "clamp", "clip": "clamp", "clamp_min": "clamp_min",
                  "clamp_max": "clamp_max"}

_LINEAR_FUNCS = {F.linear}
_MAX_POOL_FUNCS = {F.max_pool1d, F._max_pool1d, torch.max_pool1d}
_IDENTITY_METHODS = {"contiguous"}

_INPLACE_METHOD_HINT = "in-place tensor methods are not fused"


# --------------------------------------------------------------------------------------------
# The builder.


class _Ctx:
    """What classify() needs about the chain under construction."""

    def __init__(self, gm: fx.GraphModule, chain: Chain, chain_nodes: set, mode_flags: dict):
        self.gm = gm
        self.chain = chain
        self.chain_nodes = chain_nodes
        self.mode_flags = mode_flags   # qualname -> current training flag (for capture decisions)
        self.cur: fx.Node = chain.linear
        self.rank = 0
        self.has_feat = True
        self.width = chain.out_features

    def module(self, node: fx.Node) -> nn.Module:
        return self.gm.get_submodule(node.target)

    def operand(self, a, what: str, allow_value: bool = False) -> Ref:
        """A binary operand: a number, an outside tensor (t), or an earlier chain value (v)."""
        if isinstance(a, fx.Node):
            if a in self.chain.values:
                if not allow_value:
                    raise Unsupported(f"{what} is a value of the chain")
                return Ref("v", a)
            if a in self.chain_nodes:
                raise Unsupported(f"{what} is an intermediate of the chain")
            inf = node_info(a)
            if inf is not None and not isinstance(inf, TInfo):
                raise Unsupported(f"{what} is not a tensor")
            return Ref("t", a)
        if isinstance(a, (bool, int, float)):
            return _imm(a)
        raise Unsupported(f"{what} is a {type(a).__name__}")

    def tensor_operand(self, a, what: str, kind: str = "t") -> Ref:
        if isinstance(a, AttrRef):
            return Ref(kind, a)
        if not isinstance(a, fx.Node):
            raise Unsupported(f"{what} is not a tensor ({type(a).__name__})")
        if a in self.chain_nodes:
            raise Unsupported(f"{what} is computed inside the chain")
        return Ref(kind, a)

    def last_dim(self, dim, what: str):
        if not self.has_feat:
            raise Unsupported(f"{what} after a keepdim=False reduction (no feature dim left)")
        d = _int_or_single(dim, f"{what} dim")
        nd = d + self.rank if d < 0 else d
        if nd != self.rank - 1:
            raise Unsupported(f"{what} over dim {d} of a rank-{self.rank} value (only the last dim fuses)")

    def need_rank(self, ranks, what: str):
        if not self.has_feat or self.rank not in ranks:
            raise Unsupported(f"{what} on a rank-{self.rank} value (needs rank {' or '.join(map(str, ranks))})")

    def same_shape_out(self, node: fx.Node, what: str, other: Optional[Ref] = None):
        """The node's output must have the current value's shape and dtype (no broadcasting up)."""
        out, cur = node_info(node), node_info(self.cur)
        if not isinstance(out, TInfo) or not isinstance(cur, TInfo):
            return
        if out.dtype != cur.dtype:
            raise Unsupported(f"{what} changes the dtype ({cur.dtype} -> {out.dtype})")
        if tuple(out.shape) != tuple(cur.shape):
            raise Unsupported(f"{what} broadcasts the value from {list(cur.shape)} to {list(out.shape)}")


def _check_inplace(ctx: _Ctx, node: fx.Node, inplace):
    if inplace and len(ctx.cur.users) != 1:
        raise Unsupported("in-place op on a value that is used elsewhere")


def _unary(op, **keys):
    return {None: (op, keys)}


def classify(node: fx.Node, ctx: _Ctx) -> Stage:
    """Turn ``node`` (a user of the current value ``ctx.cur``) into a Stage, or raise Unsupported."""
    cur = ctx.cur
    if node.op == "call_module":
        return _classify_module(node, ctx)
    if node.op == "call_method":
        return _classify_method(node, ctx)
    if node.op != "call_function":
        raise Unsupported(f"{node.op} node")
    t = node.target

    def first_is_cur(args_name="input"):
        if not node.args or node.args[0] is not cur:
            raise Unsupported(f"{target_name(node)} does not take the chain value as its input")

    if t in _UNARY_FUNCS:
        first_is_cur()
        kw = dict(node.kwargs)
        inplace = kw.pop("inplace", node.args[1] if len(node.args) > 1 else False)
        if kw or len(node.args) > 2:
            raise Unsupported(f"unexpected arguments to {target_name(node)}")
        _check_inplace(ctx, node, inplace)
        return Stage([node], _unary(_UNARY_FUNCS[t]))
    if t in _BINARY_FUNCS:
        return _binary(node, ctx, _BINARY_FUNCS[t], list(node.args), dict(node.kwargs))
    if t in (torch.max, torch.min):
        return _max_min(node, ctx, "max" if t is torch.max else "min", list(node.args), dict(node.kwargs))
    if t in _REDUCE_FUNCS:
        first_is_cur()
        return _reduce(node, ctx, _REDUCE_FUNCS[t], bind(node, ["input", "dim", "keepdim"],
                                                         {"keepdim": False, "dtype": None}))
    if t in _SOFTMAX_FUNCS:
        first_is_cur()
        a = bind(node, ["input", "dim", "_stacklevel", "dtype"], {"dim": None, "dtype": None, "_stacklevel": 3}) \
            if t in (F.softmax, F.log_softmax) else bind(node, ["input", "dim", "dtype"], {"dtype": None})
        return _softmax(node, ctx, _SOFTMAX_FUNCS[t], a)
    if t in _CLAMP_FUNCS:
        first_is_cur()
        kind = _CLAMP_FUNCS[t]
        names = {"clamp": ["input", "min", "max"], "clamp_min": ["input", "min"],
                 "clamp_max": ["input", "max"]}[kind]
        return _clamp(node, ctx, bind(node, names, {"min": None, "max": None}))
    if t in (F.hardtanh, torch._C._nn.hardtanh):
        first_is_cur()
        a = bind(node, ["input", "min_val", "max_val", "inplace"],
                 {"min_val": -1.0, "max_val": 1.0, "inplace": False})
        _check_inplace(ctx, node, a["inplace"])
        return _clamp(node, ctx, {"min": a["min_val"], "max": a["max_val"]})
    if t in (F.relu6, torch._C._nn.relu6):
        first_is_cur()
        a = bind(node, ["input", "inplace"], {"inplace": False})
        _check_inplace(ctx, node, a["inplace"])
        return _clamp(node, ctx, {"min": 0.0, "max": 6.0})
    if t in (torch.pow, operator.pow):
        return _pow(node, ctx, list(node.args), dict(node.kwargs))
    if t is F.gelu:
        first_is_cur()
        a = bind(node, ["input", "approximate"], {"approximate": "none"})
        return _gelu(a["approximate"], node)
    if t is F.softplus:
        first_is_cur()
        a = bind(node, ["input", "beta", "threshold"], {"beta": 1.0, "threshold": 20.0})
        return Stage([node], _unary("softplus", beta=_imm(_number(a["beta"], "beta")),
                                    threshold=_imm(_number(a["threshold"], "threshold"))))
    if t in (F.elu, torch._C._nn.elu):
        first_is_cur()
        if t is F.elu:
            a = bind(node, ["input", "alpha", "inplace"], {"alpha": 1.0, "inplace": False})
            _check_inplace(ctx, node, a["inplace"])
        else:
            a = bind(node, ["input", "alpha", "scale", "input_scale"],
                     {"alpha": 1.0, "scale": 1.0, "input_scale": 1.0})
            if a["scale"] != 1 or a["input_scale"] != 1:
                raise Unsupported("elu with scale/input_scale")
        return Stage([node], _unary("elu", alpha=_imm(_number(a["alpha"], "alpha"))))
    if t in (F.leaky_relu, torch._C._nn.leaky_relu):
        first_is_cur()
        a = bind(node, ["input", "negative_slope", "inplace"], {"negative_slope": 0.01, "inplace": False})
        _check_inplace(ctx, node, a["inplace"])
        return Stage([node], _unary("leaky_relu", alpha=_imm(_number(a["negative_slope"], "negative_slope"))))
    if t in (F.group_norm, torch.group_norm):
        first_is_cur()
        a = bind(node, ["input", "num_groups", "weight", "bias", "eps", "cudnn_enabled"],
                 {"weight": None, "bias": None, "eps": 1e-5, "cudnn_enabled": True})
        return _group_norm(node, ctx, a["num_groups"], a["weight"], a["bias"], a["eps"])
    if t in (F.layer_norm, torch.layer_norm):
        first_is_cur()
        a = bind(node, ["input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"],
                 {"weight": None, "bias": None, "eps": 1e-5, "cudnn_enable": True})
        return _layer_norm(node, ctx, a["normalized_shape"], a["weight"], a["bias"], a["eps"])
    if t is F.batch_norm:
        first_is_cur()
        a = bind(node, ["input", "running_mean", "running_var", "weight", "bias", "training",
                        "momentum", "eps"],
                 {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5})
        return _batch_norm_functional(node, ctx, a)
    if t is torch.batch_norm:
        first_is_cur()
        a = bind(node, ["input", "weight", "bias", "running_mean", "running_var", "training",
                        "momentum", "eps", "cudnn_enabled"], {})
        return _batch_norm_functional(node, ctx, a)
    if t in (F.dropout, torch.dropout):
        first_is_cur()
        if t is F.dropout:
            a = bind(node, ["input", "p", "training", "inplace"],
                     {"p": 0.5, "training": True, "inplace": False})
        else:
            a = bind(node, ["input", "p", "train"], {})
            a["training"], a["inplace"] = a["train"], False
        _check_inplace(ctx, node, a["inplace"])
        p = _number(a["p"], "dropout p")
        training = a["training"]
        if not isinstance(training, bool):
            raise Unsupported("dropout's training flag is not a constant")
        if training and p > 0:
            raise Unsupported(f"dropout(p={p}) in training mode runs in PyTorch")
        return Stage([node], _unary("dropout", p=_imm(p), training=bool(training)))
    if t is F.avg_pool1d:
        first_is_cur()
        a = bind(node, ["input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"],
                 {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True})
        return _pool(node, ctx, "avg_pool", a["kernel_size"], a["stride"], a["padding"],
                     a["ceil_mode"], a["count_include_pad"], 1)
    if t in _MAX_POOL_FUNCS:
        first_is_cur()
        a = bind(node, ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
                        "return_indices"],
                 {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False,
                  "return_indices": False})
        if a["return_indices"]:
            raise Unsupported("max_pool1d with return_indices")
        return _pool(node, ctx, "max_pool", a["kernel_size"], a["stride"], a["padding"],
                     a["ceil_mode"], None, a["dilation"])
    if t in (operator.getitem, getattr):
        raise Unsupported(f"{target_name(node)} of the chain value")
    raise Unsupported(f"{target_name(node)} is not a fusable stage")


def _classify_method(node: fx.Node, ctx: _Ctx) -> Stage:
    cur, m = ctx.cur, node.target
    if not node.args or node.args[0] is not cur:
        # e.g. other.add(x): the chain value is an argument, not self
        if m in _BINARY_METHODS:
            return _binary(node, ctx, _BINARY_METHODS[m], list(node.args), dict(node.kwargs))
        raise Unsupported(f"Tensor.{m} does not take the chain value as self")
    if m in _UNARY_METHODS:
        if len(node.args) > 1 or node.kwargs:
            raise Unsupported(f"unexpected arguments to Tensor.{m}")
        return Stage([node], _unary(_UNARY_METHODS[m]))
    if m in _IDENTITY_METHODS:
        if len(node.args) > 1 or node.kwargs:
            raise Unsupported(f"Tensor.{m} with arguments")
        return Stage([node], {None: None})
    if m in _BINARY_METHODS:
        return _binary(node, ctx, _BINARY_METHODS[m], list(node.args), dict(node.kwargs))
    if m in ("max", "min"):
        return _max_min(node, ctx, m, list(node.args), dict(node.kwargs))
    if m in _REDUCE_METHODS:
        return _reduce(node, ctx, _REDUCE_METHODS[m],
                       bind(node, ["input", "dim", "keepdim"], {"keepdim": False, "dtype": None}))
    if m in _SOFTMAX_METHODS:
        return _softmax(node, ctx, _SOFTMAX_METHODS[m],
                        bind(node, ["input", "dim", "dtype"], {"dtype": None}))
    if m in _CLAMP_METHODS:
        kind = _CLAMP_METHODS[m]
        names = {"clamp": ["input", "min", "max"], "clamp_min": ["input", "min"],
                 "clamp_max": ["input", "max"]}[kind]
        return _clamp(node, ctx, bind(node, names, {"min": None, "max": None}))
    if m == "pow":
        return _pow(node, ctx, list(node.args), dict(node.kwargs))
    if m.endswith("_") and not m.startswith("_"):
        raise Unsupported(f"Tensor.{m}: {_INPLACE_METHOD_HINT}")
    raise Unsupported(f"Tensor.{m} is not a fusable stage")


def _classify_module(node: fx.Node, ctx: _Ctx) -> Stage:
    mod = ctx.module(node)
    tp = type(mod)
    q = node.target
    if len(node.args) != 1 or node.kwargs or node.args[0] is not ctx.cur:
        raise Unsupported(f"module '{q}' not called on the chain value alone")
    if tp in _UNARY_MODULES:
        _check_inplace(ctx, node, getattr(mod, "inplace", False))
        return Stage([node], _unary(_UNARY_MODULES[tp]))
    if tp is nn.Identity:
        return Stage([node], {None: None})
    if tp is nn.GELU:
        return _gelu(mod.approximate, node)
    if tp is nn.Softplus:
        return Stage([node], _unary("softplus", beta=_imm(mod.beta), threshold=_imm(mod.threshold)))
    if tp is nn.ELU:
        _check_inplace(ctx, node, mod.inplace)
        return Stage([node], _unary("elu", alpha=_imm(mod.alpha)))
    if tp is nn.LeakyReLU:
        _check_inplace(ctx, node, mod.inplace)
        return Stage([node], _unary("leaky_relu", alpha=_imm(mod.negative_slope)))
    if tp in (nn.Hardtanh, nn.ReLU6):
        _check_inplace(ctx, node, mod.inplace)
        return _clamp(node, ctx, {"min": mod.min_val, "max": mod.max_val})
    if tp in (nn.Softmax, nn.LogSoftmax):
        return _softmax(node, ctx, "softmax" if tp is nn.Softmax else "log_softmax",
                        {"dim": mod.dim, "dtype": None})
    if tp is nn.GroupNorm:
        w = AttrRef(f"{q}.weight") if mod.weight is not None else None
        b = AttrRef(f"{q}.bias") if mod.bias is not None else None
        ctx.need_rank((2,), "GroupNorm")
        if mod.num_channels != ctx.width:
            raise Unsupported(f"GroupNorm({mod.num_groups}, {mod.num_channels}) on width {ctx.width}")
        return _group_norm(node, ctx, mod.num_groups, w, b, mod.eps)
    if tp is nn.LayerNorm:
        w = AttrRef(f"{q}.weight") if getattr(mod, "weight", None) is not None else None
        b = AttrRef(f"{q}.bias") if getattr(mod, "bias", None) is not None else None
        return _layer_norm(node, ctx, mod.normalized_shape, w, b, mod.eps)
    if tp is nn.BatchNorm1d:
        return _batch_norm_module(node, ctx, mod)
    if tp is nn.Dropout:
        _check_inplace(ctx, node, mod.inplace)
        p = float(mod.p)
        if p == 0:
            return Stage([node], _unary("dropout", p=_imm(0.0), training=False))
        if ctx.mode_flags.get(q, mod.training):
            raise Unsupported(f"Dropout(p={p}) '{q}' is in training mode (runs in PyTorch)")
        return Stage([node], {False: ("dropout", {"p": _imm(p), "training": False}),
                              True: ("dropout", {"p": _imm(p), "training": True})},
                     mode_module=q, note=f"Dropout '{q}'")
    if tp is nn.AvgPool1d:
        return _pool(node, ctx, "avg_pool", mod.kernel_size, mod.stride, mod.padding,
                     mod.ceil_mode, mod.count_include_pad, 1)
    if tp is nn.MaxPool1d:
        if mod.return_indices:
            raise Unsupported("MaxPool1d with return_indices")
        return _pool(node, ctx, "max_pool", mod.kernel_size, mod.stride, mod.padding,
                     mod.ceil_mode, None, mod.dilation)
    raise Unsupported(f"module '{q}' ({tp.__name__}) is not a fusable stage")


# ---- stage helpers --------------------------------------------------------------------------


def _gelu(approximate, node) -> Stage:
    if approximate == "none":
        return Stage([node], _unary("gelu"))
    if approximate == "tanh":
        return Stage([node], _unary("gelu_tanh"))
    raise Unsupported(f"gelu approximate={approximate!r}")


def _binary(node: fx.Node, ctx: _Ctx, op: str, args: list, kwargs: dict) -> Stage:
    cur = ctx.cur
    if len(args) < 2:
        names = ["input", "other"]
        for i, n in enumerate(names[len(args):]):
            if n in kwargs:
                args.append(kwargs.pop(n))
    if len(args) != 2:
        raise Unsupported(f"{target_name(node)} with {len(args)} operands")
    alpha = kwargs.pop("alpha", 1)
    rounding = kwargs.pop("rounding_mode", None)
    if kwargs:
        raise Unsupported(f"unexpected keywords {sorted(kwargs)} to {target_name(node)}")
    if rounding is not None:
        raise Unsupported(f"division with rounding_mode={rounding!r}")
    a0, a1 = args
    rev = False
    if op == "rsub":  # rsub(input, other, alpha) = other - alpha * input
        op = "sub"
        a0, a1 = a1, a0
        alpha_on = "first"
    else:
        alpha_on = "second"
    if a0 is cur:
        other = a1
        if alpha != 1 and alpha_on == "first":
            raise Unsupported("alpha scales the chain value")
    elif a1 is cur:
        other, rev = a0, True
        if alpha != 1 and alpha_on == "second":
            raise Unsupported("alpha scales the chain value")
    else:
        raise Unsupported(f"{target_name(node)} does not take the chain value")
    if alpha != 1:
        if op not in ("add", "sub") or not isinstance(other, (int, float, bool)):
            raise Unsupported("alpha with a tensor operand")
        other = other * _number(alpha, "alpha")
    b = ctx.operand(other, f"operand of {target_name(node)}", allow_value=True)
    if b.kind == "t":
        inf = node_info(other)
        if isinstance(inf, TInfo) and inf.dtype.is_complex:
            raise Unsupported("complex operand")
    ctx.same_shape_out(node, target_name(node), b)
    keys = {"b": b}
    if rev and op in ("sub", "div"):  # add, mul, minimum, maximum commute
        keys["rev"] = 1
    return Stage([node], _unary(op, **keys))


def _max_min(node: fx.Node, ctx: _Ctx, which: str, args: list, kwargs: dict) -> Stage:
    """torch.max(x) (full), torch.max(x, other) (elementwise), torch.max(x, dim[, keepdim])."""
    cur = ctx.cur
    if len(args) >= 2 and isinstance(args[1], fx.Node) or "other" in kwargs:
        return _binary(node, ctx, "maximum" if which == "max" else "minimum", args, kwargs)
    if not args or args[0] is not cur:
        raise Unsupported(f"{which} does not take the chain value as input")
    names = ["input", "dim", "keepdim"]
    a = {}
    for i, v in enumerate(args):
        a[names[i]] = v
    a.update(kwargs)
    if "dim" not in a:
        raise Unsupported(f"{which} over all elements")
    a.setdefault("keepdim", False)
    # The result is (values, indices); the chain continues through `values` only.
    users = list(node.users)
    if len(users) != 1:
        raise Unsupported(f"{which}(dim) result used {len(users)} times (indices not fused)")
    g = users[0]
    ok = (g.op == "call_function" and
          ((g.target is operator.getitem and g.args[1:] == (0,)) or
           (g.target is getattr and g.args[1:] == ("values",))))
    if not ok:
        raise Unsupported(f"{which}(dim) indices are used")
    st = _reduce(g, ctx, which, a, value_node=g)
    st.nodes = [node, g]
    return st


def _reduce(node, ctx: _Ctx, op: str, a: dict, value_node=None) -> Stage:
    if a.get("dtype") is not None:
        raise Unsupported(f"{op} with dtype=")
    dim = a["dim"]
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        raise Unsupported(f"{op} over all elements")
    ctx.last_dim(dim, op)
    keepdim = a["keepdim"]
    if not isinstance(keepdim, bool):
        raise Unsupported(f"{op} keepdim is not a constant")
    return Stage([node], _unary(op, keepdim=keepdim))


def _softmax(node, ctx: _Ctx, op: str, a: dict) -> Stage:
    if a.get("dtype") is not None:
        raise Unsupported(f"{op} with dtype=")
    if a["dim"] is None:
        raise Unsupported(f"{op} with the implicit dim")
    ctx.last_dim(a["dim"], op)
    return Stage([node], _unary(op))


def _clamp(node, ctx: _Ctx, a: dict) -> Stage:
    keys = {}
    lo, hi = a.get("min"), a.get("max")
    if lo is None and hi is None:
        raise Unsupported("clamp without bounds")
    if lo is not None:
        keys["lo"] = _imm(_number(lo, "clamp min"))
    if hi is not None:
        keys["hi"] = _imm(_number(hi, "clamp max"))
    ctx.same_shape_out(node, "clamp")
    return Stage([node], _unary("clamp", **keys))


def _pow(node, ctx: _Ctx, args: list, kwargs: dict) -> Stage:
    names = ["input", "exponent"]
    a = dict(zip(names, args))
    a.update(kwargs)
    if a.get("input") is not ctx.cur:
        raise Unsupported("pow with the chain value as the exponent")
    e = a.get("exponent")
    if isinstance(e, fx.Node) or not isinstance(e, (int, float)) or isinstance(e, bool):
        raise Unsupported("pow with a tensor exponent")
    ctx.same_shape_out(node, "pow")
    return Stage([node], _unary("pow", alpha=_imm(e)))


def _group_norm(node, ctx: _Ctx, groups, weight, bias, eps) -> Stage:
    ctx.need_rank((2,), "group_norm")
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise Unsupported("group_norm groups is not a constant int")
    keys = {"groups": groups, "eps": _imm(_number(eps, "eps"))}
    if weight is not None:
        keys["weight"] = ctx.tensor_operand(weight, "group_norm weight")
    if bias is not None:
        keys["bias"] = ctx.tensor_operand(bias, "group_norm bias")
    return Stage([node], _unary("group_norm", **keys))


def _layer_norm(node, ctx: _Ctx, shape, weight, bias, eps) -> Stage:
    if not ctx.has_feat:
        raise Unsupported("layer_norm after a keepdim=False reduction")
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) != 1:
        raise Unsupported(f"layer_norm over {shape!r} (only the last dim fuses)")
    if shape[0] != ctx.width:
        raise Unsupported(f"layer_norm normalized_shape {tuple(shape)} on width {ctx.width}")
    keys = {"groups": 1, "eps": _imm(_number(eps, "eps"))}
    if weight is not None:
        keys["weight"] = ctx.tensor_operand(weight, "layer_norm weight")
    if bias is not None:
        keys["bias"] = ctx.tensor_operand(bias, "layer_norm bias")
    return Stage([node], _unary("group_norm", **keys))


def _batch_norm_functional(node, ctx: _Ctx, a: dict) -> Stage:
    ctx.need_rank((2,), "batch_norm")
    training = a["training"]
    if not isinstance(training, bool):
        raise Unsupported("batch_norm training flag is not a constant")
    rm, rv = a["running_mean"], a["running_var"]
    if (rm is None) != (rv is None):
        raise Unsupported("batch_norm with only one running statistic")
    if not training and rm is None:
        raise Unsupported("eval batch_norm without running statistics")
    keys = {"training": training, "eps": _imm(_number(a["eps"], "eps"))}
    if training and rm is not None:
        mom = a["momentum"]
        if mom is None:
            raise Unsupported("functional batch_norm with momentum=None")
        keys["momentum"] = _imm(_number(mom, "momentum"))
    if a["weight"] is not None:
        keys["weight"] = ctx.tensor_operand(a["weight"], "batch_norm weight")
    if a["bias"] is not None:
        keys["bias"] = ctx.tensor_operand(a["bias"], "batch_norm bias")
    if rm is not None:
        keys["running_mean"] = ctx.tensor_operand(rm, "running_mean", "s")
        keys["running_var"] = ctx.tensor_operand(rv, "running_var", "s")
    return Stage([node], _unary("batch_norm", **keys))


def _batch_norm_module(node, ctx: _Ctx, mod: nn.BatchNorm1d) -> Stage:
    ctx.need_rank((2,), "BatchNorm1d")
    q = node.target
    if mod.num_features != ctx.width:
        raise Unsupported(f"BatchNorm1d({mod.num_features}) on width {ctx.width}")
    common = {}
    if mod.weight is not None:
        common["weight"] = Ref("t", AttrRef(f"{q}.weight"))
    if mod.bias is not None:
        common["bias"] = Ref("t", AttrRef(f"{q}.bias"))
    tracked = mod.running_mean is not None and mod.running_var is not None
    eps = _imm(mod.eps)

    def variant(training: bool):
        keys = {"training": training or not tracked, "eps": eps}
        if training and tracked:
            keys["momentum"] = None if mod.momentum is None else _imm(mod.momentum)
        keys.update(common)
        if tracked:
            keys["running_mean"] = Ref("s", AttrRef(f"{q}.running_mean"))
            keys["running_var"] = Ref("s", AttrRef(f"{q}.running_var"))
            if training and mod.num_batches_tracked is not None:
                keys["num_batches"] = Ref("s", AttrRef(f"{q}.num_batches_tracked"))
        return ("batch_norm", keys)

    if tracked and mod.momentum is None and mod.num_batches_tracked is None:
        raise Unsupported("BatchNorm1d with momentum=None and no num_batches_tracked")
    return Stage([node], {False: variant(False), True: variant(True)}, mode_module=q,
                 note=f"BatchNorm1d '{q}'")


def _pool(node, ctx: _Ctx, op, kernel, stride, padding, ceil_mode, include_pad, dilation) -> Stage:
    ctx.need_rank((2, 3), op.replace("_", ""))

    def one(v, what):
        if isinstance(v, (list, tuple)):
            if len(v) != 1:
                raise Unsupported(f"{op} {what} {v!r}")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int):
            raise Unsupported(f"{op} {what} is not a constant int")
        return v

    k = one(kernel, "kernel_size")
    s = k if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) else one(stride, "stride")
    p = one(padding, "padding")
    if one(dilation, "dilation") != 1:
        raise Unsupported(f"{op} with dilation")
    if not isinstance(ceil_mode, bool):
        raise Unsupported(f"{op} ceil_mode is not a constant")
    keys = {"kernel": k, "stride": s, "padding": p, "ceil": bool(ceil_mode)}
    if op == "avg_pool":
        if not isinstance(include_pad, bool):
            raise Unsupported("avg_pool count_include_pad is not a constant")
        keys["include_pad"] = bool(include_pad)
    return Stage([node], _unary(op, **keys))


# --------------------------------------------------------------------------------------------
# Finding chains.


def _linear_parts(node: fx.Node, gm: fx.GraphModule):
    """(x, weight source, bias source|None, module qualname|None) or raise Unsupported."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if type(mod) is not nn.Linear:
            return None
        if len(node.args) != 1 or node.kwargs:
            raise Unsupported("Linear called with extra arguments")
        q = node.target
        return (node.args[0], AttrRef(f"{q}.weight"),
                AttrRef(f"{q}.bias") if mod.bias is not None else None, q)
    if node.op == "call_function" and node.target in _LINEAR_FUNCS:
        a = bind(node, ["input", "weight", "bias"], {"bias": None})
        x, w, b = a["input"], a["weight"], a["bias"]
        if not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
            raise Unsupported("F.linear with non-tensor arguments")
        if b is not None and not isinstance(b, fx.Node):
            raise Unsupported("F.linear bias is not a tensor")
        return (x, w, b, None)
    return None


def _attr_tensor(gm: fx.GraphModule, q: str):
    obj = gm
    for part in q.split("."):
        obj = getattr(obj, part)
    return obj


def _shape_of_source(gm, src):
    if isinstance(src, AttrRef):
        t = _attr_tensor(gm, src.qualname)
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None
    if src.op == "get_attr":
        t = _attr_tensor(gm, src.target)
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None
    inf = node_info(src)
    return tuple(inf.shape) if isinstance(inf, TInfo) else None


def find_chains(gm: fx.GraphModule, flavor: str = "fx", check: Optional[Callable] = None) -> CaptureReport:
    """Every chain in ``gm``. ``check(spec) -> reason`` (the C++ parser), when given, vets each
    spec; a spec it refuses is reported in ``rejected`` and not returned as a chain."""
    report = CaptureReport(flavor=flavor)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    taken: set = set()
    for node in list(gm.graph.nodes):
        if node in taken:
            continue
        try:
            parts = _linear_parts(node, gm)
        except Unsupported as e:
            report.rejected.append((node.name, str(e)))
            continue
        if parts is None:
            continue
        x, w, b, q = parts
        wshape = _shape_of_source(gm, w)
        if wshape is None or len(wshape) != 2:
            report.rejected.append((node.name, f"linear weight shape unknown or not 2-d ({wshape})"))
            continue
        xinf = node_info(x)
        lin_inf = node_info(node)
        if not isinstance(lin_inf, TInfo) or not isinstance(xinf, TInfo):
            report.rejected.append((node.name, "no shape information for the linear's input/output"))
            continue
        if xinf.rank < 1:
            report.rejected.append((node.name, "0-d input"))
            continue
        chain = Chain(index=len(report.chains), linear=node, x=x, weight=w, bias=b,
                      in_features=int(wshape[1]), out_features=int(wshape[0]), linear_module=q)
        _grow(chain, gm, order)
        chain.finish()
        if check is not None:
            bad = None
            for flags in chain.flag_combos():
                reason = check(chain.spec(flags))
                if reason:
                    bad = reason
                    break
            if bad:
                report.rejected.append((node.name, f"spec refused by the parser: {bad}"))
                continue
        taken.update(chain.nodes)
        report.chains.append(chain)
    return report


def _grow(chain: Chain, gm: fx.GraphModule, order: dict):
    lin = chain.linear
    chain.values = {lin: 0}
    chain_nodes = {lin}
    mode_flags = {}
    ctx = _Ctx(gm, chain, chain_nodes, mode_flags)
    ctx.rank = node_info(lin).rank
    ctx.width = chain.out_features
    stop = ""
    while True:
        cur = ctx.cur
        users = sorted(cur.users, key=lambda n: order.get(n, 1 << 30))
        if not users:
            stop = f"{cur.name} is not used"
            break
        nxt = users[0]
        if nxt.op == "output":
            stop = f"{cur.name} is the graph's output"
            break
        if nxt in chain_nodes:  # cannot happen in a DAG, but be safe
            stop = f"{nxt.name} already in the chain"
            break
        try:
            stage = classify(nxt, ctx)
        except Unsupported as e:
            stop = f"{nxt.name}: {e}"
            break
        # The stage's value must keep the rank bookkeeping right.
        stage.input_node = cur
        op_line = next((v for v in stage.variants.values() if v is not None), None)
        chain.stages.append(stage)
        chain_nodes.update(stage.nodes)
        vnode = stage.value_node
        if op_line is None:
            chain.values[vnode] = chain.values[cur]
        else:
            chain.values[vnode] = len(chain.stages)
            op, keys = op_line
            if op in ("sum", "mean", "max", "min", "logsumexp"):
                if keys.get("keepdim", True):
                    ctx.width = 1
                else:
                    ctx.rank -= 1
                    ctx.has_feat = False
                    ctx.width = 0
            elif op in ("avg_pool", "max_pool"):
                inf = node_info(vnode)
                if isinstance(inf, TInfo) and inf.rank >= 1:
                    ctx.width = int(inf.shape[-1])
        inf = node_info(vnode)
        if isinstance(inf, TInfo) and inf.rank != ctx.rank:
            # Our bookkeeping disagrees with the graph's metadata: stop before this stage.
            chain.stages.pop()
            for n in stage.nodes:
                chain_nodes.discard(n)
                chain.values.pop(n, None)
            stop = f"{nxt.name}: rank bookkeeping mismatch"
            break
        ctx.cur = vnode
    # Every value but the last must be used only inside the chain: keep the longest prefix
    # for which that holds.
    chain.stop = stop
    while chain.stages:
        inside = set(chain.nodes)
        bad = None
        last = chain.output
        for n in inside:
            if n is last:
                continue
            for u in n.users:
                if u not in inside:
                    bad = (n, u)
                    break
            if bad:
                break
        if bad is None:
            break
        removed = chain.stages.pop()
        for n in removed.nodes:
            chain.values.pop(n, None)
        chain.stop = f"{bad[0].name} is also used by {bad[1].name}, outside the chain"


def capture_spec_texts(gm: fx.GraphModule, flavor: str = "fx") -> list:
    """Convenience: the spec text of every chain at the graph's current training flags."""
    rep = find_chains(gm, flavor)
    out = []
    for c in rep.chains:
        flags = tuple(gm.get_submodule(q).training for q in c.mode_modules)
        out.append(c.spec(flags))
    return out

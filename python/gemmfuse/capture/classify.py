"""From one graph node to one Stage (a spec line): the target tables and the builders for
every fusable op, module, function and method."""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .values import AttrRef, Ref, TInfo, _imm, is_number_node, node_info
from .chain import Chain, Stage, Unsupported, _int_or_single, _number, bind, target_name

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
                  torch.log_softmax: "log_softmax", F.log_softmax: "log_softmax",
                  F.softmin: "softmin"}
_SOFTMAX_MODULES = {nn.Softmax: "softmax", nn.LogSoftmax: "log_softmax", nn.Softmin: "softmin"}
_SOFTMAX_METHODS = {"softmax": "softmax", "log_softmax": "log_softmax"}

_CLAMP_FUNCS = {torch.clamp: "clamp", torch.clip: "clamp", torch.clamp_min: "clamp_min",
                torch.clamp_max: "clamp_max"}
_CLAMP_METHODS = {"clamp": "clamp", "clip": "clamp", "clamp_min": "clamp_min",
                  "clamp_max": "clamp_max"}

_MAX_POOL_FUNCS = {F.max_pool1d, F._max_pool1d, torch.max_pool1d}
_IDENTITY_METHODS = {"contiguous"}

_INPLACE_METHOD_HINT = "in-place tensor methods are not fused"


# --------------------------------------------------------------------------------------------
# The builder.


class _Ctx:
    """What classify() needs about the chain under construction."""

    def __init__(self, gm: fx.GraphModule, chain: Chain, chain_nodes: set, mode_flags: dict,
                 numbers: Optional[dict] = None):
        self.gm = gm
        self.chain = chain
        self.chain_nodes = chain_nodes
        self.mode_flags = mode_flags   # qualname -> current training flag (for capture decisions)
        self.numbers = numbers or {}   # graph node -> its number at compile time (find_chains)
        self.cur: fx.Node = chain.linear
        self.rank = 0
        self.has_feat = True
        self.width = chain.out_features

    def module(self, node: fx.Node) -> nn.Module:
        return self.gm.get_submodule(node.target)

    def imm(self, v, what: str) -> Ref:
        """A number argument: a constant, or a node whose compile-time number the spec holds
        (guarded: the chain checks it on every call)."""
        if isinstance(v, fx.Node) and v in self.numbers:
            return _imm(self.numbers[v], guard=v)
        return _imm(_number(v, what))

    def operand(self, a, what: str, allow_value: bool = False) -> Ref:
        """A binary operand: a number, an outside tensor (t), or an earlier chain value (v)."""
        if isinstance(a, fx.Node) and a in self.numbers:
            return self.imm(a, what)
        if isinstance(a, fx.Node):
            if a in self.chain.values:
                if not allow_value:
                    raise Unsupported(f"{what} is a value of the chain")
                return Ref("v", a)
            if a in self.chain_nodes:
                raise Unsupported(f"{what} is an intermediate of the chain")
            inf = node_info(a)
            if (inf is not None and not isinstance(inf, TInfo)) or is_number_node(a):
                raise Unsupported(f"{what} is not a tensor (a number the graph computes at "
                                  f"run time, which the spec cannot hold)")
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
    if node.op == "call_module":
        return _classify_module(node, ctx)
    if node.op == "call_method":
        return _classify_method(node, ctx)
    if node.op != "call_function":
        raise Unsupported(f"{node.op} node")
    t = node.target
    if t in _UNARY_FUNCS:
        _takes_chain_value(node, ctx)
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
    if t in (torch.pow, operator.pow):
        return _pow(node, ctx, list(node.args), dict(node.kwargs))
    if t in (operator.getitem, getattr):
        raise Unsupported(f"{target_name(node)} of the chain value")
    stage_of = _STAGE_OF_INPUT.get(t)
    if stage_of is None:
        raise Unsupported(f"{target_name(node)} is not a fusable stage")
    _takes_chain_value(node, ctx)
    return stage_of(node, ctx)


def _takes_chain_value(node: fx.Node, ctx: _Ctx) -> None:
    if not node.args or node.args[0] is not ctx.cur:
        raise Unsupported(f"{target_name(node)} does not take the chain value as its input")


# Functions whose first argument is the chain value: node -> Stage, each with its signature.
def _reduce_stage(node, ctx):
    return _reduce(node, ctx, _REDUCE_FUNCS[node.target],
                   bind(node, ["input", "dim", "keepdim"], {"keepdim": False, "dtype": None}))


def _softmax_stage(node, ctx):
    if node.target in (torch.softmax, torch.log_softmax):  # (input, dim, dtype)
        a = bind(node, ["input", "dim", "dtype"], {"dtype": None})
    else:  # torch.nn.functional's: (input, dim, _stacklevel, dtype)
        a = bind(node, ["input", "dim", "_stacklevel", "dtype"],
                 {"dim": None, "dtype": None, "_stacklevel": 3})
    return _softmax(node, ctx, _SOFTMAX_FUNCS[node.target], a)


def _clamp_stage(node, ctx):
    names = {"clamp": ["input", "min", "max"], "clamp_min": ["input", "min"],
             "clamp_max": ["input", "max"]}[_CLAMP_FUNCS[node.target]]
    return _clamp(node, ctx, bind(node, names, {"min": None, "max": None}))


def _hardtanh_stage(node, ctx):
    a = bind(node, ["input", "min_val", "max_val", "inplace"],
             {"min_val": -1.0, "max_val": 1.0, "inplace": False})
    _check_inplace(ctx, node, a["inplace"])
    return _clamp(node, ctx, {"min": a["min_val"], "max": a["max_val"]})


def _relu6_stage(node, ctx):
    a = bind(node, ["input", "inplace"], {"inplace": False})
    _check_inplace(ctx, node, a["inplace"])
    return _clamp(node, ctx, {"min": 0.0, "max": 6.0})


def _gelu_stage(node, ctx):
    return _gelu(bind(node, ["input", "approximate"], {"approximate": "none"})["approximate"], node)


def _softplus_stage(node, ctx):
    a = bind(node, ["input", "beta", "threshold"], {"beta": 1.0, "threshold": 20.0})
    return Stage([node], _unary("softplus", beta=ctx.imm(a["beta"], "beta"),
                                threshold=ctx.imm(a["threshold"], "threshold")))


def _elu_stage(node, ctx):
    if node.target is F.elu:
        a = bind(node, ["input", "alpha", "inplace"], {"alpha": 1.0, "inplace": False})
        _check_inplace(ctx, node, a["inplace"])
    else:
        a = bind(node, ["input", "alpha", "scale", "input_scale"],
                 {"alpha": 1.0, "scale": 1.0, "input_scale": 1.0})
        if a["scale"] != 1 or a["input_scale"] != 1:
            raise Unsupported("elu with scale/input_scale")
    return Stage([node], _unary("elu", alpha=ctx.imm(a["alpha"], "alpha")))


def _leaky_relu_stage(node, ctx):
    a = bind(node, ["input", "negative_slope", "inplace"], {"negative_slope": 0.01, "inplace": False})
    _check_inplace(ctx, node, a["inplace"])
    return Stage([node], _unary("leaky_relu", alpha=ctx.imm(a["negative_slope"], "negative_slope")))


def _group_norm_stage(node, ctx):
    a = bind(node, ["input", "num_groups", "weight", "bias", "eps", "cudnn_enabled"],
             {"weight": None, "bias": None, "eps": 1e-5, "cudnn_enabled": True})
    return _group_norm(node, ctx, a["num_groups"], a["weight"], a["bias"], a["eps"])


def _layer_norm_stage(node, ctx):
    a = bind(node, ["input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"],
             {"weight": None, "bias": None, "eps": 1e-5, "cudnn_enable": True})
    return _layer_norm(node, ctx, a["normalized_shape"], a["weight"], a["bias"], a["eps"])


def _batch_norm_stage(node, ctx):
    if node.target is F.batch_norm:
        a = bind(node, ["input", "running_mean", "running_var", "weight", "bias", "training",
                        "momentum", "eps"],
                 {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5})
    else:
        a = bind(node, ["input", "weight", "bias", "running_mean", "running_var", "training",
                        "momentum", "eps", "cudnn_enabled"], {})
    return _batch_norm_functional(node, ctx, a)


def _dropout_stage(node, ctx):
    if node.target is F.dropout:
        a = bind(node, ["input", "p", "training", "inplace"],
                 {"p": 0.5, "training": True, "inplace": False})
    else:
        a = bind(node, ["input", "p", "train"], {})
        a["training"], a["inplace"] = a["train"], False
    _check_inplace(ctx, node, a["inplace"])
    p = ctx.imm(a["p"], "dropout p")
    training = a["training"]
    if not isinstance(training, bool):
        raise Unsupported("dropout's training flag is not a constant")
    if training and p.value > 0:
        raise Unsupported(f"dropout(p={p.value}) in training mode runs in PyTorch")
    return Stage([node], _unary("dropout", p=p, training=bool(training)))


def _avg_pool_stage(node, ctx):
    a = bind(node, ["input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"],
             {"stride": None, "padding": 0, "ceil_mode": False, "count_include_pad": True})
    return _pool(node, ctx, "avg_pool", a["kernel_size"], a["stride"], a["padding"],
                 a["ceil_mode"], a["count_include_pad"], 1)


def _max_pool_stage(node, ctx):
    a = bind(node, ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
                    "return_indices"],
             {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False,
              "return_indices": False})
    if a["return_indices"]:
        raise Unsupported("max_pool1d with return_indices")
    return _pool(node, ctx, "max_pool", a["kernel_size"], a["stride"], a["padding"],
                 a["ceil_mode"], None, a["dilation"])


_STAGE_OF_INPUT = {
    **{t: _reduce_stage for t in _REDUCE_FUNCS},
    **{t: _softmax_stage for t in _SOFTMAX_FUNCS},
    **{t: _clamp_stage for t in _CLAMP_FUNCS},
    **{t: _max_pool_stage for t in _MAX_POOL_FUNCS},
    F.hardtanh: _hardtanh_stage, torch._C._nn.hardtanh: _hardtanh_stage,
    F.relu6: _relu6_stage, torch._C._nn.relu6: _relu6_stage,
    F.gelu: _gelu_stage, F.softplus: _softplus_stage,
    F.elu: _elu_stage, torch._C._nn.elu: _elu_stage,
    F.leaky_relu: _leaky_relu_stage, torch._C._nn.leaky_relu: _leaky_relu_stage,
    F.group_norm: _group_norm_stage, torch.group_norm: _group_norm_stage,
    F.layer_norm: _layer_norm_stage, torch.layer_norm: _layer_norm_stage,
    F.batch_norm: _batch_norm_stage, torch.batch_norm: _batch_norm_stage,
    F.dropout: _dropout_stage, torch.dropout: _dropout_stage,
    F.avg_pool1d: _avg_pool_stage,
}


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
    stage_of = _STAGE_OF_MODULE.get(tp)
    if stage_of is None:
        raise Unsupported(f"module '{q}' ({tp.__name__}) is not a fusable stage")
    return stage_of(node, ctx, mod)


# Modules called on the chain value: (node, ctx, module) -> Stage.
def _softplus_module(node, ctx, mod):
    return Stage([node], _unary("softplus", beta=_imm(mod.beta), threshold=_imm(mod.threshold)))


def _elu_module(node, ctx, mod):
    _check_inplace(ctx, node, mod.inplace)
    return Stage([node], _unary("elu", alpha=_imm(mod.alpha)))


def _leaky_relu_module(node, ctx, mod):
    _check_inplace(ctx, node, mod.inplace)
    return Stage([node], _unary("leaky_relu", alpha=_imm(mod.negative_slope)))


def _hardtanh_module(node, ctx, mod):  # nn.ReLU6 too
    _check_inplace(ctx, node, mod.inplace)
    return _clamp(node, ctx, {"min": mod.min_val, "max": mod.max_val})


def _softmax_module(node, ctx, mod):
    return _softmax(node, ctx, _SOFTMAX_MODULES[type(mod)], {"dim": mod.dim, "dtype": None})


def _affine(q: str, mod, name: str):
    return AttrRef(f"{q}.{name}") if getattr(mod, name, None) is not None else None


def _group_norm_module(node, ctx, mod):
    ctx.need_rank((2,), "GroupNorm")
    if mod.num_channels != ctx.width:
        raise Unsupported(f"GroupNorm({mod.num_groups}, {mod.num_channels}) on width {ctx.width}")
    q = node.target
    return _group_norm(node, ctx, mod.num_groups, _affine(q, mod, "weight"), _affine(q, mod, "bias"),
                       mod.eps)


def _layer_norm_module(node, ctx, mod):
    q = node.target
    return _layer_norm(node, ctx, mod.normalized_shape, _affine(q, mod, "weight"),
                       _affine(q, mod, "bias"), mod.eps)


def _dropout_module(node, ctx, mod):
    _check_inplace(ctx, node, mod.inplace)
    q, p = node.target, float(mod.p)
    if p == 0:
        return Stage([node], _unary("dropout", p=_imm(0.0), training=False))
    if ctx.mode_flags.get(q, mod.training):
        raise Unsupported(f"Dropout(p={p}) '{q}' is in training mode (runs in PyTorch)")
    return Stage([node], {False: ("dropout", {"p": _imm(p), "training": False}),
                          True: ("dropout", {"p": _imm(p), "training": True})},
                 mode_module=q, note=f"Dropout '{q}'")


def _avg_pool_module(node, ctx, mod):
    return _pool(node, ctx, "avg_pool", mod.kernel_size, mod.stride, mod.padding,
                 mod.ceil_mode, mod.count_include_pad, 1)


def _max_pool_module(node, ctx, mod):
    if mod.return_indices:
        raise Unsupported("MaxPool1d with return_indices")
    return _pool(node, ctx, "max_pool", mod.kernel_size, mod.stride, mod.padding,
                 mod.ceil_mode, None, mod.dilation)


_STAGE_OF_MODULE = {
    nn.Identity: lambda node, ctx, mod: Stage([node], {None: None}),
    nn.GELU: lambda node, ctx, mod: _gelu(mod.approximate, node),
    nn.Softplus: _softplus_module, nn.ELU: _elu_module, nn.LeakyReLU: _leaky_relu_module,
    nn.Hardtanh: _hardtanh_module, nn.ReLU6: _hardtanh_module,
    **{m: _softmax_module for m in _SOFTMAX_MODULES},
    nn.GroupNorm: _group_norm_module, nn.LayerNorm: _layer_norm_module,
    nn.BatchNorm1d: lambda node, ctx, mod: _batch_norm_module(node, ctx, mod),
    nn.Dropout: _dropout_module, nn.AvgPool1d: _avg_pool_module, nn.MaxPool1d: _max_pool_module,
}


# ---- stage helpers --------------------------------------------------------------------------


def _gelu(approximate, node) -> Stage:
    if approximate == "none":
        return Stage([node], _unary("gelu"))
    if approximate == "tanh":
        return Stage([node], _unary("gelu_tanh"))
    raise Unsupported(f"gelu approximate={approximate!r}")


def _binary_args(node: fx.Node, args: list, kwargs: dict) -> tuple:
    """(first operand, second operand, alpha) of a binary op called with these arguments."""
    for n in ["input", "other"][len(args):]:
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
    return args[0], args[1], alpha


def _binary(node: fx.Node, ctx: _Ctx, op: str, args: list, kwargs: dict) -> Stage:
    cur = ctx.cur
    a0, a1, alpha = _binary_args(node, args, kwargs)
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
    st.variants[None][1]["index"] = True  # the gradient goes to the index torch.max returns
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
        keys["lo"] = ctx.imm(lo, "clamp min")
    if hi is not None:
        keys["hi"] = ctx.imm(hi, "clamp max")
    ctx.same_shape_out(node, "clamp")
    return Stage([node], _unary("clamp", **keys))


def _pow(node, ctx: _Ctx, args: list, kwargs: dict) -> Stage:
    names = ["input", "exponent"]
    a = dict(zip(names, args))
    a.update(kwargs)
    if a.get("input") is not ctx.cur:
        raise Unsupported("pow with the chain value as the exponent")
    e = a.get("exponent")
    if (e not in ctx.numbers if isinstance(e, fx.Node)
            else not isinstance(e, (int, float)) or isinstance(e, bool)):
        raise Unsupported("pow with a tensor exponent")
    ctx.same_shape_out(node, "pow")
    return Stage([node], _unary("pow", alpha=ctx.imm(e, "pow exponent")))


def _group_norm(node, ctx: _Ctx, groups, weight, bias, eps) -> Stage:
    ctx.need_rank((2,), "group_norm")
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise Unsupported("group_norm groups is not a constant int")
    keys = {"groups": groups, "eps": ctx.imm(eps, "eps")}
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
    keys = {"groups": 1, "eps": ctx.imm(eps, "eps")}
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
    keys = {"training": training, "eps": ctx.imm(a["eps"], "eps")}
    if training and rm is not None:
        mom = a["momentum"]
        if mom is None:
            raise Unsupported("functional batch_norm with momentum=None")
        keys["momentum"] = ctx.imm(mom, "momentum")
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
        return _int_or_single(v, f"{op} {what}")

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

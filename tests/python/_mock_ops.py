"""A pure-PyTorch stand-in for the C++ operator library, for developing the Python front
without a build (``GEMMFUSE_MOCK=1``). It interprets the chain spec with eager PyTorch ops in
the input's dtype and registers ``torch.ops.gemmfuse.{run,describe,check}`` with the same
schemas. It is NOT a reference for numbers (the C++ CPU executor is); it only lets the
plumbing (capture, rewrite, fallbacks, state, compile/export) be exercised.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "square": torch.square, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "exp": torch.exp, "log": torch.log, "relu": torch.relu,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "mish": F.mish,
    "reciprocal": torch.reciprocal, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
_BIN = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
        "minimum": torch.minimum, "maximum": torch.maximum}
_RED = {"sum": lambda x, k: x.sum(-1, keepdim=k), "mean": lambda x, k: x.mean(-1, keepdim=k),
        "max": lambda x, k: x.amax(-1, keepdim=k), "min": lambda x, k: x.amin(-1, keepdim=k),
        "logsumexp": lambda x, k: torch.logsumexp(x, -1, keepdim=k)}


def parse(spec: str):
    lines = [ln.split() for ln in spec.strip().splitlines() if ln.strip()]
    out = []
    for parts in lines:
        keys = {}
        for kv in parts[1:]:
            k, v = kv.split("=", 1)
            keys[k] = v
        out.append((parts[0], keys))
    if not out or out[0][0] != "linear":
        raise ValueError("line 1: the first line must be linear")
    for op, _ in out[1:]:
        if op not in _UNARY and op not in _BIN and op not in _RED and op not in (
                "softplus", "elu", "leaky_relu", "clamp", "pow", "softmax", "log_softmax",
                "group_norm", "avg_pool", "max_pool", "batch_norm", "dropout"):
            raise ValueError(f"unknown op {op}")
    return out


def _num(v):
    return float(v)


def interpret(spec, x, weight, bias, operands, state):
    lines = parse(spec)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = F.linear(x2, weight, bias)
    vals = [y]

    def opnd(s, like):
        if s[0] == "t":
            t = operands[int(s[1:])]
            if t.dim() >= 2 and t.shape[:-1] == lead:
                t = t.reshape(-1, t.shape[-1])
            elif t.dim() == len(lead) + 1 and t.shape[-1] == 1:
                t = t.reshape(-1, 1)
            return t
        if s[0] == "s":
            return state[int(s[1:])]
        if s[0] == "v":
            return vals[int(s[1:])]
        return _num(s)

    cur = y
    for op, k in lines[1:]:
        if op in _UNARY:
            cur = _UNARY[op](cur)
        elif op in _BIN:
            b = opnd(k["b"], cur)
            if not isinstance(b, torch.Tensor):
                b = torch.tensor(b, dtype=cur.dtype)
            cur = _BIN[op](b, cur) if k.get("rev") == "1" else _BIN[op](cur, b)
        elif op in _RED:
            cur = _RED[op](cur, k.get("keepdim", "1") == "1")
        elif op == "softplus":
            cur = F.softplus(cur, _num(k.get("beta", 1)), _num(k.get("threshold", 20)))
        elif op == "elu":
            cur = F.elu(cur, _num(k.get("alpha", 1)))
        elif op == "leaky_relu":
            cur = F.leaky_relu(cur, _num(k.get("alpha", 0.01)))
        elif op == "clamp":
            cur = torch.clamp(cur, _num(k.get("lo", "-inf")), _num(k.get("hi", "inf")))
            if "lo" not in k or "hi" not in k:
                cur = torch.clamp(cur, min=_num(k["lo"])) if "lo" in k else torch.clamp(cur, max=_num(k["hi"]))
        elif op == "pow":
            cur = cur ** _num(k["alpha"])
        elif op == "softmax":
            cur = torch.softmax(cur, -1)
        elif op == "log_softmax":
            cur = torch.log_softmax(cur, -1)
        elif op == "group_norm":
            w = opnd(k["weight"], cur) if "weight" in k else None
            b = opnd(k["bias"], cur) if "bias" in k else None
            cur = F.group_norm(cur, int(k.get("groups", 1)), w, b, _num(k.get("eps", 1e-5)))
        elif op in ("avg_pool", "max_pool"):
            kern = int(k["kernel"])
            stride = int(k.get("stride", kern))
            pad = int(k.get("padding", 0))
            ceil = k.get("ceil", "0") == "1"
            if op == "avg_pool":
                cur = F.avg_pool1d(cur.unsqueeze(1), kern, stride, pad, ceil,
                                   k.get("include_pad", "1") == "1").squeeze(1)
            else:
                cur = F.max_pool1d(cur.unsqueeze(1), kern, stride, pad, 1, ceil).squeeze(1)
        elif op == "batch_norm":
            training = k.get("training", "0") == "1"
            rm = opnd(k["running_mean"], cur) if "running_mean" in k else None
            rv = opnd(k["running_var"], cur) if "running_var" in k else None
            w = opnd(k["weight"], cur) if "weight" in k else None
            b = opnd(k["bias"], cur) if "bias" in k else None
            mom = k.get("momentum", "0.1")
            if "num_batches" in k and training:
                nb = opnd(k["num_batches"], cur)
                nb.add_(1)
                if mom == "none":
                    mom = 1.0 / float(nb)
            mom = 0.0 if mom == "none" else _num(mom)
            if training and cur.shape[0] <= 1:
                raise ValueError("Expected more than 1 value per channel when training, got input size "
                                 + str(cur.shape))
            cur = F.batch_norm(cur, rm, rv, w, b, training, mom, _num(k.get("eps", 1e-5)))
        elif op == "dropout":
            if k.get("training", "0") == "1" and _num(k.get("p", 0.5)) > 0:
                raise RuntimeError("gemmfuse unsupported: dropout in training mode")
        vals.append(cur)
    if cur.dim() >= 1 and cur.shape[0] == x2.shape[0] and (cur.dim() == 2):
        return cur.reshape(*lead, cur.shape[-1]).contiguous()
    return cur.reshape(*lead).contiguous() if cur.dim() == 1 else cur


def _out_shape(spec, x):
    lines = parse(spec)
    w = int(lines[0][1]["out"])
    feat = True
    for op, k in lines[1:]:
        if op in _RED:
            if k.get("keepdim", "1") == "1":
                w = 1
            else:
                feat = False
        elif op in ("avg_pool", "max_pool"):
            kern = int(k["kernel"])
            stride = int(k.get("stride", kern))
            pad = int(k.get("padding", 0))
            ceil = k.get("ceil", "0") == "1"
            num = w + 2 * pad - kern
            o = (math.ceil(num / stride) if ceil else num // stride) + 1
            if ceil and (o - 1) * stride >= w + pad:
                o -= 1
            w = o
    return list(x.shape[:-1]) + ([w] if feat else [])


_lib = None


def install():
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("gemmfuse", "DEF")
    _lib.define("run(str spec, Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, "
                "Tensor(a!)[] state, str precision) -> Tensor")
    _lib.define("describe(str spec, Tensor x, Tensor weight, Tensor? bias, Tensor[] operands, "
                "Tensor[] state, str precision) -> str")
    _lib.define("check(str spec) -> str")

    def run(spec, x, weight, bias, operands, state, precision):
        if x.shape[:-1].numel() == 0:
            return x.new_empty(_out_shape(spec, x))
        return interpret(spec, x, weight, bias, operands, state)

    def run_meta(spec, x, weight, bias, operands, state, precision):
        return x.new_empty(_out_shape(spec, x))

    def describe(spec, x, weight, bias, operands, state, precision):
        for op, k in parse(spec)[1:]:
            if op == "dropout" and k.get("training") == "1" and float(k.get("p", 0.5)) > 0:
                raise RuntimeError("gemmfuse unsupported: dropout in training mode")
        return "mock plan\n" + spec

    def check(spec):
        try:
            parse(spec)
            return ""
        except ValueError as e:
            return str(e)

    _lib.impl("run", run, "CPU")
    _lib.impl("run", run, "CUDA")
    _lib.impl("run", run_meta, "Meta")
    _lib.impl("describe", describe, "CompositeExplicitAutograd")
    _lib.impl("check", check, "CompositeExplicitAutograd")

"""Seeded differential fuzz: random Linear -> stages chains, gemmfuse vs eager PyTorch (float64).

Every chain is a real nn.Module (modules, F.* functions, tensor methods, operators, parameters
and buffers as operands, residuals), optimized with gemmfuse.optimize and compared with the
same module in float64. Where eager fp32 is not finite, gemmfuse must give the same NaN/inf;
elsewhere |out - ref64| <= 1e-4 + 1e-4*|ref64| + 4*max|eager32 - ref64| (the fp32
conditioning of the chain itself, which some ops amplify: the worst eager error over the output).

GEMMFUSE_FUZZ_SEED picks the seed (printed); GEMMFUSE_FUZZ_N the number of chains.
A failure prints the spec, the shapes and the program so that it can be replayed.
"""
import copy
import os
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gemmfuse
from conftest import needs_lib

pytestmark = needs_lib

SEED = int(os.environ.get("GEMMFUSE_FUZZ_SEED", "20261121"))
COUNT = int(os.environ.get("GEMMFUSE_FUZZ_N", "520"))
BATCHES = 4  # the chains are split over this many tests (so -x stops early, and -n works)


def _odd_size(rng, lo, hi):
    while True:
        v = rng.randint(lo, hi)
        if v % 8:
            return v


UNARY = ["neg", "abs", "square", "sqrt", "rsqrt", "exp", "log", "relu", "sigmoid", "tanh",
         "silu", "mish", "reciprocal", "gelu", "gelu_tanh", "softplus", "elu", "leaky_relu",
         "clamp", "hardtanh", "relu6", "pow"]
BINARY = ["add", "sub", "mul", "div", "minimum", "maximum"]
REDUCE = ["sum", "mean", "max", "min", "logsumexp"]
SAFE_DOMAIN = {"sqrt", "rsqrt", "log", "reciprocal"}


def _pool_width(kind, w, k, s, p, ceil, incl=True):
    z = torch.zeros(1, 1, w)
    if kind == "avg_pool":
        return F.avg_pool1d(z, k, s, p, ceil, incl).shape[-1]
    return F.max_pool1d(z, k, s, p, 1, ceil).shape[-1]


def gen_program(rng):
    """A random chain program: (K, N, M, lead, steps)."""
    K = _odd_size(rng, 3, 70)
    N = _odd_size(rng, 3, 140)
    M = rng.choice([1, 2, 3, 5, 9, 17, 33])
    lead = () if rng.random() < 0.8 else (2,)
    rank2 = lead == ()
    steps = []
    width, feat = N, True
    values = [(N, True)]  # (width, has_feat) per value id
    n_steps = rng.randint(1, 7)
    bn_ok = rank2
    for _ in range(n_steps):
        choices = ["unary"] * 6 + ["binary"] * 5
        if feat:
            choices += ["reduce"] * 2 + ["softmax"] * 2 + ["pool"]
            if width >= 1:
                choices += ["layer_norm"]
            if rank2:
                choices += ["group_norm"] * 2
            if bn_ok:
                choices += ["batch_norm"] * 2
            choices += ["dropout"]
        kind = rng.choice(choices)
        form = rng.choice(["module", "function", "method"])
        if kind == "unary":
            op = rng.choice(UNARY)
            if op in SAFE_DOMAIN or (op == "pow" and rng.random() < 0.3):
                steps.append(("unary", "abs", "method", {}))
                values.append((width, feat))
                steps.append(("binary", "add", "operator", {"b": ("scalar", 0.5), "rev": False}))
                values.append((width, feat))
            if op == "exp":
                steps.append(("unary", "clamp", "function", {"lo": -8.0, "hi": 8.0}))
                values.append((width, feat))
            params = {}
            if op == "clamp":
                lo = rng.choice([None, -1.5, -0.25])
                hi = rng.choice([None, 0.5, 2.0]) if lo is not None else rng.choice([0.5, 2.0])
                params = {"lo": lo, "hi": hi}
            elif op == "softplus":
                params = {"beta": rng.choice([1.0, 2.0, 0.5]), "threshold": rng.choice([20.0, 5.0])}
            elif op == "elu":
                params = {"alpha": rng.choice([1.0, 0.5])}
            elif op == "leaky_relu":
                params = {"slope": rng.choice([0.01, 0.2])}
            elif op == "hardtanh":
                params = {"lo": -rng.choice([1.0, 0.5]), "hi": rng.choice([1.0, 2.0])}
            elif op == "pow":
                params = {"e": rng.choice([2, 3, 2.0])}
                if steps and steps[-1][1] == "add" and steps[-1][3].get("b") == ("scalar", 0.5):
                    params["e"] = rng.choice([0.5, 1.5, -1.0])
            steps.append(("unary", op, form, params))
        elif kind == "binary":
            op = rng.choice(BINARY)
            same = [i for i, (w, f) in enumerate(values) if w == width and f == feat]
            opts = ["scalar", "col", "row", "full", "one", "zero_dim"] + (["value"] * 2 if same else [])
            if not feat:
                opts = ["scalar", "row", "full", "one", "zero_dim"] + (["value"] if same else [])
            ok = rng.choice(opts)
            rev = rng.random() < 0.35
            if op == "div":
                if ok == "value":
                    ok = "col" if feat else "row"
                if rev:  # b / x: make x safe first
                    steps.append(("unary", "abs", "method", {}))
                    values.append((width, feat))
                    steps.append(("binary", "add", "operator", {"b": ("scalar", 0.75), "rev": False}))
                    values.append((width, feat))
            if ok == "scalar":
                b = ("scalar", rng.choice([2.0, -0.5, 3, 0.125, 1.5]))
            elif ok == "value":
                b = ("value", rng.choice(same))
            else:
                b = (ok, None)
            steps.append(("binary", op, rng.choice(["operator", "function", "method"]),
                          {"b": b, "rev": rev, "positive": op == "div"}))
        elif kind == "reduce":
            op = rng.choice(REDUCE)
            keep = rng.random() < 0.6
            steps.append(("reduce", op, form, {"keepdim": keep, "dim": rng.choice([-1, len(lead) + 1])}))
            if keep:
                width = 1
            else:
                feat, width = False, 0
        elif kind == "softmax":
            op = rng.choice(["softmax", "log_softmax", "softmin"])
            if op == "softmin" and form == "method":  # a function and a module, no method
                form = "function"
            steps.append(("softmax", op, form, {"dim": rng.choice([-1, len(lead) + 1])}))
        elif kind == "pool":
            op = rng.choice(["avg_pool", "max_pool"])
            k = rng.randint(1, min(4, max(1, width)))
            s = rng.randint(1, k)
            p = rng.randint(0, k // 2)
            ceil = rng.random() < 0.3
            incl = rng.random() < 0.5
            try:
                nw = _pool_width(op, width, k, s, p, ceil, incl)
            except RuntimeError:
                continue
            if nw < 1:
                continue
            steps.append(("pool", op, rng.choice(["module", "function"]),
                          {"k": k, "s": s, "p": p, "ceil": ceil, "incl": incl}))
            width = nw
        elif kind == "group_norm":
            divs = [g for g in range(1, width + 1) if width % g == 0 and M * width // g > 1]
            if not divs:
                continue
            g = rng.choice(divs)
            steps.append(("group_norm", "group_norm", rng.choice(["module", "function"]),
                          {"groups": g, "affine": rng.random() < 0.7,
                           "eps": rng.choice([1e-5, 1e-3])}))
        elif kind == "layer_norm":
            steps.append(("layer_norm", "layer_norm", rng.choice(["module", "function"]),
                          {"affine": rng.random() < 0.7, "eps": rng.choice([1e-5, 1e-3]),
                           "width": width}))
        elif kind == "batch_norm":
            train = M >= 2 and rng.random() < 0.6
            steps.append(("batch_norm", "batch_norm", "module",
                          {"train": train, "affine": rng.random() < 0.8,
                           "momentum": rng.choice([0.1, 0.3, None]),
                           "track": M < 2 or rng.random() < 0.85}))
            bn_ok = bn_ok and True
        elif kind == "dropout":
            steps.append(("dropout", "dropout", rng.choice(["module", "function"]), {"p": 0.3}))
        values.append((width, feat))
    return K, N, M, lead, steps, rng.random() < 0.8


class FuzzModel(nn.Module):
    """Interprets a program; symbolic_trace flattens it into a plain graph."""

    def __init__(self, program, rng_seed):
        super().__init__()
        K, N, M, lead, steps, bias = program
        g = torch.Generator().manual_seed(rng_seed)
        self.lin = nn.Linear(K, N, bias=bias)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(N, K, generator=g) / K ** 0.5)
            if bias:
                self.lin.bias.copy_(torch.randn(N, generator=g) * 0.5)
        self.steps = steps
        self.lead, self.M = lead, M
        width, feat = N, True
        self.extra = nn.ModuleDict()
        widths = []
        for i, (kind, op, form, prm) in enumerate(steps):
            widths.append((width, feat))
            name = f"s{i}"
            if kind == "binary":
                b = prm["b"]
                shape = {"col": (width,), "row": lead + (M, 1) if feat else lead + (M,), "full": lead + (M, width) if feat else lead + (M,),
                         "one": (1,), "zero_dim": ()}.get(b[0])
                if shape is not None:
                    t = torch.randn(shape, generator=g)
                    if prm.get("positive"):
                        t = t.abs() + 0.5
                    if b[0] in ("col", "one") and torch.rand((), generator=g) < 0.5:
                        setattr(self, name, nn.Parameter(t))
                    else:
                        self.register_buffer(name, t)
            elif kind in ("group_norm", "layer_norm"):
                if form == "module":
                    self.extra[name] = (
                        nn.GroupNorm(prm["groups"], width, eps=prm["eps"], affine=prm["affine"])
                        if kind == "group_norm" else
                        nn.LayerNorm(width, eps=prm["eps"], elementwise_affine=prm["affine"]))
                    if prm["affine"]:
                        with torch.no_grad():
                            self.extra[name].weight.copy_(torch.randn(width, generator=g))
                            self.extra[name].bias.copy_(torch.randn(width, generator=g))
                elif prm["affine"]:
                    setattr(self, name + "w", nn.Parameter(torch.randn(width, generator=g)))
                    setattr(self, name + "b", nn.Parameter(torch.randn(width, generator=g)))
            elif kind == "batch_norm":
                bn = nn.BatchNorm1d(width, momentum=prm["momentum"], affine=prm["affine"],
                                    track_running_stats=prm["track"])
                with torch.no_grad():
                    if prm["affine"]:
                        bn.weight.copy_(torch.randn(width, generator=g))
                        bn.bias.copy_(torch.randn(width, generator=g))
                    if prm["track"]:
                        bn.running_mean.copy_(torch.randn(width, generator=g) * 0.3)
                        bn.running_var.copy_(torch.rand(width, generator=g) + 0.5)
                bn.train(prm["train"])
                self.extra[name] = bn
            elif kind == "dropout" and form == "module":
                self.extra[name] = nn.Dropout(prm["p"]).eval()
            elif kind == "pool" and form == "module":
                cls = nn.AvgPool1d if op == "avg_pool" else nn.MaxPool1d
                kw = {"count_include_pad": prm["incl"]} if op == "avg_pool" else {}
                self.extra[name] = cls(prm["k"], prm["s"], prm["p"], ceil_mode=prm["ceil"], **kw)
            elif kind == "softmax" and form == "module":
                cls = {"softmax": nn.Softmax, "log_softmax": nn.LogSoftmax, "softmin": nn.Softmin}[op]
                self.extra[name] = cls(dim=prm["dim"])
            elif kind == "unary" and form == "module":
                mod = _unary_module(op, prm)
                if mod is not None:
                    self.extra[name] = mod
            # width bookkeeping
            if kind == "reduce":
                width, feat = (1, True) if prm["keepdim"] else (0, False)
            elif kind == "pool":
                width = _pool_width(op, width, prm["k"], prm["s"], prm["p"], prm["ceil"], prm["incl"])

    def train(self, mode=True):  # keep each BN/Dropout in the mode the program chose
        self.training = mode
        return self

    def forward(self, x):
        vals = [self.lin(x)]
        for i, (kind, op, form, prm) in enumerate(self.steps):
            cur = vals[-1]
            name = f"s{i}"
            vals.append(_apply(self, name, kind, op, form, prm, cur, vals))
        return vals[-1]


def _unary_module(op, prm):
    return {
        "relu": lambda: nn.ReLU(), "sigmoid": lambda: nn.Sigmoid(), "tanh": lambda: nn.Tanh(),
        "silu": lambda: nn.SiLU(), "mish": lambda: nn.Mish(), "gelu": lambda: nn.GELU(),
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "softplus": lambda: nn.Softplus(prm.get("beta", 1), prm.get("threshold", 20)),
        "elu": lambda: nn.ELU(prm.get("alpha", 1.0)),
        "leaky_relu": lambda: nn.LeakyReLU(prm.get("slope", 0.01)),
        "hardtanh": lambda: nn.Hardtanh(prm.get("lo", -1), prm.get("hi", 1)),
        "relu6": lambda: nn.ReLU6(),
    }.get(op, lambda: None)()


_FUNCS = {
    "neg": torch.neg, "abs": torch.abs, "square": torch.square, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "exp": torch.exp, "log": torch.log, "relu": F.relu,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "mish": F.mish,
    "reciprocal": torch.reciprocal, "gelu": F.gelu,
}


def _apply(self, name, kind, op, form, prm, cur, vals):
    if kind == "unary":
        if name in self.extra:
            return self.extra[name](cur)
        if op == "clamp":
            if form == "method":
                return cur.clamp(prm["lo"], prm["hi"])
            if prm["lo"] is None:
                return torch.clamp_max(cur, prm["hi"])
            if prm["hi"] is None:
                return torch.clamp_min(cur, prm["lo"])
            return torch.clamp(cur, min=prm["lo"], max=prm["hi"])
        if op == "hardtanh":
            return F.hardtanh(cur, prm["lo"], prm["hi"])
        if op == "relu6":
            return F.relu6(cur)
        if op == "softplus":
            return F.softplus(cur, beta=prm["beta"], threshold=prm["threshold"])
        if op == "elu":
            return F.elu(cur, prm["alpha"])
        if op == "leaky_relu":
            return F.leaky_relu(cur, prm["slope"])
        if op == "gelu_tanh":
            return F.gelu(cur, approximate="tanh")
        if op == "pow":
            return cur ** prm["e"] if form != "method" else cur.pow(prm["e"])
        if form == "method" and hasattr(torch.Tensor, op):
            return getattr(cur, op)()
        return _FUNCS[op](cur)
    if kind == "binary":
        kindb, v = prm["b"]
        if kindb == "scalar":
            b = v
        elif kindb == "value":
            b = vals[v]
        else:
            b = getattr(self, name)
        a, c = (b, cur) if prm["rev"] else (cur, b)
        if op in ("minimum", "maximum"):
            if isinstance(b, (int, float)):
                return torch.clamp(cur, max=b) if op == "minimum" else torch.clamp(cur, min=b)
            return getattr(torch, op)(a, c) if form != "method" else getattr(a, op)(c)
        if form == "operator" or isinstance(a, (int, float)):
            return {"add": lambda: a + c, "sub": lambda: a - c, "mul": lambda: a * c,
                    "div": lambda: a / c}[op]()
        if form == "method":
            return getattr(a, op)(c)
        return getattr(torch, op)(a, c)
    if kind == "reduce":
        dim, keep = prm["dim"], prm["keepdim"]
        if op in ("max", "min"):
            if form == "method":
                return getattr(cur, op)(dim, keepdim=keep).values
            return getattr(torch, op)(cur, dim=dim, keepdim=keep)[0]
        if form == "method":
            return getattr(cur, op)(dim, keepdim=keep)
        return getattr(torch, op)(cur, dim=dim, keepdim=keep)
    if kind == "softmax":
        if name in self.extra:
            return self.extra[name](cur)
        if form == "method":
            return getattr(cur, op)(prm["dim"])
        return getattr(F, op)(cur, dim=prm["dim"])
    if kind == "pool":
        if name in self.extra:
            return self.extra[name](cur)
        if op == "avg_pool":
            return F.avg_pool1d(cur, prm["k"], prm["s"], prm["p"], prm["ceil"], prm["incl"])
        return F.max_pool1d(cur, prm["k"], prm["s"], prm["p"], ceil_mode=prm["ceil"])
    if kind == "group_norm":
        if name in self.extra:
            return self.extra[name](cur)
        w = getattr(self, name + "w", None)
        return F.group_norm(cur, prm["groups"], w, getattr(self, name + "b", None), prm["eps"])
    if kind == "layer_norm":
        if name in self.extra:
            return self.extra[name](cur)
        w = getattr(self, name + "w", None)
        return F.layer_norm(cur, (prm["width"],), w, getattr(self, name + "b", None), prm["eps"])
    if kind == "batch_norm":
        return self.extra[name](cur)
    if kind == "dropout":
        if name in self.extra:
            return self.extra[name](cur)
        return F.dropout(cur, prm["p"], training=False)
    raise AssertionError(kind)


def _compare(out, ref64, eager32):
    """(ok, message)."""
    if out.shape != ref64.shape:
        return False, f"shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    out = out.double()
    e32 = eager32.double()
    fin = torch.isfinite(e32)
    if not torch.equal(torch.isnan(out[~fin]), torch.isnan(e32[~fin])) or \
            not torch.equal(out[~fin & ~torch.isnan(e32)], e32[~fin & ~torch.isnan(e32)]):
        return False, "non-finite values differ from eager fp32"
    ref = ref64[fin]
    o = out[fin]
    # The chain's own fp32 conditioning: eager fp32's worst error over the output (some chains,
    # e.g. a norm over nearly equal values, amplify rounding wherever it happens).
    e_err = (e32[fin] - ref).abs().max() if ref.numel() else 0.0
    tol = 1e-4 + 1e-4 * ref.abs() + 4 * e_err
    bad = ~((o - ref).abs() <= tol)
    if bad.any():
        i = bad.nonzero()[0].item()
        return False, (f"{int(bad.sum())}/{bad.numel()} values off; e.g. got {o[i].item():.9g} "
                       f"ref64 {ref[i].item():.9g} eager32 {e32[fin][i].item():.9g}")
    return True, ""


def run_one(index, stats):
    rng = random.Random(SEED * 1000003 + index)
    program = gen_program(rng)
    K, N, M, lead, steps, bias = program
    torch.manual_seed(SEED + index)
    model = FuzzModel(program, SEED + index)
    x = torch.randn(*lead, M, K)
    ref_model = copy.deepcopy(model).double()
    eager_model = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, (x,))
    rts = gemmfuse.runtimes(opt)
    rep = opt._gemmfuse
    spec = rep.entries[0].spec if rep.entries else "(no chain)"
    where = (f"fuzz seed={SEED} index={index}: x{list(x.shape)} K={K} N={N}\nspec:\n{spec}"
             f"program: {steps}\nexplain:\n{gemmfuse.explain(opt, print_it=False)}")
    with torch.no_grad():
        out = opt(x)
        eager = eager_model(x)
        ref = ref_model(x.double())
    ok, msg = _compare(out, ref, eager)
    assert ok, f"{msg}\n{where}"
    # BatchNorm state must follow PyTorch's.
    for (n1, b1), (_, b2), (_, b3) in zip(model.named_buffers(), eager_model.named_buffers(),
                                          ref_model.named_buffers()):
        if b1.dtype == torch.int64:
            assert torch.equal(b1, b2), f"buffer {n1}: {b1} != {b2}\n{where}"
            continue
        ok, msg = _compare(b1, b3, b2)
        assert ok, f"buffer {n1}: {msg}\n{where}"
    fused = bool(rts) and rts[0].fused_calls == 1
    stats["fused"] += fused
    stats["whole"] += fused and "output" in rep.entries[0].stop
    if not fused:
        stats["pytorch"].append((index, rep.entries[0].reason if rep.entries else "no chain",
                                 dict(rts[0].fallbacks) if rts else {}))


@pytest.mark.parametrize("part", range(BATCHES))
def test_fuzz(part, capsys):
    stats = {"fused": 0, "whole": 0, "pytorch": []}
    idx = range(part, COUNT, BATCHES)
    for i in idx:
        run_one(i, stats)
    n = len(idx)
    with capsys.disabled():
        print(f"\n[fuzz seed={SEED} part {part}] {n} chains: {stats['fused']} fused "
              f"({stats['whole']} whole), {len(stats['pytorch'])} ran in PyTorch")
        for entry in stats["pytorch"][:5]:
            print("   in PyTorch:", entry)
    # The generator only writes chains gemmfuse takes: nearly all must fuse, whole.
    assert stats["fused"] >= 0.9 * n, stats["pytorch"][:10]
    assert stats["whole"] >= 0.9 * n

"""Gradients of fused chains against float64: every op of the C++ op table (test_op_grads),
and random chains (test_fuzz_backward, the forward fuzz's generator). The chains run fused
while autograd records (gemmfuse::train_forward / train_backward); each gradient (x, W, b and
every parameter the chain reads) must match float64 autograd about as well as eager fp32's
does: ||g - g64|| <= 8 ||g_eager - g64|| + 1e-5 ||g64|| + 3e-5 sqrt(n) (n values: some random
chains normalise constant values, e.g. a norm over a width of 1, whose gradients are rounding
noise times 1/sqrt(eps) in every precision; a wrong derivative is off by O(1)), with eager's
non-finite values where eager has them.

GEMMFUSE_FUZZ_SEED picks the seed; GEMMFUSE_GRAD_FUZZ_N the number of random chains."""
import copy
import os
import random

import pytest
import torch

import gemmfuse
from conftest import needs_cuda, needs_lib
from test_fuzz import SEED, FuzzModel, gen_program

pytestmark = needs_lib

GRAD_COUNT = int(os.environ.get("GEMMFUSE_GRAD_FUZZ_N", "320"))
BATCHES = 4


def _grads(model, x, gy):
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(gy.to(y.dtype))
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in model.named_parameters()})
    return y, grads


def _close(got, ref, eager, nudged):
    if got is None or ref is None:
        return got is None and ref is None and eager is None, "a gradient is missing"
    got, ref, eager, nudged = got.double(), ref.double(), eager.double(), nudged.double()
    fin = torch.isfinite(eager)
    if not torch.equal(torch.isnan(got[~fin]), torch.isnan(eager[~fin])):
        return False, "non-finite gradients differ from eager's"
    d = (got[fin] - ref[fin]).norm()
    # The chain's own conditioning at fp32's precision: eager fp32's error, and how far float64
    # moves when every input and parameter is nudged by fp32's rounding (a second sample of
    # that noise: eager alone can be lucky on an ill-conditioned chain).
    noise = max((eager[fin] - ref[fin]).norm(), (nudged[fin] - ref[fin]).norm())
    bound = (8 * noise + 1e-5 * ref[fin].norm()
             + 3e-5 * max(1, int(fin.sum())) ** 0.5)  # per value: chains of nearly constant values
    return bool(d <= bound), f"|g - g64| {float(d):.3g} > {float(bound):.3g}"


def check_grads(program, seed, where, device="cpu"):
    torch.manual_seed(seed)
    K, N, M, lead, steps, bias = program
    model = FuzzModel(program, seed).to(device)
    x = torch.randn(*lead, M, K, device=device)
    ref = copy.deepcopy(model).double()
    eager = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad():
        shape = copy.deepcopy(eager)(x).shape
    gy = torch.randn(shape, dtype=torch.float64, device=device)
    y, g = _grads(opt, x, gy)
    # A batch-statistics BatchNorm over an exactly constant column (var = 0, e.g. after a
    # minimum with a scalar) multiplies rounding noise by 1/sqrt(eps) in every gradient above
    # it: such chains are checked for running fused and finite only.
    constant = []
    hooks = [m.register_forward_pre_hook(
        lambda mod, args: constant.append(bool((args[0].var(0, unbiased=False) == 0).any())))
        for m in ref.modules() if isinstance(m, torch.nn.BatchNorm1d) and m.training]
    _, g64 = _grads(ref, x.double(), gy)
    for h in hooks:
        h.remove()
    if any(constant):
        assert all(torch.isfinite(t).all() or not torch.isfinite(g64[n]).all()
                   for n, t in g.items() if t is not None), where
        rts = gemmfuse.runtimes(opt)
        return bool(rts) and rts[0].train_calls >= 1
    _, g32 = _grads(eager, x, gy)
    nudge = copy.deepcopy(ref)
    with torch.no_grad():
        for p in nudge.parameters():
            p.mul_(1 + 2 ** -24 * torch.randn_like(p))
    _, g64n = _grads(nudge, x.double() * (1 + 2 ** -24 * torch.randn_like(x.double())), gy)
    rts = gemmfuse.runtimes(opt)
    for name in g64:
        ok, msg = _close(g.get(name), g64[name], g32.get(name), g64n[name])
        assert ok, f"grad of {name}: {msg}\n{where}\nexplain:\n{gemmfuse.explain(opt, print_it=False)}"
    return bool(rts) and rts[0].train_calls >= 1


# One program per op of the table (and per operand kind for the binary ops): (name, steps).
def _op_programs():
    s = lambda op, form="function", **p: ("unary", op, form, p)  # noqa: E731
    safe = [("unary", "abs", "method", {}), ("binary", "add", "operator", {"b": ("scalar", 0.5), "rev": False})]
    progs = {
        "neg": [s("neg")], "abs": [s("abs")], "square": [s("square")],
        "sqrt": safe + [s("sqrt")], "rsqrt": safe + [s("rsqrt")], "log": safe + [s("log")],
        "reciprocal": safe + [s("reciprocal")],
        "exp": [s("clamp", lo=-8.0, hi=8.0), s("exp")], "relu": [s("relu")], "sigmoid": [s("sigmoid")],
        "tanh": [s("tanh")], "silu": [s("silu")], "mish": [s("mish")], "gelu": [s("gelu")],
        "gelu_tanh": [s("gelu_tanh")], "softplus": [s("softplus", beta=2.0, threshold=5.0)],
        "elu": [s("elu", alpha=0.5)], "leaky_relu": [s("leaky_relu", slope=0.2)],
        "clamp": [s("clamp", lo=-0.25, hi=0.5)], "pow": [s("pow", e=3)],
        "pow_frac": safe + [s("pow", e=1.5)],
        "sum": [("reduce", "sum", "function", {"keepdim": True, "dim": -1}), s("exp")],
        "mean": [("reduce", "mean", "method", {"keepdim": False, "dim": -1}), s("tanh")],
        "max": [("reduce", "max", "function", {"keepdim": True, "dim": -1}), s("sigmoid")],
        "min": [("reduce", "min", "method", {"keepdim": True, "dim": -1})],
        "logsumexp": [("reduce", "logsumexp", "function", {"keepdim": True, "dim": -1})],
        "softmax": [("softmax", "softmax", "function", {"dim": -1})],
        "log_softmax": [("softmax", "log_softmax", "method", {"dim": -1})],
        "softmin": [("softmax", "softmin", "module", {"dim": -1})],
        "group_norm": [("group_norm", "group_norm", "module", {"groups": 4, "affine": True, "eps": 1e-5})],
        "layer_norm": [("layer_norm", "layer_norm", "function", {"affine": True, "eps": 1e-5, "width": 24})],
        "avg_pool": [("pool", "avg_pool", "function", {"k": 3, "s": 2, "p": 1, "ceil": True, "incl": False})],
        "max_pool": [("pool", "max_pool", "module", {"k": 3, "s": 1, "p": 1, "ceil": False, "incl": True})],
        "batch_norm": [("batch_norm", "batch_norm", "module", {"train": True, "affine": True, "momentum": 0.1, "track": True}), s("relu")],
        "batch_norm_eval": [("batch_norm", "batch_norm", "module", {"train": False, "affine": True, "momentum": 0.1, "track": True}), s("gelu")],
        "dropout": [("dropout", "dropout", "module", {"p": 0.3}), s("tanh")],
    }
    for op in ("add", "sub", "mul", "div", "minimum", "maximum"):
        for kind in ("scalar", "col", "row", "full", "one", "value"):
            b = ("scalar", 1.5) if kind == "scalar" else ("value", 1) if kind == "value" else (kind, None)
            pre = [s("tanh")] + (safe if op == "div" else [])
            progs[f"{op}_{kind}_rev"] = pre + [("binary", op, "function" if op in ("minimum", "maximum") else "operator",
                                                 {"b": b, "rev": True, "positive": op == "div"})]
            progs[f"{op}_{kind}"] = pre + [("binary", op, "method", {"b": b, "rev": False, "positive": op == "div"})]
    return progs


OP_PROGRAMS = _op_programs()


@pytest.mark.parametrize("name", list(OP_PROGRAMS))
def test_op_grads(name):
    steps = OP_PROGRAMS[name]
    program = (16, 24, 6, (), steps, True)
    assert check_grads(program, 7 + len(name), f"op program {name}: {steps}"), "did not run fused"


def test_every_table_op_has_a_gradient_test():
    table = {line.split()[0] for line in torch.ops.gemmfuse.ops().strip().splitlines()}
    covered = {n.split("_")[0] if n.split("_")[0] in table else n for n in OP_PROGRAMS}
    covered |= {"gelu_tanh", "leaky_relu", "log_softmax", "group_norm", "avg_pool", "max_pool",
                "batch_norm"} & set(OP_PROGRAMS)
    assert table - covered == set(), sorted(table - covered)


GPU_GRAD_COUNT = int(os.environ.get("GEMMFUSE_GPU_GRAD_FUZZ_N", "100"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("part", range(BATCHES))
def test_fuzz_backward(part, device, capsys):
    fused = 0
    idx = range(part, GRAD_COUNT if device == "cpu" else GPU_GRAD_COUNT, BATCHES)
    for i in idx:
        rng = random.Random(SEED * 1000003 + 7919 * i + 1)
        program = gen_program(rng)
        fused += check_grads(program, SEED + i, f"backward fuzz seed={SEED} index={i} on "
                                                f"{device}: {program}", device)
    with capsys.disabled():
        print(f"\n[backward fuzz seed={SEED} part {part} {device}] {len(idx)} chains, {fused} fused")
    assert fused >= 0.9 * len(idx)

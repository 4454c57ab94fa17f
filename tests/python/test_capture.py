"""Capture: FX graphs (symbolic_trace and dynamo) -> chain spec text, and why chains stop."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from conftest import make_seed, needs_lib, seed_ids
from gemmfuse import _lib
from gemmfuse.capture import compile_time_numbers, find_chains
from gemmfuse.optimized import _propagate, _share_state

E5 = "1.0000000000000001e-05"
P1 = "0.10000000000000001"

SEED_SPECS = {
    "m18": """linear in=96 out=160 bias=1
sum keepdim=1
max keepdim=1 index=1
mean keepdim=1
logsumexp keepdim=1
logsumexp keepdim=1
""",
    "m22": """linear in=96 out=160 bias=1
mul b=2
add b=v1
clamp lo=-10 hi=10
logsumexp keepdim=1
mish
mul b=v4
""",
    "m84": f"""linear in=96 out=160 bias=1
batch_norm training=1 eps={E5} momentum={P1} weight=t0 bias=t1 running_mean=s0 running_var=s1 num_batches=s2
mul b=t2
softmax
""",
    "m94": f"""linear in=96 out=256 bias=1
add b=t0
clamp lo=-1 hi=1
mish
group_norm groups=8 eps={E5} weight=t1 bias=t2
""",
    "m99": """linear in=96 out=160 bias=1
gelu
softmax
""",
}


def fx_report(model, inputs):
    gm = fx.symbolic_trace(model)
    _share_state(gm, model)
    _propagate(gm, tuple(inputs))
    return gm, find_chains(gm, "fx")


def fx_specs(model, inputs):
    gm, rep = fx_report(model, inputs)
    return [c.spec(tuple(gm.get_submodule(q).training for q in c.mode_modules)) for c in rep.chains], rep


def dynamo_report(model, inputs, dynamic=None):
    got = {}

    def backend(gm, example_inputs):
        got["gm"] = gm
        got["rep"] = find_chains(gm, "dynamo", numbers=compile_time_numbers(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    torch._dynamo.reset()
    return got["gm"], got["rep"]


@pytest.mark.parametrize("mid", seed_ids())
def test_seed_spec_symbolic_trace(mid):
    model, inputs = make_seed(mid)
    specs, rep = fx_specs(model, inputs)
    assert specs == [SEED_SPECS[mid]], specs
    assert rep.rejected == []
    assert "output" in rep.chains[0].stop


# The float attributes torch.compile(dynamic=True) turns into graph inputs, per seed model.
DYNAMIC_NUMBERS = {"m18": set(), "m99": set(), "m84": {"bn_eps", "bn_momentum"},
                   "m22": {"scale_factor", "clamp_min", "clamp_max"},
                   "m94": {"hardtanh_min_val", "hardtanh_max_val", "groupnorm_eps"}}


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("mid", seed_ids())
def test_seed_spec_dynamo(mid, dynamic):
    model, inputs = make_seed(mid)
    gm, rep = dynamo_report(model, inputs, dynamic)
    assert len(rep.chains) == 1, rep.chains
    spec = rep.chains[0].spec(())
    expect = SEED_SPECS[mid]
    if mid == "m84":  # dynamo keeps num_batches_tracked.add_(1) as its own node
        expect = expect.replace(" num_batches=s2", "")
    assert spec == expect
    # Parameters arrive as placeholders in dynamo graphs.
    assert rep.chains[0].weight.op in ("placeholder", "get_attr")
    # Under dynamic=True the float attributes are graph inputs, held at their values.
    guarded = {n.args[0].name for n in rep.chains[0].guards}
    if dynamic:
        assert len(guarded) == len(DYNAMIC_NUMBERS[mid]), guarded
        assert all(any(name in g for g in guarded) for name in DYNAMIC_NUMBERS[mid]), guarded
    else:
        assert not guarded


def test_bn_spec_follows_training_flag():
    model, inputs = make_seed("m84")
    gm, rep = fx_report(model, inputs)
    c = rep.chains[0]
    assert c.mode_modules == ["bn"]
    train, ev = c.spec((True,)), c.spec((False,))
    assert "batch_norm training=1" in train and "num_batches=s2" in train
    assert "batch_norm training=0" in ev and "momentum" not in ev and "num_batches" not in ev
    assert "running_mean=s0 running_var=s1" in ev
    # state order: running_mean, running_var, num_batches_tracked
    assert [s.qualname for s in c.state] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


def test_bn_momentum_none_and_untracked():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 12)
            self.a = nn.BatchNorm1d(12, momentum=None)
            self.b = nn.BatchNorm1d(12, track_running_stats=False, affine=False)

        def forward(self, x):
            return self.b(self.a(self.l(x)))

    specs, _ = fx_specs(M(), (torch.randn(4, 8),))
    assert specs[0].splitlines()[1].startswith("batch_norm training=1 eps=")
    assert "momentum=none" in specs[0].splitlines()[1]
    assert specs[0].splitlines()[2] == f"batch_norm training=1 eps={E5}"


class Residuals(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(10, 14)

    def forward(self, x):
        y = self.l(x)
        a = torch.relu(y)
        b = a * y                      # residual to v0
        c = 3.0 - b                    # reversed scalar
        d = torch.sub(c, 2, alpha=2)   # alpha folded into the scalar
        e = c / d                      # residual to v3 (c) and current
        f = x.new_ones(()) if False else e
        return f.pow(2).amax(dim=-1)


def test_residuals_reversed_and_alpha():
    specs, rep = fx_specs(Residuals(), (torch.randn(5, 10),))
    assert specs == ["""linear in=10 out=14 bias=1
relu
mul b=v0
sub b=3 rev=1
sub b=4
div b=v3 rev=1
pow alpha=2
max keepdim=0
"""]


class Ops(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 16, bias=False)
        self.ln = nn.LayerNorm(16)
        self.pool = nn.AvgPool1d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.drop = nn.Dropout(0.3)
        self.register_buffer("col", torch.randn(16))
        self.register_buffer("row", torch.randn(4, 1))

    def forward(self, x):
        y = self.l(x)
        y = F.softplus(y, beta=2.0, threshold=10.0)
        y = F.elu(y, alpha=0.5)
        y = F.leaky_relu(y, 0.2)
        y = F.gelu(y, approximate="tanh")
        y = y.clamp_min(-3).clamp(max=3)
        y = F.relu6(y)
        y = torch.maximum(y, self.col)
        y = torch.minimum(self.row, y)
        y = self.ln(y)
        y = self.drop(y)
        y = F.log_softmax(y, dim=1)
        y = self.pool(y)
        y = F.max_pool1d(y, 2)
        y = torch.logsumexp(y, -1, keepdim=True)
        return y.sigmoid().tanh().exp().log().abs().neg().square().sqrt().rsqrt().reciprocal()


def test_many_ops_eval_dropout():
    m = Ops().eval()
    specs, rep = fx_specs(m, (torch.randn(4, 6),))
    assert specs == [f"""linear in=6 out=16 bias=0
softplus beta=2 threshold=10
elu alpha=0.5
leaky_relu alpha=0.20000000000000001
gelu_tanh
clamp lo=-3
clamp hi=3
clamp lo=0 hi=6
maximum b=t0
minimum b=t1
group_norm groups=1 eps={E5} weight=t2 bias=t3
dropout p=0.29999999999999999 training=0
log_softmax
avg_pool kernel=3 stride=2 padding=1 ceil=1 include_pad=0
max_pool kernel=2 stride=2 padding=0 ceil=0
logsumexp keepdim=1
sigmoid
tanh
exp
log
abs
neg
square
sqrt
rsqrt
reciprocal
"""]
    assert rep.chains[0].mode_modules == ["drop"]


def test_training_dropout_ends_chain():
    m = Ops().train()
    specs, rep = fx_specs(m, (torch.randn(4, 6),))
    assert specs[0].rstrip().endswith("group_norm groups=1 eps=1.0000000000000001e-05 weight=t2 bias=t3")
    assert "Dropout(p=0.3) 'drop' is in training mode" in rep.chains[0].stop


@pytest.mark.parametrize("dim,ok", [(1, True), (-1, True), (0, False)])
def test_dims_2d(dim, ok):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 5)

        def forward(self, x):
            return torch.softmax(self.l(x), dim=dim)

    specs, rep = fx_specs(M(), (torch.randn(3, 4),))
    if ok:
        assert specs[0].endswith("softmax\n")
    else:
        assert specs[0] == "linear in=4 out=5 bias=1\n"
        assert "only the last dim fuses" in rep.chains[0].stop


def test_dims_3d_and_keepdim_false():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 5)

        def forward(self, x):
            y = self.l(x)              # [2, 3, 5]
            y = y.sum(2)               # last dim, keepdim=False -> [2, 3]
            y = y * 2
            return y.mean(-1)          # would reduce over the batch dim 1: not fusable

    specs, rep = fx_specs(M(), (torch.randn(2, 3, 4),))
    assert specs == ["linear in=4 out=5 bias=1\nsum keepdim=0\nmul b=2\n"]
    assert "keepdim=False" in rep.chains[0].stop


def test_outside_user_truncates():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 5)

        def forward(self, x):
            y = self.l(x)
            a = torch.relu(y)
            b = a * 2
            return b + 1, a            # `a` escapes: the chain ends at a

    specs, rep = fx_specs(M(), (torch.randn(3, 4),))
    assert specs == ["linear in=4 out=5 bias=1\nrelu\n"]
    assert "outside the chain" in rep.chains[0].stop


def test_broadcast_up_refused_and_two_chains():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(4, 5)
            self.l2 = nn.Linear(5, 3)

        def forward(self, x, big):
            y = self.l1(x).relu()
            y = y + big                  # [3,5] + [2,3,5] broadcasts up: ends the chain
            z = F.linear(y.sum(0), self.l2.weight, self.l2.bias)
            return torch.tanh(z)

    specs, rep = fx_specs(M(), (torch.randn(3, 4), torch.randn(2, 3, 5)))
    assert specs == ["linear in=4 out=5 bias=1\nrelu\n", "linear in=5 out=3 bias=1\ntanh\n"]
    assert "broadcasts the value" in rep.chains[0].stop


def test_max_with_indices_used_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 5)

        def forward(self, x):
            v, i = torch.max(self.l(x), dim=1, keepdim=True)
            return v, i

    specs, rep = fx_specs(M(), (torch.randn(3, 4),))
    assert specs == ["linear in=4 out=5 bias=1\n"]
    assert "indices" in rep.chains[0].stop


def test_inplace_on_shared_value_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 5)

        def forward(self, x):
            y = self.l(x)
            z = F.relu(y, inplace=True)
            return z + y

    specs, rep = fx_specs(M(), (torch.randn(3, 4),))
    assert specs == ["linear in=4 out=5 bias=1\n"]
    assert "in-place" in rep.chains[0].stop


def test_group_norm_on_3d_refused_layer_norm_ok():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 6)
            self.gn = nn.GroupNorm(1, 3)

        def forward(self, x):
            y = F.layer_norm(self.l(x), (6,))
            return self.gn(y)

    specs, rep = fx_specs(M(), (torch.randn(2, 3, 4),))
    assert specs == [f"linear in=4 out=6 bias=1\ngroup_norm groups=1 eps={E5}\n"]
    assert "needs rank 2" in rep.chains[0].stop


def test_dynamo_functional_ops_and_max_getitem():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 12)
            self.bn = nn.BatchNorm1d(12)
            self.gn = nn.GroupNorm(3, 12)

        def forward(self, x):
            y = self.bn(self.l(x))
            y = self.gn(y)
            y = torch.max(y, dim=-1, keepdim=True)[0]
            return y * F.mish(y)

    m = M().eval()
    gm, rep = dynamo_report(m, (torch.randn(4, 8),))
    spec = rep.chains[0].spec(())
    assert spec == f"""linear in=8 out=12 bias=1
batch_norm training=0 eps={E5} weight=t0 bias=t1 running_mean=s0 running_var=s1
group_norm groups=3 eps={E5} weight=t2 bias=t3
max keepdim=1 index=1
mish
mul b=v3
"""


def test_nothing_captured_without_linear():
    gm, rep = fx_report(nn.Sequential(nn.ReLU()), (torch.randn(2, 3),))
    assert rep.chains == [] and rep.rejected == []


class _Attention(nn.Module):
    """A Linear, then products of two activations (bmm, @, einsum) that start no chain."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32)

    def forward(self, x):
        s = torch.bmm(self.q(x), x.transpose(1, 2))
        return s @ x + torch.einsum("bij,bkj->bik", x, x).sum(-1, keepdim=True)


def test_products_of_two_activations_are_listed():
    """Each matrix product with no weight operand is reported (name, form with shapes), the
    Linear's chain is not, and a model without such products reports none."""
    gm, rep = fx_report(_Attention(), (torch.randn(2, 8, 32),))
    assert len(rep.chains) == 1 and rep.rejected == []
    forms = [form for _, form in rep.products]
    assert forms == ["torch.bmm [2, 8, 32] x [2, 32, 8]", "@ [2, 8, 8] x [2, 8, 32]",
                     "torch.einsum [2, 8, 32] x [2, 8, 32]"], forms
    _, rep = fx_report(nn.Sequential(nn.Linear(4, 5), nn.ReLU()), (torch.randn(2, 4),))
    assert rep.products == []


@needs_lib
def test_explain_lists_products_and_where_they_run(monkeypatch):
    """explain lists each product of two activations: on gemmfuse's GEMM (the CPU tests run
    everything gemmfuse takes, GEMMFUSE_ALWAYS_FUSE=1; einsum too) or why not (the CPU by
    default)."""
    import gemmfuse
    text = gemmfuse.explain(_Attention(), (torch.randn(2, 8, 32),), print_it=False)
    assert "matrix products of two activations" in text
    assert "  bmm: torch.bmm [2, 8, 32] x [2, 32, 8] on gemmfuse's GEMM" in text, text
    assert "torch.einsum [2, 8, 32] x [2, 8, 32] on gemmfuse's GEMM (gemmfuse.products.einsum" \
        in text, text
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    text = gemmfuse.explain(_Attention(), (torch.randn(2, 8, 32),), print_it=False)
    assert "  bmm: torch.bmm [2, 8, 32] x [2, 32, 8] left to PyTorch: on the CPU" in text, text
    text = gemmfuse.explain(nn.Sequential(nn.Linear(4, 5)), (torch.randn(2, 4),), print_it=False)
    assert "matrix products" not in text


@needs_lib
@pytest.mark.parametrize("mid", seed_ids())
def test_seed_specs_parse_in_cpp(mid):
    assert _lib.check(SEED_SPECS[mid]) == ""
    assert _lib.check("linear in=4 out=5 bias=1\nfrobnicate\n") != ""

"""torch.compile(backend="gemmfuse"), and compile/export of an optimized module."""
import copy

import pytest
import torch

import gemmfuse
from gemmfuse import backend as gf_backend
from conftest import assert_close64, double_ref, make_seed, needs_lib, seed_ids

pytestmark = needs_lib


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_has_run(gm):
    return any(n.op == "call_function" and "gemmfuse" in str(n.target) and "run" in str(n.target)
               for n in gm.graph.nodes)


@pytest.mark.parametrize("precision", [None, "fast"])
@pytest.mark.parametrize("mid", seed_ids())
def test_backend_seed_models(mid, precision):
    model, inputs = make_seed(mid)
    ref = double_ref(model)
    eager = copy.deepcopy(model)
    kw = {} if precision is None else {"options": {"precision": precision}}
    compiled = torch.compile(model, backend="gemmfuse", **kw)
    n0 = len(gf_backend.REPORTS)
    with torch.no_grad():
        for step in range(2):
            x = torch.rand_like(inputs[0])
            assert_close64(compiled(x), ref(x.double()), what=f"{mid} step {step}")
            eager(x)
    rep = gf_backend.REPORTS[-1]
    assert len(gf_backend.REPORTS) > n0
    assert rep.precision == (precision or "fp32")
    assert [e.status for e in rep.entries] == ["fused"], rep.entries
    if mid == "m84":
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model.bn, name), getattr(eager.bn, name),
                                       atol=1e-6, rtol=1e-5)


def test_backend_grad_mode_leaves_chain_to_pytorch():
    model, inputs = make_seed("m99")
    compiled = torch.compile(model, backend="gemmfuse")
    out = compiled(inputs[0])
    assert out.requires_grad
    out.sum().backward()
    assert model.linear.weight.grad is not None
    rep = gf_backend.REPORTS[-1]
    assert rep.entries[0].status == "pytorch" and "autograd" in rep.entries[0].reason


def test_backend_mode_switch_recompiles():
    model, inputs = make_seed("m84")
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="gemmfuse")
    x = inputs[0]
    with torch.no_grad():
        compiled(x)
        ref_model(x)
        model.eval(); ref_model.eval()
        torch.testing.assert_close(compiled(x), ref_model(x), atol=1e-5, rtol=1e-5)
    assert "training=0" in gf_backend.REPORTS[-1].entries[0].spec


def test_backend_nothing_to_capture():
    m = torch.nn.Sequential(torch.nn.ReLU())
    compiled = torch.compile(m, backend="gemmfuse")
    x = torch.randn(3, 4)
    torch.testing.assert_close(compiled(x), torch.relu(x))
    assert gf_backend.REPORTS[-1].entries == []


@pytest.mark.parametrize("mid", seed_ids())
def test_compile_optimized_traces_the_op(mid):
    model, inputs = make_seed(mid)
    opt = gemmfuse.optimize(model, inputs)
    seen = []

    def spy(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(opt, backend=spy, fullgraph=True)(inputs[0])
    assert seen and _graph_has_run(seen[0]), seen[0].graph


@pytest.mark.parametrize("mid", seed_ids())
def test_compile_optimized_aot_eager(mid):
    model, inputs = make_seed(mid)
    eager = copy.deepcopy(model)
    ref = double_ref(model)
    opt = gemmfuse.optimize(model, inputs)
    compiled = torch.compile(opt, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        for step in range(2):
            x = torch.rand_like(inputs[0])
            assert_close64(compiled(x), ref(x.double()), what=f"{mid} aot_eager {step}")
            eager(x)
    if mid == "m84":
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model.bn, name), getattr(eager.bn, name),
                                       atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("mid", seed_ids())
def test_export_optimized(mid, train):
    model, inputs = make_seed(mid)
    model.train(train)
    opt = gemmfuse.optimize(model, inputs)
    x = inputs[0]
    with torch.no_grad():
        ep = torch.export.export(opt, (x,))
    assert any("gemmfuse" in str(n.target) for n in ep.graph.nodes), ep.graph
    ref = double_ref(model)
    with torch.no_grad():
        out = ep.module()(x)
    assert_close64(out, ref(x.double()), what=f"{mid} export")

"""torch.compile(backend="gemmfuse"), and compile/export of an optimized module."""
import copy

import pytest
import torch

import gemmfuse
from gemmfuse import reports as gf_reports
from gemmfuse.explain import explain_text
from conftest import SEED_B, assert_close64, double_ref, make_seed, needs_lib, seed_ids

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
    n0 = len(gf_reports.COMPILED)
    with torch.no_grad():
        for step in range(2):
            x = torch.rand_like(inputs[0])
            assert_close64(compiled(x), ref(x.double()), what=f"{mid} step {step}")
            eager(x)
    rep = gf_reports.COMPILED[-1]
    assert len(gf_reports.COMPILED) > n0
    assert rep.precision == (precision or "fp32")
    assert [e.status for e in rep.entries] == ["fused"], rep.entries
    if mid == "m84":
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model.bn, name), getattr(eager.bn, name),
                                       atol=1e-6, rtol=1e-5)


NO_INDUCTOR = {"options": {"inductor": False}}


def _dynamic_batches(mid, **compile_kw):
    """The seed model compiled with dynamic=True and called at three batch sizes, each
    checked against float64 (eager runs alongside: m84's running statistics move on). Returns
    (model, eager, compiled, the one entry of the one graph compiled)."""
    model, inputs = make_seed(mid)
    ref = double_ref(model)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="gemmfuse", dynamic=True, **compile_kw)
    with torch.no_grad():
        for batch in (SEED_B, 5, 23):
            x = torch.rand(batch, inputs[0].shape[1])
            assert_close64(compiled(x), ref(x.double()), what=f"{mid} batch {batch}")
            eager(x)
            ref.load_state_dict(eager.state_dict())
    graphs = gf_reports.compiled_graphs(compiled)
    assert len(graphs) == 1, "dynamic=True should compile one graph for every batch size"
    (entry,) = graphs[0]._gemmfuse.entries
    if mid == "m84":
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model.bn, name), getattr(eager.bn, name),
                                       atol=1e-6, rtol=1e-5)
    return model, graphs[0], compiled, entry


def test_backend_graph_arguments_hold_no_newline():
    """Inductor copies a node's arguments into comments of the code it generates, line by line:
    a newline inside the spec would end such a comment and break the module (a SyntaxError
    on CUDA, where Triton kernels carry those comments)."""
    model, inputs = make_seed(seed_ids()[0])
    compiled = torch.compile(model, backend="gemmfuse")
    with torch.no_grad():
        compiled(*inputs)
    (gm,) = gf_reports.compiled_graphs(compiled)
    args = [a for n in gm.graph.nodes if n.op == "call_function" and "gemmfuse" in str(n.target)
            for a in n.args if isinstance(a, str)]
    assert args, "the fused op's spec and precision are string arguments"
    assert not any("\n" in a for a in args), args
    text = gemmfuse.explain(compiled, print_it=False)
    assert "spec:\n    linear in=" in text and "fused call(s) of this spec issued" in text, text


@pytest.mark.parametrize("mid", seed_ids())
def test_backend_dynamic_shapes(mid):
    # torch.compile(dynamic=True) passes float attributes (eps, momentum, clamp bounds, scale
    # factors) as graph inputs read with .item(): a graph Inductor compiles cannot fall back per
    # call, so its chains stop before such a number; chains without one fuse whole, and one
    # graph serves every batch size (the fake kernels take symbolic sizes).
    _, _, compiled, entry = _dynamic_batches(mid)
    assert entry.status == "fused", entry
    if mid == "m22":  # x * scale_factor: an unspecialized float
        assert "a number the graph computes at run time" in entry.stop, entry
    else:
        assert entry.stop.endswith("is the graph's output"), entry
    assert gemmfuse.fused_calls(compiled) >= 3


@pytest.mark.parametrize("mid", seed_ids())
def test_backend_without_inductor_dynamic_shapes_fuse_whole_chains(mid):
    # options={"inductor": False} (optimize()'s capture through dynamo): each chain behind a
    # runtime that checks every call, so it may hold numbers read at compile time, guarded.
    model, inputs = make_seed(mid)
    static = torch.compile(copy.deepcopy(model), backend="gemmfuse", **NO_INDUCTOR)
    with torch.no_grad():
        static(inputs[0])
    static_spec = gf_reports.compiled_graphs(static)[0]._gemmfuse.entries[0].spec
    _, graph, _, entry = _dynamic_batches(mid, **NO_INDUCTOR)
    assert entry.status == "fused" and entry.stop.endswith("is the graph's output"), entry
    assert entry.spec == static_spec
    (rt,) = gemmfuse.runtimes(graph)
    assert rt.fused_calls == 3 and not rt.fallbacks, rt.fallbacks
    if mid in ("m22", "m84", "m94"):
        assert rt.guards, "the chain should hold numbers read at compile time"


def test_backend_dynamic_number_changed_runs_in_pytorch():
    # dynamo does not recompile when an unspecialized float changes; the chain must notice.
    model, inputs = make_seed("m22")
    compiled = torch.compile(model, backend="gemmfuse", dynamic=True, **NO_INDUCTOR)
    x = inputs[0]
    with torch.no_grad():
        compiled(x)
        model.scale_factor = 3.0
        ref = double_ref(model)
        assert_close64(compiled(x), ref(x.double()), what="m22 after scale_factor = 3")
        model.scale_factor = 2.0
        compiled(x)
    graphs = gf_reports.compiled_graphs(compiled)
    assert len(graphs) == 1
    (rt,) = gemmfuse.runtimes(graphs[0])
    assert rt.fused_calls == 2
    ((reason, count),) = rt.fallbacks.items()
    assert count == 1 and "scale_factor differs from its value at compile time" in reason
    text = explain_text(graphs[0])
    assert "numbers read at compile time" in text and "scale_factor = 2.0" in text


def test_backend_dynamic_number_changed_under_inductor():
    # Under Inductor the number stays a graph input: a changed scale factor is computed with.
    model, inputs = make_seed("m22")
    compiled = torch.compile(model, backend="gemmfuse", dynamic=True)
    x = inputs[0]
    with torch.no_grad():
        compiled(x)
        model.scale_factor = 3.0
        assert_close64(compiled(x), double_ref(model)(x.double()), what="m22 after scale_factor = 3")


def test_explain_compiled_module():
    model, inputs = make_seed("m84")
    compiled = torch.compile(model, backend="gemmfuse")
    with pytest.raises(ValueError, match="no gemmfuse compilation"):
        gemmfuse.explain(compiled, print_it=False)
    with torch.no_grad():
        compiled(inputs[0])
        model.eval()  # a new training flag: dynamo compiles a second graph
        compiled(inputs[0])
    text = gemmfuse.explain(compiled, print_it=False)
    assert "2 graph(s) compiled by the gemmfuse backend" in text, text
    assert text.count("FUSED") == 2 and "training=1" in text and "training=0" in text, text
    assert "ColumnStats" in text and "RowPass" in text, "the plan at the input each graph ran with"
    assert gemmfuse.explain(model, print_it=False) == text  # the wrapped module: the same graphs
    assert "fused call(s) of this spec issued" in text
    assert gemmfuse.fused_calls(compiled) >= 2
    other, _ = make_seed("m84")
    with pytest.raises(ValueError, match="no gemmfuse compilation"):
        gemmfuse.explain(other, print_it=False)
    with pytest.raises(ValueError, match="already compiled"):
        gemmfuse.explain(compiled, inputs, print_it=False)


def test_explain_a_second_instance_whose_graph_dynamo_reused():
    """A second model of the same class compiled with the backend runs the first one's graph
    (dynamo's guards pass; the backend is not called again): explain and fused_calls find that
    graph for it; a plain module of that class, never compiled, still has none."""
    first, inputs = make_seed("m22")
    second, _ = make_seed("m22")
    with torch.no_grad():
        torch.compile(first, backend="gemmfuse")(inputs[0])
        n = len(gf_reports.COMPILED)
        compiled = torch.compile(second, backend="gemmfuse")
        compiled(inputs[0])
    assert len(gf_reports.COMPILED) == n, "dynamo reused the first graph"
    text = gemmfuse.explain(compiled, print_it=False)
    assert "1 graph(s) compiled by the gemmfuse backend" in text and "FUSED" in text, text
    calls = gemmfuse.fused_calls(compiled)
    with torch.no_grad():
        compiled(inputs[0])
    assert gemmfuse.fused_calls(compiled) > calls
    plain, _ = make_seed("m22")
    with pytest.raises(ValueError, match="no gemmfuse compilation"):
        gemmfuse.explain(plain, print_it=False)


def test_backend_fuses_while_autograd_records():
    model, inputs = make_seed("m99")
    compiled = torch.compile(model, backend="gemmfuse")
    out = compiled(inputs[0])
    assert out.requires_grad
    out.sum().backward()
    assert model.linear.weight.grad is not None
    rep = gf_reports.COMPILED[-1]
    assert rep.entries[0].status == "fused"
    assert torch.ops.gemmfuse.calls(rep.entries[0].spec)[1] >= 1, "a training call"
    ref = copy.deepcopy(model)
    ref.linear.weight.grad = None
    ref(inputs[0]).sum().backward()
    torch.testing.assert_close(model.linear.weight.grad, ref.linear.weight.grad, atol=1e-5, rtol=1e-4)


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
    assert "training=0" in gf_reports.COMPILED[-1].entries[0].spec


def test_backend_nothing_to_capture():
    m = torch.nn.Sequential(torch.nn.ReLU())
    compiled = torch.compile(m, backend="gemmfuse")
    x = torch.randn(3, 4)
    torch.testing.assert_close(compiled(x), torch.relu(x))
    assert gf_reports.COMPILED[-1].entries == []


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


class _ReluChain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 128)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def test_backend_under_autocast_leaves_the_chain_to_inductor():
    model, x = _ReluChain(), torch.randn(16, 64)
    compiled = torch.compile(copy.deepcopy(model), backend="gemmfuse")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = compiled(x), model(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)
    (entry,) = gf_reports.COMPILED[-1].entries
    assert entry.status == "pytorch" and "autocast" in entry.reason, entry


def test_compiler_carries_precision_and_inductor_options():
    model, x = _ReluChain(), torch.randn(16, 64)
    backend = gemmfuse.compiler("fast", max_autotune=False)
    with torch.no_grad():
        out = torch.compile(copy.deepcopy(model), backend=backend, mode="default")(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    rep = gf_reports.COMPILED[-1]
    assert rep.precision == "fast" and rep.flavor == "inductor"
    assert [e.status for e in rep.entries] == ["fused"]
    with pytest.raises(ValueError, match="precision"):
        gemmfuse.compiler("fp16")
    with pytest.raises(Exception, match="not_an_inductor_option"):
        torch.compile(copy.deepcopy(model), backend="gemmfuse",
                      options={"not_an_inductor_option": 1})(x)


def test_measured_choice_times_backward_off_the_compiling_thread(monkeypatch):
    """On CUDA the autograd engine runs a timed backward on its device thread while the
    backend's thread holds dynamo's compile lock: Inductor's lowering of the chain must have
    its backward compiled already (a lazy compile would wait for that lock forever)."""
    import threading
    from gemmfuse import measure, route_timer
    monkeypatch.delenv("GEMMFUSE_ALWAYS_FUSE", raising=False)
    monkeypatch.setenv("GEMMFUSE_TIMED_ROUTES", "1")
    monkeypatch.setattr(measure, "_CHOICES", {})

    times = iter([1.0, 1.0, 1.0, 2.0])  # the chain: fused, Inductor; the whole graph: the same

    def timer(fn, device):
        done = []
        worker = threading.Thread(target=lambda: (fn(), done.append(True)), daemon=True)
        worker.start()
        worker.join(60)
        assert done, "the timed call blocked"
        return next(times)

    monkeypatch.setattr(route_timer, "timer", timer)
    model = _ReluChain()
    x = torch.randn(16, 64, requires_grad=True)
    torch.compile(model, backend="gemmfuse")(x).sum().backward()
    rep = gf_reports.COMPILED[-1]
    (entry,) = rep.entries
    assert "forward+backward timed fused 1 ms, Inductor 1 ms" in entry.choice, entry
    assert "whole forward+backward timed with the fused chains 1 ms, Inductor alone 2 ms" in rep.whole
    assert entry.status == "fused" and model.lin.weight.grad is not None

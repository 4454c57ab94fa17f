"""Plan selection by timing (route_timer) on the CPU with an injected timer: at a new input
signature a chain the planner would fuse is timed fused and in PyTorch once; the faster runs
from then on, explain says which and the two times; chains that update state are not timed."""
import pytest
import torch
import torch.nn as nn

import gemmfuse
from gemmfuse import route_timer
from conftest import needs_lib
from test_route import ReluClamp

pytestmark = needs_lib


class LinearBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 48)
        self.bn = nn.BatchNorm1d(48)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


class ScriptedTimer:
    """Calls each timed function once (so both paths really run) and returns the next scripted
    time: the runtime times the fused op first, then PyTorch."""

    def __init__(self, times):
        self.times = list(times)
        self.calls = 0

    def __call__(self, fn, device):
        fn()
        self.calls += 1
        return self.times.pop(0)


@pytest.fixture
def timed(monkeypatch):
    """Chains timed, the whole module not (whole_timed below)."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    monkeypatch.setenv("GEMMFUSE_TIMED_ROUTES", "1")
    monkeypatch.setattr(route_timer, "whole_timed_on", lambda device: False)

    def install(times):
        t = ScriptedTimer(times)
        monkeypatch.setattr(route_timer, "timer", t)
        return t
    return install


def test_faster_fused_plan_is_kept_and_explained(timed):
    t = timed([1.0, 2.0])
    torch.manual_seed(0)
    model, x = ReluClamp(), torch.randn(8, 32)
    with torch.no_grad():
        opt = gemmfuse.optimize(model, (x,))
        for _ in range(3):
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    (rt,) = gemmfuse.runtimes(opt)
    assert t.calls == 2 and rt.fused_calls == 3 and not rt.fallbacks
    assert "timed once: fused 1 ms, PyTorch 2 ms" in gemmfuse.explain(opt, print_it=False)


def test_slower_fused_plan_routes_to_pytorch_and_new_shape_is_timed_again(timed):
    t = timed([3.0, 2.0, 1.0, 5.0])
    torch.manual_seed(0)
    model, x = ReluClamp(), torch.randn(8, 32)
    with torch.no_grad():
        opt = gemmfuse.optimize(model, (x,))
        for _ in range(3):
            torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)  # PyTorch's own ops
        assert t.calls == 2  # timed once at this shape
        x2 = torch.randn(16, 32)
        torch.testing.assert_close(opt(x2), model(x2), rtol=1e-5, atol=1e-5)
    (rt,) = gemmfuse.runtimes(opt)
    assert t.calls == 4 and rt.fused_calls == 1
    (reason,) = rt.fallbacks
    assert "timed once: PyTorch 2 ms, fused 3 ms" in reason and rt.fallbacks[reason] == 3
    text = gemmfuse.explain(opt, print_it=False)
    assert "timed once: PyTorch 2 ms, fused 3 ms" in text
    assert "timed once: fused 1 ms, PyTorch 5 ms" in text


def test_chains_that_update_state_are_not_timed(timed, monkeypatch):
    t = timed([])
    torch.manual_seed(0)
    bn, x = LinearBatchNorm(), torch.randn(8, 32)
    eager = __import__("copy").deepcopy(bn)
    with torch.no_grad():
        opt = gemmfuse.optimize(bn, (x,))
        torch.testing.assert_close(opt(x), eager(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.bn.running_mean, eager.bn.running_mean)  # updated once
    assert t.calls == 0
    monkeypatch.setenv("GEMMFUSE_TIMED_ROUTES", "0")
    with torch.no_grad():
        gemmfuse.optimize(ReluClamp(), (x,))(x)
    assert t.calls == 0


@pytest.mark.parametrize("fast_ms, fp32_ms, chosen", [(3.0, 2.0, "fp32"), (2.0, 3.0, None)])
def test_fast_runs_fp32_kernel_where_timed_faster(timed, fast_ms, fp32_ms, chosen):
    t = timed([fast_ms, fp32_ms, 5.0])  # fast's kernel, fp32's, then PyTorch
    torch.manual_seed(0)
    model, x = ReluClamp(), torch.randn(8, 32)
    with torch.no_grad():
        opt = gemmfuse.optimize(model, (x,), precision="fast")
        for _ in range(2):
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
    (rt,) = gemmfuse.runtimes(opt)
    assert t.calls == 3 and rt.fused_calls == 2 and not rt.fallbacks
    assert list(rt.precision_at.values()) == ([chosen] if chosen else [])
    text = gemmfuse.explain(opt, print_it=False)
    if chosen:
        assert "timed once: fused 2 ms on fp32's kernel, fast's own 3 ms, PyTorch 5 ms" in text
    else:
        assert "timed once: fused 2 ms, PyTorch 5 ms" in text


@pytest.mark.parametrize("fused_ms, chosen", [(1.0, "fused"), (3.0, "pytorch")])
def test_training_calls_are_timed_forward_and_backward(timed, fused_ms, chosen):
    """While autograd records, the first call at a signature times the fused op's forward and
    backward against PyTorch's; timing leaves no gradient behind (autograd.grad), and the
    step's gradients are eager's either way."""
    t = timed([fused_ms, 2.0])
    torch.manual_seed(0)
    model, x = ReluClamp(), torch.randn(8, 32)
    eager = __import__("copy").deepcopy(model)
    opt = gemmfuse.optimize(model, (x,))
    for _ in range(2):
        opt(x).square().sum().backward()
        eager(x).square().sum().backward()
    assert t.calls == 2, "timed once"
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)  # two steps' worth
    (rt,) = gemmfuse.runtimes(opt)
    text = gemmfuse.explain(opt, print_it=False)
    if chosen == "fused":
        assert rt.train_calls == 2 and not rt.fallbacks
        assert "forward and backward timed once: fused 1 ms, PyTorch 2 ms" in text
    else:
        assert rt.train_calls == 0
        (reason,) = rt.fallbacks
        assert "forward and backward timed once: PyTorch 2 ms, fused 3 ms" in reason


class TwoReluChains(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


@pytest.fixture
def whole_timed(monkeypatch):
    """Only the whole-module/graph timing on (chains untimed, as on the CPU by default), with
    the planner's own routes (the suite otherwise fuses every chain it can)."""
    monkeypatch.setattr(route_timer, "whole_timed_on", lambda device: True)
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")

    def install(times):
        timer = ScriptedTimer(times)
        monkeypatch.setattr(route_timer, "timer", timer)
        return timer
    return install


# 1.95 against 2: faster, but within measure.WHOLE_MARGIN: the model as it is runs
@pytest.mark.parametrize("train_ms, eager_modes", [(3.0, {"train"}), (1.5, set()), (1.95, {"train"})])
def test_whole_module_timing_runs_the_model_where_it_is_faster(whole_timed, train_ms, eager_modes):
    timer = whole_timed([1.0, 2.0, train_ms, 2.0])  # forward fused, PyTorch; training the same
    model, x = TwoReluChains(), torch.randn(4, 16)
    opt = gemmfuse.optimize(model, (x,))
    assert timer.calls == 4
    assert set(opt.__dict__.get("_gemmfuse_eager", ())) == eager_modes
    text = gemmfuse.explain(opt, print_it=False)
    assert "whole forward timed with the fused chains 1 ms, PyTorch alone 2 ms: the fused chains run" in text
    verdict = "PyTorch alone runs" if eager_modes else "the fused chains run"
    assert f"whole forward+backward timed with the fused chains {train_ms:g} ms, PyTorch alone 2 ms: {verdict}" in text
    n = gemmfuse.fused_calls(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
    assert gemmfuse.fused_calls(opt) > n, "no_grad calls run fused"
    n = gemmfuse.fused_calls(opt)
    opt(x).sum().backward()
    assert (gemmfuse.fused_calls(opt) == n) == bool(eager_modes), "training calls: the model itself where faster"
    assert model.fc1.weight.grad is not None


@pytest.mark.parametrize("fused_ms, fused_runs", [(3.0, False), (1.0, True)])
def test_whole_graph_timing_compiles_the_faster_graph(whole_timed, fused_ms, fused_runs):
    torch._dynamo.reset()
    timer = whole_timed([fused_ms, 2.0])
    model, x = TwoReluChains(), torch.randn(4, 16)
    compiled = torch.compile(model, backend="gemmfuse")
    with torch.no_grad():
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
        assert timer.calls == 2
        n = gemmfuse.fused_calls(compiled)
        compiled(x)
    assert (gemmfuse.fused_calls(compiled) > n) == fused_runs
    text = gemmfuse.explain(compiled, print_it=False)
    verdict = "the fused chains run" if fused_runs else "Inductor alone runs"
    assert f"whole forward timed with the fused chains {fused_ms:g} ms, Inductor alone 2 ms: {verdict}" in text, text
    torch._dynamo.reset()


def test_warm_up_on_the_cpu_is_the_warmup_calls():
    calls = []
    route_timer.warm_up(lambda: calls.append(1), torch.device("cpu"), 3)
    assert len(calls) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_warm_up_on_a_gpu_runs_about_warmup_ms_of_calls():
    """After a compile the GPU idles at a low clock: a timing warms up for ~WARMUP_MS of calls
    first (a ~1 ms call: ~20 calls; a tiny one: at most MAX_WARMUP_CALLS)."""
    long_calls, short_calls = [], []
    cycles_per_ms = torch.cuda.get_device_properties(0).clock_rate  # kHz: cycles per ms
    route_timer.warm_up(lambda: (torch.cuda._sleep(cycles_per_ms), long_calls.append(1)),
                        torch.device("cuda"), 2)
    route_timer.warm_up(lambda: short_calls.append(1), torch.device("cuda"), 2)
    assert 2 + 5 <= len(long_calls) <= 2 + 1 + route_timer.WARMUP_MS, len(long_calls)
    assert 100 < len(short_calls) <= 2 + 1 + route_timer.MAX_WARMUP_CALLS, len(short_calls)

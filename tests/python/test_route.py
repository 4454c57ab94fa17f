"""The planner's routing on the CPU: chains whose row pass PyTorch's vectorized kernels run
faster (transcendental ops, 16-bit models) run in PyTorch, with the reason in explain; the
GEMV rewrite and arithmetic chains run fused."""
import torch
import torch.nn as nn

import gemmfuse
from conftest import make_seed, needs_lib


class ReluClamp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 48)

    def forward(self, x):
        return torch.clamp(torch.relu(self.fc(x)) * 2.0, max=1.5)


def _route_on(monkeypatch):
    monkeypatch.delenv("GEMMFUSE_ALWAYS_FUSE", raising=False)


@needs_lib
def test_softmax_chain_runs_in_pytorch_on_cpu(monkeypatch):
    _route_on(monkeypatch)
    model, (x,) = make_seed("m99")
    with torch.no_grad():
        opt = gemmfuse.optimize(model, (x,))
        ref = model(x)
        for _ in range(3):
            out = opt(torch.rand_like(x) if _ else x)
        first = opt(x)
    torch.testing.assert_close(first, ref, rtol=0, atol=0)  # PyTorch's own ops
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.fused_calls == 0
    reasons = [r for r in rt.fallbacks if "PyTorch is faster" in r]
    assert reasons and "gelu" in reasons[0] and sum(rt.fallbacks.values()) == 4
    text = gemmfuse.explain(opt, print_it=False)
    assert "route: runs in PyTorch" in text and "PyTorch is faster" in text
    del out


@needs_lib
def test_gemv_and_arithmetic_chains_stay_fused_on_cpu(monkeypatch):
    _route_on(monkeypatch)
    m18, (x,) = make_seed("m18")
    torch.manual_seed(1)
    plain = ReluClamp()
    x2 = torch.randn(8, 32)
    with torch.no_grad():
        for model, inp in ((m18, x), (plain, x2)):
            opt = gemmfuse.optimize(model, (inp,))
            torch.testing.assert_close(opt(inp), model(inp), rtol=1e-5, atol=1e-5)
            (rt,) = gemmfuse.runtimes(opt)
            assert rt.fused_calls == 1 and not rt.fallbacks, rt.fallbacks


@needs_lib
def test_bf16_model_runs_in_pytorch_on_cpu(monkeypatch):
    _route_on(monkeypatch)
    torch.manual_seed(2)
    model = ReluClamp().to(torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        opt = gemmfuse.optimize(model, (x,))
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.fused_calls == 0 and any("bf16" in r for r in rt.fallbacks), rt.fallbacks


@needs_lib
def test_routed_training_calls_run_pytorch_each_time(monkeypatch):
    """A signature the planner routes to PyTorch while autograd records stays routed on every
    later recorded call (one check, then the routed path), with eager's gradients."""
    _route_on(monkeypatch)
    model, (x,) = make_seed("m99")
    eager = __import__("copy").deepcopy(model)
    opt = gemmfuse.optimize(model, (x,))
    for _ in range(3):
        opt(x).sum().backward()
        eager(x).sum().backward()
    torch.testing.assert_close(model.linear.weight.grad, eager.linear.weight.grad, rtol=0, atol=0)
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.fused_calls == 0 and sum(rt.fallbacks.values()) == 3
    (reason,) = rt.fallbacks
    assert "PyTorch is faster" in reason and rt._routed_train is not None

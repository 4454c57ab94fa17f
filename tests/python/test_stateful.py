"""optimize() on models whose forward keeps state on `self`: capture never changes the user's
model, and the optimized module behaves as eager over several calls."""
import copy

import pytest
import torch
import torch.nn as nn

import gemmfuse
from conftest import needs_lib

pytestmark = needs_lib


class RNNCell(nn.Module):
    """A hand-written cell that keeps its hidden state as an attribute."""

    def __init__(self, n_in=24, n_hidden=40):
        super().__init__()
        self.i2h = nn.Linear(n_in + n_hidden, n_hidden)
        self.hidden = torch.randn(8, n_hidden)

    def forward(self, x):
        self.hidden = torch.tanh(self.i2h(torch.cat((x, self.hidden), 1)))
        return self.hidden


class Counting(nn.Module):
    """Counts its calls in a plain attribute and remembers its last input's mean."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.last_mean = x.mean()
        return torch.relu(self.lin(x)) * 2


def _attrs(model):
    return {(name, k): v for name, m in model.named_modules() for k, v in m.__dict__.items()
            if not k.startswith("_")}


@pytest.mark.parametrize("make", [RNNCell, Counting], ids=["rnn-cell", "counting"])
def test_optimize_leaves_the_model_untouched(make):
    torch.manual_seed(0)
    model = make()
    before = _attrs(model)
    x = torch.randn(8, 24 if make is RNNCell else 16)
    gemmfuse.optimize(model, (x,))
    after = _attrs(model)
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k] is v, f"optimize changed {k}"


@pytest.mark.parametrize("make", [RNNCell, Counting], ids=["rnn-cell", "counting"])
def test_state_on_self_follows_eager_over_calls(make):
    torch.manual_seed(0)
    model = make()
    eager = copy.deepcopy(model)
    n_in = 24 if make is RNNCell else 16
    opt = gemmfuse.optimize(model, (torch.randn(8, n_in),))
    for step in range(4):
        x = torch.randn(8, n_in)
        y, ref = opt(x), eager(x)
        assert isinstance(y, torch.Tensor) and type(y) is torch.Tensor, type(y)
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5, msg=f"step {step}")
    if make is RNNCell:
        torch.testing.assert_close(model.hidden, eager.hidden, atol=1e-5, rtol=1e-5)
    else:
        assert model.calls == eager.calls == 4
        torch.testing.assert_close(model.last_mean, eager.last_mean)
    assert "assigns to" in gemmfuse.explain(opt, print_it=False)


def test_state_on_self_trains():
    torch.manual_seed(0)
    model = RNNCell()
    eager = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, (torch.randn(8, 24),))
    x = torch.randn(8, 24)
    opt(x).square().sum().backward()
    eager(x).square().sum().backward()
    torch.testing.assert_close(model.i2h.weight.grad, eager.i2h.weight.grad, atol=1e-5, rtol=1e-4)


def test_whole_timing_of_a_stateful_model_routes_training_calls_to_it(monkeypatch):
    """The dynamo-captured module timed as a whole (an injected timer: forward fused faster,
    training slower): training calls run the model itself, each timed call started from the
    model's state, and the model is left as it was."""
    from gemmfuse import route_timer
    from test_route_timer import ScriptedTimer
    monkeypatch.setattr(route_timer, "whole_timed_on", lambda device: True)
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    timer = ScriptedTimer([1.0, 2.0, 3.0, 2.0])
    monkeypatch.setattr(route_timer, "timer", timer)
    torch.manual_seed(0)
    model = RNNCell()
    eager = copy.deepcopy(model)
    before = _attrs(model)
    opt = gemmfuse.optimize(model, (torch.randn(8, 24),))
    assert timer.calls == 4 and opt.__dict__["_gemmfuse_eager"] == {"train"}, opt.__dict__.get("_gemmfuse_whole")
    assert all(_attrs(model)[k] is v for k, v in before.items()), "timing left the model as it was"
    assert "PyTorch alone runs" in gemmfuse.explain(opt, print_it=False)
    def reached():  # calls that reached the chain runtimes (fused, or routed by the planner)
        return sum(rt.fused_calls + sum(rt.fallbacks.values()) for rt in gemmfuse.runtimes(opt))
    for step in range(3):
        x = torch.randn(8, 24)
        n = reached()
        y, ref = opt(x), eager(x)
        assert reached() == n, "a training call runs the model itself"
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5, msg=f"step {step}")
        y.sum().backward()
        eager.hidden = eager.hidden.detach()
        model.hidden = model.hidden.detach()
    with torch.no_grad():
        n = reached()
        opt(torch.randn(8, 24))
        assert reached() > n, "no_grad calls run the captured graph"

"""Training through fused chains behaves as eager: optimizer steps, gradient accumulation,
retain_graph, one module called twice in a graph, activation checkpointing, the torch.compile
backend, and no saved tensors under no_grad (CPU; the CUDA cases run where there is a GPU)."""
import copy

import pytest
import torch
import torch.utils.checkpoint

import gemmfuse
from conftest import HAVE_CUDA, make_seed, needs_lib

pytestmark = needs_lib
DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])


def _pair(mid, device):
    model, (x,) = make_seed(mid, device=device)
    return model, copy.deepcopy(model), x


def _no_worse(ours, eager, ref64, factor=1.25):
    """Our gradient is at least nearly as close to float64 as eager fp32's (their rounding
    differs: compared with each other they can differ by more than either errs)."""
    e_ours = float((ours.double() - ref64).norm())
    e_eager = float((eager.double() - ref64).norm())
    assert e_ours <= factor * e_eager + 1e-6 * float(ref64.norm()) + 1e-9, (e_ours, e_eager)


def _close_params(a, b, tol):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f"{n}: {m}")
    for (n, p), (_, q) in zip(a.named_buffers(), b.named_buffers()):
        torch.testing.assert_close(p.float(), q.float(), rtol=tol, atol=tol, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mid", ["m22", "m84", "m94", "m99"])
def test_adamw_steps_match_eager(mid, device):
    model, ref, x = _pair(mid, device)
    opt = gemmfuse.optimize(model, (x,))
    o1 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    o2 = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(3):
        xs = torch.rand_like(x)
        for m, o in ((opt, o1), (ref, o2)):
            o.zero_grad()
            loss = (m(xs) ** 2).mean()
            loss.backward()
            o.step()
    _close_params(model, ref, 1e-4)  # Adam's steps are ~lr whatever the gradient's size
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.train_calls == 3 and not rt.fallbacks, rt.fallbacks


@pytest.mark.parametrize("device", DEVICES)
def test_accumulation_retain_graph_and_twice_in_a_graph(device):
    model, ref, x = _pair("m99", device)
    m64 = copy.deepcopy(ref).double()
    opt = gemmfuse.optimize(model, (x,))
    x2 = torch.rand_like(x)
    for m, dt in ((opt, torch.float32), (ref, torch.float32), (m64, torch.float64)):
        y = m(x.to(dt)) * 2 + m(x2.to(dt))      # the same module twice in one graph
        y.sum().backward(retain_graph=True)
        (y ** 2).sum().backward()                # the same graph again, gradients accumulate
    for p, q, r in zip(model.parameters(), ref.parameters(), m64.parameters()):
        _no_worse(p.grad, q.grad, r.grad)
    assert gemmfuse.runtimes(opt)[0].train_calls == 2


@pytest.mark.parametrize("device", DEVICES)
def test_activation_checkpointing(device):
    model, ref, x = _pair("m94", device)
    m64 = copy.deepcopy(ref).double()
    opt = gemmfuse.optimize(model, (x,))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()]
    torch.utils.checkpoint.checkpoint(opt, xs[0], use_reentrant=False).pow(2).sum().backward()
    ref(xs[1]).pow(2).sum().backward()
    m64(xs[2]).pow(2).sum().backward()
    # m94's hardtanh: a value within rounding of a kink takes either derivative, so both fp32
    # errors come from a few such flips, in different places (2x: noise, not a bias).
    _no_worse(xs[0].grad, xs[1].grad, xs[2].grad, factor=2.0)
    for p, q, r in zip(model.parameters(), ref.parameters(), m64.parameters()):
        _no_worse(p.grad, q.grad, r.grad, factor=2.0)
    assert gemmfuse.runtimes(opt)[0].train_calls >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_backend_trains(device):
    model, ref, x = _pair("m84", device)
    m64 = copy.deepcopy(ref).double()
    compiled = torch.compile(model, backend="gemmfuse")
    compiled(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    m64(x.double()).pow(2).sum().backward()
    for p, q, r in zip(model.parameters(), ref.parameters(), m64.parameters()):
        _no_worse(p.grad, q.grad, r.grad)
    rep = gemmfuse.reports.COMPILED[-1]
    assert [e.status for e in rep.entries] == ["fused"], rep.entries
    assert torch.ops.gemmfuse.calls(rep.entries[0].spec)[1] >= 1, "a training call"


def test_no_grad_saves_nothing():
    model, _, x = _pair("m99", "cpu")
    opt = gemmfuse.optimize(model, (x,))
    calls = []
    real = torch.ops.gemmfuse.train_forward
    with torch.no_grad():
        opt(x)
    with torch.inference_mode():
        opt(x)
    rt = gemmfuse.runtimes(opt)[0]
    assert rt.train_calls == 0 and rt.fused_calls == 2 and not calls and real is not None
    y = opt(x)
    assert y.grad_fn is not None and rt.train_calls == 1


@pytest.mark.parametrize("device", DEVICES)
def test_fused_optimizer_steps_are_seen(device):
    """AdamW(fused=True) writes parameters without bumping their version counters; the
    weights gemmfuse prepares from them (m18: W's column sums for its GEMV) must follow."""
    model, ref, x = _pair("m18", device)
    opt = gemmfuse.optimize(model, (x,))
    o1 = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    o2 = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for _ in range(2):
        for m, o in ((opt, o1), (ref, o2)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
        with torch.no_grad():
            torch.testing.assert_close(opt(x), ref(x), rtol=1e-4, atol=1e-4)
    assert gemmfuse.runtimes(opt)[0].train_calls == 2

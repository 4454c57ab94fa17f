"""`with gemmfuse.fp32_matmul():` (matmul_switch.py): fp32 matrix products of uncaptured code
on gemmfuse's fp32 GEMM, forward and backward, against float64; what it does not take runs as
PyTorch runs it, counted with the reason. On the CPU the switch is pointed at CPU tensors
(the CPU executor); on a GPU, at CUDA ones (the split kernel where it pays)."""
import copy

import pytest
import torch
import torch.nn as nn

import gemmfuse
from gemmfuse import matmul_switch
from conftest import HAVE_CUDA, needs_lib

pytestmark = needs_lib
DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def fresh_counts():
    matmul_switch.reset_counts()
    yield
    gemmfuse.set_fp32_matmul(False)


@pytest.mark.parametrize("dev", DEVICES)
def test_mlp_trains_through_the_switch(dev):
    """Forward and every gradient within eager fp32's error against float64 (1.25x, as fp32
    mode promises), and each product counted: 2 forward, dW and dx per layer."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 192), nn.GELU(), nn.Linear(192, 64)).to(dev)
    ref, eager = copy.deepcopy(m).double(), copy.deepcopy(m)
    x = torch.randn(96, 256, device=dev, requires_grad=True)
    xd, xe = x.detach().double().requires_grad_(), x.detach().clone().requires_grad_()
    g = torch.randn(96, 64, device=dev)
    with gemmfuse.fp32_matmul(devices=(dev,)):
        y = m(x)
        y.backward(g)
    ref(xd).backward(g.double())
    eager(xe).backward(g)
    assert gemmfuse.fp32_matmul_counts() == {"gemmfuse": 6}
    with torch.no_grad():
        assert rel(y, ref(xd)) <= 1.25 * rel(eager(xe), ref(xd)) + 1e-7
    pairs = [(x.grad, xe.grad, xd.grad)] + [
        (p.grad, pe.grad, pr.grad)
        for p, pe, pr in zip(m.parameters(), eager.parameters(), ref.parameters())]
    for got, eag, want in pairs:
        assert rel(got, want) <= 1.25 * rel(eag, want) + 1e-7


@pytest.mark.parametrize("dev", DEVICES)
def test_products_of_views_and_strides(dev):
    """mm, addmm, `@` and matmul of a batch, by parameters' transposes (frozen ones too) and
    by plain tensors, on sliced and offset left operands: float64's values."""
    torch.manual_seed(1)
    a = torch.randn(70, 130, device=dev)[:, 3:67]        # [70, 64], rows strided, offset
    w = nn.Parameter(torch.randn(48, 64, device=dev))
    frozen = nn.Parameter(torch.randn(40, 64, device=dev), requires_grad=False)
    bias = torch.randn(40, device=dev)
    x3 = torch.randn(4, 9, 64, device=dev)
    b = torch.randn(64, 40, device=dev)
    with gemmfuse.fp32_matmul(devices=(dev,)), torch.no_grad():
        outs = [torch.mm(a, w.T), torch.addmm(bias, a, frozen.T), a @ w.T, torch.matmul(x3, w.T),
                torch.nn.functional.linear(a.contiguous(), frozen, bias), a @ b,
                torch.addmm(bias, a, b)]
    wd, fd = w.detach().double(), frozen.double()
    wants = [a.double() @ wd.T, bias.double() + a.double() @ fd.T, a.double() @ wd.T,
             x3.double() @ wd.T, a.double() @ fd.T + bias.double(), a.double() @ b.double(),
             bias.double() + a.double() @ b.double()]
    for got, want in zip(outs, wants):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert rel(got, want) < 1e-6
    assert gemmfuse.fp32_matmul_counts() == {"gemmfuse": 7}


@pytest.mark.parametrize("dev", DEVICES)
def test_what_it_does_not_take_runs_as_pytorch(dev):
    torch.manual_seed(2)
    a, w = torch.randn(8, 16, device=dev), nn.Parameter(torch.randn(4, 16, device=dev))
    b, c = torch.randn(16, 4, device=dev), torch.randn(8, 4, device=dev)
    cases = [
        (lambda: torch.mm(a.double(), b.double()), "float64 operands"),
        (lambda: torch.bmm(a[None], b[None]), "a batched product"),
        (lambda: torch.addmm(c[0], a, w.T, beta=0.5), "beta or alpha"),
        (lambda: torch.addmm(c, a, w.T), "not one fp32 row"),
        (lambda: torch.mm(a[:0], w.T), "an empty product"),
    ]
    for fn, why in cases:
        matmul_switch.reset_counts()
        with gemmfuse.fp32_matmul(devices=(dev,)), torch.no_grad():
            got = fn()
        with torch.no_grad():
            assert torch.equal(got, fn()), why
        (where,) = gemmfuse.fp32_matmul_counts()
        assert where.startswith("PyTorch: ") and why in where, (where, why)
    matmul_switch.reset_counts()
    with gemmfuse.fp32_matmul(devices=("meta",)), torch.no_grad():  # another device type
        torch.mm(a, w.T)
    (where,) = gemmfuse.fp32_matmul_counts()
    assert where == f"PyTorch: operands on {dev} (the switch covers meta)"


@pytest.mark.parametrize("dev", DEVICES)
def test_bad_shapes_and_special_values_behave_as_pytorch(dev):
    a, w = torch.randn(8, 16, device=dev), nn.Parameter(torch.randn(4, 15, device=dev))
    with gemmfuse.fp32_matmul(devices=(dev,)), torch.no_grad(), pytest.raises(RuntimeError):
        torch.mm(a, w.T)
    matmul_switch.reset_counts()
    a = torch.randn(40, 256, device=dev)
    a[3, 7], a[5, 9], a[11, :] = float("inf"), float("nan"), float("-inf")
    w = nn.Parameter(torch.randn(64, 256, device=dev))
    with gemmfuse.fp32_matmul(devices=(dev,)), torch.no_grad():
        got = torch.mm(a, w.T)
    with torch.no_grad():
        want = torch.mm(a, w.T)
    assert gemmfuse.fp32_matmul_counts() == {"gemmfuse": 1}
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert rel(got[fin], want[fin].double()) < 1e-5


def test_global_switch_on_and_off():
    a, w = torch.randn(8, 16), nn.Parameter(torch.randn(4, 16))
    gemmfuse.set_fp32_matmul(True, devices=("cpu",))
    torch.mm(a, w.T)
    gemmfuse.set_fp32_matmul(False)
    torch.mm(a, w.T)
    assert gemmfuse.fp32_matmul_counts() == {"gemmfuse": 1}
    with pytest.raises(ValueError, match="precision"):
        gemmfuse.fp32_matmul(precision="fp16")


@pytest.mark.skipif(not HAVE_CUDA, reason="needs a GPU")
def test_right_operands_that_change_keep_no_preparation():
    """Products by fresh tensors (an activation, a gradient) prepare them for their call
    alone: memory does not grow by a kept preparation per operand."""
    # 2048^3: large enough for the split kernel, whose preparation of W is its fp16 parts
    a = torch.randn(2048, 2048, device="cuda")
    bs = [torch.randn(2048, 2048, device="cuda") for _ in range(12)]  # alive: distinct addresses
    with gemmfuse.fp32_matmul(), torch.no_grad():
        torch.mm(a, bs[0])
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for b in bs[1:]:
            torch.mm(a, b)
        torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    assert grown < 8 * 2 ** 20, grown  # a kept preparation: W's fp16 parts, 16 MiB each

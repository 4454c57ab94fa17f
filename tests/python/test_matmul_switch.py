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
def test_fused_optimizer_steps_reach_the_next_product(dev):
    """AdamW(fused=True) writes W without bumping its version, which W's kept preparation
    (its fp16 parts on a GPU) keys on: the switch installs the step hook that bumps it, so
    the product after a step reads the new W. The hook is removed first, so that no other
    test's leaves it in place."""
    from gemmfuse import runtime
    if runtime._optimizer_hook is not None:
        runtime._optimizer_hook.remove()
        runtime._optimizer_hook = None
    torch.manual_seed(3)
    lin = nn.Linear(2048, 2048, device=dev)  # the split kernel's size on a GPU
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2, fused=True)
    x = torch.randn(1024, 2048, device=dev)
    for _ in range(2):
        with gemmfuse.fp32_matmul(devices=(dev,)):
            y = lin(x)
            y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    with gemmfuse.fp32_matmul(devices=(dev,)), torch.no_grad():
        y = lin(x)
        assert gemmfuse.fp32_matmul_counts()["gemmfuse"] == 5  # 2 x (forward, dW), then 1
    with torch.no_grad():
        want = torch.addmm(lin.bias.double(), x.double(), lin.weight.double().t())
        eager = torch.addmm(lin.bias, x, lin.weight.t())
    assert rel(y, want) <= 1.25 * rel(eager, want) + 1e-7


def test_a_kept_weight_is_keyed_on_the_parameter(monkeypatch):
    """A parameter's kept preparation is keyed on the tensor the op is given, by its version:
    that tensor must carry the parameter's version counter. A view made inside the mode (below
    autograd) has its own, at 0 whatever the steps (on a GPU that left the old W's parts in
    use after AdamW(fused=True) steps); the parameter itself is given."""
    from gemmfuse import _lib
    real, seen = _lib.ops(), []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def linear(self, x, w, bias, precision, keep):
            seen.append((w._version, keep, w.data_ptr(), tuple(w.shape)))
            return real.linear(x, w, bias, precision, keep)

    monkeypatch.setattr(_lib, "ops", lambda: Spy())
    torch.manual_seed(4)
    lin = nn.Linear(32, 16)
    with torch.no_grad():
        lin.weight.mul_(1.5)
        lin.weight.add_(0.25)
    x = torch.randn(8, 32)
    with gemmfuse.fp32_matmul(devices=("cpu",)), torch.no_grad():
        y = lin(x)
    assert seen == [(lin.weight._version, True, lin.weight.data_ptr(), (16, 32))]
    assert lin.weight._version >= 2  # the two writes above (init wrote too)
    assert rel(y, torch.addmm(lin.bias.double(), x.double(), lin.weight.double().t())) < 1e-6


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
        (lambda: torch.baddbmm(c[None], a[None], b[None], beta=0.5), "beta or alpha"),
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


# Each product's (M, K, N) in the batched tests: on a GPU large enough for the split kernel
# (f16x3, forward and both gradients' products), where gemmfuse takes a batch; on the CPU small
# (the CPU executor takes every batch).
def batch_dims(dev):
    if dev == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("on CUDA gemmfuse takes batches whose products run on the split kernel: sm_90")
    return (1152, 1280, 1024) if dev == "cuda" else (24, 40, 20)


@pytest.mark.parametrize("dev", DEVICES)
def test_batched_products_of_views_and_strides(dev):
    """bmm, baddbmm (broadcast and full added terms), matmul and `@` with batch dimensions and
    two-operand einsum, on sliced and transposed operands: float64's values, eager's dtype and
    shape, each product taken."""
    torch.manual_seed(3)
    M, K, N = batch_dims(dev)
    a = torch.randn(3, M, K + 6, device=dev)[:, :, 3:K + 3]    # rows strided, offset
    b = torch.randn(3, N, K, device=dev).transpose(1, 2)      # [3, K, N], transposed
    a4, b4 = torch.randn(2, 3, M, K, device=dev), torch.randn(2, 3, K, N, device=dev)
    row, full = torch.randn(M, N, device=dev), torch.randn(3, M, N, device=dev)
    cases = [lambda: torch.bmm(a, b), lambda: torch.baddbmm(row, a, b),
             lambda: torch.baddbmm(full, a, b), lambda: torch.matmul(a, b), lambda: a4 @ b,
             lambda: a4 @ b4, lambda: torch.einsum("bij,bjk->bik", a, b)]
    with gemmfuse.fp32_matmul(devices=(dev,)), torch.no_grad():
        outs = [fn() for fn in cases]
    with torch.no_grad():
        eager = [fn() for fn in cases]
    ad, bd = a.double(), b.double()
    wants = [ad @ bd, row.double() + ad @ bd, full.double() + ad @ bd, ad @ bd,
             a4.double() @ bd, a4.double() @ b4.double(), ad @ bd]
    for got, eag, want in zip(outs, eager, wants):
        assert got.dtype == eag.dtype == torch.float32 and got.shape == eag.shape == want.shape
        assert rel(got, want) < 1e-6
    assert gemmfuse.fp32_matmul_counts() == {"gemmfuse": len(cases)}


class BatchedProduct(nn.Module):
    """x @ w for a batch of weights: one bmm of two tensors that require grad."""

    def __init__(self, b, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(b, k, n) / k ** 0.5)

    def forward(self, x):
        return torch.bmm(x, self.w)


@pytest.mark.parametrize("dev", DEVICES)
def test_batched_product_trains_through_the_switch(dev):
    """bmm's backward calls bmm for dx and dw: both run through the switch, each gradient
    within eager fp32's error against float64 (1.25x, as fp32 mode promises)."""
    torch.manual_seed(4)
    M, K, N = batch_dims(dev)
    m = BatchedProduct(3, K, N).to(dev)
    ref, eager = copy.deepcopy(m).double(), copy.deepcopy(m)
    x = torch.randn(3, M, K, device=dev, requires_grad=True)
    xd, xe = x.detach().double().requires_grad_(), x.detach().clone().requires_grad_()
    g = torch.randn(3, M, N, device=dev)
    with gemmfuse.fp32_matmul(devices=(dev,)):
        y = m(x)
        y.backward(g)
    ref(xd).backward(g.double())
    eager(xe).backward(g)
    assert gemmfuse.fp32_matmul_counts() == {"gemmfuse": 3}  # forward, dx, dw
    with torch.no_grad():
        assert rel(y, ref(xd)) <= 1.25 * rel(eager(xe), ref(xd)) + 1e-7
    for got, eag, want in [(x.grad, xe.grad, xd.grad), (m.w.grad, eager.w.grad, ref.w.grad)]:
        assert rel(got, want) <= 1.25 * rel(eag, want) + 1e-7


@pytest.mark.parametrize("dev", DEVICES)
def test_batches_it_does_not_take_run_as_pytorch(dev, monkeypatch):
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")  # the CUDA case: route as users get it
    torch.manual_seed(5)
    a, b, c = (torch.randn(3, 8, 16, device=dev), torch.randn(3, 16, 4, device=dev),
               torch.randn(8, 4, device=dev))
    cases = [
        (lambda: torch.baddbmm(c, a, b, beta=0.5), "beta or alpha"),
        (lambda: torch.baddbmm(c, a, b, alpha=2), "beta or alpha"),
        (lambda: torch.bmm(a.double(), b.double()), "float64 operands"),
        (lambda: torch.bmm(a.half(), b.half()), "float16 operands"),
        (lambda: torch.bmm(a[:0], b[:0]), "an empty product"),
        (lambda: torch.bmm(a[:, :0], b), "an empty product"),
        (lambda: torch.baddbmm(c, a[:, :, :0], b[:, :0]), "an empty product"),
    ]
    if dev == "cuda":  # products this small run on cuBLAS: at::bmm runs them as one call
        cases.append((lambda: torch.bmm(a, b), "not on the split kernel"))
    for fn, why in cases:
        matmul_switch.reset_counts()
        with gemmfuse.fp32_matmul(devices=(dev,)), torch.no_grad():
            got = fn()
        with torch.no_grad():
            want = fn()
        assert got.dtype == want.dtype and torch.equal(got, want), why
        (where,) = gemmfuse.fp32_matmul_counts()
        assert where.startswith("PyTorch: ") and why in where, (where, why)
    bad = [lambda: torch.bmm(a, b[:2]), lambda: torch.bmm(a, b[:, :15]),
           lambda: torch.baddbmm(c, a, b[:, :15])]
    for fn in bad:
        with gemmfuse.fp32_matmul(devices=(dev,)), torch.no_grad(), pytest.raises(RuntimeError):
            fn()


def test_bmm_route_and_checks():
    """The C++ ops directly: bmm_route takes a plain CPU fp32 batch and gives reasons (never
    raises) for what bmm rejects; bmm raises those with its checks; Meta gives the shape."""
    ops = gemmfuse._lib.ops()
    a, b = torch.randn(2, 5, 7), torch.randn(2, 7, 3)
    assert ops.bmm_route(a, b, "fp32") == ""
    assert ops.bmm_route(a[:0], b[:0], "fp32") == "an empty product"
    bad = [((a[0], b[0]), "3-D"), ((a, b[:1]), "batch sizes differ"),
           ((a, b[:, :6]), "cannot be multiplied"), ((a.double(), b.double()), "fp32")]
    for (x, y), why in bad:
        assert why in ops.bmm_route(x, y, "fp32")
        with pytest.raises(RuntimeError, match=why):
            ops.bmm(x, y, "fp32")
    out = ops.bmm(a.to("meta"), b.to("meta"), "fp32")
    assert out.device.type == "meta" and out.shape == (2, 5, 3)


def test_mm_route_gives_reasons_and_never_raises():
    """mm_route on the CPU: a product the planner takes runs on gemmfuse (the CPU executor is
    the reference path); shapes that cannot be multiplied and empty products get reasons."""
    ops = gemmfuse._lib.ops()
    a, b, bias = torch.randn(5, 7), torch.randn(7, 3), torch.randn(3)
    assert ops.mm_route(a, b, None, "fp32") == "" and ops.mm_route(a, b, bias, "fast") == ""
    assert ops.mm_route(a, b[:6], None, "fp32") == "not a matrix product of matching shapes"
    assert ops.mm_route(a[None], b, None, "fp32") == "not a matrix product of matching shapes"
    assert ops.mm_route(a[:0], b, None, "fp32") == "an empty product"
    assert ops.mm_route(a[:, :0], b[:0], None, "fp32") == "an empty product"


@pytest.mark.parametrize("m, n", [(16, 8), (24, 20)])
def test_bmm_puts_each_product_in_its_place(m, n):
    """gemmfuse::bmm writes product i into slice i of the output where M N is a multiple of 64
    (each slice 256-byte aligned: 16 x 8), else stacks products run apart (24 x 20)."""
    torch.manual_seed(6)
    a, b = torch.randn(5, m, 12), torch.randn(5, 12, n)
    out = gemmfuse._lib.ops().bmm(a, b, "fp32")
    assert out.shape == (5, m, n) and out.is_contiguous()
    assert rel(out, a.double() @ b.double()) < 1e-6


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


def test_each_signature_is_timed_once_and_the_faster_way_runs(monkeypatch):
    """Where C++'s route sends a product to gemmfuse, the first call of each signature times
    gemmfuse's way and PyTorch's (here a stand-in timer, the CPU opted in as a GPU is by
    default) and the faster runs from then on, counted with the times; a parameter's product
    (its W kept) is a signature apart from a plain tensor's of the same shape."""
    monkeypatch.setenv("GEMMFUSE_TIMED_ROUTES", "1")
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    monkeypatch.setattr(matmul_switch.route_timer, "_timed", {})
    times = []
    monkeypatch.setattr(matmul_switch.route_timer, "timer", lambda fn, dev: (fn(), times.pop(0))[1])
    torch.manual_seed(6)
    a, b = torch.randn(24, 40), torch.randn(40, 16)
    times[:] = [2.0, 1.0]  # gemmfuse's, then PyTorch's
    with gemmfuse.fp32_matmul(devices=("cpu",)), torch.no_grad():
        got = [a @ b for _ in range(3)]
    slower = "PyTorch: PyTorch timed faster at this shape (1.000 ms against gemmfuse's 2.000 ms)"
    assert gemmfuse.fp32_matmul_counts() == {slower: 3} and times == []
    assert all(torch.equal(g, torch.mm(a, b)) for g in got)

    lin = nn.Linear(40, 16)
    plain = lin.weight.detach().clone()
    times[:] = [1.0, 3.0, 5.0, 1.0, 2.0, 4.0]  # the Linear's, the batch's, the plain W's
    matmul_switch.reset_counts()
    with gemmfuse.fp32_matmul(devices=("cpu",)), torch.no_grad():
        for _ in range(2):
            y = lin(a)
            z = torch.bmm(a[None], b[None])
            torch.addmm(lin.bias, a, plain.t())
    assert times == []
    assert gemmfuse.fp32_matmul_counts() == {
        "gemmfuse": 4,
        "PyTorch: PyTorch timed faster at this shape (1.000 ms against gemmfuse's 5.000 ms)": 2}
    want = torch.addmm(lin.bias.double(), a.double(), lin.weight.double().t())
    assert rel(y, want) < 1e-6 and torch.equal(z, torch.bmm(a[None], b[None]))


def test_products_are_not_timed_where_routes_are_untimed(monkeypatch):
    """On the CPU by default (GEMMFUSE_TIMED_ROUTES unset) C++'s route alone decides."""
    monkeypatch.delenv("GEMMFUSE_TIMED_ROUTES", raising=False)

    def timer(fn, dev):
        raise AssertionError("timed")

    monkeypatch.setattr(matmul_switch.route_timer, "timer", timer)
    with gemmfuse.fp32_matmul(devices=("cpu",)), torch.no_grad():
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert gemmfuse.fp32_matmul_counts() == {"gemmfuse": 1}


@pytest.mark.skipif(not HAVE_CUDA, reason="CUDA graph capture needs a GPU")
def test_a_timed_choice_holds_in_cuda_graph_capture(monkeypatch):
    """A signature timed before capture keeps its choice inside torch.cuda.graph (where no
    timing can run): here the stand-in timer made PyTorch's mm the faster."""
    monkeypatch.setenv("GEMMFUSE_TIMED_ROUTES", "1")
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    monkeypatch.setattr(matmul_switch.route_timer, "_timed", {})
    times = [2.0, 1.0]
    monkeypatch.setattr(matmul_switch.route_timer, "timer", lambda fn, dev: (fn(), times.pop(0))[1])
    a, b = torch.randn(2048, 2048, device="cuda"), torch.randn(2048, 2048, device="cuda")
    mode = gemmfuse.fp32_matmul()
    with mode, torch.no_grad():
        a @ b  # timed here, unless C++'s route already sends it to PyTorch
    timed = times == []
    matmul_switch.reset_counts()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), mode, torch.no_grad():
        y = a @ b
    graph.replay()
    torch.cuda.synchronize()
    (where,) = gemmfuse.fp32_matmul_counts()
    assert where.startswith("PyTorch: ") and (not timed or "timed faster" in where), where
    assert rel(y, a.double() @ b.double()) < 1e-5

"""fp32 attention inside gemmfuse.fp32_matmul() (attention_switch.py): PyTorch's memory-efficient
attention and its backward on gemmfuse's split-product kernels, a backward on the side its
forward ran; output and gradients against float64 within 1.25x eager fp32's error; what the kernel
does not take runs as PyTorch runs it, with the reason."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import gemmfuse
from gemmfuse import matmul_switch
from conftest import HAVE_CUDA, needs_lib

pytestmark = [needs_lib, pytest.mark.skipif(not HAVE_CUDA, reason="the kernel is CUDA's")]


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def assert_as_eager(got, eager, q, k, v, go, **kw):
    """got and eager: (output, dq, dk, dv); got's errors against float64's math path within
    1.25x eager's."""
    d = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*d, **kw)
    want = (ref, *torch.autograd.grad(ref, d, go.double()))
    for g, e, w in zip(got, eager, want):
        assert rel(g.detach(), w) <= 1.25 * rel(e.detach(), w) + 1e-7


@pytest.fixture(autouse=True)
def fresh_counts():
    matmul_switch.reset_counts()


def qkv(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", generator=g).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True, "mask"])
@pytest.mark.parametrize("shape,keys", [((2, 3, 200, 64), 0), ((1, 2, 130, 128), 0),
                                        ((2, 2, 70, 64), 150), ((1, 3, 150, 96), 40)])
def test_sdpa_forward_on_gemmfuse_and_gradients_as_eager(shape, keys, causal, monkeypatch):
    """causal: True, False, or "mask": a bool attention mask [Sq, Sk] (SDPA passes it to the
    efficient-attention op as an additive bias, which the kernels read in place). keys: Sk
    where it is not Sq (cross-attention's keys and values). Both directions on gemmfuse's
    kernels (GEMMFUSE_ALWAYS_FUSE=1: untimed), at every head dim."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "1")
    q = qkv(shape, 1)[0]
    k, v = qkv((*shape[:2], keys or shape[2], shape[3]), 2)[:2]
    go = torch.randn(shape, device="cuda")
    kw = {"is_causal": causal} if causal != "mask" else \
        {"attn_mask": torch.rand(shape[2], keys or shape[2], device="cuda") > 0.2}
    with gemmfuse.fp32_matmul():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        grads = torch.autograd.grad(out, (q, k, v), go)
    counts = gemmfuse.fp32_matmul_counts()
    assert counts.get("gemmfuse", 0) == 2, counts  # the forward and the backward
    eager = F.scaled_dot_product_attention(q, k, v, **kw)
    eager_grads = torch.autograd.grad(eager, (q, k, v), go)
    assert_as_eager((out, *grads), (eager, *eager_grads), q, k, v, go, **kw)


def test_a_backward_runs_where_its_forward_ran(monkeypatch):
    """A forward timed faster in PyTorch (a stand-in timer here) leaves its backward to PyTorch
    too, whatever gemmfuse's backward would take: each side's backward recomputes the scores as
    its own forward did (attention.py's module docstring). The output is then eager's, bit for
    bit, and so are the gradients up to the order of PyTorch's own backward's atomic sums."""
    from gemmfuse import route_timer
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")  # conftest's default skips the timing
    times = itertools.cycle([2.0, 1.0])  # gemmfuse's side is timed first
    monkeypatch.setattr(route_timer, "timer", lambda fn, device: next(times))
    q, k, v = qkv((1, 2, 96, 64), 7)  # a signature no other test times
    go = torch.randn(q.shape, device="cuda")
    with gemmfuse.fp32_matmul():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out, (q, k, v), go)
    counts = gemmfuse.fp32_matmul_counts()
    assert counts.get("gemmfuse", 0) == 0, counts
    assert any("its forward ran in PyTorch" in where for where in counts), counts
    eager = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, eager)
    for got, want in zip(grads, torch.autograd.grad(eager, (q, k, v), go)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_inputs_off_16_byte_boundaries():
    """q, k, v and the output's gradient as contiguous views starting 4 bytes into their storage,
    through gemmfuse's attention call (the kernels, whatever PyTorch's dispatcher would pick for
    such views): their 16-byte loads and copies read aligned copies; values and gradients as
    eager's (on aligned copies) against float64."""
    from gemmfuse.attention import runs_on_gemmfuse, scaled_dot_product_attention
    shape = (2, 2, 100, 64)
    n = 2 * 2 * 100 * 64
    g = torch.Generator(device="cuda").manual_seed(5)
    base = torch.randn(4 * n + 1, device="cuda", generator=g)
    leaves = base[1:].detach().requires_grad_()
    q, k, v, go = (leaves[i * n:(i + 1) * n].view(shape) for i in range(4))
    go = go.detach()
    assert all(t.data_ptr() % 16 == 4 for t in (q, k, v, go))
    assert runs_on_gemmfuse(q, k, v)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), go)
    # PyTorch's own fp32 SDPA faults on these views (its memory-efficient kernel: "misaligned
    # address", sticky, on an H200 with torch 2.11): eager runs on aligned copies of the values.
    e = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = F.scaled_dot_product_attention(*e, is_causal=True)
    eager_grads = torch.autograd.grad(eager, e, go.clone())
    assert_as_eager((out, *grads), (eager, *eager_grads), q, k, v, go, is_causal=True)


def test_what_the_kernel_does_not_take_runs_as_pytorch():
    q, k, v = qkv((1, 2, 64, 64), 2)
    small = [t[..., :32] for t in (q, k, v)]
    narrow_v = v[..., :32]  # values of another head dim than the queries' and keys'
    cases = [(lambda: F.scaled_dot_product_attention(q, k, narrow_v), "k and v [B, H, Sk, D]"),
             (lambda: F.scaled_dot_product_attention(*small), "head dim 32")]
    for fn, why in cases:
        matmul_switch.reset_counts()
        with gemmfuse.fp32_matmul(), torch.no_grad():
            got = fn()
        with torch.no_grad():
            want = fn()
        assert torch.allclose(got, want, rtol=0, atol=0)
        counts = gemmfuse.fp32_matmul_counts()
        assert any(why in where for where in counts), counts

"""Products of two activations in captured models (gemmfuse.products): optimize() and the
torch.compile backend run `a @ b`, torch.matmul, torch.bmm and torch.mm of fp32 activations
on gemmfuse's batched product where it takes them (the CPU tests: GEMMFUSE_ALWAYS_FUSE=1),
two-operand einsum and baddbmm too, forward and backward, within 1.25x eager fp32's error
against float64 (batch dims that broadcast too); vector operands and the einsums the plan
declines stay PyTorch's, with the reason."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import gemmfuse
from gemmfuse import products, reports
from conftest import HAVE_CUDA, needs_lib
from test_attention_capture import assert_as_eager

pytestmark = [needs_lib, pytest.mark.usefixtures("fresh_dynamo")]
DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])


class Mixer(nn.Module):
    """Linears, then products of activations: a 4-D @, one whose batch dims broadcast, a bmm,
    and a product with a vector (PyTorch's)."""

    def __init__(self, d=64):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):  # x [4, 32, 64]
        a, b = self.a(x), self.b(x)
        s = a.view(2, -1, 16, 64) @ b.view(2, -1, 64, 16)  # [2, 4, 16, 16]
        r = s @ s[:1]                                      # batch dims that broadcast
        t = torch.bmm(r.reshape(-1, 16, 16), a.reshape(-1, 16, 64))
        w = r @ r[0, 0, 0]                                 # a vector operand
        return t.reshape(x.shape) + w.sum()


def product_nodes(opt) -> list:
    graphs = [opt] if isinstance(opt, fx.GraphModule) else reports.compiled_graphs(opt)
    return [n for gm in graphs for n in gm.graph.nodes if n.target is products.matmul]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("how", ["optimize", "backend", "backend-runtimes"])
def test_products_of_activations_on_gemmfuse_as_eager(dev, how):
    torch.manual_seed(0)
    model, x = Mixer().to(dev), torch.randn(4, 32, 64, device=dev)
    if how == "optimize":
        opt = gemmfuse.optimize(model, (x,))
    else:
        opt = torch.compile(model, backend="gemmfuse",
                            options={"inductor": False} if how == "backend-runtimes" else None)
    assert_as_eager(model, opt, x)
    assert len(product_nodes(opt)) >= 3  # the two 4-D @ and the bmm (per graph dynamo made)
    text = gemmfuse.explain(opt, print_it=False)
    assert "on gemmfuse's GEMM (gemmfuse.products.matmul; backward: dA on gemmfuse, dB on " \
           "gemmfuse)" in text, text
    assert "left to " in text and "a vector operand" in text, text


def test_the_call_without_grad_and_at_odd_shapes():
    """matmul as torch.matmul: 2-D and 5-D operands, no grad, a product of K = 1, an empty
    batch, batch dims that broadcast."""
    g = torch.Generator().manual_seed(1)
    for a_shape, b_shape in [((3, 5), (5, 7)), ((2, 1, 3, 4, 5), (2, 1, 3, 5, 2)),
                             ((4, 6, 1), (4, 1, 3)), ((0, 3, 4), (0, 4, 2)),
                             ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((3, 4), (2, 4, 5))]:
        a, b = torch.randn(a_shape, generator=g), torch.randn(b_shape, generator=g)
        got, want = products.matmul(a, b), torch.matmul(a, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tf32_precision_leaves_products_to_pytorch():
    torch.manual_seed(0)
    model, x = Mixer(), torch.randn(4, 32, 64)
    opt = gemmfuse.optimize(model, (x,), precision="tf32")
    assert not product_nodes(opt)
    assert "left to PyTorch: tf32 precision" in gemmfuse.explain(opt, print_it=False)


class EinsumMixer(nn.Module):
    """Products written as einsum (attention-style scores, a contraction over two dims, one
    whose output order is permuted), a baddbmm, an addmm of activations (a chain: the finder
    takes a 2-D activation as its weight) and an einsum the plan declines (a diagonal)."""

    def __init__(self, d=64):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):  # x [4, 32, 64]
        a, b = self.a(x), self.b(x)
        q, k = a.view(4, 32, 4, 16), b.view(4, 32, 4, 16)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k)                  # [4, 4, 32, 32]
        o = torch.einsum("bhqk,bkhd->bqhd", s, k).reshape(4, 32, 64)
        c = torch.einsum("bij,bkj->ik", a, b)                      # contracts b and j
        t = torch.baddbmm(o, s.sum(1), b, beta=0.5, alpha=2.0)
        u = torch.addmm(c[0], c, c.t())
        diag = torch.einsum("bii,bij->bj", s.reshape(16, 32, 32), s.reshape(16, 32, 32))
        return t.sum() + u.sum() + diag.sum() + o.square().sum()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("how", ["optimize", "backend"])
def test_einsum_and_baddbmm_on_gemmfuse_as_eager(dev, how):
    torch.manual_seed(0)
    model, x = EinsumMixer().to(dev), torch.randn(4, 32, 64, device=dev)
    opt = gemmfuse.optimize(model, (x,)) if how == "optimize" else \
        torch.compile(model, backend="gemmfuse")
    assert_as_eager(model, opt, x)
    text = gemmfuse.explain(opt, print_it=False)
    for call in ("einsum", "baddbmm"):
        assert f"on gemmfuse's GEMM (gemmfuse.products.{call}; backward: dA on gemmfuse" in text, text
    assert "a label repeated within a term (a diagonal)" in text, text


@pytest.mark.parametrize("eq, a_shape, b_shape", [
    ("ij,jk->ik", (5, 7), (7, 3)),
    ("bij,bkj->bki", (2, 5, 7), (2, 3, 7)),
    ("bqhd,bkhd->bhqk", (2, 6, 3, 4), (2, 5, 3, 4)),
    ("abc,cbd->dba", (3, 4, 5), (5, 4, 2)),        # b a batch dim, c contracted, output permuted
    ("i,j->ij", (4,), (6,)),                       # an outer product: K = 1
    ("ij,ij->", (3, 4), (3, 4)),                   # a full contraction: M = N = 1
    ("bij,bjk->bik", (0, 3, 4), (0, 4, 2)),        # an empty batch
])
def test_einsum_as_one_product(eq, a_shape, b_shape):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(a_shape, generator=g), torch.randn(b_shape, generator=g)
    got, want = products.einsum(eq, a, b), torch.einsum(eq, a, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eq, a_shape, b_shape, why", [
    ("...ij,...jk->...ik", (2, 3, 4), (2, 4, 5), "an ellipsis"),
    ("ij,jk", (3, 4), (4, 5), "an implicit output"),
    ("ii,ij->ij", (3, 3), (3, 4), "a diagonal"),
    ("ij,jk->k", (3, 4), (4, 5), "summed over one operand only"),
    ("bij,bjk->bik", (1, 3, 4), (2, 4, 5), "different sizes"),
])
def test_einsums_the_plan_declines_run_as_torch_einsum(eq, a_shape, b_shape, why):
    from gemmfuse import einsum_plan
    assert why in einsum_plan.why_not(eq, a_shape, b_shape)
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    torch.testing.assert_close(products.einsum(eq, a, b), torch.einsum(eq, a, b))


def test_baddbmm_as_pytorch_with_beta_zero_and_nan_input():
    g = torch.Generator().manual_seed(3)
    inp = torch.full((2, 3, 5), float("nan"))
    b1, b2 = torch.randn(2, 3, 4, generator=g), torch.randn(2, 4, 5, generator=g)
    for beta, alpha in [(0, 1), (0, 0.5), (1, 1), (0.25, 3)]:
        i = inp if beta == 0 else torch.randn(3, 5, generator=g)  # broadcasts over the batch
        want = torch.baddbmm(i, b1, b2, beta=beta, alpha=alpha)
        torch.testing.assert_close(products.baddbmm(i, b1, b2, beta, alpha), want)

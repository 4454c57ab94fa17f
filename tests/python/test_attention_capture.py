"""SDPA calls in captured models (capture/attention.py, gemmfuse.attention): optimize() and
torch.compile(backend="gemmfuse") put gemmfuse.attention.scaled_dot_product_attention in place
of F.scaled_dot_product_attention where the kernels take the call, explain says so, and the
output and every gradient are within 1.25x eager fp32's error against float64. Calls the
kernels do not take (a mask, dropout, another dtype, the CPU without GEMMFUSE_ALWAYS_FUSE)
stay the model's own, with the reason. On the CPU the rewritten call runs PyTorch's SDPA (the
kernels are CUDA's), so there the tests check the rewrite; on a GPU, the kernels' numbers."""
import copy
import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.fx as fx
import torch.nn.functional as F

import gemmfuse
from gemmfuse import reports
from gemmfuse.attention import scaled_dot_product_attention
from conftest import HAVE_CUDA, needs_lib

pytestmark = [needs_lib, pytest.mark.usefixtures("fresh_dynamo")]
DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])
SLACK = 1e-7


class Block(nn.Module):
    """A causal self-attention block as GPT-2 writes it (qkv Linear, SDPA, projection)."""

    def __init__(self, d=128, heads=2, mask_T=0, mask_dtype=torch.bool, **sdpa_kw):
        super().__init__()
        self.d, self.heads, self.sdpa_kw = d, heads, sdpa_kw
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        m = torch.randn(mask_T, mask_T)
        self.mask = (m > 0 if mask_dtype == torch.bool else m) if mask_T else None

    def forward(self, x):  # torch.fx traces it (optimize()'s fx flavour)
        B, T, d, h = x.shape[0], x.shape[1], self.d, self.heads
        qkv = self.qkv(x).view(B, T, 3, h, d // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=self.mask,
                                           **self.sdpa_kw)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class WrittenOut(nn.Module):
    """minGPT's attention (bench/models.py's CausalSelfAttention): scores, a scale, the causal
    mask from a buffer, softmax, dropout of p = 0, @ v; dynamo captures it (x.size())."""

    def __init__(self, d=128, heads=2, T=96, mask="causal", scale=True):
        super().__init__()
        self.d, self.heads, self.scale = d, heads, scale
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop = nn.Dropout(0.0)
        m = torch.tril(torch.ones(T, T)) if mask == "causal" else (torch.rand(T, T) > 0.2).float()
        self.register_buffer("bias", m.view(1, 1, T, T), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(self.d, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1)
        if self.scale:
            att = att * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        return self.proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def outputs_and_grads(module, x):
    for p in module.parameters():
        p.grad = None
    xg = x.detach().clone().requires_grad_()
    y = module(xg)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y))
    return [y.detach(), xg.grad] + [p.grad for p in module.parameters()]


def assert_as_eager(model, opt, x):
    """opt's output and gradients against eager fp32's and a float64 copy's."""
    got = outputs_and_grads(opt, x)
    m64 = copy.deepcopy(model).double()
    ref64 = outputs_and_grads(m64, x.double())
    ref32 = outputs_and_grads(copy.deepcopy(model), x)
    for i, (g, e, w) in enumerate(zip(got, ref32, ref64)):
        assert rel(g, w) <= 1.25 * rel(e, w) + SLACK, (i, rel(g, w), rel(e, w))


def attention_nodes(opt) -> list:
    """The gemmfuse attention calls of an optimized module's graph (fx) or graphs (dynamo)."""
    graphs = [opt] if isinstance(opt, fx.GraphModule) else reports.compiled_graphs(opt)
    return [n for gm in graphs for n in gm.graph.nodes if n.target is scaled_dot_product_attention]


def model_and_input(dev, d=128, heads=2, T=96, seed=0, **kw):
    torch.manual_seed(seed)
    return Block(d, heads, **kw).to(dev), torch.randn(2, T, d, device=dev)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("kw", [{"is_causal": True}, {}, {"is_causal": True, "scale": 0.2}])
def test_optimize_takes_sdpa(dev, kw):
    model, x = model_and_input(dev, **kw)
    opt = gemmfuse.optimize(model, (x,))
    assert len(attention_nodes(opt)) == 1
    assert_as_eager(model, opt, x)
    text = gemmfuse.explain(opt, print_it=False)
    causal = " causal" if kw.get("is_causal") else ""
    assert f"attention: scaled_dot_product_attention [2x2x96x64]{causal} " \
           "(F.scaled_dot_product_attention) on gemmfuse's fp32 attention kernels" in text, text


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("how", ["optimize", "backend"])
def test_sdpa_with_a_mask_taken(dev, dtype, how):
    """An attention mask from the module (bool: attend where True; fp32: added to the scores)
    goes into gemmfuse's call: outputs and gradients as eager's against float64."""
    model, x = model_and_input(dev, mask_T=96, mask_dtype=dtype)
    model.mask = model.mask.to(dev)
    opt = gemmfuse.optimize(model, (x,)) if how == "optimize" else \
        torch.compile(model, backend="gemmfuse")
    assert_as_eager(model, opt, x)
    assert len(attention_nodes(opt)) == 1
    text = gemmfuse.explain(opt, print_it=False)
    name = str(dtype).replace("torch.", "")
    assert f"masked by a {name} mask [96, 96]" in text and "on gemmfuse's fp32 attention" in text, text


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("kw", [{}, {"fullgraph": True}, {"options": {"inductor": False}}])
def test_backend_takes_sdpa(dev, kw):
    model, x = model_and_input(dev, is_causal=True)
    compiled = torch.compile(model, backend="gemmfuse", **kw)
    assert_as_eager(model, compiled, x)
    assert len(attention_nodes(compiled)) >= 1
    assert "on gemmfuse's fp32 attention kernels" in gemmfuse.explain(compiled, print_it=False)


@pytest.mark.parametrize("kw,why", [
    ({"mask_T": 96, "is_causal": True}, "an attention mask with is_causal"),
    ({"dropout_p": 0.1}, "dropout_p 0.1"),
])
def test_calls_not_taken_keep_the_models_call(kw, why):
    model, x = model_and_input("cpu", **kw)
    opt = gemmfuse.optimize(model, (x,))
    assert not attention_nodes(opt)
    text = gemmfuse.explain(opt, print_it=False)
    assert "left to PyTorch: " + why in text, text


def test_bf16_and_the_cpu_keep_the_models_call(monkeypatch):
    model, x = model_and_input("cpu")
    opt = gemmfuse.optimize(copy.deepcopy(model).bfloat16(), (x.bfloat16(),))
    assert "left to PyTorch: q, k, v of torch.bfloat16, not fp32" in gemmfuse.explain(opt, print_it=False)
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    opt = gemmfuse.optimize(model, (x,))
    assert not attention_nodes(opt)
    assert "left to PyTorch: attention on cpu" in gemmfuse.explain(opt, print_it=False)


def test_tf32_precision_keeps_the_models_call():
    model, x = model_and_input("cpu")
    opt = gemmfuse.optimize(model, (x,), precision="tf32")
    assert not attention_nodes(opt)
    assert "left to PyTorch: tf32 precision" in gemmfuse.explain(opt, print_it=False)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("scale", [True, False])
def test_written_out_causal_attention_taken(dev, scale):
    torch.manual_seed(0)
    model, x = WrittenOut(scale=scale).to(dev), torch.randn(2, 96, 128, device=dev)
    for make in (lambda m: gemmfuse.optimize(m, (x,)), lambda m: torch.compile(m, backend="gemmfuse")):
        model = copy.deepcopy(model)
        opt = make(model)
        assert_as_eager(model, opt, x)
        nodes = attention_nodes(opt)  # one per graph dynamo made (inference, training)
        assert nodes and all(n.kwargs == {"is_causal": True, "scale": 64 ** -0.5 if scale else 1.0}
                             for n in nodes)
        text = gemmfuse.explain(opt, print_it=False)
        assert "causal (written out: q @ kᵀ, softmax, @ v) on gemmfuse's fp32 attention" in text, text


def test_written_out_other_mask_not_taken():
    torch.manual_seed(0)
    model, x = WrittenOut(mask="random"), torch.randn(2, 96, 128)
    opt = torch.compile(model, backend="gemmfuse")
    assert_as_eager(model, opt, x)
    assert not attention_nodes(opt)
    assert "left to Inductor: a mask that is not causal" in gemmfuse.explain(opt, print_it=False)


@pytest.mark.skipif(not HAVE_CUDA, reason="the choice is timed on a GPU")
def test_a_call_timed_slower_on_gemmfuse_stays_the_models(monkeypatch):
    """Timed once per shape (a stand-in timer: gemmfuse 2 ms, PyTorch 1 ms, forward and
    backward, as the parameters need grad): the model's own SDPA call stays, with the reason."""
    from gemmfuse import route_timer
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    monkeypatch.setattr(route_timer, "_timed", {})
    times = itertools.cycle([2.0, 1.0])  # each choice times gemmfuse's way, then PyTorch's
    monkeypatch.setattr(route_timer, "timer", lambda fn, dev: (fn(), next(times))[1])
    model, x = model_and_input("cuda", is_causal=True)
    opt = gemmfuse.optimize(model, (x,))
    assert not attention_nodes(opt)
    assert ("left to PyTorch: PyTorch timed faster at this shape (1.000 ms against gemmfuse's "
            "2.000 ms) (forward and backward)") in gemmfuse.explain(opt, print_it=False)


@pytest.mark.skipif(not HAVE_CUDA, reason="gemmfuse's attention kernels are CUDA's")
@pytest.mark.parametrize("shape,causal", [((2, 3, 1, 64), True), ((1, 2, 65, 64), False),
                                          ((0, 2, 64, 64), True), ((2, 2, 100, 96), True),
                                          ((1, 3, 130, 128), False)])
def test_the_call_as_eager_at_odd_shapes(shape, causal):
    """gemmfuse.attention.scaled_dot_product_attention on q, k, v made as models make them
    ([B, S, H, D] transposed: not contiguous): output and gradients against float64 within
    1.25x eager fp32's error (head dims 64, 96 and 128, both directions on gemmfuse's
    kernels); an empty batch gives empty results, as eager."""
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    B, H, S, D = shape
    q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g).transpose(1, 2).requires_grad_()
               for _ in range(3))
    go = torch.randn(shape, device="cuda", generator=g)
    got = scaled_dot_product_attention(q, k, v, is_causal=causal)
    got_grads = torch.autograd.grad(got, (q, k, v), go)
    eager = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    eager_grads = torch.autograd.grad(eager, (q, k, v), go)
    if B == 0:
        assert got.shape == eager.shape and all(t.numel() == 0 for t in got_grads)
        return
    d = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*d, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, d, go.double())
    for g_, e, w in zip((got, *got_grads), (eager, *eager_grads), (ref, *ref_grads)):
        if w.norm() == 0:  # S = 1: dq = dk = 0 exactly; dS = P (dP - delta) leaves rounding
            assert g_.abs().max() <= 1e-5 * go.abs().max() * v.abs().max()
            continue
        assert rel(g_.detach(), w) <= 1.25 * rel(e.detach(), w) + SLACK


def assert_same_nonfinite(got, want, what):
    """NaN where want is NaN, the same infinities, and finite values close."""
    for f in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(f(got), f(want)), (what, f.__name__, f(got).sum(), f(want).sum())
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4 * want[fin].abs().max())


@pytest.mark.skipif(not HAVE_CUDA, reason="gemmfuse's attention kernels are CUDA's")
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_inputs_as_pytorchs_math_path(causal):
    """NaN and infinities in q, k, v (one head each, others finite): the output as PyTorch's
    math path gives it (its NaN and infinities; eager's memory-efficient kernel skips masked key
    blocks, so its pattern depends on its tiles), and the gradients finite exactly where the
    math path's are."""
    g = torch.Generator(device="cuda").manual_seed(7 + causal)
    q, k, v = (torch.randn(2, 3, 70, 64, device="cuda", generator=g) for _ in range(3))
    k[0, 1, 10, 7] = math.inf
    q[1, 0, 30, 3], v[1, 0, 50, 1] = -math.inf, math.nan
    v[0, 2, 20, 5] = math.inf
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    go = torch.randn(q.shape, device="cuda", generator=g)
    got = scaled_dot_product_attention(q, k, v, is_causal=causal)
    got_grads = torch.autograd.grad(got, (q, k, v), go)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    want_grads = torch.autograd.grad(want, (q, k, v), go)
    assert_same_nonfinite(got.detach(), want.detach(), "output")
    for name, g_, w in zip("qkv", got_grads, want_grads):
        assert torch.equal(torch.isfinite(g_), torch.isfinite(w)), name


@pytest.mark.skipif(not HAVE_CUDA, reason="gemmfuse's attention kernels are CUDA's")
@pytest.mark.parametrize("kind", ["padding", "float", "a row masked throughout"])
def test_the_call_with_masks_as_eager(kind):
    """Masks as models pass them: a bool padding mask [B, 1, 1, S] (each sequence's last keys
    masked), an fp32 mask [S, S] added to the scores, a bool [S, S] with a query row masked
    throughout (eager's output there: 0 or NaN as it gives it). Outputs and gradients against
    float64 within 1.25x eager fp32's error, the non-finite pattern as eager's."""
    g = torch.Generator(device="cuda").manual_seed(3)
    B, H, S, D = 2, 3, 100, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g).requires_grad_() for _ in range(3))
    if kind == "padding":
        mask = (torch.arange(S, device="cuda") < torch.tensor([[S], [S - 30]], device="cuda"))
        mask = mask.view(B, 1, 1, S)
    elif kind == "float":
        mask = torch.randn(S, S, device="cuda", generator=g)
    else:
        mask = torch.rand(S, S, device="cuda", generator=g) > 0.3
        mask[17] = False
    go = torch.randn(B, H, S, D, device="cuda", generator=g)
    got = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got_grads = torch.autograd.grad(got, (q, k, v), go)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    eager_grads = torch.autograd.grad(eager, (q, k, v), go)
    assert_same_nonfinite(got.detach(), eager.detach(), "output")
    fin = torch.isfinite(eager).all(-1, keepdim=True).expand_as(eager)
    d = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*d, attn_mask=mask.double() if kind == "float" else mask)
    ref_grads = torch.autograd.grad(ref, d, go.double())
    for g_, e, w in zip((got, *got_grads), (eager, *eager_grads), (ref, *ref_grads)):
        g_, e, w = (t.detach()[fin] if t.shape == fin.shape else t.detach() for t in (g_, e, w))
        assert rel(g_, w) <= 1.25 * rel(e, w) + SLACK


class GroupedQuery(nn.Module):
    """Grouped-query attention as Llama writes it: 4 query heads share each of 2 key/value heads
    (SDPA's enable_gqa), causal."""

    def __init__(self, d=256, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * kv_heads * (d // heads))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, d = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("how", ["optimize", "backend"])
def test_grouped_query_attention_taken(dev, how):
    """k and v repeated to q's heads before gemmfuse's kernels (their gradients summed back by
    autograd): outputs and gradients as eager's against float64."""
    torch.manual_seed(0)
    model, x = GroupedQuery().to(dev), torch.randn(2, 96, 256, device=dev)
    opt = gemmfuse.optimize(model, (x,)) if how == "optimize" else \
        torch.compile(model, backend="gemmfuse")
    assert_as_eager(model, opt, x)
    assert len(attention_nodes(opt)) == 1
    text = gemmfuse.explain(opt, print_it=False)
    assert "causal with 2 key/value heads" in text and "on gemmfuse's fp32 attention" in text, text


class CrossAttention(nn.Module):
    """An encoder-decoder's cross-attention (T5's, Whisper's): queries from the decoder's x,
    keys and values from the encoder's memory of another length; a bool mask [Tq, Tk] or none,
    or the causal mask (key j hidden from query i where j > i)."""

    def __init__(self, d=128, heads=2, mask=None, causal=False):
        super().__init__()
        self.heads, self.hd, self.mask, self.causal = heads, d // heads, mask, causal
        self.q, self.kv, self.proj = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x, memory):
        B, T, d = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(memory).view(B, -1, 2, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("how", ["optimize", "backend"])
@pytest.mark.parametrize("kind", ["plain", "mask", "causal"])
def test_cross_attention_taken(dev, how, kind):
    """Queries and keys of two lengths (70 and 150): outputs and gradients (memory's included)
    as eager's against float64; explain names the keys' count."""
    torch.manual_seed(0)
    mask = (torch.rand(70, 150, device=dev) > 0.2) if kind == "mask" else None
    model = CrossAttention(mask=mask, causal=kind == "causal").to(dev)
    x, mem = torch.randn(2, 70, 128, device=dev), torch.randn(2, 150, 128, device=dev)
    opt = gemmfuse.optimize(model, (x, mem)) if how == "optimize" else \
        torch.compile(model, backend="gemmfuse")
    outs = []
    for m, xs in ((opt, (x, mem)), (model, (x, mem)), (copy.deepcopy(model).double(),
                                                        (x.double(), mem.double()))):
        a, b = (t.detach().clone().requires_grad_() for t in xs)
        y = m(a, b)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y))
        outs.append([y.detach(), a.grad, b.grad] + [p.grad for p in m.parameters()])
    for i, (g, e, w) in enumerate(zip(*outs)):
        assert rel(g, w) <= 1.25 * rel(e, w) + SLACK, (i, rel(g, w), rel(e, w))
    assert len(attention_nodes(opt)) == 1
    text = gemmfuse.explain(opt, print_it=False)
    assert "[2x2x70x64] over 150 keys" in text and "on gemmfuse's fp32 attention" in text, text

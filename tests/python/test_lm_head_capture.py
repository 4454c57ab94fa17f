"""optimize() on an LM head: a Linear whose logits only feed a cross-entropy loss becomes one
gemmfuse.linear_cross_entropy call (capture/lm_head.py), without the [M, V] logits. A small
GPT-like model (Embedding -> Linear+GELU -> LayerNorm -> lm_head -> loss, some targets
ignored): the loss and every parameter's gradient against float64 copies, within 1.25x eager
fp32's error; the Linear written as a module, F.linear or x @ W.t(); the loss as
F.cross_entropy, nn.CrossEntropyLoss (label smoothing, reduction "sum") or
F.nll_loss(F.log_softmax); not taken (with the reason in explain): logits also returned, a
class weight, bf16; three fused AdamW steps as eager."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gemmfuse
from gemmfuse.lm_head import linear_cross_entropy
from conftest import HAVE_CUDA, needs_lib, rel

pytestmark = needs_lib
DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])
SLACK = 1e-7
V, D = 61, 24


class TinyGPT(nn.Module):
    """Embedding -> Linear+GELU -> LayerNorm -> lm_head (no bias) -> a cross-entropy loss;
    `head`: how the lm_head Linear is written, `loss`: how the loss is."""

    def __init__(self, head="module", loss="F", return_logits=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.head, self.loss, self.return_logits = head, loss, return_logits
        self.crit = nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1, reduction="sum")
        self.register_buffer("class_weight", torch.rand(V) + 0.5)

    def logits(self, h):
        if self.head == "F.linear":
            return F.linear(h, self.lm_head.weight)
        if self.head == "matmul":
            return h @ self.lm_head.weight.t()
        return self.lm_head(h)

    def forward(self, idx, targets):
        logits = self.logits(self.ln(F.gelu(self.fc(self.emb(idx)))))
        t = targets.view(-1)
        if self.loss == "nll":
            loss = F.nll_loss(F.log_softmax(logits, dim=-1).reshape(-1, V), t, ignore_index=-1)
        elif self.loss == "module":
            loss = self.crit(logits.flatten(0, -2), t)
        elif self.loss == "weight":
            loss = F.cross_entropy(logits.view(-1, V), t, weight=self.class_weight, ignore_index=-1)
        else:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), t, ignore_index=-1)
        return (logits, loss) if self.return_logits else loss


def batch(dev, seed, B=3, T=7):
    """Fresh random token ids and targets, a few targets -1 (ignored)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (B, T), generator=g)
    t = torch.randint(0, V, (B, T), generator=g)
    t.view(-1)[torch.randperm(B * T, generator=g)[:4]] = -1
    return idx.to(dev), t.to(dev)


def model_on(dev, seed=0, **kw):
    torch.manual_seed(seed)
    m = TinyGPT(**kw)
    with torch.no_grad():  # logits of a few units: the softmax is not flat
        m.lm_head.weight.mul_(8)
    return m.to(dev)


def loss_and_grads(module, params, idx, t):
    """The loss (the last output) and the gradients of `params` (name -> parameter)."""
    for p in params.values():
        p.grad = None
    out = module(idx, t)
    loss = out[-1] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in params.items()}


def assert_as_eager(model, opt, idx, t):
    """opt's loss and gradients (on model's parameters) against eager fp32 and float64 copies
    of the model as it stands: within 1.25x eager's error + SLACK."""
    eager, m64 = copy.deepcopy(model), copy.deepcopy(model).double()
    got = loss_and_grads(opt, dict(model.named_parameters()), idx, t)
    ref32 = loss_and_grads(eager, dict(eager.named_parameters()), idx, t)
    ref64 = loss_and_grads(m64, dict(m64.named_parameters()), idx, t)
    e, e32 = rel(got[0], ref64[0]), rel(ref32[0], ref64[0])
    assert e <= 1.25 * e32 + SLACK, ("loss", e, e32)
    for n, g64 in ref64[1].items():
        e, e32 = rel(got[1][n], g64), rel(ref32[1][n], g64)
        assert e <= 1.25 * e32 + SLACK, (n, e, e32)


def lce_nodes(opt):
    return [n for n in opt.graph.nodes if n.target is linear_cross_entropy]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("head,loss", [("module", "F"), ("F.linear", "F"), ("matmul", "F"),
                                       ("module", "module"), ("module", "nll")])
def test_lm_head_fused_as_eager(dev, head, loss):
    model = model_on(dev, head=head, loss=loss)
    opt = gemmfuse.optimize(model, batch(dev, 1))
    (node,) = lce_nodes(opt)
    assert not any(n.op == "call_module" and n.target == "lm_head" for n in opt.graph.nodes)
    if loss == "module":
        assert node.kwargs["label_smoothing"] == 0.1 and node.kwargs["reduction"] == "sum"
    assert node.kwargs["ignore_index"] == -1
    for seed in (2, 3):  # fresh inputs, another batch shape
        assert_as_eager(model, opt, *batch(dev, seed, B=2 + seed))
    text = gemmfuse.explain(opt, print_it=False)
    name = {"module": "lm_head", "F.linear": "linear", "matmul": "matmul"}[head]
    assert f"LM head + cross-entropy: {name} [{D} → {V}]" in text, text
    assert "fused (gemmfuse.linear_cross_entropy" in text and "chunks of" in text, text


@pytest.mark.parametrize("dev", DEVICES)
def test_logits_returned_not_taken(dev):
    """The model returns (logits, loss): the logits are needed, the head is not fused, and
    the outputs are still as eager's; explain says why."""
    model = model_on(dev, return_logits=True)
    idx, t = batch(dev, 4)
    opt = gemmfuse.optimize(model, (idx, t))
    assert not lce_nodes(opt)
    logits, ref32 = opt(idx, t)[0], model(idx, t)[0]
    ref64 = copy.deepcopy(model).double()(idx, t)[0]
    assert logits.shape == (3, 7, V)
    assert rel(logits, ref64) <= 1.25 * rel(ref32, ref64) + SLACK
    assert_as_eager(model, opt, idx, t)
    text = gemmfuse.explain(opt, print_it=False)
    assert "lm_head" in text and "left to PyTorch: the logits also returned" in text, text


@pytest.mark.parametrize("dev, loss, why", [
    ("cpu", "F", "on the CPU"),  # faster in PyTorch there, unless GEMMFUSE_ALWAYS_FUSE=1
    *[(d, "weight", "a class weight is given") for d in DEVICES]])
def test_heads_left_to_pytorch(dev, loss, why, monkeypatch):
    """Heads gemmfuse does not take run as eager's, and explain says why."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0" if why == "on the CPU" else "1")
    model = model_on(dev, loss=loss)
    idx, t = batch(dev, 5)
    opt = gemmfuse.optimize(model, (idx, t))
    assert not lce_nodes(opt)
    assert_as_eager(model, opt, idx, t)
    assert f"left to PyTorch: {why}" in gemmfuse.explain(opt, print_it=False)


@pytest.mark.parametrize("dev", DEVICES)
def test_bf16_not_taken(dev):
    model = model_on(dev).to(torch.bfloat16)
    idx, t = batch(dev, 6)
    opt = gemmfuse.optimize(model, (idx, t))
    assert not lce_nodes(opt)
    got = opt(idx, t)
    assert got.dtype == torch.bfloat16 and torch.equal(got, model(idx, t))
    assert "fuses fp32 only" in gemmfuse.explain(opt, print_it=False)


@pytest.mark.parametrize("dev", DEVICES)
def test_adamw_steps_as_eager(dev):
    """Three fused AdamW steps on the optimized model's parameters; at each step the loss and
    the gradients against eager fp32 and float64 copies of the model as it stands (the op
    must see the weights the optimizer wrote)."""
    model = model_on(dev)
    opt = gemmfuse.optimize(model, batch(dev, 7))
    assert lce_nodes(opt)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    before = model.lm_head.weight.detach().clone()
    for step in range(3):
        assert_as_eager(model, opt, *batch(dev, 10 + step))
        adam.step()
    assert not torch.equal(before, model.lm_head.weight)


class Head(nn.Module):
    """A Linear on [M, K] rows and a cross-entropy loss, the logits used as `mode` says."""

    def __init__(self, mode):
        super().__init__()
        self.lin, self.mode = nn.Linear(D, V), mode

    def forward(self, x, t):
        y = self.lin(x)
        if self.mode == "probabilities":
            return F.cross_entropy(y, t.softmax(-1))
        if self.mode == "read":
            return F.cross_entropy(y, t) + y.square().mean()
        return F.cross_entropy(y, t, reduction="none")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("mode,why", [("none", ""),
                                      ("probabilities", "not one class index per row"),
                                      ("read", "the logits also read by")])
def test_two_d_rows_and_reasons(dev, mode, why):
    """Logits [M, V] with no flatten (reduction "none": a loss per row, with bias); probability
    targets and logits read by another node are left to PyTorch with the reason. Values and
    gradients as eager's."""
    torch.manual_seed(8)
    model = Head(mode).to(dev)
    x = torch.randn(9, D, device=dev)
    t = torch.randn(9, V, device=dev) if mode == "probabilities" else torch.randint(0, V, (9,), device=dev)
    opt = gemmfuse.optimize(model, (x, t))
    assert bool(lce_nodes(opt)) == (not why)
    text = gemmfuse.explain(opt, print_it=False)
    assert (why or "fused (gemmfuse.linear_cross_entropy") in text, text
    m64 = copy.deepcopy(model).double()
    xs = [x.clone().requires_grad_() for _ in range(2)] + [x.double().requires_grad_()]
    outs = [f(xi, t if mode != "probabilities" else t.to(xi.dtype))
            for f, xi in zip((opt, copy.deepcopy(model), m64), xs)]
    gy = torch.rand(outs[0].shape, device=dev) + 0.5
    for o, xi in zip(outs, xs):
        (o * gy.to(o.dtype)).sum().backward()
    assert outs[0].shape == outs[2].shape
    for a, b, r in [(outs[0], outs[1], outs[2]), (xs[0].grad, xs[1].grad, xs[2].grad)]:
        assert rel(a, r) <= 1.25 * rel(b, r) + SLACK

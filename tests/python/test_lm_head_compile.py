"""torch.compile(model, backend="gemmfuse") on an LM head: the Linear and its cross-entropy loss
in dynamo's graph (the weight a placeholder) become one gemmfuse.linear_cross_entropy call
before the chain finder runs, as in optimize() (test_lm_head_capture.py's tiny GPT); Inductor
(through AOTAutograd) compiles the rest. The loss and every gradient against float64 within
1.25x eager fp32's error, explain's line, three fused AdamW steps, fullgraph=True, dynamic
shapes, the runtimes flavour (inductor=False), and heads left to Inductor with the reason
(the logits returned; the CPU without GEMMFUSE_ALWAYS_FUSE)."""
import pytest
import torch

import gemmfuse
from gemmfuse import reports
from gemmfuse.lm_head import linear_cross_entropy
from conftest import needs_lib
from test_lm_head_capture import D, DEVICES, V, assert_as_eager, batch, model_on

pytestmark = [needs_lib, pytest.mark.usefixtures("fresh_dynamo")]


def lce_nodes(compiled) -> list:
    """The linear_cross_entropy calls of every graph the backend rewrote for `compiled`."""
    return [n for gm in reports.compiled_graphs(compiled) for n in gm.graph.nodes
            if n.target is linear_cross_entropy]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("head,loss", [("module", "F"), ("matmul", "F"), ("module", "module"),
                                       ("module", "nll")])
def test_backend_lm_head_fused_as_eager(dev, head, loss):
    model = model_on(dev, head=head, loss=loss)
    compiled = torch.compile(model, backend="gemmfuse")
    for seed in (2, 3):  # another batch shape: dynamo compiles again (dynamic shapes)
        assert_as_eager(model, compiled, *batch(dev, seed, B=2 + seed))
    nodes = lce_nodes(compiled)
    assert len(nodes) == len(reports.compiled_graphs(compiled)) >= 1
    assert all(n.kwargs["ignore_index"] == -1 for n in nodes)
    if loss == "module":
        assert nodes[0].kwargs["label_smoothing"] == 0.1 and nodes[0].kwargs["reduction"] == "sum"
    text = gemmfuse.explain(compiled, print_it=False)
    form = "@ with the weight transposed" if head == "matmul" else "F.linear"
    assert f"LM head + cross-entropy: logits [{D} → {V}] ({form}," in text, text
    assert "fused (gemmfuse.linear_cross_entropy" in text and "chunks of" in text, text


@pytest.mark.parametrize("dev", DEVICES)
def test_backend_adamw_steps_as_eager(dev):
    """Three fused AdamW steps: each step's loss and gradients as eager's on the model as it
    stands (the compiled graph's op sees the weights the optimizer wrote)."""
    model = model_on(dev)
    compiled = torch.compile(model, backend="gemmfuse")
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    before = model.lm_head.weight.detach().clone()
    for step in range(3):
        assert_as_eager(model, compiled, *batch(dev, 10 + step))
        adam.step()
    assert lce_nodes(compiled)
    assert not torch.equal(before, model.lm_head.weight)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("kw", [{"fullgraph": True}, {"dynamic": True},
                                {"options": {"inductor": False}}])
def test_backend_lm_head_compile_variants(dev, kw):
    """fullgraph=True, dynamic=True and the runtimes flavour (no Inductor) fuse the head too."""
    model = model_on(dev)
    compiled = torch.compile(model, backend="gemmfuse", **kw)
    assert_as_eager(model, compiled, *batch(dev, 4))
    assert lce_nodes(compiled)
    if "dynamic" in kw:  # another shape, the same graph
        assert_as_eager(model, compiled, *batch(dev, 5, B=5, T=3))
        assert len(reports.compiled_graphs(compiled)) == 1


@pytest.mark.parametrize("dev", DEVICES)
def test_backend_logits_returned_not_taken(dev):
    """(logits, loss) returned: the head is left to Inductor, with the reason; the outputs
    and gradients are still as eager's."""
    model = model_on(dev, return_logits=True)
    compiled = torch.compile(model, backend="gemmfuse")
    idx, t = batch(dev, 6)
    assert_as_eager(model, compiled, idx, t)
    assert not lce_nodes(compiled)
    text = gemmfuse.explain(compiled, print_it=False)
    assert "left to Inductor: the logits also returned, outside the loss" in text, text


def test_backend_cpu_head_left_to_inductor(monkeypatch):
    """On the CPU without GEMMFUSE_ALWAYS_FUSE the head stays unfused (the rule optimize()
    follows: capture/lm_head.py's left_unfused_on)."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    model = model_on("cpu")
    compiled = torch.compile(model, backend="gemmfuse")
    assert_as_eager(model, compiled, *batch("cpu", 7))
    assert not lce_nodes(compiled)
    assert "left to Inductor: on the CPU" in gemmfuse.explain(compiled, print_it=False)

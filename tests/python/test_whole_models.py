"""optimize() takes whole models: every way a Linear is written is captured, chains that share
an input or meet downstream never break it, and a model torch.fx cannot trace is captured
through dynamo with the same API (signature, state, explain, pickling)."""
import copy
import inspect
import pickle

import pytest
import torch
import torch.nn as nn

import gemmfuse
from bench.models import GPTBlock
from gemmfuse.dynamo_module import GemmfuseDynamoModule
from conftest import needs_lib

pytestmark = needs_lib


class Forms(nn.Module):
    """Each way of writing a Linear, each feeding its own chain."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(12, 8) / 3)   # [out, in]
        self.V = nn.Parameter(torch.randn(8, 12) / 3)   # [in, out]
        self.b = nn.Parameter(torch.randn(12))
        self.fc = nn.Linear(8, 12)

    def forward(self, x):
        outs = [
            torch.relu(x @ self.W.T),
            torch.sigmoid(torch.matmul(x, self.W.t()) + self.b),   # bias added after
            torch.tanh(x.mm(self.W.transpose(0, 1))),
            torch.addmm(self.b, x, self.V).softmax(-1),
            (x @ self.V).sum(-1, keepdim=True) / 2,                # weight stored [in, out]
            torch.nn.functional.linear(x, self.W, self.b).clamp(-1, 1),
            torch.relu(self.fc(x)),
        ]
        return torch.cat([o.expand(-1, 12) for o in outs], dim=-1)


def test_every_linear_form_is_captured():
    torch.manual_seed(0)
    model, x = Forms(), torch.randn(5, 8)
    opt = gemmfuse.optimize(model, (x,))
    rts = gemmfuse.runtimes(opt)
    assert len(rts) == 7, gemmfuse.explain(opt, print_it=False)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-6)
    assert all(rt.fused_calls == 1 for rt in rts)
    text = gemmfuse.explain(opt, print_it=False)
    assert "with the weight [in, out]" in text and "with the weight transposed" in text
    assert "linear in=8 out=12 bias=1\nsigmoid" in text.replace("    ", "")  # `+ b` became the bias


def test_weight_stored_in_out_trains_after_a_no_grad_call():
    """The [N, K] copy of a weight stored [in, out] made under no_grad is not reused while
    autograd records: W still gets its gradient."""
    torch.manual_seed(2)
    model, x = Forms(), torch.randn(5, 8)
    eager = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad():
        opt(x)
    opt(x).sum().backward()
    eager(x).sum().backward()
    torch.testing.assert_close(model.V.grad, eager.V.grad, rtol=1e-4, atol=1e-5)


class Meet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        return torch.relu(self.a(x)) + torch.sigmoid(self.b(x)) * self.a(x).sum(-1, keepdim=True)


def test_chains_sharing_an_input_and_meeting_downstream():
    torch.manual_seed(1)
    model, x = Meet(), torch.randn(4, 16)
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-6)
    assert len(gemmfuse.runtimes(opt)) == 3


def test_a_model_fx_cannot_trace_is_captured_through_dynamo():
    torch.manual_seed(2)
    model, x = GPTBlock(n_embd=32, n_head=4), torch.randn(2, 6, 32)
    ref = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, (x,))
    assert isinstance(opt, GemmfuseDynamoModule)
    assert list(opt.state_dict()) == list(model.state_dict())
    assert inspect.signature(opt.forward) == inspect.signature(model.forward)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x), rtol=1e-5, atol=1e-5)
    text = gemmfuse.explain(opt, print_it=False)
    assert "GPTBlock was captured through torch.compile" in text and "not torch.fx" in text
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert text.count("FUSED") >= len(linears), text
    clone = pickle.loads(pickle.dumps(opt))
    with torch.no_grad():
        torch.testing.assert_close(clone(x), ref(x), rtol=1e-5, atol=1e-5)
    opt.eval()
    assert not model.training and not model.attn.training


@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 8)])
def test_mm_and_addmm_keep_pytorch_s_rules(shape):
    """torch.mm/addmm take 2-d inputs only: a 3-d input is left to PyTorch, which raises."""
    class MM(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.randn(6, 8))

        def forward(self, x):
            return torch.relu(torch.mm(x, self.W.t()))

    model, x = MM(), torch.randn(*shape)
    if len(shape) == 3:
        with pytest.raises(RuntimeError):
            model(x)
        return
    opt = gemmfuse.optimize(model, (x,))
    assert len(gemmfuse.runtimes(opt)) == 1
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))

"""What tracing reads from the model (numbers in its code, hyper-parameters of fused modules,
training flags its code branches on, its submodules) is followed after optimize: a change
makes the optimized module trace the model again, so it never computes with a stale value."""
import copy

import pytest
import torch
import torch.nn as nn

import gemmfuse
from conftest import needs_lib

pytestmark = needs_lib


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)
        self.act = nn.LeakyReLU(0.1)
        self.gelu = nn.GELU()
        self.scale = 2.0
        self.bias_shift = 0.5

    def forward(self, x):
        y = self.gelu(self.act(self.fc(x)) * self.scale + self.bias_shift)
        if self.training:
            y = y * 3.0
        return torch.softmax(y, dim=-1)


def _check(opt, model, x, retraced):
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-6)
    assert opt._gemmfuse.retraced == retraced


def test_numbers_and_hyper_parameters_are_followed():
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(8, 24)
    opt = gemmfuse.optimize(model, (x,))
    assert gemmfuse.runtimes(opt), "nothing fused: this test would check nothing"
    _check(opt, model, x, [])
    model.scale = 3.5                      # a number the model's code reads
    _check(opt, model, x, ["Scaled.scale"])
    opt.bias_shift = -1.0                  # written through the optimized module
    assert model.bias_shift == -1.0
    _check(opt, model, x, ["Scaled.scale", "Scaled.bias_shift"])
    model.act.negative_slope = 0.3         # a fused module's hyper-parameter
    model.gelu.approximate = "tanh"
    _check(opt, model, x, ["Scaled.scale", "Scaled.bias_shift", "act.negative_slope"])
    with torch.no_grad():
        opt(x)
    assert len(opt._gemmfuse.retraced) == 3 and gemmfuse.runtimes(opt)[0].fused_calls >= 2
    text = gemmfuse.explain(opt, print_it=False)
    assert "traced again" in text and "act.negative_slope" in text


def test_training_flag_read_by_the_code_is_followed():
    torch.manual_seed(1)
    model, x = Scaled(), torch.randn(8, 24)
    opt = gemmfuse.optimize(model, (x,))
    _check(opt, model, x, [])
    opt.eval()                             # the model's code branches on self.training
    assert not model.training and not model.fc.training
    _check(opt, model, x, ["Scaled.training"])
    model.train()
    _check(opt, model, x, ["Scaled.training", "Scaled.training"])


@pytest.mark.parametrize("what", ["momentum", "eps", "layer_norm_eps", "groups"])
def test_norm_hyper_parameters(what):
    torch.manual_seed(2)
    bn = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU())
    ln = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32))
    gn = nn.Sequential(nn.Linear(16, 32), nn.GroupNorm(4, 32))
    model = {"momentum": bn, "eps": bn, "layer_norm_eps": ln, "groups": gn}[what]
    ref = copy.deepcopy(model)
    x = torch.randn(12, 16)
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad():
        for step in range(3):
            if step == 1:
                for m in (model, ref):
                    if what == "momentum":
                        m[1].momentum = 0.7
                    elif what == "groups":
                        m[1].num_groups = 8
                    else:
                        m[1].eps = 0.5
            torch.testing.assert_close(opt(x), ref(x), rtol=1e-5, atol=1e-5)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # running statistics too
    assert len(opt._gemmfuse.retraced) == 1


def test_unchanged_model_is_not_traced_again():
    """train()/eval() on a model whose code does not read the flag: the BatchNorm's spec for
    each flag is ready, nothing is traced again."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Softmax(dim=1))
    x = torch.randn(12, 16)
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad():
        for mode in (False, True, False):
            opt.train(mode)
            torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-6)
    assert opt._gemmfuse.retraced == []

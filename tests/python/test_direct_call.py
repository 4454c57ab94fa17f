"""The direct call path of modules whose whole forward is one fused chain (gemmfuse/direct.py):
it must behave exactly as the normal module call, and step aside whenever it could differ."""
import copy

import pytest
import torch
import torch.nn as nn

import gemmfuse
from conftest import assert_close64, double_ref, make_seed, needs_lib

pytestmark = needs_lib


def _opt(mid="m99"):
    model, inputs = make_seed(mid)
    return model, gemmfuse.optimize(model, inputs), inputs[0]


@pytest.mark.parametrize("mid", ["m18", "m84", "m99"])
def test_direct_path_installed_and_correct(mid):
    model, opt, x = _opt(mid)
    assert "_gemmfuse_direct" in opt.__dict__
    rt = gemmfuse.runtimes(opt)[0]
    ref = double_ref(model)
    with torch.no_grad():
        out = opt(x)
    assert rt.fused_calls == 1
    assert_close64(out, ref(x.double()), what=mid)


def test_not_installed_when_forward_does_more():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 6)

        def forward(self, x):
            return torch.softmax(self.l(x), dim=1) + 1.0 + x.sum()

    m = M()
    opt = gemmfuse.optimize(m, torch.rand(3, 8))
    rts = gemmfuse.runtimes(opt)
    assert rts, "the Linear + softmax was not fused, so this test would check nothing"
    assert "_gemmfuse_direct" not in opt.__dict__
    x = torch.rand(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x))
    assert rts[0].fused_calls == 1


def _count_forward_calls(opt) -> list:
    """Counts calls of opt's generated forward (its class is opt's own): the normal path calls
    it, the direct path does not."""
    calls = []
    cls = type(opt)
    forward = cls.forward
    cls.forward = lambda self, *args, **kwargs: (calls.append(1), forward(self, *args, **kwargs))[1]
    return calls


def test_hooks_and_kwargs_take_the_normal_path():
    model, opt, x = _opt()
    with torch.no_grad():
        base = opt(x)
        seen = []
        h = opt.register_forward_hook(lambda mod, args, out: (seen.append(1), out * 2)[1])
        torch.testing.assert_close(opt(x), base * 2)
        assert seen == [1]
        h.remove()
        pre = opt.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
        torch.testing.assert_close(opt(x), opt.forward(x * 0.5))
        pre.remove()
        g = nn.modules.module.register_module_forward_hook(lambda mod, args, out: out + 1)
        try:  # a global hook runs on every module, the fused chain's ones too, as in eager
            torch.testing.assert_close(opt(x), model(x))
            assert not torch.allclose(opt(x), base + 1)
        finally:
            g.remove()
        torch.testing.assert_close(opt(x=x), base)
        torch.testing.assert_close(opt(x), base)


def test_replaced_submodule_and_parameters_are_followed():
    """A new weight is read at the next call (direct path); a replaced submodule is something
    tracing read, so the module traces the model again and keeps computing what it does."""
    model, opt, x = _opt()
    calls = _count_forward_calls(opt)
    with torch.no_grad():
        model.linear.weight = nn.Parameter(torch.randn_like(model.linear.weight) * 0.01)
        assert_close64(opt(x), double_ref(model)(x.double()), what="new weight")
        assert calls == [] and opt._gemmfuse.retraced == []
        new = nn.Linear(model.linear.in_features, model.linear.out_features)
        opt.linear = new  # the model's own children: both modules see it
        assert model.linear is new
        assert_close64(opt(x), double_ref(model)(x.double()), what="new Linear")
        assert opt._gemmfuse.retraced == ["M99.linear (submodule)"]
        assert "_gemmfuse_direct" in opt.__dict__ and gemmfuse.runtimes(opt)[0].fused_calls == 1

        class MyLinear(nn.Linear):
            pass

        model.linear = MyLinear(model.linear.in_features, model.linear.out_features)
        assert_close64(opt(x), double_ref(model)(x.double()), what="Linear subclass")
        assert len(opt._gemmfuse.retraced) == 2


def test_deepcopy_keeps_working_and_independent():
    model, opt, x = _opt("m84")
    c = copy.deepcopy(opt)
    with torch.no_grad():
        a, b = opt(x), c(x)
    torch.testing.assert_close(a, b)
    assert c.bn.running_mean is not opt.bn.running_mean
    assert int(c.bn.num_batches_tracked) == 1 and int(opt.bn.num_batches_tracked) == 1

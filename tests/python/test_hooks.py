"""Forward hooks and pre-hooks on a module a chain replaces run as in eager: while one exists
the chain runs in PyTorch (its modules called, hooks and all), and explain says so."""
import pytest
import torch
import torch.nn as nn

import gemmfuse
from conftest import make_seed, needs_lib

pytestmark = needs_lib


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Softmax(dim=-1)), torch.randn(6, 16)


@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_forward_hooks_on_chain_modules_run(before, which):
    model, x = _model()
    seen = []

    def hook(mod, args, out):
        seen.append(type(mod).__name__)
        return out * 2

    h = model[which].register_forward_hook(hook) if before else None
    opt = gemmfuse.optimize(model, (x,))
    if not before:
        h = model[which].register_forward_hook(hook)
    with torch.no_grad():
        ref = model(x)
        got = opt(x)
    torch.testing.assert_close(got, ref)
    assert len(seen) == 2  # once in eager, once in the optimized module
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.fused_calls == 0 and any("hooks on the module" in r for r in rt.fallbacks)
    assert "hooks on the module" in gemmfuse.explain(opt, print_it=False)
    h.remove()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-6)
    assert rt.fused_calls == 1  # fused again once the hook is gone


def test_pre_hook_changes_the_input_as_in_eager():
    model, x = _model()
    opt = gemmfuse.optimize(model, (x,))
    model[0].register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_global_hook_runs_on_every_module():
    model, inputs = make_seed("m84")
    opt = gemmfuse.optimize(model, inputs)
    names = []
    g = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: names.append(type(mod).__name__))
    try:
        with torch.no_grad():
            opt(*inputs)
    finally:
        g.remove()
    assert {"Linear", "BatchNorm1d"} <= set(names)

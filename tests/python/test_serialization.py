"""An optimized module survives copy.deepcopy, pickle and torch.save/torch.load: the copy runs
fused, computes what the model computes, and its state_dict loads into the model's class."""
import copy
import io
import pickle

import pytest
import torch

import gemmfuse
from conftest import make_seed, needs_lib, seed_ids

pytestmark = needs_lib


def _torch_roundtrip(opt):
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o)),
          "torch.save": _torch_roundtrip}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("mid", seed_ids())
def test_copies_run_fused_and_match(mid, how):
    model, inputs = make_seed(mid)
    opt = gemmfuse.optimize(model, inputs)
    with torch.no_grad():
        opt(*inputs)                      # state (running statistics) moves before the copy
        twin = copy.deepcopy(model)       # the eager reference, from the same state
        clone = COPIES[how](opt)
        before = [rt.fused_calls for rt in gemmfuse.runtimes(clone)]
        x = torch.rand_like(inputs[0])
        torch.testing.assert_close(clone(x), twin(x), rtol=1e-5, atol=1e-6)
        for p in model.parameters():  # the original changes; the copy reads its own modules
            p.mul_(2)
        torch.testing.assert_close(clone(x), twin(x), rtol=1e-5, atol=1e-6)
    after = [rt.fused_calls for rt in gemmfuse.runtimes(clone)]
    assert after and all(a == b + 2 for a, b in zip(after, before)), (before, after)
    assert list(clone.state_dict()) == list(model.state_dict())
    for a, b in zip(clone.state_dict().values(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fresh = make_seed(mid, seed=7)[0]
    fresh.load_state_dict(clone.state_dict())  # into the original class
    assert not {id(p) for p in clone.parameters()} & {id(q) for q in model.parameters()}

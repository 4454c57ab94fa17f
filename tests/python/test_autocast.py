"""Under torch.autocast a chain returns eager's output dtype and a result as accurate as
eager's: on the CPU it runs in PyTorch under the same autocast; on CUDA fused in the autocast
dtype (its first call at a shape runs in PyTorch to learn eager's output dtype)."""
import pytest
import torch
import torch.nn as nn

import gemmfuse
from conftest import make_seed, needs_cuda, needs_lib, rel

pytestmark = needs_lib


class Head(nn.Module):
    def __init__(self, last):
        super().__init__()
        self.fc = nn.Linear(64, 96)
        self.last = last

    def forward(self, x):
        y = torch.nn.functional.gelu(self.fc(x))
        return torch.softmax(y, dim=-1) if self.last == "softmax" else y * 2.0


@pytest.mark.parametrize("last", ["softmax", "scale"])
def test_cpu_autocast_matches_eager(last):
    torch.manual_seed(0)
    model, x = Head(last), torch.randn(16, 64)
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = model(x), opt(x)
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mid", ["m22", "m84", "m94", "m99"])
def test_cuda_autocast_dtype_and_accuracy(mid, dtype):
    model, inputs = make_seed(mid, batch=64, k=256, n=256, device="cuda")
    x = inputs[0]
    opt = gemmfuse.optimize(model, inputs)
    ref64 = [None]
    with torch.no_grad():
        import copy
        m64 = copy.deepcopy(model).double()
        with torch.autocast("cuda", dtype=dtype):
            eager = model(x)
            opt(x)                      # learns eager's output dtype
            got = opt(x)
        ref64[0] = m64(x.double())
    assert got.dtype == eager.dtype
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.fused_calls >= 1
    assert rel(got, ref64[0]) <= 1.25 * rel(eager, ref64[0]) + 1e-6

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
@pytest.mark.parametrize("case", ["m84", "m99", "gelu_scale", "relu"])
def test_cuda_autocast_dtype_and_accuracy(case, dtype):
    """A chain whose eager output under autocast is 16-bit runs fused, as accurate as eager;
    one that ends in an op autocast runs in fp32 (softmax, norms) runs in PyTorch."""
    import copy
    if case in ("m84", "m99"):
        model, (x,) = make_seed(case, batch=64, k=256, n=256, device="cuda")
    else:
        torch.manual_seed(4)
        model = (Head("scale") if case == "gelu_scale"
                 else nn.Sequential(nn.Linear(64, 96), nn.ReLU())).cuda()
        x = torch.randn(64, 64, device="cuda")
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad():
        m64 = copy.deepcopy(model).double()
        with torch.autocast("cuda", dtype=dtype):
            eager = model(x)
            opt(x)                      # learns eager's output dtype
            got = opt(x)
        ref = m64(x.double())
    assert got.dtype == eager.dtype
    (rt,) = gemmfuse.runtimes(opt)
    if eager.dtype == torch.float32:
        assert rt.fused_calls == 0
        torch.testing.assert_close(got, eager)
    else:
        assert rt.fused_calls >= 1
        assert rel(got, ref) <= 1.25 * rel(eager, ref) + 1e-6

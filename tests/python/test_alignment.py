"""Any alignment, K, stride or storage offset of x, W and bias: the chain runs (another kernel
where the fast one needs 16-byte rows) and computes what eager computes; never an error where
eager works."""
import pytest
import torch
import torch.nn as nn

import gemmfuse
from conftest import HAVE_CUDA, is_sm90, needs_lib

pytestmark = needs_lib

DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])
MODES = ["fp32", "fast", "tf32", "bf16"]


def _view_at(t: torch.Tensor, offset: int) -> torch.Tensor:
    """The same values in a tensor whose storage begins `offset` elements earlier (so its data
    pointer is off a 16-byte boundary for odd offsets)."""
    flat = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    flat[offset:] = t.reshape(-1)
    return flat[offset:].view(t.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [256, 259])
def test_offset_views_and_odd_k(device, mode, k):
    torch.manual_seed(k)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model = nn.Sequential(nn.Linear(k, 136), nn.GELU(), nn.Softmax(dim=-1)).to(device, dtype)
    x = torch.rand(80, k, device=device, dtype=dtype)
    opt = gemmfuse.optimize(model, (x,), precision="fp32" if mode == "bf16" else mode)
    with torch.no_grad():
        model[0].weight = nn.Parameter(_view_at(model[0].weight.detach(), 1))
        model[0].bias = nn.Parameter(_view_at(model[0].bias.detach(), 3))
        xs = [x, _view_at(x, 1), torch.rand(80, 2 * k, device=device, dtype=dtype)[:, ::2]]
        for xi in xs:
            eager = model(xi)
            got = opt(xi)
            tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else (
                dict(rtol=1e-3, atol=1e-4) if mode == "tf32" else dict(rtol=1e-4, atol=1e-5))
            torch.testing.assert_close(got, eager, **tol)
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.fused_calls + sum(rt.fallbacks.values()) == 3


@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("scale", [1e4, 1e8, 1e20, 1e30])
@pytest.mark.parametrize("m,n", [(512, 1024), (1024, 4096)], ids=["row-pass", "fused-kernel"])
def test_bf16_softmax_chain_is_finite_where_eager_is(scale, m, n):
    """Linear -> gelu -> softmax in bf16 with pre-activations up to ~1e30: finite wherever eager
    is, and as close to the float64 result of the same bf16 model as eager (eager rounds the
    Linear's output to bf16, which turns near-ties of huge logits into exact ones; the fused
    kernel keeps them apart, as float64 does). 1024 x 4096 on an sm90 GPU runs the fused GEMM
    + softmax kernel (enough tiles to fill it), 512 x 1024 the GEMM and a row pass."""
    import copy
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(512, n), nn.GELU(), nn.Softmax(dim=-1)).cuda().bfloat16()
    x = (torch.rand(m, 512, device="cuda") * scale).bfloat16()
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad():
        eager, got = model(x), opt(x)
        ref = copy.deepcopy(model).double()(x.double())
    finite = torch.isfinite(eager).all(dim=-1)
    assert finite.any()
    assert torch.isfinite(got[finite]).all(), "NaN or inf rows where eager is finite"
    err = lambda out: float((out[finite].double() - ref[finite]).norm() / ref[finite].norm())  # noqa: E731
    assert err(got) <= 1.25 * err(eager) + 1e-3, (err(got), err(eager))
    if n == 4096 and is_sm90():
        text = gemmfuse.explain(opt, print_it=False)
        assert "run as one sm90 kernel" in text, text

"""Training on CUDA: every seed model's gradients (x, W, b and every parameter the chain reads)
in every mode against float64, each as accurate as eager's in the same run: `fp32` at most
1.25x eager fp32's error, `fast` within atol = rtol = 1e-4 of float64 where eager fp32 is,
`tf32` at most 2x eager's with TF32 (both round to TF32), bf16 models at most 1.25x eager
bf16's. The running statistics after the step match eager's."""
import copy

import pytest
import torch

import gemmfuse
from gemmfuse import route_timer
from conftest import make_seed, needs_cuda, needs_lib, seed_ids

pytestmark = [needs_lib, needs_cuda]


def _step(model, x, gy, tf32=False):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        x = x.clone().requires_grad_()
        y = model(x)
        y.backward(gy.to(y.dtype))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("mode", ["fp32", "fast", "tf32", "bf16"])
@pytest.mark.parametrize("mid", seed_ids())
def test_seed_model_gradients(mid, mode):
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model, (x,) = make_seed(mid, batch=128, k=384, n=512, device="cuda")
    model, x = model.to(dtype), x.to(dtype)
    eager, m64 = copy.deepcopy(model), copy.deepcopy(model).double()
    opt = gemmfuse.optimize(model, (x,), precision="fp32" if mode == "bf16" else mode)
    with torch.no_grad():
        gy = torch.randn(copy.deepcopy(eager)(x).shape, device="cuda", dtype=torch.float64)
    got = _step(opt, x, gy)
    ref = _step(m64, x.double(), gy)
    eag = _step(eager, x, gy, tf32=mode == "tf32")
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.train_calls == 1, rt.fallbacks
    for name, r in ref.items():
        g, e = got[name].double(), eag[name].double()
        err, err_e = float((g - r).norm()), float((e - r).norm())
        floor = 1e-6 * float(r.norm()) + 1e-9
        if mode == "fast":
            ok = torch.allclose(g, r, atol=1e-4, rtol=1e-4) or not torch.allclose(e, r, atol=1e-4, rtol=1e-4)
        else:
            ok = err <= (2.0 if mode == "tf32" else 1.25) * err_e + floor
        assert ok, f"{mid} {mode} grad of {name}: error {err:.3g}, eager's {err_e:.3g}"
    # bf16 buffers: ours hold the rounding of fp32 batch statistics, eager's of statistics of
    # bf16-rounded values: a couple of bf16 ulps (2^-7 relative each) apart.
    rtol = 2 ** -6 if mode == "bf16" else 1e-3
    for (n, b), (_, be) in zip(model.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(b.float(), be.float(), rtol=rtol, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_gpu_train_no_grad_nothing_saved_and_inference_fast_path():
    model, (x,) = make_seed("m99", device="cuda")
    opt = gemmfuse.optimize(model, (x,))
    with torch.no_grad():
        opt(x)
        opt(x)
    rt = gemmfuse.runtimes(opt)[0]
    assert rt.train_calls == 0 and rt.fused_calls == 2
    opt(x).sum().backward()
    assert rt.train_calls == 1 and model.linear.weight.grad is not None


def _check_split_gradient(got, eag, ref, nan_col, exact):
    """A gradient from the split kernel against eager's and float64's: column `nan_col` NaN in
    both, the rest finite and at most 1.25x eager's error, and the parts `exact(g, finite
    columns)` picks within 1e-6 of float64's (where only values the split leaves out count)."""
    assert torch.isnan(got[:, nan_col]).all() and torch.isnan(eag[:, nan_col]).all()
    fin = torch.ones(got.shape[1], dtype=torch.bool, device=got.device)
    fin[nan_col] = False
    g, e, r = got[:, fin], eag[:, fin], ref[:, fin]
    assert torch.isfinite(g).all()
    err, err_e = float((g - r).norm()), float((e - r).norm())
    assert err <= 1.25 * err_e + 1e-7 * float(r.norm()), (err, err_e)
    for (name, gg), rr in zip(exact(got, fin).items(), exact(ref, fin).values()):
        assert float((gg - rr).norm()) <= 1e-6 * float(rr.norm()), name


class _Scaled(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.linear = torch.nn.Linear(k, n)

    def forward(self, x):
        return self.linear(x) * 3.0


def test_dw_on_split_kernel_with_tiny_and_nan_values():
    """dW = dVᵀ x on the f16x3 kernel (a shape its cost rule takes): as accurate as SGEMM
    overall, exact where only values the split leaves out contribute (a row of dV's transpose
    crowded with tiny values: recomputed; a column of x whose values are tiny but one: its
    columns recomputed), NaN where x holds a NaN."""
    M, K, N = 512, 1024, 2048
    torch.manual_seed(5)
    model = _Scaled(K, N).cuda()
    x = torch.rand(M, K, device="cuda")
    gy = torch.randn(M, N, device="cuda")
    x[0] = 0.0
    gy[:, 5] *= 1e-12                  # dW[5] = 3 sum_m gy[m, 5] x[m]: only tiny values (x[0] = 0)
    gy[0, 5] = 1.0
    x[:, 11] *= 1e-12                  # dW[:, 11]: only tiny values (gy[1] = 0)
    x[1, 11] = 1.0
    gy[1] = 0.0
    x[2, 13] = float("nan")            # dW[:, 13] NaN
    opt = gemmfuse.optimize(model, (x,))
    assert "dW = dVᵀ x on the fp32 f16x3 kernel" in gemmfuse.explain(opt)
    eager = copy.deepcopy(model)
    got = _step(opt, x, gy)["linear.weight"].double()
    eag = _step(eager, x, gy)["linear.weight"].double()
    ref = 3.0 * gy.double().t() @ x.double()
    assert gemmfuse.runtimes(opt)[0].train_calls == 1
    _check_split_gradient(got, eag, ref, 13, lambda g, fin: {"row 5": g[5, fin], "column 11": g[:, 11]})


def test_dx_on_split_kernel_with_tiny_and_nan_values():
    """dx = dV W on the f16x3 kernel (W split by columns, read MN-major): as accurate as SGEMM
    overall, exact where only values the split leaves out contribute (a row of dV tiny but one
    value, against a zero row of W: corrected; a column of W tiny but one value, whose dV
    column is zero: recomputed), NaN where W holds a NaN; rows of dV spread over 2^40 (as
    softmax gradients are) through the second level."""
    M, K, N = 512, 1024, 2048
    torch.manual_seed(6)
    model = _Scaled(K, N).cuda()
    with torch.no_grad():
        w = model.linear.weight
        w[0] = 0.0
        w[:, 17] *= 1e-12              # dx[:, 17]: only tiny values (dV[:, 9] = 0)
        w[9, 17] = 1.0
        w[7, 13] = float("nan")        # dx[:, 13] NaN
    x = torch.rand(M, K, device="cuda")
    gy = torch.randn(M, N, device="cuda")
    gy[4] *= 1e-12                     # dx[4]: only tiny values (W[0] = 0)
    gy[4, 0] = 1.0
    gy[:, 9] = 0.0
    gy[8:40] *= torch.exp2(-40 * torch.rand(32, N, device="cuda"))
    opt = gemmfuse.optimize(model, (x,))
    assert "dx = dV W on the fp32 f16x3 kernel" in gemmfuse.explain(opt)
    eager = copy.deepcopy(model)
    got = _step(opt, x, gy)["x"].double()
    eag = _step(eager, x, gy)["x"].double()
    ref = 3.0 * gy.double() @ model.linear.weight.detach().double()
    assert gemmfuse.runtimes(opt)[0].train_calls == 1
    _check_split_gradient(got, eag, ref, 13,
                          lambda g, fin: {"row 4": g[4, fin], "column 17": g[:, 17], "rows 8-39": g[8:40, fin]})


def test_16bit_training_routes_to_pytorch(monkeypatch):
    """While autograd records, a bf16 model's chain runs in PyTorch (the fused backward is
    slower than eager bf16's); under no_grad it runs fused."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    monkeypatch.setattr(route_timer, "whole_timed_on", lambda device: False)
    monkeypatch.setattr(route_timer, "timed_routes_on", lambda device: False)  # the rule, not a timing
    model, (x,) = make_seed("m99", device="cuda")
    model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    opt = gemmfuse.optimize(model, (x,))
    opt(x).float().sum().backward()
    (rt,) = gemmfuse.runtimes(opt)
    assert rt.train_calls == 0 and any("while autograd records" in k for k in rt.fallbacks), rt.fallbacks
    assert model.linear.weight.grad is not None
    with torch.no_grad():
        opt(x)
    assert rt.fused_calls == 1

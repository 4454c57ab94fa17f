"""Bad and unusual inputs: errors and results as PyTorch gives them, on the CPU and (where
there is one) on the GPU."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gemmfuse
from conftest import assert_close64, double_ref, make_seed, needs_cuda, needs_lib, seed_ids

pytestmark = needs_lib

DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def _pytorch_error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


@pytest.mark.parametrize("mid", seed_ids())
@pytest.mark.parametrize("device", DEVICES)
def test_wrong_dtype_raises_like_pytorch(mid, device):
    model, inputs = make_seed(mid, device=device)
    opt = gemmfuse.optimize(model, inputs)
    x = inputs[0].double()
    expect = _pytorch_error(lambda: model(x))
    assert expect is not None
    with torch.no_grad(), pytest.raises(type(expect)) as got:
        opt(x)
    assert str(got.value) == str(expect)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_model_given_fp32_raises_like_pytorch(dtype):
    """m99 in bf16/fp16 on the GPU called with fp32 x, and the fp32 model with 16-bit x:
    PyTorch's error, word for word."""
    model, inputs = make_seed("m99", device="cuda")
    for m, x in ((copy.deepcopy(model).to(dtype), inputs[0]), (model, inputs[0].to(dtype))):
        opt = gemmfuse.optimize(m, (x.to(next(m.parameters()).dtype),))
        expect = _pytorch_error(lambda: m(x))
        assert expect is not None
        with torch.no_grad(), pytest.raises(type(expect)) as got:
            opt(x)
        assert str(got.value) == str(expect)


@pytest.mark.parametrize("mid", seed_ids())
@pytest.mark.parametrize("device", DEVICES)
def test_wrong_last_dim_raises_like_pytorch(mid, device):
    model, inputs = make_seed(mid, device=device)
    opt = gemmfuse.optimize(model, inputs)
    x = torch.rand(16, 95, device=device)
    expect = _pytorch_error(lambda: model(x))
    with torch.no_grad(), pytest.raises(type(expect)) as got:
        opt(x)
    assert str(got.value) == str(expect)


def test_wrong_device_clear_error():
    model, inputs = make_seed("m99")
    opt = gemmfuse.optimize(model, inputs)
    x = torch.empty(16, 96, device="meta")
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device.*meta.*cpu"):
        opt(x)


@pytest.mark.parametrize("mid", seed_ids())
@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(mid, device):
    model, inputs = make_seed(mid, device=device)
    opt = gemmfuse.optimize(model, inputs)
    x = torch.rand(96, 16, device=device).t()
    assert not x.is_contiguous()
    with torch.no_grad():
        assert_close64(opt(x), double_ref(model)(x.double()), what=mid)
    assert gemmfuse.runtimes(opt)[0].fallbacks == {}


@pytest.mark.parametrize("mid", seed_ids())
@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(mid, device):
    model, inputs = make_seed(mid, device=device)
    opt = gemmfuse.optimize(model, inputs)
    x = torch.rand(0, 96, device=device)
    expect = _pytorch_error(lambda: model(x))
    with torch.no_grad():
        if expect is not None:
            with pytest.raises(type(expect)):
                opt(x)
        else:
            out, ref = opt(x), model(x)
            assert out.shape == ref.shape and out.numel() == 0 and out.dtype == ref.dtype


@pytest.mark.parametrize("mid", seed_ids())
@pytest.mark.parametrize("device", DEVICES)
def test_3d_and_1d_inputs(mid, device):
    model, inputs = make_seed(mid, device=device)
    opt = gemmfuse.optimize(model, inputs)
    ref = double_ref(model)
    for shape in [(2, 8, 96)] + ([(96,)] if mid in ("m22", "m99", "m18") else []):
        x = torch.rand(*shape, device=device)
        expect = _pytorch_error(lambda: ref(x.double()))
        with torch.no_grad():
            if expect is not None:
                with pytest.raises(type(expect)):
                    opt(x)
            else:
                assert_close64(opt(x), ref(x.double()), what=f"{mid} {shape}")


@pytest.mark.parametrize("mid", seed_ids())
@pytest.mark.parametrize("special", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_pass_through(mid, special, device):
    model, inputs = make_seed(mid, device=device)
    opt = gemmfuse.optimize(model, inputs)
    x = inputs[0].clone()
    x[3, 5] = float(special)
    x[7] = float(special)
    with torch.no_grad():
        out = opt(x)
        ref = model(x)             # eager fp32: the same NaN/inf positions
        ref64 = double_ref(model)(x.double())
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (out, ref)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert_close64(out, ref64, what=f"{mid} {special}")


@pytest.mark.parametrize("special", ["inf", "-inf"])
def test_m18_gemv_rewrite_keeps_infinities_when_weight_signs_agree(special):
    # With every weight positive, an infinite input makes every y[n] the same infinity and
    # PyTorch's sum is that infinity (not NaN): the GEMV rewrite must give the same.
    model, inputs = make_seed("m18")
    with torch.no_grad():
        model.linear.weight.abs_().add_(1e-3)
    opt = gemmfuse.optimize(model, inputs)
    x = inputs[0].clone()
    x[2, 1] = float(special)
    x[4, 0] = float(special)
    x[4, 3] = -float(special)   # opposite infinities in one row: NaN
    with torch.no_grad():
        out, ref = opt(x), model(x)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (out, ref)
    assert torch.equal(torch.isinf(out), torch.isinf(ref)) and torch.isinf(ref[2]).all()
    assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)])


@pytest.mark.parametrize("device", DEVICES)
def test_training_batchnorm_one_row_raises_valueerror(device):
    model, inputs = make_seed("m84", device=device)
    opt = gemmfuse.optimize(model, inputs)
    x = torch.rand(1, 96, device=device)
    expect = _pytorch_error(lambda: model(x))
    assert isinstance(expect, ValueError)
    with torch.no_grad(), pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        opt(x)
    opt.eval()
    with torch.no_grad():
        assert opt(x).shape == (1, 160)


def test_bad_precision_and_double_model_falls_back():
    model, inputs = make_seed("m99")
    with pytest.raises(ValueError, match="precision"):
        gemmfuse.optimize(model, inputs, precision="fp16")
    opt = gemmfuse.optimize(model, inputs)
    opt.double()                      # a dtype the planner does not take: PyTorch runs it
    x = inputs[0].double()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), double_ref(model)(x))
        opt(x)
    rt = gemmfuse.runtimes(opt)[0]
    assert rt.fused_calls == 0 and sum(rt.fallbacks.values()) == 2, rt.fallbacks
    assert "fallbacks to PyTorch:" in gemmfuse.explain(opt, print_it=False)


def test_explain_plain_module_needs_inputs():
    model, inputs = make_seed("m99")
    with pytest.raises(ValueError, match="example_inputs"):
        gemmfuse.explain(model)
    with pytest.raises(ValueError, match="already optimized"):
        gemmfuse.optimize(gemmfuse.optimize(model, inputs), inputs)


def test_explain_optimized_module_refuses_example_inputs():
    """They would go unused (the module is optimized for its own example); explain says so
    rather than describing another shape than the one asked about."""
    model, inputs = make_seed("m99")
    opt = gemmfuse.optimize(model, inputs)
    with pytest.raises(ValueError, match="already optimized.*plan at each input shape"):
        gemmfuse.explain(opt, inputs)


def test_data_dependent_control_flow_runs_as_eager():
    """torch.fx cannot trace a branch on a tensor's value: the model is captured through
    dynamo, which breaks the graph there, and both branches compute what eager does."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            y = torch.relu(self.l(x))
            if y.sum() > 1:
                return y
            return -y

    m = M()
    opt = gemmfuse.optimize(m, torch.randn(2, 4))
    with torch.no_grad():
        for x in (torch.randn(2, 4) * 10, torch.zeros(2, 4) - 100):
            torch.testing.assert_close(opt(x), m(x))


def test_broadcasting_bias_runs_as_pytorch():
    """F.linear broadcasts a bias of one element over the outputs; the fused op reads one value
    per output, so the chain runs in PyTorch (with the reason), and the op itself refuses such a
    bias with a clear error instead of reading past its end."""
    class OneBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 8))
            self.b = nn.Parameter(torch.randn(1))

        def forward(self, x):
            return torch.relu(F.linear(x, self.w, self.b))

    model, x = OneBias(), torch.randn(4, 8)
    opt = gemmfuse.optimize(model, (x,))
    torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)
    assert "broadcasts, PyTorch runs it" in gemmfuse.explain(opt, print_it=False)
    with pytest.raises(RuntimeError, match="bias of shape"):
        torch.ops.gemmfuse.stateless("linear in=8 out=3 bias=1", x, model.w.detach(),
                                     torch.randn(2), [], "fp32")


def test_running_statistics_of_another_size_are_refused():
    """The op refuses BatchNorm state that is not one value per column (the executors would
    read past its end) with a clear error; state of the right size runs."""
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    spec = ("linear in=8 out=3 bias=0\n"
            "batch_norm training=0 running_mean=s0 running_var=s1 weight=t0 bias=t1")
    ops = [torch.randn(3), torch.randn(3)]
    with pytest.raises(RuntimeError, match="does not fit the BatchNorm over 3 columns"):
        torch.ops.gemmfuse.run(spec, x, w, None, ops, [torch.randn(2), torch.rand(3) + 0.5],
                               "fp32")
    state = [torch.randn(3), torch.rand(3) + 0.5]
    out = torch.ops.gemmfuse.run(spec, x, w, None, ops, state, "fp32")
    assert out.shape == (4, 3) and torch.isfinite(out).all()

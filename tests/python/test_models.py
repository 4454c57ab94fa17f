"""The seed models (bench.models) against their description in docs/models.md."""

import pytest
import torch
import torch.nn.functional as F

from bench.models import BATCH, IN_FEATURES, MODELS, OUT_FEATURES, M22  # noqa: E402

B, K, N = 8, 64, 96


@pytest.mark.parametrize("mid", list(MODELS))
def test_builds_and_shapes(mid):
    torch.manual_seed(0)
    model, inputs = MODELS[mid].make(B, K, N)
    assert model.training
    assert len(inputs) == 1 and inputs[0].shape == (B, K) and inputs[0].dtype == torch.float32
    assert 0 <= float(inputs[0].min()) and float(inputs[0].max()) < 1
    out = model(*inputs)
    assert out.shape == ((B, 1) if MODELS[mid].out_is_row else (B, N))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("mid", list(MODELS))
def test_seed_defaults(mid):
    cls = MODELS[mid].cls
    init = cls.get_init_inputs()
    assert init[:2] == [IN_FEATURES, OUT_FEATURES]
    x, = cls.get_inputs(batch=2)  # a small batch; the default is the seed's 1024
    assert x.shape == (2, IN_FEATURES)
    assert cls.get_inputs.__defaults__[0] == BATCH


def test_init_args():
    assert MODELS["m22"].cls.get_init_inputs() == [8192, 8192, 2.0, -10.0, 10.0]
    assert MODELS["m84"].cls.get_init_inputs() == [8192, 8192, 1e-5, 0.1, (1,)]
    assert MODELS["m94"].cls.get_init_inputs() == [8192, 8192, (8192,), 256]
    m94, _ = MODELS["m94"].make(2, 64, 96)
    assert 96 % m94.groupnorm.num_groups == 0


def test_dtype_device():
    model, (x,) = MODELS["m99"].make(4, 32, 48, dtype=torch.bfloat16)
    assert x.dtype == torch.bfloat16 and model.linear.weight.dtype == torch.bfloat16
    assert model(x).dtype == torch.bfloat16


def test_m18_is_a_gemv():
    torch.manual_seed(1)
    model, (x,) = MODELS["m18"].make(B, K, N, dtype=torch.float64)
    w, b = model.linear.weight, model.linear.bias
    expect = (x @ w.sum(0) + b.sum()).unsqueeze(1)
    torch.testing.assert_close(model(x), expect, rtol=1e-12, atol=1e-12)


def test_m22_scale_folds_exactly():
    torch.manual_seed(2)
    model, (x,) = MODELS["m22"].make(B, K, N)
    y = F.linear(x, model.matmul.weight, model.matmul.bias) * 4.0  # x*2 then x+x, exact in fp32
    y = torch.logsumexp(torch.clamp(y, -10.0, 10.0), dim=1, keepdim=True)
    assert torch.equal(model(x), y * F.mish(y))
    assert isinstance(model, M22) and model.scale_factor == 2.0


def test_m84_updates_running_stats():
    torch.manual_seed(3)
    model, (x,) = MODELS["m84"].make(B, K, N, dtype=torch.float64)
    bn = model.bn
    assert int(bn.num_batches_tracked) == 0
    y = model.gemm(x)
    out = model(x)
    torch.testing.assert_close(bn.running_mean, 0.1 * y.mean(0))
    torch.testing.assert_close(bn.running_var, 0.9 + 0.1 * y.var(0, unbiased=True))
    assert int(bn.num_batches_tracked) == 1
    z = (y - y.mean(0)) / torch.sqrt(y.var(0, unbiased=False) + 1e-5)  # batch stats, biased var
    torch.testing.assert_close(out, torch.softmax(model.scale * z, dim=1))


def test_m94_matches_functional():
    torch.manual_seed(4)
    model, (x,) = MODELS["m94"].make(B, K, N, dtype=torch.float64)
    y = F.mish(F.hardtanh(model.gemm(x) + model.bias))
    g = model.groupnorm
    expect = F.group_norm(y, g.num_groups, g.weight, g.bias, 1e-5)
    torch.testing.assert_close(model(x), expect)


def test_m99_matches_functional():
    torch.manual_seed(5)
    model, (x,) = MODELS["m99"].make(B, K, N, dtype=torch.float64)
    y = model.linear(x)
    expect = torch.softmax(0.5 * y * (1 + torch.erf(y / 2 ** 0.5)), dim=1)
    torch.testing.assert_close(model(x), expect)

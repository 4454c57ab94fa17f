"""CUDA: problems whose M x N (or M x K) elements pass 2^31, so that every kernel on their path
must index with 64 bits (issue 3: "int64 indexing where M·N exceeds 2^31").

Each case runs a seed chain at ~524k rows on the GPU and compares every element, chunk by
chunk on the device, with the same model in float64. The output is poisoned first (the
caching allocator hands back a NaN-filled block), so an element a kernel never wrote, or one
written at a wrapped-around index, shows. The cases need ~40 GB of free device memory and
skip where there is less (and everywhere without a GPU).
"""
import copy

import pytest
import torch

import gemmfuse
from conftest import F16X3_TEXT, HAVE_CUDA, explain_block, is_sm90, make_seed, needs_lib, rel

pytestmark = [needs_lib, pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")]

TWO_31 = 2 ** 31
NEED_BYTES = 40 << 30
CHUNK = 32768  # rows per float64 reference chunk


def _enough_memory():
    free, _ = torch.cuda.mem_get_info()
    return free >= NEED_BYTES


needs_memory = pytest.mark.skipif(not HAVE_CUDA or not _enough_memory(),
                                  reason="needs ~40 GB of free GPU memory")


def _poison_allocator(numel, dtype):
    """Leaves a NaN-filled block of numel elements in PyTorch's cache, for the next allocation
    of that size (the output) to reuse."""
    t = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del t


def _batchnorm_batch_stats(model, x):
    """Column mean and biased variance of model.gemm(x), in float64, over every row."""
    lin = copy.deepcopy(model.gemm).double()
    s = torch.zeros(lin.out_features, dtype=torch.float64, device="cuda")
    for i in range(0, x.shape[0], CHUNK):
        s += lin(x[i:i + CHUNK].double()).sum(0)
    mean = s / x.shape[0]
    q = torch.zeros_like(s)
    for i in range(0, x.shape[0], CHUNK):
        q += (lin(x[i:i + CHUNK].double()) - mean).square().sum(0)
    return mean, q / x.shape[0]


def _reference_model(mid, model, x):
    """A float64 model that computes, row chunk by row chunk, what `model` computes on all of x
    (and m84's batch statistics): m84's training-mode BatchNorm normalises with the whole
    batch's statistics, so its copy runs in eval mode with those as its running ones."""
    ref = copy.deepcopy(model).double()
    if mid != "m84":
        return ref, None
    mean, var = _batchnorm_batch_stats(model, x)
    ref.bn.running_mean.copy_(mean)
    ref.bn.running_var.copy_(var)
    ref.eval()
    return ref, (mean, var)


def _check_ran_fused(opt, x, precision):
    """The call ran on gemmfuse's kernels (no fallback to PyTorch, which would pass vacuously),
    and its plan at x's shape, as explain lists it, is printed to the log; fp32 mode on an
    H100 takes the f16x3 GEMM there, `fast` its split products."""
    rt = gemmfuse.runtimes(opt)[0]
    assert rt.fused_calls >= 1 and rt.fallbacks == {}, rt.fallbacks
    text = gemmfuse.explain(opt, print_it=False)
    block = explain_block(text, f"    x {list(x.shape)} {x.dtype} on {x.device}")
    assert block[0].endswith("plan:"), text
    plan = "\n".join(block[1:])
    print(f"plan at {tuple(x.shape)}:\n{plan}")
    if precision == "fp32" and is_sm90():
        assert F16X3_TEXT in plan, plan
    if precision == "fast":
        assert "splits x and W into bf16 hi + lo parts" in plan, plan


def _check_chunks(out, ref_model, x, what, eager=None, atol=1e-4, rtol=1e-4):
    """Every row of out against ref_model(x) in float64, CHUNK rows at a time, on the device.
    With `eager` (a model in out's dtype), the check is relative: out's error no worse than
    1.25x eager's (+1e-4), per chunk."""
    assert out.shape[0] == x.shape[0]
    for i in range(0, x.shape[0], CHUNK):
        xs = x[i:i + CHUNK]
        with torch.no_grad():
            ref = ref_model(xs.double())
        got = out[i:i + CHUNK].double()
        assert not torch.isnan(got).any(), f"{what}: NaN (unwritten?) in rows {i}..{i + len(xs)}"
        if eager is None:
            torch.testing.assert_close(got, ref, atol=atol, rtol=rtol,
                                       msg=lambda m: f"{what}, rows {i}..{i + len(xs)}: {m}")
        else:
            with torch.no_grad():
                e = eager(xs.to(out.dtype)).double()
            err, err_e = rel(got, ref), rel(e, ref)
            assert err <= 1.25 * err_e + 1e-4, (what, i, err, err_e)


# (model, M, K, N, precision): M x N > 2^31 at K = 128 (fp32 mode on an H100 takes the f16x3
# kernel here, from its least K, `fast` the split products), and, for the x splits,
# M x K > 2^31 at N = 256.
WIDE_M, WIDE_K, WIDE_N = TWO_31 // 4096 + 64, 128, 4096
DEEP_M, DEEP_K, DEEP_N = TWO_31 // 4096 + 64, 4096, 256
CASES = [(mid, WIDE_M, WIDE_K, WIDE_N, p) for mid in ("m22", "m84", "m94", "m99") for p in ("fp32", "fast")]
CASES += [("m99", DEEP_M, DEEP_K, DEEP_N, p) for p in ("fp32", "fast")]


@needs_memory
@pytest.mark.parametrize("mid,M,K,N,precision", CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}x{c[3]}-{c[4]}" for c in CASES])
def test_large_index_fp32(mid, M, K, N, precision):
    assert M * N > TWO_31 or M * K > TWO_31
    model, _ = make_seed(mid, batch=8, k=K, n=N, device="cuda")
    x = torch.rand(M, K, device="cuda")
    ref_model, batch_stats = _reference_model(mid, model, x)
    bn_before = (model.bn.running_mean.clone(), model.bn.running_var.clone()) if mid == "m84" else None
    opt = gemmfuse.optimize(model, (x[:1024],), precision=precision)
    out_cols = 1 if mid == "m22" else N
    _poison_allocator(M * out_cols, torch.float32)
    with torch.no_grad():
        out = opt(x)
    torch.cuda.synchronize()
    assert out.shape == (M, out_cols)
    _check_ran_fused(opt, x, precision)
    _check_chunks(out, ref_model, x, f"{mid} {precision} M={M} K={K} N={N}")
    if mid == "m84":  # the running statistics moved by momentum 0.1 towards the batch's
        mean, var = batch_stats
        torch.testing.assert_close(model.bn.running_mean.double(), 0.9 * bn_before[0].double() + 0.1 * mean,
                                   atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(model.bn.running_var.double(),
                                   0.9 * bn_before[1].double() + 0.1 * var * M / (M - 1), atol=1e-5, rtol=1e-4)


@needs_memory
def test_large_index_bf16():
    """m99 in bf16 at M x N > 2^31: too many tiles for the fused sm90 kernel, so the GEMM and
    the row pass run apart; error no worse than eager bf16's, chunk by chunk."""
    M, K, N = WIDE_M, WIDE_K, WIDE_N
    model, _ = make_seed("m99", batch=8, k=K, n=N, device="cuda")
    ref_model = copy.deepcopy(model).double()
    model = model.to(torch.bfloat16)
    x = torch.rand(M, K, device="cuda").bfloat16()
    opt = gemmfuse.optimize(copy.deepcopy(model), (x[:1024],))
    _poison_allocator(M * N, torch.bfloat16)
    with torch.no_grad():
        out = opt(x)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    _check_ran_fused(opt, x, "bf16")
    _check_chunks(out, ref_model, x, f"m99 bf16 M={M} N={N}", eager=model)

"""CUDA: seed models x precision vs float64, GPU fuzz, shapes, streams, CUDA graphs, devices.

Skips without a GPU. Precision promises (docs/design.md):
  fp32: error vs float64 no worse than 1.25x eager fp32's (+ slack for tiny values);
  fast: allclose(atol=rtol=1e-4) and rel <= 2e-5;
  tf32: as PyTorch with allow_tf32 (checked loosely: within 2x eager TF32's error).
"""
import copy
import random
import time

import pytest
import torch
import torch.nn as nn

import gemmfuse
from gemmfuse import route_timer
from conftest import F16X3_TEXT, HAVE_CUDA, assert_close64, is_sm90, make_seed, needs_lib, rel, seed_ids

pytestmark = [needs_lib, pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")]

# A shape at which fp32 mode's GEMM takes the sm90 f16x3 kernel (its cost rule leaves smaller
# GEMMs, such as 256 x 1024 x 1024, on SGEMM): the tests below cover that path on an H100.
B, K, N = 512, 1024, 4096

# The fp32 promise (error no worse than 1.25x eager's) is statistical; with one output element
# (M=1 on m18/m22) either side can be off by an ulp or two, so allow 4 ulps of slack.
FP32_ULPS = 4 * 2.0 ** -24



@pytest.fixture(autouse=True)
def _no_tf32():
    if not HAVE_CUDA:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _seed_gpu(mid, batch=B, k=K, n=N):
    return make_seed(mid, batch=batch, k=k, n=n, device="cuda")


@pytest.mark.parametrize("precision", ["fp32", "fast", "tf32"])
@pytest.mark.parametrize("mid", seed_ids())
def test_seed_models_cuda(mid, precision):
    model, inputs = _seed_gpu(mid)
    ref_model = copy.deepcopy(model).double()
    eager = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, inputs, precision=precision)
    assert len(gemmfuse.runtimes(opt)) == 1
    x = inputs[0]
    with torch.no_grad():
        out = opt(x)
        ref = ref_model(x.double())
        e32 = eager(x)
        if precision == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            e_tf32 = copy.deepcopy(eager)(x) if mid != "m84" else None
            torch.backends.cuda.matmul.allow_tf32 = False
    r, r_eager = rel(out, ref), rel(e32, ref)
    if precision == "fast":
        assert_close64(out, ref, what=f"{mid} fast")
        assert r <= 2e-5, (mid, r)
    elif precision == "fp32":
        assert r <= 1.25 * r_eager + FP32_ULPS, (mid, r, r_eager)
    else:
        if e_tf32 is not None:
            assert r <= 2 * rel(e_tf32, ref) + 1e-6, (mid, r)
    rt = gemmfuse.runtimes(opt)[0]
    assert rt.fused_calls == 1 and rt.fallbacks == {}, rt.fallbacks
    if precision == "fp32" and mid != "m18" and is_sm90():  # m18 is a GEMV
        assert F16X3_TEXT in gemmfuse.explain(opt, print_it=False)
    if mid == "m84":
        # The running stats come from the batch statistics of this mode's GEMM: TF32's
        # ~3e-4 relative GEMM error moves the batch means by up to ~1e-4 absolute.
        atol = 2e-4 if precision == "tf32" else 1e-5
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model.bn, name).double(), getattr(ref_model.bn, name).double(),
                                       atol=atol, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mid", seed_ids())
def test_16bit_models_cuda(mid, dtype):
    """bf16/fp16 models: error no worse than eager's in the same dtype; BatchNorm running
    statistics stay in the model's dtype, are updated in place (read and written there, no
    fp32 round trip), and the eval fold reads them."""
    model, inputs = _seed_gpu(mid)
    ref_model = copy.deepcopy(model).double()
    model = model.to(dtype)
    eager = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, (inputs[0].to(dtype),))
    for step in range(2):
        x = torch.rand(B, K, device="cuda")
        with torch.no_grad():
            out, ref, e = opt(x.to(dtype)), ref_model(x.double()), eager(x.to(dtype))
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert rel(out, ref) <= 1.25 * rel(e, ref) + 1e-4, (mid, step, rel(out, ref), rel(e, ref))
        if mid == "m84":
            for name in ("running_mean", "running_var"):
                ours, theirs = getattr(model.bn, name), getattr(eager.bn, name)
                assert ours.dtype == dtype
                exact = getattr(ref_model.bn, name)
                # within two ulps of the dtype of the float64 model's statistics
                torch.testing.assert_close(ours.double(), exact, atol=1e-3, rtol=2 * 2.0 ** -7)
                assert rel(ours, exact) <= 1.25 * rel(theirs, exact) + 1e-4, name
            assert model.bn.num_batches_tracked.item() == step + 1
    assert gemmfuse.runtimes(opt)[0].fallbacks == {}
    if mid == "m84":  # eval: the BatchNorm is folded into W from the 16-bit running stats
        opt.eval(), eager.eval(), ref_model.eval()
        x = torch.rand(B, K, device="cuda")
        with torch.no_grad():
            out, ref, e = opt(x.to(dtype)), ref_model(x.double()), eager(x.to(dtype))
        assert rel(out, ref) <= 1.25 * rel(e, ref) + 1e-4, ("eval", rel(out, ref), rel(e, ref))


@pytest.mark.parametrize("precision", ["fp32", "fast"])
@pytest.mark.parametrize("M", [1, 7, 128, 1024, 4096])
def test_shapes_not_multiple_of_16(M, precision):
    k, n = 1001, 999
    from bench.models import M94
    for mid in ("m22", "m99", "m94"):
        if mid == "m94":  # 8 groups of 125 channels
            torch.manual_seed(0)
            model = M94(k, 1000, (1000,), 8).cuda()
        else:
            model, _ = _seed_gpu(mid, batch=M, k=k, n=n)
        x = torch.rand(M, k, device="cuda")
        ref_model = copy.deepcopy(model).double()
        eager = copy.deepcopy(model)
        opt = gemmfuse.optimize(model, (x,), precision=precision)
        with torch.no_grad():
            out, ref, e32 = opt(x), ref_model(x.double()), eager(x)
        if precision == "fast":
            assert_close64(out, ref, what=f"{mid} M={M}")
        else:
            assert rel(out, ref) <= 1.25 * rel(e32, ref) + FP32_ULPS, (mid, M)
        assert gemmfuse.runtimes(opt)[0].fallbacks == {}


@pytest.mark.parametrize("M", [1, 4, 16, 17, 32])
@pytest.mark.parametrize("mid", ["m22", "m84", "m94", "m99"])
def test_small_batches_fp32(mid, M):
    """M <= 32: the GEMM runs on gemm_small_m.cu, with x read in place (16-byte aligned) and
    through a copy (x one element past a 16-byte boundary); both keep the fp32 promise
    (cuBLASLt has 2.2x eager's error on m84 at M = 16 with that x, 2.6x on m99 at M = 17)."""
    if mid == "m84" and M == 1:
        pytest.skip("training BatchNorm needs more than one row")
    model, _ = _seed_gpu(mid, batch=M)
    buf = torch.rand(M * K + 1, device="cuda")
    for x in (buf[:M * K].view(M, K), buf[1:].view(M, K)):
        ref_model, eager = copy.deepcopy(model).double(), copy.deepcopy(model)
        opt = gemmfuse.optimize(copy.deepcopy(model), (x,), precision="fp32")
        with torch.no_grad():
            out, ref, e32 = opt(x), ref_model(x.double()), eager(x)
        aligned = x.data_ptr() % 16 == 0
        assert rel(out, ref) <= 1.25 * rel(e32, ref) + FP32_ULPS, (mid, M, aligned)
        assert gemmfuse.runtimes(opt)[0].fallbacks == {}


@pytest.mark.parametrize("M", [3, 17, 31])
@pytest.mark.parametrize("k", [1001, 1002, 1003])
def test_small_batches_fp32_odd_k(k, M):
    """K % 4 != 0: W's rows start at every shift from a 16-byte boundary (x read through up
    to 4 shifted copies); the fp32 promise holds (cuBLASLt: 1.7-2.6x eager's error)."""
    for mid in ("m22", "m99"):
        model, _ = _seed_gpu(mid, batch=M, k=k, n=999)
        x = torch.rand(M, k, device="cuda")
        ref_model, eager = copy.deepcopy(model).double(), copy.deepcopy(model)
        opt = gemmfuse.optimize(copy.deepcopy(model), (x,), precision="fp32")
        with torch.no_grad():
            out, ref, e32 = opt(x), ref_model(x.double()), eager(x)
        assert rel(out, ref) <= 1.25 * rel(e32, ref) + FP32_ULPS, (mid, M, k)
        assert gemmfuse.runtimes(opt)[0].fallbacks == {}


def test_3d_inputs_cuda():
    model, _ = _seed_gpu("m99", k=333, n=777)
    x = torch.rand(4, 37, 333, device="cuda")

    class Last(nn.Module):          # softmax over the last dim of a 3-d value
        def __init__(self, inner):
            super().__init__()
            self.linear = inner.linear

        def forward(self, x):
            return torch.softmax(torch.nn.functional.gelu(self.linear(x)), dim=-1)

    m = Last(model)
    ref = copy.deepcopy(m).double()
    opt = gemmfuse.optimize(m, (x,), precision="fast")
    with torch.no_grad():
        assert_close64(opt(x), ref(x.double()), what="3-d")
    assert gemmfuse.runtimes(opt)[0].fused_calls == 1


def test_non_default_stream():
    model, inputs = _seed_gpu("m94")
    ref = copy.deepcopy(model).double()
    opt = gemmfuse.optimize(model, inputs, precision="fast")
    s = torch.cuda.Stream()
    x = inputs[0]
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        xs = x * 1.0                       # produced on the side stream
        outs = [opt(xs) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(s)
    for o in outs:
        assert_close64(o, ref(x.double()), what="side stream")


def _returns_before_the_gpu(call, what):
    """call() only enqueues work: behind ~0.5 s of GPU sleep on the current stream, it returns
    long before that ends, and the sleep is still running after it (a host sync anywhere in
    the call, on any stream, would wait for it)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # ~0.5 s at ~2 GHz
    t0 = time.perf_counter()
    call()
    took = time.perf_counter() - t0
    done = torch.cuda.Event()
    done.record()
    pending = not done.query()
    torch.cuda.synchronize()
    slept = time.perf_counter() - t0
    assert pending and took < 0.5 * slept, f"{what}: the call took {took:.3f} s of {slept:.3f} s"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mid", seed_ids())
def test_forward_has_no_host_sync(mid, dtype):
    """A forward call (not the first: that one plans and prepares the weights) never waits
    for the GPU: every seed model, every precision mode (and bf16, m99's fused sm90 kernel),
    training-mode BatchNorm's running statistics included."""
    model, inputs = _seed_gpu(mid)
    modes = ["fp32", "fast", "tf32"] if dtype == torch.float32 else ["fp32"]
    for precision in modes:
        m = copy.deepcopy(model).to(dtype)
        x = inputs[0].to(dtype)
        opt = gemmfuse.optimize(m, (x,), precision=precision)
        with torch.no_grad():
            opt(x)
            _returns_before_the_gpu(lambda: opt(x), f"{mid} {dtype} {precision}")
        assert gemmfuse.runtimes(opt)[0].fused_calls == 2


BF16_MAX = 3.3895313892515355e38  # bf16's largest finite value; fp32 goes to 3.4028e38


def _exceptional_case(M, k, n, fold):
    """A Linear (then an eval BatchNorm, folded into W at prepare, when `fold`) whose x and W
    hold values exact in bf16 and fp16 (a zero low part: times an infinite part, a split would
    make NaN where fp32 gives an infinity) and, in a few rows, inf, -inf, NaN, values past
    bf16's range (whose rows' other values `fp32`'s split then cannot carry) and nonzero
    values below 2^-110 (which `fast`'s split cannot carry; `fp32`'s row scales carry them);
    a W row with a NaN (a NaN column), x rows with both infinities and with three (past the
    two a row at K = 1024 that `fp32` corrects rather than recomputes)."""
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.bfloat16().float())
        lin.weight[20, 7] = float("inf")
        if not fold:  # folding multiplies W by the BatchNorm scale: it would overflow
            lin.weight[21, 8] = 1.002 * BF16_MAX
        lin.weight[22, 9] = -float("inf")
        lin.weight[23] *= 1e-36
        lin.weight[24, 3] = float("nan")
    model = lin
    if fold:
        bn = nn.BatchNorm1d(n)
        with torch.no_grad():
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)  # positive scales: W' keeps W's signs and overflows
            bn.bias.uniform_(-1, 1)
        model = nn.Sequential(lin, bn).eval()
    model = model.cuda()
    x = torch.rand(M, k, device="cuda").bfloat16().float()
    x[3, 5] = float("inf")
    x[7, 9] = -float("inf")
    x[11, 2] = 1.002 * BF16_MAX
    x[11, 8] = 0.5  # with W[21, 8] a sum of two large terms, far from fp32's overflow
    x[13, 4] = float("nan")
    x[15] *= 1e-36
    x[17, 1], x[17, 6] = float("inf"), -float("inf")
    x[19, :3] = float("inf")
    return model, x


@pytest.mark.parametrize("mid, M, K, N", [("m94", 128, 4096, 4096), ("m99", 128, 4096, 4096),
                                          ("m99", 100, 4104, 4100)])
def test_fp32_split_k_gemm(mid, M, K, N):
    """fp32 mode with 128 rows at K = N = 4096 (and with M, N and K tails, none a multiple of
    16): on an H100/H200 the f16x3 GEMM's 32 (33) output tiles would leave most SMs idle, so
    it runs split-K (each tile's K in sms // tiles ranges, 4 on 132 SMs, the partial sums
    added in fp32 through the workspace); as faithful as eager fp32, on fresh inputs per call
    and under CUDA-graph replay."""
    model, inputs = _seed_gpu(mid, batch=M, k=K, n=N)
    ref_model = copy.deepcopy(model).double()
    eager = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, inputs, precision="fp32")
    if is_sm90():
        tiles = -(-M // 128) * -(-N // 128)
        ranges = min(torch.cuda.get_device_properties(0).multi_processor_count // tiles, 8)
        text = gemmfuse.explain(opt, print_it=False)
        assert F16X3_TEXT in text and f"cut into {ranges} ranges" in text, text
    with torch.no_grad():
        for _ in range(2):
            x = torch.rand_like(inputs[0])
            out, ref, e32 = opt(x), ref_model(x.double()), eager(x)
            assert rel(out, ref) <= 1.25 * rel(e32, ref) + FP32_ULPS, (rel(out, ref), rel(e32, ref))
        static_x = torch.rand_like(inputs[0])
        opt(static_x)  # warm: plans and prepared weights exist before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = opt(static_x)
        for _ in range(2):  # the replayed memset clears the split-K kernel's flags each time
            static_x.copy_(torch.rand_like(static_x))
            static_out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref = ref_model(static_x.double())
            assert rel(static_out, ref) <= 1.25 * rel(eager(static_x), ref) + FP32_ULPS
    rt = gemmfuse.runtimes(opt)[0]
    assert rt.fallbacks == {}, rt.fallbacks


def test_fast_with_128_rows_runs_fp32_kernel():
    """`fast` with one row of 128-row tiles runs fp32's split-K f16x3 GEMM (faster there than
    fast's three bf16 products, and more accurate); from 129 rows its own."""
    if not is_sm90():
        pytest.skip("the f16x3 kernel needs an sm90 GPU")
    for M, fp32 in ((128, True), (256, False)):
        model, inputs = _seed_gpu("m99", batch=M, k=4096, n=4096)
        opt = gemmfuse.optimize(model, inputs, precision="fast")
        text = gemmfuse.explain(opt, print_it=False)
        assert (f"fast with M = {M} <= 128 rows" in text) == fp32, text


def _per_chain_timing_only(monkeypatch):
    """These tests follow one chain's timed route: the whole-module timing that optimize()
    does first (it calls the chain in both grad modes) is off."""
    monkeypatch.setattr(route_timer, "whole_timed_on", lambda device: False)


def test_new_shapes_are_timed_on_cuda(monkeypatch):
    """On CUDA each new input signature is timed fused and in PyTorch once (route_timer); the
    faster runs, with PyTorch's result where PyTorch runs, and explain shows the times."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    monkeypatch.delenv("GEMMFUSE_TIMED_ROUTES", raising=False)
    _per_chain_timing_only(monkeypatch)
    model, inputs = _seed_gpu("m99", batch=256, k=1024, n=1024)
    eager = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, inputs)
    with torch.no_grad():
        for _ in range(2):
            x = torch.rand_like(inputs[0])
            out, ref = opt(x), eager(x)
    rt = gemmfuse.runtimes(opt)[0]
    assert len(rt.timed) == 1
    (fused_ms, eager_ms, _), = rt.timed.values()
    if fused_ms > eager_ms:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert rt.fused_calls == 0
    else:
        assert rt.fused_calls == 2
    assert "timed once" in gemmfuse.explain(opt, print_it=False)


def test_first_call_inside_cuda_graph_capture_is_not_timed(monkeypatch):
    """A new signature's first call made while a CUDA graph is captured runs fused, untimed
    (timing synchronizes, which capture forbids), and replays correctly."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    monkeypatch.delenv("GEMMFUSE_TIMED_ROUTES", raising=False)
    _per_chain_timing_only(monkeypatch)
    model, inputs = _seed_gpu("m99", batch=256, k=1024, n=1024)
    eager = copy.deepcopy(model)
    opt = gemmfuse.optimize(model, inputs)
    static_x = torch.rand_like(inputs[0])
    with torch.no_grad():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = opt(static_x)
        torch.cuda.synchronize()
        static_x.copy_(torch.rand_like(static_x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, eager(static_x), rtol=1e-4, atol=1e-5)
    assert not gemmfuse.runtimes(opt)[0].timed


@pytest.mark.parametrize("fold", [False, True], ids=["linear", "linear-eval-bn"])
@pytest.mark.parametrize("M", [64, 512])
@pytest.mark.parametrize("precision", ["fp32", "fast", "tf32"])
def test_values_the_splits_cannot_carry(precision, M, fold):
    """inf, NaN, values past bf16's range and tiny ones in x and W reach Y as in eager fp32:
    the same NaN and infinity positions, the same signs, the finite values within 1e-4 of
    float64 (`fast` and `fp32` mark the rows they cannot carry and recompute them in fp32, or
    write NaN where they hold one; `fp32` adds a few infinities' products instead; M = 512
    takes the sm90 f16x3 GEMM in `fp32` and the split in `fast`; at M = 64 both run cuBLASLt's SGEMM,
    `fast` because its GEMM is too small for the split to pay)."""
    model, x = _exceptional_case(M, 1024, 4096, fold)
    ref64 = copy.deepcopy(model).double()
    opt = gemmfuse.optimize(copy.deepcopy(model), (torch.rand(M, 1024, device="cuda"),),
                            precision=precision)
    with torch.no_grad():
        out, eager, ref = opt(x), model(x), ref64(x.double())
    assert gemmfuse.runtimes(opt)[0].fallbacks == {}
    if precision == "fast":
        text = gemmfuse.explain(opt, print_it=False)
        assert ("recomputed in fp32" if M == 512 else "GFLOP: the split's launches") in text, text
    if precision == "fp32" and M == 512 and is_sm90():
        assert F16X3_TEXT in gemmfuse.explain(opt, print_it=False)
    assert torch.equal(torch.isnan(out), torch.isnan(eager)), (precision, torch.isnan(out).sum())
    assert torch.equal(torch.isinf(out), torch.isinf(eager)), (precision, torch.isinf(out).sum())
    assert torch.equal(out[torch.isinf(eager)], eager[torch.isinf(eager)])
    finite = torch.isfinite(eager)
    assert finite.sum() > M * 4096 // 2
    if precision != "tf32":  # TF32 is as loose as PyTorch's own
        assert_close64(out[finite], ref[finite], what=f"{precision} M={M} fold={fold}")


def _fp32_linear_against_float64(lin, x, what):
    """Runs `lin` on x as gemmfuse fp32 (the f16x3 path on sm90, no fallback) and checks it as
    faithful as eager fp32 against float64; returns (out, float64 reference)."""
    ref = copy.deepcopy(lin).double()(x.double())
    opt = gemmfuse.optimize(copy.deepcopy(lin), (x,), precision="fp32")
    if is_sm90():
        assert F16X3_TEXT in gemmfuse.explain(opt, print_it=False)
    with torch.no_grad():
        out, eager = opt(x), lin(x)
    assert gemmfuse.runtimes(opt)[0].fallbacks == {}
    assert_close64(out, ref, what=what)
    assert rel(out, ref) <= 1.25 * rel(eager, ref) + FP32_ULPS, (rel(out, ref), rel(eager, ref))
    return out, ref


@pytest.mark.parametrize("rows", [10, 512])
def test_fp32_tiny_values_beside_large_weights(rows):
    """fp32 mode on values more than 2^28 below their row's largest, which the f16x3 split
    leaves out of its parts: in `rows` rows of x three such values (1e-10 beside U[0,1)) where
    W's columns are 1e7 times its other values (not marked themselves), so their products are
    ~1e3 ulps of Y and must be added back. 10 rows hold 30 such values, at most K/32 = 32: the
    fix-up corrects them; 512 rows (and 200 more values in each of 4 rows) go through the
    second level, a split of those rows' tiny values and a GEMM of their own. As faithful as
    eager fp32 against float64, on the f16x3 path on an H100/H200."""
    M, K, N = 512, 1024, 4096
    lin = nn.Linear(K, N).cuda()
    big = [5, 300, 777]
    with torch.no_grad():
        lin.weight.copy_((torch.rand(N, K, device="cuda") * 0.5 + 0.5)
                         * torch.sign(torch.randn(N, K, device="cuda")))
        lin.weight[:, big] *= 1e7
    x = torch.rand(M, K, device="cuda")
    x[:, big] = 0.0  # other rows: no products with the large columns (they would swamp Y)
    x[:rows, big] = 1e-10 * torch.rand(rows, 3, device="cuda").add(1)
    if rows == M:
        x[40:44, 400:600] = 3e-11
    _, ref = _fp32_linear_against_float64(lin, x, f"fp32 tiny values in {rows} rows")
    tiny_part = (x[:, big].double() @ lin.weight[:, big].double().t()).abs()
    assert tiny_part.max() > 1e3 * 2.0 ** -24 * ref.abs().median()  # the products to bring back


@pytest.mark.parametrize("sigma", [2.0, 6.0])
def test_fp32_softmax_outputs_as_input(sigma):
    """A Linear fed softmax outputs (logits ~ N(0, sigma^2)): every row holds values far below
    its largest (down to ~2^-35 at sigma 2, past 2^-60 at 6), which fp32 mode's split carries
    through its second level. As faithful as eager fp32 against float64."""
    M, K, N = 512, 2048, 1024
    lin = nn.Linear(K, N).cuda()
    x = torch.softmax(sigma * torch.randn(M, K, device="cuda"), dim=1)
    _fp32_linear_against_float64(lin, x, f"fp32 softmax inputs, sigma {sigma}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(1024, 1024, 4096), (1000, 520, 8192)])
def test_fused_gemm_softmax_kernel(M, K, N, dtype):
    """m99's chain at shapes the sm90 fused kernel takes (one and two 128x256 tiles per CTA,
    a ragged M): explain says it runs, the error is no worse than eager's in the same dtype,
    and a graph replay equals the direct call. Elsewhere explain says why it does not run."""
    model, _ = make_seed("m99", batch=M, k=K, n=N, device="cuda")
    ref_model = copy.deepcopy(model).double()
    model = model.to(dtype)
    x = torch.rand(M, K, device="cuda")
    opt = gemmfuse.optimize(copy.deepcopy(model), (x.to(dtype),))
    text = gemmfuse.explain(opt, print_it=False)
    if not is_sm90():
        assert "fused sm90 GEMM + softmax kernel is not used" in text, text
    else:
        assert "run as one sm90 kernel" in text, text
    with torch.no_grad():
        out, ref, e = opt(x.to(dtype)), ref_model(x.double()), model(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel(out, ref) <= 1.25 * rel(e, ref) + 1e-4, (rel(out, ref), rel(e, ref))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    xs = x.to(dtype)
    with torch.cuda.stream(s), torch.no_grad():
        opt(xs)  # warm: plans and prepared weights exist before capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        graphed = opt(xs)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graphed, out, atol=0, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 4.0, 64.0])
def test_fused_gemm_softmax_input_scales(scale):
    """m99's chain in bf16 on inputs that give pre-activations far past the seed's (std 0.6 to
    37 instead of 0.3): the fused kernel's epilogue picks its gelu form from the data, and
    every form must keep the error no worse than eager's."""
    M, K, N = 1024, 1024, 4096
    model, _ = make_seed("m99", batch=M, k=K, n=N, device="cuda")
    ref_model = copy.deepcopy(model).double()
    model = model.to(torch.bfloat16)
    opt = gemmfuse.optimize(copy.deepcopy(model), (torch.rand(M, K, device="cuda").bfloat16(),))
    for _ in range(2):
        x = scale * torch.randn(M, K, device="cuda")
        with torch.no_grad():
            out, ref, e = opt(x.bfloat16()), ref_model(x.double()), model(x.bfloat16())
        assert torch.isfinite(out).all()
        assert rel(out, ref) <= 1.25 * rel(e, ref) + 1e-4, (scale, rel(out, ref), rel(e, ref))


@pytest.mark.parametrize("mid", ["m18", "m22", "m94", "m99"])
def test_cuda_graph_capture_replay(mid):
    model, inputs = _seed_gpu(mid)
    ref = copy.deepcopy(model).double()
    opt = gemmfuse.optimize(model, inputs, precision="fast")
    static_x = inputs[0].clone()
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                opt(static_x)              # warm-up: prepared weights, workspaces
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = opt(static_x)
        for _ in range(3):
            new = torch.rand_like(static_x)
            static_x.copy_(new)
            g.replay()
            torch.cuda.synchronize()
            assert_close64(static_out, ref(new.double()), what=f"{mid} graph replay")


@pytest.mark.parametrize("mid", seed_ids())
def test_weights_changed_after_optimize_cuda(mid):
    model, inputs = _seed_gpu(mid)
    opt = gemmfuse.optimize(model, inputs, precision="fast")
    x = inputs[0]
    with torch.no_grad():
        opt(x)
        lin = next(m for m in model.modules() if isinstance(m, nn.Linear))
        lin.weight.mul_(-0.5)
        lin.bias.add_(0.25)
        ref = copy.deepcopy(model).double()
        assert_close64(opt(x), ref(x.double()), what=f"{mid} after weight change")
        opt.load_state_dict(copy.deepcopy(make_seed(mid, batch=B, k=K, n=N, device="cuda", seed=7)[0].state_dict()))
        ref = copy.deepcopy(model).double()
        assert_close64(opt(x), ref(x.double()), what=f"{mid} after load_state_dict")


def test_devices_mismatch_clear_error():
    model, inputs = _seed_gpu("m99")
    opt = gemmfuse.optimize(model, inputs)
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device.*cpu.*cuda"):
        opt(inputs[0].cpu())
    cpu_model, cpu_inputs = make_seed("m99")
    opt_cpu = gemmfuse.optimize(cpu_model, cpu_inputs)
    with torch.no_grad(), pytest.raises(RuntimeError, match="same device.*cuda.*cpu"):
        opt_cpu(cpu_inputs[0].cuda())


def test_gpu_fuzz():
    """>= 200 random chains from test_fuzz's generator, run on CUDA."""
    import test_fuzz as T

    n = 208
    stats = {"fused": 0, "whole": 0, "pytorch": []}
    for i in range(n):
        idx = 100000 + i
        rng = random.Random(T.SEED * 1000003 + idx)
        program = T.gen_program(rng)
        Kf, Nf, M, lead, steps, bias = program
        torch.manual_seed(idx)
        model = T.FuzzModel(program, idx)
        x = torch.randn(*lead, M, Kf)
        ref_model = copy.deepcopy(model).double()
        model = model.cuda()
        eager = copy.deepcopy(model)
        xc = x.cuda()
        opt = gemmfuse.optimize(model, (xc,))
        with torch.no_grad():
            out = opt(xc)
            e32 = eager(xc)
            ref = ref_model(x.double())
        ok, msg = T._compare(out.cpu(), ref, e32.cpu())
        entry = opt._gemmfuse.entries[0] if opt._gemmfuse.entries else None
        assert ok, f"{msg}\nGPU fuzz seed={T.SEED} index={idx} x{list(x.shape)}\nspec:\n{entry.spec if entry else ''}program: {steps}"
        rts = gemmfuse.runtimes(opt)
        stats["fused"] += bool(rts) and rts[0].fused_calls == 1
    assert stats["fused"] >= 0.9 * n


@pytest.mark.parametrize("dynamic", [None, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("mid", seed_ids())
def test_compile_backend_cuda(mid, dynamic):
    """torch.compile(backend="gemmfuse") on CUDA: dynamo's graph (modules inlined, parameters
    as inputs) is captured and runs fused, in `fast` mode within 1e-4 of float64; with
    dynamic=True too (float attributes arrive as graph inputs, the batch size symbolic)."""
    from gemmfuse import reports as gf_reports
    torch._dynamo.reset()
    model, inputs = _seed_gpu(mid)
    ref = copy.deepcopy(model).double()
    compiled = torch.compile(model, backend="gemmfuse", options={"precision": "fast"},
                             dynamic=dynamic)
    with torch.no_grad():
        for step in range(2):
            x = torch.rand_like(inputs[0])
            if dynamic and step == 1:
                x = x[: x.shape[0] // 2 + 1]
            out = compiled(x)
            assert_close64(out, ref(x.double()), what=f"{mid} compiled step {step}")
            assert rel(out, ref(x.double())) <= 2e-5
    assert [e.status for e in gf_reports.COMPILED[-1].entries] == ["fused"]
    assert gemmfuse.fused_calls(compiled) >= 2
    torch._dynamo.reset()

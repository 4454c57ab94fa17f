"""gemmfuse.linear_cross_entropy (lm_head.py, bindings/linear_cross_entropy.cpp): an LM head's
Linear and cross-entropy loss in chunks of rows, without the [M, V] logits. Loss and the
gradients of x, weight and bias against float64 (F.cross_entropy of float64 copies), each
within 1.25x eager fp32's error; reductions, ignore_index, label smoothing, bias or none,
chunk sizes, 3-D inputs, empty batches, NaN rows, every row ignored; the products on gemmfuse's
GEMM; PyTorch's results where the op does not take the call; fake kernels and torch.compile."""
import pytest
import torch
import torch.nn.functional as F

import gemmfuse
from gemmfuse import lm_head
from conftest import HAVE_CUDA, assert_close64, needs_cuda, needs_lib, rel

pytestmark = needs_lib
DEVICES = ["cpu"] + (["cuda"] if HAVE_CUDA else [])
SLACK = 1e-7  # absolute slack on the relative error (as test_matmul_switch.py's)


def inputs(dev, lead, K, V, bias=True, ignored=(), ignore_index=-100, seed=0):
    """Fresh random x [*lead, K], W [V, K] (logits of a few units), b [V] or None and a target
    with the rows `ignored` (flat indices) set to ignore_index."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g)
    w = torch.randn(V, K, generator=g) * (3 / max(K, 1) ** 0.5)
    b = torch.randn(V, generator=g) if bias else None
    t = torch.randint(0, V, tuple(lead), generator=g)
    t.view(-1)[list(ignored)] = ignore_index
    to = (lambda a: None if a is None else a.to(dev))
    return to(x), to(w), to(b), to(t)


def eager(x, w, t, b=None, chunk_rows=None, precision=None, **kw):
    """What linear_cross_entropy computes, in PyTorch (with its logits)."""
    loss = F.cross_entropy(F.linear(x, w, b).reshape(-1, w.shape[0]), t.reshape(-1), **kw)
    return loss.reshape(t.shape) if kw.get("reduction") == "none" else loss


def loss_and_grads(fn, x, w, b, t, grad, dtype=None, **kw):
    """fn's loss and the gradients of x, w, b (None for a missing bias) for grad_output `grad`,
    on copies of the inputs (in `dtype` where given)."""
    leaves = [None if a is None else a.detach().to(dtype or a.dtype).requires_grad_() for a in (x, w, b)]
    loss = fn(leaves[0], leaves[1], t, leaves[2], **kw)
    loss.backward(grad.to(loss.dtype))
    return loss.detach(), [None if a is None else a.grad for a in leaves]


def grad_for(reduction, t, dev, seed=1):
    """A grad_output other than 1 (the backward must scale by it): a scalar, or one per row."""
    g = torch.Generator().manual_seed(seed)
    shape = t.shape if reduction == "none" else ()
    return (torch.rand(shape, generator=g) + 0.5).to(dev)


def assert_as_eager(got, fp32, ref, what):
    """got within 1.25x eager fp32's error against float64 (+ SLACK); NaN exactly where
    float64 has NaN."""
    assert got.dtype == torch.float32 and got.shape == ref.shape, what
    assert torch.equal(got.isnan().cpu(), ref.isnan().cpu()), f"{what}: NaN positions differ"
    keep = ~ref.isnan()
    err, eager_err = rel(got[keep], ref[keep]), rel(fp32[keep], ref[keep])
    assert err <= 1.25 * eager_err + SLACK, f"{what}: error {err:.3g}, eager fp32's {eager_err:.3g}"


def check_against_float64(x, w, b, t, reduction, **kw):
    """Loss and gradients of linear_cross_entropy against float64, as eager fp32 is."""
    grad = grad_for(reduction, t, x.device)
    kw = dict(reduction=reduction, **kw)
    got, got_g = loss_and_grads(gemmfuse.linear_cross_entropy, x, w, b, t, grad, **kw)
    fp32, fp32_g = loss_and_grads(eager, x, w, b, t, grad, **kw)
    ref, ref_g = loss_and_grads(eager, x, w, b, t, grad, dtype=torch.float64, **kw)
    assert_as_eager(got, fp32, ref, "loss")
    for name, a, e, r in zip(("dx", "dW", "db"), got_g, fp32_g, ref_g):
        if r is not None:
            assert_as_eager(a, e, r, name)
    return got, got_g


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64(dev, reduction, smoothing, bias):
    """45 rows in chunks of 16 (the last one shorter), three rows ignored."""
    x, w, b, t = inputs(dev, (45,), 32, 70, bias=bias, ignored=(0, 17, 44), seed=3)
    check_against_float64(x, w, b, t, reduction, label_smoothing=smoothing, chunk_rows=16)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("chunk_rows", [1, 7, 40, 1000, None])
def test_chunk_sizes(dev, chunk_rows):
    """One row a chunk, chunks not dividing M, one chunk of all rows, a chunk larger than M, the
    chosen size: the same function of the inputs."""
    x, w, b, t = inputs(dev, (40,), 24, 50, ignored=(5,), seed=4)
    for reduction in ("mean", "none"):
        check_against_float64(x, w, b, t, reduction, label_smoothing=0.1, chunk_rows=chunk_rows)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_three_dim_input(dev, reduction):
    """x [B, T, K] and target [B, T]: the rows flattened, a loss per token in target's shape."""
    x, w, b, t = inputs(dev, (3, 11), 16, 40, ignored=(2, 20), seed=5)
    got, grads = check_against_float64(x, w, b, t, reduction, chunk_rows=8)
    assert got.shape == (t.shape if reduction == "none" else ())
    assert grads[0].shape == x.shape


@pytest.mark.parametrize("dev", DEVICES)
def test_ignore_index_a_class(dev):
    """ignore_index may name a class: rows of that class count for nothing."""
    x, w, b, t = inputs(dev, (30,), 16, 20, seed=6)
    t[::4] = 7
    for reduction in ("mean", "sum"):
        check_against_float64(x, w, b, t, reduction, ignore_index=7, label_smoothing=0.1, chunk_rows=8)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_row_ignored(dev, reduction):
    """PyTorch's results: mean's 0/0 is NaN, sum 0, each row 0; every gradient zero."""
    x, w, b, t = inputs(dev, (12,), 8, 10, ignored=range(12), seed=7)
    grad = grad_for(reduction, t, dev)
    kw = dict(reduction=reduction, label_smoothing=0.1, chunk_rows=5)
    got, got_g = loss_and_grads(gemmfuse.linear_cross_entropy, x, w, b, t, grad, **kw)
    want, want_g = loss_and_grads(eager, x, w, b, t, grad, **kw)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan().all()) == (reduction == "mean")
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    for a, e in zip(got_g, want_g):
        assert torch.equal(a, e) and not a.any()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch(dev, reduction):
    """M = 0: mean NaN, sum 0, none empty (PyTorch's), and zero gradients of the inputs' shapes."""
    x, w, b, t = inputs(dev, (0,), 8, 10, seed=8)
    grad = grad_for(reduction, t, dev)
    got, got_g = loss_and_grads(gemmfuse.linear_cross_entropy, x, w, b, t, grad, reduction=reduction)
    want, want_g = loss_and_grads(eager, x, w, b, t, grad, reduction=reduction)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    for a, e in zip(got_g, want_g):
        assert a.shape == e.shape and torch.equal(a, e) and not a.any()


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nan_rows(dev, reduction):
    """A NaN in a counted row and in an ignored one: NaN where PyTorch gives NaN (the loss
    skips the ignored row, the gradients do not), the rest as close as eager's."""
    x, w, b, t = inputs(dev, (20,), 16, 30, ignored=(9,), seed=9)
    x[3, 5] = float("nan")
    x[9, 2] = float("nan")
    check_against_float64(x, w, b, t, reduction, label_smoothing=0.1, chunk_rows=6)


@pytest.mark.parametrize("dev", DEVICES)
def test_fast_precision(dev):
    """precision="fast": loss and gradients within its promise, atol = rtol = 1e-4 of float64
    (the CPU computes every mode in fp32)."""
    x, w, b, t = inputs(dev, (70,), 64, 96, ignored=(3,), seed=19)
    grad = grad_for("mean", t, dev)
    got, got_g = loss_and_grads(gemmfuse.linear_cross_entropy, x, w, b, t, grad,
                                precision="fast", chunk_rows=32)
    ref, ref_g = loss_and_grads(eager, x, w, b, t, grad, dtype=torch.float64)
    for name, a, r in zip(("loss", "dx", "dW", "db"), [got] + got_g, [ref] + ref_g):
        assert_close64(a, r, what=name)


@needs_cuda
def test_odd_vocabulary_stays_on_the_split_kernel():
    """V = 2050 (not a multiple of 8, as GPT-2's 50257): the logits' product (N = V) and dx's
    (K = V) run on the split kernel with the classes padded, and the loss and gradients are
    as eager's."""
    x, w, b, t = inputs("cuda", (1100,), 1024, 2050, ignored=(9,), seed=23)
    text = lm_head.describe(x, w, b, chunk_rows=512)
    assert "logits = x Wᵀ + b: gemmfuse (the split kernel)" in text, text
    assert "dx = dlogits W: gemmfuse (the split kernel)" in text, text
    check_against_float64(x, w, b, t, "mean", label_smoothing=0.1, chunk_rows=512)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_zero_in_features_run_on_at_mm(reduction):
    """K = 0 (the planner refuses such a Linear): the products run on at::mm, and the logits
    are the bias."""
    x, w, b, t = inputs("cpu", (9,), 0, 6, seed=10)
    text = lm_head.describe(x, w, b, chunk_rows=4)
    assert text.count("at::mm (") == 3 and "zero in or out features" in text
    got, got_g = loss_and_grads(gemmfuse.linear_cross_entropy, x, w, b, t, grad_for(reduction, t, "cpu"),
                                reduction=reduction, chunk_rows=4)
    want, want_g = loss_and_grads(eager, x, w, b, t, grad_for(reduction, t, "cpu"), reduction=reduction)
    torch.testing.assert_close(got, want)
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a, e)


def test_products_run_on_gemmfuse():
    """On the CPU every product of every chunk runs as a gemmfuse Linear: the logits' (per
    chunk), dx's and dW's (per chunk, while autograd records), the classes padded to a
    multiple of 8, counted by gemmfuse::calls."""
    K, V, M, C = 12, 26, 23, 10  # chunks of 10, 10, 3
    x, w, b, t = inputs("cpu", (M,), K, V, seed=11)
    text = lm_head.describe(x, w, b, chunk_rows=C)
    assert text.startswith(f"chunks of {C} rows: 3 for {M} rows, {V} classes")
    assert text.count("gemmfuse (the CPU executor") == 3, text
    # the classes padded with zero rows of W to a multiple of 8 (32 here): the logits' N, dx's K
    Vp = (V + 7) // 8 * 8
    specs = [f"linear in={K} out={Vp} bias=1", f"linear in={Vp} out={K} bias=0",
             f"linear in={C} out={K} bias=0", f"linear in=3 out={K} bias=0"]
    before = [torch.ops.gemmfuse.calls(s)[0] for s in specs]
    loss_and_grads(gemmfuse.linear_cross_entropy, x, w, b, t, torch.tensor(1.0), chunk_rows=C)
    after = [torch.ops.gemmfuse.calls(s)[0] for s in specs]
    assert [a - c for a, c in zip(after, before)] == [3, 3, 2, 1]
    with torch.no_grad():  # the loss alone: the logits' products only
        gemmfuse.linear_cross_entropy(x, w, t, b, chunk_rows=C)
    assert [torch.ops.gemmfuse.calls(s)[0] for s in specs] == [after[0] + 3] + after[1:]


def test_no_grad_and_frozen_inputs():
    """Nothing requires grad, or grad mode is off: the loss alone, no graph, the same value."""
    x, w, b, t = inputs("cpu", (25,), 16, 30, ignored=(1,), seed=12)
    want = gemmfuse.linear_cross_entropy(x, w.requires_grad_(), t, b, chunk_rows=8)
    with torch.no_grad():
        got = gemmfuse.linear_cross_entropy(x, w, t, b, chunk_rows=8)
    frozen = gemmfuse.linear_cross_entropy(x, w.detach(), t, b, chunk_rows=8)
    assert want.requires_grad and not got.requires_grad and not frozen.requires_grad
    assert torch.equal(got, want.detach()) and torch.equal(frozen, got)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_run_as_pytorch(dtype):
    """Not fp32: PyTorch's F.linear and F.cross_entropy, the same values to the bit."""
    x, w, b, t = inputs("cpu", (2, 9), 16, 20, ignored=(4,), seed=13)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    for reduction in ("mean", "none"):
        got = gemmfuse.linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=0.1)
        want = eager(x, w, t, b, reduction=reduction, label_smoothing=0.1)
        assert got.dtype == dtype and torch.equal(got, want)


def test_bad_inputs():
    x, w, b, t = inputs("cpu", (6,), 8, 10, seed=14)
    cases = [
        (lambda: gemmfuse.linear_cross_entropy(x, w, t.int(), b), RuntimeError, "int64 target"),
        (lambda: gemmfuse.linear_cross_entropy(x, w[:, :5], t, b), RuntimeError, "cannot be multiplied"),
        (lambda: gemmfuse.linear_cross_entropy(x, w, t, b[:4]), RuntimeError, "bias of shape"),
        (lambda: gemmfuse.linear_cross_entropy(x, w, t[:5], b), ValueError, "target of shape"),
        (lambda: gemmfuse.linear_cross_entropy(x, w, t, b, reduction="avg"), ValueError, "reduction"),
        (lambda: gemmfuse.linear_cross_entropy(x, w, t, b, precision="fp64"), ValueError, "precision"),
        (lambda: gemmfuse.linear_cross_entropy(x, w, t, b, label_smoothing=1.5), RuntimeError,
         "label_smoothing must be between"),
        (lambda: gemmfuse.linear_cross_entropy(x, w, t.clone().fill_(10), b), IndexError,
         "Target 10 is out of bounds"),
        (lambda: gemmfuse.linear_cross_entropy(x, w[:0], t, b[:0]), RuntimeError, "no classes"),
    ]
    for fn, kind, text in cases:
        with pytest.raises(kind, match=text):
            fn()


def test_fake_kernels_opcheck():
    """The ops' schemas and fake (Meta) kernels, as torch.library checks them, forward with and
    without gradients and the backward."""
    x, w, b, t = inputs("cpu", (9,), 8, 12, ignored=(2,), seed=15)
    ops = torch.ops.gemmfuse
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    for reduction in ("mean", "none"):
        for with_grads in (True, False):
            args = (x, w, b, t, -100, 0.1, reduction, "fp32", 4, with_grads)
            torch.library.opcheck(ops.linear_cross_entropy.default, args, test_utils=utils)
    grad = torch.rand(9) + 0.5
    torch.library.opcheck(ops.linear_cross_entropy_backward.default,
                          (grad, x, w, None, t, -100, 0.0, "none", "fp32", 4), test_utils=utils)


def test_compiles_whole():
    """torch.compile traces the function in one graph (the op opaque, its fake kernel giving
    the shapes): loss and gradients as the eager call's."""
    x, w, b, t = inputs("cpu", (2, 13), 16, 24, ignored=(3,), seed=16)
    fn = torch.compile(gemmfuse.linear_cross_entropy, backend="aot_eager", fullgraph=True)
    grad = torch.tensor(0.8)
    got, got_g = loss_and_grads(fn, x, w, b, t, grad, label_smoothing=0.1, chunk_rows=8)
    want, want_g = loss_and_grads(gemmfuse.linear_cross_entropy, x, w, b, t, grad,
                                  label_smoothing=0.1, chunk_rows=8)
    torch.testing.assert_close(got, want)
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a, e)


# On a GPU, shapes whose products can run on the split kernel (sm90) in chunks of the full
# size, whose preparation of W is kept between calls, and a shorter last chunk.
def train_shape(dev):
    if dev == "cuda":
        return dict(M=1100, K=1024, V=2048, chunk_rows=512)
    return dict(M=50, K=16, V=40, chunk_rows=16)


@pytest.mark.parametrize("dev", DEVICES)
def test_training_steps_follow_the_weight(dev):
    """Steps of AdamW(fused=True), which writes W without bumping its version: each step's loss
    and gradients are those of eager PyTorch on the same weights (a kept preparation of an
    earlier W would give the earlier W's logits)."""
    s = train_shape(dev)
    x, w, b, t = inputs(dev, (s["M"],), s["K"], s["V"], ignored=(7,), seed=17)
    ours = [torch.nn.Parameter(a.clone()) for a in (w, b)]
    theirs = [torch.nn.Parameter(a.clone()) for a in (w, b)]
    opts = [torch.optim.AdamW(p, lr=0.05, fused=True) for p in (ours, theirs)]
    for step in range(4):
        got = gemmfuse.linear_cross_entropy(x, ours[0], t, ours[1], chunk_rows=s["chunk_rows"])
        want = eager(x, theirs[0], t, theirs[1])
        got.backward()
        want.backward()
        # (a stale W, one step behind, would be off by far more: each step moves every weight
        # by about lr)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5)
            q.grad = p.grad.clone()  # the same step for both
        for o in opts:
            o.step()
            o.zero_grad()


@needs_cuda
def test_cuda_describe_names_the_kernels():
    s = train_shape("cuda")
    x, w, b, _ = inputs("cuda", (s["M"],), s["K"], s["V"], seed=18)
    text = lm_head.describe(x, w, b, chunk_rows=s["chunk_rows"])
    assert text.count("gemmfuse (") == 3, text

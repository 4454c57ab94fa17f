"""The five seed models, optimized, against the same model in float64 (small shapes)."""
import copy

import pytest
import torch

import gemmfuse
from conftest import assert_close64, double_ref, explain_block, make_seed, needs_lib, seed_ids

pytestmark = needs_lib
PRECISIONS = ["fp32", "fast", "tf32"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mid", seed_ids())
def test_seed_vs_float64(mid, precision):
    model, inputs = make_seed(mid)
    ref = double_ref(model)
    opt = gemmfuse.optimize(model, inputs, precision=precision)
    rts = gemmfuse.runtimes(opt)
    assert len(rts) == 1, gemmfuse.explain(opt, print_it=False)
    with torch.no_grad():
        for step in range(2):
            x = torch.rand_like(inputs[0])
            out = opt(x)
            expect = ref(x.double())
            assert out.dtype == torch.float32
            assert_close64(out, expect, what=f"{mid} {precision} call {step}")
    assert rts[0].fused_calls == 2 and rts[0].fallbacks == {}, rts[0].fallbacks


def test_m84_running_stats_follow_pytorch():
    model, inputs = make_seed("m84")
    eager = copy.deepcopy(model)
    ref = double_ref(model)
    opt = gemmfuse.optimize(model, inputs)
    # optimize() must not have touched the statistics.
    assert int(model.bn.num_batches_tracked) == 0
    assert torch.equal(model.bn.running_mean, torch.zeros(160))
    with torch.no_grad():
        for _ in range(2):
            x = torch.rand_like(inputs[0])
            out = opt(x)
            assert_close64(out, ref(x.double()), what="m84")
            eager(x)
    bn, ebn = model.bn, eager.bn
    assert opt.bn is bn
    assert int(bn.num_batches_tracked) == int(ebn.num_batches_tracked) == 2
    torch.testing.assert_close(bn.running_mean, ebn.running_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(bn.running_var, ebn.running_var, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(bn.running_mean.double(), ref.bn.running_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(bn.running_var.double(), ref.bn.running_var, atol=1e-6, rtol=1e-5)
    assert gemmfuse.runtimes(opt)[0].fallbacks == {}


def test_m84_eval_mode_uses_running_stats():
    model, inputs = make_seed("m84")
    opt = gemmfuse.optimize(model, inputs)
    with torch.no_grad():
        opt(torch.rand_like(inputs[0]))           # train: updates stats
        opt.eval()
        assert not model.bn.training              # the same module object
        ref = double_ref(model)
        before = model.bn.running_mean.clone()
        x = torch.rand_like(inputs[0])
        assert_close64(opt(x), ref(x.double()), what="m84 eval")
        assert torch.equal(model.bn.running_mean, before)
        assert int(model.bn.num_batches_tracked) == 1
        opt.train()
        opt(x)
        assert int(model.bn.num_batches_tracked) == 2
    rt = gemmfuse.runtimes(opt)[0]
    assert rt.fused_calls == 3 and rt.fallbacks == {}
    text = gemmfuse.explain(opt, print_it=False)
    assert "batch_norm training=1" in text


def test_m94_second_bias_is_used():
    model, inputs = make_seed("m94")
    opt = gemmfuse.optimize(model, inputs)
    with torch.no_grad():
        model.bias.add_(torch.randn(256) * 3)      # the second bias changes after optimize
        ref = double_ref(model)
        x = torch.rand_like(inputs[0])
        assert_close64(opt(x), ref(x.double()), what="m94")
        out0 = opt(x)
        model.bias.zero_()
        out1 = opt(x)
        assert not torch.allclose(out0, out1)
        assert_close64(out1, double_ref(model)(x.double()), what="m94 zero bias")


def test_explain_m18_gemv():
    model, inputs = make_seed("m18")
    text = gemmfuse.explain(model, inputs, print_it=False)
    assert "FUSED" in text
    low = text.lower()
    assert "gemv" in low and ("column sum" in low or "colsum" in low), text


def test_explain_m22_times_four():
    model, inputs = make_seed("m22")
    opt = gemmfuse.optimize(model, inputs)
    text = gemmfuse.explain(opt, print_it=False)
    assert "FUSED" in text
    assert "x*4" in text.replace(" ", "") or "mul b=4" in text, text


def test_explain_gives_the_plan_at_each_input_shape():
    """Plans depend on the call's shape (and on BatchNorm's mode): explain lists each input
    signature the chain ran fused with, latest last, with the plan at it, and no more than
    ChainRuntime.SEEN_MAX of them."""
    model, inputs = make_seed("m84")
    opt = gemmfuse.optimize(model, inputs)
    assert "fused calls by input" not in gemmfuse.explain(opt, print_it=False)
    rows = inputs[0].shape[0]
    k = inputs[0].shape[1]
    with torch.no_grad():
        opt(*inputs)
        opt(torch.rand(rows + 5, k))
        opt.eval()
        opt(torch.rand(rows + 5, k))
        opt.train()
    text = gemmfuse.explain(opt, print_it=False)
    head = "    x [{}, {}] torch.float32 on cpu (training: bn={})"
    same = explain_block(text, head.format(rows, k, True))
    assert same == [head.format(rows, k, True) + ": the plan above"], same
    wider = "\n".join(explain_block(text, head.format(rows + 5, k, True)))
    assert f"[{rows + 5}x{k}]" in wider and f"over {rows + 5} rows" in wider, wider
    folded = "\n".join(explain_block(text, head.format(rows + 5, k, False)))
    assert "BN folded" in folded and "ColumnStats" not in folded, folded
    order = [text.index(head.format(r, k, t)) for r, t in
             ((rows, True), (rows + 5, True), (rows + 5, False))]
    assert order == sorted(order), text

    limit = gemmfuse.runtimes(opt)[0].SEEN_MAX
    with torch.no_grad():
        for extra in range(1, limit + 2):
            opt(torch.rand(rows + 10 + extra, k))
    text = gemmfuse.explain(opt, print_it=False)
    listed = [line for line in text.splitlines() if line.startswith("    x [")]
    assert len(listed) == limit, listed
    assert listed[-1].startswith(head.format(rows + 11 + limit, k, True)), listed


@pytest.mark.parametrize("mid", seed_ids())
def test_explain_lists_nodes_and_spec(mid):
    model, inputs = make_seed(mid)
    opt = gemmfuse.optimize(model, inputs)
    with torch.no_grad():
        opt(*inputs)
    text = gemmfuse.explain(opt, print_it=False)
    assert "replaces these PyTorch nodes" in text and "linear in=96" in text
    assert "plan:" in text and "1 fused call(s)" in text and "fallbacks to PyTorch: none" in text


class MatmulHalfSumScale(torch.nn.Module):
    """torch.matmul(x, W.T) / 2 -> sum(dim=1) -> * s (issue 47: scalars between the product and
    the sum used to keep it a GEMM)."""

    def __init__(self, k=64, n=48):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k) / k ** 0.5)

    def forward(self, x):
        return ((torch.matmul(x, self.weight.T) / 2 - 1).sum(dim=1) * 3)


def test_scalars_between_the_product_and_a_sum_still_give_the_gemv():
    torch.manual_seed(0)
    model = MatmulHalfSumScale()
    x = torch.randn(32, 64)
    opt = gemmfuse.optimize(model, (x,))
    text = gemmfuse.explain(opt, print_it=False)
    assert "sum moved before" in text and "GEMV" in text, text
    for _ in range(3):
        x = torch.randn(32, 64)
        assert_close64(opt(x), double_ref(model)(x.double()), what="x W^T / 2 - 1, sum, * 3")


def test_scalars_over_a_sum_train_as_eager():
    """The hoisted GEMV's gradients (weight and x) against float64."""
    torch.manual_seed(1)
    model = MatmulHalfSumScale()
    ref = double_ref(model)
    opt = gemmfuse.optimize(model, (torch.randn(16, 64),))
    x = torch.randn(16, 64, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    g = torch.randn(16)
    opt(x).backward(g)
    ref(xd).backward(g.double())
    assert_close64(x.grad, xd.grad, what="dx")
    assert_close64(model.weight.grad, ref.weight.grad, what="dW")
    assert gemmfuse.runtimes(opt)[0].train_calls == 1

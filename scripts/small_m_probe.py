"""Small-M fp32 GEMM paths at the seed shape: m99 (gelu -> softmax) with x and W 16-byte
aligned (x read in place), x one element off (one shifted copy of x), W one element off (one
copy) and K = 8191 (W rows at every shift: four copies, masked tails): gemmfuse fp32 against
eager, CUDA events over batches of back-to-back calls, inputs rotated, error vs float64.
Usage: python scripts/small_m_probe.py [M ...]"""
import copy
import statistics
import sys

import torch

import gemmfuse
from gemmfuse.models import M99


def timed(fn, xs, reps=30, batch=10):
    """Median per-call time of `reps` batches of `batch` back-to-back calls (launch latency
    hidden), inputs rotated."""
    for x in xs:
        fn(x)
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for j in range(batch):
            fn(xs[(i + j) % len(xs)])
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / batch)
    return statistics.median(ts)


def rel(o, r):
    return float((o.double() - r).norm() / r.norm())


for M in [int(v) for v in (sys.argv[1:] or ["1", "4", "8", "16"])]:
    for K, x_off, w_off in ((8192, 0, 0), (8192, 1, 0), (8192, 0, 1), (8191, 0, 0)):
        torch.manual_seed(M)
        model = M99(K, 8192).cuda()
        ours = copy.deepcopy(model)
        if w_off:  # the same weights, one element past a 16-byte boundary
            wbuf = torch.empty(8192 * K + w_off, device="cuda")
            wbuf[w_off:].copy_(model.linear.weight.detach().flatten())
            ours.linear.weight.data = wbuf[w_off:].view(8192, K)
        bufs = [torch.randn(M * K + 1, device="cuda") for _ in range(3)]
        xs = [b[x_off:x_off + M * K].view(M, K) for b in bufs]
        ref = copy.deepcopy(model).double()
        opt = gemmfuse.optimize(ours, (xs[0],), precision="fp32")
        assert ours.linear.weight.data_ptr() % 16 == 4 * w_off
        with torch.no_grad():
            r = ref(xs[0].double())
            e_err, g_err = rel(model(xs[0]), r), rel(opt(xs[0]), r)
            te, tg = timed(model, xs), timed(opt, xs)
        print(f"M={M:2d} K={K} x_off={x_off} w_off={w_off}: eager {te:7.1f} us err {e_err:.2e} | "
              f"gemmfuse {tg:7.1f} us err {g_err:.2e} | {te / tg:.2f}x, err ratio {g_err / e_err:.2f}")

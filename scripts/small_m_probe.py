"""Small-M fp32 GEMM paths at the seed shape: m99 (gelu -> softmax) with x 16-byte aligned
(16-byte loads) and one element off (4-byte loads), and K = 8191 (4-byte loads, masked tail):
gemmfuse fp32 against eager, CUDA events over batches of back-to-back calls, inputs rotated,
error vs float64."""
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
    for K, off in ((8192, 0), (8192, 1), (8191, 0)):
        torch.manual_seed(M)
        model = M99(K, 8192).cuda()
        bufs = [torch.randn(M * K + 1, device="cuda") for _ in range(3)]
        xs = [b[off:off + M * K].view(M, K) for b in bufs]
        ref = copy.deepcopy(model).double()
        opt = gemmfuse.optimize(copy.deepcopy(model), (xs[0],), precision="fp32")
        with torch.no_grad():
            r = ref(xs[0].double())
            e_err, g_err = rel(model(xs[0]), r), rel(opt(xs[0]), r)
            te, tg = timed(model, xs), timed(opt, xs)
        print(f"M={M:2d} K={K} x_off={off}: eager {te:7.1f} us err {e_err:.2e} | "
              f"gemmfuse {tg:7.1f} us err {g_err:.2e} | {te / tg:.2f}x, err ratio {g_err / e_err:.2f}")

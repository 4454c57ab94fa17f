"""Where a small fused call's time goes on the host: per-call wall time of layers of the call
path, against the GPU time of the same work (CUDA-graph replay, so no launch gaps).
Used for m18, whose GEMV is ~15 us of GPU work: there the host path sets the time.
    PYTHONPATH=python python3 scripts/host_overhead.py [--model m18]
"""
import argparse
import time

import torch

import gemmfuse
from gemmfuse.models import MODELS


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def graph_us(fns, n=201):
    """GPU time per call: CUDA-graph replay (no launch gaps), cycling through one graph per fn
    (one per input set, so x comes from HBM, not L2, when the sets are larger than L2)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            for fn in fns:
                fn()
    torch.cuda.synchronize()
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for g in graphs:
        g.replay()
    a.record()
    for i in range(n):
        graphs[i % len(graphs)].replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3


def bench_style_us(fn, xs):
    """The bench's own timing of short calls (gemmfuse.bench.time_calls): batches of
    back-to-back calls between CUDA events, input sets rotated; median us per call."""
    from gemmfuse.bench import time_calls
    r = time_calls(fn, [[x] for x in xs], warmup=10, repeats=20, dev=xs[0].device)
    return r["ms"] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="m18")
    args = ap.parse_args()
    model, inputs = MODELS[args.model].make(device="cuda")
    opt = gemmfuse.optimize(model, inputs, precision="fp32")
    x = inputs[0]
    # The bench's input sets: 3 of them, 3 x 33.6 MB against a 50 MB L2.
    xs = [x] + [torch.rand_like(x) for _ in range(2)]
    rt = gemmfuse.runtimes(opt)[0]
    lin = model.linear
    spec = next(iter(rt.specs.values())) if len(rt.specs) == 1 else None
    small = torch.rand(16, device="cuda")
    rows = []
    with torch.no_grad():
        rows.append(("torch.add on 16 floats (dispatch floor)", per_call_us(lambda: torch.add(small, 1))))
        if spec is not None:
            op = torch.ops.gemmfuse.run.default
            rows.append(("torch.ops.gemmfuse.run", per_call_us(
                lambda: op(spec, x, lin.weight, lin.bias, [], [], "fp32"))))
        rows.append(("optimized module", per_call_us(lambda: opt(x))))
        it = iter(range(1 << 62))
        rows.append(("optimized module, 3 inputs rotated", per_call_us(
            lambda: opt(xs[next(it) % 3]))))
        rows.append(("eager model", per_call_us(lambda: model(x), n=50)))
        rows.append(("GPU time of the optimized module (graph replay, one x: in L2)",
                     graph_us([lambda: opt(x)])))
        rows.append(("GPU time, 3 inputs rotated (x from HBM)",
                     graph_us([lambda xi=xi: opt(xi) for xi in xs])))
        rows.append(("bench timing (batched events), one x", bench_style_us(opt, [x])))
        rows.append(("bench timing (batched events), 3 inputs rotated", bench_style_us(opt, xs)))
        if spec is not None:
            rows.append(("bench timing of the op alone, 3 inputs rotated", bench_style_us(
                lambda xi: op(spec, xi, lin.weight, lin.bias, [], [], "fp32"), xs)))
    for name, us in rows:
        print(f"{name:55s} {us:9.1f} us")


if __name__ == "__main__":
    main()

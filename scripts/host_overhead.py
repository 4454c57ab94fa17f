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


def graph_us(fn, n=200):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    for _ in range(n):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="m18")
    args = ap.parse_args()
    model, inputs = MODELS[args.model].make(device="cuda")
    opt = gemmfuse.optimize(model, inputs, precision="fp32")
    x = inputs[0]
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
        rows.append(("eager model", per_call_us(lambda: model(x), n=50)))
        rows.append(("GPU time of the optimized module (graph replay)", graph_us(lambda: opt(x))))
    for name, us in rows:
        print(f"{name:55s} {us:9.1f} us")


if __name__ == "__main__":
    main()

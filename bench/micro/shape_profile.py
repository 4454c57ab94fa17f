"""Where a fused chain's forward time goes at the zoo's shapes where the timed route chose
PyTorch (docs/measurements.md, the zoo section): torch.profiler over the fused op (fp32,
GEMMFUSE_ALWAYS_FUSE) and eager, kernels by CUDA time per call, plus each side's time per
call from CUDA events around back-to-back calls and the host time of issuing one call.
Answers whether the fused path loses in its GEMM, its splits and fix-up, a separate row pass,
or its host time.
Usage: python3 -m bench.micro.shape_profile [MxKxN:act ...]  (default: the zoo's shapes)"""
import os
import sys
import time

os.environ.setdefault("GEMMFUSE_ALWAYS_FUSE", "1")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import gemmfuse  # noqa: E402
from bench.micro.train_profile import kernel_rows  # noqa: E402

CALLS = 20
# (M, K, N, activation): deep-mlp large, pinn large, dlrm large, swin-mlp large fc1, the
# mixer's token mixing, and m99's shape for reference.
SHAPES = [(1024, 1024, 1024, "relu"), (16384, 256, 256, "tanh"), (65536, 512, 512, "relu"),
          (100352, 192, 768, "gelu"), (32768, 256, 512, "gelu"), (1024, 8192, 8192, "relu")]
ACTS = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh, "gelu": torch.nn.GELU}


def per_call_ms(fn, x, calls=CALLS):
    """CUDA events around `calls` back-to-back calls: ms per call (sustained)."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn(x)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / calls


def host_us(fn, x, calls=CALLS):
    """Wall time of issuing one call while the GPU is kept busy (a sleep kernel ahead)."""
    torch.cuda._sleep(int(2e8))
    t = time.perf_counter()
    for _ in range(calls):
        fn(x)
    us = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return us


def kernels(fn, x):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn(x)
        torch.cuda.synchronize()
    return kernel_rows(prof, CALLS)


def main(shapes):
    dev = torch.device("cuda")
    for m, k, n, act in shapes:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(k, n), ACTS[act]()).to(dev)
        x = torch.rand(m, k, device=dev)
        with torch.no_grad():
            opt = gemmfuse.optimize(model, (x,))
            gflop = 2 * m * k * n / 1e9
            print(f"\n== {m}x{k}x{n} {act}: {gflop:.2f} GFLOP")
            for name, fn in (("eager", model), ("fused", opt)):
                ms = per_call_ms(fn, x)
                print(f"{name}: {ms:.4f} ms per call ({gflop / ms:.1f} TFLOP/s), "
                      f"host {host_us(fn, x):.1f} us per call")
                for t, c, key in kernels(fn, x)[:8]:
                    print(f"  {t:8.4f} ms  x{c:<2d} {key[:110]}")


def _parse(arg):
    dims, act = arg.split(":")
    m, k, n = (int(v) for v in dims.split("x"))
    return m, k, n, act


if __name__ == "__main__":
    main([_parse(a) for a in sys.argv[1:]] or SHAPES)

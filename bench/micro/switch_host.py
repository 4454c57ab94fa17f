"""Host time of one small product inside gemmfuse.fp32_matmul, against the plain call and a
do-nothing TorchDispatchMode: what the switch's Python layer costs a launch-bound call.
The switch declines these products (CPU operands with the switch on CUDA; or on CUDA, shapes
off the split kernel), so the figures are the mode and its checks, not a kernel.

    python3 -m bench.micro.switch_host [--device cpu|cuda] [--size 8] [--calls 20000]
"""
import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gemmfuse


class _Nothing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_call_us(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    a = torch.randn(args.size, args.size, device=args.device)
    b = torch.randn(args.size, args.size, device=args.device)
    # On the CPU the switch covers CUDA only, so it declines at its first check.
    switch, nothing = gemmfuse.fp32_matmul(devices=("cuda",)), _Nothing()

    def inside(mode):
        def call():
            with mode:
                return a @ b
        return call

    for name, fn in (("plain a @ b", lambda: a @ b), ("do-nothing dispatch mode", inside(nothing)),
                     ("fp32_matmul, declined", inside(switch))):
        us = per_call_us(fn, args.calls)  # issue time: on CUDA the products queue, unsynced
        print(f"{name:28s} {us:7.2f} us a call")


if __name__ == "__main__":
    main()

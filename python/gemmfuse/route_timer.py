"""Never slower than PyTorch: at a new input signature, a chain the planner would fuse is timed
fused and in PyTorch (its own nodes) once, and the faster runs from then on. The planner's cost
rules decide first (where PyTorch is known to be faster the call never reaches the timer); the
timer covers what they do not model (small or oddly shaped GEMMs, 16-bit chains, launch-bound
calls). ``timer`` is the function that measures: tests replace it."""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch


def timed_routes_on(device: torch.device) -> bool:
    """GEMMFUSE_TIMED_ROUTES=0 turns the timing off, =1 on for every device; by default it is on
    for CUDA. On the CPU the planner's rules route (the CPU GEMM is PyTorch's own BLAS call)."""
    v = os.environ.get("GEMMFUSE_TIMED_ROUTES")
    if v is not None:
        return v != "0"
    return device.type == "cuda"


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, runs: int = 7) -> float:
    """The median of `runs` calls of fn in milliseconds after `warmup` calls: CUDA events around
    each call on a GPU (launch and host time included where the GPU waits for them), the wall
    clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(runs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(runs):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


timer: Callable[[Callable[[], object], torch.device], float] = median_ms

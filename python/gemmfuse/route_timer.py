"""Never slower than PyTorch: at a new input signature, a chain the planner would fuse is timed
fused and in PyTorch (its own nodes) once, and the faster runs from then on. The planner's cost
rules decide first (where PyTorch is known to be faster the call never reaches the timer); the
timer covers what they do not model (small or oddly shaped GEMMs, 16-bit chains, launch-bound
calls). ``timer`` is the function that measures: tests replace it."""
from __future__ import annotations

import gc
import math
import os
import statistics
import time
from typing import Callable

import torch


def always_fuse() -> bool:
    """GEMMFUSE_ALWAYS_FUSE=1 runs everything the planner takes on gemmfuse, also where PyTorch
    is expected or timed faster (the CPU tests use it to exercise the CPU executor)."""
    return os.environ.get("GEMMFUSE_ALWAYS_FUSE") == "1"


def timed_routes_on(device: torch.device) -> bool:
    """GEMMFUSE_TIMED_ROUTES=0 turns the timing off, =1 on for every device; by default it is on
    for CUDA. On the CPU the planner's rules route (the CPU GEMM is PyTorch's own BLAS call)."""
    v = os.environ.get("GEMMFUSE_TIMED_ROUTES")
    if v is not None:
        return v != "0"
    return device.type == "cuda"


def whole_timed_on(device: torch.device) -> bool:
    """Whether a whole compiled graph or optimized module is timed with its fused chains
    against without them: where chains are timed (tests turn this one on alone)."""
    return timed_routes_on(device)


# A call shorter than this is timed in batches of back-to-back calls (here and in the bench's
# CallTimer): alone it mostly measures the idle GPU waiting for its launch.
BATCH_BELOW_MS = 0.5


def calls_per_batch(one_call_ms: float) -> int:
    """Back-to-back calls per timed batch for a call of `one_call_ms` (1: timed alone)."""
    if one_call_ms >= BATCH_BELOW_MS:
        return 1
    return max(2, int(2 * BATCH_BELOW_MS / max(one_call_ms, 1e-3)))


# Untimed calls before a GPU timing: at least this much of them (the bench's default for each
# variant too, bench/timing.py): after a compile the GPU sits idle at a low clock, and the
# first side timed would otherwise pay the clock's ramp that the second does not.
WARMUP_MS = 20.0
MAX_WARMUP_CALLS = 500


def warm_up(fn: Callable[[], object], device: torch.device, warmup: int) -> None:
    """`warmup` calls, then on a GPU more, until about WARMUP_MS of them have run."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one_ms = (time.perf_counter() - t) * 1e3
    for _ in range(min(MAX_WARMUP_CALLS, math.ceil(WARMUP_MS / max(one_ms, 1e-3)) - 1)):
        fn()


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, runs: int = 7) -> float:
    """fn's time per call in milliseconds after warm_up (`warmup` calls, on a GPU at least
    WARMUP_MS of them): on a GPU the median of `runs` calls each between two CUDA events;
    where that is under BATCH_BELOW_MS (a call then mostly measures the idle GPU waiting for
    its launch), the median of `runs` batches of back-to-back calls per call, as the bench
    times such calls (sustained throughput). On the CPU the wall clock of single calls. No
    garbage collection inside the timed calls."""
    warm_up(fn, device, warmup)
    gc_on = gc.isenabled()
    gc.disable()
    try:
        if device.type != "cuda":
            times = []
            for _ in range(runs):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return statistics.median(times)
        one = statistics.median(_cuda_batches(fn, 1, runs))
        per = calls_per_batch(one)
        return one if per == 1 else statistics.median(_cuda_batches(fn, per, runs))
    finally:
        if gc_on:
            gc.enable()


def _cuda_batches(fn, per: int, runs: int) -> list:
    """`runs` batches of `per` back-to-back calls, each between two CUDA events: ms per call."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(runs)]
    for start, end in events:
        start.record()
        for _ in range(per):
            fn()
        end.record()
    events[-1][1].synchronize()
    return [start.elapsed_time(end) / per for start, end in events]


timer: Callable[[Callable[[], object], torch.device], float] = median_ms


# Where gemmfuse's way and PyTorch's were timed at a signature: "" (gemmfuse) or why PyTorch.
_timed: dict = {}
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not fake (torch.compile's tracing) or subclassed


def timed_choice(key, ours: Callable[[], object], theirs: Callable[[], object], x) -> str:
    """'' where gemmfuse's way (`ours`) timed at least as fast as PyTorch's (`theirs`) at this
    signature (`key`), else why PyTorch runs it: timed once per signature with `timer`, kept
    for the process; a kept choice holds in CUDA graph capture too. Untimed, '': where routes
    are untimed on x's device, fake tensors, GEMMFUSE_ALWAYS_FUSE=1, and a signature first met
    in capture."""
    if type(x) not in _PLAIN or not timed_routes_on(x.device) or always_fuse():
        return ""
    got = _timed.get(key)
    if got is None and x.is_cuda and torch.cuda.is_current_stream_capturing():
        return ""
    if got is None:
        ours_ms, theirs_ms = timer(ours, x.device), timer(theirs, x.device)
        got = "" if ours_ms <= theirs_ms else (
            f"PyTorch timed faster at this shape ({theirs_ms:.3f} ms against gemmfuse's "
            f"{ours_ms:.3f} ms)")
        _timed[key] = got
    return got

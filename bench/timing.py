"""Timing GPU and CPU calls for the benchmark: CallTimer (rounds of warm-up and timed calls,
CUDA events, short calls in back-to-back batches), one batch size for every variant of a
comparison (share_batching), and the device helpers the runners share."""
from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from gemmfuse import route_timer
from gemmfuse.route_timer import calls_per_batch


# The least GPU time of warm-up calls per round after the first (see CallTimer.round);
# `python -m bench --warmup-ms` sets it per run (5000: each variant timed at the clock the chip
# settles to under its own sustained load; docs/measurements.md). The same default as the
# product's own timed routes (gemmfuse.route_timer.WARMUP_MS).
WARMUP_MS = route_timer.WARMUP_MS


# Each round times at least this much of a short call's batches: ten batches of a 0.4 ms call
# are 8 ms, within which a host-bound call's time moves by 10% from run to run (the zoo's
# launch-bound rows); longer calls keep `repeats`.
MIN_BATCHED_MS = 50.0


# ----------------------------------------------------------------------------------- helpers
def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


class CallTimer:
    """Times one callable `fn(*sets[i % len(sets)])` over one or more rounds; the bench
    alternates the rounds of every variant of a model (see measure_all), so that slow drifts
    of the GPU's clock and temperature fall on all of them alike.

    Each round: warm-up calls (`warmup`, or more: see round), then `repeats` timed calls.
    On a GPU each call is timed alone between two CUDA events (`ms_latency`). A call shorter
    than its own host path (m18's GEMV: ~10 us of GPU work behind ~17 us of Python and
    dispatch) then measures the idle GPU waiting for the launch, not the work; such calls
    (decided in the first round, or for every variant of a comparison by share_batching)
    are also timed in batches of back-to-back calls between two events, `repeats` batches
    or more (at least MIN_BATCHED_MS of them), and `ms` is the median batch time per call
    (sustained throughput, inputs still rotated). For longer calls the two agree and `ms` is
    the per-call median over every round."""

    def __init__(self, fn, sets, dev, tick=lambda: None):
        self.fn, self.sets, self.dev, self.tick = fn, sets, dev, tick
        self.latency, self.batched, self.per, self.round_ms = [], [], None, []
        self.windows = []  # GPU: (t0, t1) time.time() around each round's timed calls

    def _timed(self, per, repeats):
        fn, sets = self.fn, self.sets
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(repeats)]
        # No progress ticks inside the timed loop: host work between calls would idle the GPU.
        for r, (a, b) in enumerate(evs):
            a.record()
            for j in range(per):
                fn(*sets[(r * per + j) % len(sets)])
            b.record()
        sync(self.dev)
        return [a.elapsed_time(b) / per for a, b in evs]

    def probe(self, warmup, calls=5):
        """The batch size this call would pick alone (route_timer.calls_per_batch of its
        median single-call time after `warmup` calls); 1 off the GPU."""
        if self.dev.type != "cuda":
            return 1
        for i in range(warmup):
            self.fn(*self.sets[i % len(self.sets)])
        sync(self.dev)
        return calls_per_batch(statistics.median(self._timed(1, calls)))

    def round(self, warmup, repeats, warmup_ms=WARMUP_MS):
        fn, sets = self.fn, self.sets
        # After the first round, on a GPU, at least warmup_ms of calls, so that this variant
        # is not timed at the previous one's clock (`warmup` calls of a 0.2 ms variant after a
        # 2.7 ms one would be). 20 ms moves the clock most of the way; under a power cap it
        # settles only over seconds, as the chip warms (docs/measurements.md).
        calls = warmup
        if self.dev.type == "cuda" and self.round_ms:
            calls = max(warmup, math.ceil(warmup_ms / max(self.round_ms[0], 1e-3)))
        for i in range(calls):
            fn(*sets[i % len(sets)])
            if i < warmup:  # the progress bar counts `warmup` calls per round
                self.tick()
        sync(self.dev)
        if self.dev.type != "cuda":
            ms = []
            for i in range(repeats):
                t0 = time.perf_counter()
                fn(*sets[i % len(sets)])
                ms.append((time.perf_counter() - t0) * 1e3)
                self.tick()
            self.latency += ms
            self.round_ms.append(statistics.median(ms))
            return
        # Like timeit: no garbage collection inside timed regions (a collection there is a
        # host stall that a short call would show as its own time).
        gc_on = gc.isenabled()
        gc.disable()
        t0 = time.time()
        try:
            latency = self._timed(1, repeats)
            if self.per is None:
                self.per = calls_per_batch(statistics.median(latency))
            batches = max(repeats, min(20 * repeats, math.ceil(
                MIN_BATCHED_MS / max(self.per * statistics.median(latency), 1e-3))))
            batched = self._timed(self.per, batches) if self.per > 1 else None
        finally:
            if gc_on:
                gc.enable()
        self.windows.append((t0, time.time()))
        for _ in range(repeats):
            self.tick()
        self.latency += latency
        if batched is not None:
            self.batched += batched
        self.round_ms.append(statistics.median(batched if batched is not None else latency))

    def summary(self):
        rounds = len(self.round_ms)
        where = f", {rounds} rounds" if rounds > 1 else ""
        if self.dev.type != "cuda":
            out = _summary(self.latency, "per call, host clock" + where)
        else:
            out = _summary(self.latency, "per call (CUDA events around each call)" + where)
            out["ms_latency"] = out["ms"]
            if self.batched:
                out.update(_summary(self.batched, f"batches of {self.per} back-to-back calls "
                                                  f"(CUDA events around each batch)" + where))
        if rounds > 1:
            out["ms_rounds"] = self.round_ms
        if self.windows:
            out["timed_windows"] = self.windows  # turned into gpu_state by run()
        return out


def share_batching(timers, warmup):
    """Every timer of a comparison times in batches of one size, the one its shortest call
    picks (CallTimer.probe): a variant just over the batching threshold would otherwise be
    timed per call, idle launch gaps included, against others timed back to back."""
    pers = []
    for t in (t for t in timers if t is not None):
        try:
            pers.append((t, t.probe(warmup)))
        except Exception:  # noqa: BLE001 - its own round records the failure
            continue
    per = max((p for _, p in pers), default=1)
    for t, _ in pers:
        t.per = per


def time_calls(fn, sets, warmup, repeats, dev, tick=lambda: None):
    """Median/min/p90 ms per call of `fn(*sets[i % len(sets)])`, after `warmup` calls: one
    round of a CallTimer."""
    t = CallTimer(fn, sets, dev, tick)
    t.round(warmup, repeats)
    return t.summary()


def _summary(ms, how):
    ms = sorted(ms)
    return {"ms": statistics.median(ms), "ms_min": ms[0], "ms_p90": ms[int(0.9 * (len(ms) - 1))],
            "timing": how}

"""`python -m gemmfuse bench`: the seed models, eager vs torch.compile vs gemmfuse, in one process.

Per model every variant gets its own deepcopy of one freshly built model (so BatchNorm's running
statistics start from the same state), the same input sets (``torch.rand``, rotated while timing),
and is checked against one float64 reference (deepcopy of the model in float64, same inputs).
Times: CUDA events around each call; a model's variants are built first, then timed in
``rounds`` alternating rounds of ``warmup`` untimed and ``repeats`` timed calls each; the median
over every round's calls. Without a GPU it runs on the CPU at a small shape and says so.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..route_timer import calls_per_batch
from .gpu_monitor import GpuMonitor, summarize as summarize_gpu_state
from .models import MODELS, M99
from .record import OUT_DIR, record

# H100 SXM ceilings (docs/measurements.md): cuBLAS bf16 GEMM rate, device copy bandwidth
# (bytes read + written), and the measured fp32/TF32 cuBLAS rates at the seed GEMM for context.
CEILINGS = {
    "bf16_tflops": 740.0,
    "copy_tbs": 2.97,
    "sgemm_tflops": 2 * 1024 * 8192 * 8192 / 2.726e-3 / 1e12,
    "tf32_tflops": 2 * 1024 * 8192 * 8192 / 0.387e-3 / 1e12,
    "source": "H100 80GB HBM3 figures (docs/measurements.md); other GPUs differ",
}
CPU_BATCH, CPU_FEATURES = 64, 1024
SWEEP_M_GPU, SWEEP_M_CPU = (1, 16, 128, 1024, 4096), (1, 16, 64, 256)
FAST_REL_MAX = 2e-5  # design.md: `fast` within atol = rtol = 1e-4 of float64, rel <= 2e-5


# The least GPU time of warm-up calls per round after the first (see CallTimer.round);
# `gemmfuse bench --warmup-ms` sets it per run (5000: each variant timed at the clock the chip
# settles to under its own sustained load; docs/measurements.md).
WARMUP_MS = 20.0
# Each round times at least this much of a short call's batches: ten batches of a 0.4 ms call
# are 8 ms, within which a host-bound call's time moves by 10% from run to run (the zoo's
# launch-bound rows); longer calls keep `repeats`.
MIN_BATCHED_MS = 50.0


@dataclass
class Config:
    models: list = field(default_factory=lambda: list(MODELS))
    modes: list = field(default_factory=lambda: ["fp32", "fast", "tf32"])
    batch: int | None = None
    in_features: int | None = None
    out_features: int | None = None
    repeats: int | None = None  # timed calls per round (None: 20 on a GPU, 100 on the CPU)
    warmup: int = 3     # untimed calls per round (after the first, checked, call)
    warmup_ms: float = WARMUP_MS  # and at least this much GPU time of them after the first round
    rounds: int | None = None   # alternating rounds over a model's variants (see _measure_all;
    #                             None: 4 on a GPU, 8 on the CPU, whose shared cores are noisier)
    input_sets: int = 3
    out: str | None = None       # JSON path (default bench/out/<time>-<device>.json)
    record: bool = False         # also the device kind's latest record in bench/results
    compile: bool | None = None  # None: on GPU yes, on CPU no
    bf16: bool = True
    sweep: bool = False
    sweep_m: list | None = None
    suite: bool = False          # the suite (suite.py) instead of the reference models
    train: bool = False          # training through the reference models (train.py)
    suite_only: list | None = None
    device: str = "auto"
    seed: int = 0
    zoo: bool = False            # the model zoo (zoo.py, zoo_runner.py) instead of the seed models
    zoo_models: list | None = None     # None: all; the rest None: zoo_runner.settings' defaults
    zoo_batches: list | None = None
    zoo_dtypes: list | None = None
    zoo_phases: list | None = None
    zoo_variants: list | None = None


# ----------------------------------------------------------------------------------- helpers
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()



def _tick(progress, task):
    progress.advance(task)
    progress.refresh()


class CallTimer:
    """Times one callable `fn(*sets[i % len(sets)])` over one or more rounds; the bench
    alternates the rounds of every variant of a model (see _measure_all), so that slow drifts
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
        _sync(self.dev)
        return [a.elapsed_time(b) / per for a, b in evs]

    def probe(self, warmup, calls=5):
        """The batch size this call would pick alone (route_timer.calls_per_batch of its
        median single-call time after `warmup` calls); 1 off the GPU."""
        if self.dev.type != "cuda":
            return 1
        for i in range(warmup):
            self.fn(*self.sets[i % len(self.sets)])
        _sync(self.dev)
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
        _sync(self.dev)
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


def errors(out, ref):
    """rel = ||out-ref|| / ||ref||, max |out-ref|, allclose at 1e-4; NaN anywhere fails."""
    o = out.detach().double()
    finite = bool(torch.isfinite(o).all())
    if o.shape != ref.shape:
        return {"rel_err": None, "max_abs_err": None, "allclose_1e4": False, "finite": finite,
                "error": f"shape {tuple(o.shape)} != reference {tuple(ref.shape)}"}
    d = o - ref
    rn = float(ref.norm())
    rel = float(d.norm()) / rn if rn > 0 else float(d.norm())
    return {"rel_err": _num(rel), "max_abs_err": _num(float(d.abs().max()) if d.numel() else 0.0),
            "allclose_1e4": bool(torch.allclose(o, ref, atol=1e-4, rtol=1e-4)), "finite": finite}


def _num(v):
    return None if v is None or not math.isfinite(v) else v


def _state(module):
    """Buffers by name (OptimizedModule's `_orig_mod.` prefix dropped)."""
    if not isinstance(module, torch.nn.Module):
        return {}
    return {k.replace("_orig_mod.", ""): v for k, v in module.named_buffers()}


def state_errors(candidates, ref_state, dtype):
    """Compare running stats after one step with the float64 model's (first module that has them)."""
    if not ref_state:
        return {}
    for src in candidates:
        st = _state(src)
        if all(k in st for k in ref_state):
            break
    else:
        return {"state_ok": False, "state_note": "no module holds the reference's buffers"}
    rel, ok = 0.0, True
    for k, r in ref_state.items():
        v = st[k].detach().double().cpu()
        if not r.is_floating_point():
            ok &= torch.equal(v, r.double())
            continue
        rel = max(rel, float((v - r).norm() / r.norm().clamp_min(1e-30)))
    tol = 1e-3 if dtype == torch.float32 else 1e-2
    return {"state_rel_err": _num(rel), "state_ok": bool(ok and rel <= tol)}


def _explain(obj):
    try:
        from gemmfuse import explain
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            text = explain(obj)
        return (text if isinstance(text, str) else buf.getvalue())[:4000]
    except Exception as e:  # explain is informative only
        return f"(explain failed: {type(e).__name__}: {e})"[:400]


def _routes(opt):
    """What each chain of an optimized module ran over the timed calls: fused calls, calls
    routed to PyTorch by reason, and the route timer's figures (fused ms, PyTorch ms)."""
    try:
        from gemmfuse import runtimes
        return [{"fused_calls": rt.fused_calls, "fallbacks": dict(rt.fallbacks),
                 "timed_ms": [[round(v, 5) if v is not None else None for v in t]
                              for t in rt.timed.values()]}
                for rt in runtimes(opt)]
    except Exception as e:  # informative only
        return f"(routes failed: {type(e).__name__}: {e})"[:400]


@contextlib.contextmanager
def _tf32(on):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def build_variant(variant, model, example):
    """(callable, module-like holding state, explain text) for one variant on `model` (a copy)."""
    if variant in ("eager", "eager-bf16"):
        return model, model, None
    if variant == "eager-tf32":
        def fn(*xs):
            with _tf32(True):
                return model(*xs)
        return fn, model, None
    if variant == "compile":
        c = torch.compile(model)
        return c, c, None
    if variant.startswith("gemmfuse-"):
        from gemmfuse import optimize
        mode = variant.split("-", 1)[1]
        opt = optimize(model, tuple(example), precision="fp32" if mode == "bf16" else mode)
        return opt, opt, _explain(opt)
    raise ValueError(variant)


def variants_for(cfg, dev):
    v = ["eager"]
    if cfg.compile if cfg.compile is not None else dev.type == "cuda":
        v.append("compile")
    if "tf32" in cfg.modes:
        v.append("eager-tf32")  # the reference for gemmfuse-tf32's promise
    v += [f"gemmfuse-{m}" for m in cfg.modes]
    if cfg.bf16:
        v += ["eager-bf16", "gemmfuse-bf16"]
    return v


def judge(rec, by_mode):
    """Set `promise` and `pass`. Eager/compile rows report allclose(1e-4)."""
    m, rel = rec["mode"], rec.get("rel_err")
    base = {"gemmfuse-fp32": "eager", "gemmfuse-tf32": "eager-tf32",
            "gemmfuse-bf16": "eager-bf16"}.get(m)
    if rec.get("error") or rel is None or not rec.get("finite", False):
        ok, promise = False, "runs, finite output"
    elif m == "gemmfuse-fast":
        promise = f"allclose 1e-4 and rel <= {FAST_REL_MAX:g}"
        ok = rec["allclose_1e4"] and rel <= FAST_REL_MAX
    elif base:
        bref = (by_mode.get(base) or {}).get("rel_err")
        promise = f"rel <= 1.25 x {base} rel"
        ok = bref is not None and rel <= 1.25 * bref
    else:
        promise, ok = "allclose 1e-4 (informative)", rec["allclose_1e4"]
    if rec.get("state_ok") is False:
        ok = False
    rec["promise"], rec["pass"] = promise, bool(ok)


def finish(rows):
    """Same-run speedup and eager error (vs eager of the same dtype), then the verdict."""
    by_mode = {r["mode"]: r for r in rows}
    for r in rows:
        eager = by_mode.get("eager-bf16" if r["dtype"] == "bfloat16" else "eager") or {}
        r["eager_rel_err"] = eager.get("rel_err")
        r["speedup_vs_eager"] = eager["ms"] / r["ms"] if eager.get("ms") and r.get("ms") else None
        judge(r, by_mode)
    return rows


def floors(spec, b, k, n):
    """FLOPs, bytes and floor times at the H100 ceilings, per element size."""
    out = {}
    for name, elem in (("fp32", 4), ("bf16", 2)):
        fl, by = spec.flops_bytes(b, k, n, elem)
        c = fl / (CEILINGS["bf16_tflops"] * 1e12) * 1e3
        mem = by / (CEILINGS["copy_tbs"] * 1e12) * 1e3
        out[name] = {"flops": fl, "bytes": by, "floor_ms_compute_bf16_rate": c,
                     "floor_ms_memory": mem, "floor_ms": max(c, mem)}
    # fp32-grade on tensor cores (`fast`): three bf16 products' worth of work
    out["fp32"]["floor_ms_3xbf16"] = max(3 * out["fp32"]["floor_ms_compute_bf16_rate"],
                                          out["fp32"]["floor_ms_memory"])
    if spec.id == "m18":  # x @ colsum(W) + sum(b): a GEMV over x (W's column sums cached)
        by = 4 * (b * k + k + b)
        out["gemv_rewrite"] = {"flops": 2 * b * k, "bytes": by,
                               "floor_ms": by / (CEILINGS["copy_tbs"] * 1e12) * 1e3}
    return out


def pick_device(want: str) -> torch.device:
    """--device: "cuda", "cpu", or "auto" (CUDA where there is a GPU)."""
    cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if cuda else "cpu")


def device_info(dev):
    info = {"device": dev.type, "torch": torch.__version__, "python": platform.python_version(),
            "host_cpu": platform.processor() or platform.machine()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=torch.cuda.get_device_name(dev), cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}", gpu_mem_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count)
    else:
        info["gpu"] = None
    info["git"] = _git_commit()
    return info


def _git_commit():
    """GEMMFUSE_GIT_COMMIT when set (the commit as the caller knows it, for a copied tree whose
    .git is not the one the code came from: scripts/device-run.sh), else this tree's HEAD."""
    if os.environ.get("GEMMFUSE_GIT_COMMIT"):
        return os.environ["GEMMFUSE_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except Exception:
        return None


# ------------------------------------------------------------------------------ measurement
def _build(variant, model, sets, dtype, ref, ref_state, dev, tick):
    """One variant on a fresh copy of `model`: its record, with the first call (which
    compiles) checked, and a CallTimer for it (None after an error)."""
    rec = {"mode": variant, "dtype": str(dtype).replace("torch.", "")}
    try:
        m = copy.deepcopy(model).to(dtype)
        xs = [[x.to(dtype) for x in s] for s in sets]
        fn, holder, text = build_variant(variant, m, xs[0])
        if text is not None:
            rec["explain"] = text
        out = fn(*xs[0])  # first call (compiles): the checked one, from the initial state
        _sync(dev)
        tick()
        rec.update(errors(out, ref))
        rec.update(state_errors([holder, m], ref_state, dtype))
        del out
        return rec, CallTimer(fn, xs, dev, tick)
    except Exception as e:
        _failed(rec, e)
        _free(dev)
        return rec, None


def _failed(rec, e):
    rec.update(error=f"{type(e).__name__}: {e}"[:1000], ms=None,
               traceback=traceback.format_exc()[-2000:])


def _measure_all(variants, model, sets, ref, ref_state, cfg, dev, progress, tasks):
    """Every variant built (and checked) first, then timed in cfg.rounds alternating rounds:
    in each, every variant in turn (reversed in odd rounds) gets its warm-up (see
    CallTimer.round) and cfg.repeats timed calls.
    The GPU's clock and temperature drift over a run (one model's variants take seconds, the
    compile variant's compilation idles it); alternating puts every variant at every stage of
    that drift instead of each at its own. `tasks[v]`: variant v's progress bar. Returns the
    records, in `variants` order."""
    built = []
    for v in variants:
        dtype = torch.bfloat16 if v.endswith("bf16") else torch.float32
        tick = lambda t=tasks[v]: _tick(progress, t)  # noqa: E731
        built.append(_build(v, model, sets, dtype, ref, ref_state, dev, tick))
    share_batching([t for rec, t in built if not rec.get("error")], cfg.warmup)
    for r in range(cfg.rounds):
        # Odd rounds run the variants in reverse (ABBA): each one follows a different
        # predecessor, whose heat and clock it may inherit, in alternate rounds.
        for rec, timer in (built if r % 2 == 0 else built[::-1]):
            if timer is not None and not rec.get("error"):
                try:
                    timer.round(cfg.warmup, cfg.repeats, cfg.warmup_ms)
                except Exception as e:
                    _failed(rec, e)
    records = []
    for v, (rec, timer) in zip(variants, built):
        if timer is not None and not rec.get("error"):
            rec.update(timer.summary())
            if v.startswith("gemmfuse-"):
                rec["routes"] = _routes(timer.fn)
        progress.update(tasks[v], completed=_calls_per_variant(cfg))
        records.append(rec)
    del built
    if "compile" in variants:
        torch._dynamo.reset()
    _free(dev)
    return records


def reference(model, sets):
    r = copy.deepcopy(model).double()
    out = r(*[x.double() for x in sets[0]])
    st = {k: v.detach().double().cpu().clone() for k, v in _state(r).items()}
    del r
    return out.detach(), st


def _input_sets(cls, n, b, k, dev):
    return [cls.get_inputs(b, k, device=dev) for _ in range(n)]


def run_models(cfg, dev, shape, progress, base):
    b, k, n = shape
    variants = variants_for(cfg, dev)
    tasks = {(mid, v): progress.add_task(f"{mid} {v}", total=_calls_per_variant(cfg))
             for mid in cfg.models for v in variants}
    records = []
    for i, mid in enumerate(cfg.models):
        spec = MODELS[mid]
        torch.manual_seed(cfg.seed + i)
        model, _ = spec.make(b, k, n, device=dev)
        sets = _input_sets(spec.cls, cfg.input_sets, b, k, dev)
        ref, ref_state = reference(model, sets)
        fl = floors(spec, b, k, n)
        rows = _measure_all(variants, model, sets, ref, ref_state, cfg, dev, progress,
                            {v: tasks[(mid, v)] for v in variants})
        for rec in rows:
            rec.update(base, model=mid, batch=b, in_features=k, out_features=n,
                       floor_ms=fl["bf16" if rec["dtype"] == "bfloat16" else "fp32"]["floor_ms"],
                       timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        records += finish(rows)
        del model, sets, ref
        _free(dev)
    return records


def _calls_per_variant(cfg):
    return 1 + cfg.rounds * (cfg.warmup + cfg.repeats)


def run_sweep(cfg, dev, k, n, progress, base):
    """m99's chain at several M: eager, gemmfuse fast and fp32; TFLOP/s and GB/s vs the ceilings."""
    ms_list = cfg.sweep_m or (SWEEP_M_GPU if dev.type == "cuda" else SWEEP_M_CPU)
    variants = ["eager", "gemmfuse-fast", "gemmfuse-fp32"]
    tasks = {(m, v): progress.add_task(f"sweep M={m} {v}", total=_calls_per_variant(cfg))
             for m in ms_list for v in variants}
    torch.manual_seed(cfg.seed + 100)
    model = M99(k, n).to(dev)
    out = []
    for m in ms_list:
        sets = _input_sets(M99, cfg.input_sets, m, k, dev)
        ref, _ = reference(model, sets)
        flops, bytes_ = 2 * m * n * k, 4 * (m * k + n * k + n + m * n)
        floor = max(flops / (CEILINGS["bf16_tflops"] * 1e12), bytes_ / (CEILINGS["copy_tbs"] * 1e12))
        rows = _measure_all(variants, model, sets, ref, {}, cfg, dev, progress,
                            {v: tasks[(m, v)] for v in variants})
        for rec in rows:
            rec.update(base, chain="m99", M=m, K=k, N=n, flops=flops, bytes=bytes_,
                       floor_ms=floor * 1e3)
            if rec.get("ms"):
                s = rec["ms"] * 1e-3
                rec.update(tflops=flops / s / 1e12, gbs=bytes_ / s / 1e9,
                           pct_bf16_peak=100 * flops / s / (CEILINGS["bf16_tflops"] * 1e12),
                           pct_copy_bw=100 * bytes_ / s / (CEILINGS["copy_tbs"] * 1e12))
        out += finish(rows)
        del sets, ref
        _free(dev)
    del model
    _free(dev)
    return out


# ------------------------------------------------------------------------------------ report
def _fmt(v, f):
    return "—" if v is None else format(v, f)


def sweep_table(sweep):
    from rich.table import Table
    t = Table(title="sweep: m99 chain (gelu→softmax), K=N fixed; % of bf16 740 TFLOP/s, 2.97 TB/s")
    for c in ("M", "variant", "ms", "TFLOP/s", "%peak", "GB/s", "%bw", "floor ms", "rel err"):
        t.add_column(c, justify="right" if c != "variant" else "left")
    for r in sweep:
        t.add_row(str(r["M"]), r["mode"], _fmt(r.get("ms"), ".4f"), _fmt(r.get("tflops"), ".1f"),
                  _fmt(r.get("pct_bf16_peak"), ".1f"), _fmt(r.get("gbs"), ".0f"),
                  _fmt(r.get("pct_copy_bw"), ".1f"), _fmt(r.get("floor_ms"), ".4f"),
                  _fmt(r.get("rel_err"), ".1e") if not r.get("error") else "error")
    return t


def main_table(records, header):
    from rich.table import Table
    clock = any(r.get("gpu_state") for r in records)  # a GPU run with nvidia-smi samples
    t = Table(title=f"gemmfuse bench — {header.get('gpu') or 'CPU'}, "
                    f"M={header['batch']} K={header['in_features']} N={header['out_features']}",
              caption=f"ms: median per call over {header.get('rounds', 1)} rounds alternating "
                      "over each model's variants; calls under 0.5 ms are timed in batches of "
                      "back-to-back calls, '1-call ms' times each alone (launch latency "
                      "included). speedup vs eager of the same dtype; pass: gemmfuse rows their "
                      "promise (design.md), other rows allclose(1e-4)"
                      + ("; SM MHz, W: medians of nvidia-smi's samples over the timed calls "
                         "(the chip lowers its clock as it warms)" if clock else ""))
    cols = ("model", "variant", "ms", "1-call ms", "speedup", "rel err", "max abs", "pass")
    for c in cols + (("SM MHz", "W") if clock else ()):
        t.add_column(c, justify="left" if c in ("model", "variant") else "right")
    for r in records:
        ok = "[green]ok[/]" if r["pass"] else ("[red]error[/]" if r.get("error") else "[red]FAIL[/]")
        g = r.get("gpu_state") or {}
        t.add_row(r["model"], r["mode"], _fmt(r.get("ms"), ".3f"),
                  _fmt(r.get("ms_latency", r.get("ms")), ".3f"),
                  _fmt(r.get("speedup_vs_eager"), ".2f") + ("×" if r.get("speedup_vs_eager") else ""),
                  _fmt(r.get("rel_err"), ".1e"), _fmt(r.get("max_abs_err"), ".1e"), ok,
                  *((_fmt(g.get("sm_mhz"), ".0f"), _fmt(g.get("power_w"), ".0f")) if clock else ()))
    return t


def _clean(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def run(cfg: Config, console=None):
    """Run the bench, print progress, notes and tables (main table last), write JSON + PNG."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if cfg.zoo:
        from .zoo_runner import run_zoo
        return run_zoo(cfg, console)
    console = console or Console(width=None if sys.stdout.isatty() else 150, record=True)
    unknown = [m for m in cfg.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    bad = [m for m in cfg.modes if m not in ("fp32", "fast", "tf32")]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; known: fp32, fast, tf32")
    dev = pick_device(cfg.device)
    gpu = dev.type == "cuda"
    cfg.repeats = cfg.repeats or (20 if gpu else 100)
    cfg.rounds = cfg.rounds or (4 if gpu else 8)
    b = cfg.batch or (1024 if gpu else CPU_BATCH)
    k = cfg.in_features or (8192 if gpu else CPU_FEATURES)
    n = cfg.out_features or (8192 if gpu else CPU_FEATURES)
    info = device_info(dev)
    notes = []
    if not gpu:
        notes.append(f"no GPU used: ran on the CPU at batch {b}, {k}x{n} (seed shapes are 1024, "
                     f"8192x8192 on a GPU); CPU times say nothing about GPU performance")
        if not cfg.compile:
            notes.append("torch.compile skipped on the CPU (pass --compile to include it)")
    if cfg.repeats * cfg.rounds < 20:
        notes.append(f"only {cfg.repeats * cfg.rounds} timed runs (20 or more for figures worth "
                     f"quoting)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = (info["gpu"] or "cpu").lower().replace(" ", "-")
    out = Path(cfg.out or OUT_DIR / f"{stamp}-{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    base = {"device": dev.type, "gpu": info["gpu"], "torch": torch.__version__}

    old = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False  # eager fp32 means no TF32
    torch.set_float32_matmul_precision("highest")
    # No auto-refresh: its background thread takes the GIL at random moments, and a stall
    # inside a timed region delays the next launch (seen as 2x outliers on short calls).
    progress = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, auto_refresh=False)
    # The SM clock, power and temperature of each record's timed calls (gpu_monitor.py).
    monitor = GpuMonitor.for_device(dev).start() if gpu else None
    try:
        with (contextlib.nullcontext() if cfg.train else torch.no_grad()), progress:
            if cfg.train:
                from .train import run_train
                records = run_train(cfg, dev, progress, base)
            elif cfg.suite:
                from .suite import run_suite
                records = run_suite(cfg, dev, progress, base, only=cfg.suite_only)
            else:
                records = run_models(cfg, dev, (b, k, n), progress, base)
            sweep = run_sweep(cfg, dev, k, n, progress, base) if cfg.sweep else None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        torch.set_float32_matmul_precision(old[1])
        if monitor is not None:
            monitor.stop()
    # Each record's GPU state from the samples in its timed windows, now that every sample
    # (the last ones too) has been read.
    for r in records + (sweep or []):
        windows = r.pop("timed_windows", None)
        if monitor is not None and windows:
            state = summarize_gpu_state([monitor.window(a, b) for a, b in windows])
            if state is not None:
                r["gpu_state"] = state
    if monitor is not None:
        info["gpu_monitor"] = {"fields": monitor.fields, "period_ms": monitor.period_ms,
                               "samples": len(monitor.samples), "why_not": monitor.why_not}

    header = dict(info, batch=b, in_features=k, out_features=n, repeats=cfg.repeats,
                  warmup=cfg.warmup, warmup_ms=cfg.warmup_ms, rounds=cfg.rounds,
                  input_sets=cfg.input_sets, grad="autograd records" if cfg.train else "no_grad",
                  timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"), notes=notes,
                  note="; ".join(notes), ceilings=CEILINGS,
                  models={} if cfg.suite or cfg.train else
                  {mid: {"summary": MODELS[mid].summary, **floors(MODELS[mid], b, k, n)}
                   for mid in cfg.models})
    if cfg.suite:
        from .suite import summary
        header["suite"] = summary(records)
    if cfg.train:
        header["train"] = True
    result = {"header": header, "records": records}
    if sweep is not None:
        result["sweep"] = sweep
    out.write_text(json.dumps(_clean(result), indent=1))
    from .plot import plot_speedups, plot_sweep
    png = out.with_suffix(".png")
    plotted = ([dict(r, mode=f"{r['mode']} {r['scenario']}") for r in records] if cfg.train
               else records)
    plot_speedups(plotted, png, f"{header.get('gpu') or 'CPU'} M={b} K={k} N={n}"
                  + (" training" if cfg.train else ""))
    paths = [str(out), str(png)]
    if sweep:
        paths.append(str(plot_sweep(sweep, out.with_name(out.stem + "-sweep.png"))))

    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    failed = {}
    for r in records + (sweep or []):
        if r.get("error"):
            failed.setdefault(r["error"][:300], []).append(f"{r.get('model', 'sweep')} {r['mode']}")
    for err, where in failed.items():
        console.print(f"[red]error[/] in {', '.join(where[:4])}"
                      f"{f' and {len(where) - 4} more' if len(where) > 4 else ''}: {err}")
    if sweep:
        console.print(sweep_table(sweep))
    if cfg.train:
        from .train import table as train_table
        console.print(train_table(records, header))
    else:
        console.print(main_table(records, header))
    log = out.with_suffix(".log")
    console.save_text(str(log))  # everything printed above, as plain text
    paths.append(str(log))
    if cfg.record:
        paths += record(result, paths)
    console.print("wrote " + ", ".join(paths))
    return result, out

"""`python -m bench --zoo`: the model zoo (zoo.py) through eager PyTorch, torch.compile,
``gemmfuse.optimize`` and the gemmfuse compile backend, in one process.

Per model and batch kind one model is built (seeded). Per phase a float64 deepcopy of it gives
the reference: in the forward phase (``torch.no_grad``, ``eval()``) the outputs of the first
CHECK_CALLS calls in sequence (so that a stateful model's second call checks the state it
kept); in the train phase the first step's output, loss and every parameter's gradient. Per
dtype (fp32, bf16) and phase every variant gets its own deepcopy of the model in that dtype, is
checked against the reference on an untimed first call (bf16 too against float64), then the
variants are timed in alternating rounds with runner.CallTimer (CUDA events around each call,
short calls in batches of back-to-back calls, inputs rotated; the host clock on the CPU). A
train step is zero_grad, forward, loss, backward and ``AdamW(fused=True).step()``
(``foreach=False`` on the CPU).

Memory (CUDA): what a variant keeps between calls (its weights, optimizer state, compiled or
prepared data: the growth of allocated memory over its build and check) plus the most its calls
allocate above that (torch.cuda's peak counter, reset before each of its timed rounds); the
other variants' memory is not counted. A variant that raises is a record with the error's first
line, and the bench goes on.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import math
import os
import re
import time
import traceback

import torch

from .compare import errors, finite_or_none
from .timing import CallTimer, free, share_batching, sync
from .zoo_report import err_of

VARIANTS = ("eager", "compile", "optimize", "backend", "max-autotune")
DEFAULT_VARIANTS = ("eager", "compile", "optimize", "backend")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PHASES = ("forward", "train")
CHECK_CALLS = 2  # forward phase: calls checked in sequence from the reset state
MB = 2 ** 20


# Seconds one group (a model, batch kind, dtype and phase: every variant built, checked and
# timed) may take before the run is ended with a stack dump (GEMMFUSE_ZOO_GROUP_LIMIT_S).
GROUP_LIMIT_S = float(os.environ.get("GEMMFUSE_ZOO_GROUP_LIMIT_S", 300))


def cast(xs, dtype):
    """The floating tensors of `xs` in `dtype`; integer ones (indices, targets) as they are."""
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in xs)


def reset(model):
    """Put a stateful model (one with ``reset()``) back to its initial state."""
    fn = getattr(model, "reset", None)
    if callable(fn):
        fn()


def _first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def wrap(variant, m, example):
    """(the callable the variant times, the object gemmfuse's explain/runtimes read) on `m`."""
    if variant == "eager":
        return m, None
    if variant == "compile":
        return torch.compile(m), None
    if variant == "max-autotune":
        return torch.compile(m, mode="max-autotune"), None
    if variant == "optimize":  # 16-bit models run in their own dtype at precision fp32
        from gemmfuse import optimize
        opt = optimize(m, tuple(example), precision="fp32")
        return opt, opt
    if variant == "backend":
        c = torch.compile(m, backend="gemmfuse")
        return c, c
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def reference(base, sets, loss_fn, phase):
    """The float64 model's answers on `sets` (cast to float64): forward: the outputs of the
    first CHECK_CALLS calls in sequence; train: the first step's output, loss and gradients."""
    r = copy.deepcopy(base).double().train(phase == "train")
    reset(r)
    xs = [cast(s, torch.float64) for s in sets[:CHECK_CALLS]]
    if phase == "forward":
        with torch.no_grad():
            return {"outs": [r(*x).detach() for x in xs]}
    out = r(*xs[0])
    loss = loss_fn(out, xs[0])
    loss.backward()
    grads = {n: p.grad.detach() for n, p in r.named_parameters() if p.grad is not None}
    return {"outs": [out.detach()], "loss": float(loss.detach()), "grads": grads}


ZERO_GRAD = 1e-7  # a reference gradient this much smaller than the largest one is "zero"


def grad_errors(model, ref_grads):
    """Gradient errors against float64: the worst parameter's relative error (and which),
    and the error of all gradients together. A parameter whose true gradient is zero (a key
    bias before softmax, a per-token bias before LayerNorm: each precision returns its own
    rounding noise) has no meaningful relative error: such parameters (ZERO_GRAD) count only
    in the overall error and are listed. A parameter that got no gradient counts as a zero
    one."""
    params = dict(model.named_parameters())
    norms = {n: float(r.norm()) for n, r in ref_grads.items()}
    top = max(norms.values(), default=0.0)
    worst, name, missing, zero, d2 = 0.0, None, [], [], 0.0
    for n, r in ref_grads.items():
        p = params.get(n)
        g = p.grad if p is not None else None
        if g is None:
            missing.append(n)
        d = float((g.detach().double() - r).norm()) if g is not None else norms[n]
        d2 += d * d
        if norms[n] <= ZERO_GRAD * top:
            zero.append(n)
            continue
        e = d / norms[n]
        if not math.isnan(worst) and not e <= worst:  # the first NaN stays
            worst, name = e, n
    total = sum(v * v for v in norms.values()) ** 0.5
    overall = d2 ** 0.5 / total if total > 0 else d2 ** 0.5
    return {"grad_rel_err": finite_or_none(worst), "grad_worst": name,
            "grad_rel_err_all": finite_or_none(overall),
            "grad_zero": zero, "grad_missing": missing,
            "grad_finite": math.isfinite(worst) and math.isfinite(overall)}


def chains(holder):
    """Chains gemmfuse fused / found, from explain's head lines (one per compiled graph), and
    explain's text; None where the API says nothing (it is informative only)."""
    if holder is None:
        return {}
    try:
        from gemmfuse import explain
        text = explain(holder, print_it=False)
    except Exception as e:  # noqa: BLE001
        return {"chains_fused": None, "chains_total": None, "explain": f"(explain failed: {_first_line(e)})"}
    found = [tuple(map(int, m)) for m in re.findall(r"(\d+) of (\d+) chain\(s\) fused", text)]
    return {"chains_fused": sum(f for f, _ in found) if found else None,
            "chains_total": sum(t for _, t in found) if found else None, "explain": text[:4000],
            **sites(text)}


# explain's line for each attention call and LM head: how it starts, and what says it was taken
SITE_LINES = (("attention", "attention: ", " on gemmfuse's fp32 attention kernels"),
              ("lm_heads", "LM head + cross-entropy: ", " fused (gemmfuse.linear_cross_entropy"))


def sites(text: str) -> dict:
    """The attention calls and LM heads explain lists (every graph's): how many run on
    gemmfuse, of how many, and each distinct line (where it ran and why) with its count."""
    out = {}
    for key, start, taken in SITE_LINES:
        lines = [line for line in text.splitlines() if line.startswith(start)]
        out[f"{key}_fused"] = sum(taken in line for line in lines)
        out[f"{key}_total"] = len(lines)
        out[f"{key}_lines"] = dict(collections.Counter(line[:300] for line in lines))
    return out


def routes(holder):
    """Fused calls, the chains that ran fused at all, and calls routed to PyTorch (by reason)
    over every chain runtime (None where the variant has no runtimes to ask)."""
    if holder is None:
        return {}
    try:
        from gemmfuse import fused_calls, runtimes
        rts = runtimes(holder)
        falls = {}
        for rt in rts:
            for k, v in dict(rt.fallbacks).items():
                falls[k] = falls.get(k, 0) + v
        if not rts:  # chains compiled into an Inductor graph: the op's own count per spec
            return {"runtimes": 0, "fused_calls": fused_calls(holder), "fallbacks": None}
        return {"runtimes": len(rts), "fused_calls": sum(rt.fused_calls for rt in rts),
                "chains_ran_fused": sum(1 for rt in rts if rt.fused_calls), "fallbacks": falls,
                "whole_eager": sorted(getattr(holder, "__dict__", {}).get("_gemmfuse_eager", ()))}
    except Exception as e:  # noqa: BLE001
        return {"runtimes": None, "routes_error": _first_line(e)}


def optimizer_for(model, dev):
    if dev.type == "cuda":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)


def train_step(fn, model, opt, loss_fn):
    """One training step through `fn` (the variant's callable on `model`): zero_grad, reset a
    stateful model (its training loss is one step from the initial state), forward, loss,
    backward, optimizer step."""
    def step(*xs):
        opt.zero_grad(set_to_none=True)
        reset(model)
        loss_fn(fn(*xs), xs).backward()
        opt.step()
    return step


class VariantRun:
    """One variant of one model at one dtype and phase: its model copy, the checked first
    call(s), its CallTimer and its memory figures."""

    def __init__(self, name, rec, dev):
        self.name, self.rec, self.dev = name, rec, dev
        self.timer, self.resident, self.transient, self.peak_total = None, None, 0, 0

    def build(self, base, sets, dtype, loss_fn, ref, phase):
        """Copy, wrap and check the variant (untimed); then its timer. Errors are recorded."""
        dev, rec = self.dev, self.rec
        sync(dev)
        a0 = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        t0 = time.perf_counter()
        try:
            m = copy.deepcopy(base).to(dtype).train(phase == "train")
            reset(m)
            fn, holder = wrap(self.name, m, sets[0])
            reset(m)  # optimize() ran the model on the example
            if phase == "forward":
                rec.update(check_forward(fn, m, sets, ref))
                timed = fn
            else:
                opt = optimizer_for(m, dev)
                rec.update(check_train(fn, m, opt, sets, loss_fn, ref))
                timed = train_step(fn, m, opt, loss_fn)
            sync(dev)
            rec["first_call_s"] = time.perf_counter() - t0
            rec.update(chains(holder))
            self.holder = holder
            if dev.type == "cuda":
                self.resident = torch.cuda.memory_allocated(dev) - a0
            self.timer = CallTimer(timed, sets, dev)
        except Exception as e:  # noqa: BLE001 - a failing variant is a record
            self.fail(e)

    def fail(self, e):
        self.rec.update(error=_first_line(e), traceback=traceback.format_exc()[-2000:], ms=None)
        self.timer = None
        free(self.dev)

    def round(self, cfg):
        """One timed round (CallTimer.round), with its peak memory above what it began with."""
        if self.timer is None:
            return
        cuda = self.dev.type == "cuda"
        try:
            if cuda:
                sync(self.dev)
                torch.cuda.reset_peak_memory_stats(self.dev)
                a = torch.cuda.memory_allocated(self.dev)
            self.timer.round(cfg.warmup, cfg.repeats, cfg.warmup_ms)
            if cuda:
                sync(self.dev)
                peak = torch.cuda.max_memory_allocated(self.dev)
                self.transient = max(self.transient, peak - a)
                self.peak_total = max(self.peak_total, peak)
        except Exception as e:  # noqa: BLE001
            self.fail(e)

    def finish(self):
        """The record: timing summary, routes, memory."""
        rec = self.rec
        if self.timer is not None:
            rec.update(self.timer.summary())
            rec.pop("timed_windows", None)
            rec.update(routes(getattr(self, "holder", None)))
            if self.resident is not None:
                rec.update(resident_mb=self.resident / MB, transient_mb=self.transient / MB,
                           peak_mb=(self.resident + self.transient) / MB,
                           process_peak_mb=self.peak_total / MB)  # all variants' memory too
        rec.setdefault("peak_mb", None)
        self.timer = None
        return rec


def check_forward(fn, model, sets, ref):
    """The first CHECK_CALLS calls from the reset state against the float64 outputs: the
    worst call's errors, and each call's relative error."""
    results = [errors(fn(*xs), r) for xs, r in zip(sets, ref["outs"])]  # in sequence
    bad = [e for e in results if e.get("rel_err") is None]
    worst = dict(bad[0] if bad else max(results, key=lambda e: e["rel_err"]))
    worst.update(finite=all(e["finite"] for e in results),
                 allclose_1e4=all(e["allclose_1e4"] for e in results))
    reset(model)
    return dict(worst, rel_err_calls=[e.get("rel_err") for e in results])


def check_train(fn, model, opt, sets, loss_fn, ref):
    """One untimed step from the initial weights: the output's, the loss's and the gradients'
    errors against float64; then the optimizer's step (its state allocated before the timed
    calls) and zero_grad."""
    opt.zero_grad(set_to_none=True)
    reset(model)
    out = fn(*sets[0])
    loss = loss_fn(out, sets[0])
    loss.backward()
    rec = errors(out, ref["outs"][0])
    lv = float(loss.detach())
    rec["loss_rel_err"] = finite_or_none(abs(lv - ref["loss"]) / max(abs(ref["loss"]), 1e-30))
    rec.update(grad_errors(model, ref["grads"]))
    del out, loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    reset(model)
    return rec


# ------------------------------------------------------------------------------ the loops
def _stage(head, variant, what):
    """One line on stderr per stage, so that a log cut off by a time limit shows where."""
    import sys
    import time
    print(f"[zoo {time.strftime('%H:%M:%S')}] {head.get('model')} {head.get('batch')} "
          f"{head.get('dtype')} {head.get('phase')}: {variant}: {what}", file=sys.stderr, flush=True)


def measure_group(base, sets32, loss_fn, ref, dtype, phase, variants, cfg, dev, tick, head):
    """Every variant of one model, batch kind, dtype and phase: built and checked in turn,
    then timed in cfg.rounds rounds, odd rounds in reverse order (so that each variant meets
    every stage of the GPU's clock and temperature drift, as in runner._measure_all).
    Returns one record per variant."""
    import faulthandler
    # A group stuck past the limit dumps every thread's Python stack to stderr and ends the
    # process: the JSON keeps every group before it, and the log shows where it hung.
    faulthandler.dump_traceback_later(GROUP_LIMIT_S, exit=True)
    sets = [cast(s, dtype) for s in sets32]
    runs = []
    with torch.no_grad() if phase == "forward" else contextlib.nullcontext():
        for v in variants:
            _stage(head, v, "build and check")
            run = VariantRun(v, dict(head, variant=v), dev)
            run.build(base, sets, dtype, loss_fn, ref, phase)
            runs.append(run)
            tick()
        _stage(head, "all", "timing rounds")
        share_batching([run.timer for run in runs], cfg.warmup)
        for r in range(cfg.rounds):
            for run in (runs if r % 2 == 0 else runs[::-1]):
                run.round(cfg)
                tick()
    records = [run.finish() for run in runs]
    faulthandler.cancel_dump_traceback_later()
    del runs, sets
    torch._dynamo.reset()  # each group compiles fresh models: no cache limits, no leftovers
    free(dev)
    return speedups(records)


def speedups(records):
    """speedup = eager ms / ms (same model, batch, dtype and phase); for optimize and backend
    also vs_compile = compile ms / ms."""
    ms = {r["variant"]: r.get("ms") for r in records}
    for r in records:
        mine = r.get("ms")
        r["speedup"] = ms.get("eager") / mine if mine and ms.get("eager") else None
        if r["variant"] in ("optimize", "backend"):
            r["vs_compile"] = ms.get("compile") / mine if mine and ms.get("compile") else None
    return records


def _failed_group(head, variants, dtypes, phases, why):
    """Records for groups that could not run at all (the model or its reference failed)."""
    return [dict(head, dtype=d, phase=p, variant=v, error=why, ms=None, peak_mb=None)
            for p in phases for d in dtypes for v in variants]


def run_model(index, name, st, cfg, dev, tick, emit, base_rec):
    """One zoo model at every batch kind, phase and dtype of `st`; `emit(records)` after each
    group (the caller writes the JSON and logs a line)."""
    from .zoo import ZOO
    entry = ZOO[name]
    for kind in st["batches"]:
        head = dict(base_rec, model=name, batch=kind, shape=entry.batches[kind])
        torch.manual_seed(cfg.seed + index)
        try:
            base, make_inputs, loss_fn = entry.build(kind, dev)
            sets32 = [make_inputs(cfg.seed * 1000 + j) for j in range(cfg.input_sets)]
        except Exception as e:  # noqa: BLE001
            emit(_failed_group(head, st["variants"], st["dtypes"], st["phases"],
                               "build: " + _first_line(e)))
            continue
        for phase in st["phases"]:
            try:
                ref = reference(base, sets32, loss_fn, phase)
            except Exception as e:  # noqa: BLE001
                emit(_failed_group(head, st["variants"], st["dtypes"], [phase],
                                   "float64 reference: " + _first_line(e)))
                continue
            for dn in st["dtypes"]:
                group = dict(head, dtype=dn, phase=phase,
                             timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
                emit(measure_group(base, sets32, loss_fn, ref, DTYPES[dn], phase,
                                   st["variants"], cfg, dev, tick, group))
            del ref
            free(dev)
        del base, sets32
        free(dev)


# --------------------------------------------------------------------------------- the run
def settings(cfg, dev):
    """The zoo's lists from cfg, defaults by device, checked; eager always first (it is what
    the speedups divide)."""
    from .zoo import KINDS, ZOO
    gpu = dev.type == "cuda"
    st = {"models": cfg.zoo_models or list(ZOO),
          "batches": cfg.zoo_batches or (["small", "large"] if gpu else ["tiny"]),
          "dtypes": cfg.zoo_dtypes or list(DTYPES), "phases": cfg.zoo_phases or list(PHASES),
          "variants": list(cfg.zoo_variants or (DEFAULT_VARIANTS if gpu else ("eager", "optimize")))}
    known = {"models": ZOO, "batches": KINDS, "dtypes": DTYPES, "phases": PHASES,
             "variants": VARIANTS}
    for key, values in st.items():
        bad = [v for v in values if v not in known[key]]
        if bad:
            raise SystemExit(f"--zoo-{key}: unknown {bad}; known: {', '.join(known[key])}")
    st["variants"] = ["eager"] + [v for v in dict.fromkeys(st["variants"]) if v != "eager"]
    return st


@contextlib.contextmanager
def precise():
    """fp32 means fp32: no TF32 in matmuls or cuDNN convolutions (the patch embeddings) while
    the zoo runs; the previous settings are put back."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
           torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[:2]
        torch.set_float32_matmul_precision(old[2])


def describe_models(st):
    """Per model: its note, and per batch kind its configuration, parameters and FLOPs."""
    from .zoo import ZOO, count
    out = {}
    for name in st["models"]:
        kinds = {}
        for k in st["batches"]:
            d = {"config": ZOO[name].batches[k]}
            try:
                d.update(count(ZOO[name], k))
            except Exception as e:  # noqa: BLE001 - informative only
                d["count_error"] = _first_line(e)
            kinds[k] = d
        out[name] = {"note": ZOO[name].note, "kinds": kinds}
    return out


def group_line(records):
    """One plain line per group for the log: eager ms, then each variant's speedup and error."""
    r0 = records[0]
    parts = [f"{r0['model']} {r0['batch']} {r0['dtype']} {r0['phase']}:"]
    for r in records:
        if r.get("error"):
            parts.append(f"{r['variant']} ERROR {r['error'][:80]}")
            continue
        err = err_of(r)
        ms = f"{r['ms']:.3f} ms" if r["variant"] == "eager" else f"{r.get('speedup') or 0:.2f}x"
        parts.append(f"{r['variant']} {ms} err {err if err is None else format(err, '.1e')}")
    return " | ".join(parts)


def _setup(cfg):
    """Device, timing defaults (fewer calls than the seed bench: the zoo is large), output path."""
    from pathlib import Path

    from .record import OUT_DIR
    from .device import device_info, pick_device
    dev = pick_device(cfg.device)
    gpu = dev.type == "cuda"
    cfg.repeats = cfg.repeats or (10 if gpu else 5)
    cfg.rounds = cfg.rounds or (3 if gpu else 2)
    cfg.input_sets = max(3, cfg.input_sets)  # rotated while timing; CHECK_CALLS are checked
    info = device_info(dev)
    slug = (info["gpu"] or "cpu").lower().replace(" ", "-")
    out = Path(cfg.out or OUT_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}-zoo.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    return dev, info, out


def run_zoo(cfg, console=None):
    """Run the zoo: progress (a rich task per model) and a line per group, then the table,
    the summary, the JSON (rewritten after every group, so that a cut-off run keeps what it
    measured), the PNG and the log beside it (zoo_report). Returns (result, JSON path)."""
    import json
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import zoo_report
    from .record import clean_json
    console = console or Console(width=None if sys.stdout.isatty() else 160, record=True)
    dev, info, out = _setup(cfg)
    st = settings(cfg, dev)
    notes = [] if dev.type == "cuda" else [
        "no GPU used: CPU times say nothing about GPU performance; peak memory is CUDA only"]
    header = dict(info, zoo=True, **st, repeats=cfg.repeats, rounds=cfg.rounds,
                  warmup=cfg.warmup, warmup_ms=cfg.warmup_ms, input_sets=cfg.input_sets,
                  check_calls=CHECK_CALLS, seed=cfg.seed, notes=notes,
                  models_info=describe_models(st))
    base_rec = {"device": dev.type, "gpu": info["gpu"], "torch": torch.__version__}
    result = {"header": header, "records": []}

    def emit(records):
        result["records"].extend(records)
        out.write_text(json.dumps(clean_json(result), indent=1, default=str))
        progress.console.log(group_line(records))
        sys.stdout.flush()

    per_group = len(st["variants"]) * (1 + cfg.rounds)
    progress = Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, auto_refresh=False)
    with precise(), progress:
        total = per_group * len(st["batches"]) * len(st["dtypes"]) * len(st["phases"])
        tasks = {n: progress.add_task(n, total=total) for n in st["models"]}
        for i, name in enumerate(st["models"]):
            def tick(t=tasks[name]):
                progress.advance(t)
                progress.refresh()
            run_model(i, name, st, cfg, dev, tick, emit, base_rec)
            progress.update(tasks[name], completed=total)
            progress.refresh()
    header["summary"] = zoo_report.summary(result["records"])
    out.write_text(json.dumps(clean_json(result), indent=1, default=str))
    zoo_report.report(result, out, console, cfg)
    return result, out

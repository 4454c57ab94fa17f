"""`python -m bench`: the seed models, eager vs torch.compile vs gemmfuse, in one process.

Per model every variant gets its own deepcopy of one freshly built model (so BatchNorm's running
statistics start from the same state), the same input sets (``torch.rand``, rotated while timing),
and is checked against one float64 reference (deepcopy of the model in float64, same inputs).
Times: CUDA events around each call; a model's variants are built first, then timed in
``rounds`` alternating rounds of ``warmup`` untimed and ``repeats`` timed calls each; the median
over every round's calls. Without a GPU it runs on the CPU at a small shape and says so.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .compare import CEILINGS, calls_per_variant, finish, floors, measure_all, reference, variants_for
from .device import device_info, pick_device
from .gpu_monitor import GpuMonitor, summarize as summarize_gpu_state
from .models import MODELS, M99, model_seed
from .record import OUT_DIR, clean_json, record
from .timing import WARMUP_MS, free

CPU_BATCH, CPU_FEATURES = 64, 1024
SWEEP_M_GPU, SWEEP_M_CPU = (1, 16, 128, 1024, 4096), (1, 16, 64, 256)


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
    rounds: int | None = None   # alternating rounds over a model's variants (see measure_all;
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
    matmul: bool = False         # bare fp32 matrix products, gemmfuse's switch (matmul.py)
    matmul_shapes: list | None = None  # None: the device's set (matmul.py)
    lmhead: bool = False         # an LM head + cross-entropy, fwd+bwd (lm_head.py)
    lmhead_shapes: list | None = None  # None: the device's set (lm_head.py)
    attention: bool = False      # fp32 SDPA, forward and fwd+bwd (attention.py)
    attention_shapes: list | None = None  # None: the device's set (attention.py)
    suite_only: list | None = None
    device: str = "auto"
    seed: int = 0
    zoo: bool = False            # the model zoo (zoo.py, zoo_runner.py) instead of the seed models
    zoo_models: list | None = None     # None: all; the rest None: zoo_runner.settings' defaults
    zoo_batches: list | None = None
    zoo_dtypes: list | None = None
    zoo_phases: list | None = None
    zoo_variants: list | None = None


def _input_sets(cls, n, b, k, dev):
    return [cls.get_inputs(b, k, device=dev) for _ in range(n)]


def run_models(cfg, dev, shape, progress, base):
    b, k, n = shape
    variants = variants_for(cfg, dev)
    tasks = {(mid, v): progress.add_task(f"{mid} {v}", total=calls_per_variant(cfg))
             for mid in cfg.models for v in variants}
    records = []
    for mid in cfg.models:
        spec = MODELS[mid]
        torch.manual_seed(model_seed(cfg.seed, mid))
        model, _ = spec.make(b, k, n, device=dev)
        sets = _input_sets(spec.cls, cfg.input_sets, b, k, dev)
        ref, ref_state = reference(model, sets)
        fl = floors(spec, b, k, n)
        rows = measure_all(variants, model, sets, ref, ref_state, cfg, dev, progress,
                            {v: tasks[(mid, v)] for v in variants})
        for rec in rows:
            rec.update(base, model=mid, batch=b, in_features=k, out_features=n,
                       floor_ms=fl["bf16" if rec["dtype"] == "bfloat16" else "fp32"]["floor_ms"],
                       timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        records += finish(rows)
        del model, sets, ref
        free(dev)
    return records


def run_sweep(cfg, dev, k, n, progress, base):
    """m99's chain at several M: eager, gemmfuse fast and fp32; TFLOP/s and GB/s vs the ceilings."""
    ms_list = cfg.sweep_m or (SWEEP_M_GPU if dev.type == "cuda" else SWEEP_M_CPU)
    variants = ["eager", "gemmfuse-fast", "gemmfuse-fp32"]
    tasks = {(m, v): progress.add_task(f"sweep M={m} {v}", total=calls_per_variant(cfg))
             for m in ms_list for v in variants}
    torch.manual_seed(cfg.seed + 100)
    model = M99(k, n).to(dev)
    out = []
    for m in ms_list:
        sets = _input_sets(M99, cfg.input_sets, m, k, dev)
        ref, _ = reference(model, sets)
        flops, bytes_ = 2 * m * n * k, 4 * (m * k + n * k + n + m * n)
        floor = max(flops / (CEILINGS["bf16_tflops"] * 1e12), bytes_ / (CEILINGS["copy_tbs"] * 1e12))
        rows = measure_all(variants, model, sets, ref, {}, cfg, dev, progress,
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
        free(dev)
    del model
    free(dev)
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


def per_shape(cfg):
    """(name, module, its run function) of the per-shape bench cfg asks for (--matmul,
    --lmhead, --attention: shapes of their own, no seed M, K, N; the module's summary, table and
    PLOT_TITLE), or None."""
    if cfg.matmul:
        from . import matmul
        return "matmul", matmul, matmul.run_matmul
    if cfg.lmhead:
        from . import lm_head
        return "lmhead", lm_head, lm_head.run_lmhead
    if cfg.attention:
        from . import attention
        return "attention", attention, attention.run_attention
    return None


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
    # (an LM head's fwd+bwd takes ~20 ms on the CPU even at its small shapes: fewer calls there)
    cfg.repeats = cfg.repeats or (20 if gpu else 10 if cfg.lmhead else 100)
    cfg.rounds = cfg.rounds or (4 if gpu or cfg.lmhead else 8)
    shaped = per_shape(cfg)
    b = cfg.batch or (1024 if gpu else CPU_BATCH)
    k = cfg.in_features or (8192 if gpu else CPU_FEATURES)
    n = cfg.out_features or (8192 if gpu else CPU_FEATURES)
    info = device_info(dev)
    notes = []
    if not gpu and shaped:
        notes.append(f"no GPU used: ran on the CPU at the {shaped[0]} bench's small shapes; "
                     "CPU times say nothing about GPU performance")
    elif not gpu:
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
    grad = cfg.train or cfg.lmhead or cfg.attention  # the benches that time backward calls
    try:
        with (contextlib.nullcontext() if grad else torch.no_grad()), progress:
            if cfg.train:
                from .train import run_train
                records = run_train(cfg, dev, progress, base)
            elif cfg.suite:
                from .suite import run_suite
                records = run_suite(cfg, dev, progress, base, only=cfg.suite_only)
            elif shaped:
                records = shaped[2](cfg, dev, progress, base)
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
                  input_sets=cfg.input_sets, grad="autograd records" if grad else "no_grad",
                  timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"), notes=notes,
                  note="; ".join(notes), ceilings=CEILINGS,
                  models={} if cfg.suite or cfg.train or shaped else
                  {mid: {"summary": MODELS[mid].summary, **floors(MODELS[mid], b, k, n)}
                   for mid in cfg.models})
    if cfg.suite:
        from .suite import summary
        header["suite"] = summary(records)
    if cfg.train:
        header["train"] = True
    if shaped:  # its shapes are its own: no M, K, N of the seed models
        for key in ("batch", "in_features", "out_features"):
            header.pop(key)
        header[shaped[0]] = shaped[1].summary(records)
    result = {"header": header, "records": records}
    if sweep is not None:
        result["sweep"] = sweep
    out.write_text(json.dumps(clean_json(result), indent=1))
    from .plot import plot_speedups, plot_sweep
    png = out.with_suffix(".png")
    plotted = ([dict(r, mode=f"{r['mode']} {r['scenario']}") for r in records] if cfg.train
               else records)
    plot_speedups(plotted, png, f"{header.get('gpu') or 'CPU'} "
                  + (shaped[1].PLOT_TITLE if shaped else
                     f"M={b} K={k} N={n}" + (" training" if cfg.train else "")))
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
    elif shaped:
        console.print(shaped[1].table(records, header))
    else:
        console.print(main_table(records, header))
    log = out.with_suffix(".log")
    console.save_text(str(log))  # everything printed above, as plain text
    paths.append(str(log))
    if cfg.record:
        paths += record(result, paths)
    console.print("wrote " + ", ".join(paths))
    return result, out

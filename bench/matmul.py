"""`python -m bench --matmul`: bare fp32 matrix products, gemmfuse's fp32 switch against what
users would run instead, in the same run.

Variants, per shape:
  eager          torch fp32 (``torch.backends.cuda.matmul.allow_tf32 = False``: cuBLAS SGEMM)
  eager-tf32     torch with allow_tf32 = True: a reference, faster and less accurate
  gemmfuse-fp32  the same product inside ``gemmfuse.fp32_matmul(precision="fp32",
                 devices=(dev.type,))`` (entered around each call, so its host cost counts)
  gemmfuse-fast  the same with precision="fast"
torch.compile is left out: compiling a bare matmul gives cuBLAS's GEMM again (eager's).

Shapes (GPU): 2-D ``a @ b`` (M×N×K) square 256 to 16384 (``sq256`` … ``sq16384``); skinny
``m16``, ``m128`` (M = 16, 128; N = K = 8192), ``k64``, ``k256`` (K = 64, 256; M = N = 8192),
``n64`` (N = 64; M = K = 8192); batched ``[B, M, K] @ [B, K, N]``: ``bmm8x2048``,
``bmm32x1024`` (square products), ``bmm96qk`` (96 × 1024×1024×64, attention's QKᵀ) and
``bmm96pv`` (96 × 1024×64×1024, its PV); GPT-2-small's Linears at 8 × 1024 tokens
(``gpt2qkv`` 8192×2304×768, ``gpt2proj`` 8192×768×768, ``gpt2fc`` 8192×3072×768, ``gpt2fc2``
8192×768×3072). On the CPU a small set (``sq128``, ``sq256``,
``m16x1024``, ``bmm4x64``), whose figures say nothing of a GPU's. ``--matmul-shapes`` picks
shapes of either set by name.

Inputs: ``torch.randn``, fresh per shape (seeded by the shape's name), ``--input-sets`` (3)
sets rotated while timing. Accuracy: each variant's first call against a float64 product of
the same inputs on the device, rel = ‖out − ref‖/‖ref‖; where that check would hold more than
REF_MAX_BYTES (sq16384), only rows 0..1023 of a are multiplied and compared (``ref_rows`` in
the record). Verdicts: gemmfuse-fp32 passes if rel ≤ 1.25 × eager's + 1e-7, gemmfuse-fast if
rel ≤ 1e-4 or eager's is above 1e-4; the eager rows pass if they run with a finite output.
Timing: CUDA events after warm-up, variants alternated round by round (compare.alternate),
the median over rounds. Each gemmfuse record holds the switch's counts for its checked call
(``counts``: where the product ran) and ``ran_on`` from them. Writes the table, JSON, PNG
(speedup over eager per shape) and log under bench/out/ as the other benches do.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .compare import _failed, _tf32, _tick, alternate, calls_per_variant, collect, errors
from .models import model_seed
from .timing import CallTimer, free, sync

VARIANTS = ("eager", "eager-tf32", "gemmfuse-fp32", "gemmfuse-fast")
REF_MAX_BYTES = 8 * 2 ** 30  # float64 a, b, ref, out and out - ref: beyond it, REF_ROWS rows
REF_ROWS = 1024
PLOT_TITLE = "--matmul: bare fp32 products"
PROMISES = {"gemmfuse-fp32": "rel <= 1.25 x eager's + 1e-7",
            "gemmfuse-fast": "rel <= 1e-4, or eager's above 1e-4"}


@dataclass(frozen=True)
class Shape:
    """a @ b with a [B, M, K] and b [B, K, N]; B None: 2-D a [M, K], b [K, N]."""
    name: str
    m: int
    n: int
    k: int
    b: int | None = None

    @property
    def flops(self) -> float:
        return 2.0 * (self.b or 1) * self.m * self.n * self.k

    def dims(self):
        """The shapes of a and b."""
        lead = () if self.b is None else (self.b,)
        return lead + (self.m, self.k), lead + (self.k, self.n)

    def label(self) -> str:
        return "×".join(map(str, ((self.b,) if self.b else ()) + (self.m, self.n, self.k)))


GPU_SHAPES = ([Shape(f"sq{s}", s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192, 16384)]
              + [Shape("m16", 16, 8192, 8192), Shape("m128", 128, 8192, 8192),
                 Shape("k64", 8192, 8192, 64), Shape("k256", 8192, 8192, 256),
                 Shape("n64", 8192, 64, 8192),
                 Shape("bmm8x2048", 2048, 2048, 2048, 8), Shape("bmm32x1024", 1024, 1024, 1024, 32),
                 Shape("bmm96qk", 1024, 1024, 64, 96), Shape("bmm96pv", 1024, 64, 1024, 96)]
              # GPT-2-small's Linears at 8 × 1024 tokens (qkv, attention projection, MLP in, out)
              + [Shape("gpt2qkv", 8192, 2304, 768), Shape("gpt2proj", 8192, 768, 768),
                 Shape("gpt2fc", 8192, 3072, 768), Shape("gpt2fc2", 8192, 768, 3072)])
CPU_SHAPES = [Shape("sq128", 128, 128, 128), Shape("sq256", 256, 256, 256),
              Shape("m16x1024", 16, 1024, 1024), Shape("bmm4x64", 64, 64, 64, 4)]


def shapes_for(dev, names=None, gpu=GPU_SHAPES, cpu=CPU_SHAPES, bench="matmul") -> list:
    """The device's shapes (`gpu` or `cpu`), or those named (from either set)."""
    if not names:
        return gpu if dev.type == "cuda" else cpu
    known = {s.name: s for s in gpu + cpu}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {bench} shape(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names]


def verdict(mode: str, err, eager_err) -> bool:
    """Whether `mode`'s relative error `err` keeps its promise, given eager fp32's `eager_err`:
    fp32 within 1.25 × eager's + 1e-7; fast within 1e-4 unless eager's is above 1e-4; the
    eager rows are informative (True wherever there is an error figure)."""
    if err is None:
        return False
    if mode == "gemmfuse-fp32":
        return eager_err is not None and err <= 1.25 * eager_err + 1e-7
    if mode == "gemmfuse-fast":
        return err <= 1e-4 or (eager_err is not None and eager_err > 1e-4)
    return True


def _inputs(shape, cfg, dev):
    torch.manual_seed(model_seed(cfg.seed, shape.name))
    a_dims, b_dims = shape.dims()
    return [(torch.randn(a_dims, device=dev), torch.randn(b_dims, device=dev))
            for _ in range(cfg.input_sets)]


def reference_rows(shape):
    """None where the float64 check of the whole product fits REF_MAX_BYTES (a, b, the
    reference, the output in float64 and their difference), else REF_ROWS: a's first rows."""
    full = 8 * (shape.b or 1) * (shape.m * shape.k + shape.k * shape.n + 3 * shape.m * shape.n)
    return REF_ROWS if full > REF_MAX_BYTES and shape.m > REF_ROWS else None


def _variant_fn(name, dev):
    """The callable (a, b) -> a @ b that variant `name` times."""
    if name == "eager":
        return torch.matmul
    if name == "eager-tf32":
        def tf32(a, b):
            with _tf32(True):
                return a @ b
        return tf32
    import gemmfuse
    mode = gemmfuse.fp32_matmul(precision=name.split("-", 1)[1], devices=(dev.type,))

    def switched(a, b):
        with mode:
            return a @ b
    return switched


def ran_on(mode, counts) -> str:
    """Where the checked call's products ran: 'PyTorch' for the eager rows, else the switch's
    counts ('gemmfuse', or 'PyTorch: <reason>'), joined."""
    if counts is None:
        return "PyTorch (TF32)" if mode == "eager-tf32" else "PyTorch"
    return "; ".join(sorted(counts)) or "no product counted"


def _build(name, sets, ref, rows, dev, tick):
    """Variant `name`'s record, its first call checked (the switch's counts reset before it),
    and its CallTimer (None after an error)."""
    from gemmfuse import fp32_matmul_counts, matmul_switch
    rec = {"mode": name, "dtype": "float32"}
    try:
        fn = _variant_fn(name, dev)
        matmul_switch.reset_counts()
        out = fn(*sets[0])
        sync(dev)
        tick()
        rec["counts"] = fp32_matmul_counts() if name.startswith("gemmfuse-") else None
        rec["ran_on"] = ran_on(name, rec["counts"])
        rec.update(errors(out if rows is None else out[..., :rows, :], ref))
        del out
        return rec, CallTimer(fn, sets, dev, tick)
    except Exception as e:  # a variant that fails is a record with its error
        _failed(rec, e)
        free(dev)
        return rec, None


def _finish(rows, shape, ref_rows, base):
    """Shape fields, speedup and error over eager's, TFLOP/s and the verdict, per record."""
    eager = next(r for r in rows if r["mode"] == "eager")
    e_ms, e_err = eager.get("ms"), eager.get("rel_err")
    note = (f"error of rows 0..{ref_rows - 1} only (the float64 check of the whole product "
            f"would hold over {REF_MAX_BYTES / 2 ** 30:g} GiB)" if ref_rows else "whole product")
    for r in rows:
        ms, err = r.get("ms"), r.get("rel_err")
        r.update(base, model=shape.name, shape=shape.name, op="mm" if shape.b is None else "bmm",
                 B=shape.b, M=shape.m, N=shape.n, K=shape.k, dims=shape.label(),
                 flops=shape.flops,
                 ref_rows=ref_rows, reference=note, eager_rel_err=e_err,
                 speedup_vs_eager=e_ms / ms if e_ms and ms else None,
                 tflops=shape.flops / (ms * 1e-3) / 1e12 if ms else None,
                 err_vs_eager=err / e_err if err is not None and e_err else None,
                 promise=PROMISES.get(r["mode"], "runs, finite output (informative)"),
                 timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        r["pass"] = bool(not r.get("error") and r.get("finite")
                         and verdict(r["mode"], err, e_err))
    return rows


def _measure(shape, cfg, dev, progress, tasks, base):
    """One shape: inputs, the float64 reference, every variant built and checked, then timed
    in alternating rounds."""
    sets = _inputs(shape, cfg, dev)
    rows = reference_rows(shape)
    a, b = sets[0]
    ref = torch.matmul((a if rows is None else a[..., :rows, :]).double(), b.double())
    progress.console.log(f"matmul bench: {shape.name} ({shape.label()}), float64 reference "
                         + (f"of rows 0..{rows - 1}" if rows else "of the whole product"))
    built = [_build(v, sets, ref, rows, dev, lambda t=tasks[v]: _tick(progress, t))
             for v in VARIANTS]
    del ref, a, b
    return _finish(time_variants(built, VARIANTS, cfg, progress, tasks), shape, rows, base)


def time_variants(built, variants, cfg, progress, tasks) -> list:
    """The built variants timed in alternating rounds, their records; Dynamo reset after a
    compiled variant (its graphs were this shape's alone)."""
    alternate(built, cfg)
    rows = collect(variants, built, cfg, progress, tasks)
    built.clear()  # the timers and their inputs go before the next shape's
    if "compile" in variants:
        torch._dynamo.reset()
    return rows


def run_shapes(shapes, variants, measure, cfg, dev, progress, base) -> list:
    """Every shape's records, in `variants`' order: `measure(shape, cfg, dev, progress, tasks,
    base)` per shape, tasks[v] variant v's progress bar; the device's memory freed after each."""
    tasks = {(s.name, v): progress.add_task(f"{s.name} {v}", total=calls_per_variant(cfg))
             for s in shapes for v in variants}
    records = []
    for s in shapes:
        records += measure(s, cfg, dev, progress, {v: tasks[(s.name, v)] for v in variants}, base)
        free(dev)
    return records


def run_matmul(cfg, dev, progress, base) -> list:
    """Every shape's records (cfg.matmul_shapes, or the device's set), VARIANTS' order."""
    return run_shapes(shapes_for(dev, cfg.matmul_shapes), VARIANTS, _measure, cfg, dev,
                      progress, base)


def summary(records, variants=VARIANTS) -> dict:
    """The header's digest: the shapes, each variant's median speedup and its passes (eager,
    variants[0], the baseline)."""
    out = {"shapes": list(dict.fromkeys(r["shape"] for r in records)), "variants": list(variants)}
    for v in variants[1:]:
        rows = [r for r in records if r["mode"] == v]
        sp = [r["speedup_vs_eager"] for r in rows if r.get("speedup_vs_eager")]
        out[v] = {"median_speedup": statistics.median(sp) if sp else None,
                  "passed": sum(bool(r["pass"]) for r in rows), "shapes": len(rows)}
    return out


def _where(r) -> str:
    counts = r.get("counts")
    if counts and set(counts) == {"gemmfuse"}:
        return "on gemmfuse"
    return r.get("ran_on") or "—"


def table_rows(records, sep=" "):
    """(record, shape cell, verdict cell) per record: the shape's name and dims (joined by
    `sep`) on a shape's first row, blank on the others."""
    last = None
    for r in records:
        shape = "" if r["shape"] == last else f"{r['shape']}{sep}{r['dims']}"
        last = r["shape"]
        yield r, shape, ("[red]error[/]" if r.get("error") else
                         "[green]ok[/]" if r["pass"] else "[red]FAIL[/]")


def table(records, header):
    from rich.table import Table
    f = lambda v, s: "—" if v is None else format(v, s)  # noqa: E731
    cpu = "" if header.get("gpu") else " (CPU figures, small shapes: not the GPU's)"
    t = Table(title=f"gemmfuse bench --matmul — {header.get('gpu') or 'CPU'}{cpu}",
              caption=f"ms: median per call over {header.get('rounds', 1)} rounds alternating "
                      "over each shape's variants; speedup vs eager fp32 (no TF32); TFLOP/s: "
                      "2·B·M·N·K / time; rel err: ‖out − ref‖/‖ref‖ against float64 (*: rows "
                      "0..1023 only); err / eager: over eager fp32's; pass: fp32 ≤ 1.25 × eager's "
                      "+ 1e-7, fast ≤ 1e-4 (or eager's above), eager rows: finite (informative)")
    for c in ("shape (B×)M×N×K", "variant", "ms", "speedup", "TFLOP/s", "rel err", "err / eager",
              "where it ran", "pass"):
        t.add_column(c, justify="left" if c[0] in "svw" else "right")
    for r, shape, ok in table_rows(records):
        t.add_row(shape, r["mode"], f(r.get("ms"), ".3f"), f(r.get("speedup_vs_eager"), ".2f"),
                  f(r.get("tflops"), ".2f"),
                  f(r.get("rel_err"), ".1e") + ("*" if r.get("ref_rows") else ""),
                  f(r.get("err_vs_eager"), ".2f"), _where(r), ok)
    return t

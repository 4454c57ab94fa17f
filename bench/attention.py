"""`python -m bench --attention`: fp32 attention (``F.scaled_dot_product_attention``), forward
and forward + backward (issue 48, item 6), gemmfuse's split-product kernels against what users
would run instead, in the same run.

Variants, per shape and phase:
  eager          ``F.scaled_dot_product_attention`` in fp32: PyTorch's pick (on an H100 the
                 memory-efficient kernel)
  eager-tf32     SDPA's math path with allow_tf32 = True: a reference, faster products and
                 less accurate
  compile        ``torch.compile`` of the SDPA call (default mode), compiled by the first
                 (checked) call of each shape, Dynamo reset after the shape; ``--no-compile``
                 leaves it out
  gemmfuse-fp32  ``gemmfuse.attention.scaled_dot_product_attention``: what optimize() and the
                 torch.compile backend put in place of a model's SDPA call (each direction on
                 gemmfuse's kernel where its route takes it, else PyTorch's)
A forward call is ``out = f(q, k, v)``; a train call also takes ``torch.autograd.grad(out,
(q, k, v), dout)``, the same work for all.

Shapes (B × H × S × D, causal unless ``-full``), each in two phases (``:fwd``, ``:train``),
GPU: ``s1024d64`` 8×12×1024×64 (the issue's target, also ``-full``), ``s512d64`` 8×12×512×64,
``s2048d64`` 4×12×2048×64, ``s4096d64`` 2×12×4096×64, ``s1024d128`` 8×12×1024×128; CPU: a small
set (``s64d32``), whose figures say nothing of a GPU's. ``--attention-shapes`` picks shapes of
either set by name (``s1024d64:train``; a name without a phase takes both).

Inputs: ``torch.randn`` q, k, v, dout, fresh per shape (seeded by its name), ``--input-sets``
(3) rotated while timing. Accuracy: each variant's first call against SDPA's math path in
float64 on the device: the output's ‖Δ‖/‖ref‖ and, in the train phase, dq's, dk's and dv's;
``rel_err`` the largest. Verdicts: gemmfuse-fp32 passes if each is ≤ 1.25 × eager's + 1e-7;
the other rows if they run with a finite output (informative). The issue's target:
gemmfuse-fp32 train at s1024d64 ≥ 3× eager fp32 with errors within eager's (``target_met``).
Timing: CUDA events after warm-up, variants alternated round by round (compare.alternate),
the median over rounds. Writes the table, JSON, PNG and log under bench/out/ as the other
benches do.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .compare import _failed, _tf32, _tick, errors
from . import lm_head, matmul
from .matmul import run_shapes, table_rows, time_variants, verdict
from .models import model_seed
from .timing import CallTimer, free, sync

VARIANTS = ("eager", "eager-tf32", "compile", "gemmfuse-fp32")
PROMISES = {"gemmfuse-fp32": "out (and dq, dk, dv) each <= 1.25 x eager's + 1e-7"}
PLOT_TITLE = "--attention: fp32 SDPA, forward and forward + backward"
TARGET = "gemmfuse-fp32 train at s1024d64 >= 3x eager fp32 SDPA, errors <= eager's (issue 48)"


@dataclass(frozen=True)
class Shape:
    """q, k, v [B, H, S, D]; `train`: forward and backward, else the forward alone."""
    name: str
    b: int
    h: int
    s: int
    d: int
    causal: bool = True
    train: bool = False

    @property
    def outputs(self) -> tuple:
        return ("out", "dq", "dk", "dv") if self.train else ("out",)

    @property
    def flops(self) -> float:
        """The forward's two products, 4·B·H·S²·D (halved where causal); the backward's five
        products 2.5 times that."""
        f = 4.0 * self.b * self.h * self.s * self.s * self.d * (0.5 if self.causal else 1.0)
        return 3.5 * f if self.train else f

    def label(self) -> str:
        return f"{self.b}×{self.h}×{self.s}×{self.d}{'' if self.causal else ' full'}"


def _phases(name, b, h, s, d, causal=True) -> list:
    return [Shape(f"{name}:{p}", b, h, s, d, causal, p == "train") for p in ("fwd", "train")]


GPU_SHAPES = (_phases("s1024d64", 8, 12, 1024, 64) + _phases("s1024d64-full", 8, 12, 1024, 64, False)
              + _phases("s512d64", 8, 12, 512, 64) + _phases("s2048d64", 4, 12, 2048, 64)
              + _phases("s4096d64", 2, 12, 4096, 64) + _phases("s1024d128", 8, 12, 1024, 128))
CPU_SHAPES = _phases("s64d32", 1, 2, 64, 32)


def shapes_for(dev, names=None) -> list:
    """The device's shapes, or those named (from either set; a name without a phase: both)."""
    if names:
        bare = {s.name.split(":")[0] for s in GPU_SHAPES + CPU_SHAPES}
        names = [p for n in names for p in ([f"{n}:fwd", f"{n}:train"] if n in bare else [n])]
    return matmul.shapes_for(dev, names, GPU_SHAPES, CPU_SHAPES, "attention")


def variants_for(cfg) -> list:
    """VARIANTS, without compile where --no-compile says so."""
    return [v for v in VARIANTS if v != "compile" or cfg.compile is not False]


def _inputs(shape, cfg, dev):
    """cfg.input_sets sets (q, k, v, dout); q, k, v require grad in the train phase."""
    torch.manual_seed(model_seed(cfg.seed, shape.name))
    dims = (shape.b, shape.h, shape.s, shape.d)
    return [tuple(torch.randn(dims, device=dev).requires_grad_(shape.train and i < 3)
                  for i in range(4)) for _ in range(cfg.input_sets)]


def _call(sdpa, shape):
    """The timed call of an SDPA function: (out,) or (out, dq, dk, dv)."""
    def call(q, k, v, go):
        out = sdpa(q, k, v, is_causal=shape.causal)
        if not shape.train:
            return (out,)
        return (out.detach(),) + torch.autograd.grad(out, (q, k, v), go)
    return call


def _variant_fn(name, shape):
    if name == "eager":
        return _call(F.scaled_dot_product_attention, shape)
    if name == "eager-tf32":
        call = _call(F.scaled_dot_product_attention, shape)

        def tf32(*args):
            with _tf32(True), sdpa_kernel(SDPBackend.MATH):
                return call(*args)
        return tf32
    if name == "compile":
        return _call(torch.compile(F.scaled_dot_product_attention), shape)
    from gemmfuse.attention import scaled_dot_product_attention
    return _call(scaled_dot_product_attention, shape)


def reference(shape, q, k, v, go) -> dict:
    """The output (and gradients) in float64, SDPA's math path."""
    d = [t.detach().double().requires_grad_(shape.train) for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH), torch.set_grad_enabled(shape.train):
        out = F.scaled_dot_product_attention(*d, is_causal=shape.causal)
        grads = torch.autograd.grad(out, d, go.double()) if shape.train else ()
    return dict(zip(shape.outputs, (out.detach(),) + tuple(grads)))


def check(out, ref, names) -> dict:
    """Each output against the reference as <name>_err, the largest as rel_err, finite."""
    rec, finite = {}, True
    for k, o in zip(names, out):
        e = errors(o, ref[k])
        rec[f"{k}_err"], finite = e["rel_err"], finite and e["finite"]
    errs = [rec[f"{k}_err"] for k in names]
    rec.update(rel_err=None if None in errs else max(errs), finite=finite)
    return rec


def ran_on(name, q) -> str:
    if name != "gemmfuse-fp32":
        return {"compile": "Inductor", "eager-tf32": "PyTorch (math, TF32)"}.get(name, "PyTorch")
    from gemmfuse import attention
    why = attention.forward_route(q, q, q) if q.is_cuda else f"attention on {q.device.type}"
    return "gemmfuse" if not why else f"PyTorch: {why}"


def _build(name, shape, sets, ref, dev, tick):
    """Variant `name`'s record, its first call checked, and its CallTimer (None after an error)."""
    rec = {"mode": name, "dtype": "float32"}
    try:
        fn = _variant_fn(name, shape)
        out = fn(*sets[0])
        sync(dev)
        tick()
        rec.update(check(out, ref, shape.outputs))
        del out
        rec["peak_mib"] = lm_head.peak_mib(fn, sets[0], dev)
        rec["ran_on"] = ran_on(name, sets[0][0])
        return rec, CallTimer(fn, sets, dev, tick)
    except Exception as e:  # a variant that fails is a record with its error
        _failed(rec, e)
        free(dev)
        return rec, None


def _finish(rows, shape, base):
    eager = next(r for r in rows if r["mode"] == "eager")
    for r in rows:
        ms = r.get("ms")
        mine = {k: r.get(f"{k}_err") for k in shape.outputs}
        theirs = {k: eager.get(f"{k}_err") for k in shape.outputs}
        worst = [m / t for m, t in ((mine[k], theirs[k]) for k in shape.outputs)
                 if m is not None and t]
        r.update(base, model=shape.name, shape=shape.name, B=shape.b, H=shape.h, S=shape.s,
                 D=shape.d, causal=shape.causal, phase="train" if shape.train else "fwd",
                 dims=shape.label(), flops=shape.flops, eager_rel_err=eager.get("rel_err"),
                 eager_errs=theirs,
                 speedup_vs_eager=eager["ms"] / ms if eager.get("ms") and ms else None,
                 tflops=shape.flops / (ms * 1e-3) / 1e12 if ms else None,
                 err_vs_eager=max(worst) if worst else None,
                 reference="SDPA's math path in float64 on the device",
                 promise=PROMISES.get(r["mode"], "runs, finite output (informative)"),
                 timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        r["pass"] = bool(not r.get("error") and r.get("finite")
                         and all(verdict(r["mode"], mine[k], theirs[k]) for k in shape.outputs))
    return rows


def _measure(shape, cfg, dev, progress, tasks, base):
    """One shape and phase: inputs, the float64 reference, every variant built and checked,
    then timed in alternating rounds."""
    variants = list(tasks)
    sets = _inputs(shape, cfg, dev)
    ref = reference(shape, *sets[0])
    progress.console.log(f"attention bench: {shape.name} ({shape.label()})")
    built = [_build(v, shape, sets, ref, dev, lambda t=tasks[v]: _tick(progress, t))
             for v in variants]
    del ref
    rows = time_variants(built, variants, cfg, progress, tasks)
    del sets
    return _finish(rows, shape, base)


def run_attention(cfg, dev, progress, base) -> list:
    """Every shape's records (cfg.attention_shapes, or the device's set), VARIANTS' order."""
    return run_shapes(shapes_for(dev, cfg.attention_shapes), variants_for(cfg), _measure, cfg,
                      dev, progress, base)


def summary(records) -> dict:
    """matmul's digest (each variant's median speedup and passes) and the issue's target."""
    variants = list(dict.fromkeys(r["mode"] for r in records)) or list(VARIANTS)
    out = matmul.summary(records, variants)
    out["target"] = TARGET
    out["target_met"] = {r["shape"]: bool(r["pass"] and (r.get("speedup_vs_eager") or 0) >= 3)
                         for r in records
                         if r["mode"] == "gemmfuse-fp32" and r["shape"].startswith("s1024d64:train")}
    return out


def table(records, header):
    from rich import box
    from rich.table import Table
    f = lambda v, s: "—" if v is None else format(v, s)  # noqa: E731
    cpu = "" if header.get("gpu") else " (CPU figures, small shapes: not the GPU's)"
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False,
              title=f"gemmfuse bench --attention — {header.get('gpu') or 'CPU'}{cpu}",
              caption=f"ms: median per call over {header.get('rounds', 1)} rounds alternating over "
                      "each shape's variants; speedup vs eager fp32 SDPA; TFLOP/s: 4·B·H·S²·D "
                      "(halved causal) per forward, 3.5× that with the backward; errors: ‖Δ‖/‖ref‖ "
                      "against float64; err / eager: the worst over eager fp32's; pass: "
                      "gemmfuse-fp32 each ≤ 1.25 × eager's + 1e-7, other rows finite "
                      f"(informative). Target: {TARGET}")
    for c in ("shape\nB×H×S×D", "variant", "ms", "speedup", "TFLOP/s", "out\nerr", "dq\nerr",
              "dk\nerr", "dv\nerr", "err /\neager", "peak\nMiB", "where it ran", "pass"):
        t.add_column(c, justify="left" if c[:2] in ("sh", "va", "wh") else "right",
                     no_wrap=c != "where it ran")
    for r, shape, ok in table_rows(records, "\n"):
        t.add_row(shape, r["mode"], f(r.get("ms"), ".3f"), f(r.get("speedup_vs_eager"), ".2f"),
                  f(r.get("tflops"), ".2f"),
                  *(f(r.get(f"{k}_err"), ".1e") for k in ("out", "dq", "dk", "dv")),
                  f(r.get("err_vs_eager"), ".2f"), f(r.get("peak_mib"), ".0f"),
                  r.get("ran_on") or "—", ok)
    return t

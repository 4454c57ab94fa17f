"""`python -m bench --lmhead`: an LM head's Linear and cross-entropy loss, forward and backward
(issue 48, item 6), gemmfuse.linear_cross_entropy against what users would run instead, in the
same run.

Variants, per shape, each timed as one training call of the head:
  eager          ``F.cross_entropy(F.linear(x, W, b), target)`` in fp32 (the runner sets
                 ``torch.backends.cuda.matmul.allow_tf32 = False``: cuBLAS SGEMM)
  eager-tf32     the same with allow_tf32 = True: a reference, faster and less accurate
  compile        ``torch.compile`` of that function (default mode, fp32 without TF32), compiled
                 by the first (checked) call of each shape, Dynamo reset after the shape;
                 ``--no-compile`` leaves it out; a failed compile is the record's error
  gemmfuse-fp32  ``gemmfuse.linear_cross_entropy(x, W, target, bias=b, precision="fp32")``
  gemmfuse-fast  the same with precision="fast"
Each timed call is ``loss = f(x, W, b, target)`` then ``torch.autograd.grad(loss, (x, W, b))``
for every variant: the three gradients are returned, none accumulated into ``.grad`` (so no
zeroing inside the timed call), the same work for all.

Shapes (M tokens × d × V classes), GPU: ``gpt2`` 8192×768×50257 (the issue's target),
``gpt2x2`` 16384×768×50257, ``llama`` 4096×4096×32000, ``llama3`` 4096×4096×128256; CPU: a small
set (``m256v1000``, ``m512v5000``), whose figures say nothing of a GPU's. ``--lmhead-shapes``
picks shapes of either set by name.

Inputs, fresh per shape (seeded by the shape's name): W = randn(V, d)·d^-½, b = randn(V)·0.1
(shared by the sets), x = randn(M, d) and target = randint(0, V) with about 5% of rows set to
ignore_index (-100), ``--input-sets`` (3) of them rotated while timing. Accuracy: each variant's
first call against float64 of the same inputs on the device (F.linear + F.cross_entropy with
autograd): the loss's relative error |Δ|/|ref| and each gradient's ‖Δ‖/‖ref‖ (dx, dW, db),
``rel_err`` the largest. The float64 reference runs in chunks of rows whose [rows, V] float64
tensors (logits, log-softmax and their gradients) stay within REF_CHUNK_BYTES: each chunk's
summed loss and gradients, the sums divided by the count of rows not ignored (what reduction
"mean" is), so the whole call is checked at every shape (``ref_chunks``, ``reference``).
Verdicts: gemmfuse-fp32 passes if each of the four errors is ≤ 1.25 × eager's + 1e-7,
gemmfuse-fast if each is ≤ 1e-4 or eager's above 1e-4; the other rows pass if they run with a
finite output (informative). Peak memory (CUDA): one call after torch.cuda.reset_peak_memory_
stats, the peak less what was allocated before it (inputs and W), ``peak_mib`` and
``peak_vs_eager``; None on the CPU. The issue's target: gemmfuse-fp32 ≥ 3× eager fp32 at ≤ 0.5×
its peak memory (``target_met`` per shape in the header). An error (CUDA out of memory
included) is that variant's record; its memory is freed and the bench goes on.
Timing: CUDA events after warm-up, variants alternated round by round (compare.alternate),
the median over rounds. W does not change between calls: gemmfuse's kept preparation of W
(per version of W) is reused across the timed calls, as between the micro-batches of one
optimizer step, not across steps. gemmfuse rows hold the plan for the call
(``gemmfuse.lm_head.describe``: its chunks and where each product runs) as ``plan``, and
``ran_on``. Writes the table, JSON, PNG (speedup over eager per shape) and log under
bench/out/ as the other benches do.
"""
from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .compare import _failed, _tf32, _tick, errors
from . import matmul
from .matmul import run_shapes, table_rows, time_variants, verdict
from .models import model_seed
from .timing import CallTimer, free, sync

VARIANTS = ("eager", "eager-tf32", "compile", "gemmfuse-fp32", "gemmfuse-fast")
ERRS = ("loss", "dx", "dW", "db")  # the checked outputs, in the timed call's order
IGNORE = -100                      # ignore_index, F.cross_entropy's default
IGNORED = 0.05                     # the share of rows whose target is IGNORE
REF_CHUNK_BYTES = 2 * 2 ** 30      # a reference chunk's [rows, V] float64 tensors (4 of them)
PROMISES = {"gemmfuse-fp32": "loss, dx, dW, db each <= 1.25 x eager's + 1e-7",
            "gemmfuse-fast": "loss, dx, dW, db each <= 1e-4, or eager's above 1e-4"}
PLOT_TITLE = "--lmhead: Linear + cross-entropy, forward + backward"
TARGET = "gemmfuse-fp32 fwd+bwd >= 3x eager fp32 at <= 0.5x its peak memory (issue 48)"


@dataclass(frozen=True)
class Shape:
    """x [M, d], W [V, d], b [V], target [M]."""
    name: str
    m: int
    d: int
    v: int

    @property
    def flops(self) -> float:
        """The three products of forward + backward (logits, dx, dW): 3 · 2·M·d·V."""
        return 6.0 * self.m * self.d * self.v

    def label(self) -> str:
        return f"{self.m}×{self.d}×{self.v}"


GPU_SHAPES = [Shape("gpt2", 8192, 768, 50257), Shape("gpt2x2", 16384, 768, 50257),
              Shape("llama", 4096, 4096, 32000), Shape("llama3", 4096, 4096, 128256)]
CPU_SHAPES = [Shape("m256v1000", 256, 64, 1000), Shape("m512v5000", 512, 128, 5000)]


def shapes_for(dev, names=None) -> list:
    """The device's shapes, or those named (from either set)."""
    return matmul.shapes_for(dev, names, GPU_SHAPES, CPU_SHAPES, "lmhead")


def variants_for(cfg) -> list:
    """VARIANTS, without compile where --no-compile says so."""
    return [v for v in VARIANTS if v != "compile" or cfg.compile is not False]


def _inputs(shape, cfg, dev):
    """cfg.input_sets sets (x, W, b, target), W and b shared; x, W, b require grad."""
    torch.manual_seed(model_seed(cfg.seed, shape.name))
    w = (torch.randn(shape.v, shape.d, device=dev) * shape.d ** -0.5).requires_grad_()
    b = (torch.randn(shape.v, device=dev) * 0.1).requires_grad_()
    sets = []
    for _ in range(cfg.input_sets):
        t = torch.randint(0, shape.v, (shape.m,), device=dev)
        t[torch.rand(shape.m, device=dev) < IGNORED] = IGNORE
        sets.append((torch.randn(shape.m, shape.d, device=dev).requires_grad_(), w, b, t))
    return sets


def eager_loss(x, w, b, t, reduction="mean"):
    return F.cross_entropy(F.linear(x, w, b), t, ignore_index=IGNORE, reduction=reduction)


def fwd_bwd(loss_fn):
    """The timed call of a loss function: (loss, dx, dW, db), by torch.autograd.grad."""
    def call(x, w, b, t):
        loss = loss_fn(x, w, b, t)
        return (loss.detach(),) + torch.autograd.grad(loss, (x, w, b))
    return call


def _variant_fn(name):
    """Variant `name`'s timed call (x, W, b, target) -> (loss, dx, dW, db)."""
    if name == "eager":
        return fwd_bwd(eager_loss)
    if name == "eager-tf32":
        call = fwd_bwd(eager_loss)

        def tf32(*args):
            with _tf32(True):
                return call(*args)
        return tf32
    if name == "compile":
        return fwd_bwd(torch.compile(eager_loss))
    import gemmfuse
    precision = name.split("-", 1)[1]
    return fwd_bwd(lambda x, w, b, t: gemmfuse.linear_cross_entropy(
        x, w, t, bias=b, ignore_index=IGNORE, precision=precision))


def reference_chunk_rows(shape) -> int:
    """Rows per chunk of the float64 reference: its [rows, V] float64 logits, log-softmax and
    their gradients within REF_CHUNK_BYTES (all M rows where they fit)."""
    return max(1, min(shape.m, REF_CHUNK_BYTES // (4 * 8 * shape.v)))


def reference(x, w, b, t, chunk_rows) -> dict:
    """The loss and the gradients of x, W and b in float64 (reduction "mean"), `chunk_rows`
    rows at a time: each chunk's summed loss and gradients, the sums over the count of rows
    whose target is not IGNORE."""
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    dx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    dw, db = torch.zeros_like(w64), torch.zeros_like(b64)
    for s in range(0, x.shape[0], chunk_rows):
        xc = x[s:s + chunk_rows].detach().double().requires_grad_()
        lc = eager_loss(xc, w64, b64, t[s:s + chunk_rows], reduction="sum")
        gx, gw, gb = torch.autograd.grad(lc, (xc, w64, b64))
        loss += lc.detach()
        dx[s:s + chunk_rows] = gx
        dw += gw
        db += gb
        del lc, gx, gw, gb
    n = (t != IGNORE).sum().double()
    return {"loss": loss / n, "dx": dx / n, "dW": dw / n, "db": db / n}


def check(out, ref) -> dict:
    """Each of (loss, dx, dW, db) against the reference (compare.errors' rel: |Δ|/|ref| for
    the loss, ‖Δ‖/‖ref‖ for the gradients) as <name>_err, the largest as rel_err, finite."""
    rec, finite = {}, True
    for k, o in zip(ERRS, out):
        e = errors(o, ref[k])
        rec[f"{k}_err"] = e["rel_err"]
        finite &= e["finite"]
        if e.get("error"):
            rec["error"] = f"{k}: {e['error']}"
    errs = [rec[f"{k}_err"] for k in ERRS]
    rec.update(rel_err=None if None in errs else max(errs), finite=finite)
    return rec


def peak_mib(fn, args, dev):
    """CUDA: the peak memory of one call of fn(*args) above what was allocated before it, MiB;
    None elsewhere."""
    if dev.type != "cuda":
        return None
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    out = fn(*args)
    sync(dev)
    del out
    return (torch.cuda.max_memory_allocated(dev) - before) / 2 ** 20


def plan(name, x, w, b):
    """(plan, ran_on): a gemmfuse row's plan for the call (gemmfuse.lm_head.describe) and, from
    it, where its products run and in how many chunks; (None, what runs) for the others."""
    if not name.startswith("gemmfuse-"):
        return None, {"compile": "Inductor", "eager-tf32": "PyTorch (TF32)"}.get(name, "PyTorch")
    from gemmfuse import lm_head
    if not lm_head._fused(x, w, b):
        return None, "PyTorch (not taken: no operator library)"
    text = lm_head.describe(x, w, b, precision=name.split("-", 1)[1])
    routes = list(dict.fromkeys(line.split(": ", 1)[-1] for line in text.splitlines()[1:]))
    where = ("gemmfuse" if routes and all(r.startswith("gemmfuse") for r in routes)
             else "; ".join(routes))
    n = re.match(r"chunks of \d+ rows: (\d+)", text)
    return text, where + (f", {n[1]} chunk{'s' * (n[1] != '1')}" if n else "")


def _build(name, sets, ref, dev, tick):
    """Variant `name`'s record, its first call checked and its peak memory measured, and its
    CallTimer (None after an error, whose memory is freed)."""
    rec = {"mode": name, "dtype": "float32"}
    try:
        fn = _variant_fn(name)
        out = fn(*sets[0])  # compile's first call compiles
        sync(dev)
        tick()
        rec.update(check(out, ref))
        del out
        rec["peak_mib"] = peak_mib(fn, sets[0], dev)
        rec["plan"], rec["ran_on"] = plan(name, *sets[0][:3])
        timer = CallTimer(fn, sets, dev, tick)
    except Exception as e:  # a variant that fails (out of memory too) is a record with its error
        _failed(rec, e)
        timer = out = None
    if timer is None:  # freed here, the exception, its frames and `out` gone
        free(dev)
    return rec, timer


def _ratio(a, b):
    return a / b if a is not None and b else None


def _finish(rows, shape, chunk_rows, base):
    """Shape fields, speedup, peak memory and errors over eager's, TFLOP/s and the verdict."""
    eager = next(r for r in rows if r["mode"] == "eager")
    chunks = -(-shape.m // chunk_rows)
    note = (f"float64 on the device, the whole call: rows in {chunks} chunk(s) of up to "
            f"{chunk_rows} (summed losses and gradients over the count of rows not ignored)")
    for r in rows:
        ms, mine = r.get("ms"), {k: r.get(f"{k}_err") for k in ERRS}
        theirs = {k: eager.get(f"{k}_err") for k in ERRS}
        worst = [x for x in (_ratio(mine[k], theirs[k]) for k in ERRS) if x is not None]
        r.update(base, model=shape.name, shape=shape.name, M=shape.m, d=shape.d, V=shape.v,
                 dims=shape.label(), flops=shape.flops, ref_chunks=chunks,
                 ref_chunk_rows=chunk_rows, reference=note, eager_rel_err=eager.get("rel_err"),
                 eager_errs=theirs, speedup_vs_eager=_ratio(eager.get("ms"), ms),
                 tflops=shape.flops / (ms * 1e-3) / 1e12 if ms else None,
                 err_vs_eager=max(worst) if worst else None,
                 peak_vs_eager=_ratio(r.get("peak_mib"), eager.get("peak_mib")),
                 promise=PROMISES.get(r["mode"], "runs, finite output (informative)"),
                 timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        r["pass"] = bool(not r.get("error") and r.get("finite")
                         and all(verdict(r["mode"], mine[k], theirs[k]) for k in ERRS))
    return rows


def _measure(shape, cfg, dev, progress, tasks, base):
    """One shape: inputs, the float64 reference, every variant built and checked, then timed
    in alternating rounds."""
    variants = list(tasks)
    sets = _inputs(shape, cfg, dev)
    chunk_rows = reference_chunk_rows(shape)
    ref = reference(*sets[0], chunk_rows)
    progress.console.log(f"lmhead bench: {shape.name} ({shape.label()}), float64 reference in "
                         f"chunks of {chunk_rows} rows")
    built = [_build(v, sets, ref, dev, lambda t=tasks[v]: _tick(progress, t)) for v in variants]
    del ref
    rows = time_variants(built, variants, cfg, progress, tasks)
    del sets
    return _finish(rows, shape, chunk_rows, base)


def run_lmhead(cfg, dev, progress, base) -> list:
    """Every shape's records (cfg.lmhead_shapes, or the device's set), VARIANTS' order."""
    return run_shapes(shapes_for(dev, cfg.lmhead_shapes), variants_for(cfg), _measure, cfg, dev,
                      progress, base)


def summary(records) -> dict:
    """The header's digest: matmul's (the shapes, each variant's median speedup and passes),
    each variant's median peak memory over eager's, and the issue's target per shape."""
    variants = list(dict.fromkeys(r["mode"] for r in records)) or list(VARIANTS)
    out = matmul.summary(records, variants)
    for v in variants[1:]:
        peaks = [r["peak_vs_eager"] for r in records if r["mode"] == v and r.get("peak_vs_eager")]
        out[v]["median_peak_vs_eager"] = statistics.median(peaks) if peaks else None
    out["target"] = TARGET
    out["target_met"] = {r["shape"]: met(r) for r in records if r["mode"] == "gemmfuse-fp32"}
    return out


def met(r):
    """Whether gemmfuse-fp32's record `r` meets the issue's target (None without the figures:
    on the CPU, or where eager failed)."""
    s, p = r.get("speedup_vs_eager"), r.get("peak_vs_eager")
    return None if s is None or p is None else bool(r["pass"] and s >= 3 and p <= 0.5)


def table(records, header):
    from rich import box
    from rich.table import Table
    f = lambda v, s: "—" if v is None else format(v, s)  # noqa: E731
    cpu = "" if header.get("gpu") else " (CPU figures, small shapes: not the GPU's)"
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=f"gemmfuse bench --lmhead — {header.get('gpu') or 'CPU'}{cpu}",
              caption=f"ms: median per forward + backward (torch.autograd.grad of x, W, b) over "
                      f"{header.get('rounds', 1)} rounds alternating over each shape's variants; "
                      "speedup vs eager fp32 (no TF32); TFLOP/s: 6·M·d·V / time; errors against "
                      "float64: loss |Δ|/|ref|, dx dW db ‖Δ‖/‖ref‖; err / eager: the worst of "
                      "the four over eager fp32's; peak: CUDA memory of one call above its "
                      "inputs; pass: fp32 each ≤ 1.25 × eager's + 1e-7, fast each ≤ 1e-4 (or "
                      f"eager's above), other rows finite (informative). Target: {TARGET}")
    for c in ("shape\nM×d×V", "variant", "ms", "speedup", "TFLOP/s", "loss\nerr", "dx\nerr",
              "dW\nerr", "db\nerr", "err /\neager", "peak\nMiB", "peak /\neager", "where it ran",
              "pass"):
        left = c[:2] in ("sh", "va", "wh")
        t.add_column(c, justify="left" if left else "right", no_wrap=c != "where it ran")
    for r, shape, ok in table_rows(records, "\n"):
        t.add_row(shape, r["mode"], f(r.get("ms"), ".3f"), f(r.get("speedup_vs_eager"), ".2f"),
                  f(r.get("tflops"), ".2f"), *(f(r.get(f"{k}_err"), ".1e") for k in ERRS),
                  f(r.get("err_vs_eager"), ".2f"), f(r.get("peak_mib"), ".0f"),
                  f(r.get("peak_vs_eager"), ".2f"), r.get("ran_on") or "—", ok)
    return t

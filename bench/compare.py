"""One model's variants compared (the seed models and the suite): each variant built on its
own copy, its first call checked against a float64 reference, then all timed in alternating
rounds (measure_all); the verdicts against each precision's promise (finish, judge) and the
floors at the H100's ceilings."""
from __future__ import annotations

import contextlib
import copy
import io
import math
import traceback

import torch

from .timing import CallTimer, free, share_batching, sync


# H100 SXM ceilings (docs/measurements.md): cuBLAS bf16 GEMM rate, device copy bandwidth
# (bytes read + written), and the measured fp32/TF32 cuBLAS rates at the seed GEMM for context.
CEILINGS = {
    "bf16_tflops": 740.0,
    "copy_tbs": 2.97,
    "sgemm_tflops": 2 * 1024 * 8192 * 8192 / 2.726e-3 / 1e12,
    "tf32_tflops": 2 * 1024 * 8192 * 8192 / 0.387e-3 / 1e12,
    "source": "H100 80GB HBM3 figures (docs/measurements.md); other GPUs differ",
}


# `fast` promises atol = rtol = 1e-4 against float64 (design.md); the bench also holds it to
# rel <= 2e-5, the first design's bound, so that a systematic error allclose passes shows.
FAST_REL_MAX = 2e-5


def _tick(progress, task):
    progress.advance(task)
    progress.refresh()


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
    worst = float(d.abs().max()) if d.numel() else 0.0
    return {"rel_err": finite_or_none(rel), "max_abs_err": finite_or_none(worst),
            "allclose_1e4": bool(torch.allclose(o, ref, atol=1e-4, rtol=1e-4)), "finite": finite}


def finite_or_none(v):
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
    return {"state_rel_err": finite_or_none(rel), "state_ok": bool(ok and rel <= tol)}


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
        sync(dev)
        tick()
        rec.update(errors(out, ref))
        rec.update(state_errors([holder, m], ref_state, dtype))
        del out
        return rec, CallTimer(fn, xs, dev, tick)
    except Exception as e:
        _failed(rec, e)
        free(dev)
        return rec, None


def _failed(rec, e):
    rec.update(error=f"{type(e).__name__}: {e}"[:1000], ms=None,
               traceback=traceback.format_exc()[-2000:])


def measure_all(variants, model, sets, ref, ref_state, cfg, dev, progress, tasks):
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
    alternate(built, cfg)
    records = []
    for v, (rec, timer) in zip(variants, built):
        if timer is not None and not rec.get("error"):
            rec.update(timer.summary())
            if v.startswith("gemmfuse-"):
                rec["routes"] = _routes(timer.fn)
        progress.update(tasks[v], completed=calls_per_variant(cfg))
        records.append(rec)
    del built
    if "compile" in variants:
        torch._dynamo.reset()
    free(dev)
    return records


def alternate(built, cfg):
    """Time `built`, a list of (record, CallTimer or None), in cfg.rounds alternating rounds
    (see measure_all), every timer at one batch size (share_batching); a round that raises
    marks its record failed and that variant is timed no further."""
    share_batching([t for rec, t in built if t is not None and not rec.get("error")], cfg.warmup)
    for r in range(cfg.rounds):
        # Odd rounds run the variants in reverse (ABBA): each one follows a different
        # predecessor, whose heat and clock it may inherit, in alternate rounds.
        for rec, timer in (built if r % 2 == 0 else built[::-1]):
            if timer is not None and not rec.get("error"):
                try:
                    timer.round(cfg.warmup, cfg.repeats, cfg.warmup_ms)
                except Exception as e:
                    _failed(rec, e)


def collect(variants, built, cfg, progress, tasks):
    """The records of `built` (see alternate), in `variants`' order, each with its timer's
    summary (none after an error); every variant's progress bar filled."""
    out = []
    for v, (rec, timer) in zip(variants, built):
        if timer is not None and not rec.get("error"):
            rec.update(timer.summary())
        progress.update(tasks[v], completed=calls_per_variant(cfg))
        out.append(rec)
    return out


def reference(model, sets):
    r = copy.deepcopy(model).double()
    out = r(*[x.double() for x in sets[0]])
    st = {k: v.detach().double().cpu().clone() for k, v in _state(r).items()}
    del r
    return out.detach(), st


def calls_per_variant(cfg):
    return 1 + cfg.rounds * (cfg.warmup + cfg.repeats)

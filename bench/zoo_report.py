"""What `python -m bench --zoo` shows and writes from its records (zoo_runner.py): the rich
table (a row per model, batch, dtype and phase; a column per variant), the summary (median
speedups per dtype and phase; the rows where optimize is slower than eager or the backend
slower than torch.compile), the PNG chart and the log."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

SLOW = 0.98  # below this speedup a row is listed as slower


def groups(records):
    """Records by (model, batch, dtype, phase), in the order they ran."""
    out = {}
    for r in records:
        out.setdefault((r["model"], r["batch"], r["dtype"], r["phase"]), []).append(r)
    return out


def _where(r):
    return f"{r['model']} {r['batch']} {r['dtype']} {r['phase']}"


def err_of(r):
    """The error a row is judged by, against float64: the forward output's, or in training
    all parameter gradients' together (||g - g64|| / ||g64|| over every parameter). The worst
    single parameter's error stays in the record (grad_rel_err) but is not judged: a parameter
    whose gradient is orders of magnitude below the largest carries the whole effect of any
    ReLU kink that fp32 rounding happens to cross in the layers above it, so it swings from
    1e-6 to 1e-3 with the GEMM's rounding order (deep-mlp's first layer: eager fp32 1.2e-3 and
    the fused path 1.5e-6 on an H200, the reverse on an H100)."""
    return r.get("grad_rel_err_all") if r["phase"] == "train" else r.get("rel_err")


def worse_than_eager(r, eager):
    """The variant's error is well beyond eager's of the same dtype (four times it, plus a
    dtype-sized margin): a wrong result rather than another order of rounding."""
    mine, base = err_of(r), err_of(eager or {"phase": r["phase"]})
    if r.get("error") or mine is None or base is None:
        return False
    return mine > 4 * base + (1e-2 if r["dtype"] == "bf16" else 1e-5)


def _eager_of(records):
    return {(r["model"], r["batch"], r["dtype"], r["phase"]): r for r in records
            if r["variant"] == "eager"}


def summary(records):
    """Median speedup vs eager of each variant per dtype and phase (over the rows where it
    ran), errors per variant, and the rows below SLOW: optimize vs eager, backend vs compile."""
    med = {}
    for (dt, ph), by in _by_panel(records).items():
        med[f"{dt} {ph}"] = {v: (statistics.median(xs) if xs else None) for v, xs in by.items()}
    errors = {}
    for r in records:
        if r.get("error"):
            errors[r["variant"]] = errors.get(r["variant"], 0) + 1
    eager = _eager_of(records)
    wrong = [f"{_where(r)} {r['variant']}: {err_of(r):.1e} (eager {err_of(e):.1e})"
             for r in records if r["variant"] != "eager"
             and worse_than_eager(r, e := eager.get((r["model"], r["batch"], r["dtype"], r["phase"])))]
    return {"median_speedup": med, "errors": errors, "error_worse_than_eager": wrong,
            "optimize_slower_than_eager": [f"{_where(r)}: {r['speedup']:.2f}x" for r in records
                                           if r["variant"] == "optimize"
                                           and (r.get("speedup") or SLOW) < SLOW],
            "backend_slower_than_compile": [f"{_where(r)}: {r['vs_compile']:.2f}x" for r in records
                                            if r["variant"] == "backend"
                                            and (r.get("vs_compile") or SLOW) < SLOW]}


def _by_panel(records):
    out = {}
    for r in records:
        if r["variant"] != "eager":
            xs = out.setdefault((r["dtype"], r["phase"]), {}).setdefault(r["variant"], [])
            if r.get("speedup"):
                xs.append(r["speedup"])
    return out


def summary_lines(s):
    lines = []
    for panel, by in s["median_speedup"].items():
        parts = [f"{v} {x:.2f}×" if x else f"{v} —" for v, x in by.items()]
        lines.append(f"median speedup vs eager, {panel}: " + ", ".join(parts))
    if s["errors"]:
        lines.append("errors: " + ", ".join(f"{v} {n}" for v, n in s["errors"].items()))
    for key, what in (("error_worse_than_eager", "error vs float64 well beyond eager's"),
                      ("optimize_slower_than_eager", f"optimize < {SLOW}× eager"),
                      ("backend_slower_than_compile", f"backend < {SLOW}× compile")):
        rows = s.get(key, [])
        lines.append(f"{what}: " + ("; ".join(rows) if rows else "none"))
    return lines


def _fmt(v, f):
    return "—" if v is None else format(v, f)


def cell(r, errs, eager=None):
    """A variant's cell: eager's ms or the speedup, the error against float64 (train: all
    gradients together; red where well beyond eager's), peak MB, chains fused, and the
    backend's ratio to torch.compile."""
    if r is None:
        return "—"
    if r.get("error"):
        return f"[red]error {errs.setdefault(r['error'], len(errs) + 1)}[/]"
    if r["variant"] == "eager":
        lines = [f"{_fmt(r.get('ms'), '.3f')} ms"]
    else:
        s = r.get("speedup")
        color = "red" if s and s < SLOW else "green" if s and s > 1 / SLOW else "default"
        lines = [f"[{color}]{_fmt(s, '.2f')}×[/]"]
    text = f"{'∇' if r['phase'] == 'train' else 'err'} {_fmt(err_of(r), '.0e')}"
    lines.append(f"[red]{text}![/]" if worse_than_eager(r, eager) else text)
    if r.get("peak_mb") is not None:
        lines.append(f"{r['peak_mb']:.0f} MB")
    if r.get("chains_total") is not None:
        ran = r.get("chains_ran_fused")
        mode = "train" if r["phase"] == "train" else "forward"
        lines.append(f"{r['chains_fused']}/{r['chains_total']} fused"
                     + (", model ran" if mode in (r.get("whole_eager") or ())
                        else f", {ran} ran" if ran is not None else ""))
    for key, name in (("attention", "attn"), ("lm_heads", "lm-head")):
        if r.get(f"{key}_total"):
            lines.append(f"{name} {r[f'{key}_fused']}/{r[f'{key}_total']}")
    if r["variant"] == "backend" and r.get("vs_compile"):
        lines.append(f"{r['vs_compile']:.2f}× cmp")
    return "\n".join(lines)


def table(records, header):
    """The rich table and the error messages it numbers ({message: number})."""
    from rich.table import Table
    t = Table(title=f"gemmfuse bench --zoo — {header.get('gpu') or 'CPU'}", show_lines=True,
              caption="eager: median ms per call (forward: no_grad; train: zero_grad, forward, "
                      "loss, backward, AdamW step); others: speedup vs eager (same dtype), "
                      "'cmp': backend vs torch.compile. err: ||out-ref||/||ref|| vs float64 "
                      "(worst of the first calls); ∇: the error of all parameter gradients "
                      "together vs float64 on the first step (red !: well beyond eager's); MB: peak CUDA "
                      "memory of the variant (its own resident memory + its calls' peak); "
                      "fused: chains gemmfuse fused / found (explain), and how many of them "
                      "ran fused (the others were routed to PyTorch; 'model ran': timed as a "
                      "whole, the model itself was faster and ran); attn, lm-head: attention "
                      "calls and LM heads on gemmfuse / found (the record says why each ran "
                      "where it did)")
    for c in ("model", "batch", "dtype", "phase"):
        t.add_column(c)
    for v in header["variants"]:
        t.add_column(v, justify="right")
    errs = {}
    for key, recs in groups(records).items():
        by = {r["variant"]: r for r in recs}
        t.add_row(*key, *(cell(by.get(v), errs, by.get("eager")) for v in header["variants"]))
    return t, errs


def plot(records, path, title=""):
    """Grouped bars of speedup vs eager per model and batch, one panel per dtype and phase,
    log scale; hatched: the variant's error is well beyond eager's; x at 1: it failed."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from .plot import _plt
    plt = _plt()
    panels = list(dict.fromkeys((r["dtype"], r["phase"]) for r in records))
    cols = list(dict.fromkeys((r["model"], r["batch"]) for r in records))
    variants = [v for v in dict.fromkeys(r["variant"] for r in records) if v != "eager"]
    by = {(r["model"], r["batch"], r["dtype"], r["phase"], r["variant"]): r for r in records}
    w = 0.8 / max(1, len(variants))
    fig, axes = plt.subplots(max(1, len(panels)), 1, squeeze=False,
                             figsize=(max(8, 2 + len(cols) * max(0.6, 0.35 + 0.15 * len(variants))),
                                      3.0 * max(1, len(panels))))
    colors = plt.get_cmap("tab10").colors
    for ax, (dt, ph) in zip(axes[:, 0], panels):
        ys_all = [1.0]
        for j, v in enumerate(variants):
            color, xs, ys, bad = colors[j % len(colors)], [], [], []
            for i, (m, b) in enumerate(cols):
                r, x = by.get((m, b, dt, ph, v)), i + (j - (len(variants) - 1) / 2) * w
                if r and r.get("speedup"):
                    xs.append(x)
                    ys.append(r["speedup"])
                    bad.append(worse_than_eager(r, by.get((m, b, dt, ph, "eager"))))
                elif r and r.get("error"):
                    ax.plot([x], [1.0], "x", color=color, ms=6, mew=2)
            for bar, hatched in zip(ax.bar(xs, ys, w, color=color), bad):
                if hatched:
                    bar.set_hatch("//")
                    bar.set_edgecolor("k")
            ys_all += ys
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylim(min(0.5, min(ys_all) / 1.3), max(2.0, max(ys_all) * 1.3))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(range(len(cols)), [f"{m}\n{b}" for m, b in cols], fontsize=6.5)
        ax.set_xlim(-0.6, len(cols) - 0.4)
        ax.set_ylabel("speedup vs eager")
        ax.set_title(f"{dt} {ph}", fontsize=9)
        ax.grid(axis="y", which="major", lw=0.3, alpha=0.6)
    if variants:  # one plain patch per variant (a variant may have no bar in a panel)
        from matplotlib.patches import Patch
        axes[0, 0].legend(handles=[Patch(color=colors[j % len(colors)], label=v)
                                   for j, v in enumerate(variants)],
                          fontsize=7, ncol=len(variants), loc="upper left")
    fig.suptitle(f"gemmfuse bench --zoo {title} (hatched: error well beyond eager's; "
                 f"x: the variant failed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(result, out, console, cfg):
    """Print the notes, the table, its numbered errors and the summary; write the PNG and the
    log beside the JSON (and the record with --record). Returns the paths written."""
    from .record import record
    header, records = result["header"], result["records"]
    paths = [str(out), str(plot(records, out.with_suffix(".png"), header.get("gpu") or "CPU"))]
    for note in header.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")
    t, errs = table(records, header)
    console.print(t)
    for msg, n in errs.items():
        where = [f"{_where(r)} {r['variant']}" for r in records if r.get("error") == msg]
        more = f" and {len(where) - 3} more" if len(where) > 3 else ""
        console.print(f"[red]error {n}[/] in {', '.join(where[:3])}{more}: {msg}")
    for line in summary_lines(header["summary"]):
        console.print(line)
    log = out.with_suffix(".log")
    console.save_text(str(log))
    paths.append(str(log))
    if cfg.record:
        paths += record(result, paths)
    console.print("wrote " + ", ".join(paths))
    return paths


def merge(paths, out, console, cfg):
    """One record from zoo runs made in parts (a GPU call has a time limit, the zoo takes
    longer): their records together, the summary over all of them, the table, PNG and log.
    The parts must come from one kind of GPU; the header lists each part's models and commit
    (GEMMFUSE_GIT_COMMIT names the commit where a part's header has none)."""
    parts = [(str(p), json.loads(Path(p).read_text())) for p in paths]
    gpus = {d["header"].get("gpu") for _, d in parts}
    if len(gpus) != 1:
        raise SystemExit(f"--zoo-merge: the parts ran on different devices: {sorted(map(str, gpus))}")
    commit = os.environ.get("GEMMFUSE_GIT_COMMIT")
    header = dict(parts[0][1]["header"], notes=[])
    header["models"] = [m for _, d in parts for m in d["header"]["models"]]
    header["models_info"] = {k: v for _, d in parts for k, v in d["header"]["models_info"].items()}
    header["parts"] = [{"file": Path(p).name, "models": d["header"]["models"],
                        "git": d["header"].get("git") or commit} for p, d in parts]
    header["git"] = header.get("git") or commit
    for _, d in parts:
        header["notes"] += [n for n in d["header"].get("notes", []) if n not in header["notes"]]
    records = [r for _, d in parts for r in d["records"]]
    header["summary"] = summary(records)
    result = {"header": header, "records": records}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    return report(result, out, console, cfg)

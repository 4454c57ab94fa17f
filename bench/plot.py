"""Bench charts (matplotlib, Agg): speedup per model per variant; the M sweep's throughput."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_speedups(records, path, title=""):
    """Grouped bars: speedup vs eager (same dtype), log scale; failed checks hatched."""
    plt = _plt()
    models = list(dict.fromkeys(r["model"] for r in records))
    variants = [v for v in dict.fromkeys(r["mode"] for r in records)
                if not v.startswith(("eager ", "eager-bf16")) and v not in ("eager", "eager-bf16")]
    # (the baselines: 1 by definition)
    by = {(r["model"], r["mode"]): r for r in records}
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models) + 2), 4.5))
    w = 0.8 / max(1, len(variants))
    colors = plt.get_cmap("tab10").colors
    all_y = [1.0]
    for j, v in enumerate(variants):
        xs, ys, hatch = [], [], []
        for i, m in enumerate(models):
            r = by.get((m, v))
            if r and r.get("speedup_vs_eager"):
                xs.append(i + (j - (len(variants) - 1) / 2) * w)
                ys.append(r["speedup_vs_eager"])
                hatch.append(not r.get("pass"))
        if not xs:
            continue
        bars = ax.bar(xs, ys, w, label=v, color=colors[j % len(colors)])
        all_y += ys
        for b, h, y in zip(bars, hatch, ys):
            if h:
                b.set_hatch("//")
            ax.annotate(f"{y:.3g}", (b.get_x() + b.get_width() / 2, y), ha="center",
                        va="bottom", fontsize=6)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylim(min(0.5, min(all_y) / 1.5), max(2.0, max(all_y) * 1.5))
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("speedup vs eager (same dtype)")
    ax.set_title(f"gemmfuse bench {title}\n(hatched: check failed)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_sweep(sweep, path):
    """Achieved TFLOP/s and GB/s against M, one line per variant."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for v in dict.fromkeys(r["mode"] for r in sweep):
        rows = [r for r in sweep if r["mode"] == v and r.get("ms")]
        ms = [r["M"] for r in rows]
        a.plot(ms, [r["tflops"] for r in rows], "o-", label=v)
        b.plot(ms, [r["gbs"] for r in rows], "o-", label=v)
    for ax, y in ((a, "TFLOP/s"), (b, "GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (batch)")
        ax.set_ylabel(y)
        ax.legend(fontsize=7)
    a.axhline(740, ls="--", color="gray", lw=0.8)
    b.axhline(2970, ls="--", color="gray", lw=0.8)
    fig.suptitle("m99 chain sweep (dashed: H100 bf16 740 TFLOP/s, copy 2.97 TB/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)

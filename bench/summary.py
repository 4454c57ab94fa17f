"""A bench record as the README's results table (markdown), from its JSON:

    python -m bench.summary bench/results/h100.json
"""
from __future__ import annotations

import json
import sys

COLUMNS = (("gemmfuse-fp32", "`fp32`"), ("gemmfuse-fast", "`fast`"), ("gemmfuse-tf32", "`tf32`"),
           ("compile", "torch.compile"), ("gemmfuse-bf16", "bf16 model"))


def table(result: dict, name: str = "") -> str:
    h = result["header"]
    by = {(r["model"], r["mode"]): r for r in result["records"]}
    models = list(dict.fromkeys(r["model"] for r in result["records"]))
    cols = [(k, t) for k, t in COLUMNS if any((m, k) in by for m in models)]
    head = (f"{h.get('gpu') or 'CPU'}, M={h['batch']} K={h['in_features']} N={h['out_features']}, "
            f"commit {h.get('git') or '?'}, {h.get('timestamp', '')[:10]}"
            + (f" (`{name}`)" if name else ""))
    lines = [head, "", "| model | " + " | ".join(t for _, t in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for m in models:
        cells = []
        for k, _ in cols:
            r = by.get((m, k))
            s = r and r.get("speedup_vs_eager")
            cells.append("—" if not s else f"{s:.3g}×" + ("" if r.get("pass", True) else " (fails its promise)"))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    for path in (argv or sys.argv[1:]):
        with open(path) as f:
            print(table(json.load(f), path))
        print()


if __name__ == "__main__":
    main()

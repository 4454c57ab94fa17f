"""The table of an A/B run (scripts/device-ab.sh): for each gemmfuse row of each bench, the
median ms of wheel a and of wheel b over the repeats, and b / a.
`python tools/ab_table.py DIR` (DIR: where ab.tgz was unpacked, holding <bench>-<a|b>-<i>.console)."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path


def rows(console: Path) -> dict:
    """(model, variant, measure) -> ms, from the rich table a bench prints."""
    out = {}
    for line in console.read_text(errors="replace").splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.split("│")[1:-1]]
        train = len(cells) > 3 and not cells[2].replace(".", "").isdigit()
        key = (cells[0], cells[1], cells[2] if train else "forward")
        try:
            out[key] = float(cells[3] if train else cells[2])
        except (ValueError, IndexError):  # "—": the variant did not run
            continue
    return out


def table(root: Path) -> list:
    runs = {}
    for console in sorted(root.glob("*-[ab]-*.console")):
        bench, wheel, _ = console.stem.rsplit("-", 2)
        for key, ms in rows(console).items():
            runs.setdefault((bench,) + key, {}).setdefault(wheel, []).append(ms)
    lines = []
    for key in sorted(runs):
        got = runs[key]
        if "eager" in key[2] or set(got) != {"a", "b"}:
            continue
        a, b = statistics.median(got["a"]), statistics.median(got["b"])
        lines.append(f"{key[0]:6s} {key[1]:5s} {key[2]:16s} {key[3]:12s} a {a:8.3f}  b {b:8.3f}  b/a {b / a:.3f}")
    return lines


if __name__ == "__main__":
    print("\n".join(table(Path(sys.argv[1]))))

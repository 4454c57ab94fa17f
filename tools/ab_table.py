"""The table of an A/B of two wheels (scripts/device-ab.sh): for each gemmfuse row of each
bench, the median ms of wheel a and of wheel b over the repeats, and b / a, from the bench's
own JSON records; then each wheel's verdict (the bench's pass column: accuracy, and for
--train the gradients' error over eager's), so that a speed table cannot hide a failing row.
`python tools/ab_table.py DIR` (DIR: the ab-<i>.tgz archives unpacked into one folder,
holding <bench>-<a|b>-<i>/results.tgz as scripts/device-run.sh leaves them)."""
from __future__ import annotations

import json
import statistics
import sys
import tarfile
from pathlib import Path


def records(run: Path) -> list:
    """The bench records of one run folder (its bench-*.json, inside results.tgz)."""
    with tarfile.open(run / "results.tgz") as tar:
        for member in tar.getmembers():
            if member.name.endswith(".json") and Path(member.name).name.startswith("bench-"):
                return json.load(tar.extractfile(member))["records"]
    return []


def table(root: Path) -> list:
    runs = {}
    for run in sorted(p for p in root.glob("*-[ab]-*") if p.is_dir()):
        bench, wheel, _ = run.name.rsplit("-", 2)
        for r in records(run):
            if r.get("ms") is None or not r["mode"].startswith("gemmfuse"):
                continue
            key = (bench, r["model"], r["mode"], r.get("scenario", "forward"))
            runs.setdefault(key, {}).setdefault(wheel, []).append((r["ms"], verdict(r)))
    lines = []
    for key, got in sorted(runs.items()):
        if set(got) != {"a", "b"}:
            continue
        a, b = (statistics.median(ms for ms, _ in got[w]) for w in "ab")
        va, vb = (verdicts([v for _, v in got[w]]) for w in "ab")
        lines.append(f"{key[0]:6s} {key[1]:5s} {key[2]:16s} {key[3]:12s} a {a:8.3f}  b {b:8.3f}  "
                     f"b/a {b / a:.3f}  a {va}  b {vb}")
    return lines


def verdict(r: dict) -> str:
    """ok or FAIL, with the gradients' error over eager's where the bench gives it."""
    word = "ok" if r.get("pass") else "FAIL"
    g = r.get("grad_err_vs_eager")
    return f"{word} {g:.2f}" if g is not None else word


def verdicts(vs: list) -> str:
    """The runs' verdicts: one where they agree, else each."""
    return vs[0] if len(set(vs)) == 1 else "/".join(vs)


if __name__ == "__main__":
    print("\n".join(table(Path(sys.argv[1]))))

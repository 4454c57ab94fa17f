"""Issue 3's targets over the H100 benches kept in bench/results since session 22: per bench,
bf16 m99, `fast` m99 and m18 (`fp32`) speedups over eager from the same run, then the median of
each and how many benches meet its target. The m99 targets depend on the chip's thermal state
(bench/NOTES.md, sessions 19-22); since session 33 a target is read as the median over these
benches, printed with the count that meets it.

    python3 scripts/target_history.py [--first-session 22]
"""
import argparse
import glob
import json
import os
import re
import statistics

TARGETS = {  # (model, bench variant): target speedup
    ("m99", "gemmfuse-bf16"): 1.2,
    ("m99", "gemmfuse-fast"): 4.5,
    ("m18", "gemmfuse-fp32"): 100.0,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--first-session", type=int, default=22)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "..", "bench", "results"))
    args = ap.parse_args()
    rows = []
    for path in sorted(glob.glob(os.path.join(args.results, "*-h100-s*.json"))):
        m = re.search(r"-s(\d+)-", os.path.basename(path))
        if not m or int(m.group(1)) < args.first_session:
            continue
        try:
            records = json.load(open(path)).get("records", [])
        except (ValueError, AttributeError):
            continue  # not a bench record file
        got = {key: r["speedup_vs_eager"] for r in records for key in TARGETS
               if (r.get("model"), r.get("mode")) == key}
        if got:  # a bench of m99 or m18 (each target counts the benches that ran it)
            rows.append((os.path.basename(path), got))
    names = [f"{m} {v.removeprefix('gemmfuse-')}" for m, v in TARGETS]
    print(f"{'bench':44s} " + " ".join(f"{n:>10s}" for n in names))
    for name, got in rows:
        print(f"{name:44s} " + " ".join(f"{got[k]:10.3f}" if k in got else f"{'-':>10s}" for k in TARGETS))
    for (key, target), n in zip(TARGETS.items(), names):
        vals = [got[key] for _, got in rows if key in got]
        if vals:
            print(f"{n}: median {statistics.median(vals):.3f}x, at or above {target}x in "
                  f"{sum(v >= target for v in vals)} of {len(vals)} benches")


if __name__ == "__main__":
    main()

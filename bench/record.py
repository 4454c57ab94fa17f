"""Where bench results go. A run writes its JSON, PNG and log under ``bench/out/`` (ignored by
git); ``--record`` also makes them the device kind's latest record in ``bench/results/``
(``<kind>.json``, ``.png``, ``.log``) and adds the run's headline speedups to
``bench/results/history.csv``; a suite run (``--suite``) is recorded as ``<kind>-suite.*``, a
training run as ``<kind>-train.*``, a zoo run (``--zoo``) as ``<kind>-zoo.*``, a matmul run
(``--matmul``) as ``<kind>-matmul.*``, an LM head run (``--lmhead``) as ``<kind>-lmhead.*``, an
attention run (``--attention``) as ``<kind>-attention.*``."""
from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

OUT_DIR = Path("bench/out")
RESULTS_DIR = Path("bench/results")
HISTORY = "history.csv"
MODELS = ("m18", "m22", "m84", "m94", "m99")
MODES = ("fp32", "fast", "tf32", "bf16")
HISTORY_FIELDS = (["file", "date", "gpu", "commit", "batch", "K", "N"]
                  + [f"{m}_{v}" for m in MODELS for v in MODES])


def device_kind(gpu_name) -> str:
    """'h100', 'h200', 'cpu', or the GPU's name as a slug."""
    if not gpu_name:
        return "cpu"
    name = gpu_name.lower()
    for kind in ("h100", "h200", "a100", "b200", "l40s"):
        if kind in name:
            return kind
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def history_row(result: dict, name: str) -> dict:
    h = result["header"]
    row = {"file": name, "date": h.get("timestamp", "")[:10], "gpu": h.get("gpu") or "cpu",
           "commit": h.get("git") or "", "batch": h.get("batch"), "K": h.get("in_features"),
           "N": h.get("out_features")}
    for r in result["records"]:
        mode = r.get("mode", "")
        if r.get("model") in MODELS and mode.startswith("gemmfuse-") and r.get("speedup_vs_eager"):
            row[f"{r['model']}_{mode[len('gemmfuse-'):]}"] = round(r["speedup_vs_eager"], 3)
    return row


def record(result: dict, paths: list, results_dir: Path = RESULTS_DIR) -> list:
    """Copy a run's files to results_dir as its device kind's latest record; append its
    headline row to the history. Returns the paths written."""
    if not results_dir.is_dir():
        raise SystemExit(f"--record: {results_dir} is not a folder here; run the bench from the "
                         f"gemmfuse checkout")
    h = result["header"]
    suite = any(k in h for k in ("suite", "train", "zoo", "matmul", "lmhead", "attention"))
    kind = device_kind(h.get("gpu")) + next((f"-{k}" for k in ("suite", "zoo", "matmul", "lmhead",
                                                                 "attention", "train")
                                              if k in h), "")
    written = []
    for p in map(Path, paths):
        suffix = p.name[len(p.stem):] if not p.stem.endswith("-sweep") else "-sweep" + p.suffix
        dest = results_dir / f"{kind}{suffix}"
        shutil.copyfile(p, dest)
        written.append(str(dest))
    if suite:  # the history holds the reference models' figures
        return written
    hist = results_dir / HISTORY
    new = not hist.exists()
    with hist.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HISTORY_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(history_row(result, f"{kind}.json"))
    written.append(str(hist))
    return written


def clean_json(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: clean_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean_json(v) for v in o]
    return o

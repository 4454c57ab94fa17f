"""`python -m bench --attention` (bench/attention.py) end to end on the CPU at its CPU shape,
both phases; its errors against float64, verdicts and shape names; on a GPU, gemmfuse's row at
a GPU shape on gemmfuse's kernels within its promise."""
import json

import pytest

from conftest import HAVE_CUDA, needs_lib
from bench.attention import VARIANTS, shapes_for
from bench.cli import main

FIELDS = {"shape", "B", "H", "S", "D", "causal", "phase", "dims", "mode", "ms",
          "speedup_vs_eager", "tflops", "out_err", "rel_err", "err_vs_eager", "eager_errs",
          "peak_mib", "ran_on", "pass", "promise", "reference", "timestamp", "device"}


def _run(tmp_path, device, shape, *args):
    out = tmp_path / "att.json"
    assert main(["--attention", "--device", device, "--attention-shapes", shape, "--repeats", "2",
                 "--rounds", "2", "--warmup", "1", "--out", str(out), *args]) == 0
    return out, json.loads(out.read_text())


@needs_lib
def test_attention_bench_on_the_cpu(tmp_path):
    out, res = _run(tmp_path, "cpu", "s64d32")
    assert out.with_suffix(".png").stat().st_size > 0 and out.with_suffix(".log").exists()
    h, recs = res["header"], res["records"]
    assert h["attention"]["shapes"] == ["s64d32:fwd", "s64d32:train"]
    assert h["grad"] == "autograd records" and "attention bench's small shapes" in h["note"]
    assert [r["mode"] for r in recs] == list(VARIANTS) * 2
    for r in recs:
        assert FIELDS <= set(r), (r["mode"], FIELDS - set(r))
        assert not r.get("error") and r["pass"] and r["ms"] > 0, r
        errs = ["out"] + (["dq", "dk", "dv"] if r["phase"] == "train" else [])
        assert all(0 < r[f"{k}_err"] < 1e-5 for k in errs), r
        assert r["rel_err"] == max(r[f"{k}_err"] for k in errs)
    by = {(r["phase"], r["mode"]): r for r in recs}
    assert by[("train", "gemmfuse-fp32")]["ran_on"] == "PyTorch: attention on cpu"
    assert by[("fwd", "compile")]["ran_on"] == "Inductor"


def test_shape_names_take_both_phases_or_one():
    import torch
    cpu = torch.device("cpu")
    assert [s.name for s in shapes_for(cpu, ["s1024d64"])] == ["s1024d64:fwd", "s1024d64:train"]
    assert [s.name for s in shapes_for(cpu, ["s1024d64-full:train"])] == ["s1024d64-full:train"]
    with pytest.raises(SystemExit, match="unknown attention shape"):
        shapes_for(cpu, ["s3d3"])


@needs_lib
@pytest.mark.skipif(not HAVE_CUDA, reason="gemmfuse's attention kernels are CUDA's")
def test_attention_bench_on_a_gpu(tmp_path):
    _, res = _run(tmp_path, "cuda", "s512d64", "--no-compile")
    rows = [r for r in res["records"] if r["mode"] == "gemmfuse-fp32"]
    assert len(rows) == 2 and all(r["ran_on"] == "gemmfuse" for r in rows), rows
    for r in rows:  # within 1.25 x eager's error, the output's and each gradient's
        assert r["pass"], (r["phase"], r["out_err"], r.get("dq_err"), r["eager_errs"])

"""`python -m bench --matmul` (bench/matmul.py) end to end on the CPU at its CPU shapes, and
its verdicts."""
import json

import pytest
import torch

from conftest import needs_lib
from bench.cli import main
from bench.matmul import CPU_SHAPES, VARIANTS, reference_rows, shapes_for, verdict, Shape

FIELDS = {"shape", "op", "B", "M", "N", "K", "mode", "ms", "speedup_vs_eager", "tflops",
          "rel_err", "err_vs_eager", "eager_rel_err", "ran_on", "pass", "promise", "timestamp",
          "device", "ref_rows"}


@needs_lib
def test_matmul_bench_on_the_cpu(tmp_path):
    """Every CPU shape's four variants: fields, eager's error finite and above 0, the fp32
    switch's products on gemmfuse (one product per checked call) within its promise; JSON,
    PNG and log written."""
    out = tmp_path / "mm.json"
    assert main(["--matmul", "--device", "cpu", "--repeats", "2", "--rounds", "2",
                 "--warmup", "1", "--out", str(out)]) == 0
    assert out.with_suffix(".png").stat().st_size > 0 and out.with_suffix(".log").exists()
    res = json.loads(out.read_text())
    h, recs = res["header"], res["records"]
    assert h["matmul"]["shapes"] == [s.name for s in CPU_SHAPES] and h["note"]
    assert [(r["shape"], r["mode"]) for r in recs] == [(s.name, v) for s in CPU_SHAPES
                                                       for v in VARIANTS]
    for r in recs:
        assert FIELDS <= set(r), (r["mode"], FIELDS - set(r))
        assert not r.get("error"), r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["ref_rows"] is None
        if r["mode"] == "eager":
            assert 0 < r["rel_err"] < 1e-5 and r["speedup_vs_eager"] == 1.0 and r["pass"]
        if r["mode"].startswith("gemmfuse-"):
            assert r["counts"] == {"gemmfuse": 1} and r["ran_on"] == "gemmfuse", r
        if r["mode"] == "gemmfuse-fp32":
            assert r["pass"] and r["err_vs_eager"] <= 1.25, r
    assert recs[0]["op"] == "mm" and recs[-1]["op"] == "bmm" and recs[-1]["B"] == 4


def test_verdicts():
    """fp32: within 1.25 x eager's error + 1e-7; fast: within 1e-4 unless eager's is above
    1e-4; eager rows: any error figure; no figure: a failure."""
    assert verdict("gemmfuse-fp32", 1.2e-6, 1e-6) and verdict("gemmfuse-fp32", 1.3e-6, 1.1e-6)
    assert not verdict("gemmfuse-fp32", 1.5e-6, 1e-6) and not verdict("gemmfuse-fp32", 1e-7, None)
    assert verdict("gemmfuse-fast", 9e-5, 1e-6) and not verdict("gemmfuse-fast", 2e-4, 1e-6)
    assert verdict("gemmfuse-fast", 3e-4, 2e-4)  # eager itself above 1e-4
    assert verdict("eager-tf32", 1e-3, 1e-6) and not verdict("gemmfuse-fp32", None, 1e-6)


def test_shapes_and_the_sliced_reference():
    """The GPU set by name, a subset by name, unknown names refused; the float64 check of
    sq16384 (10 GiB in float64) only on a's first 1024 rows, sq8192's whole."""
    names = [s.name for s in shapes_for(torch.device("cuda"))]
    assert names[:7] == [f"sq{s}" for s in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    assert {"m16", "m128", "k64", "k256", "n64", "bmm8x2048", "bmm96qk", "bmm96pv"} <= set(names)
    assert [s.name for s in shapes_for(torch.device("cpu"), ["sq4096", "bmm4x64"])] == [
        "sq4096", "bmm4x64"]
    with pytest.raises(SystemExit, match="unknown matmul shape"):
        shapes_for(torch.device("cpu"), ["sq3"])
    assert reference_rows(Shape("sq16384", 16384, 16384, 16384)) == 1024
    assert reference_rows(Shape("sq8192", 8192, 8192, 8192)) is None
    qk = Shape("bmm96qk", 1024, 1024, 64, 96)
    assert qk.dims() == ((96, 1024, 64), (96, 64, 1024)) and qk.flops == 2.0 * 96 * 1024 * 1024 * 64


def test_record_names_a_matmul_run(tmp_path):
    """--record: a matmul run is the device kind's <kind>-matmul.* record, not in the history."""
    from bench.record import record
    run = tmp_path / "r.json"
    run.write_text("{}")
    results = tmp_path / "results"
    results.mkdir()
    res = {"header": {"gpu": "NVIDIA H100 80GB HBM3", "matmul": {}}, "records": []}
    assert record(res, [str(run)], results) == [str(results / "h100-matmul.json")]

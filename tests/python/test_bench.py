"""`python -m bench` end to end on the CPU at a tiny shape."""
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

from bench.compare import errors  # noqa: E402
from bench.timing import time_calls  # noqa: E402
from bench.cli import main  # noqa: E402

FIELDS = {"model", "mode", "dtype", "ms", "speedup_vs_eager", "rel_err", "max_abs_err",
          "allclose_1e4", "gpu", "torch", "batch", "in_features", "out_features", "timestamp",
          "eager_rel_err", "pass", "device"}


def _library_ready():
    from gemmfuse import _lib
    return _lib.available()


def _bench(tmp_path, *extra):
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--models", "m84,m94", "--batch", "4",
            "--in-features", "64", "--out-features", "96", "--repeats", "2", "--out", str(out),
            *extra]
    assert main(argv) == 0
    assert out.exists() and out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def test_bench_machinery(tmp_path):
    """Runs whether or not the library is built: a missing gemmfuse is an error record."""
    res = _bench(tmp_path, "--modes", "fp32", "--warmup-ms", "7")
    h = res["header"]
    assert h["device"] == "cpu" and h["note"] and h["batch"] == 4 and h["warmup_ms"] == 7
    assert set(h["models"]) == {"m84", "m94"} and h["models"]["m84"]["fp32"]["flops"] == 2 * 4 * 64 * 96
    modes = [r["mode"] for r in res["records"] if r["model"] == "m84"]
    assert modes == ["eager", "gemmfuse-fp32", "eager-bf16", "gemmfuse-bf16"]
    for r in res["records"]:
        if r["mode"].startswith("eager"):
            assert FIELDS <= set(r), FIELDS - set(r)
            assert r["ms"] > 0 and r["speedup_vs_eager"] == 1.0 and r["rel_err"] < 1e-2
        if r["model"] == "m84" and not r.get("error"):
            assert r["state_ok"], r  # running stats after one call match the float64 model's
    eager = next(r for r in res["records"] if r["mode"] == "eager")
    assert eager["pass"] and eager["rel_err"] < 1e-5


@pytest.mark.skipif(not _library_ready(), reason="gemmfuse operator library not built yet")
def test_bench_gemmfuse(tmp_path):
    res = _bench(tmp_path, "--sweep", "--sweep-m", "1,8")
    recs = res["records"]
    assert {r["mode"] for r in recs} >= {"eager", "gemmfuse-fp32", "gemmfuse-fast",
                                        "gemmfuse-tf32", "eager-bf16", "gemmfuse-bf16"}
    for r in recs:
        assert FIELDS <= set(r), (r["mode"], FIELDS - set(r))
        assert not r.get("error"), r
        assert r["finite"] and r["rel_err"] < (1e-2 if r["dtype"] == "bfloat16" else 1e-3), r
        assert isinstance(r["pass"], bool)  # the promise itself is the library's tests' business
        if r["mode"].startswith("gemmfuse-"):  # what ran: fused calls and routes, per chain
            (route,) = r["routes"]
            assert route["fused_calls"] + sum(route["fallbacks"].values()) > 0, r["routes"]
    assert {s["M"] for s in res["sweep"]} == {1, 8}
    assert all(s.get("tflops", 0) > 0 and not s.get("error") for s in res["sweep"])


def test_errors_and_timing():
    ref = torch.ones(3, 4, dtype=torch.float64)
    e = errors(torch.ones(3, 4), ref)
    assert e["rel_err"] == 0 and e["allclose_1e4"] and e["finite"]
    bad = torch.ones(3, 4)
    bad[0, 0] = float("nan")
    assert not errors(bad, ref)["finite"]
    calls = []
    t = time_calls(lambda x: calls.append(x), [(1,), (2,), (3,)], 2, 4, torch.device("cpu"))
    assert calls == [1, 2, 1, 2, 3, 1] and t["ms"] >= 0


def test_device_info_commit(monkeypatch):
    # A copied tree (the GPU machine's) can carry an older .git: the caller's commit wins.
    from bench.device import device_info
    monkeypatch.setenv("GEMMFUSE_GIT_COMMIT", "abc1234")
    assert device_info(torch.device("cpu"))["git"] == "abc1234"
    monkeypatch.delenv("GEMMFUSE_GIT_COMMIT")
    assert device_info(torch.device("cpu"))["git"] != "abc1234"


def test_negative_warmup_ms_is_refused():
    with pytest.raises(SystemExit, match="warmup-ms"):
        main(["--device", "cpu", "--warmup-ms", "-1"])


def test_variants_alternate_in_rounds(monkeypatch):
    """A model's variants are built (first call checked) first, then timed round by round:
    each round gives every variant its warm-up and timed calls in turn, odd rounds in reverse."""
    import bench.compare as compare
    from bench.runner import Config
    log = []

    def fake_build(variant, model, example):
        def fn(*xs):
            log.append(variant)
            return torch.zeros(2, 3)
        return fn, model, None

    monkeypatch.setattr(compare, "build_variant", fake_build)
    cfg = Config(repeats=2, warmup=1, rounds=3)
    sets = [(torch.rand(2, 3),)]
    ref = torch.zeros(2, 3, dtype=torch.float64)
    from rich.progress import Progress
    progress = Progress(auto_refresh=False, disable=True)
    tasks = {v: progress.add_task(v, total=None) for v in ("eager", "gemmfuse-fp32")}
    recs = compare.measure_all(["eager", "gemmfuse-fp32"], torch.nn.Linear(3, 3), sets, ref, {},
                               cfg, torch.device("cpu"), progress, tasks)
    a, b = ["eager"] * 3, ["gemmfuse-fp32"] * 3  # a round: 1 warm-up + 2 timed calls each
    assert log == ["eager", "gemmfuse-fp32"] + a + b + b + a + a + b  # odd rounds reversed
    assert [r["mode"] for r in recs] == ["eager", "gemmfuse-fp32"]
    for r in recs:
        assert len(r["ms_rounds"]) == 3 and r["ms"] >= 0 and r["rel_err"] == 0


def test_record_keeps_the_latest_per_device_kind(tmp_path):
    """--record: the run's files become <kind>.json/.png/.log in the results folder, and its
    headline speedups a row of history.csv."""
    from bench.record import device_kind, record
    assert device_kind("NVIDIA H100 80GB HBM3") == "h100" and device_kind(None) == "cpu"
    run = tmp_path / "out"
    run.mkdir()
    files = []
    for name in ("20260101-gpu.json", "20260101-gpu.png", "20260101-gpu-sweep.png", "20260101-gpu.log"):
        (run / name).write_text(name)
        files.append(str(run / name))
    res = {"header": {"gpu": "NVIDIA H200", "git": "abc", "timestamp": "2026-01-01T00:00:00",
                      "batch": 8, "in_features": 16, "out_features": 32},
           "records": [{"model": "m99", "mode": "gemmfuse-fast", "speedup_vs_eager": 4.56789},
                       {"model": "m99", "mode": "eager", "speedup_vs_eager": 1.0}]}
    results = tmp_path / "results"
    results.mkdir()
    for _ in range(2):
        record(res, files, results)
    assert sorted(p.name for p in results.iterdir()) == [
        "h200-sweep.png", "h200.json", "h200.log", "h200.png", "history.csv"]
    assert (results / "h200-sweep.png").read_text() == "20260101-gpu-sweep.png"
    rows = (results / "history.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("file,date") and ",4.568," in rows[1]


def test_train_bench_records(tmp_path):
    """--train: a record per model, variant and scenario, with gradient errors and speedups."""
    out = tmp_path / "t.json"
    assert main(["--train", "--device", "cpu", "--models", "m84", "--modes", "fp32",
                 "--batch", "8", "--in-features", "32", "--out-features", "48", "--repeats", "2",
                 "--rounds", "1", "--no-bf16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["header"]["train"]
    recs = res["records"]
    assert {(r["mode"], r["scenario"]) for r in recs} == {
        (m, s) for m in ("eager", "gemmfuse-fp32") for s in ("fwd+bwd", "fwd+bwd(dx)", "step")}
    for r in recs:
        assert not r.get("error"), r
        assert r["ms"] > 0 and r["speedup_vs_eager"] > 0
        assert set(r["grad_rel_err"]) >= {"x", "gemm.weight", "bn.weight"}
        # (gemm.bias's true gradient is 0: a BatchNorm follows; its relative error says nothing)
        assert all(r["grad_rel_err"][n] < 1e-3 for n in ("x", "gemm.weight", "bn.weight")), r["grad_rel_err"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_share_batching_gives_every_variant_the_shortest_calls_batch_size():
    """One batch size for every variant of a comparison: the largest any of them picks
    alone (its shortest call); a variant whose probe fails keeps its own (its round records
    the failure)."""
    from bench.timing import share_batching

    class Probe:
        def __init__(self, per):
            self.want, self.per = per, None

        def probe(self, warmup):
            if self.want is None:
                raise RuntimeError("broken variant")
            return self.want

    timers = [Probe(1), Probe(4), Probe(2), Probe(None), None]
    share_batching(timers, warmup=1)
    assert [t.per for t in timers[:4]] == [4, 4, 4, None]

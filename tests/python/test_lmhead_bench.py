"""`python -m bench --lmhead` (bench/lm_head.py) end to end on the CPU at a CPU shape, its
float64 reference in chunks, its verdicts, shapes and inputs."""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import needs_cuda, needs_lib
from bench import lm_head
from bench.cli import main
from bench.lm_head import (CPU_SHAPES, ERRS, IGNORE, VARIANTS, Shape, reference,
                           reference_chunk_rows, shapes_for)

FIELDS = {"shape", "M", "d", "V", "dims", "mode", "ms", "speedup_vs_eager", "tflops", "loss_err",
          "dx_err", "dW_err", "db_err", "rel_err", "err_vs_eager", "eager_errs", "peak_mib",
          "peak_vs_eager", "ran_on", "pass", "promise", "reference", "ref_chunks", "timestamp",
          "device"}


def _run(tmp_path, *args):
    out = tmp_path / "lm.json"
    assert main(["--lmhead", "--device", "cpu", "--lmhead-shapes", "m256v1000", "--repeats", "2",
                 "--rounds", "2", "--warmup", "1", "--out", str(out), *args]) == 0
    return out, json.loads(out.read_text())


@needs_lib
def test_lmhead_bench_on_the_cpu(tmp_path):
    """m256v1000's five variants (torch.compile too): fields, errors of the loss and the three
    gradients against float64 finite, above 0 and small, gemmfuse's rows on gemmfuse in one
    chunk within their promises, no peak memory off CUDA; JSON, PNG and log written."""
    out, res = _run(tmp_path)
    assert out.with_suffix(".png").stat().st_size > 0 and out.with_suffix(".log").exists()
    h, recs = res["header"], res["records"]
    assert h["lmhead"]["shapes"] == ["m256v1000"] and h["grad"] == "autograd records"
    assert "lmhead bench's small shapes" in h["note"] and "batch" not in h
    assert h["lmhead"]["target_met"] == {"m256v1000": None}  # no peak memory on the CPU
    assert [r["mode"] for r in recs] == list(VARIANTS)
    for r in recs:
        assert FIELDS <= set(r), (r["mode"], FIELDS - set(r))
        assert not r.get("error"), r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["pass"], r
        assert all(0 < r[f"{k}_err"] < 1e-5 for k in ERRS), r
        assert r["rel_err"] == max(r[f"{k}_err"] for k in ERRS)
        assert r["peak_mib"] is None and r["peak_vs_eager"] is None
        assert r["ref_chunks"] == 1 and (r["M"], r["d"], r["V"]) == (256, 64, 1000)
    by = {r["mode"]: r for r in recs}
    assert by["eager"]["speedup_vs_eager"] == 1.0 and by["eager"]["err_vs_eager"] == 1.0
    assert by["compile"]["ran_on"] == "Inductor"
    for v in ("gemmfuse-fp32", "gemmfuse-fast"):
        assert by[v]["ran_on"] == "gemmfuse, 1 chunk", by[v]
        assert "dW = dlogitsᵀ x: gemmfuse" in by[v]["plan"]
    assert "gemmfuse bench --lmhead" in out.with_suffix(".log").read_text()


@needs_lib
def test_a_failing_variant_is_its_record(tmp_path, monkeypatch):
    """A variant whose call raises (here CUDA's out-of-memory error, as eager may at the large
    shapes) is a record with the error, no time and no pass; the others run on (no compile)."""
    real = lm_head._variant_fn

    def fn(name):
        if name != "eager-tf32":
            return real(name)

        def oom(*_):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 12 GiB")
        return oom
    monkeypatch.setattr(lm_head, "_variant_fn", fn)
    _, res = _run(tmp_path, "--no-compile")
    by = {r["mode"]: r for r in res["records"]}
    assert list(by) == ["eager", "eager-tf32", "gemmfuse-fp32", "gemmfuse-fast"]
    bad = by["eager-tf32"]
    assert bad["error"].startswith("OutOfMemoryError: CUDA out of memory") and bad["ms"] is None
    assert not bad["pass"] and bad["speedup_vs_eager"] is None
    assert all(by[v]["ms"] > 0 and by[v]["pass"] for v in ("eager", "gemmfuse-fp32", "gemmfuse-fast"))


def _rows(**errs):
    """A shape's eager and gemmfuse-fp32 rows with the given errors (eager's all 1e-6)."""
    eager = {"mode": "eager", "ms": 2.0, "finite": True, **{f"{k}_err": 1e-6 for k in ERRS}}
    mine = {"mode": "gemmfuse-fp32", "ms": 1.0, "finite": True,
            **{f"{k}_err": errs.get(k, 1e-6) for k in ERRS}}
    return lm_head._finish([eager, mine], CPU_SHAPES[0], 256, {})[1]


def test_each_error_is_judged():
    """gemmfuse-fp32 passes only if each of the loss, dx, dW and db errors is within 1.25 x
    eager's + 1e-7; err_vs_eager is the worst ratio; without eager's figures it fails."""
    ok = _rows(dW=1.3e-6)
    assert ok["pass"] and ok["err_vs_eager"] == pytest.approx(1.3) and ok["speedup_vs_eager"] == 2
    for k in ERRS:
        assert not _rows(**{k: 1.5e-6})["pass"], k
    eager = {"mode": "eager", "error": "OutOfMemoryError: ...", "ms": None}
    mine = {"mode": "gemmfuse-fp32", "ms": 1.0, "finite": True, **{f"{k}_err": 1e-7 for k in ERRS}}
    r = lm_head._finish([eager, mine], CPU_SHAPES[0], 256, {})[1]
    assert not r["pass"] and r["speedup_vs_eager"] is None and r["err_vs_eager"] is None
    fast = {**r, "speedup_vs_eager": 3.5, "peak_vs_eager": 0.2, "pass": True}
    assert lm_head.met(fast) and lm_head.met(r) is None  # the target; no figures
    assert not lm_head.met({**fast, "peak_vs_eager": 0.6})
    assert not lm_head.met({**fast, "speedup_vs_eager": 2.9})
    assert not lm_head.met({**fast, "pass": False})


def test_the_chunked_float64_reference():
    """The float64 reference in chunks (here of 7 rows, 5 of them ignored) equals the whole
    call's autograd in float64 (reduction "mean"); ignored rows' dx is 0; chunk sizes: one
    chunk at the CPU shapes, several where V's float64 rows would pass REF_CHUNK_BYTES."""
    m, d, v = 40, 16, 30
    x, w, b = torch.randn(m, d), torch.randn(v, d), torch.randn(v)
    t = torch.randint(0, v, (m,))
    t[[1, 8, 9, 20, 39]] = IGNORE
    x64, w64, b64 = (a.double().requires_grad_() for a in (x, w, b))
    loss = F.cross_entropy(F.linear(x64, w64, b64), t, ignore_index=IGNORE)
    want = dict(zip(ERRS, (loss.detach(), *torch.autograd.grad(loss, (x64, w64, b64)))))
    for rows in (7, m):
        got = reference(x, w, b, t, rows)
        for k in ERRS:
            assert got[k].dtype == torch.float64
            torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=k)
    assert float(got["dx"][[1, 8, 9, 20, 39]].abs().max()) == 0 and float(got["dx"].abs().max()) > 0
    gpt2 = shapes_for(torch.device("cuda"), ["gpt2"])[0]
    assert reference_chunk_rows(gpt2) == lm_head.REF_CHUNK_BYTES // (32 * 50257) == 1335
    assert [reference_chunk_rows(s) for s in CPU_SHAPES] == [s.m for s in CPU_SHAPES]


def test_shapes_and_inputs():
    """The GPU set (the issue's gpt2 first), a subset by name from either set, unknown names
    refused; inputs seeded by the shape's name, W and b shared by the sets, x and target
    rotated, about 5% of targets ignored, none zero."""
    gpu = shapes_for(torch.device("cuda"))
    assert [(s.name, s.m, s.d, s.v) for s in gpu] == [
        ("gpt2", 8192, 768, 50257), ("gpt2x2", 16384, 768, 50257), ("llama", 4096, 4096, 32000),
        ("llama3", 4096, 4096, 128256)]
    assert gpu[0].flops == 6.0 * 8192 * 768 * 50257 and gpu[0].label() == "8192×768×50257"
    assert [s.name for s in shapes_for(torch.device("cpu"), ["llama3", "m512v5000"])] == [
        "llama3", "m512v5000"]
    with pytest.raises(SystemExit, match="unknown lmhead shape"):
        shapes_for(torch.device("cpu"), ["sq256"])  # a matmul shape
    assert shapes_for(torch.device("cpu")) == CPU_SHAPES
    cfg = type("Cfg", (), {"seed": 0, "input_sets": 3})()
    shape = Shape("t", 4000, 8, 50)
    sets, again = lm_head._inputs(shape, cfg, torch.device("cpu")), lm_head._inputs(
        shape, cfg, torch.device("cpu"))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[3], b[3]) for a, b in zip(sets, again))
    assert all(s[1] is sets[0][1] and s[2] is sets[0][2] for s in sets)
    assert not torch.equal(sets[0][0], sets[1][0]) and not torch.equal(sets[0][3], sets[1][3])
    for x, w, b, t in sets:
        assert x.requires_grad and w.requires_grad and b.requires_grad
        assert 0.03 < float((t == IGNORE).double().mean()) < 0.07 and int(t.max()) < 50
        x, w, b = x.detach(), w.detach(), b.detach()
        assert 0.8 < float(x.std()) < 1.2 and 0.3 < float(w.std()) < 0.4 and float(b.abs().max()) > 0


def test_lmhead_and_matmul_are_separate_runs():
    with pytest.raises(SystemExit, match="separate runs"):
        main(["--lmhead", "--matmul", "--device", "cpu"])


def test_record_names_an_lmhead_run(tmp_path):
    """--record: an LM head run's files are the device kind's <kind>-lmhead.* record; the
    history (the seed models' speedups) is left alone."""
    from bench.record import record
    files = [tmp_path / "run.json", tmp_path / "run.png"]
    for f in files:
        f.write_text("{}")
    results = tmp_path / "results"
    results.mkdir()
    res = {"header": {"gpu": "NVIDIA H200", "lmhead": {}}, "records": []}
    assert record(res, [str(f) for f in files], results) == [
        str(results / "h200-lmhead.json"), str(results / "h200-lmhead.png")]
    assert not (results / "history.csv").exists()


@needs_cuda
@needs_lib
def test_lmhead_bench_on_a_gpu(tmp_path, monkeypatch):
    """On CUDA, a CPU shape: every variant's peak memory above 0 and over eager's; every
    variant within its promise. Routed as users get it (no GEMMFUSE_ALWAYS_FUSE)."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")
    out = tmp_path / "lm.json"
    assert main(["--lmhead", "--device", "cuda", "--lmhead-shapes", "m512v5000", "--repeats", "2",
                 "--rounds", "2", "--warmup", "1", "--warmup-ms", "0", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())["records"]
    for r in recs:
        assert not r.get("error") and r["peak_mib"] > 0 and r["peak_vs_eager"] > 0, r
        errs = {k: (r.get(f"{k}_err"), r["eager_errs"].get(k)) for k in r["eager_errs"]}
        assert r["pass"], (r["shape"], r["mode"], r.get("where"), errs)  # (mine, eager's)
    assert recs[0]["peak_vs_eager"] == 1.0

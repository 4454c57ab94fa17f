"""The model zoo (bench/zoo.py) and `python -m bench --zoo` (bench/zoo_runner.py) on the CPU at
the tiny batch kind; the real shapes are checked on the meta device (no memory, no compute)."""
import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import needs_lib
from bench import zoo_runner
from bench.zoo import KINDS, ZOO, count
from bench.cli import main

NAMES = list(ZOO)


def test_zoo_registry():
    assert len(ZOO) >= 12
    for z in ZOO.values():
        assert set(z.batches) == set(KINDS) and z.note, z.name


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_runs_forward_and_backward(name):
    model, make_inputs, loss_fn = ZOO[name].build("tiny")
    a, b = make_inputs(0), make_inputs(1)
    # random data, not zeros or one value (a language model's inputs are token ids alone)
    assert a and all(bool((t != t.flatten()[0]).any()) for t in a if t.numel() > 1)
    assert all(torch.equal(x, y) for x, y in zip(a, make_inputs(0)))  # a seed is reproducible
    assert not all(torch.equal(x, y) for x, y in zip(a, b))
    ref = copy.deepcopy(model).double()
    zoo_runner.reset(ref)  # (a stateful model's state in float64 too)
    tiny = count(ZOO[name], "tiny")  # small enough for a CPU test (a size, not a timing)
    assert tiny["params"] < 1e5 and tiny["flops_forward"] < 1e7
    with torch.no_grad():
        out = model(*a)
        want = ref(*zoo_runner.cast(a, torch.float64))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert float((out.double() - want).norm() / want.norm()) < 1e-5  # fp32 rounding only
    loss = loss_fn(model(*a), a)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing  # every parameter takes part in the loss


def test_tiny_bf16_build():
    model, make_inputs, loss_fn = ZOO["dlrm"].build("tiny", dtype=torch.bfloat16)
    dense, sparse = make_inputs(0)
    assert dense.dtype == torch.bfloat16 and sparse.dtype == torch.int64
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert loss_fn(model(dense, sparse), (dense, sparse)).dtype == torch.float32  # upcast loss


@pytest.mark.parametrize("name", NAMES)
def test_real_shapes_fit_the_budget(name):
    """small is the real widths at a launch-bound batch; large fills an H100 but stays under
    the entry's budget per eager fp32 training step (3x the forward's FLOPs at 50 TFLOP/s;
    ~50 ms, more for a whole model)."""
    small, large = count(ZOO[name], "small"), count(ZOO[name], "large")
    assert small["params"] == large["params"] > 1e4
    assert 0 < small["flops_forward"] < large["flops_forward"]
    assert large["flops_forward"] >= 4e9
    assert large["est_ms_fp32_train_h100"] < ZOO[name].budget_ms, large


def test_real_shapes_known_figures():
    vit = count(ZOO["vit-s16"], "small")
    assert 21.5e6 < vit["params"] < 22.5e6 and 8.5e9 < vit["flops_forward"] < 9.5e9  # ViT-S/16
    assert count(ZOO["deep-mlp"], "large")["flops_forward"] == 16 * 2 * 1024 ** 3
    assert count(ZOO["pinn"], "large")["flops_forward"] == 2 * 16384 * (3 * 256 + 7 * 256 ** 2 + 256)
    assert count(ZOO["swiglu"], "large")["params"] == 3 * 4096 * 11008


def test_rnn_cell_keeps_its_state():
    model, make_inputs, _ = ZOO["rnn-cell"].build("tiny")
    (x,) = make_inputs(0)
    with torch.no_grad():
        first, second = model(x).clone(), model(x).clone()
        assert not torch.allclose(first, second)  # the second call read the first's state
        assert torch.equal(model.hidden, second)
        model.reset()
        assert torch.equal(model(x), first)


def test_grad_errors():
    lin = torch.nn.Linear(3, 2)
    ref = {"weight": torch.ones(2, 3, dtype=torch.float64), "bias": torch.ones(2, dtype=torch.float64)}
    lin.weight.grad = torch.ones(2, 3) * 1.01
    e = zoo_runner.grad_errors(lin, ref)  # a missing gradient counts as zero: error 1
    assert e["grad_rel_err"] == 1.0 and e["grad_worst"] == "bias" and e["grad_missing"] == ["bias"]
    lin.bias.grad = torch.ones(2)
    e = zoo_runner.grad_errors(lin, ref)
    assert e["grad_worst"] == "weight" and abs(e["grad_rel_err"] - 0.01) < 1e-6
    assert abs(e["grad_rel_err_all"] - 0.01 * (6 / 8) ** 0.5) < 1e-6 and e["grad_finite"]
    # a true gradient of zero has no relative error: listed, counted only overall
    ref["bias"] = torch.full((2,), 1e-17, dtype=torch.float64)
    lin.bias.grad = torch.full((2,), 1e-9)
    e = zoo_runner.grad_errors(lin, ref)
    assert e["grad_zero"] == ["bias"] and e["grad_worst"] == "weight" and e["grad_rel_err_all"] < 0.011
    lin.weight.grad[0, 0] = float("nan")
    assert not zoo_runner.grad_errors(lin, ref)["grad_finite"]


def _row(variant, ms, err, phase="forward", dtype="fp32", model="m"):
    key = "rel_err" if phase == "forward" else "grad_rel_err"
    return {"model": model, "batch": "small", "dtype": dtype, "phase": phase,
            "variant": variant, "ms": ms, key: err}


def test_speedups_and_summary():
    from bench import zoo_report
    rows = zoo_runner.speedups([_row("eager", 2.0, 1e-7), _row("compile", 1.0, 1e-7),
                                _row("optimize", 2.5, 1e-7), _row("backend", 1.25, 0.3)])
    by = {r["variant"]: r for r in rows}
    assert by["eager"]["speedup"] == 1.0 and by["compile"]["speedup"] == 2.0
    assert by["optimize"]["speedup"] == 0.8 and by["optimize"]["vs_compile"] == 0.4
    assert by["backend"]["vs_compile"] == 0.8 and "vs_compile" not in by["compile"]
    train = zoo_runner.speedups([_row("eager", 1.0, 0.01, "train", "bf16"),
                                 _row("optimize", None, None, "train", "bf16")])
    train[1]["error"] = "RuntimeError: x"
    s = zoo_report.summary(rows + train)
    assert s["median_speedup"]["fp32 forward"] == {"compile": 2.0, "optimize": 0.8, "backend": 1.6}
    assert s["median_speedup"]["bf16 train"] == {"optimize": None}
    assert s["optimize_slower_than_eager"] == ["m small fp32 forward: 0.80x"]
    assert s["backend_slower_than_compile"] == ["m small fp32 forward: 0.80x"]
    assert s["errors"] == {"optimize": 1}
    # a wrong result (0.3 against eager's 1e-7) is listed; rounding differences are not
    assert s["error_worse_than_eager"] == ["m small fp32 forward backend: 3.0e-01 (eager 1.0e-07)"]
    assert not zoo_report.worse_than_eager(_row("x", 1, 4e-7), _row("eager", 1, 1e-7))
    assert zoo_report.worse_than_eager(_row("x", 1, 0.05, dtype="bf16"),
                                       _row("eager", 1, 5e-3, dtype="bf16"))


def _zoo(tmp_path, *args):
    out = tmp_path / "zoo.json"
    assert main(["--zoo", "--device", "cpu", "--zoo-batches", "tiny", "--repeats", "2",
                 "--rounds", "1", "--out", str(out), *args]) == 0
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    log = out.with_suffix(".log").read_text()
    assert "gemmfuse bench --zoo" in log and "median speedup vs eager" in log
    return res


def test_failing_variant_is_recorded(tmp_path, monkeypatch):
    """A variant that raises is a record with its error; the others are measured."""
    real = zoo_runner.wrap

    def wrap(variant, m, example):
        if variant == "optimize":
            raise RuntimeError("boom\nsecond line")
        return real(variant, m, example)
    monkeypatch.setattr(zoo_runner, "wrap", wrap)
    res = _zoo(tmp_path, "--zoo-models", "pinn", "--zoo-variants", "optimize",
               "--zoo-dtypes", "fp32")
    recs = {(r["phase"], r["variant"]): r for r in res["records"]}
    assert set(recs) == {(p, v) for p in ("forward", "train") for v in ("eager", "optimize")}
    for p in ("forward", "train"):
        assert recs[(p, "optimize")]["error"] == "RuntimeError: boom"
        assert recs[(p, "eager")]["ms"] > 0 and recs[(p, "eager")]["speedup"] == 1.0
    assert res["header"]["summary"]["errors"] == {"optimize": 2}


@needs_lib
def test_zoo_bench_eager_and_optimize(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "1")  # the CPU executor runs every chain
    res = _zoo(tmp_path, "--zoo-models", "deep-mlp,swiglu,dlrm", "--zoo-variants", "eager,optimize",
               "--zoo-phases", "forward,train")
    h, recs = res["header"], res["records"]
    assert h["zoo"] and h["variants"] == ["eager", "optimize"] and h["batches"] == ["tiny"]
    assert h["models_info"]["swiglu"]["kinds"]["tiny"]["flops_forward"] == 2 * 4 * 3 * 32 * 64
    assert len(recs) == 3 * 2 * 2 * 2
    eager = {(r["model"], r["dtype"], r["phase"]): r for r in recs if r["variant"] == "eager"}
    for r in recs:
        assert not r.get("error"), r
        assert r["ms"] > 0 and r["speedup"] > 0 and r["peak_mb"] is None and r["finite"]
        bf16 = r["dtype"] == "bf16"
        e = eager[(r["model"], r["dtype"], r["phase"])]
        err = "rel_err" if r["phase"] == "forward" else "grad_rel_err"
        # fp32 within float32's rounding of float64; bf16 (weights and inputs rounded too)
        # within bf16's, and optimize no worse than eager bf16 by much
        # (a bf16 gradient whose true value is small cancels: tens of percent happen)
        bound = (0.1 if r["phase"] == "forward" else 0.5) if bf16 else 1e-5
        assert r[err] < bound, (err, r[err], r["model"], r["variant"], r.get("grad_worst"))
        assert r[err] <= 1.5 * e[err] + (1e-3 if bf16 else 1e-7), (err, r[err], e[err], r["model"])
        if r["phase"] == "forward":
            assert len(r["rel_err_calls"]) == 2
        else:
            assert r["grad_finite"] and r["loss_rel_err"] < (1e-2 if bf16 else 1e-6), r
        if r["variant"] == "eager":
            assert r["speedup"] == 1.0 and "chains_fused" not in r
        else:
            assert r["chains_fused"] >= 1 and r["chains_total"] >= r["chains_fused"], r
            assert r["fused_calls"] > 0, r  # GEMMFUSE_ALWAYS_FUSE: the fused path ran
            assert "vs_compile" in r and r["vs_compile"] is None  # compile not run
    s = h["summary"]
    assert set(s["median_speedup"]) == {"fp32 forward", "bf16 forward", "fp32 train", "bf16 train"}
    assert all(v["optimize"] > 0 for v in s["median_speedup"].values())


@needs_lib
def test_zoo_bench_stateful_cell(tmp_path, monkeypatch):
    """The RNN cell's second call reads the state its first call left: every variant starts
    from the same reset state, and optimize must follow the state like eager (an optimize()
    that traces `self.hidden` as a constant gets the second call wrong)."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "1")
    res = _zoo(tmp_path, "--zoo-models", "rnn-cell", "--zoo-variants", "eager,optimize",
               "--zoo-phases", "forward", "--zoo-dtypes", "fp32")
    recs = {r["variant"]: r for r in res["records"]}
    assert max(recs["eager"]["rel_err_calls"]) < 1e-5  # the reference saw the same sequence
    assert not recs["optimize"].get("error"), recs["optimize"]
    assert max(recs["optimize"]["rel_err_calls"]) < 1e-5, recs["optimize"]["rel_err_calls"]
    assert res["header"]["summary"]["error_worse_than_eager"] == []


@needs_lib
def test_zoo_bench_compile_variants(tmp_path, monkeypatch):
    """torch.compile and the gemmfuse backend on one small model (compiling takes a while)."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "1")
    res = _zoo(tmp_path, "--zoo-models", "deep-mlp", "--zoo-variants", "eager,compile,backend",
               "--zoo-dtypes", "fp32")
    recs = {(r["phase"], r["variant"]): r for r in res["records"]}
    for phase in ("forward", "train"):
        c, b = recs[(phase, "compile")], recs[(phase, "backend")]
        assert not c.get("error") and not b.get("error"), (c, b)
        err = "rel_err" if phase == "forward" else "grad_rel_err"
        assert c[err] < 1e-5 and b[err] < 1e-5, (c[err], b[err])
        assert b["vs_compile"] == pytest.approx(c["ms"] / b["ms"])
        assert b["chains_fused"] >= 1, b  # (the backend's chains may have no per-call counts)


def test_record_names_a_zoo_run(tmp_path):
    """--record: a zoo run is its device kind's `-zoo` record, and stays out of the history."""
    from bench.record import record
    run = tmp_path / "z.json"
    run.write_text("{}")
    (tmp_path / "results").mkdir()
    res = {"header": {"gpu": "NVIDIA H100 80GB HBM3", "zoo": True}, "records": []}
    assert record(res, [str(run)], tmp_path / "results") == [str(tmp_path / "results" / "h100-zoo.json")]


def test_zoo_merge_joins_parts(tmp_path, monkeypatch):
    """Zoo runs made in parts (one GPU call each) merge into one record: every part's rows, the
    summary over all of them, the parts and their commit in the header; parts from different
    devices are refused."""
    parts = []
    for i, model in enumerate(("pinn", "swiglu")):
        (tmp_path / str(i)).mkdir()
        _zoo(tmp_path / str(i), "--zoo-models", model, "--zoo-variants", "eager,optimize",
             "--zoo-dtypes", "fp32", "--zoo-phases", "forward")
        parts.append(str(tmp_path / str(i) / "zoo.json"))
    first = json.loads(Path(parts[0]).read_text())
    first["header"]["git"] = None  # a part run from a tree without .git
    Path(parts[0]).write_text(json.dumps(first))
    monkeypatch.setenv("GEMMFUSE_GIT_COMMIT", "abc1234")
    out = tmp_path / "merged" / "all.json"
    assert main(["--zoo-merge", *parts, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["model"] for r in res["records"]] == ["pinn"] * 2 + ["swiglu"] * 2
    h = res["header"]
    assert h["models"] == ["pinn", "swiglu"] and set(h["models_info"]) == {"pinn", "swiglu"}
    own = json.loads(Path(parts[1]).read_text())["header"]["git"]
    assert [p["git"] for p in h["parts"]] == ["abc1234", own]
    assert list(h["summary"]["median_speedup"]) == ["fp32 forward"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    other = json.loads(Path(parts[1]).read_text())
    other["header"]["gpu"] = "another GPU"
    Path(parts[1]).write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different devices"):
        main(["--zoo-merge", *parts, "--out", str(out)])


def test_zoo_records_where_attention_and_the_lm_head_ran(monkeypatch):
    """The zoo's record counts the attention calls and LM heads explain lists, taken or not,
    with each one's line; the table's cell shows the counts."""
    monkeypatch.setenv("GEMMFUSE_ALWAYS_FUSE", "0")  # the CPU's own choice: PyTorch runs both
    model, make_inputs, _ = ZOO["gpt2-small"].build("tiny")
    import gemmfuse
    from bench import zoo_report
    rec = zoo_runner.chains(gemmfuse.optimize(model, make_inputs(0)))
    assert rec["attention_total"] == 2 and rec["lm_heads_total"] == 1  # two blocks, one head
    assert rec["attention_fused"] == 0 and rec["lm_heads_fused"] == 0  # on the CPU: PyTorch's
    assert sum(rec["attention_lines"].values()) == 2
    assert all("left to PyTorch" in line and "causal" in line for line in rec["attention_lines"])
    assert "left to PyTorch" in next(iter(rec["lm_heads_lines"]))
    rec.update(variant="optimize", phase="forward", speedup=1.0, rel_err=1e-7)
    text = zoo_report.cell(rec, {})
    assert "attn 0/2" in text and "lm-head 0/1" in text
    fused = "attention: sdpa [1x2x8x16] causal (F) on gemmfuse's fp32 attention kernels (x)"
    assert zoo_runner.sites("gemmfuse: 0 of 0 chain(s) fused\n\n" + fused + "\n")["attention_fused"] == 1

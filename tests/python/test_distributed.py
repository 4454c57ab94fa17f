"""FSDP2 and tensor parallelism through gemmfuse on the CPU: two processes with gloo, launched
by torchrun. The four cases of the 2-GPU runner (bench.distributed) at small
shapes: fully_shard then optimize(), optimize() then fully_shard, fully_shard under
torch.compile(backend="gemmfuse"), and a ColwiseParallel -> RowwiseParallel MLP; then the
edge cases of dist_cases.py in one launch. Each trains a copy with gemmfuse and one without
under the same wrapper: losses and parameters within 1e-5 (relative) of each other, fused
calls where chains can fuse, and reasons where they cannot. Chains are forced fused
(GEMMFUSE_ALWAYS_FUSE=1: at these shapes the CPU router would send them to PyTorch)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import needs_lib, with_bench_path

pytestmark = [needs_lib, pytest.mark.skipif(not torch.distributed.is_available(),
                                            reason="torch.distributed is not available")]
ENV = {"GEMMFUSE_ALWAYS_FUSE": "1", "NCCL_NVLS_ENABLE": "0"}


def _torchrun(tmp_path, target, *args, port_offset=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(29000 + (os.getpid() + port_offset) % 1000), *target, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=with_bench_path({**os.environ, **ENV}), cwd=tmp_path)
    return p


def _case(tmp_path, case, steps=4):
    out = tmp_path / f"{case}.json"
    p = _torchrun(tmp_path, ["-m", "bench.distributed"], "--case", case, "--device", "cpu",
                  "--steps", str(steps), "--timed", "1", "--rounds", "1", "--out", str(out),
                  port_offset=sum(map(ord, case)))
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["fsdp2-after", "fsdp2-before", "tp"])
def test_optimize_under_wrapper(tmp_path, case):
    r = _case(tmp_path, case)
    c = r["check"]
    assert r["header"]["backend"] == "gloo"
    assert c["rel_to_eager"] <= 1e-5 and c["pass"], {k: v for k, v in c.items() if k != "explain"}
    assert c["fused_calls"] > 0 and c["train_calls"] >= 4 and not c["fallbacks"], c["fallbacks"]
    if case == "tp":  # fc1 column-parallel, fc2 row-parallel: each fused on its shard
        assert "is row-parallel: its product is all-reduced" in c["explain"]
        assert c["explain"].count("): FUSED") >= 9, c["explain"]  # 4 blocks x 2 and the head
    else:  # every block a unit, each optimized inside FSDP's hooks
        assert c["explain"].count("FSDP unit 'blocks.") == 4
    if case == "fsdp2-before":  # fully_shard changed the classes: traced again at the first call
        assert "traced again 1 time(s)" in c["explain"]


def test_compile_backend_under_fsdp2(tmp_path):
    r = _case(tmp_path, "fsdp2-compile", steps=3)
    c = r["check"]
    assert c["rel_to_eager"] <= 1e-5 and c["pass"], {k: v for k, v in c.items() if k != "explain"}
    assert c["fused_calls"] > 0 and "FUSED" in c["explain"]


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    out = tmp / "cases.json"
    p = _torchrun(tmp, [str(Path(__file__).with_name("dist_cases.py")), str(out)], port_offset=500)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def _ok(facts):
    assert "error" not in facts, facts.get("error")
    assert facts["rel"] <= 1e-5, facts["rel"]


def test_fsdp2_blocks_only(edge):
    f = edge["blocks_only"]
    _ok(f)
    assert f["fused_calls"] > 0 and f["explain"].count("FSDP unit 'blocks.") == 2


def test_fsdp2_unit_with_other_hooks_runs_in_pytorch(edge):
    f = edge["hooked_unit"]
    _ok(f)
    assert f["hook_calls"] >= 3  # the user's hook ran on every training call
    assert "FSDP unit 'blocks.1': runs in PyTorch: hooks other than FSDP's" in f["explain"]
    assert f["fused_calls"] > 0  # blocks.0 and the head still fused


@pytest.mark.parametrize("case", ["colsum_after", "colsum_compile"])
def test_fsdp2_prepared_weights_follow_steps(edge, case):
    """Column sums prepared from W follow FSDP's unsharded W after each step (FSDP keeps its
    version counter across all-gathers)."""
    f = edge[case]
    _ok(f)
    assert f["fused_calls"] > 0
    assert f.get("bumped", True)


def test_fsdp2_root_fx_cannot_trace(edge):
    f = edge["fx_untraceable"]
    _ok(f)
    assert f["fused_calls"] > 0 and "captured through torch.compile" in f["explain"]


def test_tp_parallelized_after_optimize(edge):
    f = edge["tp_before"]
    _ok(f)
    # both Linears were planned for whole weights: each sees its local shard's shape differ
    assert f["reasons"] and all("parallelized after optimize()" in r for r in f["reasons"]), f["reasons"]


def test_tp_under_compile_not_captured(edge):
    f = edge["tp_compile"]
    _ok(f)
    assert "a DTensor input (tensor parallel under torch.compile)" in f["explain"]


def test_tp_foreach_optimizer_step(edge):
    """The tp runner's copies step with multi-tensor SGD, CUDA's default: DTensor and plain
    parameters (the head) go in separate groups, and every DTensor's gradient is one."""
    f = edge["tp_foreach"]
    _ok(f)
    assert f["foreach"] and f["fused_calls"] > 0
    assert not f["plain_grads"], f["plain_grads"]

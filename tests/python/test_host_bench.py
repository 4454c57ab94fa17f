"""The host-cost benchmark's harness (bench/host.py) on the CPU."""
import json

import torch

from bench import host
from conftest import needs_lib


def test_measure_against_itself():
    # With optimize() replaced by the identity, the "optimized" model is eager's: both time the
    # same calls, so the harness must report nearly the same time for each.
    # A busy machine (a build on the same cores) can stall one side of a run: three tries.
    for _ in range(3):
        t = host.measure(torch.device("cpu"), width=16, batch=4, optimize=lambda m, ex: m)
        if 0.5 < t.optimized_us / t.eager_us < 2.0:
            break
    assert t.eager_us > 0 and t.plain_op_us > 0
    assert 0.5 < t.optimized_us / t.eager_us < 2.0, t
    assert t.per_chain_us == t.optimized_us / host.CHAINS
    assert t.eager_us > 4 * t.plain_op_us, "16 Linear+ReLU layers cost more than one op"


@needs_lib
def test_main_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert host.main("cpu", str(out)) == 0
    rows = json.loads(out.read_text())["host"]
    assert [(r["device"], r["autograd"]) for r in rows] == [("cpu", False), ("cpu", True)]
    for r in rows:
        assert r["optimized_us"] > 0 and abs(r["per_chain_us"] * 16 - r["optimized_us"]) < 1e-6
    assert "per chain" in capsys.readouterr().out

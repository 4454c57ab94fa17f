"""tools/ab_table.py, the table of an A/B of two wheels: medians, their ratio, and each wheel's
verdict from the bench's records (a failing row shows even where the times agree)."""
import importlib.util
import io
import json
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_table", ROOT / "tools" / "ab_table.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def _run(root: Path, name: str, ms: float, ok: bool, grad: float):
    run = root / name
    run.mkdir()
    recs = [{"model": "m94", "mode": "gemmfuse-fp32", "scenario": "fwd+bwd", "ms": ms,
             "pass": ok, "grad_err_vs_eager": grad},
            {"model": "m94", "mode": "eager", "scenario": "fwd+bwd", "ms": 9.0, "pass": True}]
    data = json.dumps({"records": recs}).encode()
    with tarfile.open(run / "results.tgz", "w:gz") as tar:
        info = tarfile.TarInfo("out/bench-1.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def test_medians_ratio_and_verdicts(tmp_path):
    for i, ms in enumerate([2.0, 2.2, 2.1], 1):
        _run(tmp_path, f"train-a-{i}", ms, True, 0.3)
    for i, (ms, ok) in enumerate([(1.0, False), (1.2, False), (1.1, True)], 1):
        _run(tmp_path, f"train-b-{i}", ms, ok, 2.59 if not ok else 0.3)
    lines = ab.table(tmp_path)
    assert len(lines) == 1, lines  # eager rows are not compared
    line = lines[0]
    assert "a    2.100" in line and "b    1.100" in line and "b/a 0.524" in line, line
    assert line.endswith("a ok 0.30  b FAIL 2.59/FAIL 2.59/ok 0.30"), line

"""tools/function_sizes.py, the function-size report of `make test`: it reads Python, C++ and
CUDA (as C++) and lists what is over the limits."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("lizard")
ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("function_sizes", ROOT / "tools" / "function_sizes.py")
sizes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sizes)


def test_reports_long_and_branchy_functions_in_every_language(tmp_path, monkeypatch):
    branches = "\n".join(f"  if (x == {i}) return {i};" for i in range(25))
    (tmp_path / "k.cu").write_text(f"__global__ void k(int x) {{}}\nint branchy(int x) {{\n{branches}\n  return 0;\n}}\n")
    body = "\n".join(f"    y = y + {i}" for i in range(90))
    (tmp_path / "m.py").write_text(f"def long_one(y):\n{body}\n    return y\n\n\ndef short(y):\n    return y\n")
    monkeypatch.setattr(sizes, "ROOT", tmp_path)
    rows = {r[2]: r for r in sizes.oversized(["."], 80, 20)}
    assert set(rows) == {"branchy", "long_one"}, rows
    assert rows["branchy"][4] == 26 and rows["long_one"][3] == 92

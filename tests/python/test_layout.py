"""The code's layout (issue 46): the product package holds the product (the benchmark lives in
bench/, outside the wheel, and the product never imports it), and neither package has an
import cycle (tools/import_cycles.py, lazy imports inside functions included)."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import import_cycles  # noqa: E402


def test_no_import_cycles():
    for pkg in ("python/gemmfuse", "bench"):
        g = import_cycles.graph(import_cycles.modules(ROOT / pkg))
        assert len(g) > 5, pkg  # the package was read
        assert import_cycles.cycles(g) == [], pkg


def test_the_cycle_finder_finds_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from .a import y\n")
    assert import_cycles.cycles(import_cycles.graph(import_cycles.modules(pkg))) == [["p.a", "p.b"]]


def test_product_package_holds_no_benchmark():
    product = ROOT / "python" / "gemmfuse"
    assert not (product / "bench").exists()
    for f in product.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            assert not any(n == "bench" or n.startswith("bench.") for n in names), f

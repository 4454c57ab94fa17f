"""The Python capture and the C++ op table agree: every spec name the capture can emit is an op
of the table, and every pointwise, reduction and norm op of the table can be reached from some
PyTorch function, method or module."""
import re
import inspect

import torch

from gemmfuse.capture import classify
from conftest import needs_lib

pytestmark = needs_lib


def _table():
    text = torch.ops.gemmfuse.ops()
    return dict(line.split() for line in text.strip().splitlines())


TABLES = ("_UNARY_FUNCS", "_UNARY_METHODS", "_UNARY_MODULES", "_BINARY_FUNCS", "_BINARY_METHODS",
          "_REDUCE_FUNCS", "_REDUCE_METHODS", "_SOFTMAX_FUNCS", "_SOFTMAX_METHODS")


def _names_emitted() -> set:
    """Every spec op name classify.py can write: its lookup tables' values (rsub becomes sub)
    and the op names its builders pass as literals."""
    names = set()
    for t in TABLES:
        names |= set(getattr(classify, t).values())
    names = {"sub" if n == "rsub" else n for n in names}
    src = inspect.getsource(classify)
    for pattern in (r'_unary\("(\w+)"', r'\("(\w+)", \{', r'\("(\w+)", keys\)',
                    r'_pool\(node, ctx, "(\w+)"', r'"(maximum)" if', r'else "(minimum)"',
                    r'_max_min\(node, ctx, "(\w+)"', r'"(max)" if t is torch.max', r'else "(min)"'):
        names |= set(re.findall(pattern, src))
    return names


def test_capture_names_are_table_ops():
    table = _table()
    emitted = _names_emitted()
    assert emitted - set(table) == set(), "capture emits ops the C++ table does not know"
    reachable = {n for n, fam in table.items() if fam != "dropout"} - emitted
    assert reachable == set(), f"table ops no PyTorch form reaches: {sorted(reachable)}"


def test_table_families():
    table = _table()
    assert table["gelu"] == "unary" and table["add"] == "binary" and table["softmax"] == "row_norm"
    assert table["batch_norm"] == "column_norm" and table["logsumexp"] == "reduce"

"""gemmfuse: run ``Linear -> elementwise/normalisation/reduction`` chains as fused kernels.

    import gemmfuse
    fast = gemmfuse.optimize(model, example_inputs, precision="fp32")   # or "fast", "tf32"
    gemmfuse.explain(fast)                                             # prints it, returns the text
    compiled = torch.compile(model, backend="gemmfuse")                # options={"precision": ...}
    gemmfuse.explain(compiled)                                         # after a call
    with gemmfuse.fp32_matmul(): ...                                   # uncaptured fp32 products
    loss = gemmfuse.linear_cross_entropy(h, head.weight, target)      # LM head + loss, no logits

Python is the front only: capture (FX graph -> chain spec text), the optimized module and the
torch.compile backend. Planning and kernels are C++ (``torch.ops.gemmfuse``).
"""
from __future__ import annotations

from . import _lib
from ._lib import LibraryMissing
from .capture import find_chains
from .explain import explain
from .lm_head import linear_cross_entropy
from .matmul_switch import counts as fp32_matmul_counts, fp32_matmul, set_fp32_matmul
from .optimized import fused_calls, optimize, runtimes, weights_changed
from .runtime import PRECISIONS

from . import backend as _backend
from .backend import compiler

_backend.register()

__all__ = ["optimize", "explain", "find_chains", "runtimes", "fused_calls", "weights_changed", "PRECISIONS",
           "LibraryMissing", "compiler", "fp32_matmul", "set_fp32_matmul", "fp32_matmul_counts",
           "linear_cross_entropy", "load_library"]


def load_library() -> str:
    """Load the C++ operator library now (it is otherwise loaded on first use)."""
    return _lib.load()

"""``torch.compile(model, backend="gemmfuse")``: rewrite the chains of dynamo's graph.

Dynamo hands the backend a GraphModule whose modules are inlined (``F.linear``,
``F.batch_norm(..., training, momentum, eps)``, ``F.group_norm``, ...) and whose parameters and
buffers arrive as placeholders. The backend captures the chains of that graph (capture/,
"dynamo" flavour), replaces each by one ``_run_chain`` call and returns the rewritten
``gm.forward``; with nothing captured it returns the graph unchanged. Training flags are
constants in such graphs (dynamo guards on them and recompiles when they change).

Precision: ``torch.compile(m, backend="gemmfuse", options={"precision": "fast"})``; default fp32.
While autograd records, the chains run as the differentiable fused op (autograd.py).
"""
from __future__ import annotations

import weakref

import torch.fx as fx
import torch.nn as nn

from . import _lib
from .capture import compile_time_numbers, find_chains
from .rewrite import rewrite_chain
from .runtime import PRECISIONS
from .reports import ChainEntry, OptimizeReport, remember

BACKEND_NAME = "gemmfuse"


def gemmfuse_backend(gm: fx.GraphModule, example_inputs, options=None, mode=None, **_):
    options = dict(options or {})
    precision = options.pop("precision", "fp32")
    if precision not in PRECISIONS:
        raise ValueError(f"gemmfuse backend: precision must be one of {PRECISIONS}, got {precision!r}")
    report = OptimizeReport(precision=precision, flavor="dynamo")
    report.graph = weakref.ref(gm)
    report.params = [weakref.ref(t) for t in list(example_inputs) + list(gm.parameters())
                     if isinstance(t, nn.Parameter)]
    gm._gemmfuse = report
    remember(report)
    if not _lib.available():
        report.rejected.append(("*", "the gemmfuse operator library is not available"))
        return gm.forward
    cap = find_chains(gm, "dynamo", check=_lib.check,
                      numbers=compile_time_numbers(gm, example_inputs))
    report.rejected = list(cap.rejected)
    remap: dict = {}
    fused = 0
    for chain in cap.chains:
        entry = ChainEntry(index=chain.index, linear=chain.linear.name,
                           nodes=chain.describe_nodes(), stop=chain.stop, form=chain.form, spec=chain.spec(()),
                           status="pytorch")
        report.entries.append(entry)
        attr = f"_gemmfuse_chain_{chain.index}"
        rewrite_chain(gm, chain, precision, remap, attr)
        entry.status, entry.attr = "fused", attr
        fused += 1
    if fused:
        gm.recompile()
    return gm.forward


def register():
    try:
        from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
    except ImportError:  # pragma: no cover - very old torch
        return
    if BACKEND_NAME not in _COMPILER_FNS:
        register_backend(gemmfuse_backend, name=BACKEND_NAME)

"""What optimize() and the torch.compile backend record about each chain, for ``explain``:
one OptimizeReport per optimized module or compiled graph, one ChainEntry per chain."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn


@dataclass
class ChainEntry:
    index: int
    linear: str
    nodes: list                    # the PyTorch nodes of the chain, formatted
    stop: str                      # why the chain ends where it does
    spec: str                      # at optimize time (current training flags)
    status: str                    # "fused" | "pytorch"
    reason: str = ""               # why it stays in PyTorch
    plan: str = ""                 # describe() at optimize time
    attr: Optional[str] = None     # the ChainRuntime attribute on the module
    mode_modules: list = field(default_factory=list)
    example: dict = field(default_factory=dict)   # shapes used for describe
    form: str = "nn.Linear"        # how the model wrote the Linear
    choice: str = ""               # the measured choice (torch.compile backend), with its times


@dataclass
class OptimizeReport:
    precision: str
    flavor: str
    entries: list = field(default_factory=list)
    rejected: list = field(default_factory=list)  # (linear node, reason): not captured at all
    # dynamo flavour: weak references to the rewritten graph and to the parameters it reads
    # (compiled_graphs finds a compiled module's graphs by them).
    graph: Any = None
    params: list = field(default_factory=list)
    # fx flavour: what made the module trace the model again, one entry per time
    retraced: list = field(default_factory=list)
    # fx flavour inside an FSDP2 model: the units (fsdp.UnitCall) the graph calls, each
    # optimized in its own forward
    units: list = field(default_factory=list)
    # the whole graph or module timed with its fused chains against without them (measure.py's
    # Choice.whole_text), "" where it was not timed
    whole: str = ""


# The torch.compile backend's most recent compilations, newest last.
COMPILED: list = []
_KEEP = 32


def remember(report: OptimizeReport) -> None:
    COMPILED.append(report)
    del COMPILED[:-_KEEP]


def compiled_graphs(module) -> list:
    """The graphs the backend rewrote for ``module`` (a torch.compile'd module, or the module
    it wraps), oldest first: among the most recent compilations, those whose graph is alive
    and reads one of the module's parameters."""
    orig = getattr(module, "_orig_mod", module)
    if not isinstance(orig, nn.Module):
        return []
    from .fsdp import unsharded_params  # FSDP2: graphs read the unsharded parameters
    mine = {id(p) for p in list(orig.parameters()) + unsharded_params(orig)}
    out = []
    for rep in COMPILED:
        gm = rep.graph() if rep.graph is not None else None
        if gm is not None and any((p := r()) is not None and id(p) in mine for r in rep.params):
            out.append(gm)
    return out

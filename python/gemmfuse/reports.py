"""What optimize() and the torch.compile backend record about each chain, for ``explain``:
one OptimizeReport per optimized module or compiled graph, one ChainEntry per chain."""
from __future__ import annotations

import re

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
    products: list = field(default_factory=list)  # products.ProductSite: two activations
    lm_heads: list = field(default_factory=list)  # capture/lm_head.py's LMHead, fused or not
    attention: list = field(default_factory=list)  # capture/attention.py's AttentionSite
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
    # backend: (qualified name, shape, dtype) of the module parameters the graph reads, for
    # compiled modules whose graphs dynamo reused from another instance (compiled_graphs)
    param_sig: frozenset = frozenset()
    backend_id: str = ""  # the name dynamo gives the compiled graph in the code it runs

    def fused_lm_heads(self) -> list:
        """The LM heads the graph runs as linear_cross_entropy calls."""
        return [h for h in self.lm_heads if h.status == "fused"]

    def fused_attention(self) -> list:
        """The attention calls the graph runs on gemmfuse's attention kernels."""
        return [a for a in self.attention if a.status == "fused"]


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
    if out or not _compiled_wrapper(module):
        return out
    # Dynamo runs a graph compiled for another instance wherever its guards pass (the same
    # class, parameter shapes and dtypes), with no new compilation: the graphs dynamo holds
    # for the wrapper's frame that read parameters of this module's names, shapes and dtypes.
    sig = {(n, tuple(p.shape), p.dtype) for n, p in orig.named_parameters()}
    live = _dynamo_graph_names(module)
    return [gm for rep in COMPILED if rep.backend_id in live and rep.param_sig <= sig
            and (gm := rep.graph() if rep.graph is not None else None) is not None]


def _compiled_wrapper(module) -> bool:
    """torch.compile's wrapper, or optimize()'s module captured through dynamo."""
    return (isinstance(getattr(module, "_orig_mod", None), nn.Module)
            or "_gemmfuse_compiled" in getattr(module, "__dict__", {}))


def _dynamo_graph_names(module) -> set:
    """The names of the compiled graphs in dynamo's cache for the frames a compiled module
    runs: its class's forward (a user's module), or the frame torch.compile wraps around a
    torch.nn module's call. The cache is dynamo's, per code object (every instance's)."""
    opt = getattr(module, "__dict__", {}).get("_gemmfuse_compiled", module)
    orig = getattr(opt, "_orig_mod", opt)
    fn = getattr(opt, "forward", None)
    codes = [getattr(f, "__code__", None)
             for f in (getattr(type(orig), "forward", None), getattr(fn, "__wrapped__", None))]
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        entries = [e for c in codes if c is not None for e in _debug_get_cache_entry_list(c)]
    except (ImportError, RuntimeError, TypeError):  # a torch without it: nothing found
        return set()
    return {n for e in entries for n in e.code.co_names if n.startswith("__compiled_fn")}


def param_signature(gm, example_inputs) -> frozenset:
    """(qualified name, shape, dtype) of the module parameters among a dynamo graph's inputs,
    the names read from their dynamo sources (L['self']._modules['fc1']._parameters['weight'])."""
    out = set()
    for node, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
        arg = node.meta.get("grapharg")
        if arg is None or not isinstance(v, nn.Parameter):
            continue
        keys = re.findall(r"\._(?:modules|parameters)\['([^']*)'\]", str(arg.source.name))
        if keys:
            out.add((".".join(keys), tuple(v.shape), v.dtype))
    return frozenset(out)

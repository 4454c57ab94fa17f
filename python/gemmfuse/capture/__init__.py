"""Capture: find ``Linear -> stages`` chains in a torch.fx graph and write them as chain specs.

Two graph flavours are read:
  * ``torch.fx.symbolic_trace`` graphs: ``call_module`` leaves (Linear, BatchNorm1d, GroupNorm,
    LayerNorm, Dropout, activations, pools, Softmax, ...), ``call_function`` torch.* / F.* /
    operator.*, ``call_method`` tensor methods, ``get_attr`` parameters;
  * torch.compile (dynamo) graphs: modules inlined into F.* calls, parameters and buffers as
    placeholders, ``torch.max(x, dim)`` results read through ``getitem``.

A chain is a linear node followed by nodes that each consume the current value (and maybe
earlier values of the chain: residuals), whose other inputs are scalars or tensors produced
outside the chain (operands ``t<i>``; BatchNorm running statistics are state ``s<i>``). Every
intermediate value must be used only inside the chain; the last may be used anywhere. Only the
last dim is fusable: reductions, softmax, norms and pools over any other dim end the chain.

Nothing here computes; the spec text goes to the C++ core (docs/chain-spec.md). For every
linear node the capture also records why its chain stopped where it did (``Chain.stop``) and,
for linear nodes it could not start a chain at, why (``CaptureReport.rejected``).
"""
from __future__ import annotations

from .chain import CaptureReport, Chain, Stage, Unsupported
from .find import _attr_tensor, capture_spec_texts, compile_time_numbers, find_chains
from .values import AttrRef, InfoProp, TInfo, node_info, source_key

__all__ = ["AttrRef", "CaptureReport", "Chain", "InfoProp", "Stage", "TInfo", "Unsupported",
           "capture_spec_texts", "compile_time_numbers", "find_chains", "node_info", "source_key", "_attr_tensor"]

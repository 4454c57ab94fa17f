"""``optimize()``'s result for a model torch.fx cannot trace symbolically (Python control flow
on tensor shapes, `B, T, C = x.size()`, ...): the model captured through dynamo instead,
with the gemmfuse torch.compile backend, behind a module that holds the model's own
parameters, buffers and children, has its forward signature and pickles as it.

Dynamo guards on what it read (attributes, training flags, hooks, shapes) and compiles again
when one changes, so nothing here needs to watch the model.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn


class GemmfuseDynamoModule(nn.Module):
    def __init__(self, model: nn.Module, precision: str, examples: list, why_not_fx: str,
                 rebuild):
        """``rebuild(model, precision, examples)``: optimize() again on a copy or an unpickled
        model (optimized._unpickle), which pickling and deepcopy name."""
        super().__init__()
        d = self.__dict__  # the model's own dictionaries: state_dict keys and tensors are its
        d["_parameters"] = model._parameters
        d["_buffers"] = model._buffers
        d["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        d["_modules"] = model._modules
        d["training"] = model.training
        d["_gemmfuse_source"] = model
        d["_gemmfuse_precision"] = precision
        d["_gemmfuse_examples"] = examples
        d["_gemmfuse_why_not_fx"] = why_not_fx
        d["_gemmfuse_rebuild"] = rebuild
        # The rest of the graph runs as PyTorch ops (inductor=False), each chain behind a
        # runtime that checks every call, as optimize() promises.
        compiled = torch.compile(model, backend="gemmfuse",
                                 options={"precision": precision, "inductor": False})
        d["_gemmfuse_compiled"] = compiled

        @functools.wraps(model.forward)
        def forward(*args, **kwargs):
            eager = d.get("_gemmfuse_eager")  # modes the model runs faster in (optimized._time_whole)
            if eager and ("train" if torch.is_grad_enabled() else "forward") in eager:
                return model(*args, **kwargs)
            return compiled(*args, **kwargs)

        d["forward"] = forward  # the model's signature (inspect.signature follows __wrapped__)

    def train(self, mode: bool = True):
        super().train(mode)
        self.__dict__["_gemmfuse_source"].training = mode
        return self

    def __reduce__(self):
        d = self.__dict__
        return (d["_gemmfuse_rebuild"],
                (d["_gemmfuse_source"], d["_gemmfuse_precision"], d["_gemmfuse_examples"]))

    def __deepcopy__(self, memo):
        import copy
        d = self.__dict__
        return d["_gemmfuse_rebuild"](copy.deepcopy(d["_gemmfuse_source"], memo),
                                      d["_gemmfuse_precision"], d["_gemmfuse_examples"])

    def extra_repr(self) -> str:
        return (f"captured through torch.compile (torch.fx: {self._gemmfuse_why_not_fx}); "
                f"precision={self._gemmfuse_precision}")

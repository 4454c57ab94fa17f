"""What tracing read from a model's modules, and whether it has changed since.

torch.fx bakes into the graph every plain value the model's code reads while it is traced
(`x * self.scale` becomes `x * 2.0`, `if self.training:` takes one branch), and the capture
bakes into chain specs the hyper-parameters of the modules it fuses (a BatchNorm's eps and
momentum, a LeakyReLU's slope, GELU's `approximate`, GroupNorm's groups). An optimized module
that kept running such a graph after the value changed would compute something else than the
model. ``AttributeWatch`` records those values at optimize time; the optimized module checks
them on every call (a few dictionary reads) and traces the model again when one differs.

What is recorded, per module of the model:
  * every public attribute holding a plain value (numbers, bools, strings, None, dtypes,
    devices, tuples and lists of these);
  * the module's children, by identity (a replaced submodule changes what a chain computes);
  * its ``training`` flag where its class's own code reads ``training`` (user modules that
    branch on it). Modules of torch.nn are left out of that: the fused modules among them
    (BatchNorm, Dropout) have a spec for each flag, and the others run in PyTorch, where
    they read the flag themselves;
  * its class: ``fully_shard`` (FSDP2) gives a module a class of its own, and its parameters
    then live sharded between calls; the model traced again sees the units (fsdp.py).
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn

_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)
_MISSING = object()


def _plain(v) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, (tuple, list)):
        return all(_plain(e) for e in v)
    return False


def _code_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _names_read(cls: type) -> set:
    """Attribute names that the code of ``cls`` and its bases (up to nn.Module) mentions."""
    names = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        for v in vars(klass).values():
            fn = getattr(v, "__func__", v)
            code = getattr(fn, "__code__", None)
            if isinstance(code, types.CodeType):
                names |= _code_names(code)
    return names


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        if a == b:
            return True
    except Exception:  # noqa: BLE001 - an odd __eq__: treat as changed
        return False
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b  # NaN


class AttributeWatch:
    """The plain attributes, children and (where read) training flags of every module of a
    model, as they were when it was traced."""

    def __init__(self, model: nn.Module):
        self.entries = []  # (module, dict name or None, key, value, what to call it)
        self.classes = []  # (module, its class, what to call it)
        for qual, mod in model.named_modules(remove_duplicate=True):
            where = qual or type(model).__name__
            self.classes.append((mod, type(mod), f"the class of {where}"))
            read_training = (not type(mod).__module__.startswith("torch.nn")
                             and "training" in _names_read(type(mod)))
            for k, v in vars(mod).items():
                if k.startswith("_") or (k == "training" and not read_training):
                    continue
                if _plain(v):
                    self.entries.append((mod, None, k, v, f"{where}.{k}"))
            for k, child in mod._modules.items():
                self.entries.append((mod, "_modules", k, child, f"{where}.{k} (submodule)"))

    def changed(self):
        """What changed first ("model.scale", "fc.act (submodule)"), or None."""
        for mod, table, key, value, name in self.entries:
            d = mod.__dict__ if table is None else mod.__dict__[table]
            now = d.get(key, _MISSING)
            if now is not value and (table is not None or not _same(now, value)):
                return name
        for mod, cls, name in self.classes:
            if type(mod) is not cls:
                return f"{name} ({cls.__name__} -> {type(mod).__name__})"
        return None

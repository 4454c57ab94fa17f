"""Capture never changes the user's model: what tracing or an example call assigns to a
module (``self.hidden = ...`` in a forward, a counter, a new buffer) is undone afterwards, and
reported so that optimize() can tell a forward that keeps state on ``self`` (torch.fx would
bake a Proxy or one call's value into the graph) and capture it through dynamo instead, which
replays such assignments on every call."""
from __future__ import annotations

import torch.nn as nn

_DICTS = ("_parameters", "_buffers", "_modules")


class ModuleState:
    """The attribute dictionaries of every module of a model, as they are now (by identity)."""

    def __init__(self, model: nn.Module, skip: tuple = ()):
        """``skip``: dictionaries left out (FSDP2 swaps ``_parameters`` entries itself)."""
        self.saved = []
        for name, mod in model.named_modules(remove_duplicate=True):
            d = mod.__dict__
            self.saved.append((name, mod, dict(d),
                               {k: dict(d[k]) for k in _DICTS if k in d and k not in skip}))

    def changed(self) -> list:
        """'<module>.<attribute>' for every attribute assigned, added or removed since."""
        out = []
        for name, mod, plain, inner in self.saved:
            prefix = f"{name}." if name else ""
            out += [prefix + k for k in _diff(plain, mod.__dict__, skip=_DICTS)]
            for k, before in inner.items():
                out += [prefix + n for n in _diff(before, mod.__dict__.get(k, {}))]
        return out

    def restore(self) -> None:
        """Put every dictionary back as it was (the inner ones in place: optimized modules
        share them)."""
        for _, mod, plain, inner in self.saved:
            d = mod.__dict__
            for k in [k for k in d if k not in plain]:
                del d[k]
            for k, v in plain.items():
                if k not in _DICTS and d.get(k, _MISSING) is not v:
                    d[k] = v
            for k, before in inner.items():
                now = d[k]
                if _diff(before, now):
                    now.clear()
                    now.update(before)


_MISSING = object()


def _diff(before: dict, now: dict, skip=()) -> list:
    keys = (set(before) | set(now)) - set(skip)
    return sorted(k for k in keys if before.get(k, _MISSING) is not now.get(k, _MISSING))

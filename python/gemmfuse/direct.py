"""A shorter call path for optimized modules whose whole forward is one fused chain (m18-like
models, where the fused op is a ~10 us GEMV and Python is most of a call).

The generated forward reads every parameter with ``self.linear.weight`` (``nn.Module.__getattr__``,
~0.8 us per level on the bench host) under three layers of ``__call__``. When the graph is
exactly "placeholders -> attributes -> one ``_run_chain`` -> output", ``install`` gives the module's
own class a ``__call__`` that reads the same attributes through the module dictionaries
(``_modules``/``_parameters``/``_buffers``, as ``nn.Module.__getattr__`` would) and calls the chain
runtime directly. It falls back to the normal call whenever that could differ: keyword
arguments, a different argument count, hooks (module or global), tracing or compiling, or an
attribute that is no longer found where it was at install time (a replaced submodule of another
class, a name moved between dictionaries).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.modules import module as _nn_module

_MISS = object()
_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state
_DICTS = ("_parameters", "_buffers", "_modules")


def global_hooks() -> bool:
    return bool(_nn_module._global_forward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_backward_pre_hooks or _nn_module._global_backward_hooks)


def _hooked(sd: dict) -> bool:
    """Whether the module (its instance dict) has any hook, or lacks the hook dicts."""
    try:
        return bool(sd["_forward_hooks"] or sd["_forward_pre_hooks"] or sd["_backward_hooks"]
                    or sd["_backward_pre_hooks"])
    except KeyError:
        return True


def _where(obj, name):
    """Which of the module dictionaries holds ``name`` (None: not one of them, or shadowed by
    the instance ``__dict__`` or a class attribute such as a parametrization's property)."""
    if not isinstance(obj, nn.Module) or name in obj.__dict__ or hasattr(type(obj), name):
        return None
    for d in _DICTS:
        if name in getattr(obj, d):
            return d
    return None


class _Attr:
    """A get_attr path read through module dictionaries, guarded by the types seen at install."""

    def __init__(self, root, qualname: str):
        self.steps = []  # (expected container type, dict name, key)
        obj = root
        for name in qualname.split("."):
            d = _where(obj, name)
            if d is None:
                raise LookupError(qualname)
            self.steps.append((type(obj), d, name))
            obj = getattr(obj, d)[name]

    def read(self, root):
        obj = root
        for typ, d, name in self.steps:
            if type(obj) is not typ:
                return _MISS
            obj = getattr(obj, d).get(name, _MISS)
            if obj is _MISS:
                return _MISS
        return obj


def path_or_none(root, qualname: str):
    """The dictionary path to an attribute of root, or None where it is not in the module
    dictionaries (read it with getattr then)."""
    try:
        return _Attr(root, qualname)
    except LookupError:
        return None


class _Direct:
    def __init__(self, nargs: int, rt_attr: str, sources: list):
        self.nargs = nargs
        self.rt_attr = rt_attr
        self.sources = sources  # ("arg", index) | ("attr", _Attr)

    def inputs(self, root, args):
        out = []
        for kind, v in self.sources:
            if kind == "arg":
                out.append(args[v])
            elif kind == "none":  # read by the chain runtime itself (ChainRuntime.owned)
                out.append(None)
            else:
                t = v.read(root)
                if t is _MISS:
                    return None
                out.append(t)
        return out


def _plan(gm: fx.GraphModule, run_chain) -> _Direct | None:
    """The direct path for gm's graph, or None when the graph is not one chain end to end."""
    parts = _one_chain(gm, run_chain)
    if parts is None:
        return None
    placeholders, attrs, call = parts
    rt_node, srcs = call.args
    if rt_node not in attrs or not isinstance(srcs, (list, tuple)):
        return None
    sources = []
    try:
        for s in srcs:
            if s is None:
                sources.append(("none", None))
            elif s in placeholders:
                sources.append(("arg", placeholders.index(s)))
            elif s in attrs:
                sources.append(("attr", _Attr(gm, attrs[s])))
            else:
                return None
    except LookupError:
        return None
    return _Direct(len(placeholders), attrs[rt_node], sources)


def _one_chain(gm: fx.GraphModule, run_chain):
    """(placeholders, get_attr nodes -> targets, the run_chain call) of a graph that is
    "placeholders -> attributes -> one run_chain call -> output", else None."""
    placeholders, attrs, call, output = [], {}, None, None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.args or n.target.startswith("*"):  # defaults, *args, **kwargs
                return None
            placeholders.append(n)
        elif n.op == "get_attr":
            attrs[n] = n.target
        elif n.op == "call_function" and n.target is run_chain and call is None:
            call = n
        elif n.op == "output":
            output = n
        else:
            return None
    if call is None or output is None or output.args[0] is not call or call.kwargs:
        return None
    return placeholders, attrs, call


def _direct_call(self, *args, **kwargs):
    """The ``__call__`` install gives a class: the chain runtime straight from the module
    dictionaries when the call allows it, else the normal path: the ``__call__`` of the
    class's base (the optimized module's, which checks what tracing read and then calls
    nn.Module's: hooks, then the generated forward), not fx's wrapper (that one dispatches
    through ``super()`` and would come back here)."""
    sd = self.__dict__  # instance attributes read from the dict: no MRO walk per lookup
    d = sd.get("_gemmfuse_direct")
    watch = sd.get("_gemmfuse_watch")
    if (d is not None and not kwargs and len(args) == d.nargs and not _hooked(sd)
            and not global_hooks() and not _is_compiling() and not _tracing_state()
            and (watch is None or watch.changed() is None)):
        rt = sd.get(d.rt_attr)
        inputs = d.inputs(self, args) if rt is not None else None
        if inputs is not None:
            return rt(inputs)
    return super(type(self), self).__call__(*args, **kwargs)


def install(gm: fx.GraphModule, run_chain) -> bool:
    """Give gm's own class (fx makes one per GraphModule) the direct ``__call__`` when its graph
    allows it. A later ``recompile()`` puts fx's ``__call__`` back."""
    direct = _plan(gm, run_chain)
    if direct is None or gm.__dict__.get("_gemmfuse_eager"):  # some calls run the model itself
        return False
    type(gm).__call__ = _direct_call
    gm.__dict__["_gemmfuse_direct"] = direct
    return True


def uninstall(gm: fx.GraphModule) -> None:
    """Put the normal call back (a module that runs some calls as the model itself)."""
    if active(gm):
        del type(gm).__call__
    gm.__dict__.pop("_gemmfuse_direct", None)


def active(module) -> bool:
    """Whether calls to `module` take the direct path. A deepcopy (a class fx derives afresh)
    or a recompile() keeps the dictionary entry but not the ``__call__``."""
    return ("_gemmfuse_direct" in getattr(module, "__dict__", {})
            and type(module).__call__ is _direct_call)

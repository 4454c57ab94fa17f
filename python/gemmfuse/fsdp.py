"""FSDP2 (``fully_shard``) through ``optimize()``.

``fully_shard(module)`` keeps each parameter sharded (a DTensor) between calls and registers
two hooks on the module: its pre-forward all-gathers the parameters and puts the unsharded
plain tensors into the modules' ``_parameters`` (the first one to run, the root's, also sets
FSDP up once: "lazy init"), its post-forward puts the shards back and registers what the
backward needs (the all-gather again, then the gradients' reduce-scatter from the unsharded
parameters' ``.grad``). A fused chain therefore computes right exactly when it runs between
the two hooks of the modules its parameters belong to.

torch.fx tracing would run those hooks with Proxies (the tracer calls submodules through
``nn.Module.__call__``): that sets a block up as an FSDP root and fails halfway ("FSDP state has
already been lazily initialized" at the first real call). So every module fully_shard was
applied to is a *unit*: the tracer stops at it (``UnitTracer``), the parent's graph calls it
through ``_call_unit``, and the unit's own forward is optimized on its own, inside FSDP's
pre/post-forward (``Hooks.run``, as ``register_fsdp_forward_method`` runs them around another
method), during the example call (optimized._build_unit): the capture reads the unsharded parameters. At run time the
fused op reads the unsharded parameters FSDP put in place, and returns gradients to them, which
FSDP reduce-scatters into the sharded ones. A unit with hooks other than FSDP's runs as PyTorch
runs it (the module's own call), with the reason in ``explain``.

FSDP2 all-gathers into the same unsharded tensor every step and keeps its version counter
(``_unsafe_preserve_version_counter``), which gemmfuse's prepared weights (split parts, column
sums) key on: a unit bumps its unsharded parameters' versions whenever the sharded ones'
changed (``Hooks.refresh``), and the optimizer-step hook does the same for models compiled
with the backend (``unsharded_after_step``).
"""
from __future__ import annotations

import inspect
import weakref

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import InfoProp
from .direct import global_hooks

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # a build without torch.distributed
    FSDPModule = None


def is_unit(module) -> bool:
    """Whether fully_shard was applied to this module."""
    return FSDPModule is not None and isinstance(module, FSDPModule)


def has_units(model: nn.Module) -> bool:
    return FSDPModule is not None and any(isinstance(m, FSDPModule) for m in model.modules())


class UnitTracer(fx.Tracer):
    """torch.fx's tracer, stopping at every unit below the module it traces (never running
    FSDP's hooks: they would act on Proxies)."""

    def __init__(self, root: nn.Module):
        super().__init__()
        self._traced = root

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (m is not self._traced and is_unit(m)) or super().is_leaf_module(m, qualname)


class Hooks:
    """FSDP's pre- and post-forward of one unit, around its optimized forward."""

    def __init__(self, module: nn.Module, qualname: str):
        self.module = module
        self.qualname = qualname or f"the root ({type(module).__name__})"
        self.fallbacks: dict = {}     # reason -> calls run as PyTorch runs the module
        self._versions = None         # the sharded parameters' versions at the last refresh

    def other_hooks(self) -> str:
        """Why the unit must run through its own call: hooks other than FSDP's, which the
        optimized forward would skip ("" when there are none)."""
        m = self.module
        if global_hooks():
            return "global module hooks are registered: the unit runs in PyTorch so that they run"
        state, d = m._get_fsdp_state(), m.__dict__
        if d.get("_backward_hooks") or d.get("_backward_pre_hooks"):
            return f"backward hooks on FSDP unit '{self.qualname}': it runs in PyTorch"
        for h in list(d["_forward_pre_hooks"].values()) + list(d["_forward_hooks"].values()):
            if getattr(h, "__self__", None) is not state:
                return (f"hooks other than FSDP's on unit '{self.qualname}' (e.g. from "
                        f"fully_shard of a module list, or the user's): it runs in PyTorch")
        return ""

    def run(self, fn, args: tuple, kwargs: dict):
        """fn(*args, **kwargs) between FSDP's pre- and post-forward of the unit; the module's
        own call where it has other hooks."""
        m = self.module
        why = self.other_hooks()
        if why:
            self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
            return m(*args, **kwargs)
        state = m._get_fsdp_state()
        args, kwargs = state._pre_forward(m, args, kwargs)
        self.refresh(state)
        out = fn(*args, **kwargs)
        return state._post_forward(m, args, out)

    def refresh(self, state):
        """Bump the unsharded parameters' versions when the sharded ones have changed since
        the last call (an optimizer step, load_state_dict): FSDP keeps their versions across
        all-gathers, and prepared weights would otherwise outlive the data they came from."""
        group = state._fsdp_param_group
        if group is None:
            return
        params = group.fsdp_params
        versions = [fp.sharded_param._version for fp in params]
        if versions != self._versions:
            self._versions = versions
            full = [fp._unsharded_param for fp in params if hasattr(fp, "_unsharded_param")]
            if full:
                torch.autograd.graph.increment_version(full)


class UnitCall:
    """A unit as its parent's graph calls it: its optimized forward (``opt``, a
    GemmfuseModule that runs FSDP's hooks around itself) once the example call has built it,
    else the module's own call (``reason`` says why)."""

    def __init__(self, module: nn.Module, qualname: str):
        self.module = module
        self.qualname = qualname
        self.opt = None
        self.reason = ""


def _call_unit(unit: UnitCall, *args, **kwargs):
    """The call_function target that replaces a unit's call_module node."""
    if unit.opt is None:
        return unit.module(*args, **kwargs)
    return unit.opt(*args, **kwargs)


def positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The call's arguments in the forward's order (the example run passes placeholders
    positionally)."""
    if not kwargs:
        return tuple(args)
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def route_units(gm: fx.GraphModule, prefix: str = "") -> list:
    """Replace every call_module node of a unit by ``_call_unit(<UnitCall>, ...)`` (the
    UnitCall a plain attribute of gm, so no state_dict key); returns the UnitCalls."""
    units: dict = {}
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_module" or not is_unit(gm.get_submodule(n.target)):
            continue
        if n.target not in units:
            units[n.target] = (f"_gemmfuse_unit_{len(units)}",
                               UnitCall(gm.get_submodule(n.target), prefix + n.target))
            gm.__dict__[units[n.target][0]] = units[n.target][1]
        with g.inserting_before(n):
            ref = g.create_node("get_attr", units[n.target][0])
            new = g.call_function(_call_unit, (ref,) + tuple(n.args), dict(n.kwargs))
        n.replace_all_uses_with(new)
        g.erase_node(n)
    if units:
        gm.recompile()
    return [u for _, u in units.values()]


class UnitProp(InfoProp):
    """InfoProp that, at each unit's first call, optimizes the unit's forward on the
    arguments it receives there and runs it: ``build_unit(unit, args, kwargs, precision)``
    (optimized._build_unit, which captures the unit as optimize() captures a model)."""

    def __init__(self, gm: fx.GraphModule, precision: str, build_unit):
        super().__init__(gm)
        self.precision = precision
        self.build_unit = build_unit

    def call_function(self, target, args, kwargs):
        if target is _call_unit and args[0].opt is None and not args[0].reason:
            return self.build_unit(args[0], tuple(args[1:]), dict(kwargs), self.precision)
        return super().call_function(target, args, kwargs)


def reshard(model: nn.Module):
    """Put every unit's shards back after the example call: a root keeps its parameters
    unsharded after a forward (FSDP reshards it after the backward), and an optimizer made
    after optimize() must get the sharded ones, as it would before any call."""
    for m in model.modules():
        if is_unit(m):
            m.reshard()


def unsharded_params(module: nn.Module) -> list:
    """The unsharded parameters FSDP has made for the units in ``module`` (the tensors a
    compiled graph reads while the unit runs)."""
    out = []
    for m in module.modules():
        if is_unit(m):
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in (group.fsdp_params if group is not None else ()):
                if hasattr(fp, "_unsharded_param"):
                    out.append(fp._unsharded_param)
    return out


_BY_OPTIMIZER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def unsharded_after_step(optimizer, params: list) -> list:
    """The unsharded parameters whose sharded ones ``optimizer`` steps (for the step hook to
    bump: see the module's docstring). Looked up once per optimizer among the live FSDP states,
    and only where a parameter is a DTensor."""
    if FSDPModule is None:
        return []
    key = (len(params), id(params[0]) if params else 0)
    hit = _BY_OPTIMIZER.get(optimizer)
    if hit is None or hit[0] != key:
        from torch.distributed.tensor import DTensor
        fsdp_params = []
        if any(isinstance(p, DTensor) for p in params):
            from torch.distributed._composable_state import _module_state_mapping
            mine = {id(p) for p in params}
            states = {s for s in (r() for r in list(_module_state_mapping.values())) if s is not None}
            for s in states:
                group = getattr(s, "_fsdp_param_group", None)
                fsdp_params += [fp for fp in (group.fsdp_params if group is not None else ())
                                if id(fp.sharded_param) in mine]
        hit = _BY_OPTIMIZER[optimizer] = (key, fsdp_params)
    return [fp._unsharded_param for fp in hit[1] if hasattr(fp, "_unsharded_param")]

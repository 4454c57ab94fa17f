"""The optimized module: a traced copy of the model whose chains call ``torch.ops.gemmfuse.run``.

``optimize(model, example_inputs, precision)`` traces the model with torch.fx, finds every
``Linear -> stages`` chain (capture/), asks the C++ planner (``describe``) whether it takes
each chain on the example inputs, and replaces every accepted chain by one call of
``_run_chain``. Everything else keeps running in PyTorch. The result is a
``torch.fx.GraphModule`` that shares the model's Parameters, buffers and submodules (the same
objects, the same ``state_dict`` keys), follows ``.train()``/``.eval()`` and has the model's
forward signature.

At call time each chain checks its inputs; anything the fused op must not see (wrong dtype,
shape or device, autograd recording, a shape/mode combination the planner refuses) runs the
chain's original nodes in PyTorch instead, so errors and results are PyTorch's own. Every
such fallback is counted with its reason (``explain`` shows them).
"""
from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from . import _lib, direct
from .reports import ChainEntry, OptimizeReport, compiled_graphs
from .capture import (AttrRef, CaptureReport, Chain, InfoProp, TInfo, _attr_tensor, find_chains,
                      node_info, source_key)

PRECISIONS = ("fp32", "fast", "tf32")
_BN_MSG = "Expected more than 1 value per channel when training"


def always_fuse() -> bool:
    """GEMMFUSE_ALWAYS_FUSE=1 runs every chain the planner takes fused, also where it expects
    PyTorch to be faster (the CPU tests use it to exercise the CPU executor)."""
    return os.environ.get("GEMMFUSE_ALWAYS_FUSE") == "1"


def _call_module(mod, *args, **kwargs):
    """The fallback graphs' stand-in for call_module: the module is an input, not an attribute."""
    return mod(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# The runtime of one chain.


class ChainRuntime:
    """Everything one fused chain needs at call time. Lives as a plain attribute of the
    optimized GraphModule (not a submodule: it holds no parameters and adds no state_dict
    keys); the graph passes it, and the chain's inputs, to ``_run_chain``."""

    def __init__(self, index: int, specs: dict, x_idx: int, w_idx: int, b_idx: Optional[int],
                 op_idx: list, st_idx: list, mode_idx: list, mode_names: list, precision: str,
                 fallback: fx.GraphModule, in_features: int, x_rank: Optional[int] = None,
                 guards: tuple = ()):
        self.index = index
        self.specs = specs                # training flags tuple -> spec text
        self.x_idx, self.w_idx, self.b_idx = x_idx, w_idx, b_idx
        self.op_idx, self.st_idx, self.mode_idx = list(op_idx), list(st_idx), list(mode_idx)
        self.mode_names = list(mode_names)
        self.precision = precision
        self.fallback = fallback          # the original nodes, inputs as arguments
        self.in_features = in_features
        self.x_rank = x_rank              # dims were normalised for this input rank
        # (input index, compile-time value, name): numbers the graph passes at run time that
        # the specs hold as constants (Chain.guards); a call that brings another value runs
        # in PyTorch.
        self.guards = tuple(guards)
        self.bn_training = {f: ("batch_norm training=1" in s) for f, s in specs.items()}
        # Statistics (eager calls only).
        self.fused_calls = 0
        self.fallbacks: dict = {}         # reason -> count
        self.refused: dict = {}           # (shape, dtype, device, flags) -> planner's reason
        # The input signatures of fused calls, latest last (explain prints the plan at each;
        # plans change with the shape). Recorded off the fast path: a new signature takes the
        # checked call.
        self.seen: dict = {}              # (shape, dtype, device, flags) -> None
        self._warned = False
        self._fast = None                 # (shape, dtype, device, flags, spec) of the last fused call
        self._routed = None               # (shape, dtype, device, flags, reason) of the last call
        #                                   the planner routed to PyTorch
        # The C++ binding behind the OpOverload (its __call__ only forwards to it): one Python
        # frame less per call, which matters for calls as short as m18's (~10 us).
        self._op = torch.ops.gemmfuse.run.default._op

    # -- helpers ---------------------------------------------------------------------------
    def flags(self, inputs) -> tuple:
        return tuple(bool(inputs[i].training) for i in self.mode_idx)

    def spec(self, flags: tuple) -> str:
        return self.specs[flags]

    SEEN_MAX = 8  # input signatures kept for explain

    def _saw(self, key: tuple):
        self.seen.pop(key, None)
        self.seen[key] = None
        if len(self.seen) > self.SEEN_MAX:
            del self.seen[next(iter(self.seen))]

    def _changed_number(self, inputs):
        """The name of the first guarded number that differs from its compile-time value."""
        for i, v, name in self.guards:
            now = inputs[i]
            if not (now == v or (now != now and v != v)):  # NaN stays NaN
                return name
        return None

    def _record(self, reason: str):
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def _pytorch(self, inputs, reason: str):
        self._record(reason)
        return self.fallback(*inputs)

    # -- the traced path (torch.compile / torch.export of the optimized module) --------------
    def traced(self, inputs):
        flags = tuple(bool(inputs[i].training) for i in self.mode_idx)
        spec = self.specs[flags]
        x = inputs[self.x_idx]
        w = inputs[self.w_idx]
        b = None if self.b_idx is None else inputs[self.b_idx]
        ops = []
        for i in self.op_idx:
            t = inputs[i]
            if t.dtype != x.dtype:
                t = t.to(x.dtype)
            ops.append(t.contiguous())
        state = [inputs[i] for i in self.st_idx]
        return torch.ops.gemmfuse.run(spec, x.contiguous(), w, b, ops, state, self.precision)

    # -- the eager path ------------------------------------------------------------------------
    def __call__(self, inputs):
        # Fast path: the same input signature and modes as the last fused call, under no
        # autograd. Skips the checks below; what could still differ (an operand moved or cast)
        # the C++ op checks itself and raises PyTorch's own error for.
        fast = self._fast
        if fast is not None:
            x = inputs[self.x_idx]
            if self._same_signature(x, inputs, fast):
                b = None if self.b_idx is None else inputs[self.b_idx]
                op_idx, st_idx = self.op_idx, self.st_idx
                # () for an empty list: no allocation (a list is a GC-tracked object each call)
                out = self._op(fast[4], x if x.is_contiguous() else x.contiguous(),
                               inputs[self.w_idx], b,
                               [inputs[i] for i in op_idx] if op_idx else (),
                               [inputs[i] for i in st_idx] if st_idx else (), self.precision)
                self.fused_calls += 1
                return out
        routed = self._routed
        if routed is not None and self._same_signature(inputs[self.x_idx], inputs, routed):
            self.fallbacks[routed[4]] += 1
            return self.fallback.forward(*inputs)
        return self._checked_call(inputs)

    def _same_signature(self, x, inputs, sig) -> bool:
        """Whether a call has the signature (shape, dtype, device, training flags) of `sig`,
        no autograd recording and its guarded numbers unchanged."""
        return (type(x) is torch.Tensor and x.shape == sig[0] and x.dtype == sig[1]
                and x.device == sig[2] and not torch.is_grad_enabled()
                and (not self.mode_idx or self.flags(inputs) == sig[3])
                and (not self.guards or self._changed_number(inputs) is None))

    def _checked_call(self, inputs):
        x = inputs[self.x_idx]
        w = inputs[self.w_idx]
        b = None if self.b_idx is None else inputs[self.b_idx]
        if not isinstance(x, torch.Tensor):
            return self._pytorch(inputs, "the input is not a tensor")
        if x.device != w.device:
            raise RuntimeError(
                f"gemmfuse: Expected all tensors to be on the same device, but the input is on "
                f"{x.device} and the Linear weight on {w.device} (chain {self.index}); move the "
                f"input or the model with .to(device)")
        if x.dtype != w.dtype or not x.is_floating_point():
            return self._pytorch(inputs, f"input dtype {x.dtype} != weight dtype {w.dtype}")
        changed = self._changed_number(inputs) if self.guards else None
        if changed is not None:
            return self._pytorch(inputs, f"{changed} differs from its value at compile time, "
                                         f"which the fused chain holds")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            return self._pytorch(inputs, f"input shape {list(x.shape)} does not end in {self.in_features}")
        if self.x_rank is not None and x.dim() != self.x_rank:
            return self._pytorch(inputs, f"input rank {x.dim()} differs from the example's "
                                         f"{self.x_rank} (dims were resolved for it)")
        flags = tuple(bool(inputs[i].training) for i in self.mode_idx)
        ops, state = [], []
        for i in self.op_idx:
            t = inputs[i]
            if not isinstance(t, torch.Tensor):
                return self._pytorch(inputs, "an operand is not a tensor")
            if t.device != x.device:
                if t.dim() == 0 and t.device.type == "cpu":
                    t = t.to(x.device)
                else:
                    return self._pytorch(inputs, f"operand on {t.device}, input on {x.device}")
            if t.dtype != x.dtype:
                t = t.to(x.dtype)
            ops.append(t.contiguous())
        for i in self.st_idx:
            t = inputs[i]
            if t.device != x.device or not t.is_contiguous():
                return self._pytorch(inputs, f"state tensor on {t.device} or not contiguous")
            state.append(t)
        if b is not None and (b.device != x.device or b.dtype != x.dtype):
            return self._pytorch(inputs, "bias device/dtype differs from the input's")
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or
                                        (b is not None and b.requires_grad) or
                                        any(t.requires_grad for t in ops)):
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "gemmfuse: autograd is recording and the chain's inputs require grad, so the "
                    "chain runs in PyTorch (the fused op has no backward). Call the module under "
                    "torch.no_grad() or torch.inference_mode() to run it fused.", stacklevel=3)
            return self._pytorch(inputs, "autograd is recording (run under torch.no_grad() to fuse)")
        if x.numel() == 0 and self.bn_training[flags]:
            return self._pytorch(inputs, "empty batch with a training BatchNorm")
        key = (tuple(x.shape), x.dtype, x.device, flags)
        if key in self.refused:
            return self._pytorch(inputs, self.refused[key])
        spec = self.specs[flags]
        if not x.is_contiguous():
            x = x.contiguous()
        try:
            if key not in self.seen and not always_fuse():
                # The planner's word on a new signature: where PyTorch runs the chain faster
                # (e.g. transcendental ops on the CPU), the call runs there.
                why = torch.ops.gemmfuse.route(spec, x, w, b, ops, state, self.precision)
                if why:
                    reason = f"PyTorch is faster at shape {list(x.shape)} on {x.device.type}: {why}"
                    self.refused[key] = reason
                    self._routed = key + (reason,)
                    return self._pytorch(inputs, reason)
            out = torch.ops.gemmfuse.run(spec, x, w, b, ops, state, self.precision)
        except (RuntimeError, ValueError) as e:
            if _lib.is_unsupported(e):
                reason = f"planner refused shape {list(x.shape)} flags {flags}: {_lib.unsupported_reason(e)}"
                self.refused[key] = reason
                return self._pytorch(inputs, reason)
            if _BN_MSG in str(e):
                # PyTorch raises ValueError here; let the original nodes raise it verbatim.
                self._record("training BatchNorm with one value per channel")
                self.fallback(*inputs)  # PyTorch raises its own ValueError here, verbatim
                raise ValueError(str(e).splitlines()[0]) from None
            raise
        self.fused_calls += 1
        self._saw(key)
        if (all(o is inputs[i] for o, i in zip(ops, self.op_idx))
                and all(t is inputs[i] for t, i in zip(state, self.st_idx))):
            self._fast = (x.shape, x.dtype, x.device, flags, spec)
        return out


def _run_chain(rt: ChainRuntime, inputs: list):
    """The call_function target that replaces a chain in the graph."""
    if torch.compiler.is_compiling():
        return rt.traced(inputs)
    return rt(inputs)


# --------------------------------------------------------------------------------------------
# Rewriting a graph.


def _flatten_nodes(args):
    out = []
    fx.node.map_arg(args, lambda n: out.append(n))
    return out


def _resolve(remap: dict, n):
    while isinstance(n, fx.Node) and n in remap:
        n = remap[n]
    return n


@dataclass
class Rewritten:
    node: fx.Node
    runtime: ChainRuntime
    sources: list


def rewrite_chain(gm: fx.GraphModule, chain: Chain, precision: str, remap: dict,
                  attr_name: str) -> Rewritten:
    """Replace the chain's nodes by ``_run_chain(gm.<attr_name>, [inputs...])``."""
    g = gm.graph
    chain_nodes = chain.nodes
    chain_set = set(chain_nodes)
    sources, index = [], {}

    def add(src):
        src = _resolve(remap, src)
        k = source_key(src)
        if k not in index:
            index[k] = len(sources)
            sources.append(src)
        return index[k]

    for n in chain_nodes:
        for a in _flatten_nodes((n.args, n.kwargs)):
            if a not in chain_set:
                add(a)
        if n.op == "call_module":
            add(AttrRef(n.target))
    x_idx = add(chain.x)
    w_idx = add(chain.weight)
    b_idx = add(chain.bias) if chain.bias is not None else None
    op_idx = [add(s) for s in chain.operands]
    st_idx = [add(s) for s in chain.state]
    mode_idx = [add(AttrRef(q)) for q in chain.mode_modules]
    guards = [(add(n), v, _number_name(n)) for n, v in chain.guards.items()]

    # The fallback: the original nodes as a graph of their own, every input an argument.
    fb = fx.Graph()
    ph = [fb.placeholder(f"in{i}") for i in range(len(sources))]
    env = {}

    def tr(a):
        if a in env:
            return env[a]
        return ph[index[source_key(_resolve(remap, a))]]

    for n in chain_nodes:
        if n.op == "call_module":
            mod_in = ph[index[source_key(AttrRef(n.target))]]
            args = fx.node.map_arg(n.args, tr)
            kwargs = fx.node.map_arg(n.kwargs, tr)
            env[n] = fb.call_function(_call_module, (mod_in,) + tuple(args), dict(kwargs))
        else:
            env[n] = fb.node_copy(n, tr)
    fb.output(env[chain.output])
    fallback = fx.GraphModule(nn.Module(), fb, class_name="GemmfuseFallback")

    specs = {flags: chain.spec(flags) for flags in chain.flag_combos()}
    xinf = node_info(chain.x)
    rt = ChainRuntime(chain.index, specs, x_idx, w_idx, b_idx, op_idx, st_idx, mode_idx,
                      list(chain.mode_modules), precision, fallback, chain.in_features,
                      xinf.rank if isinstance(xinf, TInfo) else None, guards)
    rt.example_sources = [example_record(src) for src in sources]
    setattr(gm, attr_name, rt)

    last = chain.output
    with g.inserting_before(last):
        getattrs = {}
        args = []
        for src in sources:
            if isinstance(src, AttrRef):
                if src.qualname not in getattrs:
                    getattrs[src.qualname] = g.get_attr(src.qualname)
                args.append(getattrs[src.qualname])
            else:
                args.append(src)
        rt_node = g.create_node("get_attr", attr_name)  # a plain attribute: skip get_attr's check
        new = g.call_function(_run_chain, (rt_node, args))
    new.meta.update({k: v for k, v in last.meta.items()
                     if k in ("gemmfuse_info", "example_value", "val", "tensor_meta", "stack_trace")})
    last.replace_all_uses_with(new)
    remap[last] = new
    for n in reversed(chain_nodes):
        g.erase_node(n)
    return Rewritten(new, rt, sources)


def _number_name(node: fx.Node) -> str:
    """What a guarded number is called in messages: the graph input it is read from."""
    if node.op == "call_method" and node.target == "item" and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node.name


def example_tensor(gm: fx.GraphModule, src) -> Any:
    """A tensor standing in for a source at describe time: real attributes, zeros otherwise."""
    if isinstance(src, AttrRef):
        return _attr_tensor(gm, src.qualname)
    if src.op == "get_attr":
        return _attr_tensor(gm, src.target)
    inf = node_info(src)
    if isinstance(inf, TInfo):
        return torch.zeros(inf.shape, dtype=inf.dtype, device=inf.device)
    return None


def example_record(src):
    """What example_from_record needs to rebuild a stand-in for a source later (no fx.Node)."""
    if isinstance(src, AttrRef):
        return ("attr", src.qualname)
    if src.op == "get_attr":
        return ("attr", src.target)
    inf = node_info(src)
    return ("info", inf if isinstance(inf, TInfo) else None)


def example_from_record(gm, rec):
    kind, v = rec
    if kind == "attr":
        return _attr_tensor(gm, v)
    if v is None:
        return None
    return torch.zeros(v.shape, dtype=v.dtype, device=v.device)


# --------------------------------------------------------------------------------------------
# optimize()


class GemmfuseModule(fx.GraphModule):
    """The optimized module: a GraphModule that keeps exactly the model's parameters, buffers
    and children (GraphModule alone keeps only what its graph reads) also through deepcopy."""

    def __deepcopy__(self, memo):
        res = super().__deepcopy__(memo)
        for k in ("_parameters", "_buffers", "_modules"):
            d = getattr(res, k)
            d.clear()
            d.update(copy.deepcopy(getattr(self, k), memo))
        res._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
        for k, v in self.__dict__.items():
            if k not in res.__dict__:
                res.__dict__[k] = copy.deepcopy(v, memo)
        res.training = self.training
        return res


def _share_state(gm: fx.GraphModule, model: nn.Module):
    """Make gm hold exactly the model's parameters, buffers and children (same objects, same
    order), so state_dict keys and tensors are the model's."""
    plain = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            atom = n.target.split(".")[0]
            if atom not in model._parameters and atom not in model._buffers and atom not in model._modules:
                plain[atom] = getattr(model, atom)
    gm._parameters.clear()
    gm._parameters.update(model._parameters)
    gm._buffers.clear()
    gm._buffers.update(model._buffers)
    gm._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
    gm._modules.clear()
    gm._modules.update(model._modules)
    for k, v in plain.items():
        gm.__dict__[k] = v
    gm.training = model.training


def _propagate(gm: fx.GraphModule, inputs: tuple):
    """Run the traced model once on the example inputs for shapes; undo its side effects on
    buffers (BatchNorm running statistics) and on the RNG."""
    saved = [(b, b.detach().clone()) for b in gm.buffers()]
    devices = sorted({t.device.index or 0 for t in list(inputs) + [p for p in gm.parameters()]
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            InfoProp(gm).run(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def optimize(model: nn.Module, example_inputs, precision: str = "fp32") -> fx.GraphModule:
    """Return ``model`` with every fusable ``Linear -> stages`` chain running as one gemmfuse op.

    ``example_inputs``: a tensor or a tuple of the forward's positional arguments (used once,
    to learn shapes; the model's buffers and the RNG are left as they were).
    ``precision``: "fp32" (default, SGEMM-faithful), "fast" (split precision on tensor cores,
    within 1e-4 of float64) or "tf32".
    """
    if precision not in PRECISIONS:
        raise ValueError(f"gemmfuse.optimize: precision must be one of {PRECISIONS}, got {precision!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"gemmfuse.optimize expects an nn.Module, got {type(model).__name__}")
    if getattr(model, "_gemmfuse", None) is not None:
        raise ValueError("gemmfuse.optimize: this module is already optimized")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    _lib.load()
    try:
        tracer = fx.Tracer()
        graph = tracer.trace(model)
        name = model.__class__.__name__ if isinstance(model, nn.Module) else "Module"
        gm = GemmfuseModule(tracer.root, graph, name)
    except Exception as e:  # noqa: BLE001 - any tracing failure
        raise RuntimeError(
            f"gemmfuse.optimize: torch.fx.symbolic_trace failed on {type(model).__name__} "
            f"({type(e).__name__}: {e}). Models with data-dependent control flow can use "
            f"torch.compile(model, backend='gemmfuse') instead.") from e
    _share_state(gm, model)
    _propagate(gm, example_inputs)

    report = OptimizeReport(precision=precision, flavor="fx")
    cap: CaptureReport = find_chains(gm, "fx", check=_lib.check)
    report.rejected = list(cap.rejected)
    remap: dict = {}
    for chain in cap.chains:
        flags = tuple(bool(gm.get_submodule(q).training) for q in chain.mode_modules)
        spec = chain.spec(flags)
        entry = ChainEntry(index=chain.index, linear=chain.linear.name,
                           nodes=chain.describe_nodes(), stop=chain.stop, spec=spec,
                           status="pytorch", mode_modules=list(chain.mode_modules))
        report.entries.append(entry)
        try:
            x = example_tensor(gm, chain.x)
            w = example_tensor(gm, chain.weight)
            b = example_tensor(gm, chain.bias) if chain.bias is not None else None
            ops = [example_tensor(gm, s) for s in chain.operands]
            st = [example_tensor(gm, s) for s in chain.state]
            entry.example = {"x": list(x.shape), "operands": [list(t.shape) for t in ops]}
            ops = [t.to(x.dtype) if t.dtype != x.dtype else t for t in ops]
            entry.plan = _lib.describe(spec, x, w, b, ops, st, precision)
        except (RuntimeError, ValueError, AttributeError, TypeError) as e:
            entry.reason = (_lib.unsupported_reason(e) if _lib.is_unsupported(e)
                            else f"describe failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        attr = f"_gemmfuse_chain_{chain.index}"
        rewrite_chain(gm, chain, precision, remap, attr)
        entry.status = "fused"
        entry.attr = attr
    gm.recompile()
    gm._gemmfuse = report
    direct.install(gm, _run_chain)
    return gm


def runtimes(module: nn.Module) -> list:
    """The ChainRuntime objects of an optimized module, by chain index; of a module compiled
    with backend="gemmfuse", those of every graph compiled for it (reports.compiled_graphs)."""
    rep = getattr(module, "_gemmfuse", None)
    if rep is None:
        return [rt for gm in compiled_graphs(module) for rt in runtimes(gm)]
    return [getattr(module, e.attr) for e in rep.entries if e.attr]


def weights_changed(module: nn.Module) -> None:
    """Tell gemmfuse that ``module``'s parameters or buffers were written behind autograd's back
    (``p.data.copy_(...)`` and other writes through ``.data`` do not bump ``_version``, which
    the C++ preparation cache keys on). Bumps every version counter, so prepared weights
    (column sums, folded BatchNorm, split-precision parts) are rebuilt on the next call."""
    for t in list(module.parameters()) + list(module.buffers()):
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)

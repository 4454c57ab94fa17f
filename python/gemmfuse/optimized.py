"""``optimize(model, example_inputs, precision)``: the model traced with torch.fx, every
``Linear -> stages`` chain (capture/) the C++ planner takes on the example inputs replaced by
one ``_run_chain`` call (rewrite.py), everything else left to PyTorch; a model torch.fx cannot
trace is captured through dynamo instead (``GemmfuseDynamoModule``, dynamo_module.py). The
result (a ``GemmfuseModule`` or that) shares the model's Parameters, buffers and submodules
(the same objects, the same ``state_dict`` keys), follows ``.train()``/``.eval()`` and has the
model's forward signature.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn

from . import _lib, direct, fsdp, measure, route_timer, tensor_parallel
from .capture import CaptureReport, InfoProp, find_chains
from .capture.parallel import capture_reason
from .reports import ChainEntry, OptimizeReport, compiled_graphs
from .rewrite import example_tensor, fuse_attention, fuse_lm_heads, fuse_products, rewrite_chain
from .snapshot import ModuleState
from .runtime import PRECISIONS, _run_chain, always_fuse
from .watch import AttributeWatch
from .dynamo_module import GemmfuseDynamoModule

class GemmfuseModule(fx.GraphModule):
    """The optimized module: a GraphModule that holds exactly the model's parameters, buffers
    and children (the model's own dictionaries, so that assigning through either module
    changes both), reads and writes the model's plain attributes through to it, and traces the
    model again when something tracing read from it has changed (watch.py)."""

    def __call__(self, *args, **kwargs):
        d = self.__dict__
        watch = d.get("_gemmfuse_watch")
        if watch is not None:
            what = watch.changed()
            if what is not None:
                self._gemmfuse_retrace(args, kwargs, what)
        hooks = d.get("_gemmfuse_fsdp")  # an FSDP unit: its graph runs inside FSDP's hooks
        if hooks is not None:
            return hooks.run(super().__call__, args, kwargs)
        return super().__call__(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__.get("_gemmfuse_source")
            if source is not None and name in source.__dict__ and not name.startswith("_"):
                return source.__dict__[name]
            raise

    def __setattr__(self, name, value):
        source = self.__dict__.get("_gemmfuse_source")
        if (source is not None and not name.startswith("_") and name != "training"
                and name in source.__dict__ and name not in self.__dict__):
            setattr(source, name, value)  # the model's own attribute: the watch sees the change
            return
        super().__setattr__(name, value)

    def train(self, mode: bool = True):
        super().train(mode)
        source = self.__dict__.get("_gemmfuse_source")
        if source is not None:
            source.training = mode  # its children are this module's, already switched
        return self

    def _gemmfuse_retrace(self, args, kwargs, what: str):
        """Optimize the model again with this call's arguments and take the result's graph,
        chains and report: tracing read something (`what`) that has changed."""
        source = self.__dict__["_gemmfuse_source"]
        if kwargs:
            raise RuntimeError(f"gemmfuse: {what} changed since optimize, and the module must "
                               f"be traced again with positional arguments only")
        new = optimize(source, args, self._gemmfuse.precision)
        new._gemmfuse.retraced = self._gemmfuse.retraced + [what]
        _adopt(self, new)

    def __reduce__(self):
        """Pickled as the model it was made from, its precision and its example inputs'
        shapes: unpickling optimizes the model again."""
        d = self.__dict__
        return (_unpickle, (d["_gemmfuse_source"], d["_gemmfuse"].precision,
                            d["_gemmfuse_examples"]))

    def __deepcopy__(self, memo):
        res = super().__deepcopy__(memo)
        for k in ("_parameters", "_buffers", "_modules"):
            res.__dict__[k] = copy.deepcopy(self.__dict__[k], memo)
        res._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
        for k, v in self.__dict__.items():
            if k not in res.__dict__:
                res.__dict__[k] = copy.deepcopy(v, memo)
        res.__dict__["training"] = self.training
        _bind(res)
        _install_call(res)
        return res


def _adopt(gm: GemmfuseModule, new: GemmfuseModule):
    """Give gm new's graph, chain runtimes, report and watch (both hold the same model's state;
    gm keeps its own hooks)."""
    for k in [k for k in gm.__dict__ if k.startswith("_gemmfuse")]:
        del gm.__dict__[k]
    own = {"_graph", "_wrapped_call", "_gemmfuse_direct", "training"}
    for k, v in new.__dict__.items():
        if k in own or k.startswith("_forward") or k.startswith("_backward"):
            continue
        gm.__dict__[k] = v
    gm.graph = new.graph  # takes ownership and recompiles gm's forward
    _bind(gm)
    _install_call(gm)


def _install_call(gm) -> None:
    """gm's class call: the model itself for the modes it runs faster in (_time_whole), else
    the direct path where the graph allows it (direct.py), else fx's."""
    if gm.__dict__.get("_gemmfuse_eager"):
        gm.__dict__.pop("_gemmfuse_direct", None)
        type(gm).__call__ = _eager_call
    else:
        direct.install(gm, _run_chain)


def _eager_call(self, *args, **kwargs):
    """A call in a mode the model runs faster in as it is goes straight to the model (which
    reads its own attributes: nothing to watch); one with hooks on the optimized module, or
    in the other mode, takes the normal path."""
    d = self.__dict__
    if ("train" if torch.is_grad_enabled() else "forward") in d["_gemmfuse_eager"] and not (
            d["_forward_hooks"] or d["_forward_pre_hooks"]):
        return d["_gemmfuse_source"](*args, **kwargs)
    return GemmfuseModule.__call__(self, *args, **kwargs)


def _bind(gm) -> None:
    """The chain runtimes of gm read their modules from gm (ChainRuntime.bind)."""
    for e in gm.__dict__["_gemmfuse"].entries:
        if e.attr:
            gm.__dict__[e.attr].bind(gm)


def _example_record(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.device)
    return ("value", v)


def _unpickle(model: nn.Module, precision: str, examples: list) -> "GemmfuseModule":
    params = [t for t in list(model.parameters()) + list(model.buffers())]
    home = params[0].device if params else None
    args = []
    for rec in examples:
        if rec[0] == "value":
            args.append(rec[1])
            continue
        _, shape, dtype, device = rec
        if home is not None and device.type != home.type:
            device = home  # loaded with map_location: follow the model
        make = torch.rand if dtype.is_floating_point else torch.zeros
        args.append(make(shape, dtype=dtype, device=device))
    return optimize(model, tuple(args), precision)


def _share_state(gm: fx.GraphModule, model: nn.Module):
    """Make gm hold exactly the model's parameters, buffers and children: the model's own
    dictionaries (same objects, same order), so state_dict keys and tensors are the model's
    and assigning a parameter or submodule through either module changes both."""
    plain = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            atom = n.target.split(".")[0]
            if atom not in model._parameters and atom not in model._buffers and atom not in model._modules:
                plain[atom] = getattr(model, atom)
    gm.__dict__["_parameters"] = model._parameters
    gm.__dict__["_buffers"] = model._buffers
    gm.__dict__["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
    gm.__dict__["_modules"] = model._modules
    for k, v in plain.items():
        gm.__dict__[k] = v
    gm.__dict__["training"] = model.training


def _propagate(gm: fx.GraphModule, inputs: tuple, prop=None):
    """Run the traced model once on the example inputs for shapes (``prop``: the interpreter,
    InfoProp by default); undo its side effects on buffers (BatchNorm running statistics) and
    on the RNG. Returns the output."""
    saved = [(b, b.detach().clone()) for b in gm.buffers()]
    devices = sorted({t.device.index or 0 for t in list(inputs) + [p for p in gm.parameters()]
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            return (prop or InfoProp(gm)).run(
                *[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def optimize(model: nn.Module, example_inputs, precision: str = "fp32") -> nn.Module:
    """Return ``model`` with every fusable ``Linear -> stages`` chain running as one gemmfuse op.

    ``example_inputs``: a tensor or a tuple of the forward's positional arguments (used once,
    to learn shapes; the model's buffers and the RNG are left as they were).
    ``precision``: "fp32" (default, SGEMM-faithful), "fast" (split precision on tensor cores,
    within 1e-4 of float64) or "tf32".
    A model with modules ``fully_shard`` (FSDP2) was applied to is optimized unit by unit, each
    inside FSDP's hooks (fsdp.py); one that ``parallelize_module`` prepared runs its
    column-parallel chains on the local shards (tensor_parallel.py).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"gemmfuse.optimize: precision must be one of {PRECISIONS}, got {precision!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"gemmfuse.optimize expects an nn.Module, got {type(model).__name__}")
    if getattr(model, "_gemmfuse", None) is not None or isinstance(model, GemmfuseDynamoModule):
        raise ValueError("gemmfuse.optimize: this module is already optimized")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    _lib.load()
    if fsdp.has_units(model):
        return _optimize_units(model, example_inputs, precision)
    gm, why = _trace(model)
    if gm is None:
        return _through_dynamo(model, example_inputs, precision, why)
    gm = _capture(gm, model, example_inputs, precision)[0]
    _time_whole(gm, model, example_inputs)
    return gm


def _optimize_units(model: nn.Module, example_inputs: tuple, precision: str):
    """optimize() of a model with FSDP units (fsdp.py): the model's graph stops at them, each
    unit's forward is optimized inside its hooks during the example call (_build_unit), and a
    model that is a unit itself runs its graph inside its own hooks."""
    gm, why = _trace(model, fsdp.UnitTracer(model))
    if gm is None:  # dynamo runs FSDP's hooks as they are (graph breaks), and the rest fused
        return _through_dynamo(model, example_inputs, precision, why)
    units = fsdp.route_units(gm)
    if not fsdp.is_unit(model):
        gm = _capture(gm, model, example_inputs, precision, units=units)[0]
        fsdp.reshard(model)
        return gm
    hooks = fsdp.Hooks(model, "")
    made = {}

    def body(*a, **k):
        args = fsdp.positional(model, a, k)
        made["gm"], out = _capture(gm, model, args, precision, units=units)
        return out
    with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model, example_inputs)):
        hooks.run(body, tuple(example_inputs), {})
    fsdp.reshard(model)
    if "gm" not in made:  # hooks of its own besides FSDP's: dynamo runs them
        return _through_dynamo(model, example_inputs, precision, next(iter(hooks.fallbacks)))
    made["gm"].__dict__["_gemmfuse_fsdp"] = hooks
    return made["gm"]


def _build_unit(unit: "fsdp.UnitCall", args: tuple, kwargs: dict, precision: str):
    """Optimize an FSDP unit's forward on this call's arguments, inside FSDP's hooks (the
    capture reads the unsharded parameters); returns the call's output. A unit that cannot
    be captured keeps its own call, with the reason."""
    m = unit.module
    gm, why = _trace(m, fsdp.UnitTracer(m))
    if gm is None:
        unit.reason = f"torch.fx cannot trace its forward ({why}): it runs in PyTorch"
        return m(*args, **kwargs)
    units = fsdp.route_units(gm, unit.qualname + ".")
    hooks = fsdp.Hooks(m, unit.qualname)
    made = {}

    def body(*a, **k):
        made["gm"], out = _capture(gm, m, fsdp.positional(m, a, k), precision, units=units)
        return out
    out = hooks.run(body, args, kwargs)
    if "gm" in made:
        made["gm"].__dict__["_gemmfuse_fsdp"] = hooks
        unit.opt = made["gm"]
    else:
        unit.reason = next(iter(hooks.fallbacks))
    return out


def _cuda_devices(model: nn.Module, example_inputs: tuple) -> list:
    """The CUDA devices the model's parameters and the inputs are on (for fork_rng)."""
    return sorted({t.device.index or 0 for t in list(example_inputs) + list(model.parameters())
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda"})


def _whole_timed_device(opt: nn.Module, model: nn.Module, example_inputs: tuple):
    """The device the whole module is timed on, or None where it is not timed: inputs on
    several devices, timing off there, GEMMFUSE_ALWAYS_FUSE, several ranks, no chain or LM
    head fused (a dynamo-captured module may run a reused graph, with no report of its own:
    timed), tensor-parallel parameters."""
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor)}
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    if not route_timer.whole_timed_on(device) or always_fuse() or measure.distributed():
        return None
    if isinstance(opt, GemmfuseModule) and not runtimes(opt):
        rep = getattr(opt, "_gemmfuse", None)
        if rep is None or not (rep.fused_lm_heads() or rep.fused_attention()):
            return None
    return None if tensor_parallel.has_dtensor_params(model) else device


def _time_whole(opt: nn.Module, model: nn.Module, example_inputs: tuple) -> None:
    """Time the optimized module against the model as it is on the example inputs, the forward
    under no_grad and, for a model in training mode with parameters that require grad, the
    forward and backward; in a mode where the model is faster, calls run the model itself
    (_eager_call; GemmfuseDynamoModule's forward), and explain shows both times. Chains can
    each be faster alone and the whole slower (host time per call). The model's state and
    the RNG are left as they were; a timing that fails leaves the module fused."""
    device = _whole_timed_device(opt, model, example_inputs)
    if device is None:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    before = ModuleState(model)
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    eager, texts = set(), []
    def from_the_start(fn):  # each timed call starts from the model's state (state on self)
        return lambda *args: (before.restore(), fn(*args))[1]
    try:
        for mode in ("forward", "train") if model.training and params else ("forward",):
            choice = measure.whole_choice(from_the_start(opt), from_the_start(model),
                                          list(example_inputs), mode == "train", device,
                                          "PyTorch", leaves=params if mode == "train" else ())
            texts.append(choice.whole_text())
            if not choice.fused:
                eager.add(mode)
    except Exception as e:  # noqa: BLE001 - timing is advice: the fused module stays
        texts.append(f"whole-module timing failed ({type(e).__name__}: {e}"[:200] + "); fused")
    finally:
        before.restore()
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
    opt.__dict__["_gemmfuse_whole"] = "; ".join(texts)
    if eager:
        opt.__dict__["_gemmfuse_eager"] = frozenset(eager)
        if isinstance(opt, GemmfuseModule):
            _install_call(opt)


def _trace(model: nn.Module, tracer=None):
    """(the model traced by torch.fx, sharing its state, "") or (None, why not: a tracing
    error, or a forward that assigns to its module)."""
    before = ModuleState(model)
    try:
        tracer = tracer or fx.Tracer()
        graph = tracer.trace(model)
        gm = GemmfuseModule(tracer.root, graph, model.__class__.__name__)
    except Exception as e:  # noqa: BLE001 - any tracing failure: capture through dynamo
        before.restore()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    assigned = before.changed()
    before.restore()
    if assigned:  # state kept on self: torch.fx would bake one call's value into the graph
        return None, ("the forward assigns to " + ", ".join(assigned[:4])
                      + (" ..." if len(assigned) > 4 else ""))
    _share_state(gm, model)
    return gm, ""


def _capture(gm: GemmfuseModule, model: nn.Module, example_inputs: tuple, precision: str,
             units=None):
    """Run the traced graph on the example inputs, replace every chain the planner takes by
    a _run_chain call, and make gm the optimized module. ``units``: the FSDP units gm calls
    (a list, possibly empty, inside an FSDP model: fsdp.py), built during that run.
    Returns (gm, the example call's output)."""
    # FSDP swaps parameters in and out of the modules during the run: they are its to restore
    before = ModuleState(model, skip=("_parameters",) if units is not None else ())
    prop = fsdp.UnitProp(gm, precision, _build_unit) if units is not None else None
    out = _propagate(gm, example_inputs, prop)
    before.restore()  # the example call's own assignments, if any
    report = OptimizeReport(precision=precision, flavor="fx")
    report.units = list(units or ())
    fuse_lm_heads(gm, precision, report)  # first: the chain finder must not see their Linears
    fuse_attention(gm, precision, report)
    cap: CaptureReport = find_chains(gm, "fx", check=_lib.check)
    report.rejected += cap.rejected
    fuse_products(gm, precision, report, cap.products)
    remap: dict = {}
    for chain in cap.chains:
        entry = _fuse_chain(gm, chain, precision, remap)
        report.entries.append(entry)
    gm.recompile()
    d = gm.__dict__  # plain entries: nn.Module.__setattr__ would register the model as a child
    d["_gemmfuse"] = report
    _bind(gm)
    d["_gemmfuse_source"] = model
    d["_gemmfuse_examples"] = [_example_record(v) for v in example_inputs]
    d["_gemmfuse_watch"] = AttributeWatch(model)
    if units is None:  # a unit's calls must go through its hooks (GemmfuseModule.__call__)
        direct.install(gm, _run_chain)
    return gm, out


def _fuse_chain(gm: GemmfuseModule, chain, precision: str, remap: dict) -> ChainEntry:
    """Plan one chain on the example shapes and, where the planner takes it, rewrite it into
    a _run_chain call; the report's entry for it."""
    flags = tuple(bool(gm.get_submodule(q).training) for q in chain.mode_modules)
    spec = chain.spec(flags)
    entry = ChainEntry(index=chain.index, linear=chain.linear.name,
                       nodes=chain.describe_nodes(), stop=chain.stop, form=chain.form, spec=spec,
                       status="pytorch", mode_modules=list(chain.mode_modules))
    why = capture_reason(gm, chain)
    if why:  # a tensor-parallel Linear whose chain cannot run on its local shard
        entry.reason = why
        return entry
    try:
        x = example_tensor(gm, chain.x)
        w = tensor_parallel.local(example_tensor(gm, chain.weight))
        w = w.t().contiguous() if chain.weight_kn else w
        b = tensor_parallel.local(example_tensor(gm, chain.bias)) if chain.bias is not None else None
        ops = [example_tensor(gm, s) for s in chain.operands]
        st = [example_tensor(gm, s) for s in chain.state]
        entry.example = {"x": list(x.shape), "operands": [list(t.shape) for t in ops]}
        ops = [t.to(x.dtype) if t.dtype != x.dtype else t for t in ops]
        entry.plan = _lib.describe(spec, x, w, b, ops, st, precision)
    except (RuntimeError, ValueError, AttributeError, TypeError) as e:
        entry.reason = (_lib.unsupported_reason(e) if _lib.is_unsupported(e)
                        else f"describe failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return entry
    attr = f"_gemmfuse_chain_{chain.index}"
    rewrite_chain(gm, chain, precision, remap, attr, rooted=True)
    entry.status = "fused"
    entry.attr = attr
    return entry


def _through_dynamo(model: nn.Module, example_inputs: tuple, precision: str, why: str):
    """The model captured through dynamo (torch.fx could not trace it: `why`), compiled once
    on the example inputs with its buffers and the RNG left as they were."""
    opt = GemmfuseDynamoModule(model, precision, [_example_record(v) for v in example_inputs], why,
                               rebuild=_unpickle)
    sharded = fsdp.has_units(model)  # FSDP2 swaps parameters itself, and reshards below
    before = ModuleState(model, skip=("_parameters",) if sharded else ())
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model, example_inputs)):
            opt(*[t.clone() if isinstance(t, torch.Tensor) else t for t in example_inputs])
    finally:
        before.restore()
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
    if sharded:
        fsdp.reshard(model)
    else:
        _time_whole(opt, model, example_inputs)
    return opt


def runtimes(module: nn.Module) -> list:
    """The ChainRuntime objects of an optimized module, by chain index; of a module compiled
    with backend="gemmfuse", those of every graph compiled for it (reports.compiled_graphs)."""
    rep = getattr(module, "_gemmfuse", None)
    if rep is None:
        return [rt for gm in compiled_graphs(module) for rt in runtimes(gm)]
    own = [getattr(module, e.attr) for e in rep.entries if e.attr]
    return own + [rt for u in rep.units if u.opt is not None for rt in runtimes(u.opt)]


def fused_calls(module: nn.Module) -> int:
    """How many fused calls an optimized or compiled module has issued: its chain runtimes'
    counts, and for chains compiled into Inductor graphs the op's own count of their specs
    (process-wide: chains of the same spec elsewhere count too)."""
    rep = getattr(module, "_gemmfuse", None)
    if rep is None:  # each spec once: graphs compiled again for new guards share them
        graphs = compiled_graphs(module)
        specs = {e.spec for gm in graphs if gm._gemmfuse.flavor == "inductor"
                 for e in gm._gemmfuse.entries if e.status == "fused"}
        return (sum(sum(torch.ops.gemmfuse.calls(s)) for s in specs)
                + sum(fused_calls(gm) for gm in graphs if gm._gemmfuse.flavor != "inductor"))
    if rep.flavor == "inductor":
        return sum(sum(torch.ops.gemmfuse.calls(e.spec)) for e in rep.entries if e.status == "fused")
    return sum(rt.fused_calls for rt in runtimes(module))


def weights_changed(module: nn.Module) -> None:
    """Tell gemmfuse that ``module``'s parameters or buffers were written behind autograd's back
    (``p.data.copy_(...)`` and other writes through ``.data`` do not bump ``_version``, which
    the C++ preparation cache keys on; torch.optim steps, fused ones too, are seen without this).
    Bumps every version counter, so prepared weights (column sums, folded BatchNorm,
    split-precision parts) are rebuilt on the next call."""
    # FSDP2's unsharded parameters keep their versions across all-gathers (fsdp.py)
    for t in list(module.parameters()) + list(module.buffers()) + fsdp.unsharded_params(module):
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)

"""``torch.compile(model, backend="gemmfuse")``: the chains of dynamo's graph become the fused
op, and Inductor compiles the rest of the graph, forward and (through AOTAutograd) backward.

Dynamo hands the backend a GraphModule whose modules are inlined (``F.linear``,
``F.batch_norm(..., training, momentum, eps)``, ``F.group_norm``, ...) and whose parameters and
buffers arrive as placeholders. The backend captures the chains of that graph (capture/,
"dynamo" flavour) and, for each, makes the measured choice (measure.py) between the fused op
and Inductor's own lowering of the chain's nodes; a chain it fuses becomes one
``gemmfuse::run`` node, an opaque op with a fake kernel and a C++ autograd node, which Inductor
calls as it is. Before that, each LM head (a Linear whose logits only feed a cross-entropy
loss: capture/lm_head.py, as optimize() finds them) becomes one
``gemmfuse.lm_head.linear_cross_entropy`` call, which AOTAutograd traces. Then the graph goes
to Inductor with the user's mode and options, so ``mode="reduce-overhead"`` (CUDA graphs) and
``"max-autotune"`` apply to the rest.

Options (``torch.compile(m, backend="gemmfuse", options={...})``):
  ``precision``  "fp32" (default), "fast" or "tf32";
  ``inductor``   False: the rest of the graph runs as PyTorch ops, each chain behind a
                 ChainRuntime that checks every call (optimize()'s capture through dynamo);
  anything else  an Inductor option, as for the default backend.
torch.compile takes either `mode` or `options`, not both: ``gemmfuse.compiler(precision=...)``
gives a backend with the precision built in, to use with any `mode`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import weakref

import torch
import torch.fx as fx
import torch.nn as nn

from . import _lib, measure
from .capture import AttrRef, compile_time_numbers, find_chains, node_info, source_key, TInfo
from .capture.find import _attr_tensor
from .rewrite import (chain_sources, chain_subgraph, fuse_attention, fuse_lm_heads,
                      fuse_products, resolve, rewrite_chain, rewrite_chain_as_op)
from .runtime import PRECISIONS, always_fuse, op_arguments
from .reports import ChainEntry, OptimizeReport, param_signature, remember

BACKEND_NAME = "gemmfuse"


def gemmfuse_backend(gm: fx.GraphModule, example_inputs, options=None, mode=None, **_):
    options = dict(options or {})
    precision = options.pop("precision", "fp32")
    inductor = options.pop("inductor", True)
    if precision not in PRECISIONS:
        raise ValueError(f"gemmfuse backend: precision must be one of {PRECISIONS}, got {precision!r}")
    report = OptimizeReport(precision=precision, flavor="inductor" if inductor else "dynamo")
    report.params = [weakref.ref(t) for t in list(example_inputs) + list(gm.parameters())
                     if isinstance(t, nn.Parameter)]
    report.param_sig = param_signature(gm, example_inputs)
    report.backend_id = str(getattr(gm, "meta", {}).get("backend_id", ""))
    remember(report)
    rest = functools.partial(_inductor, mode=mode, options=options) if inductor else None
    original = _graph_copy(gm) if inductor and _whole_timed(gm, example_inputs, mode, options) else None
    if not _lib.available():
        report.rejected.append(("*", "the gemmfuse operator library is not available"))
    else:
        fuse_lm_heads(gm, precision, report)  # first: the chain finder must not see their Linears
        fuse_attention(gm, precision, report, example_inputs)
        if inductor:
            _fuse_for_inductor(gm, example_inputs, precision, report, rest)
        else:
            _fuse_with_runtimes(gm, example_inputs, precision, report)
    if rest is None:
        gm._gemmfuse = report
        report.graph = weakref.ref(gm)
        return gm.forward
    if original is not None and _fused_work(report):
        compiled = _faster_whole(gm, original, example_inputs, rest, report)
    else:
        compiled = rest(gm, example_inputs)
    # Inductor keeps no reference to the graph; the report does, for explain (set after
    # compiling: Inductor's cache key pickles the graph module, and this is a cycle).
    gm._gemmfuse = report
    report.graph = _Held(gm)
    return compiled


def _whole_timed(gm, example_inputs, mode, options) -> bool:
    """Whether the whole graph is timed fused against Inductor alone: where timing is on for
    its device, and not under CUDA graphs (reduce-overhead, max-autotune): a graph replay has
    no host time to lose, and timing calls would record graphs during compilation."""
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or not measure.route_timer.whole_timed_on(next(iter(devices))):
        return False
    if any(isinstance(t, (torch._subclasses.FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool))
           for t in example_inputs):
        return False  # no real values to time with
    cudagraphs = (mode in ("reduce-overhead", "max-autotune")
                  or bool((options or {}).get("triton.cudagraphs")))
    return not cudagraphs and not always_fuse() and not measure.distributed()


def _fused_work(report) -> list:
    """The chains, LM heads, attention calls and products the graph runs on gemmfuse (what the
    whole-graph timing weighs)."""
    return ([e for e in report.entries if e.status == "fused"] + report.fused_lm_heads()
            + report.fused_attention() + [p for p in report.products if p.status == "fused"])


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with a copy of its graph (the same attributes: no parameter is copied)."""
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _faster_whole(gm, original, example_inputs, rest, report):
    """Inductor's compilation of the graph with the fused chains, or of the original graph
    where that is faster as a whole (timed once, the forward or the forward and backward as
    the graph will run); the report records both times."""
    training = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        fused = rest(gm, example_inputs)
        with _separate_compilation():
            own = rest(original, list(example_inputs))
    device = next(t.device for t in example_inputs if isinstance(t, torch.Tensor))
    choice = measure.whole_choice(fused, own, list(example_inputs), training, device, "Inductor")
    report.whole = choice.whole_text()
    if choice.fused:
        return fused
    for e in _fused_work(report):
        e.status, e.reason = "pytorch", "the whole graph runs faster without fused chains"
    return own


class _Held:
    """A strong reference with a weakref's call: the report's graph under Inductor."""

    def __init__(self, gm):
        self.gm = gm

    def __call__(self):
        return self.gm


def _inductor(gm, example_inputs, mode=None, options=None):
    """Inductor, with the user's mode and options, as torch.compile's default backend."""
    return torch._TorchCompileInductorWrapper(mode, options or None, None)(gm, example_inputs)


def _entry(chain, spec) -> ChainEntry:
    return ChainEntry(index=chain.index, linear=chain.linear.name, nodes=chain.describe_nodes(),
                      stop=chain.stop, form=chain.form, spec=spec, status="pytorch")


def _fuse_with_runtimes(gm, example_inputs, precision, report):
    """Each chain behind a ChainRuntime (checks, timed routes and fallbacks per call)."""
    cap = find_chains(gm, "dynamo", check=_lib.check,
                      numbers=compile_time_numbers(gm, example_inputs))
    report.rejected += cap.rejected  # after the LM heads' (fuse_lm_heads)
    fuse_products(gm, precision, report, cap.products)
    remap: dict = {}
    for chain in cap.chains:
        entry = _entry(chain, chain.spec(()))
        report.entries.append(entry)
        attr = f"_gemmfuse_chain_{chain.index}"
        rewrite_chain(gm, chain, precision, remap, attr)
        entry.status, entry.attr = "fused", attr
    if report.entries:
        gm.recompile()


def _fuse_for_inductor(gm, example_inputs, precision, report, rest):
    """Each chain the planner takes and the measurement favours becomes a gemmfuse::run node.
    Numbers the graph passes at run time are not captured as constants (numbers=None): a
    compiled graph cannot fall back per call, so a chain stops before such a number."""
    cap = find_chains(gm, "dynamo", check=_lib.check)
    report.rejected += cap.rejected  # after the LM heads' (fuse_lm_heads)
    fuse_products(gm, precision, report, cap.products)
    real = {n: v for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs)}
    training = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
    remap: dict = {}
    for chain in cap.chains:
        spec = chain.one_line_spec(())
        entry = _entry(chain, spec)
        report.entries.append(entry)
        try:
            why = _why_not(gm, chain, spec, precision, real, training, remap, entry, rest)
        except Exception as e:  # noqa: BLE001 - never an error where Inductor alone works
            why = f"left to Inductor after an error while choosing: {type(e).__name__}: {e}"[:400]
        if why:
            entry.reason = why
            continue
        rewrite_chain_as_op(gm, chain, spec, precision, remap)
        entry.status = "fused"
    if any(e.status == "fused" for e in report.entries):
        gm.recompile()


def _why_not(gm, chain, spec, precision, real, training, remap, entry, rest) -> str:
    """'' where the chain runs fused, else why Inductor runs it. Fills entry.plan and
    entry.choice."""
    lin, xin = node_info(chain.linear), node_info(chain.x)
    if not isinstance(lin, TInfo) or not isinstance(xin, TInfo) or lin.dtype != xin.dtype:
        return ("autocast: the Linear computes in another dtype than its input's; Inductor "
                "runs the chain in the dtypes autocast gives it")
    if any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return "autocast is on: Inductor runs the chain in the dtypes autocast gives it"
    sources, index = chain_sources(chain, remap)
    try:
        inputs = [_example(gm, src, real, training) for src in sources]
    except _NoExample as e:
        return f"no example value for an input of the chain ({e})"
    call = _fused_call(chain, spec, precision, index, remap)
    x, w, b, ops, state = call.tensors(inputs)
    try:
        entry.plan = _lib.describe(spec, x, w, b, ops, state, precision)
        why = "" if always_fuse() else torch.ops.gemmfuse.route(spec, x, w, b, ops, state,
                                                                precision, training)
    except (RuntimeError, ValueError) as e:
        return _lib.unsupported_reason(e) if _lib.is_unsupported(e) else f"planner: {e}"
    if why:
        return f"the planner routes it to Inductor: {why}"
    if always_fuse():
        return ""
    key = (spec, precision)
    with _separate_compilation():  # Inductor compiles the chain's backward at its first call
        choice = measure.choose(key, call, lambda: _own(chain, index, remap, inputs, rest),
                                inputs, training, x.device)
    entry.choice = choice.text()
    return "" if choice.fused else f"measured: {choice.text()}"


class _NoExample(Exception):
    pass


def _example(gm, src, real, training):
    """A tensor standing in for one chain input while timing: the graph's real parameters and
    inputs (detached copies: timing must not touch the model), random values of the recorded
    shape for values the graph computes."""
    if isinstance(src, AttrRef):
        v = _attr_tensor(gm, src.qualname)
        info = None
    elif src.op == "placeholder" and src in real:
        v, info = real[src], None
    else:
        info = node_info(src)
        if not isinstance(info, TInfo):
            raise _NoExample(src.name)
        shape = [torch.fx.experimental.symbolic_shapes.size_hint(s) for s in info.shape]
        make = torch.randn if info.dtype.is_floating_point else torch.zeros
        v = make(shape, dtype=info.dtype, device=info.device)
    if not isinstance(v, torch.Tensor):
        return v
    if isinstance(v, torch._subclasses.FakeTensor):
        raise _NoExample(f"{src} is a fake tensor")
    grad = v.requires_grad if info is None else info.requires_grad
    out = v.detach().clone()
    return out.requires_grad_(training and grad and out.is_floating_point())


class _fused_call:
    """The fused op over the chain's inputs in source order (what the graph node computes)."""

    def __init__(self, chain, spec, precision, index, remap):
        self.spec, self.precision, self.kn = spec, precision, chain.weight_kn

        def at(src):
            return index[source_key(resolve(remap, src))]
        self.x, self.w = at(chain.x), at(chain.weight)
        self.b = at(chain.bias) if chain.bias is not None else None
        self.ops = [at(s) for s in chain.operands]
        self.state = [at(s) for s in chain.state]

    def tensors(self, inputs):
        return op_arguments(inputs, self.x, self.w, self.b, self.ops, self.state, self.kn)

    def __call__(self, inputs):
        return torch.ops.gemmfuse.run(self.spec, *self.tensors(inputs), self.precision)


def _own(chain, index, remap, inputs, rest):
    """Inductor's lowering of the chain's nodes alone, compiled for these inputs. Its backward
    is compiled now, not at its first call: that call comes from the autograd engine's device
    thread while this thread holds dynamo's compile lock, which a lazy backward compilation
    takes (a deadlock on CUDA)."""
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        fn = rest(chain_subgraph(chain, index, remap), list(inputs))
    return lambda args: fn(*args)


@contextlib.contextmanager
def _separate_compilation():
    """A compilation of its own inside the backend call: no tracing context and fresh
    compile metrics (dynamo's are per thread and already hold the outer compilation's)."""
    from torch._dynamo import utils as dynamo_utils
    from torch._dynamo.metrics_context import MetricsContext
    tls = dynamo_utils._metrics_context_tls
    outer = getattr(tls, "metrics_context", None)
    tls.metrics_context = MetricsContext(on_exit=lambda *a, **k: None)
    try:
        with torch._guards.tracing(None):
            yield
    finally:
        if outer is None:
            del tls.metrics_context
        else:
            tls.metrics_context = outer


def register():
    try:
        from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
    except ImportError:  # pragma: no cover - very old torch
        return
    if BACKEND_NAME not in _COMPILER_FNS:
        register_backend(gemmfuse_backend, name=BACKEND_NAME)


def compiler(precision: str = "fp32", **options):
    """A torch.compile backend with the precision (and any Inductor options) built in, for use
    with a `mode`: ``torch.compile(m, backend=gemmfuse.compiler("fast"), mode="max-autotune")``."""
    if precision not in PRECISIONS:
        raise ValueError(f"gemmfuse.compiler: precision must be one of {PRECISIONS}, got {precision!r}")

    def backend(gm, example_inputs, **kw):
        merged = dict(options, precision=precision, **(kw.get("options") or {}))
        return gemmfuse_backend(gm, example_inputs, options=merged, mode=kw.get("mode"))
    backend.__name__ = f"gemmfuse_{precision}"
    return backend

"""The runtime of one fused chain: ``ChainRuntime`` checks each call's inputs and runs the
fused op (differentiable while autograd records), or the chain's own PyTorch nodes for anything
the fused op must not see (wrong dtype, shape or device, hooks, a shape the planner refuses or
routes to PyTorch, or that timing found PyTorch faster at), so errors and results are PyTorch's
own. Every such fallback is counted with its reason
(``explain`` shows them).
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Optional

import torch
import torch.fx as fx

from . import _lib, direct, fsdp, measure, route_timer, tensor_parallel
from .direct import global_hooks
from .route_timer import always_fuse

PRECISIONS = ("fp32", "fast", "tf32")
_MISS = object()
_any_autocast = torch._C._is_any_autocast_enabled  # one call for every device type
_BN_MSG = "Expected more than 1 value per channel when training"



def autocast_on(device_type: str) -> bool:
    """Whether torch.autocast is on for tensors of this device type (cpu and cuda have it)."""
    return device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)


def _call_module(mod, *args, **kwargs):
    """The fallback graphs' stand-in for call_module: the module is an input, not an attribute."""
    return mod(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# The runtime of one chain.


_optimizer_hook = None


def _bump_versions_after_step(optimizer, args, kwargs):
    """Fused optimizers (AdamW(fused=True), apex's, ...) write parameters without bumping
    their version counters, which gemmfuse's prepared weights (split parts, column sums,
    folded BatchNorm, converted operands) key on: bump them after every optimizer step."""
    params = [p for g in optimizer.param_groups for p in g["params"] if not p.is_inference()]
    if params:
        # FSDP2's unsharded parameters keep their versions across all-gathers (fsdp.py)
        torch.autograd.graph.increment_version(params + fsdp.unsharded_after_step(optimizer, params))


def _watch_optimizer_steps():
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _optimizer_hook = register_optimizer_step_post_hook(_bump_versions_after_step)


DATA_WRITES = ("writes through .data (p.data.copy_(...), p.data.mul_(...)) bypass the version "
               "counters that prepared weights (split parts, folded BatchNorm, column sums) key on: "
               "call gemmfuse.weights_changed(module) after them; torch.optim steps, in-place ops "
               "on parameters and load_state_dict are seen")
_data_writes_warned = False


def _warn_data_writes_once():
    """Prepared weights cannot see writes through ``.data`` (detecting them would take a
    fingerprint of every weight on every call): say so once per process, when the first
    chain is fused."""
    global _data_writes_warned
    if not _data_writes_warned:
        _data_writes_warned = True
        # the caller of optimize (or of the compiled module): the first frame outside
        # gemmfuse and torch (FSDP units are built from inside torch's hooks)
        inside = (os.path.dirname(__file__), os.path.dirname(torch.__file__))
        if sys.version_info >= (3, 12):
            where = {"skip_file_prefixes": inside}
        else:
            level, f = 1, sys._getframe(0)
            while f is not None and f.f_code.co_filename.startswith(inside):
                f, level = f.f_back, level + 1
            where = {"stacklevel": level}
        warnings.warn("gemmfuse: " + DATA_WRITES, **where)


def op_arguments(inputs, x_idx, w_idx, b_idx, op_idx, st_idx, weight_kn) -> tuple:
    """(x, W, b, operands, state) for gemmfuse::run from a chain's inputs, as the backend's
    graph node gets them (rewrite.op_call): x contiguous, a weight stored [in, out]
    transposed, operands contiguous in x's dtype."""
    x = inputs[x_idx].contiguous()
    w = inputs[w_idx].t().contiguous() if weight_kn else inputs[w_idx]
    b = None if b_idx is None else inputs[b_idx]
    ops = [inputs[i].to(x.dtype).contiguous() for i in op_idx]
    return x, w, b, ops, [inputs[i] for i in st_idx]


class ChainRuntime:
    """Everything one fused chain needs at call time. Lives as a plain attribute of the
    optimized GraphModule (not a submodule: it holds no parameters and adds no state_dict
    keys); the graph passes it, and the chain's inputs, to ``_run_chain``."""

    def __init__(self, index: int, specs: dict, x_idx: int, w_idx: int, b_idx: Optional[int],
                 op_idx: list, st_idx: list, mode_idx: list, mode_names: list, precision: str,
                 fallback: fx.GraphModule, in_features: int, x_rank: Optional[int] = None,
                 guards: tuple = (), module_idx=None, weight_kn: bool = False):
        _watch_optimizer_steps()
        _warn_data_writes_once()
        self.index = index
        self.specs = specs                # training flags tuple -> spec text
        self.x_idx, self.w_idx, self.b_idx = x_idx, w_idx, b_idx
        self.op_idx, self.st_idx, self.mode_idx = list(op_idx), list(st_idx), list(mode_idx)
        self.mode_names = list(mode_names)
        # The inputs that are modules the chain replaces (the Linear, activations, norms): while
        # one of them has hooks, calls run the fallback, which calls the modules (hooks and all).
        self.module_names = dict(module_idx or {})  # input index -> the module's qualified name
        self.module_idx = tuple(self.module_names)
        self.weight_kn = weight_kn        # the weight input is stored [in, out]
        self._wt = None                   # (weight, its version, its transpose): see _weight
        self._cast = None                 # (weight, its version, dtype, its cast): autocast
        self._autocast_out = {}           # (shape, device, flags, dtype) -> eager's output dtype
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
        self.refused_train: dict = {}     # the same, for calls autograd records
        self.train_calls = 0              # fused calls autograd recorded (of fused_calls)
        # The input signatures of fused calls, latest last (explain prints the plan at each;
        # plans change with the shape). Recorded off the fast path: a new signature takes the
        # checked call.
        self.seen: dict = {}              # (shape, dtype, device, flags, autograd records) -> None
        self.timed: dict = {}             # (shape, dtype, device, flags) -> (fused ms, PyTorch ms,
        #                                   fast's own ms where fp32's kernel ran faster, else None)
        self.precision_at: dict = {}      # the same keys -> "fp32" where `fast` runs fp32's kernel
        self._warned = False
        self._fast_call = None            # _fast_path(...) of the last fused call's signature
        self._routed = None               # (shape, dtype, device, flags, reason) of the last call
        #                                   the planner routed to PyTorch
        self._routed_train = None         # the same for calls autograd records
        # The C++ binding behind the OpOverload (its __call__ only forwards to it): one Python
        # frame less per call, which matters for calls as short as m18's, bound by host work
        # (docs/measurements.md, "Floors").
        self._op = torch.ops.gemmfuse.run.default._op

    # -- pickling: the C++ binding and the per-process caches are rebuilt, not saved ----------
    _TRANSIENT = ("_op", "_fast_call", "_routed", "_routed_train", "refused", "refused_train", "_wt", "_cast",
                  "timed", "precision_at", "_root", "_paths")

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fast_call = self._routed = self._routed_train = self._wt = self._cast = None
        self.refused, self.refused_train, self.timed, self.precision_at = {}, {}, {}, {}
        _lib.load()
        self._op = torch.ops.gemmfuse.run.default._op

    # -- helpers ---------------------------------------------------------------------------
    # Parameters and buffers of a module that is itself an input (the Linear a chain came
    # from) are not passed by the graph: fx's generated code would read each through
    # nn.Module.__getattr__ along its whole path, a cost per level of the path
    # (docs/measurements.md, "Host cost per fused chain call"). The runtime reads them from
    # that module's dictionaries instead, as nn.Module.__getattr__ would, where the module is
    # still of the class seen at optimize time (whose class attributes did not shadow them);
    # else through getattr.
    # The modules themselves are read from the optimized module (`bind`) through their
    # dictionaries, guarded by the classes seen at bind time, for the same reason.
    owned: tuple = ()   # (input index, module input index, dict name, attribute, module class)
    rooted: tuple = ()  # (input index, qualified name) of modules read from the root
    _root = None        # weak reference to the module whose graph calls this runtime
    _paths: tuple = ()  # (input index, its dictionary path or None, qualified name)

    def bind(self, root) -> None:
        """Read the rooted modules from `root` (the optimized module; again after a deep copy
        or a new trace)."""
        self._root = weakref.ref(root)
        self._paths = tuple((i, direct.path_or_none(root, q), q) for i, q in self.rooted)

    def with_owned(self, inputs) -> list:
        if type(inputs) is not list:
            inputs = list(inputs)  # the graph's list may be immutable (fx, export)
        if self._paths:
            root = self._root()
            for i, path, q in self._paths:
                m = path.read(root) if path is not None else _MISS
                inputs[i] = root.get_submodule(q) if m is _MISS else m
        for i, mi, d, name, cls in self.owned:
            m = inputs[mi]
            v = m.__dict__[d].get(name, _MISS) if type(m) is cls else _MISS
            inputs[i] = getattr(m, name) if v is _MISS else v
        return inputs

    def _weight(self, inputs):
        """The Linear's weight as [N, K]. A weight stored [in, out] (`x @ W`) is transposed
        once per version of it and grad mode (a copy made under no_grad does not carry W's
        gradient) and the copy kept (one copy of W)."""
        w = inputs[self.w_idx]
        if not self.weight_kn:
            return w
        c, grad = self._wt, torch.is_grad_enabled()
        if c is None or c[0] is not w or c[1] != w._version or c[2] != grad:
            c = self._wt = (w, w._version, grad, w.t().contiguous())
        return c[3]

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
        return self.fallback.forward(*inputs)

    # -- the traced path (torch.compile / torch.export of the optimized module) --------------
    def traced(self, inputs):
        if self.owned or self._paths:
            inputs = self.with_owned(inputs)
        flags = tuple(bool(inputs[i].training) for i in self.mode_idx)
        args = op_arguments(inputs, self.x_idx, self.w_idx, self.b_idx, self.op_idx,
                            self.st_idx, self.weight_kn)  # traced values: nothing to cache
        return torch.ops.gemmfuse.run(self.specs[flags], *args, self.precision)

    # -- the eager path ------------------------------------------------------------------------
    def __call__(self, inputs):
        # Fast path: the same input signature, modes and autograd state as the last fused
        # call. Skips the checks below; what could still differ (an operand moved or cast) the
        # C++ op checks itself and raises PyTorch's own error for. gemmfuse::run records its
        # own autograd node (C++) where an input requires grad.
        if self.owned or self._paths:
            inputs = self.with_owned(inputs)
        fast = self._fast_call
        if fast is not None:
            out = fast(inputs)
            if out is not _MISS:
                return out
        # A signature routed to PyTorch: while autograd records, the weight requiring grad makes
        # the call one that records (the planner's routes differ for those).
        recording = torch.is_grad_enabled()
        if recording and inputs[self.w_idx].requires_grad:
            routed = self._routed_train
        else:
            routed, recording = self._routed, False
        if routed is not None and self._same_signature(inputs[self.x_idx], inputs, routed, recording):
            self.fallbacks[routed[4]] += 1
            return self.fallback.forward(*inputs)
        return self._checked_call(inputs)

    def _autocast_call(self, inputs, x):
        """Under torch.autocast eager runs the Linear in the autocast dtype and each later op
        in the dtype autocast and type promotion give it. On CUDA, with a 16-bit autocast dtype
        and an fp32 model, where eager returns that dtype, the chain runs fused as a model of
        that dtype (x, W and b cast; W's cast kept per version of W); the first call at a shape
        learns eager's output dtype by running the chain in PyTorch. Elsewhere (and where the
        last op returns fp32, as softmax and the norms do under autocast) the chain runs in
        PyTorch, under the same autocast."""
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev)
        w = inputs[self.w_idx]
        b = None if self.b_idx is None else inputs[self.b_idx]
        if (dev != "cuda" or dt not in (torch.float16, torch.bfloat16) or x.dtype != torch.float32
                or w.dtype != torch.float32 or (torch.is_grad_enabled() and w.requires_grad)):
            return self._pytorch(inputs, f"autocast to {dt} on {dev}: the chain runs in PyTorch")
        key = (tuple(x.shape), x.device, self.flags(inputs), dt)
        out_dtype = self._autocast_out.get(key)
        if out_dtype is None:  # eager's own result, and its dtype for the calls after it
            out = self._pytorch(inputs, f"autocast to {dt}: the first call at this shape learns "
                                        f"eager's output dtype")
            self._autocast_out[key] = out.dtype
            return out
        if out_dtype != dt:  # the chain ends in an op autocast runs in fp32 (softmax, norms,
            # reductions): a 16-bit fused chain would round its output, so PyTorch runs it
            return self._pytorch(inputs, f"autocast to {dt}: the chain's last op returns "
                                         f"{out_dtype}, which the fused op does not write")
        c = self._cast
        if c is None or c[0] is not w or c[1] != w._version or c[2] != dt:
            c = self._cast = (w, w._version, dt, w.detach().to(dt))
        cast = list(inputs)
        cast[self.x_idx], cast[self.w_idx] = x.to(dt), c[3]
        if b is not None:
            cast[self.b_idx] = b.detach().to(dt)
        with torch.autocast(dev, enabled=False):
            return self._checked_call(cast)

    def _same_signature(self, x, inputs, sig, recording=False) -> bool:
        """Whether a call has the signature (shape, dtype, device, training flags) of `sig`,
        autograd recording or not as `recording` says, and its guarded numbers unchanged."""
        return (type(x) is torch.Tensor and x.shape == sig[0] and x.dtype == sig[1]
                and x.device == sig[2] and torch.is_grad_enabled() == recording
                and not _any_autocast()
                and (not self.mode_idx or self.flags(inputs) == sig[3])
                and (not self.guards or self._changed_number(inputs) is None)
                and (not self.module_idx or self._hooked(inputs) is None)
                and not global_hooks())

    @staticmethod
    def _records(x, w, b, ops) -> bool:
        """Whether autograd records this call (grad mode is on): an input requires grad."""
        return (w.requires_grad or x.requires_grad or (b is not None and b.requires_grad)
                or any(t.requires_grad for t in ops))

    def _hooked(self, inputs, skip=None):
        """The input index of the first module of the chain (but `skip`) with a forward or
        backward hook, or None."""
        for i in self.module_idx:
            if i == skip:
                continue
            m = inputs[i].__dict__
            if (m.get("_forward_hooks") or m.get("_forward_pre_hooks")
                    or m.get("_backward_hooks") or m.get("_backward_pre_hooks")):
                return i
        return None

    def _timed_route(self, key, inputs, flags, spec, x, w, b, ops, state, train) -> str:
        """At a new signature the planner would fuse: "" where the fused op is at least as fast
        as the chain's PyTorch nodes (route_timer; the forward, or while autograd records the
        forward and backward, measure.timed_ms), else why not. `fast` is timed against fp32's
        kernel too on forward calls, and runs it where it is faster (more accurate, so within
        fast's promise). Chains that update state (training BatchNorm's running statistics)
        are not timed: a timed call would update it; nor calls made while a CUDA graph is
        being captured."""
        if not route_timer.timed_routes_on(x.device) or self.bn_training[flags]:
            return ""
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return ""  # timing synchronizes, which a CUDA graph capture forbids: fused, untimed
        leaves = measure.grad_leaves([x, w, b, *ops]) if train else []

        def fused(precision):
            return measure.timed_ms(
                lambda: torch.ops.gemmfuse.run(spec, x, w, b, ops, state, precision), leaves, x.device)
        fused_ms, own_ms = fused(self.precision), None
        if self.precision == "fast" and not train:
            fp32_ms = fused("fp32")
            if fp32_ms < fused_ms:
                self.precision_at[key] = "fp32"
                fused_ms, own_ms = fp32_ms, fused_ms
        eager_ms = measure.timed_ms(lambda: self.fallback.forward(*inputs), leaves, x.device)
        self.timed[key + (train,)] = (fused_ms, eager_ms, own_ms)
        if fused_ms <= eager_ms:
            return ""
        what = "forward and backward" if train else "forward"
        return f"{what} timed once: PyTorch {eager_ms:.4g} ms, fused {fused_ms:.4g} ms"

    def _route(self, key, inputs, flags, spec, x, w, b, ops, state, train, timed=True) -> str:
        """At a new signature, the planner's word and then the timer's: "" where the chain
        runs fused, else why PyTorch runs it (recorded, so the signature's later calls take
        the routed path)."""
        why = torch.ops.gemmfuse.route(spec, x, w, b, ops, state, self.precision, train)
        if not why and timed:
            why = self._timed_route(key, inputs, flags, spec, x, w, b, ops, state, train)
        if not why:
            return ""
        reason = f"PyTorch is faster at shape {list(x.shape)} on {x.device.type}: {why}"
        if train:
            self.refused_train[key] = reason
            if w.requires_grad:
                self._routed_train = key + (reason,)
        else:
            self.refused[key] = reason
            self._routed = key + (reason,)
        return reason

    def _tensor_idx(self) -> tuple:
        """The inputs that are the fused op's tensors: x, W, b, operands, state."""
        b = () if self.b_idx is None else (self.b_idx,)
        return (self.x_idx, self.w_idx) + b + tuple(self.op_idx) + tuple(self.st_idx)

    def _distributed_call(self, inputs):
        """A chain over DTensors (a tensor-parallel Linear): fused on the local shards where
        that is what the parallel style computes (tensor_parallel.py), else in PyTorch, which
        runs the module's hooks and the DTensor ops."""
        x = inputs[self.x_idx]
        if isinstance(x, torch.Tensor) and autocast_on(x.device.type):
            return self._pytorch(inputs, "autocast with DTensor parameters: the chain runs in PyTorch")
        local, why, finish = tensor_parallel.local_inputs(self, inputs)
        if why:
            return self._pytorch(inputs, why)
        return self._checked_call(inputs, local, finish)

    def _checked_call(self, inputs, local=None, finish=None):
        """Checks, then the fused op. ``local``: the inputs the fused op reads instead of
        ``inputs`` (a tensor-parallel Linear's local shards); fallbacks run ``inputs``, through
        the Linear's hooks. ``finish``: what makes the output from the fused op's (a
        row-parallel Linear's all-reduce and bias)."""
        src = inputs if local is None else local
        if local is None and any(tensor_parallel.is_dtensor(src[i]) for i in self._tensor_idx()):
            return self._distributed_call(inputs)
        x = src[self.x_idx]
        w = self._weight(src)
        b = None if self.b_idx is None else src[self.b_idx]
        if not isinstance(x, torch.Tensor):
            return self._pytorch(inputs, "the input is not a tensor")
        if autocast_on(x.device.type):
            return self._autocast_call(inputs, x)
        why = self._input_reason(inputs, x, w, local)
        if why:
            return self._pytorch(inputs, why)
        flags = tuple(bool(inputs[i].training) for i in self.mode_idx)
        ops, state, why = self._operands(src, x, b)
        if why:
            return self._pytorch(inputs, why)
        return self._fused_call(inputs, local, flags, x, w, b, ops, state, finish)

    def _input_reason(self, inputs, x, w, local) -> str:
        """Why the call's input, hooks or numbers send it to PyTorch ('' where none does);
        raises PyTorch's error for an input on another device than the weight."""
        if x.device != w.device:
            raise RuntimeError(
                f"gemmfuse: Expected all tensors to be on the same device, but the input is on "
                f"{x.device} and the Linear weight on {w.device} (chain {self.index}); move the "
                f"input or the model with .to(device)")
        if x.dtype != w.dtype or not x.is_floating_point():
            return f"input dtype {x.dtype} != weight dtype {w.dtype}"
        skip = None if local is None else self.linear_idx  # its hooks: what `local` did
        hooked = self._hooked(inputs, skip) if self.module_idx else None
        if hooked is not None or global_hooks():
            what = (f"module '{self.module_names[hooked]}'" if hooked is not None
                    else "every module (global hooks)")
            return f"hooks on the {what}: the chain runs in PyTorch so that they run"
        changed = self._changed_number(inputs) if self.guards else None
        if changed is not None:
            return f"{changed} differs from its value at compile time, which the fused chain holds"
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            return f"input shape {list(x.shape)} does not end in {self.in_features}"
        if self.x_rank is not None and x.dim() != self.x_rank:
            return (f"input rank {x.dim()} differs from the example's {self.x_rank} (dims were "
                    f"resolved for it)")
        return ""

    def _fused_call(self, inputs, local, flags, x, w, b, ops, state, finish=None):
        """The fused op for checked inputs, where the planner's and the timer's routes (once
        per signature) do not send the call to PyTorch; a call whose operands are the graph's
        own sets the fast path for its signature. A call with ``finish`` is not timed: its
        PyTorch side holds a collective, and the ranks' timing loops need not match."""
        # While autograd records and something requires grad, gemmfuse::run is the
        # differentiable op (its training plan, a C++ autograd node).
        grad_on = torch.is_grad_enabled()
        train = grad_on and self._records(x, w, b, ops)
        if x.numel() == 0 and self.bn_training[flags]:
            return self._pytorch(inputs, "empty batch with a training BatchNorm")
        key = (tuple(x.shape), x.dtype, x.device, flags)
        refused = self.refused.get(key) or (self.refused_train.get(key) if train else None)
        if refused:
            return self._pytorch(inputs, refused)
        spec = self.specs[flags]
        if not x.is_contiguous():
            x = x.contiguous()
        try:
            if key + (train,) not in self.seen and not always_fuse():
                reason = self._route(key, inputs, flags, spec, x, w, b, ops, state, train,
                                     timed=finish is None)
                if reason:
                    return self._pytorch(inputs, reason)
            # `fast` may run fp32's kernel where it was timed faster (forward calls only)
            precision = self.precision if train else self.precision_at.get(key, self.precision)
            out = torch.ops.gemmfuse.run(spec, x, w, b, ops, state, precision)
        except (RuntimeError, ValueError) as e:
            return self._op_error(e, inputs, key, flags, train)
        if finish is not None:
            out = finish(out)
        self.fused_calls += 1
        self.train_calls += train
        self._saw(key + (train,))
        if (local is None and all(o is inputs[i] for o, i in zip(ops, self.op_idx))
                and all(t is inputs[i] for t, i in zip(state, self.st_idx))):
            self._fast_call = self._fast_path(
                (x.shape, x.dtype, x.device, flags, spec, precision, grad_on, train))
        return out

    def _fast_path(self, fast):
        """The call for inputs of the last fused call's signature (`fast`: shape, dtype, device,
        training flags, spec, precision, grad mode, autograd records), as a closure over
        everything fixed: it skips the checks of _checked_call and returns _MISS where the
        signature differs. What could still differ (an operand moved or cast) the C++ op
        checks itself and raises PyTorch's own error for; gemmfuse::run records its own
        autograd node (C++) where an input requires grad."""
        shape, dtype, device, flags, spec, precision, grad_on, train = fast
        x_idx, w_idx, b_idx, op_idx, st_idx = self.x_idx, self.w_idx, self.b_idx, self.op_idx, self.st_idx
        kn, op, records = self.weight_kn, self._op, self._records
        grad_enabled, tensor = torch.is_grad_enabled, torch.Tensor
        # the checks only some chains need: training flags, guarded numbers, hooked modules
        extra = tuple(check for needed, check in (
            (self.mode_idx, lambda inputs: self.flags(inputs) == flags),
            (self.guards, lambda inputs: self._changed_number(inputs) is None),
            (self.module_idx, lambda inputs: self._hooked(inputs) is None)) if needed)

        def call(inputs):
            x = inputs[x_idx]
            if not (type(x) is tensor and x.shape == shape and x.dtype == dtype
                    and x.device == device and grad_enabled() == grad_on and not _any_autocast()
                    and not global_hooks()):
                return _MISS
            # (a loop: a generator costs more per call; docs/measurements.md,
            # "Host cost per fused chain call")
            for check in extra:
                if not check(inputs):
                    return _MISS
            b = None if b_idx is None else inputs[b_idx]
            w = self._weight(inputs) if kn else inputs[w_idx]
            ops = [inputs[i] for i in op_idx] if op_idx else ()  # (): no allocation
            if grad_on and records(x, w, b, ops) != train:
                return _MISS
            out = op(spec, x if x.is_contiguous() else x.contiguous(), w, b, ops,
                     [inputs[i] for i in st_idx] if st_idx else (), precision)
            self.fused_calls += 1
            self.train_calls += train
            return out
        return call


    def _operands(self, src, x, b):
        """(operands as the fused op reads them: on x's device, in its dtype, contiguous;
        the state tensors; '' or why the call runs in PyTorch instead)."""
        ops, state = [], []
        for i in self.op_idx:
            t = src[i]
            if not isinstance(t, torch.Tensor):
                return ops, state, "an operand is not a tensor"
            if t.device != x.device:
                if t.dim() == 0 and t.device.type == "cpu":
                    t = t.to(x.device)
                else:
                    return ops, state, f"operand on {t.device}, input on {x.device}"
            if t.dtype != x.dtype:
                t = t.to(x.dtype)
            ops.append(t.contiguous())
        for i in self.st_idx:
            t = src[i]
            if t.device != x.device or not t.is_contiguous():
                return ops, state, f"state tensor on {t.device} or not contiguous"
            state.append(t)
        if b is not None and (b.device != x.device or b.dtype != x.dtype):
            return ops, state, "bias device/dtype differs from the input's"
        return ops, state, ""

    def _op_error(self, e, inputs, key, flags, train):
        """The fused op raised `e`: a shape the planner or the backward refuses runs in
        PyTorch from now on (remembered per signature); other errors are PyTorch's own."""
        x_shape, dev = list(key[0]), key[2].type
        if _lib.is_unsupported(e) and train:
            reason = (f"autograd records: no fused backward at shape {x_shape} on "
                      f"{dev}: {_lib.unsupported_reason(e)}")
            self.refused_train[key] = reason
            if not self._warned:
                self._warned = True
                warnings.warn(f"gemmfuse: {reason}; the chain runs in PyTorch while autograd "
                              f"records", stacklevel=4)
            return self._pytorch(inputs, reason)
        if _lib.is_unsupported(e):
            reason = f"planner refused shape {x_shape} flags {flags}: {_lib.unsupported_reason(e)}"
            self.refused[key] = reason
            return self._pytorch(inputs, reason)
        if _BN_MSG in str(e):
            # PyTorch raises ValueError here; let the original nodes raise it verbatim.
            self._record("training BatchNorm with one value per channel")
            self.fallback.forward(*inputs)  # PyTorch raises its own ValueError here, verbatim
            raise ValueError(str(e).splitlines()[0]) from None
        raise e


def _run_chain(rt: ChainRuntime, inputs: list):
    """The call_function target that replaces a chain in the graph."""
    if torch.compiler.is_compiling():
        return rt.traced(inputs)
    return rt(inputs)

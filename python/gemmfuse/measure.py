"""The measured choice between a chain's fused op and its own lowering (Inductor's under the
torch.compile backend), made once per chain signature at compile time, as Inductor's
autotuning chooses among its templates: both are timed on random inputs of the graph's shapes
(with the graph's real parameters), the forward alone for graphs that run under no_grad, the
forward and backward for graphs autograd records, and the faster is kept. The result, with
both times, goes into the report that ``explain`` prints.

Timing uses ``route_timer.timer`` (tests replace it) and is on where
``route_timer.timed_routes_on`` says (CUDA by default): elsewhere the chain is fused without
timing and the choice says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import route_timer


@dataclass(frozen=True)
class Choice:
    fused: bool
    what: str                      # "forward" | "forward+backward"
    fused_ms: Optional[float] = None
    own_ms: Optional[float] = None
    reason: str = ""
    own: str = "Inductor"          # what runs where the fused op does not

    def text(self) -> str:
        if self.fused_ms is None:
            return f"fused, untimed ({self.reason})"
        verdict = "fused" if self.fused else self.own
        return (f"{verdict}: {self.what} timed fused {self.fused_ms:.4g} ms, {self.own} "
                f"{self.own_ms:.4g} ms")

    def whole_text(self) -> str:
        verdict = "the fused chains run" if self.fused else f"{self.own} alone runs"
        return (f"whole {self.what} timed with the fused chains {self.fused_ms:.4g} ms, "
                f"{self.own} alone {self.own_ms:.4g} ms: {verdict}")


# (spec, precision, input signature, training) -> Choice: chains repeated across layers and
# recompilations are timed once per process.
_CHOICES: dict = {}


def _signature(tensors) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else None
                 for t in tensors)


def timed_ms(fn: Callable[[], object], leaves: list, device: torch.device) -> float:
    """fn()'s time (route_timer.timer): the forward alone under no_grad where `leaves` is
    empty, else the forward and its backward to `leaves` (torch.autograd.grad from every
    output that requires grad: nothing accumulates into any .grad, so real parameters can be
    leaves)."""
    if not leaves:
        def forward():
            with torch.no_grad():
                return fn()
        return route_timer.timer(forward, device)
    with torch.no_grad():
        grads = [torch.randn_like(t) for t in _grad_outputs(fn())]
    if not grads:
        return route_timer.timer(fn, device)

    def forward_backward():
        return torch.autograd.grad(_grad_outputs(fn()), leaves, grads, allow_unused=True)
    return route_timer.timer(forward_backward, device)


def _grad_outputs(out) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.requires_grad]


def grad_leaves(tensors) -> list:
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]


def choose(key: tuple, fused: Callable, make_own: Callable[[], Callable], inputs: list,
           training: bool, device: torch.device) -> Choice:
    """Fused or own lowering for one chain: `fused(inputs)` and `make_own()(inputs)` compute
    the same value (make_own compiles, so it is called only where timing is on and the
    signature is new); `inputs` are real tensors of the graph's shapes (leaves requiring grad
    where the graph trains them)."""
    what = "forward+backward" if training else "forward"
    full = key + (_signature(inputs), training)
    if full in _CHOICES:
        return _CHOICES[full]
    if not route_timer.timed_routes_on(device):
        return Choice(True, what, reason=f"timing is off on {device.type} (GEMMFUSE_TIMED_ROUTES)")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return Choice(True, what, reason="compiled while a CUDA graph is captured")
    own = make_own()
    leaves = grad_leaves(inputs) if training else []
    fused_ms = timed_ms(lambda: fused(inputs), leaves, device)
    own_ms = timed_ms(lambda: own(inputs), leaves, device)
    choice = Choice(fused_ms <= own_ms, what, fused_ms, own_ms)
    _CHOICES[full] = choice
    return choice


def distributed() -> bool:
    """Whether this process is one of several ranks: a whole graph or module may hold
    collectives, and timing calls (as many as each rank's own timings ask for) could leave
    the ranks' collectives unmatched, so wholes are not timed there."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# The fused chains must win a whole by more than this fraction: timings of whole models on a
# GPU host vary by several percent from run to run, and within that the model as it is runs.
WHOLE_MARGIN = 0.03


def whole_choice(fused: Callable, own: Callable, args: list, training: bool,
                 device: torch.device, own_name: str, leaves=()) -> Choice:
    """Fused or own for a whole graph or module: ``fused(*args)`` against ``own(*args)``, the
    forward, or where `training` the forward and the backward to every argument that
    requires grad and to `leaves` (a module's parameters). Tensors that do not require grad
    go in as copies (a call that updates an argument in place updates the copy); the RNG is
    forked. Chains can each be faster alone and the whole slower (host time: more launches
    per chain), so the whole decides last."""
    args = [a.detach().clone() if isinstance(a, torch.Tensor) and not a.requires_grad else a
            for a in args]
    leaves = grad_leaves(args) + list(leaves) if training else []
    what = "forward+backward" if training else "forward"
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        fused_ms = timed_ms(lambda: fused(*args), leaves, device)
        own_ms = timed_ms(lambda: own(*args), leaves, device)
    return Choice(fused_ms <= own_ms * (1 - WHOLE_MARGIN), what, fused_ms, own_ms, own=own_name)

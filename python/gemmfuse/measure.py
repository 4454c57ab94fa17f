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

    def text(self) -> str:
        if self.fused_ms is None:
            return f"fused, untimed ({self.reason})"
        verdict = "fused" if self.fused else "Inductor"
        return (f"{verdict}: {self.what} timed fused {self.fused_ms:.4g} ms, Inductor "
                f"{self.own_ms:.4g} ms")


# (spec, precision, input signature, training) -> Choice: chains repeated across layers and
# recompilations are timed once per process.
_CHOICES: dict = {}


def _signature(tensors) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else None
                 for t in tensors)


def timed_ms(fn: Callable[[], torch.Tensor], leaves: list, device: torch.device) -> float:
    """fn()'s time (route_timer.timer): the forward alone under no_grad where `leaves` is
    empty, else the forward and its backward to `leaves` (torch.autograd.grad: nothing
    accumulates into any .grad, so real parameters can be leaves)."""
    if not leaves:
        def forward():
            with torch.no_grad():
                return fn()
        return route_timer.timer(forward, device)
    with torch.no_grad():
        grad = torch.randn_like(fn())

    def forward_backward():
        return torch.autograd.grad(fn(), leaves, grad, allow_unused=True)
    return route_timer.timer(forward_backward, device)


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

"""`python -m bench --host`: what a fused chain call costs the host, against a plain PyTorch op.

The model is a deep narrow MLP, 16 x (Linear(W, W) -> ReLU), at tiny shapes, where a call is
all host work: eager issues 32 ops, optimize() 16 fused chains. Per variant the wall time of
issuing one call of the model, with and without autograd recording; per chain that over 16,
and the plain op (one ``F.linear``) for scale. On CUDA the device is kept busy (a sleep
kernel ahead of each batch of calls) so that the wall clock measures issuing, not waiting;
batches are short enough for the launch queue.
"""
from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

CHAINS = 16
TARGET_US = 5.0  # issue 45: a fused chain call within 5 us of a plain op call


class NarrowMLP(nn.Module):
    def __init__(self, width: int, depth: int = CHAINS):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@dataclass
class HostTimes:
    device: str
    grad: bool
    eager_us: float
    optimized_us: float
    plain_op_us: float

    @property
    def per_chain_us(self) -> float:
        return self.optimized_us / CHAINS

    @property
    def over_plain_op_us(self) -> float:
        return self.per_chain_us - self.plain_op_us

    def row(self) -> dict:
        return {"device": self.device, "autograd": self.grad, "eager_us": self.eager_us,
                "optimized_us": self.optimized_us, "plain_op_us": self.plain_op_us,
                "per_chain_us": self.per_chain_us, "over_plain_op_us": self.over_plain_op_us,
                "eager_per_layer_us": self.eager_us / CHAINS,
                "meets_target": self.over_plain_op_us <= TARGET_US}


def issue_us(fn, device: torch.device, calls: int = 50, rounds: int = 15) -> float:
    """Median wall time of issuing one call of fn, in microseconds (warm-up first; no
    garbage collection while timed)."""
    for _ in range(20):
        fn()
    _sync(device)
    gc_on = gc.isenabled()
    gc.disable()
    try:
        per = []
        for _ in range(rounds):
            if device.type == "cuda":
                torch.cuda._sleep(20_000_000)  # keeps the GPU busy while the host issues
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t) / calls * 1e6)
            _sync(device)
    finally:
        if gc_on:
            gc.enable()
    return statistics.median(per)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, width: int = 64, batch: int = 8, grad: bool = False,
            optimize=None) -> HostTimes:
    """Host times of eager, optimize() and one plain op, with autograd recording or not."""
    import gemmfuse
    optimize = optimize or gemmfuse.optimize
    torch.manual_seed(0)
    model = NarrowMLP(width).to(device)
    x = torch.randn(batch, width, device=device)
    opt = optimize(copy.deepcopy(model), (x,))
    w, b = model.layers[0].weight, model.layers[0].bias
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        return HostTimes(device.type, grad, issue_us(lambda: model(x), device),
                         issue_us(lambda: opt(x), device),
                         issue_us(lambda: F.linear(x, w, b), device))


def run_host(devices) -> list:
    return [measure(torch.device(d), grad=g).row() for d in devices for g in (False, True)]


def table(rows) -> str:
    head = (f"{'device':6} {'autograd':8} {'eager us':>9} {'optimized us':>12} {'per chain':>9} "
            f"{'plain op':>8} {'over op':>8}  target <= {TARGET_US:g} us")
    lines = [head]
    for r in rows:
        lines.append(f"{r['device']:6} {str(r['autograd']):8} {r['eager_us']:9.1f} "
                     f"{r['optimized_us']:12.1f} {r['per_chain_us']:9.2f} {r['plain_op_us']:8.2f} "
                     f"{r['over_plain_op_us']:8.2f}  {'met' if r['meets_target'] else 'MISSED'}")
    return "\n".join(lines)


def main(device: str = "auto", out: str | None = None) -> int:
    """Measure on the CPU, and on CUDA where there is a GPU; print the table, write JSON."""
    import json
    from pathlib import Path
    devices = ["cpu"] + (["cuda"] if device in ("auto", "cuda") and torch.cuda.is_available() else [])
    if device == "cpu":
        devices = ["cpu"]
    rows = run_host(devices)
    print(table(rows), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"host": rows, "target_us": TARGET_US,
                                         "torch": torch.__version__}, indent=1))
    return 0

"""torch.compile(model, backend="gemmfuse") against gemmfuse.optimize and eager, at the seed
shape, static and with dynamic=True (float attributes then reach the graph as inputs; see
docs/design.md). Per model: every variant built, then timed in alternating rounds (the
bench's CallTimer: CUDA events, 3 input sets rotated), error against float64, and how many
calls each compiled chain ran fused or fell back to PyTorch.
Usage: python scripts/compile_backend_probe.py [--models m22,m84] [--precision fast] [--rounds 3]"""
import argparse
import copy
import statistics

import torch

import gemmfuse
from gemmfuse.bench import CallTimer, errors
from gemmfuse.models import MODELS

ap = argparse.ArgumentParser()
ap.add_argument("--models", default="m22,m84,m94,m99")
ap.add_argument("--precision", default="fast")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--repeats", type=int, default=20)
args = ap.parse_args()
dev = torch.device("cuda")
print(f"gemmfuse from {gemmfuse.__file__}; torch {torch.__version__}; {torch.cuda.get_device_name()}")

for mid in args.models.split(","):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, inputs = MODELS[mid].make(device="cuda")
    sets = [[torch.rand_like(inputs[0])] for _ in range(3)]
    # Each variant is its own copy (m84's running statistics move with every call).
    variants = {"eager": copy.deepcopy(model),
                "optimize": gemmfuse.optimize(copy.deepcopy(model), inputs, precision=args.precision)}
    opts = {"precision": args.precision}
    variants["compile"] = torch.compile(copy.deepcopy(model), backend="gemmfuse", options=opts)
    variants["compile-dynamic"] = torch.compile(copy.deepcopy(model), backend="gemmfuse",
                                                options=opts, dynamic=True)
    ref = copy.deepcopy(model).double()
    timers = {}
    with torch.no_grad():
        for name, fn in variants.items():
            err = errors(fn(*sets[0]), ref(sets[0][0].double()))
            timers[name] = (CallTimer(fn, sets, dev), err)
        for r in range(args.rounds):
            order = list(timers) if r % 2 == 0 else list(reversed(timers))
            for name in order:
                timers[name][0].round(3, args.repeats)
    base = statistics.median(timers["eager"][0].latency)
    for name, (t, err) in timers.items():
        ms = statistics.median(t.latency)
        calls = [(rt.fused_calls, dict(rt.fallbacks)) for rt in gemmfuse.runtimes(variants[name])] \
            if name != "eager" else ""
        print(f"{mid} {name:16s} {ms:8.4f} ms  {base / ms:5.2f}x eager  rel {err['rel_err']:.1e}"
              f"  rounds {' '.join(f'{v:.4f}' for v in t.round_ms)}  {calls}")

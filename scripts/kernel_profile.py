"""Where a fused call's GPU time goes: each kernel's mean time per call (torch.profiler's CUDA
activity), for seed models in one precision mode, next to eager's kernels. The times are the
kernels' own durations; launch gaps are not in them.
    PYTHONPATH=python python3 scripts/kernel_profile.py --models m84 m99 --modes bf16 fast
"""
import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import gemmfuse
from gemmfuse.models import MODELS


def kernel_times(fn, sets, calls):
    """{kernel name: (mean us per call, launches per call)} over `calls` calls."""
    for i in range(5):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            total[e.name] += e.device_time
            count[e.name] += 1
    return {k: (total[k] / calls, count[k] / calls) for k in total}


def show(title, times):
    print(f"--- {title}: {sum(t for t, _ in times.values()):8.1f} us of kernels per call")
    for name, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:8.1f} us  x{n:.0f}  {name[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["m84", "m99"])
    ap.add_argument("--modes", nargs="+", default=["bf16"])
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.no_grad():
        for mid in args.models:
            spec = MODELS[mid]
            for mode in args.modes:
                dtype = torch.bfloat16 if mode == "bf16" else torch.float32
                model, _ = spec.make(device="cuda", dtype=dtype)
                sets = [spec.cls.get_inputs(device="cuda", dtype=dtype) for _ in range(3)]
                if mode in ("bf16", "fp32"):
                    show(f"{mid} eager {mode}", kernel_times(model, sets, args.calls))
                opt = gemmfuse.optimize(model, tuple(sets[0]),
                                        precision="fp32" if mode == "bf16" else mode)
                show(f"{mid} gemmfuse {mode}", kernel_times(opt, sets, args.calls))
                del model, opt, sets
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where a fused call's GPU time goes: each kernel's mean time per call (torch.profiler's CUDA
activity), for seed models in one precision mode, next to eager's kernels. The times are the
kernels' own durations; the span printed beside their sum (first kernel's start to last
kernel's end, per call) adds the GPU's idle time between them. Kernels launched
programmatically (PDL) are shown from when their CTAs were scheduled, waiting included, and
under the profiler the span of such calls reads ~100-150 us longer than back-to-back timing
with CUDA events finds (session 22: 741.6 against ~640 us for `fast` m99): compare spans only
between builds that launch alike.
    PYTHONPATH=python python3 scripts/kernel_profile.py --models m84 m99 --modes bf16 fast
With --compile, torch.compile's kernels too (fp32 and bf16 modes).
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
    first, last = float("inf"), 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            total[e.name] += e.device_time
            count[e.name] += 1
            first = min(first, e.time_range.start)
            last = max(last, e.time_range.end)
    times = {k: (total[k] / calls, count[k] / calls) for k in total}
    # From the first kernel's start to the last one's end, per call: the kernels' time plus
    # the GPU's idle time between them (launch gaps, host stalls).
    return times, (last - first) / calls


def show(title, timed):
    times, span = timed
    print(f"--- {title}: {sum(t for t, _ in times.values()):8.1f} us of kernels per call, "
          f"{span:8.1f} us from the first kernel's start to the last one's end")
    for name, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us:8.1f} us  x{n:.0f}  {name[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["m84", "m99"])
    ap.add_argument("--modes", nargs="+", default=["bf16"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="also torch.compile's kernels")
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
                    if args.compile:
                        compiled = torch.compile(model)
                        show(f"{mid} torch.compile {mode}", kernel_times(compiled, sets, args.calls))
                        del compiled
                opt = gemmfuse.optimize(model, tuple(sets[0]),
                                        precision="fp32" if mode == "bf16" else mode)
                show(f"{mid} gemmfuse {mode}", kernel_times(opt, sets, args.calls))
                del model, opt, sets
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where a training step's GPU time goes: torch.profiler over fwd+bwd of seed models with
gemmfuse (fp32) and eager, the kernels by total CUDA time per call. Answers which of the
backward's pieces (row backward, column sums, transposes, splits, GEMMs) is worth work.
Usage: python3 -m bench.micro.train_profile [--dtype bf16] [--top 12] [m84 m94 m99 ...]
(16-bit chains train in PyTorch unless fused by force: GEMMFUSE_ALWAYS_FUSE=1.)"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import gemmfuse
from bench.models import MODELS

CALLS = 5


def profile_calls(fn, x, gy):
    for _ in range(3):
        fn(x).backward(gy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn(x).backward(gy)
        torch.cuda.synchronize()
    rows = kernel_rows(prof, CALLS)
    total = sum(r[0] for r in rows)
    return total, rows


def kernel_rows(prof, calls: int, cpu: bool = False) -> list:
    """(ms per call, launches per call, name) of every kernel the profile saw, longest first
    (cpu: every op's own CPU time, for a profile of CPU activity)."""
    rows = []
    for e in prof.key_averages():
        t = (getattr(e, "self_cpu_time_total", 0) if cpu else
             getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0))
        if t > 0:
            rows.append((t / calls / 1e3, e.count // calls, e.key))
    return sorted(rows, reverse=True)


def main(ids, dtype=torch.float32, top=12):
    dev = torch.device("cuda")
    tag = "fp32" if dtype == torch.float32 else str(dtype).replace("torch.", "")
    for mid in ids:
        spec = MODELS[mid]
        torch.manual_seed(0)
        model, _ = spec.make(1024, 8192, 8192, device=dev)
        model = model.to(dtype)
        x = spec.cls.get_inputs(1024, 8192, device=dev)[0].to(dtype)
        gy = torch.randn_like(model(x))
        for name, fn in (("eager", model), (f"gemmfuse-{tag}", gemmfuse.optimize(model, (x,)))):
            total, rows = profile_calls(fn, x, gy)
            print(f"\n{mid} {name}: {total:.3f} ms of kernels per fwd+bwd")
            for ms, n, key in rows[:top]:
                print(f"  {ms:8.3f} ms  x{n:<3d} {key[:110]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["m84", "m94", "m99"])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    main(a.models, torch.float32 if a.dtype == "fp32" else torch.bfloat16, a.top)

"""Peak CUDA memory one optimized call adds beyond its inputs, parameters and output.

    python3 scripts/workspace_peak.py --model m99 --dtype bf16

Prints the peak allocation during three calls above what was allocated before them, minus the
outputs kept alive, in MiB: the executor's workspace and any temporaries. For A/B runs of two
builds, set GEMMFUSE_LIB.
"""
import argparse

import torch

import gemmfuse
from gemmfuse.models import MODELS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="m99")
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model, xs = MODELS[a.model].make(dtype=dtype, device="cuda")
    opt = gemmfuse.optimize(model, tuple(xs))
    with torch.inference_mode():  # as the bench calls it: fused (no autograd recording)
        opt(*xs)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        outs = [opt(*xs) for _ in range(3)]
        torch.cuda.synchronize()
    kept = sum(o.numel() * o.element_size() for o in outs)
    extra = torch.cuda.max_memory_allocated() - base - kept
    print(f"{a.model} {a.dtype}: peak beyond inputs, parameters and the 3 outputs: "
          f"{extra / 2**20:.1f} MiB (outputs {kept / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()

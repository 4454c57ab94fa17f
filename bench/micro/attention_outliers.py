"""fp32 attention's error where one query or key of a head is far larger than the rest (its
scores large): gemmfuse's kernels (``gemmfuse.attention.scaled_dot_product_attention``) and eager
fp32 SDPA, each against a float64 math-path reference, output and gradients. kernel_emu's study
(the gtest DISABLED_FirstRowStudy, docs/measurements.md) compares with a plain fp32 reference that
takes its own log-sum-exp; this compares with what a user would run instead.

    python3 -m bench.micro.attention_outliers [--shape 2x4x512x64] [--scales 1,16,256] [--seeds 3]

Prints, per operand scaled (q or k, row 0 of every head), scale and causal flag, the worst over
the seeds of gemmfuse's error over eager's for the output and dq, dk, dv.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from gemmfuse.attention import scaled_dot_product_attention


def errors(fn, q, k, v, go, causal: bool, ref) -> list:
    """Relative norm-wise errors of fn's output and gradients against ref's."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, is_causal=causal)
    grads = torch.autograd.grad(out, leaves, go)
    return [float((g.double() - r).norm() / r.norm()) for g, r in zip((out, *grads), ref)]


def reference(q, k, v, go, causal: bool) -> list:
    d = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*d, is_causal=causal)
    return [out.detach(), *torch.autograd.grad(out, d, go.double())]


def ratios(shape, which: int, scale: float, causal: bool, seed: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, go = (torch.randn(shape, device="cuda", generator=g) for _ in range(4))
    (q, k)[which][:, :, 0] *= scale
    ref = reference(q, k, v, go, causal)
    ours = errors(scaled_dot_product_attention, q, k, v, go, causal, ref)
    eager = errors(F.scaled_dot_product_attention, q, k, v, go, causal, ref)
    return [a / b for a, b in zip(ours, eager)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2x4x512x64")
    ap.add_argument("--scales", default="1,16,256")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (gemmfuse's attention kernels)")
        return
    shape = tuple(int(x) for x in args.shape.split("x"))
    print(f"{'row 0 of':>8} {'scale':>6} {'causal':>6}  out/eager  dq/eager  dk/eager  dv/eager")
    for which, name in ((0, "q"), (1, "k")):
        for scale in (float(s) for s in args.scales.split(",")):
            for causal in (False, True):
                worst = [max(r) for r in zip(*(ratios(shape, which, scale, causal, s)
                                               for s in range(args.seeds)))]
                print(f"{name:>8} {scale:>6g} {str(causal):>6}  " +
                      "  ".join(f"{r:8.2f}" for r in worst))


if __name__ == "__main__":
    main()

"""Where fp32 attention's time goes, kernel by kernel (torch.profiler): gemmfuse's attention
(``gemmfuse.attention.scaled_dot_product_attention``: its splits, the forward and backward
kernels, the non-finite launches) against eager fp32 SDPA, forward + backward, causal and full.
Each table is the sum over `--calls` calls after 3 warm-up calls.

    python3 -m bench.micro.attention_profile [--shape 8x12x1024x64] [--calls 5]

With --plain it only runs gemmfuse's causal calls, unprofiled, for an outside profiler:

    ncu -k regex:attention --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        python3 -m bench.micro.attention_profile --plain --calls 2
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from gemmfuse.attention import scaled_dot_product_attention


def profile_calls(fn, q, k, v, go, causal: bool, calls: int):
    def step():
        out = fn(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), go)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return p.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                  max_name_column_width=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8x12x1024x64", help="B x H x S x D")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--plain", action="store_true", help="gemmfuse's causal calls, unprofiled")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", generator=g).requires_grad_() for _ in range(3))
    go = torch.randn(shape, device="cuda", generator=g)
    if a.plain:
        for _ in range(a.calls):
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), go)
        torch.cuda.synchronize()
        return
    for causal in (True, False):
        for name, fn in (("gemmfuse", scaled_dot_product_attention),
                         ("eager", F.scaled_dot_product_attention)):
            print(f"== {name}, {a.shape}, {'causal' if causal else 'full'}, {a.calls} calls")
            print(profile_calls(fn, q, k, v, go, causal, a.calls))


if __name__ == "__main__":
    main()

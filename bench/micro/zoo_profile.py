"""Where a zoo model's GPU time goes: torch.profiler over forward calls or training steps of
one zoo model (bench/zoo.py) for each variant, the kernels grouped by what they do (split
GEMMs, splits, attention, the LM head's passes, cuBLAS, ATen elementwise and reductions,
the optimizer, copies), ms per call, then the longest kernels; and `explain` for the
gemmfuse variants. Answers which part of a whole model holds a variant's time.

    python3 -m bench.micro.zoo_profile [--model gpt2-small] [--kind large] [--dtype fp32]
        [--phase train] [--variants eager,optimize] [--calls 3] [--top 25] [--device cuda]

On the CPU (--device cpu) it groups the ATen ops' own CPU time instead (a check of the script).
"""
from __future__ import annotations

import argparse
import copy
import re

import torch
from torch.profiler import ProfilerActivity, profile

from bench import zoo_runner
from bench.micro.train_profile import kernel_rows
from bench.zoo import ZOO

# (group, pattern on the kernel's name), first match wins
GROUPS = (
    ("attention (gemmfuse)", r"attention_kernel|attention_backward|split_v_kernel|split_head|"
                             r"head_amax|split_rows_kernel|delta_kernel|nonfinite"),
    ("attention (PyTorch)", r"fmha|flash|attention|softmax_warp"),
    ("split GEMM (gemmfuse)", r"f16x3|split_products|Sm90|sm90|gemmfuse.*gemm"),
    ("splits and fix-ups (gemmfuse)", r"split|fixup|fix_up|transpose|colsum|gemmfuse"),
    ("cuBLAS / CUTLASS GEMM", r"gemm|sgemm|cutlass|cublas|nvjet|xmma"),
    ("optimizer", r"adam|multi_tensor|fused_adam"),
    ("reductions and norms", r"reduce|norm|softmax|cross_entropy|nll|log_softmax"),
    ("elementwise", r"elementwise|vectorized|unrolled|copy|fill|index|embedding|gather|scatter"),
    ("memory", r"Memcpy|Memset"),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def step_fn(variant: str, base, sets, phase: str, loss_fn, dev):
    """The variant's callable for one forward call or training step, and its explain holder."""
    m = copy.deepcopy(base).train(phase == "train")
    zoo_runner.reset(m)
    fn, holder = zoo_runner.wrap(variant, m, sets[0])
    if phase == "forward":
        def call():
            with torch.no_grad():
                fn(*sets[0])
        return call, holder
    opt = zoo_runner.optimizer_for(m, dev)
    step = zoo_runner.train_step(fn, m, opt, loss_fn)
    return (lambda: step(*sets[0])), holder


def profile_variant(call, calls: int, dev) -> list:
    """train_profile.kernel_rows of `calls` calls after 3 warm-up calls (on the CPU: ops)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(3):
        call()
    sync()
    act = ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[act]) as prof:
        for _ in range(calls):
            call()
        sync()
    return kernel_rows(prof, calls, cpu=dev.type != "cuda")


def report(variant: str, rows: list, top: int) -> None:
    groups: dict = {}
    for ms, n, name in rows:
        g = groups.setdefault(group_of(name), [0.0, 0])
        g[0] += ms
        g[1] += n
    total = sum(ms for ms, _, _ in rows)
    print(f"== {variant}: {total:.3f} ms of kernels a call, "
          f"{sum(n for _, n, _ in rows)} launches")
    for g, (ms, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"  {g:32s} {ms:9.3f} ms  {100 * ms / max(total, 1e-9):5.1f}%  {n:6d} launches")
    print("  longest kernels:")
    for ms, n, name in rows[:top]:
        print(f"    {ms:9.3f} ms {n:5d}x  [{group_of(name)}] {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-small", choices=sorted(ZOO))
    ap.add_argument("--kind", default="large", help="tiny, small or large")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--phase", default="train", choices=("forward", "train"))
    ap.add_argument("--variants", default="eager,optimize")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    model, make_inputs, loss_fn = ZOO[a.model].build(a.kind, dev)
    base = model.to(dtype)
    sets = [zoo_runner.cast(make_inputs(0), dtype)]
    for variant in a.variants.split(","):
        call, holder = step_fn(variant, base, sets, a.phase, loss_fn, dev)
        report(variant, profile_variant(call, a.calls, dev), a.top)
        if holder is not None:
            from gemmfuse import explain
            text = explain(holder, print_it=False)
            found = zoo_runner.sites(text)
            for key, _, _ in zoo_runner.SITE_LINES:
                print(f"  {key}: {found[key + '_fused']}/{found[key + '_total']} on gemmfuse; "
                      + "; ".join(found[key + "_lines"])[:600])
            print("  " + text.splitlines()[0])


if __name__ == "__main__":
    main()

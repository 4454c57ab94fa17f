"""Does bf16 m99's time follow where its tensors sit in memory? Several copies of the model
(each W and bias its own allocation, with a spacer between them), one process, rounds
alternating over eager bf16 and gemmfuse of every copy; the inputs rotated are the same for
all. Prints each copy's addresses and its per-round medians (us).
    PYTHONPATH=python python3 scripts/bf16_address_probe.py [--copies 6] [--rounds 4]
"""
import argparse
import statistics

import torch

import gemmfuse
from gemmfuse.bench import CallTimer
from gemmfuse.models import M99

B, K, N = 1024, 8192, 8192


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=100)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = M99(K, N).to(dev).to(torch.bfloat16)
    sets = [(torch.rand(B, K, device=dev).to(torch.bfloat16),) for _ in range(3)]
    variants, spacers = [], []
    for c in range(args.copies):
        m = M99(K, N).to(dev).to(torch.bfloat16)
        m.load_state_dict(base.state_dict())
        spacers.append(torch.empty((c + 1) * 3 * (1 << 20) + 4096 * c, dtype=torch.uint8, device=dev))
        opt = gemmfuse.optimize(m, sets[0])
        w = m.linear.weight
        variants.append((f"eager{c}", m, w))
        variants.append((f"gf{c}", opt, w))
    timers = {name: CallTimer(fn, sets, dev) for name, fn, _ in variants}
    per_round = {name: [] for name, _, _ in variants}
    with torch.no_grad():
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for name, _, _ in order:
                timers[name].round(args.warmup, args.repeats)
                per_round[name].append(1e3 * timers[name].round_ms[-1])
    print(f"{'variant':>8} {'W address':>16} {'W % 2MiB':>9}  per-round median us")
    for name, _, w in variants:
        rounds = " ".join(f"{v:7.1f}" for v in per_round[name])
        print(f"{name:>8} {w.data_ptr():#16x} {w.data_ptr() % (2 << 20):9d}  {rounds}")


if __name__ == "__main__":
    main()

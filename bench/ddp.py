"""DistributedDataParallel through gemmfuse, launched by torchrun:

    torchrun --nproc-per-node 2 -m bench.ddp [--model m99] [--steps 20] [--out F.json]

Each rank holds three copies of a seed model under DDP, trained on the same per-rank batches:
float64 (the reference), eager fp32 and gemmfuse (--mode). Checked over --steps steps of plain
SGD: every step's loss, and at the end each copy's parameters against float64's
(fp32: gemmfuse's distance at most 1.25x eager's, plus fp32's rounding of the parameters), and
the ranks' parameters equal. (SGD's update is linear in the gradient, so the distance measures
the gradients' accuracy; Adam's divides each element by its running RMS, so elements whose
gradient is below rounding noise move by +-lr on the noise's sign, and the distance measures
that noise.) Timed on every rank, in alternating rounds, with torch.optim.AdamW (fused on
CUDA): a step (forward, backward with DDP's gradient all-reduce, AdamW) of eager and gemmfuse
under DDP, and the same step of each without DDP (the single-GPU figure, both GPUs busy
alike). Rank 0 writes the JSON and prints the table; the exit status is the check's. On a
machine without GPUs it runs on the CPU with gloo (the tests' small shapes)."""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gemmfuse import optimize, runtimes
from .models import MODELS


def step_arguments(p: argparse.ArgumentParser) -> None:
    """The options the 2-GPU runners share: precision mode, checked and timed steps, rounds."""
    p.add_argument("--mode", default="fp32", choices=["fp32", "fast", "tf32"])
    p.add_argument("--steps", type=int, default=20, help="checked training steps")
    p.add_argument("--timed", type=int, default=20, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=3)


def _args(argv):
    p = argparse.ArgumentParser(prog="bench.ddp")
    p.add_argument("--model", default="m99", choices=sorted(MODELS))
    step_arguments(p)
    p.add_argument("--batch", type=int, help="rows per rank (default 1024 on GPUs, 32 on the CPU)")
    p.add_argument("--features", type=int, help="K = N (default 8192 on GPUs, 256 on the CPU)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's (timed steps)")
    p.add_argument("--sgd-step", type=float, default=1e-4,
                   help="checked steps: SGD's lr makes the first step move no parameter tensor by "
                        "more than this fraction of its norm (the seed models' gradients span 1e-4 "
                        "to 1e3: a fixed lr would leave some still and make others chaotic; a rule "
                        "over all parameters at once let m84's scale, beside a W whose gradient "
                        "BatchNorm makes tiny, take steps of 1e4); lr at most 1")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: the GPUs where there are, else the CPU with gloo")
    p.add_argument("--out", help="JSON path (rank 0 writes it)")
    return p.parse_args(argv)


class Copy:
    """One copy of the model, its optimizer, and its step (DDP-wrapped or not)."""

    def __init__(self, name, model, x0, dev, mode, ddp, lr, optimizer="adamw"):
        self.name = name
        self.dtype = torch.float64 if name == "float64" else torch.float32
        self.model = copy.deepcopy(model).to(self.dtype)
        fn = self.model
        if name == "gemmfuse":
            fn = optimize(self.model, (x0.to(self.dtype),), precision=mode)
        self.runtime = fn
        self.fn = DDP(fn, device_ids=[dev.index] if dev.type == "cuda" else None) if ddp else fn
        if optimizer == "sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr,
                                         fused=True if dev.type == "cuda" else None)

    def step(self, x, gy):
        self.opt.zero_grad(set_to_none=True)
        y = self.fn(x.to(self.dtype))
        loss = (y * gy.to(self.dtype)).sum()
        loss.backward()
        self.opt.step()
        return loss.detach()


def _batch(seed, b, k, shape_out, dev):
    """A rank's batch: x uniform in [0, 1) as the seed models' inputs, and the gradient the
    loss sum(y * gy) sends into the output."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.rand(b, k, generator=g).to(dev), torch.randn(shape_out, generator=g).to(dev)


def _dist(a, b):
    return float(sum((p.detach().double() - q.detach().double()).norm() ** 2
                     for p, q in zip(a.parameters(), b.parameters())) ** 0.5)


def _time_steps(c, batches, n, dev):
    times = []
    for i in range(n):
        x, gy = batches[i % len(batches)]
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            c.step(x, gy)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            c.step(x, gy)
            times.append((time.perf_counter() - t) * 1e3)
    return times


def run(argv=None) -> dict:
    a = _args(argv)
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    b = a.batch or (1024 if cuda else 32)
    k = a.features or (8192 if cuda else 256)
    spec = MODELS[a.model]
    torch.manual_seed(0)  # the same initial model on every rank
    model, (x0,) = spec.make(b, k, k, device=dev)
    with torch.no_grad():
        shape_out = copy.deepcopy(model)(x0).shape
    probe = copy.deepcopy(model).double()
    x, gy = _batch(rank, b, k, shape_out, dev)
    (probe(x.double()) * gy.double()).sum().backward()
    norm = lambda ts: float(sum(t.detach().double().norm() ** 2 for t in ts) ** 0.5)  # noqa: E731
    # At most 1: where the first gradients are ~0 (m94 at the CPU's shapes, its hardtanh
    # saturated), a larger lr turns chaotic once they grow.
    sgd_lr = min(1.0, a.sgd_step * min(norm([p]) / norm([p.grad]) for p in probe.parameters()
                                       if p.grad is not None and norm([p.grad]) > 0 and norm([p]) > 0))
    sgd_lr = torch.tensor(sgd_lr, device=dev)
    dist.broadcast(sgd_lr, 0)  # rank 0's, on every rank
    sgd_lr = float(sgd_lr)
    del probe
    copies = [Copy(n, model, x0, dev, a.mode, True, sgd_lr, "sgd") for n in ("float64", "eager", "gemmfuse")]
    del model

    # Checked steps: the same batches for the three copies, different ones per rank.
    losses = {c.name: [] for c in copies}
    for step in range(a.steps):
        x, gy = _batch(1000 * step + rank, b, k, shape_out, dev)
        for c in copies:
            losses[c.name].append(float(c.step(x, gy)))
    ref, eager, gf = copies
    err_eager, err_gf = _dist(eager.model, ref.model), _dist(gf.model, ref.model)
    flat = torch.cat([p.detach().reshape(-1).float() for p in gf.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    ranks_equal = all(torch.equal(gathered[0], t) for t in gathered[1:])
    rt = gf.runtime
    train_calls = sum(r.train_calls for r in runtimes(rt))
    fallbacks = {k_: v for r in runtimes(rt) for k_, v in r.fallbacks.items()}
    loss_rel = max(abs(l1 - l0) / max(abs(l0), 1e-30) for l0, l1 in zip(losses["float64"], losses["gemmfuse"]))
    loss_rel_eager = max(abs(l1 - l0) / max(abs(l0), 1e-30)
                         for l0, l1 in zip(losses["float64"], losses["eager"]))
    del ref, copies
    if cuda:
        torch.cuda.empty_cache()

    # Timed steps: DDP and plain copies of eager and gemmfuse, alternating rounds.
    variants = {
        "eager ddp": eager, "gemmfuse ddp": gf,
        "eager": Copy("eager", eager.model, x0, dev, a.mode, False, a.lr),
        "gemmfuse": Copy("gemmfuse", gf.model, x0, dev, a.mode, False, a.lr),
    }
    batches = [_batch(10 ** 6 + 7 * i + rank, b, k, shape_out, dev) for i in range(3)]
    times = {n: [] for n in variants}
    for r in range(a.rounds):
        order = list(variants.items())
        for n, c in (order if r % 2 == 0 else order[::-1]):
            dist.barrier()
            _time_steps(c, batches, 3, dev)  # warm-up
            times[n] += _time_steps(c, batches, a.timed, dev)
    ms = {n: statistics.median(t) for n, t in times.items()}
    mine = {
        "rank": rank, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "ms": ms,
        "speedup_ddp": ms["eager ddp"] / ms["gemmfuse ddp"],
        "speedup_single": ms["eager"] / ms["gemmfuse"],
    }
    mine["ddp_over_single"] = mine["speedup_ddp"] / mine["speedup_single"]
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    result = {
        "header": {"model": a.model, "mode": a.mode, "world_size": world, "batch_per_rank": b,
                   "in_features": k, "out_features": k, "steps": a.steps, "lr": a.lr,
                   "optimizer": "AdamW" + ("(fused=True)" if cuda else ""),
                   "checked_with": f"SGD(lr={sgd_lr:.3g})",
                   "backend": dist.get_backend(), "torch": torch.__version__,
                   "gpu": per_rank[0]["device"] if cuda else None,
                   "git": os.environ.get("GEMMFUSE_GIT_COMMIT", ""),
                   "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "check": {
            "param_err_eager": err_eager, "param_err_gemmfuse": err_gf,
            "param_err_ratio": err_gf / err_eager if err_eager > 0 else None,
            "loss_rel_err_gemmfuse": loss_rel, "loss_rel_err_eager": loss_rel_eager,
            "losses": losses, "ranks_equal": ranks_equal, "train_calls": train_calls,
            "fallbacks": fallbacks,
        },
        "ranks": per_rank,
    }
    c = result["check"]
    # fp32: as close to float64 as eager (1.25x, plus fp32's rounding of the parameters);
    # fast and tf32: their promise is on the forward, reported here.
    floor = 1e-6 * float(sum(p.detach().double().norm() ** 2 for p in gf.model.parameters()) ** 0.5)
    c["pass"] = bool(ranks_equal and train_calls >= a.steps and not fallbacks and
                     (a.mode != "fp32" or err_gf <= 1.25 * err_eager + floor))
    result["pass"] = c["pass"]
    result["ddp_within_10pct_of_single"] = all(r["ddp_over_single"] >= 0.9 for r in per_rank)
    if rank == 0:
        _report(result, a.out)
    # The DDP wrappers go before the process group: a Reducer freed after it (at return) can
    # hang on gloo's teardown.
    variants.clear()
    del eager, gf
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result


def print_report(title, caption, columns, rows, summary, result, out):
    """A distributed run's per-rank table and its summary line (rank 0), and its JSON."""
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title, caption=caption)
    for col in columns:
        t.add_column(col, justify="right")
    for row in rows:
        t.add_row(*row)
    con = Console(width=120)
    con.print(t)
    con.print(summary)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        con.print(f"wrote {out}")


def _report(result, out):
    h, c = result["header"], result["check"]
    rows = [(str(r["rank"]), f"{r['ms']['eager ddp']:.3f}", f"{r['ms']['gemmfuse ddp']:.3f}",
             f"{r['speedup_ddp']:.2f}", f"{r['ms']['eager']:.3f}", f"{r['ms']['gemmfuse']:.3f}",
             f"{r['speedup_single']:.2f}", f"{r['ddp_over_single']:.2f}") for r in result["ranks"]]
    print_report(
        f"gemmfuse DDP — {h['world_size']} x {h['gpu'] or 'CPU'}, {h['model']} {h['mode']}, "
        f"M={h['batch_per_rank']}/rank K=N={h['in_features']}, timed with {h['optimizer']}",
        "ms: median step (forward, backward, optimizer); speedup: eager / gemmfuse "
        "on the same rank; ddp/single: the DDP speedup over the single-GPU one",
        ("rank", "eager ddp", "gemmfuse ddp", "speedup ddp", "eager", "gemmfuse",
         "speedup single", "ddp/single"), rows,
        f"after {h['steps']} steps of {h['checked_with']}: parameters' distance to float64 DDP: eager "
        f"{c['param_err_eager']:.3g}, gemmfuse {c['param_err_gemmfuse']:.3g} "
        f"(ratio {c['param_err_ratio'] or float('nan'):.2f}); worst loss error vs float64: "
        f"eager {c['loss_rel_err_eager']:.2g}, gemmfuse {c['loss_rel_err_gemmfuse']:.2g}; "
        f"ranks' parameters equal: {c['ranks_equal']}; fused training calls "
        f"{c['train_calls']}, fallbacks {c['fallbacks'] or 'none'}; "
        f"{'PASS' if result['pass'] else 'FAIL'}; DDP speedup within 10% of the single-GPU "
        f"one on every rank: {result['ddp_within_10pct_of_single']}", result, out)


def main(argv=None):
    result = run(argv)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""FSDP2 and tensor parallelism through gemmfuse, launched by torchrun:

    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --nproc-per-node 2 \\
        -m bench.distributed --case fsdp2-after --steps 20 --out X.json

Cases (a model of --blocks residual blocks ``x + fc2(gelu(fc1(x)))`` and a head
``relu(head(x))``, width --width, hidden --hidden):
  fsdp2-after    fully_shard on every block and on the root, then gemmfuse.optimize()
  fsdp2-before   gemmfuse.optimize(), then fully_shard on every block and on the root
  fsdp2-compile  fully_shard as above, then torch.compile(backend="gemmfuse") (the variant
                 without gemmfuse: torch.compile's default backend, Inductor)
  tp             parallelize_module: each block's fc1 ColwiseParallel, fc2 RowwiseParallel

Each rank holds three copies under the same wrapper, trained on the same batches: float64
(the reference), without gemmfuse and with it (--mode). Checked over --steps steps of SGD:
every step's loss and, at the end, the parameters (each rank's shards), against float64 (fp32:
gemmfuse's distance at most 1.25x the one without gemmfuse, plus fp32's rounding of the
parameters) and against the copy without gemmfuse (reported as the largest relative
difference); gemmfuse must have issued fused calls. FSDP2 gives each rank its own batch, tensor
parallelism the same one. Then timed with AdamW in alternating rounds, CUDA events, median: a
step (forward, backward with the wrapper's collectives, optimizer) of both copies under the
wrapper, and the same step of the unwrapped model on each rank (the single-GPU figure, every
GPU busy alike, the same per-rank batch). Rank 0 writes the JSON (with explain's text) and
prints PASS/FAIL and the table; the exit status is the check's. Without GPUs it runs on the
CPU with gloo at small shapes (the tests). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gemmfuse import explain, fused_calls, optimize, runtimes
from .ddp import _time_steps, print_report, step_arguments

CASES = ("fsdp2-after", "fsdp2-before", "fsdp2-compile", "tp")


def _args(argv):
    p = argparse.ArgumentParser(prog="bench.distributed")
    p.add_argument("--case", required=True, choices=CASES)
    step_arguments(p)
    p.add_argument("--batch", type=int, help="rows per rank (default 4096 on GPUs, 16 on the CPU)")
    p.add_argument("--width", type=int, help="block width (default 4096 on GPUs, 32 on the CPU)")
    p.add_argument("--hidden", type=int, help="fc1's out features (default: the width)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2, help="SGD's (checked steps)")
    p.add_argument("--timed-lr", type=float, default=1e-4, help="AdamW's (timed steps)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", help="JSON path (rank 0 writes it)")
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, width, hidden, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return torch.relu(self.head(x))


def _wrap(case: str, model: nn.Module, mesh, x0, mode: str, gemmfuse: bool):
    """(what to call, the module holding the parameters) for one copy under the case's
    wrapper; ``mesh`` None: the model alone (the single-GPU figure)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    def shard(m):
        for b in m.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)

    if case == "fsdp2-compile":
        if mesh is not None:
            shard(model)
        backend = "gemmfuse" if gemmfuse else "inductor"
        return torch.compile(model, backend=backend, options={"precision": mode} if gemmfuse else None), model
    if case == "fsdp2-before" and gemmfuse:
        fn = optimize(model, (x0,), precision=mode)
        if mesh is not None:
            shard(model)
        return fn, model
    if mesh is not None and case in ("fsdp2-after", "fsdp2-before"):
        shard(model)
    if mesh is not None and case == "tp":
        plan = {}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.fc1"], plan[f"blocks.{i}.fc2"] = ColwiseParallel(), RowwiseParallel()
        parallelize_module(model, mesh, plan)
    return (optimize(model, (x0,), precision=mode) if gemmfuse else model), model


def param_groups(model: nn.Module) -> list:
    """The model's parameters for an optimizer: DTensors and plain tensors in separate groups.
    torch.optim's multi-tensor (foreach) step, its default on CUDA, runs each group's
    parameters of a device and dtype in one call, which DTensor refuses for a list mixing
    both (tensor parallelism leaves the head a plain Linear beside the blocks' DTensors)."""
    from gemmfuse.tensor_parallel import is_dtensor
    params = list(model.parameters())
    groups = ([p for p in params if is_dtensor(p)], [p for p in params if not is_dtensor(p)])
    return [{"params": g} for g in groups if g]


class Variant:
    """One copy of the model under the wrapper (or alone), and its optimizer."""

    def __init__(self, name, case, model, mesh, x0, mode, gemmfuse, dtype, lr):
        self.name, self.dtype, self.gemmfuse = name, dtype, gemmfuse
        self.fn, self.model = _wrap(case, copy.deepcopy(model).to(dtype), mesh, x0.to(dtype),
                                    mode, gemmfuse)
        self.opt = torch.optim.SGD(param_groups(self.model), lr=lr)

    def step(self, x, target):
        self.opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.fn(x.to(self.dtype)), target.to(self.dtype))
        loss.backward()
        self.opt.step()
        return loss.detach()

    def local_params(self):
        from gemmfuse.tensor_parallel import local
        return [local(p.detach()).double() for p in self.model.parameters()]


def _batch(seed, b, k, dev):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(b, k, generator=g).to(dev), torch.randn(b, k, generator=g).to(dev)


def _setup(a):
    """The device, process group, mesh and defaults."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(dev.type, (world,))
    a.batch = a.batch or (4096 if cuda else 16)
    a.width = a.width or (4096 if cuda else 32)
    a.hidden = a.hidden or a.width
    return rank, world, dev, mesh, cuda


def _check(a, rank, dev, variants):
    """The checked SGD steps: losses per step, then the parameters' distances."""
    ref, eager, gf = variants
    losses = {v.name: [] for v in variants}
    for step in range(a.steps):
        seed = 1000 * step + (0 if a.case == "tp" else rank)  # TP: every rank the same batch
        x, t = _batch(seed, a.batch, a.width, dev)
        for v in variants:
            losses[v.name].append(float(v.step(x, t)))
    p64, pe, pg = ref.local_params(), eager.local_params(), gf.local_params()
    sq = torch.tensor([sum(float((q - r).norm() ** 2) for q, r in zip(pe, p64)),
                       sum(float((q - r).norm() ** 2) for q, r in zip(pg, p64)),
                       sum(float(r.norm() ** 2) for r in p64)], dtype=torch.float64, device=dev)
    rel = max([float((g - e).norm() / max(float(e.norm()), 1e-30)) for g, e in zip(pg, pe)]
              + [abs(lg - le) / max(abs(le), 1e-30) for lg, le in zip(losses["gemmfuse"], losses["eager"])])
    worst = torch.tensor([rel], dtype=torch.float64, device=dev)
    dist.all_reduce(sq)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    err_e, err_g, norm = (float(v) ** 0.5 for v in sq)
    loss_rel = max(abs(l1 - l0) / max(abs(l0), 1e-30)
                   for l0, l1 in zip(losses["float64"], losses["gemmfuse"]))
    return {"param_err_eager": err_e, "param_err_gemmfuse": err_g,
            "param_err_ratio": err_g / err_e if err_e > 0 else None,
            "param_norm": norm, "rel_to_eager": float(worst), "loss_rel_err_gemmfuse": loss_rel,
            "losses": losses}


def _fusion(a, gf) -> dict:
    """What gemmfuse ran during the checked steps: fused calls (explain counts the same),
    fused calls autograd recorded, and the fallbacks to PyTorch by reason."""
    rts = [] if a.case == "fsdp2-compile" else runtimes(gf.fn)
    fallbacks = {}
    for r in rts:
        for k, n in r.fallbacks.items():
            fallbacks[k] = fallbacks.get(k, 0) + n
    return {"fused_calls": fused_calls(gf.fn), "train_calls": sum(r.train_calls for r in rts),
            "fallbacks": fallbacks, "explain": explain(gf.fn, print_it=False)}


def _timings(a, rank, dev, mesh, model, x0, eager, gf):
    """Median step (ms) of both copies under the wrapper and of the model alone, AdamW,
    alternating rounds, the same per-rank batches."""
    variants = {"eager dist": eager, "gemmfuse dist": gf,
                "eager single": Variant("eager", a.case, model, None, x0, a.mode, False, torch.float32, 0),
                "gemmfuse single": Variant("gemmfuse", a.case, model, None, x0, a.mode, True, torch.float32, 0)}
    for v in variants.values():
        v.opt = torch.optim.AdamW(param_groups(v.model), lr=a.timed_lr)
    batches = [_batch(10 ** 6 + 7 * i + (0 if a.case == "tp" else rank), a.batch, a.width, dev)
               for i in range(3)]
    times = {n: [] for n in variants}
    for r in range(a.rounds):
        order = list(variants.items())
        for n, v in (order if r % 2 == 0 else order[::-1]):
            dist.barrier()
            _time_steps(v, batches, 3, dev)  # warm-up (compiles, plans, timed routes)
            times[n] += _time_steps(v, batches, a.timed, dev)
    ms = {n: statistics.median(t) for n, t in times.items()}
    out = {"rank": rank, "ms": ms,
           "speedup_dist": ms["eager dist"] / ms["gemmfuse dist"],
           "speedup_single": ms["eager single"] / ms["gemmfuse single"]}
    out["dist_over_single"] = out["speedup_dist"] / out["speedup_single"]
    return out


def run(argv=None) -> dict:
    a = _args(argv)
    rank, world, dev, mesh, cuda = _setup(a)
    torch.manual_seed(0)  # the same initial model on every rank
    model = Net(a.width, a.hidden, a.blocks).to(dev)
    x0 = torch.randn(a.batch, a.width, device=dev)
    eager_case = "fsdp2-after" if a.case.startswith("fsdp2") else a.case  # float64: eager FSDP2
    variants = [Variant(n, eager_case if n == "float64" else a.case, model, mesh, x0, a.mode,
                        n == "gemmfuse", dt, a.lr)
                for n, dt in (("float64", torch.float64), ("eager", torch.float32),
                              ("gemmfuse", torch.float32))]
    check = _check(a, rank, dev, variants)
    check.update(_fusion(a, variants[2]))
    floor = 1e-6 * check["param_norm"]
    check["pass"] = bool(check["fused_calls"] > 0 and (
        a.mode != "fp32" or check["param_err_gemmfuse"] <= 1.25 * check["param_err_eager"] + floor))
    del variants[0]
    if cuda:
        torch.cuda.empty_cache()
    mine = _timings(a, rank, dev, mesh, model, x0, *variants)
    mine["device"] = torch.cuda.get_device_name(dev) if cuda else "cpu"
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    result = {"header": {"case": a.case, "mode": a.mode, "world_size": world, "batch_per_rank": a.batch,
                         "width": a.width, "hidden": a.hidden, "blocks": a.blocks, "steps": a.steps,
                         "checked_with": f"SGD(lr={a.lr:g})", "timed_with": f"AdamW(lr={a.timed_lr:g})",
                         "backend": dist.get_backend(), "torch": torch.__version__,
                         "gpu": per_rank[0]["device"] if cuda else None,
                         "git": os.environ.get("GEMMFUSE_GIT_COMMIT", ""),
                         "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
              "check": check, "ranks": per_rank, "pass": check["pass"],
              "within_10pct_of_single": all(r["dist_over_single"] >= 0.9 for r in per_rank)}
    if rank == 0:
        _report(result, a.out)
    variants.clear()
    dist.barrier()
    dist.destroy_process_group()
    return result


def _report(result, out):
    h, c = result["header"], result["check"]
    rows = [(str(r["rank"]), f"{r['ms']['eager dist']:.3f}", f"{r['ms']['gemmfuse dist']:.3f}",
             f"{r['speedup_dist']:.2f}", f"{r['ms']['eager single']:.3f}",
             f"{r['ms']['gemmfuse single']:.3f}", f"{r['speedup_single']:.2f}",
             f"{r['dist_over_single']:.2f}") for r in result["ranks"]]
    print_report(
        f"gemmfuse {h['case']} — {h['world_size']} x {h['gpu'] or 'CPU'} ({h['backend']}), "
        f"{h['blocks']} blocks, width {h['width']}, hidden {h['hidden']}, "
        f"M={h['batch_per_rank']}/rank, {h['mode']}, timed with {h['timed_with']}",
        "ms: median step (forward, backward, optimizer); speedup: without / with "
        "gemmfuse on the same rank; dist/single: the wrapped speedup over the "
        "model's own on one GPU",
        ("rank", "eager dist", "gemmfuse dist", "speedup dist", "eager single",
         "gemmfuse single", "speedup single", "dist/single"), rows,
        f"after {h['steps']} steps of {h['checked_with']}: parameters' distance to float64: "
        f"without gemmfuse {c['param_err_eager']:.3g}, with {c['param_err_gemmfuse']:.3g} "
        f"(ratio {c['param_err_ratio'] or float('nan'):.2f}); largest relative difference to "
        f"the copy without gemmfuse (losses, parameters) {c['rel_to_eager']:.2g}; fused calls "
        f"{c['fused_calls']} ({c['train_calls']} recorded by autograd), fallbacks "
        f"{c['fallbacks'] or 'none'}; {'PASS' if result['pass'] else 'FAIL'}; speedup within "
        f"10% of the single-GPU one on every rank: {result['within_10pct_of_single']}", result, out)


def main(argv=None):
    return 0 if run(argv)["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

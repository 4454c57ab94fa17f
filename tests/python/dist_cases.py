"""The edge cases of test_distributed.py, run in one torchrun launch of two CPU processes
(gloo): each case trains a copy with gemmfuse and one without under the same wrapper and
records what the test asserts. Rank 0 writes {case: facts, or {"error": traceback}}.

    python -m torch.distributed.run --nproc-per-node 2 dist_cases.py OUT.json [case ...]
"""
import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gemmfuse
from bench.distributed import Net
from gemmfuse.fsdp import unsharded_params
from gemmfuse.tensor_parallel import is_dtensor, local

W, B = 32, 8


class MeanBlock(nn.Module):
    """A chain whose plan prepares W's column sums (Linear -> mean): prepared data that must
    follow FSDP's all-gathered weights after each step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x):
        return x + self.fc(x).mean(dim=-1, keepdim=True) * x


class MeanNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MeanBlock() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Branchy(Net):
    """A root forward torch.fx cannot trace (control flow on a tensor's value)."""

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        if x.sum() > 0:
            x = x * 1.0
        return torch.relu(self.head(x))


def _train(fn, model, steps, rank, same_batch=False):
    """Losses of `steps` SGD steps, and the parameters' local shards after them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * s + (0 if same_batch else rank))
        x, t = torch.randn(B, W, generator=g), torch.randn(B, W, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(fn(x), t)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, [local(p.detach()).clone() for p in model.parameters()]


def _compare(a, b) -> float:
    """Largest relative difference between two _train results."""
    (la, pa), (lb, pb) = a, b
    rel = [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(la, lb)]
    rel += [float((p - q).norm() / max(float(q.norm()), 1e-30)) for p, q in zip(pa, pb)]
    worst = torch.tensor(max(rel))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def _shard(m, mesh, root=True):
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    if root:
        fully_shard(m, mesh=mesh)
    return m


def _fsdp_pair(make, mesh, rank, prepare, steps=3):
    """(with gemmfuse, without) trained under FSDP2; prepare(model) -> what to call."""
    torch.manual_seed(0)
    base = make()
    mine, ref = copy.deepcopy(base), copy.deepcopy(base)
    fn = prepare(mine)
    return fn, _train(fn, mine, steps, rank), _train(_shard(ref, mesh), ref, steps, rank)


def _facts(fn, got, want, **more):
    return {"rel": _compare(got, want), "fused_calls": gemmfuse.fused_calls(fn),
            "explain": gemmfuse.explain(fn, print_it=False), **more}


def case_blocks_only(mesh, rank):
    """fully_shard on the blocks but not the root, then optimize()."""
    x0 = torch.randn(B, W)
    fn, got, _ = _fsdp_pair(lambda: Net(W, W, 2), mesh, rank,
                            lambda m: gemmfuse.optimize(_shard(m, mesh, root=False), (x0,)))
    torch.manual_seed(0)
    ref = _shard(Net(W, W, 2), mesh, root=False)
    return _facts(fn, got, _train(ref, ref, 3, rank))


def case_hooked_unit(mesh, rank):
    """A unit with a user's forward hook besides FSDP's runs through its own call."""
    x0, seen = torch.randn(B, W), []

    def prepare(m):
        _shard(m, mesh)
        m.blocks[1].register_forward_hook(lambda *a: seen.append(1))
        return gemmfuse.optimize(m, (x0,))
    fn, got, want = _fsdp_pair(lambda: Net(W, W, 2), mesh, rank, prepare)
    return _facts(fn, got, want, hook_calls=len(seen))


def case_colsum_after(mesh, rank):
    """Prepared column sums follow the weights FSDP all-gathers after every step."""
    x0 = torch.randn(B, W)
    fn, got, want = _fsdp_pair(MeanNet, mesh, rank, lambda m: gemmfuse.optimize(_shard(m, mesh), (x0,)), 4)
    return _facts(fn, got, want)


def case_colsum_compile(mesh, rank):
    """The same through torch.compile (ChainRuntimes, no Inductor: quick on the CPU)."""
    def prepare(m):
        return torch.compile(_shard(m, mesh), backend="gemmfuse", options={"inductor": False})
    fn, got, want = _fsdp_pair(MeanNet, mesh, rank, prepare, 4)
    # An optimizer step bumps the unsharded parameters' versions (FSDP keeps them)
    model = fn._orig_mod
    before = [p._version for p in unsharded_params(model)]
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    after = [p._version for p in unsharded_params(model)]
    return _facts(fn, got, want, bumped=len(before) > 0 and all(a > b for a, b in zip(after, before)))


def case_fx_untraceable(mesh, rank):
    """A root forward torch.fx cannot trace: the FSDP2 model goes through dynamo."""
    x0 = torch.randn(B, W)
    fn, got, want = _fsdp_pair(lambda: Branchy(W, W, 2), mesh, rank,
                               lambda m: gemmfuse.optimize(_shard(m, mesh), (x0,)))
    return _facts(fn, got, want)


def _tp_plan():
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(W, 2 * W), nn.Linear(2 * W, W)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _tp_pair(mesh, rank, prepare):
    torch.manual_seed(0)
    base = MLP()
    mine, ref = copy.deepcopy(base), parallelize_module(copy.deepcopy(base), mesh, _tp_plan())
    fn = prepare(mine)
    return fn, _train(fn, mine, 3, rank, True), _train(ref, ref, 3, rank, True)


def case_tp_before(mesh, rank):
    """optimize(), then parallelize_module: the chains run in PyTorch, with reasons."""
    x0 = torch.randn(B, W)

    def prepare(m):
        fn = gemmfuse.optimize(m, (x0,))
        parallelize_module(m, mesh, _tp_plan())
        return fn
    fn, got, want = _tp_pair(mesh, rank, prepare)
    reasons = [k for rt in gemmfuse.runtimes(fn) for k in rt.fallbacks]
    return _facts(fn, got, want, reasons=reasons)


def case_tp_compile(mesh, rank):
    """torch.compile over a tensor-parallel model: chains over DTensors are not captured."""
    fn, got, want = _tp_pair(mesh, rank, lambda m: torch.compile(
        parallelize_module(m, mesh, _tp_plan()), backend="gemmfuse", options={"inductor": False}))
    return _facts(fn, got, want)


def case_tp_foreach(mesh, rank):
    """The runner's tp copies, stepped as on CUDA, where torch.optim's default is the
    multi-tensor (foreach) step: one call per parameter group, which DTensor refuses for a
    list mixing DTensors (the blocks) and plain tensors (the head, not parallelized)."""
    import torch.optim.optimizer as optim
    from bench import distributed as bench
    devices = optim._get_foreach_kernels_supported_devices
    optim._get_foreach_kernels_supported_devices = lambda: [*devices(), "cpu"]
    try:
        torch.manual_seed(0)
        model, x0 = Net(W, W, 2), torch.randn(B, W)
        eager, gf = (bench.Variant(n, "tp", model, mesh, x0, "fp32", n == "gemmfuse",
                                   torch.float32, 0.05) for n in ("eager", "gemmfuse"))
        foreach = optim._default_to_fused_or_foreach(list(gf.model.parameters()), False)[1]
        losses = {"eager": [], "gemmfuse": []}
        for s in range(3):
            g = torch.Generator().manual_seed(100 * s)
            x, t = torch.randn(B, W, generator=g), torch.randn(B, W, generator=g)
            for v in (eager, gf):
                losses[v.name].append(float(v.step(x, t)))
    finally:
        optim._get_foreach_kernels_supported_devices = devices
    plain = [n for n, p in gf.model.named_parameters() if is_dtensor(p) and not is_dtensor(p.grad)]
    return _facts(gf.fn, (losses["gemmfuse"], gf.local_params()),
                  (losses["eager"], eager.local_params()), foreach=foreach, plain_grads=plain)


def main(out, names):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name in names:
        try:
            results[name] = globals()[f"case_{name}"](mesh, rank)
        except Exception:  # noqa: BLE001 - recorded for the test to show
            results[name] = {"error": traceback.format_exc()[-4000:]}
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GEMMFUSE_ALWAYS_FUSE", "1")
    main(sys.argv[1], sys.argv[2:] or [n[5:] for n in list(globals()) if n.startswith("case_")])

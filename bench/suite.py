"""`python -m bench --suite`: Linear -> chain problems beyond the five reference models (varied
chains; M from 1 to 32768, N and K from 256 to 32768) and a minGPT-style transformer block,
eager PyTorch against gemmfuse in the same dtype, in the same run: fp32 models (`fp32` and
`fast` modes) and bf16 models."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .models import GPTBlock, model_seed

# The chains after the Linear, by name: each a function of (the Linear's output y, the input x,
# the problem's extra modules).
CHAINS = {
    "gelu_softmax": lambda y, x, m: F.softmax(F.gelu(y), dim=-1),
    "relu": lambda y, x, m: F.relu(y),
    "gelu_tanh": lambda y, x, m: F.gelu(y, approximate="tanh"),
    "silu_scale": lambda y, x, m: F.silu(y) * m.scale,
    "layernorm": lambda y, x, m: m.norm(y),
    "bias_tanh": lambda y, x, m: torch.tanh(y + m.bias2),
    "logsumexp": lambda y, x, m: torch.logsumexp(y, dim=-1, keepdim=True),
    "log_softmax": lambda y, x, m: F.log_softmax(y, dim=-1),
    "groupnorm": lambda y, x, m: m.norm(y),
    "batchnorm_relu": lambda y, x, m: F.relu(m.norm(y)),
    "mish_clamp": lambda y, x, m: torch.clamp(F.mish(y), -1.0, 2.0),
    "softplus": lambda y, x, m: F.softplus(y),
    "sigmoid_residual": lambda y, x, m: torch.sigmoid(y) + x,
    "gelu": lambda y, x, m: F.gelu(y),
    "sum": lambda y, x, m: y.sum(dim=-1, keepdim=True),
}

# (M, K, N, chain)
PROBLEMS = [
    (1, 8192, 8192, "gelu_softmax"), (4, 4096, 16384, "relu"), (16, 8192, 8192, "layernorm"),
    (32, 32768, 4096, "silu_scale"), (64, 4096, 4096, "gelu_tanh"), (128, 8192, 32768, "gelu"),
    (128, 8192, 16384, "log_softmax"), (256, 256, 32768, "bias_tanh"), (256, 8192, 256, "logsumexp"),
    (512, 1024, 1024, "relu"), (512, 4096, 11008, "silu_scale"), (1024, 8192, 8192, "groupnorm"),
    (1024, 4096, 4096, "batchnorm_relu"), (1024, 768, 3072, "gelu_tanh"), (1024, 3072, 768, "layernorm"),
    (2048, 2048, 2048, "mish_clamp"), (2048, 1024, 4096, "softplus"), (4096, 1024, 1024, "sigmoid_residual"),
    (4096, 4096, 4096, "gelu_softmax"), (4096, 8192, 1024, "log_softmax"), (8192, 512, 2048, "relu"),
    (8192, 2048, 512, "layernorm"), (8192, 1024, 4096, "gelu_tanh"), (16384, 256, 1024, "bias_tanh"),
    (16384, 1024, 256, "logsumexp"), (16384, 4096, 4096, "silu_scale"), (32768, 1024, 4096, "gelu"),
    (32768, 4096, 1024, "groupnorm"), (32768, 256, 256, "relu"), (32768, 2048, 2048, "sum"),
    (2048, 32768, 256, "batchnorm_relu"), (256, 16384, 16384, "mish_clamp"),
]

# The transformer block: 128 sequences of 512 tokens, 768 features, 8 heads.
BLOCK = dict(batch=128, tokens=512, n_embd=768, n_head=8)


class ChainProblem(nn.Module):
    """Linear(K, N) then one of CHAINS, with the modules and parameters that chain reads."""

    def __init__(self, k: int, n: int, chain: str):
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.chain = chain
        if chain == "layernorm":
            self.norm = nn.LayerNorm(n)
        elif chain == "groupnorm":
            self.norm = nn.GroupNorm(32, n)
        elif chain == "batchnorm_relu":
            self.norm = nn.BatchNorm1d(n)
        self.scale = nn.Parameter(torch.full((1,), 1.5))
        self.bias2 = nn.Parameter(torch.randn(n) * 0.1)

    def forward(self, x):
        return CHAINS[self.chain](self.fc(x), x, self)


@dataclass
class Problem:
    name: str
    make: object          # (device) -> (model, [input sets])
    flops: float


def problems(input_sets: int = 3, only=None, shrink: int = 1) -> list:
    """The suite's problems; `shrink` divides every size (a machine without a GPU runs them
    at 1/32), `only` keeps those whose name holds one of its strings."""
    out = []
    for m, k, n, chain in PROBLEMS:
        m, k, n = max(1, m // shrink), max(32, k // shrink), max(32, n // shrink)
        name = f"{chain} {m}x{k}x{n}"
        if only and not any(o in name for o in only):
            continue

        def make(dev, m=m, k=k, n=n, chain=chain):
            model = ChainProblem(k, n, chain).to(dev)
            return model, [[torch.rand(m, k, device=dev)] for _ in range(input_sets)]
        out.append(Problem(name, make, 2.0 * m * k * n))
    b = dict(BLOCK) if shrink == 1 else dict(batch=2, tokens=32, n_embd=64, n_head=4)
    if not only or any(o in "gpt_block" for o in only):
        def make_block(dev):
            model = GPTBlock(b["n_embd"], b["n_head"], block_size=b["tokens"]).to(dev)
            return model, [[torch.randn(b["batch"], b["tokens"], b["n_embd"], device=dev)]
                           for _ in range(input_sets)]
        tokens, e = b["batch"] * b["tokens"], b["n_embd"]
        out.append(Problem(f"gpt_block {b['batch']}x{b['tokens']}x{e}", make_block,
                           2.0 * tokens * e * (3 * e + e + 4 * e + 4 * e)))
    return out


VARIANTS = ["eager", "gemmfuse-fp32", "gemmfuse-fast", "eager-bf16", "gemmfuse-bf16"]


def run_suite(cfg, dev, progress, base, only=None) -> list:
    """Every problem's records (as the reference models' bench writes them), each with its
    name under `problem`."""
    from .compare import calls_per_variant, finish, measure_all, reference
    from .timing import free
    probs = problems(cfg.input_sets, only, shrink=1 if dev.type == "cuda" else 32)
    tasks = {(p.name, v): progress.add_task(f"{p.name[:24]} {v}", total=calls_per_variant(cfg))
             for p in probs for v in VARIANTS}
    records = []
    for p in probs:
        torch.manual_seed(model_seed(cfg.seed + 1000, p.name))
        model, sets = p.make(dev)
        ref, ref_state = reference(model, sets)
        rows = measure_all(VARIANTS, model, sets, ref, ref_state, cfg, dev, progress,
                            {v: tasks[(p.name, v)] for v in VARIANTS})
        for rec in rows:
            rec.update(base, model=p.name, problem=p.name, flops=p.flops,
                       timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            if rec.get("ms"):
                rec["tflops"] = p.flops / (rec["ms"] * 1e-3) / 1e12
        records += finish(rows)
        del model, sets, ref
        free(dev)
    return records


def summary(records) -> dict:
    """The suite's targets: the lowest speedup per mode, the medians, and the block's figures."""
    out = {}
    for mode in ("gemmfuse-fp32", "gemmfuse-fast", "gemmfuse-bf16"):
        sp = [r["speedup_vs_eager"] for r in records
              if r["mode"] == mode and r.get("speedup_vs_eager") and not r["model"].startswith("gpt_block")]
        if sp:
            low = min((r["speedup_vs_eager"], r["model"]) for r in records
                      if r["mode"] == mode and r.get("speedup_vs_eager")
                      and not r["model"].startswith("gpt_block"))
            out[mode] = {"median": statistics.median(sp), "min": low[0], "min_problem": low[1],
                         "below_0.98": sum(s < 0.98 for s in sp), "problems": len(sp)}
    block = {r["mode"]: r.get("speedup_vs_eager") for r in records if r["model"].startswith("gpt_block")}
    if block:
        out["gpt_block"] = block
    return out

"""Command line of the benchmark: `python -m bench ...` from the repository root (`make bench`;
see `python -m bench -h`)."""
from __future__ import annotations

import argparse


def _list(s):
    return [x.strip() for x in s.split(",") if x.strip()]


def parser():
    p = argparse.ArgumentParser(prog="python -m bench",
                                description="time the seed models (or the suite, the zoo, the "
                                            "host cost): eager, torch.compile, gemmfuse")
    b = p
    b.add_argument("--models", type=_list, default=None, help="comma list (default: all five)")
    b.add_argument("--modes", type=_list, default=None,
                   help="gemmfuse precisions, comma list of fp32,fast,tf32 (default: all)")
    b.add_argument("--batch", type=int, help="M (default 1024 on a GPU, 64 on the CPU)")
    b.add_argument("--in-features", type=int, help="K (default 8192 on a GPU, 1024 on the CPU)")
    b.add_argument("--out-features", type=int, help="N (default 8192 on a GPU, 1024 on the CPU)")
    b.add_argument("--repeats", type=int, default=None,
                   help="timed calls per round (default 20 on a GPU, 100 on the CPU); the median "
                        "over all rounds is reported")
    b.add_argument("--warmup", type=int, default=3, help="untimed calls at the start of each round")
    b.add_argument("--warmup-ms", type=float, default=None,
                   help="on a GPU, at least this much time of untimed calls in each round after "
                        "the first (default 20, bench.WARMUP_MS; 5000 times every variant at the "
                        "clock its own sustained load settles to)")
    b.add_argument("--rounds", type=int, default=None,
                   help="rounds alternating over a model's variants (each round: warm-up, then "
                        "the timed calls of each variant in turn; default 4 on a GPU, 8 on the CPU)")
    b.add_argument("--input-sets", type=int, default=3, help="input sets rotated while timing")
    b.add_argument("--out", help="JSON path (default bench/out/<time>-<device>.json); the PNG "
                                 "chart and the log are written beside it")
    b.add_argument("--record", action="store_true",
                   help="also make this run the device kind's latest record in bench/results "
                        "(<kind>.json, .png, .log) and add its speedups to bench/results/history.csv")
    c = b.add_mutually_exclusive_group()
    c.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                   help="skip torch.compile")
    c.add_argument("--compile", dest="compile", action="store_true",
                   help="include torch.compile on the CPU too")
    b.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the bf16 variants")
    b.add_argument("--train", action="store_true",
                   help="training through the reference models: forward + backward with and "
                        "without x's gradient, and a full AdamW(fused) step (bench/train.py)")
    b.add_argument("--suite", action="store_true",
                   help="the suite of Linear -> chain problems and a transformer block "
                        "(bench/suite.py) instead of the five reference models")
    b.add_argument("--suite-only", type=_list, default=None,
                   help="with --suite: only the problems whose name holds one of these")
    b.add_argument("--matmul", action="store_true",
                   help="bare fp32 matrix products (mm, bmm): eager fp32 and TF32 against "
                        "gemmfuse.fp32_matmul in fp32 and fast precision (bench/matmul.py)")
    b.add_argument("--matmul-shapes", type=_list, default=None,
                   help="with --matmul: only these shapes, by name (sq4096, m16, bmm8x2048, ...)")
    b.add_argument("--lmhead", action="store_true", help=(
        "an LM head's Linear + cross-entropy, forward and backward, with peak memory: eager, "
        "TF32, torch.compile and gemmfuse.linear_cross_entropy (bench/lm_head.py)"))
    b.add_argument("--lmhead-shapes", type=_list, default=None, help=(
        "with --lmhead: only these shapes, by name (gpt2, gpt2x2, llama, llama3, m256v1000, ...)"))
    b.add_argument("--attention", action="store_true", help=(
        "fp32 attention (SDPA), forward and forward + backward: eager, TF32 math, torch.compile "
        "and gemmfuse's attention kernels (bench/attention.py)"))
    b.add_argument("--attention-shapes", type=_list, default=None, help=(
        "with --attention: only these shapes, by name (s1024d64, s1024d64:train, s64d32, ...)"))
    b.add_argument("--sweep", action="store_true",
                   help="also m99's chain at M in 1,16,128,1024,4096 (K=N=8192 on a GPU)")
    b.add_argument("--sweep-m", type=lambda s: [int(x) for x in _list(s)], help="M values")
    b.add_argument("--host", action="store_true",
                   help="host time per fused chain call against a plain PyTorch op, with and "
                        "without autograd: a 16-chain narrow MLP at tiny shapes (bench/host.py)")
    z = b.add_argument_group("model zoo (--zoo; bench/zoo.py)")
    z.add_argument("--zoo", action="store_true",
                   help="the model zoo instead of the seed models: 12 architectures at a "
                        "launch-bound and a compute-bound batch, fp32 and bf16, forward and "
                        "training step; eager, torch.compile, optimize() and the compile backend")
    z.add_argument("--zoo-models", type=_list, default=None, help="comma list (default: all)")
    z.add_argument("--zoo-batches", type=_list, default=None,
                   help="tiny,small,large (default small,large on a GPU, tiny on the CPU)")
    z.add_argument("--zoo-dtypes", type=_list, default=None, help="fp32,bf16 (default both)")
    z.add_argument("--zoo-phases", type=_list, default=None, help="forward,train (default both)")
    z.add_argument("--zoo-variants", type=_list, default=None,
                   help="eager,compile,optimize,backend,max-autotune (default all but "
                        "max-autotune on a GPU, eager,optimize on the CPU, where Inductor's "
                        "compiles take long; eager always runs: the speedups divide its time)")
    z.add_argument("--zoo-max-autotune", action="store_true",
                   help="add torch.compile(mode='max-autotune') to the variants (long compiles)")
    z.add_argument("--zoo-merge", nargs="+", metavar="JSON", default=None,
                   help="no run: merge zoo records made in parts on one kind of GPU into --out "
                        "(JSON, table, PNG and log)")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    b.add_argument("--seed", type=int, default=0)
    return p


def _zoo_args(cfg, args):
    from .zoo_runner import DEFAULT_VARIANTS
    cfg.zoo = True
    cfg.zoo_models, cfg.zoo_batches = args.zoo_models, args.zoo_batches
    cfg.zoo_dtypes, cfg.zoo_phases, cfg.zoo_variants = args.zoo_dtypes, args.zoo_phases, args.zoo_variants
    if args.zoo_max_autotune:
        cfg.zoo_variants = list(cfg.zoo_variants or DEFAULT_VARIANTS) + ["max-autotune"]


def _zoo_merge(args):
    import sys
    from types import SimpleNamespace

    from rich.console import Console

    from .zoo_report import merge
    if not args.out:
        raise SystemExit("--zoo-merge needs --out (the merged JSON's path)")
    console = Console(width=None if sys.stdout.isatty() else 160, record=True)
    merge(args.zoo_merge, args.out, console, SimpleNamespace(record=args.record))
    return 0


def _config(args):
    """The run's Config from the arguments (the seed models, suite, training or zoo run)."""
    from .runner import Config
    from .timing import WARMUP_MS
    if (args.rounds is not None and args.rounds < 1) or (args.repeats is not None and args.repeats < 1):
        raise SystemExit("--rounds and --repeats must be at least 1")
    if sum(map(bool, (args.matmul, args.lmhead, args.attention))) > 1:
        raise SystemExit("--matmul, --lmhead and --attention are separate runs: pass one")
    warmup_ms = WARMUP_MS if args.warmup_ms is None else args.warmup_ms
    if warmup_ms < 0:
        raise SystemExit("--warmup-ms must not be negative")
    cfg = Config(repeats=args.repeats, warmup=args.warmup, warmup_ms=warmup_ms,
                 rounds=args.rounds, input_sets=args.input_sets,
                 batch=args.batch, in_features=args.in_features,
                 out_features=args.out_features, out=args.out, record=args.record,
                 compile=args.compile,
                 bf16=args.bf16, sweep=args.sweep, sweep_m=args.sweep_m,
                 suite=args.suite, suite_only=args.suite_only, train=args.train,
                 matmul=args.matmul, matmul_shapes=args.matmul_shapes,
                 lmhead=args.lmhead, lmhead_shapes=args.lmhead_shapes,
                 attention=args.attention, attention_shapes=args.attention_shapes,
                 device=args.device, seed=args.seed)
    if args.models:
        cfg.models = args.models
    if args.zoo:
        _zoo_args(cfg, args)
    if args.modes is not None:
        cfg.modes = args.modes
    return cfg


def main(argv=None):
    args = parser().parse_args(argv)
    if args.zoo_merge:
        return _zoo_merge(args)
    if args.host:
        from .host import main as host_main
        return host_main(args.device, args.out)
    from .runner import run
    run(_config(args))
    return 0

"""m99 in bf16 (Linear -> gelu -> softmax) at the seed shape for inputs of several scales:
eager bf16 against gemmfuse, same process, same inputs, both against one float64 reference.

The seed inputs (x uniform [0, 1), W uniform +-1/sqrt(K)) give pre-activations u = xW + b of
std ~0.33; the fused sm90 kernel's epilogue chooses its gelu form per warp from the range of
its values (docs/measurements.md), so its speed can depend on the data. This probe shows
how much.
    python3 -m bench.micro.data_range_probe [--scales rand 1 2 4 16]
"""
import argparse
import json

import torch

import gemmfuse
from bench.compare import errors
from bench.timing import time_calls
from bench.models import M99

B, K, N = 1024, 8192, 8192


def inputs(kind, n_sets, dev):
    """x of one distribution: 'rand' (the seed's), or a number s: s * randn."""
    if kind == "rand":
        return [(torch.rand(B, K, device=dev),) for _ in range(n_sets)]
    return [(float(kind) * torch.randn(B, K, device=dev),) for _ in range(n_sets)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scales", nargs="+", default=["rand", "1", "2", "4", "16"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    records = []
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = M99(K, N).to(dev)
    print(f"{'x':>6} {'std u':>7} {'|u|>2':>8} {'|u|>2.83':>9} {'eager ms':>9} {'gemmfuse ms':>12} "
          f"{'ratio':>6} {'eager rel':>10} {'gemmfuse rel':>13}")
    for kind in args.scales:
        sets = inputs(kind, 3, dev)
        with torch.no_grad():
            u = model.linear(sets[0][0])
            ref = model.double()(sets[0][0].double())
            model.float()
        frac2 = float((u.abs() > 2).float().mean())
        frac28 = float((u.abs() > 2.8284271).float().mean())
        m16 = M99(K, N).to(dev)
        m16.load_state_dict(model.state_dict())
        m16 = m16.to(torch.bfloat16)
        xs = [[x.to(torch.bfloat16) for x in s] for s in sets]
        opt = gemmfuse.optimize(m16, tuple(xs[0]))
        row = {}
        with torch.no_grad():
            for name, fn in (("eager", m16), ("gemmfuse", opt)):
                err = errors(fn(*xs[0]), ref)
                t = time_calls(fn, xs, 3, args.repeats, dev)
                row[name] = (t["ms"], err["rel_err"])
        print(f"{kind:>6} {float(u.std()):7.3f} {frac2:8.2e} {frac28:9.2e} {row['eager'][0]:9.4f} "
              f"{row['gemmfuse'][0]:12.4f} {row['eager'][0] / row['gemmfuse'][0]:6.3f} "
              f"{row['eager'][1]:10.2e} {row['gemmfuse'][1]:13.2e}", flush=True)
        records.append({"model": "m99", "dtype": "bfloat16", "x": kind, "std_u": float(u.std()),
                        "frac_abs_u_gt_2": frac2, "frac_abs_u_gt_2sqrt2": frac28,
                        "eager_ms": row["eager"][0], "gemmfuse_ms": row["gemmfuse"][0],
                        "speedup_vs_eager": row["eager"][0] / row["gemmfuse"][0],
                        "eager_rel_err": row["eager"][1], "rel_err": row["gemmfuse"][1],
                        "gpu": torch.cuda.get_device_name()})
        del opt, m16, xs, sets, ref, u
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"records": records}, f, indent=1)


if __name__ == "__main__":
    main()

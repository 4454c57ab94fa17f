"""fp32 mode against eager fp32 over GEMM shapes away from the seed's: where does the f16x3
tensor-core path (sm90; from 33 rows and K = 128, where its cost rule says so) stop paying for its fixed costs (the x split, the fix-up
launch, the host's TMA descriptors)? Linear(K, N) -> relu, x uniform [0, 1), each shape's
error against float64 too. Run once as is and once with GEMMFUSE_F16X3=0 (the SGEMM path)
to compare the two paths.
    python3 -m bench.micro.fp32_path_sweep [--precision fast] [--shapes MxKxN,...] [--out F]
"""
import argparse
import json

import torch
from torch import nn

import gemmfuse
from bench.compare import errors
from bench.timing import time_calls

SHAPES = [(m, k, n) for m in (256, 1024, 4096) for k, n in
          ((256, 256), (512, 512), (1024, 1024), (2048, 2048), (4096, 4096),
           (256, 8192), (8192, 256))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32", help="gemmfuse's mode (fp32, fast or tf32)")
    ap.add_argument("--shapes", help="MxKxN,... instead of the default grid")
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else SHAPES)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    print(f"{'M':>5} {'K':>5} {'N':>5} {'eager ms':>9} {'gemmfuse ms':>12} {'ratio':>6} "
          f"{'eager rel':>10} {'gemmfuse rel':>13}  gemm", flush=True)
    for m, k, n in shapes:
        model = nn.Sequential(nn.Linear(k, n), nn.ReLU()).to(dev)
        sets = [(torch.rand(m, k, device=dev),) for _ in range(4)]
        opt = gemmfuse.optimize(model, sets[0], precision=args.precision)
        text = gemmfuse.explain(opt, print_it=False)
        gemm = ("f16x3" if "runs on fp16 tensor cores" in text else
                "fast split" if "fast Gemm splits" in text else "cuBLAS")
        if "ranges on as many SMs" in text:
            gemm += " split-K"
        with torch.no_grad():
            ref = model.double()(sets[0][0].double())
            model.float()
            e_err = errors(model(*sets[0]), ref)["rel_err"]
            g_err = errors(opt(*sets[0]), ref)["rel_err"]
            t_e = time_calls(model, sets, 5, 30, dev)["ms"]
            t_g = time_calls(opt, sets, 5, 30, dev)["ms"]
        print(f"{m:5d} {k:5d} {n:5d} {t_e:9.4f} {t_g:12.4f} {t_e / t_g:6.2f} {e_err:10.2e} "
              f"{g_err:13.2e}  {gemm}", flush=True)
        rows.append({"M": m, "K": k, "N": n, "eager_ms": t_e, "gemmfuse_ms": t_g,
                     "speedup_vs_eager": t_e / t_g, "eager_rel_err": e_err, "rel_err": g_err,
                     "gemm": gemm})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "precision": args.precision,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

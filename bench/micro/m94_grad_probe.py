"""Which gradient elements set m94's train-bench verdict (gemmfuse fp32's gradient error over
eager's)? At the train bench's shape and seeding: each gradient's error against float64 for
both; the elements within 1e-5 of Hardtanh's corners and eager's flips there; the rows of
x's gradient and the channels of the bias's gradient that carry the most error, with the
nearest-to-corner values and group variances there; and the Linear + bias + clamp forward
alone through gemmfuse (its error and corner flips). Other seeds give the verdict's spread.
Usage: python3 -m bench.micro.m94_grad_probe [seeds]   (GPU: 1024 x 8192 x 8192)"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import gemmfuse
from bench.models import MODELS, model_seed
from bench.train import Variant, _grad_errors

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
B, K, N = (1024, 8192, 8192) if DEV.type == "cuda" else (256, 1024, 8192)
GROUP = 32  # channels per group at N = 8192, 256 groups


def build(base):
    torch.manual_seed(model_seed(base, "m94"))
    spec = MODELS["m94"]
    model, _ = spec.make(B, K, N, device=DEV)
    sets = [spec.cls.get_inputs(B, K, device=DEV)[0] for _ in range(2)]
    gys = [torch.randn(B, N, device=DEV) for _ in range(2)]
    return model, sets, gys


def verdicts(base):
    model, sets, gys = build(base)
    g64 = Variant("float64", model, sets, gys, DEV).grads()
    ge = Variant("eager", model, sets, gys, DEV).grads()
    go = Variant("gemmfuse-fp32", model, sets, gys, DEV).grads()
    eo, ee = _grad_errors(go, g64), _grad_errors(ge, g64)
    print(f"seed base {base}: " + "  ".join(f"{p} {eo[p]:.2e}/{ee[p]:.2e}={eo[p] / ee[p]:.2f}"
                                            for p in eo), flush=True)
    return model, sets, go, ge, g64


def pre_activation(model, x):
    """x W^T + b + bias (Hardtanh's input) in x's dtype."""
    m = model.to(x.dtype)
    with torch.no_grad():
        return F.linear(x, m.gemm.weight, m.gemm.bias) + m.bias


def where_errors_sit(model, x, go, ge, g64):
    z64 = pre_activation(model, x.double())
    z32 = pre_activation(model, x.float())
    model.float()
    corner = (z64.abs() - 1).abs()
    flips = (z32.double().abs() > 1) != (z64.abs() > 1)
    print(f"  within 1e-5 of the corners: {int((corner < 1e-5).sum())}; eager's flips: {int(flips.sum())} "
          f"at {[(int(r), int(c)) for r, c in zip(*flips.nonzero(as_tuple=True))][:8]}")
    var = F.mish(F.hardtanh(z64)).view(B, -1, GROUP).var(dim=2, unbiased=False)
    print(f"  group variance: min {float(var.min()):.3e}")
    for name, got in (("gemmfuse", go), ("eager", ge)):
        rows = (got["x"] - g64["x"]).norm(dim=1)
        chans = (got["bias"] - g64["bias"]).abs()
        top_r, top_c = rows.topk(4).indices.tolist(), chans.topk(4).indices.tolist()
        share = float((rows.topk(4).values ** 2).sum() / (rows ** 2).sum())
        print(f"  {name}: x-grad rows {top_r} (share of err² {share:.2f}), nearest corner there "
              f"{[f'{float(corner[r].min()):.1e}' for r in top_r]}; bias-grad channels {top_c}, "
              f"nearest corner there {[f'{float(corner[:, c].min()):.1e}' for c in top_c]}")


class LinearClamp(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.gemm, self.bias = m.gemm, m.bias

    def forward(self, x):
        return torch.clamp(self.gemm(x) + self.bias, -1, 1)


def forward_alone(model, x):
    """Linear + bias + clamp through gemmfuse fp32, no_grad and under autograd."""
    ref = pre_activation(model, x.double()).clamp(-1, 1)
    model.float()
    lin = LinearClamp(model)
    with torch.no_grad():
        eager = lin(x)
    for grad in (False, True):
        opt = gemmfuse.optimize(lin, (x,), precision="fp32")
        with torch.set_grad_enabled(grad):
            out = opt(x).detach()
        err = [float((o.double() - ref).norm() / ref.norm()) for o in (out, eager)]
        flips = [int(((o.double().abs() >= 1) != (ref.abs() >= 1)).sum()) for o in (out, eager)]
        print(f"  Linear+bias+clamp (grad={grad}): error gemmfuse {err[0]:.2e} eager {err[1]:.2e}; "
              f"corner flips {flips[0]} / {flips[1]}")


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    model, sets, go, ge, g64 = verdicts(0)
    where_errors_sit(model, sets[0], go, ge, g64)
    forward_alone(model, sets[0])
    for base in range(1, int(sys.argv[1]) if len(sys.argv) > 1 else 4):
        verdicts(base)


if __name__ == "__main__":
    main()

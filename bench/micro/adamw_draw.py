"""Whether a training test's "W after three AdamW steps, within 1.25x eager's error against
float64" measures fidelity or a draw. A variant more accurate than eager (each GEMM in
float64, rounded to fp32; the rest eager fp32) against eager fp32 on m94 at the compile
test's shape, over seeds, for two losses:
  square      mean(out²): for a GroupNorm output almost constant in its input (the sum of
              x^² over a group is its size, up to eps), so its gradients are rounding noise
              that AdamW turns into ±lr steps
  projection  mean(out * gy), gy a fixed random tensor per step (the test's loss)
and, with the projection, each step's gradients at the same weights (eager and float64 copies
of the accurate variant's model as it stands: the compile test's check).
A ratio above 1.25 for the more accurate variant is the test failing by chance.
Usage: python -m bench.micro.adamw_draw [seeds]   (CPU, about 20 s a seed)"""
import copy
import sys

import torch

from bench.models import MODELS

B, K, N = 512, 1024, 4096


class Float64Linear(torch.autograd.Function):
    """x Wᵀ + b and its gradients computed in float64, rounded to fp32."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return (x.double() @ w.double().T + b.double()).float()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.double()
        return (g @ w.double()).float(), (g.T @ x.double()).float(), g.sum(0).float()


def accurate(m):
    def forward(x):
        z = Float64Linear.apply(x, m.gemm.weight, m.gemm.bias) + m.bias
        return m.groupnorm(m.mish(m.hardtanh(z)))
    return forward


def train(model, forward, xs, gys, loss):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, gy in zip(xs, gys):
        opt.zero_grad(set_to_none=True)
        out = forward(x)
        (out ** 2 if loss == "square" else out * gy.to(out.dtype)).mean().backward()
        opt.step()


def rel(a, b):
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm())


def m94(seed):
    """m94 at the compile test's shape (32 channels a group), its weights drawn from `seed`;
    the torch generator then goes on to the inputs."""
    torch.manual_seed(seed)
    cls = MODELS["m94"].cls
    return cls(*cls.get_init_inputs(K, N, groups=N // 32))


def ratios(seed, loss):
    model = m94(seed)
    xs = [torch.rand(B, K) for _ in range(3)]
    gys = [torch.randn(B, N) for _ in range(3)]
    eager, acc, m64 = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model).double()
    train(eager, eager, xs, gys, loss)
    train(acc, accurate(acc), xs, gys, loss)
    train(m64, m64, [x.double() for x in xs], gys, loss)
    return {n: rel(p, r) / rel(q, r) for (n, p), (_, q), (_, r) in
            zip(acc.named_parameters(), eager.named_parameters(), m64.named_parameters())}


def grads(model, forward, x, gy):
    for p in model.parameters():
        p.grad = None
    (forward(x) * gy.to(x.dtype)).mean().backward()
    return [p.grad for p in model.parameters()]


def same_weight_ratios(seed):
    """The worst step's gradient error over eager's, per parameter, at the same weights."""
    acc = m94(seed)
    opt = torch.optim.AdamW(acc.parameters(), lr=1e-3)
    worst = {}
    for _ in range(3):
        x, gy = torch.rand(B, K), torch.randn(B, N)
        eager, m64 = copy.deepcopy(acc), copy.deepcopy(acc).double()
        ge, g64 = grads(eager, eager, x, gy), grads(m64, m64, x.double(), gy.double())
        ga = grads(acc, accurate(acc), x, gy)
        for (n, _), a, e, r in zip(acc.named_parameters(), ga, ge, g64):
            worst[n] = max(worst.get(n, 0.0), rel(a, r) / rel(e, r))
        opt.step()
    return worst


def main():
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    for loss in ("square", "projection"):
        for seed in range(seeds):
            r = ratios(seed, loss)
            print(f"{loss:10s} seed {seed}: accurate/eager W error  " +
                  "  ".join(f"{n} {v:.2f}" for n, v in r.items()), flush=True)
    for seed in range(seeds):
        r = same_weight_ratios(seed)
        print(f"same weights seed {seed}: accurate/eager gradient error (worst step)  " +
              "  ".join(f"{n} {v:.2f}" for n, v in r.items()), flush=True)


if __name__ == "__main__":
    main()

"""Whether fp32 attention on split fp16 products keeps fp32's accuracy, before any kernel is
written (issue 48, item 3): the forward and every gradient of softmax(Q Kᵀ s + mask) V with
each of the five products (S = Q Kᵀ, O = P V; dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q)
emulated as the f16x3 kernel computes one, against float64 and against eager fp32 (PyTorch's
math on the CPU), and with 3xTF32 products, as eager fp32 SDPA's memory-efficient kernel
computes them on an H100.

The emulation (CPU, float32 arithmetic on fp16-rounded parts, whose products are exact in
fp32): each operand is scaled by a power of two per row of the contraction (A per row, B per
column), split into an fp16 high part and a low part 2^11 larger, and the product is
hi·hi + 2^-11 (hi·lo + lo·hi), unscaled. The variants differ in how P (in [0, 1]) and dS are
scaled before their split: per row like any operand ("row"), or not at all ("none": P's
values below 2^-14 fall into fp16's subnormals).

    python3 -m bench.micro.attention_split_study [--seq 512] [--dim 64] [--sharp 4] [--grad-scale 1e-6]
"""
from __future__ import annotations

import argparse

import torch

SMALL = 2.0 ** -11


def split(t, reduce_dim, scaled=True):
    """(hi, lo, e): t 2^e = hi + 2^-11 lo, both fp16-rounded, e per slice along reduce_dim
    putting the slice's largest magnitude just under 2^15 (scaled "head": one e over each
    head's matrix; False: e = 0)."""
    if scaled:
        dims = (-2, -1) if scaled == "head" else reduce_dim
        amax = t.abs().amax(dim=dims, keepdim=True)
        e = torch.where(amax > 0, 14 - torch.floor(torch.log2(amax)), torch.zeros_like(amax))
    else:
        e = torch.zeros_like(t.narrow(reduce_dim, 0, 1))
    s = t * torch.exp2(e)
    hi = s.half().float()
    lo = ((s - hi) / SMALL).half().float()
    return hi, lo, e


def mm3(a, b, scale_a=True, scale_b=True):
    """a [..., m, k] @ b [..., k, n] as the f16x3 kernel computes it."""
    ah, al, ea = split(a, -1, scale_a)
    bh, bl, eb = split(b, -2, scale_b)
    acc = ah @ bh + (ah @ bl + al @ bh) * SMALL
    return acc * torch.exp2(-(ea + eb))


def attention(q, k, v, scale, mask, mm, p_scaled=True, ds_scaled=None):
    """Forward and the backward's formulas with `mm` for every product; returns (o, grads)
    for dO = g, the backward written out (the flash backward's order). P's split scaled as
    p_scaled says, dS's as ds_scaled does (None: as P's)."""
    ds_scaled = p_scaled if ds_scaled is None else ds_scaled

    def backward(g):
        dv = mm(p.transpose(-1, -2), g, p_scaled, True)
        dp = mm(g, v.transpose(-1, -2))
        delta = (g * o).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        e = 0.0
        if ds_scaled == "bound":  # one exponent per head, from |dS| <= 2 D max|dO| max|V|
            bound = 2 * q.shape[-1] * g.abs().amax((-2, -1), keepdim=True) * v.abs().amax(
                (-2, -1), keepdim=True)
            e = 14 - torch.floor(torch.log2(bound))
            ds = ds * torch.exp2(e)
        ds_mode = False if ds_scaled == "bound" else ds_scaled
        dq = mm(ds, k, ds_mode, True) * scale * torch.exp2(-torch.as_tensor(e))
        dk = mm(ds.transpose(-1, -2), q, ds_mode, True) * scale * torch.exp2(-torch.as_tensor(e))
        return dq, dk, dv
    s = mm(q, k.transpose(-1, -2)) * scale + mask
    p = torch.softmax(s, dim=-1)
    o = mm(p, v, p_scaled, True)
    return o, backward


def exact(a, b, *_):
    return a @ b


def tf32(t):
    """t rounded to TF32 (10 explicit mantissa bits, nearest, ties away: cvt.rna.tf32.f32)."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def mm_3xtf32(a, b, *_):
    """a @ b as CUTLASS's 3xTF32 (OpMultiplyAddFastF32) computes it: big = tf32(v), small =
    tf32(v - big), big·big + big·small + small·big in fp32. Eager fp32 SDPA on an H100 runs the
    memory-efficient kernel, whose products are these."""
    ab, bb = tf32(a), tf32(b)
    return ab @ bb + (ab @ tf32(b - bb) + tf32(a - ab) @ bb)


def rel(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


def study(batch, heads, seq, dim, sharp, causal, grad_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, go = (torch.randn(batch, heads, seq, dim, generator=g) for _ in range(4))
    q, go = q * sharp, go * grad_scale
    scale = dim ** -0.5
    mask = torch.zeros(seq, seq)
    if causal:
        mask = mask.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    o64, bw64 = attention(q.double(), k.double(), v.double(), scale, mask.double(), exact)
    ref = (o64,) + bw64(go.double())
    o32, bw32 = attention(q, k, v, scale, mask, exact)
    eager = (o32,) + bw32(go)
    rows = {"eager fp32": eager}
    o, bw = attention(q, k, v, scale, mask, mm_3xtf32)
    rows["3xTF32 (eager's on an H100)"] = (o,) + bw(go)
    for name, p_scaled, ds_scaled in (("f16x3, P and dS scaled per row", True, True),
                                      ("f16x3, P and dS unscaled", False, False),
                                      ("f16x3, P unscaled, dS per head", False, "head"),
                                      ("f16x3, dS per head from a bound", False, "bound")):
        o, bw = attention(q, k, v, scale, mask, mm3, p_scaled, ds_scaled)
        rows[name] = (o,) + bw(go)
    names = ("O", "dQ", "dK", "dV")
    print(f"\nB={batch} H={heads} seq={seq} d={dim} sharpness {sharp} {'causal' if causal else 'full'}"
          f" dO x {grad_scale:g}: error against float64 (and over eager fp32's)")
    for name, outs in rows.items():
        cells = [f"{n} {rel(t, r):.2e} ({rel(t, r) / rel(e, r):.2f})"
                 for n, t, r, e in zip(names, outs, ref, eager)]
        print(f"  {name:32s} " + "  ".join(cells))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--sharp", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--grad-scale", type=float, default=1.0,
                    help="dO's scale (a training loss's gradients are small: 1e-6 and below)")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    for sharp in a.sharp:
        for causal in (False, True):
            study(a.batch, a.heads, a.seq, a.dim, sharp, causal, a.grad_scale)


if __name__ == "__main__":
    main()

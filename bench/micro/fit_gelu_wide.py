"""Coefficients of the fused sm90 kernel's full-range gelu (executors/common/pointwise.h,
gelu_erf_wide_n), and their error as fp32 code evaluates them.

gelu(u) = u Phi(u) = relu(u) - g(|u|), g(a) = a Phi(-a) = a erfc(a / sqrt 2) / 2: g rises from
0, peaks at 0.17 and decays like a Gaussian, so a polynomial of z = min(2a / A - 1, 1) in
[-1, 1] covers every finite u, with g(a) <= g(A) ignored past A. The fit minimaxes the
absolute error (Lawson-weighted least squares on Chebyshev nodes, Chebyshev basis), then
takes the monomial coefficients in z (well conditioned on [-1, 1], unlike powers of a).
    python3 -m bench.micro.fit_gelu_wide [--clamp 4.75] [--degree 11] (the committed coefficients)
"""
import argparse

import numpy as np
from numpy.polynomial import chebyshev as C
from scipy.special import erfc


def g(a):
    return a * 0.5 * erfc(a / np.sqrt(2.0))


def fit(clamp, degree, iters=400, n=6000):
    z = np.cos(np.linspace(0.0, np.pi, n))
    a = (z + 1.0) * clamp / 2.0
    V, y, w = C.chebvander(z, degree), g(a), np.full(n, 1.0 / n)
    for _ in range(iters):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(V * sw[:, None], y * sw, rcond=None)
        e = np.abs(V @ c - y)
        w = w * e + 1e-300
        w /= w.sum()
    return C.cheb2poly(c).astype(np.float32)  # monomials in z, increasing degree


def gelu_wide_fp32(u, coef, clamp):
    """What the kernel computes: fp32 FMAs (a product of two fp32 values is exact in fp64)."""
    f32 = np.float32
    u = u.astype(f32)
    z = np.minimum((np.abs(u).astype(np.float64) * f32(2.0 / clamp) - 1.0).astype(f32), f32(1.0))
    q = np.full_like(u, coef[-1])
    for c in coef[-2::-1]:
        q = (q.astype(np.float64) * z + c).astype(f32)
    return (np.maximum(u, f32(0.0)).astype(np.float64) - q).astype(f32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clamp", type=float, default=4.75)
    ap.add_argument("--degree", type=int, default=11)
    args = ap.parse_args()
    coef = fit(args.clamp, args.degree)
    u = np.concatenate([np.linspace(-40.0, 40.0, 800001), np.geomspace(40.0, 3e38, 2001)])
    u = np.concatenate([u, -u]).astype(np.float32)
    exact = u.astype(np.float64) * 0.5 * erfc(-u.astype(np.float64) / np.sqrt(2.0))
    err = np.abs(gelu_wide_fp32(u, coef, args.clamp) - exact)
    big = np.abs(u) > 40
    print(f"clamp {args.clamp}, degree {args.degree}: max abs error {err[~big].max():.2e} on "
          f"[-40, 40]; max error / |u| past 40: {(err[big] / np.abs(u[big])).max():.1e}")
    print("coefficients (highest degree first):")
    print(", ".join(f"{c:.9e}f" for c in coef[::-1]))


if __name__ == "__main__":
    main()

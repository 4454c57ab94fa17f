"""What an fp32 attention kernel must beat (issue 48, item 3: fwd+bwd >= 3x eager fp32 SDPA):
PyTorch's SDPA in fp32 by backend (the default pick, the memory-efficient kernel with its 3xTF32
products, the math path on cuBLAS SGEMM), torch.compile of it, bf16 flash as the tensor
cores' reference, and gemmfuse's split-product kernel (through ``gemmfuse.fp32_matmul()``), forward and forward + backward, with their TFLOP/s (the four products of the
forward, 4·B·H·S²·d, halved for causal; the backward 2.5× the forward's) and the forward's error
against float64.

    python3 -m bench.micro.attention_baseline [--shapes 8x12x1024x64 8x12x4096x64 ...]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import gemmfuse
except ImportError:  # the baseline alone
    gemmfuse = None


def _count_delta(before, after):
    """Which way the switch's calls went while timing (gemmfuse's kernel or PyTorch's, with why)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

DEFAULT_SHAPES = ["8x12x1024x64", "8x12x1024x128", "4x12x4096x64", "8x12x512x64"]
VARIANTS = {
    "fp32 default": (torch.float32, None),
    "fp32 efficient": (torch.float32, SDPBackend.EFFICIENT_ATTENTION),
    "fp32 math": (torch.float32, SDPBackend.MATH),
    "fp32 compile": (torch.float32, "compile"),
    "bf16 flash": (torch.bfloat16, SDPBackend.FLASH_ATTENTION),
    "gemmfuse fp32": (torch.float32, "gemmfuse"),
}


def ms(fn, dev, n=10):
    """Median ms of n calls after 3, CUDA events on a GPU, the wall clock elsewhere."""
    import time
    for _ in range(3):
        fn()
    out = []
    for _ in range(n):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def run(shape, causal, dev):
    B, H, S, D = map(int, shape.split("x"))
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, go = (torch.randn(B, H, S, D, device=dev, generator=g) for _ in range(4))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    print(f"\n{shape} {'causal' if causal else 'full'}: forward {flops / 1e9:.1f} GFLOP")
    for name, (dtype, backend) in VARIANTS.items():
        if dev.type != "cuda" and (backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
                                   or dtype != torch.float32):
            continue
        if backend == "gemmfuse" and gemmfuse is None:
            continue
        a = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        sdpa = F.scaled_dot_product_attention
        fn = torch.compile(sdpa) if backend == "compile" else sdpa

        def fwd():
            if backend in (None, "compile"):
                return fn(*a, is_causal=causal)
            if backend == "gemmfuse":  # the backward runs inside the switch too (fwd_bwd)
                with gemmfuse.fp32_matmul():
                    return fn(*a, is_causal=causal)
            with sdpa_kernel(backend):
                return fn(*a, is_causal=causal)

        def fwd_bwd():
            if backend == "gemmfuse":
                with gemmfuse.fp32_matmul():
                    return torch.autograd.grad(fwd(), a, go.to(dtype))
            return torch.autograd.grad(fwd(), a, go.to(dtype))
        try:
            with torch.no_grad():
                err = float((fwd().double() - ref).norm() / ref.norm())
                counts_before = dict(gemmfuse.fp32_matmul_counts()) if backend == "gemmfuse" else {}
                f_ms = ms(fwd, dev)
            t_ms = ms(fwd_bwd, dev)
        except Exception as e:  # a backend that declines the shape or dtype
            print(f"  {name:16s} {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            continue
        ran = ""
        if backend == "gemmfuse":
            ran = f"   ran: {_count_delta(counts_before, gemmfuse.fp32_matmul_counts())}"
        print(f"  {name:16s} fwd {f_ms:8.3f} ms {flops / f_ms / 1e9:7.1f} TFLOP/s   fwd+bwd "
              f"{t_ms:8.3f} ms {3.5 * flops / t_ms / 1e9:7.1f} TFLOP/s   fwd err {err:.1e}{ran}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    for shape in a.shapes or (DEFAULT_SHAPES if dev.type == "cuda" else ["1x2x128x32"]):
        for causal in (False, True):
            run(shape, causal, dev)


if __name__ == "__main__":
    main()

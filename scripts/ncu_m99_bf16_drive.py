"""Runs F.linear (cuBLAS) and gemmfuse's fused m99 kernel in bf16 at the seed shape, once each
inside an NVTX range "measure" after warm-up, so that ncu profiles those two calls alone
(bench/NOTES.md, session 20):
    PYTHONPATH=python GEMMFUSE_LIB=... ncu --nvtx --nvtx-include "measure/" --metrics M \\
        python3 scripts/ncu_m99_bf16_drive.py
"""
import torch
import torch.nn.functional as F

import gemmfuse
from gemmfuse.models import M99

torch.manual_seed(0)
model = M99(8192, 8192).cuda().to(torch.bfloat16)
x = torch.rand(1024, 8192, device="cuda").to(torch.bfloat16)
opt = gemmfuse.optimize(model, (x,))
w, b = model.linear.weight, model.linear.bias
with torch.no_grad():
    for _ in range(3):
        F.linear(x, w, b)
        opt(x)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("measure")
    F.linear(x, w, b)
    opt(x)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()

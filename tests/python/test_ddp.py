"""DistributedDataParallel through gemmfuse: two processes launched by torchrun train a seed
model under DDP next to eager and float64 copies (bench.ddp). On the CPU with gloo
(chains forced fused: at these shapes the CPU router would send them to PyTorch), and on two
GPUs with NCCL where there are."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import needs_lib, with_bench_path

pytestmark = needs_lib


def _torchrun(tmp_path, *args, env=None):
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(29500 + os.getpid() % 1000),
           "-m", "bench.ddp", "--out", str(out), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=with_bench_path({**os.environ, **(env or {})}), cwd=tmp_path)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p


@pytest.mark.parametrize("mid", ["m84", "m94"])
def test_ddp_cpu_gloo(tmp_path, mid):
    r, p = _torchrun(tmp_path, "--device", "cpu", "--model", mid, "--steps", "4", "--timed", "1",
                     "--rounds", "1", env={"GEMMFUSE_ALWAYS_FUSE": "1"})
    c = r["check"]
    assert c["ranks_equal"] and c["train_calls"] >= 4 and not c["fallbacks"], c
    assert c["pass"], c


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_two_gpus_nccl(tmp_path):
    r, p = _torchrun(tmp_path, "--device", "cuda", "--model", "m84", "--steps", "5", "--timed", "2",
                     "--rounds", "1", "--batch", "256", "--features", "1024")
    c = r["check"]
    assert r["header"]["backend"] == "nccl" and c["ranks_equal"] and not c["fallbacks"], c
    assert c["pass"], c

"""The device a run uses and what it records about it (GPU, CUDA, commit)."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def pick_device(want: str) -> torch.device:
    """--device: "cuda", "cpu", or "auto" (CUDA where there is a GPU)."""
    cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if cuda else "cpu")


def device_info(dev):
    info = {"device": dev.type, "torch": torch.__version__, "python": platform.python_version(),
            "host_cpu": platform.processor() or platform.machine()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=torch.cuda.get_device_name(dev), cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}", gpu_mem_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count)
    else:
        info["gpu"] = None
    info["git"] = _git_commit()
    return info


def _git_commit():
    """GEMMFUSE_GIT_COMMIT when set (the commit as the caller knows it, for a copied tree whose
    .git is not the one the code came from: scripts/device-run.sh), else this tree's HEAD."""
    if os.environ.get("GEMMFUSE_GIT_COMMIT"):
        return os.environ["GEMMFUSE_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except Exception:
        return None

"""Shared fixtures for the Python tests of gemmfuse's front (capture, optimize, backend, explain).

The operator library (build/lib/libgemmfuse_ops.so, or $GEMMFUSE_LIB) is needed by every test
that runs a chain; those tests skip when it is missing, unless GEMMFUSE_REQUIRE_LIB=1 (CI), in
which case they fail (`make test` sets it).
"""
import copy
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(ROOT))  # the benchmark package (bench/), which the wheel does not hold

# The CPU tests exercise the CPU executor on every chain, also where the planner would route
# the call to PyTorch as the faster (test_route.py checks that routing without this).
os.environ.setdefault("GEMMFUSE_ALWAYS_FUSE", "1")

import gemmfuse  # noqa: E402,F401
from gemmfuse import _lib  # noqa: E402

def with_bench_path(env: dict) -> dict:
    """`env` for a subprocess that imports the benchmark package (bench/ at the repository
    root, outside the wheel): the root leads PYTHONPATH."""
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


HAVE_LIB = _lib.available()
REQUIRE_LIB = os.environ.get("GEMMFUSE_REQUIRE_LIB") == "1"
HAVE_CUDA = torch.cuda.is_available()


def pytest_report_header(config):
    return [f"gemmfuse library: {_lib._loaded or 'MISSING'}; cuda: {HAVE_CUDA}; torch {torch.__version__}"]


needs_lib = pytest.mark.skipif(not (HAVE_LIB or REQUIRE_LIB),
                               reason="libgemmfuse_ops.so not built (make -C <repo> build)")
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")

# Small seed shapes (docs/models.md uses 1024 x 8192 x 8192).
SEED_B, SEED_K, SEED_N = 16, 96, 160
SEED_N94 = 256  # m94: 8 groups of 32 channels


def seed_ids():
    from bench.models import MODELS
    return list(MODELS)


def make_seed(mid, batch=SEED_B, k=SEED_K, n=None, device="cpu", seed=0):
    """(model, inputs) for seed model `mid` at small shapes; m94 keeps 32 channels per group."""
    from bench.models import MODELS
    torch.manual_seed(seed)
    spec = MODELS[mid]
    if n is None:
        n = SEED_N94 if mid == "m94" else SEED_N
    if mid == "m94":
        cls = spec.cls
        model = cls(*cls.get_init_inputs(k, n, groups=n // 32)).to(device)
        inputs = cls.get_inputs(batch, k, device=device)
    else:
        model, inputs = spec.make(batch, k, n, device=device)
    return model, inputs


def double_ref(model):
    """The same model in float64 (deep copy)."""
    return copy.deepcopy(model).double()


def rel(out, ref):
    """Relative error ||out - ref|| / ||ref||, in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def is_sm90():
    """The GPU is an H100/H200 (where fp32 mode's GEMM can take the f16x3 kernel)."""
    return torch.cuda.get_device_capability() == (9, 0)


# What explain (the plan) says when fp32 mode's GEMM runs on the sm90 f16x3 kernel.
F16X3_TEXT = "runs on fp16 tensor cores"


def explain_block(text, head):
    """The one line of explain's `text` starting with `head`, and the deeper-indented lines
    under it (e.g. an input shape's entry and its plan)."""
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith(head)]
    assert len(at) == 1, f"{head!r} in:\n{text}"
    depth = len(head) - len(head.lstrip())
    block = [lines[at[0]]]
    for line in lines[at[0] + 1:]:
        if len(line) - len(line.lstrip()) <= depth:
            break
        block.append(line)
    return block


def assert_close64(out, ref, atol=1e-4, rtol=1e-4, what=""):
    """out (any float dtype) against a float64 reference; NaN positions must match."""
    out64 = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert out64.shape == ref.shape, f"{what}: shape {tuple(out64.shape)} != {tuple(ref.shape)}"
    assert torch.equal(torch.isnan(out64), torch.isnan(ref)), f"{what}: NaN positions differ"
    torch.testing.assert_close(out64, ref, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches cleared before and after the test (its compiled graphs, guards)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()

"""Loading the C++ operator library (``libgemmfuse_ops.so``) into ``torch.ops.gemmfuse``.

Where it is looked for, in order:
  1. ``$GEMMFUSE_LIB`` (a path to the .so),
  2. the package's own folders (``pip install .`` puts it there),
  3. the files the installed distribution lists (``pip install -e .`` keeps it in
     site-packages while the Python sources stay in the checkout).

The library is loaded lazily, on first use, so that ``import gemmfuse`` (and the capture,
which is pure Python) works without it.
"""
from __future__ import annotations

import importlib.metadata
import os
import threading
from pathlib import Path

import torch

_LIB_NAME = "libgemmfuse_ops.so"
_lock = threading.Lock()
_loaded: str | None = None
_error: str | None = None


def candidates() -> list[Path]:
    out = []
    env = os.environ.get("GEMMFUSE_LIB")
    if env:
        out.append(Path(env))
    package = __import__(__package__)
    for folder in getattr(package, "__path__", [Path(__file__).resolve().parent]):
        out.append(Path(folder) / _LIB_NAME)
    try:
        out += [Path(f.locate()) for f in importlib.metadata.files("gemmfuse") or ()
                if f.name == _LIB_NAME]
    except importlib.metadata.PackageNotFoundError:
        pass
    return list(dict.fromkeys(p.resolve() for p in out))


class LibraryMissing(RuntimeError):
    """The operator library could not be found or loaded."""


def _already_registered() -> bool:
    try:
        torch.ops.gemmfuse.run  # noqa: B018  (raises when the namespace has no such op)
        return True
    except (AttributeError, RuntimeError):
        return False


def load() -> str:
    """Load the library once; return its path. Raises LibraryMissing with a clear message."""
    global _loaded, _error
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if _already_registered():  # loaded by someone else (e.g. a test harness)
            _loaded = "<already registered>"
            return _loaded
        tried = []
        env = os.environ.get("GEMMFUSE_LIB")
        for path in candidates():
            if not path.is_file():
                tried.append(f"{path} (not found)")
                if env and path == Path(env).resolve():
                    # An explicit GEMMFUSE_LIB that does not exist is an error, not a hint.
                    break
                continue
            try:
                torch.ops.load_library(str(path))
            except (OSError, RuntimeError) as e:  # wrong torch ABI, missing CUDA libs, ...
                tried.append(f"{path} ({type(e).__name__}: {e})")
                break
            _loaded = str(path)
            return _loaded
        _error = (
            "gemmfuse: the operator library libgemmfuse_ops.so could not be loaded. Install "
            "gemmfuse with `pip install .` (or `make build`) from its checkout, or point "
            "GEMMFUSE_LIB at the library. Tried:\n  " + "\n  ".join(tried))
        raise LibraryMissing(_error)


def available() -> bool:
    try:
        load()
        return True
    except LibraryMissing:
        return False


def ops():
    """``torch.ops.gemmfuse`` with the library loaded."""
    load()
    return torch.ops.gemmfuse


def check(spec: str) -> str:
    """'' when the C++ parser accepts the spec, else its reason."""
    return ops().check(spec)


def describe(spec, x, weight, bias, operands, state, precision) -> str:
    return ops().describe(spec, x, weight, bias, list(operands), list(state), precision)


def run(spec, x, weight, bias, operands, state, precision):
    return ops().run(spec, x, weight, bias, list(operands), list(state), precision)


UNSUPPORTED = "gemmfuse unsupported"


def is_unsupported(err: BaseException) -> bool:
    return UNSUPPORTED in str(err)


def unsupported_reason(err: BaseException) -> str:
    """The planner's reason from a 'gemmfuse unsupported: <reason>' error (first line)."""
    msg = str(err)
    i = msg.find(UNSUPPORTED)
    if i < 0:
        return msg.strip().splitlines()[0] if msg.strip() else type(err).__name__
    msg = msg[i + len(UNSUPPORTED):].lstrip(": ")
    return msg.strip().splitlines()[0] if msg.strip() else "unsupported"

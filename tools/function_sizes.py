"""The product's functions over the size rules (issue 46: at most about 80 lines, cyclomatic
complexity at most 20), measured with lizard; CUDA sources (.cu, .cuh) are read as C++.
A report for `make test` (it exits 0): `python tools/function_sizes.py [--max-lines N]
[--max-ccn N] [paths...]`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("python/gemmfuse", "core", "bindings", "executors")
SKIP = ()  # paths under PRODUCT that are not product code
SUFFIXES = {".py": ".py", ".cpp": ".cpp", ".h": ".h", ".cu": ".cpp", ".cuh": ".h"}


def files(paths):
    for p in paths:
        for f in sorted((ROOT / p).rglob("*")):
            rel = f.relative_to(ROOT).as_posix()
            if f.suffix in SUFFIXES and not rel.startswith(SKIP):
                yield f, rel


def oversized(paths, max_lines: int, max_ccn: int) -> list:
    """(file, line, function, lines, ccn) of every function over either limit."""
    import lizard
    out = []
    for f, rel in files(paths):
        name = f.with_suffix(SUFFIXES[f.suffix]).name  # lizard picks the language by name
        info = lizard.analyze_file.analyze_source_code(name, f.read_text(errors="replace"))
        for fn in info.function_list:
            if fn.length > max_lines or fn.cyclomatic_complexity > max_ccn:
                out.append((rel, fn.start_line, fn.name, fn.length, fn.cyclomatic_complexity))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=list(PRODUCT))
    ap.add_argument("--max-lines", type=int, default=80)
    ap.add_argument("--max-ccn", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        rows = oversized(a.paths, a.max_lines, a.max_ccn)
    except ImportError:
        print("function sizes: lizard is not installed (pip install lizard; `make setup` does)")
        return 0
    rows.sort(key=lambda r: (-r[4], -r[3]))
    print(f"function sizes: {len(rows)} product function(s) over {a.max_lines} lines or "
          f"cyclomatic complexity {a.max_ccn}")
    for rel, line, name, length, ccn in rows:
        print(f"  {length:4} lines  CC {ccn:3}  {name}  ({rel}:{line})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

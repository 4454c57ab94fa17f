"""Import cycles among a package's modules, counting imports inside functions too (a lazy
import that closes a loop is still a loop in the design): `python tools/import_cycles.py
python/gemmfuse bench` prints each cycle and exits 1 if there is one. A module importing its
own package's ``__init__`` is not counted (that is how packages re-export)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(pkg_dir: Path) -> dict:
    """Dotted module name -> file, for every .py under pkg_dir (named from its parent)."""
    out = {}
    for f in sorted(pkg_dir.rglob("*.py")):
        parts = f.relative_to(pkg_dir.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _targets(mods: dict, current: str, node) -> list:
    """The modules of `mods` an import statement in `current` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    base = current.split(".")
    if node.level:
        package = base if mods[current].name == "__init__.py" else base[:-1]
        package = package[:len(package) - node.level + 1]
        where = ".".join(package + ([node.module] if node.module else []))
    else:
        where = node.module or ""
    found = []
    for a in node.names:
        sub = f"{where}.{a.name}"
        found.append(sub if sub in mods else where)
    return [m for m in found if m in mods]


def graph(mods: dict) -> dict:
    g = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                g[m].update(t for t in _targets(mods, m, node)
                            if t != m and not m.startswith(t + "."))
    return g


def cycles(g: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or ["python/gemmfuse", "bench"]
    found = []
    for p in paths:
        g = graph(modules(ROOT / p))
        for comp in cycles(g):
            found.append(comp)
            print("import cycle: " + ", ".join(f"{m} -> {sorted(set(g[m]) & set(comp))}"
                                              for m in comp))
    print(f"import cycles: {len(found)} in {', '.join(paths)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

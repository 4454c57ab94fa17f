"""Print pinned requirements from pyproject.toml (the one place pins live), for `make setup`.

    python scripts/pins.py build test bench   # build-system.requires, then those extras
"""
import re
import sys
from pathlib import Path

TEXT = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()


def _array(table: str, key: str) -> list:
    """The strings of `key = [...]` inside `[table]` (tomllib where Python has it)."""
    try:
        import tomllib
        data = tomllib.loads(TEXT)
        node = data
        for part in table.split("."):
            node = node[part]
        return list(node[key])
    except ImportError:
        body = TEXT.split(f"[{table}]", 1)[1].split("\n[", 1)[0]
        arr = re.search(rf"^{re.escape(key)}\s*=\s*\[(.*?)\]", body, re.S | re.M).group(1)
        return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", arr))


def main(groups):
    out = []
    for g in groups:
        if g == "build":
            out += _array("build-system", "requires")
        else:
            out += _array("project.optional-dependencies", g)
    print(" ".join(dict.fromkeys(out)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["build"])

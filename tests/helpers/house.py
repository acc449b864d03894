"""The project's import graph, read with ast from models/ and harness/ (imports inside functions included): what
tests/test_layers.py holds to the layers' rules, and what the training package's own test reads."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO


def modules(root: Path = REPO) -> dict[str, Path]:
    out = {}
    for pkg in ("models", "harness"):
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(root: Path = REPO) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its code: top level, functions, branches)."""
    mods = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                r = _resolve(t, mods)
                if r and r != m:
                    edges[m].add(r)
    return edges

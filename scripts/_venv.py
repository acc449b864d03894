"""The Python a script of scripts/ runs with: one that has kvlab's packages. Run from a fresh clone after `make
setup` without activating the virtualenv (``scripts/gpu-check --help``, ``python3 scripts/probes/kv_stats.py``), the
first Python on PATH has no torch: the script is run again, the same arguments, with the repo's
``.venv/bin/python``; with no usable virtualenv it says, in one line, to run ``make setup`` (exit 2). A Python that
has the packages (an activated virtualenv, or a device machine's own python3 with torch) runs the script itself.

Only the standard library is used here: it runs before anything else is imported.

    if __name__ == "__main__":   # at the top of a script, before its first import of torch
        import _venv
        _venv.ensure(__file__)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"
AGAIN = "KVLAB_SCRIPT_REEXEC"  # set for the second run, so that a virtualenv without the packages cannot loop


def missing(needs: tuple[str, ...]) -> list[str]:
    """The top-level modules of ``needs`` that this Python cannot import."""
    out = []
    for name in needs:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except (ImportError, ValueError):
            out.append(name)
    return out


def ensure(script: str, needs: tuple[str, ...] = ("torch",), argv: list[str] | None = None) -> None:
    """Return if this Python has ``needs``; else run ``script`` again with the repo's virtualenv (never returns), or
    print one line saying to run `make setup` and exit 2."""
    lacking = missing(needs)
    if not lacking:
        return
    script_path = Path(script).resolve()
    python = VENV / "bin" / "python"
    inside = Path(sys.prefix).resolve() == VENV.resolve()
    if python.is_file() and os.access(python, os.X_OK) and not inside and os.environ.get(AGAIN) != str(script_path):
        os.environ[AGAIN] = str(script_path)
        args = sys.argv[1:] if argv is None else argv
        os.execv(str(python), [str(python), str(script_path), *args])
    name = str(script_path.relative_to(REPO)) if script_path.is_relative_to(REPO) else f"scripts/{script_path.name}"
    what = ", ".join(lacking)
    if python.is_file():
        why = f"the repo's virtualenv {VENV} cannot import {what} (its install is unfinished or broken)"
    else:
        why = f"{sys.executable} cannot import {what} and there is no virtualenv at {VENV}"
    print(f"{name}: {why}: run `make setup` in {REPO}, then {name} again", file=sys.stderr, flush=True)
    raise SystemExit(2)

"""Cache kinds from outside the repository, as the tests of ``cache=external``, entry points and ``python -m
harness.conformance`` make them: the example package (``examples/mykinds``) copied into a temporary folder, a fake
installed distribution that declares kinds, and everything a loaded kind leaves in this process taken back out."""

from __future__ import annotations

import shutil
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import REPO

EXAMPLE = "mykinds.recent:RecentKVCache"
BROKEN = "mykinds.broken:BrokenRecentKVCache"
PACKAGE = "mykinds"


def copy_example(folder: Path) -> Path:
    """examples/mykinds copied into ``folder`` (outside the repository): the folder to put on PYTHONPATH."""
    shutil.copytree(REPO / "examples" / PACKAGE, Path(folder) / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return Path(folder)


def fake_distribution(folder: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """An installed distribution as importlib.metadata finds one on sys.path: ``folder/<name>-0.1.dist-info`` with
    its METADATA and an entry_points.txt declaring ``entry_points`` (name -> target) in kvlab.cache_kinds, beside
    the ``modules`` (file name -> source) it ships. Returns ``folder``, the path entry."""
    info = Path(folder) / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[kvlab.cache_kinds]\n{lines}")
    for file, source in modules.items():
        (Path(folder) / file).write_text(textwrap.dedent(source))
    return Path(folder)


@contextmanager
def loaded_kinds(*modules: str):
    """Whatever kinds the block loads are taken back out afterwards: from the registry, the loader's records, the
    config store and sys.modules (``modules``: the top-level names of the packages they came from), so no later
    test of this worker sees them."""
    from hydra.core.config_store import ConfigStore

    from harness.core import kinds
    from models.kv_cache import CACHE_KINDS

    before, targets, scanned = dict(CACHE_KINDS), dict(kinds.TARGETS), list(kinds._SCANNED)
    try:
        yield
    finally:
        added = [k for k in CACHE_KINDS if k not in before]
        for kind in added:
            CACHE_KINDS.pop(kind)
        kinds.TARGETS.clear()
        kinds.TARGETS.update(targets)
        kinds.BROKEN.clear()
        kinds._SCANNED[:] = scanned
        repo = ConfigStore.instance().repo
        for group in (repo.get("cache", {}), repo.get("schema", {}).get("cache", {})):
            for kind in added:
                group.pop(f"{kind}.yaml", None)
        for name in [m for m in sys.modules if m.split(".")[0] in modules]:
            sys.modules.pop(name)

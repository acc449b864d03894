"""tests/ mirrors the house: a folder per layer holds the tests of that layer, what tests share lives in tests/helpers
(fixtures in tests/conftest.py), and no test file imports another test file (read with ast, imports inside functions
included), so each file can move, run alone or run on its own pytest-xdist worker.

    tests/models/        the engine: GPT-2, generation, every cache kind, the compiled step, the engine's safe side
    tests/core/          harness.core: both engines behind one protocol, drift statistics
    tests/measurements/  harness.measurements: the plug-ins and their conformance suite
    tests/experiment/    harness.experiment: the run layer (config, runs, sweeps, resume, Slurm, W&B, faults)
    tests/analysis/      harness.analysis: results, plots, report, findings, the W&B Report
    tests/train/         harness.train: the reference model
    tests/tools/         harness.tools and scripts/: kvcalc, gpu-check, the tools' safe side (train's signals)
    tests/test_*.py      the whole house: its import graph (test_layers) and this file
"""

from __future__ import annotations

import ast

from tests.helpers import REPO

TESTS = REPO / "tests"
# folder -> the layer (a package of the house) whose tests it holds
FOLDERS = {"models": "models", "core": "harness.core", "measurements": "harness.measurements",
           "experiment": "harness.experiment", "analysis": "harness.analysis", "train": "harness.train",
           "tools": "harness.tools"}
HOUSE = {"test_layers.py", "test_house.py"}  # about the whole house: at the top


def imported_test_files(source: str, package: list[str]) -> list[str]:
    """The test files (``test_*`` modules) and ``conftest`` a module's source imports, anywhere in it; ``package`` is
    the module's package (``["tests", "models"]``), to resolve relative imports."""
    def is_test(name: str) -> bool:
        last = name.rpartition(".")[2]
        return last.startswith("test_") or last == "conftest"

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if any(is_test(p) for p in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            if any(is_test(p) for p in base.split(".")):
                found.append(base)
            else:
                found += [f"{base}.{a.name}".lstrip(".") for a in node.names if is_test(a.name)]
    return sorted(found)


def python_files() -> list:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_test_file_imports_another_test_file():
    """Every module under tests/ (helpers and conftest included) imports no ``test_*`` module and no conftest:
    what tests share is in tests/helpers."""
    bad = {}
    for f in python_files():
        package = list(f.relative_to(REPO).parent.parts)
        if found := imported_test_files(f.read_text(encoding="utf-8"), package):
            bad[str(f.relative_to(REPO))] = found
    assert bad == {}


def test_every_test_file_sits_in_its_layers_folder():
    files = [f for f in python_files() if f.name.startswith("test_")]
    assert len(files) > 30
    for f in files:
        where = f.relative_to(TESTS).parts
        if len(where) == 1:
            assert where[0] in HOUSE, f"{f.relative_to(REPO)}: a test file belongs in its layer's folder"
        else:
            assert len(where) == 2 and where[0] in FOLDERS, f"{f.relative_to(REPO)}: not in a layer's folder"
    for folder, layer in FOLDERS.items():
        assert (TESTS / folder / "__init__.py").is_file(), folder
        assert (REPO / layer.replace(".", "/") / "__init__.py").is_file(), layer  # the folder mirrors a real layer
        assert any((TESTS / folder).glob("test_*.py")), folder
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders == {*FOLDERS, "helpers"}
    assert not any(p.name.startswith("test_") for p in (TESTS / "helpers").rglob("*.py"))


def test_the_checker_sees_what_it_must():
    """Every way of importing a test file is caught (top level, inside a function, relative, a bare name after a
    sys.path insert); helpers and the project's packages are not."""
    src = ("from tests.models.test_generate import seed_prompts\n"
           "import tests.test_layers\n"
           "from tests import test_faults\n"
           "from tests.experiment import test_wandb as w\n"
           "from .test_cache_kinds import CASES\n"
           "from . import test_ragged\n"
           "from tests.conftest import REPO\n"
           "def f():\n    from test_layers import imports\n"
           "from tests.helpers import REPO, run_py\nfrom tests.helpers.caches import Writer\n"
           "from models.kv_cache import make_cache\nimport harness.core.measure\nfrom hypothesis import strategies\n")
    assert imported_test_files(src, ["tests", "models"]) == sorted([
        "tests.models.test_generate", "tests.test_layers", "tests.test_faults", "tests.experiment.test_wandb",
        "tests.models.test_cache_kinds", "tests.models.test_ragged", "tests.conftest", "test_layers"])


def test_the_longest_first_files_exist():
    """conftest's LONGEST_FIRST names files that exist: a renamed one would silently fall back to its place."""
    from tests.helpers import LONGEST_FIRST

    assert [f for f in LONGEST_FIRST if not (REPO / "tests" / f).is_file()] == []


def test_the_longest_first_files_are_handed_out_first(pytestconfig):
    """Under `make test` (-n 2 --dist loadfile) the two workers start on the first two LONGEST_FIRST files and queue
    the next two behind them, whatever the number of tests in each file: xdist's own scheduler, given the
    collection in conftest's order and the option conftest sets (xdist alone would start on the file with the most
    tests)."""
    from types import SimpleNamespace

    import pytest

    if not pytestconfig.pluginmanager.hasplugin("xdist"):
        pytest.skip("pytest-xdist is not loaded here (-p no:xdist): make test runs with it")
    from xdist import scheduler

    from tests.helpers import LONGEST_FIRST, in_hand_out_order

    class Node:  # what the scheduler reads of a worker
        shutting_down = False

        def __init__(self, name):
            self.sent, self.gateway = [], SimpleNamespace(id=name)

        def send_runtest_some(self, indexes):
            self.sent.append(indexes)

        def shutdown(self):
            self.shutting_down = True

    config = SimpleNamespace(getvalue=lambda name: {"tx": ["2*popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=pytestconfig.option.loadscopereorder))
    files = ["tests/zz/test_many.py", *(f"tests/{f}" for f in reversed(LONGEST_FIRST[:4]))]
    collection = in_hand_out_order([f"{f}::test_{i}" for f in files for i in range(20 if "many" in f else 2)])
    sched, nodes = scheduler.LoadFileScheduling(config), [Node("gw0"), Node("gw1")]
    for n in nodes:
        sched.add_node(n)
    for n in nodes:
        sched.add_node_collection(n, collection)
    sched.schedule()
    handed = [[collection[i[0]].split("::")[0].removeprefix("tests/") for i in n.sent] for n in nodes]
    assert handed == [[LONGEST_FIRST[0], LONGEST_FIRST[2]], [LONGEST_FIRST[1], LONGEST_FIRST[3]]]

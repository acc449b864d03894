"""The house's arrows point one way: the import graph of models/ and harness/ (read with ast, imports inside
functions included) has no cycle, and no module imports one from a layer above its own.

    models                       the engine: imports no harness module
    harness.common               errors, the stop-signal protocol, ownership: the standard library only
    harness.core                 engines and the pure measurement functions: models/ only
    harness.measurements         the measurement plug-ins (declarations and run()): never figures, never a run
    harness.experiment           the run layer: config, plan, weights, memory, runner, tracking, invocation
    harness.analysis             loading results, plots, figures, report, findings, papers, W&B Report: never core or models
    harness.train                the reference models (a peer of analysis: neither imports the other)
    harness.tools                bench, kvcalc
    harness.<door>               the public commands and names (harness.results, .report, .bench, ...): nothing
                                 inside harness imports them

``python -m tests.test_layers`` prints the graph's figures (modules, imports, cycles, upward imports).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.helpers.house import imports, modules

# (module prefix, rank); a module's layer is its longest matching prefix
LAYERS = {
    "models": 0,
    "harness.common": 1,
    "harness.core": 2,
    "harness.measurements": 3,
    "harness.experiment": 4,
    "harness.analysis": 5,
    "harness.train": 5,
    "harness.tools": 6,
    "harness": 7,  # the doors (harness.results, harness.report, ...) and the package itself
}
PEERS = {frozenset({"harness.analysis", "harness.train"})}  # same rank, and neither may import the other


# the README's Layout states these "never"s by name: (importer, imported) prefixes no import may join, whatever the
# ranks say (a rank change that would allow one still fails here)
NEVER = {
    ("models", "harness"): "the engine never imports the lab",
    ("harness.common", "models"): "common is the leaf",
    ("harness.common", "harness.core"): "common is the leaf",
    ("harness.core", "harness.measurements"): "core imports models/ (and common) only",
    ("harness.core", "harness.experiment"): "core imports models/ (and common) only",
    ("harness.measurements", "harness.analysis"): "a measurement never draws a figure",
    ("harness.measurements", "harness.experiment"): "a measurement never sees the run",
    ("harness.analysis", "harness.core"): "analysis never imports the torch side: what it needs is in the record",
    ("harness.analysis", "models"): "analysis never imports the torch side: what it needs is in the record",
    ("harness.analysis", "harness.train"): "analysis and train are peers",
    ("harness.train", "harness.analysis"): "analysis and train are peers",
}


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def forbidden(edges: dict[str, set[str]]) -> list[tuple[str, str, str]]:
    """The imports a NEVER rule forbids: (importer, imported, the rule)."""
    return sorted((a, b, why) for a, targets in edges.items() for b in targets
                  for (pa, pb), why in NEVER.items() if under(a, pa) and under(b, pb))


def layer(module: str) -> str:
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer into a higher one (or between peers, or into a door)."""
    bad = []
    for a, targets in edges.items():
        for b in targets:
            la, lb = layer(a), layer(b)
            if la == lb:
                if la == "harness" and b != "harness" and a != "harness":
                    bad.append((a, b))  # a door importing a door
                continue
            if LAYERS[lb] > LAYERS[la] or frozenset({la, lb}) in PEERS:
                bad.append((a, b))
    return sorted(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    assert cycles(imports()) == []


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward(imports()) == []


def test_no_import_breaks_a_never_the_readme_states():
    assert forbidden(imports()) == []


def test_every_never_is_in_the_readme_and_the_checker_catches_each():
    """Each rule is a sentence of the README's Layout (its importer's line says "never" or "only"), and a graph made
    to break it fails it."""
    readme = (REPO / "README.md").read_text()
    layout = " ".join(readme[readme.index("## Layout"):].split())  # its lines wrapped
    for (a, b), why in NEVER.items():
        assert forbidden({f"{a}.x": {f"{b}.y"}}) == [(f"{a}.x", f"{b}.y", why)]
    for phrase in ("never imports the lab", "imports models/ only", "never figures, never the run",
                   "imports neither core nor models", "neither imports the other", "the leaf"):
        assert phrase in layout, phrase


def test_every_module_has_a_layer():
    """A module outside every declared folder would escape the rules: harness's top level holds doors only."""
    doors = {m for m in modules() if layer(m) == "harness" and m != "harness"}
    assert doors == {"harness.results", "harness.report", "harness.wandb_report", "harness.bench", "harness.kvcalc",
                     "harness.heads", "harness.scorecard", "harness.conformance"}
    for door in doors:  # a door is a few lines: the code lives in its layer
        assert len(modules()[door].read_text().splitlines()) < 30, door


def test_the_checker_sees_what_it_must():
    """The rules catch what they are for, on a graph made to break them (an import inside a function included)."""
    edges = {"harness.core.measure": {"harness.analysis.plots"}, "harness.analysis.plots": {"harness.core.measure"},
             "harness.train.loop": {"harness.analysis.results"}, "harness.analysis.results": set(),
             "models.gpt2": {"harness.common.errors"}, "harness.common.errors": set()}
    assert cycles(edges) == [["harness.analysis.plots", "harness.core.measure"]]
    assert upward(edges) == [("harness.core.measure", "harness.analysis.plots"),
                             ("harness.train.loop", "harness.analysis.results"),
                             ("models.gpt2", "harness.common.errors")]
    src = "def f():\n    from harness.analysis import plots\n"
    assert any(isinstance(n, ast.ImportFrom) and n.module == "harness.analysis" for n in ast.walk(ast.parse(src)))


def test_loading_results_imports_no_torch():
    """``from harness.results import load_runs``, the analysis layer and the measurements' declarations load
    pandas, never torch (a fresh interpreter: this one has torch already)."""
    code = ("import sys\nfrom harness.results import load_runs, load_steps, load_table\n"
            "import harness.analysis.report, harness.analysis.findings, harness.analysis.wandb_report\n"
            "from harness.measurements import MEASUREMENTS, KEYS\nKEYS.drift_kl\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def figures() -> dict:
    edges = imports()
    return dict(modules=len(edges), imports=sum(len(v) for v in edges.values()), cycles=len(cycles(edges)),
                modules_in_cycles=sum(len(c) for c in cycles(edges)), upward=len(upward(edges)))


if __name__ == "__main__":
    print(figures())
    for a, b in upward(imports()):
        print(f"upward: {a} -> {b}")


def test_what_users_type_is_where_they_find_it():
    """The names the README and DESIGN give users stay put whatever moves inside (the commands themselves run in
    their layers' tests: python -m harness.{train,report,kvcalc,bench,wandb_report,measurements})."""
    import importlib.util

    from harness import experiment, kvcalc, results
    from harness.experiment import runner
    from harness.measurements import KEYS, MEASUREMENTS
    from models.generate import decode_step, greedy, prefill  # noqa: F401
    from models.gpt2 import GPT2, GPT2Config  # noqa: F401
    from models.kv_cache import CACHE_KINDS, ConcatKVCache, PreallocKVCache, kv_bytes, make_cache  # noqa: F401
    from models.tokenizer import Tokenizer  # noqa: F401

    assert callable(experiment.run) and experiment.run.__doc__ and "run" in dir(runner)
    for name in ("load_runs", "load_steps", "load_drift", "load_memory", "load_table", "load_tables"):
        assert callable(getattr(results, name)), name
    for name in ("kv_geometry", "kv_cache_bytes", "bytes_per_token", "sequences_that_fit"):
        assert callable(getattr(kvcalc, name)), name
    assert "equivalence" in MEASUREMENTS and KEYS.run_name == "run_name"
    for command in ("train", "report", "kvcalc", "bench", "wandb_report", "measurements", "conformance"):
        spec = importlib.util.find_spec(f"harness.{command}")
        main = spec.origin if not spec.submodule_search_locations else \
            importlib.util.find_spec(f"harness.{command}.__main__").origin
        assert '__name__ == "__main__"' in Path(main).read_text() or main.endswith("__main__.py"), command


RUN_CONCEPTS = {"memory", "compile"}  # measurement names that are also the run's own words (its memory check, compile=)


def measurement_names_in(source: str, names) -> list[tuple[int, str]]:
    """(line, identifier) for each identifier of ``source`` (a name, an attribute, a def or class, an argument, a
    keyword, an import) that contains one of ``names``, each string that is one, and each import of a measurement's
    module."""
    out = []
    for node in ast.walk(ast.parse(source)):
        ids = []
        if isinstance(node, ast.Name):
            ids = [node.id]
        elif isinstance(node, ast.Attribute):
            ids = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            ids = [node.name]
        elif isinstance(node, ast.arg):
            ids = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            ids = [node.arg]
        elif isinstance(node, ast.alias):
            ids = [node.asname or node.name.split(".")[-1]]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness.measurements."):
            ids = [node.module.split(".")[-1]]
        out += [(node.lineno, i) for i in ids if any(n in i.lower() for n in names)]
        if isinstance(node, ast.Constant) and node.value in names:
            out.append((node.lineno, repr(node.value)))
    return sorted(set(out))


def test_the_run_layer_names_no_measurement():
    """harness/experiment/ loops over the chosen measurements (their checks, memory phases, inputs, files) and names
    none of them: adding one touches no file of the run layer."""
    from harness.measurements import MEASUREMENTS

    names = set(MEASUREMENTS) - RUN_CONCEPTS
    assert len(names) >= 10
    found = {str(p.relative_to(REPO)): hits for p in sorted((REPO / "harness" / "experiment").glob("*.py"))
             if (hits := measurement_names_in(p.read_text(), names))}
    assert found == {}
    caught = measurement_names_in("from harness.measurements.server import serve_options\n"
                                  "def check_server(rc):\n    return 'retrieval' in rc.text_drift_len\n", names)
    assert {i for _, i in caught} == {"'retrieval'", "check_server", "server", "text_drift_len"}


def hydra_state_readers(root: Path) -> set[str]:
    """The modules under ``root`` that read Hydra's global state (its ``HydraConfig`` singleton)."""
    return {str(p.relative_to(REPO)) for p in sorted(root.rglob("*.py")) if "HydraConfig" in p.read_text()}


def test_hydra_is_read_at_the_door_only():
    """The plan is read once: the run's door (harness/experiment/runner.py) reads Hydra's global state into the
    RunConfig and a HydraJob; nothing after it (the plan, the folder's checks, the measurements) reads it again."""
    assert hydra_state_readers(REPO / "harness") == {"harness/experiment/runner.py"}

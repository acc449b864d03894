"""Follow a run's calls through kvlab's modules: how often the run's sequence stays in one module, climbs back to a
higher layer, or returns to the door's module (harness/experiment/runner.py) from one below it.

    python scripts/probes/run_calls.py            # a tiny run (model=tiny, two prompts, every measurement) traced

Every call between two functions of kvlab (models/ and harness/) made while ``harness.experiment.runner.run`` runs
is counted once per distinct (caller, callee) pair, so a loop counts once: a *stay* when both live in one module, a
*climb* when the callee's layer is above the caller's (tests/test_layers.py's ranks: models 0 .. harness.experiment
4), a *return* when the callee is in runner.py and the caller is not. Issue 67 counted the calls that carry the
run's config; this counts every call of the run's code, the same way before and after a change.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

from hydra import compose, initialize_config_dir  # noqa: E402

from harness.experiment import runner  # noqa: E402
from harness.experiment.config import register  # noqa: E402

LAYERS = {"models": 0, "harness.common": 1, "harness.core": 2, "harness.measurements": 3, "harness.experiment": 4,
          "harness.analysis": 5, "harness.train": 5, "harness.tools": 6, "harness": 7}
RUNNER = "harness.experiment.runner"


def rank(module: str) -> int:
    return LAYERS[max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)]


def module_of(frame) -> str | None:
    path = Path(frame.f_code.co_filename).resolve()
    try:
        rel = path.relative_to(REPO)
    except ValueError:
        return None
    if rel.parts[0] not in ("models", "harness"):
        return None
    return ".".join(rel.with_suffix("").parts).removesuffix(".__init__")


def traced_run(overrides: list[str]) -> set[tuple[str, str, str, str]]:
    register()
    edges = set()

    def tracer(frame, event, arg):
        if event == "call":
            callee, caller = module_of(frame), module_of(frame.f_back) if frame.f_back else None
            if callee and caller:
                edges.add((caller, frame.f_back.f_code.co_name, callee, frame.f_code.co_name))
        return None

    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(REPO / "conf"),
                                                                      version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
        out = Path(tmp) / "run"
        runner._hydra_dirs = lambda: (out, "probe", "run")
        sys.setprofile(None)
        sys.settrace(tracer)
        try:
            rec = runner.run(cfg, progress=False)
        finally:
            sys.settrace(None)
    assert rec["status"] == "ok", rec.get("error")
    return edges


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description="Follow a tiny run's calls through kvlab's run layer (see the module's "
                            "docstring).").parse_args(argv)
    edges = traced_run(["model=tiny", "n_prompts=2", "new_tokens=4", "prompt_len=4", "repeats=1", "warmup=0",
                        "context_lengths=[8]", "tracking.mode=disabled", "prompts=random"])
    run_layer = {e for e in edges if e[0].startswith("harness.experiment") and e[2].startswith("harness.experiment")}
    stays = sum(1 for a, _, b, _ in run_layer if a == b)
    crossings = len(run_layer) - stays
    returns = sorted({(a, f, g) for a, f, b, g in run_layer if b == RUNNER and a != RUNNER})
    own = sorted({(f, g) for a, f, b, g in run_layer if a == b == RUNNER})
    steps = sorted({(f, b, g) for a, f, b, g in edges if a == RUNNER and b != RUNNER})
    climbs = sorted({(a, f, b, g) for a, f, b, g in edges if rank(b) > rank(a)})
    print(f"distinct calls between kvlab functions during one run: {len(edges)}; within the run layer "
          f"(harness/experiment/): {len(run_layer)}")
    print(f"run layer: {stays} stay in one module, {crossings} cross to another, {len(returns)} return to "
          f"{RUNNER}; calls that climb to a higher layer anywhere: {len(climbs)}")
    print(f"{RUNNER}: {len(own)} calls within it, {len(steps)} calls out of it to the run's steps (each returns "
          "to it)")
    for a, f, g in returns:
        print(f"  return: {a}.{f} -> runner.{g}")
    for a, f, b, g in climbs:
        print(f"  climb: {a}.{f} -> {b}.{g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

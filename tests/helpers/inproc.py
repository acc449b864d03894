"""A run in the test's own process, as ``python run.py`` would make it but without starting Python, torch and Hydra
again (seconds per run): the config composed from conf/ with the command line's overrides, then
``harness.experiment.runner.run``, the door every run goes through, into a folder the test names. For the tests of
what the door and the plan refuse, and of runs that use a measurement or kind the test registers; the exit code and
the command line's own parsing stay with the tests that start ``run.py``."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO


def compose_cfg(overrides: list[str]):
    """The run's config as Hydra composes it from conf/ with ``overrides`` (what follows ``python run.py``), the
    schemas registered as run.py registers them for that command line (its ``cache.target=`` classes loaded)."""
    from hydra import compose, initialize_config_dir

    from harness.experiment.config import register

    register(overrides)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def run_here(monkeypatch, overrides: list[str], out: Path) -> dict:
    """One run in this process into the folder ``out``: the dict the door returns (``status``, ``error``, ...)."""
    from harness.experiment import runner

    monkeypatch.setattr(runner, "_hydra_dirs", lambda: (out, "t", Path(out).name))
    return runner.run(compose_cfg(overrides), progress=False)

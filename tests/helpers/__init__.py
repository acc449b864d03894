"""What the tests share that is not a fixture (the fixtures live in tests/conftest.py): the repository's root, the
tiny run every run.py test makes (and its quicker forms), running run.py offline, a network tripwire, and reading a
test file's ``CASES``.
The modules beside this one hold what tests of one kind share: ``caches`` (the model layer's cache kinds and
prompts), ``checkpoints`` (tiny HF checkpoints and faults in them), ``fake_hub`` (a stand-in HF hub),
``wandb_runs`` (reading an offline W&B run), ``inproc`` (a run through the door in the test's own process) and
``house`` (the project's import graph). A test file imports what it
shares from here, never from another test file (tests/test_house.py checks)."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# small and quick: what every run.py test runs
TINY = ["model=tiny", "n_prompts=2", "new_tokens=8", "prompt_len=6", "repeats=2", "warmup=1",
        "context_lengths=[8,32]"]
# the tiny run measuring equivalence alone (a second and more less than every measurement): for the tests of a
# run's folder, record, resume and exit code, which read no other measurement's keys or tables. The list is part of
# a run's identity, so a test that runs one command twice gives both the same list.
QUICK = [*TINY, "measurements=[equivalence]"]
# on a sweep's command line: no sweep report (seconds of tables and figures), for the tests that never read it
NO_REPORT = "~hydra.callbacks.report"


class Tripwire:
    """A local TCP listener that counts connections: point W&B's and every HTTP client's server at it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port, self.hits = self.sock.getsockname()[1], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            self.took(conn)

    def took(self, conn) -> None:
        conn.close()


def run_py(args, tmp_path, extra_env=None) -> subprocess.CompletedProcess:
    """``python run.py ARGS``, a process of its own, offline, W&B's folders under tmp_path: forked from the worker's
    zygote (``tests.helpers.zygote``: torch already imported, seconds less a call), or started afresh with
    ``KVLAB_TEST_ZYGOTE=0`` and where ``extra_env`` sets a PYTHON* variable (read as Python starts: PYTHONPATH's
    sitecustomize, say)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        env[var] = str(Path(tmp_path) / var.lower())
    if os.environ.get("KVLAB_TEST_ZYGOTE", "1") != "0" and not any(k.startswith("PYTHON") for k in extra_env or {}):
        from tests.helpers import zygote

        return zygote.run(["run.py", *args], REPO, env, timeout=600)
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def one_line(err: str) -> str:
    """The one line a refusal prints (asserted: one line, no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def untested_cases(path: str, cases: list) -> list[str]:
    """The ids of a test file's ``CASES`` that no test below the list names (``# id`` or ``, id``); asserts each id is
    listed once."""
    text = open(path, encoding="utf-8").read().split("\nCASES = [", 1)[1].split("\n]\n", 1)[1]
    assert len({c for c, _ in cases}) == len(cases)
    return [c for c, _ in cases if f"# {c}" not in text and f", {c}" not in text]


def case_ids(path: Path) -> list[str]:
    """The ids (each tuple's first item) of a test file's top-level ``CASES = [...]``, read with ast without
    importing the file: the list must be a literal, and is evaluated whole as one."""
    for node in ast.parse(Path(path).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["CASES"]:
            return [c[0] for c in ast.literal_eval(node.value)]
    raise AssertionError(f"{path} has no top-level CASES = [...]")


# The files handed out first under `-n 2 --dist loadfile` (tests/conftest.py keeps this order), in this order: the Slurm
# tests (mostly waiting on the scheduler and a job's time limit, so the other worker's files fill that time), the
# shipped checkpoints' targets (their evaluation takes every core: the Slurm worker leaves one idle), then the
# others longest first by their wall time (2026-12-05, `-n 2`). A worker takes the next whole file when it is free:
# a long file left for the end keeps one worker busy while the other has nothing left. Every other file follows.
LONGEST_FIRST = ("experiment/test_slurm.py", "train/test_shipped.py", "experiment/test_safe_runs.py",
                 "experiment/test_resume.py",
                 "train/test_train.py", "measurements/test_measurements.py", "models/test_generate.py",
                 "experiment/test_harness.py", "experiment/test_safe_second_pass.py", "models/test_compile.py",
                 "models/test_cache_kinds.py", "models/test_llama.py", "experiment/test_families.py",
                 "experiment/test_faults.py", "core/test_drift.py", "core/test_engines.py", "tools/test_safe_tools.py",
                 "analysis/test_findings.py",
                 "analysis/test_safe_report.py", "experiment/test_wandb.py", "analysis/test_report.py")


def in_hand_out_order(items: list, key=str) -> list:
    """``items`` (test ids, or what ``key`` reads one from) with the files in ``LONGEST_FIRST`` first, in its order;
    stable: the order within a file, and of the other files, is kept."""
    def rank(item) -> int:
        path = key(item).split("::")[0].removeprefix("tests/")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    return sorted(items, key=rank)


def bench_refused(argv, capsys) -> str:
    """``python -m harness.bench ARGV``'s one-line refusal (exit 2), without its "bench: error: " and "(see ...)"."""
    import pytest

    from harness.tools import bench

    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("bench: error: ") and line.endswith(" (see python -m harness.bench --help)")
    return line.removeprefix("bench: error: ").removesuffix(" (see python -m harness.bench --help)")


def bench_args(argv, checked: bool = False):
    """``python -m harness.bench ARGV``'s (arguments, model config) as main() hands them to ``check_args``, or with
    ``checked`` as check_args leaves them (defaults filled in); nothing is built."""
    import pytest

    from harness.tools import bench

    seen, real = {}, bench.check_args

    def stop(ap, args, cfg):
        if checked:
            real(ap, args, cfg)
        seen.update(args=args, cfg=cfg)
        raise SystemExit(0)

    bench.check_args = stop
    try:
        with pytest.raises(SystemExit):
            bench.main(argv)
    finally:
        bench.check_args = real
    return seen["args"], seen["cfg"]


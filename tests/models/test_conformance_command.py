"""``python -m harness.conformance``: the cache-kind conformance checks as a command (harness.tools.conformance).
Every built-in kind passes them; the example kind (examples/mykinds, copied outside the repository) passes them
through the command, exit 0; its broken copy fails, exit 1, naming the check it fails; a bad target is exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness.tools import conformance
from models.kv_cache import CACHE_KINDS
from tests.helpers import REPO, one_line
from tests.helpers.external import BROKEN, EXAMPLE, PACKAGE, copy_example, loaded_kinds


@pytest.mark.slow  # every option set of every kind, a few hundred greedy steps of the tiny model each: about 10 s
@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_every_builtin_kind_passes_the_commands_checks(kind):
    outcomes = conformance.run_checks(CACHE_KINDS[kind])
    assert [o.check for o in outcomes] == list(conformance.CHECKS)
    assert [o.line() for o in outcomes if not o.passed] == []


def test_the_checks_catch_what_they_are_for():
    """Kinds made wrong on purpose, each failing the check it should (so a pass means something)."""
    from models.kv_cache import PreallocKVCache
    from models.kv_cache.concat import ConcatKVCache

    class MovesPos(ConcatKVCache):  # update advances pos itself
        kind = "moves_pos"

        def update(self, layer, k_new, v_new):
            out = super().update(layer, k_new, v_new)
            self.pos += k_new.shape[2] if layer == self.n_layer - 1 else 0
            return out

    class LosesV(PreallocKVCache):  # the newest V comes back zeroed
        kind = "loses_v"

        def update(self, layer, k_new, v_new):
            k, v = super().update(layer, k_new, v_new)
            return k, torch.cat([v[:, :, :-1], torch.zeros_like(v[:, :, -1:])], dim=2)

    class HidesBytes(ConcatKVCache):  # a buffer the formula does not count
        kind = "hides_bytes"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.spare = {"scratch": torch.zeros(16)}

    failed = {cls.kind: {o.check for o in conformance.run_checks(cls) if not o.passed}
              for cls in (MovesPos, LosesV, HidesBytes)}
    assert "update/pos" in failed["moves_pos"]
    assert {"what update returns", "generation = reference"} <= failed["loses_v"]
    assert failed["hides_bytes"] == {"nbytes = formula"}


def test_the_command_on_the_broken_copy_names_the_failing_check(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(copy_example(tmp_path)))
    with loaded_kinds(PACKAGE):
        assert conformance.main([BROKEN, "--options", "budget=8", "sinks=1"]) == 1  # its first example alone
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].startswith("FAIL  keeps its slots: [budget=8,sinks=1] layer 0 sequence 0 head 0 after 5 tokens "
                               "keeps 4 distinct positions, not min(slots 8, tokens 5) = 5")
    assert [line.split()[0] for line in lines[:-1]].count("FAIL") == 1
    assert lines[-1] == f"broken_recent ({BROKEN}): 8 of 9 checks passed"


@pytest.mark.parametrize("argv,message", [
    (["mykinds.recent"], "'mykinds.recent' is not package.module:ClassName"),
    (["nowhere.kinds:Kind"], "nowhere.kinds:Kind: no module 'nowhere' on the path: put the folder that holds it on "
                             "PYTHONPATH"),
    (["mykinds.recent:Nothing"], "mykinds.recent:Nothing: module mykinds.recent ("),
    (["mykinds.recent:RecentOptions"], "RecentOptions is not a subclass of models.kv_cache.KVCache"),
    (["mykinds.recent:RecentKVCache", "--options", "budget=3", "sinks=5"],
     "--options budget=3,sinks=5: cache option sinks must be an integer in [0, budget 3), got 5"),
    (["mykinds.recent:RecentKVCache", "--options", "budget"], "--options 'budget' is not name=value"),
    (["mykinds.recent:RecentKVCache", "--options", '{"budget": 4, "bogus": 1}'],
     "cache kind 'recent' has no option 'bogus'"),
])
def test_a_bad_target_or_options_is_exit_2_in_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.syspath_prepend(str(copy_example(tmp_path)))
    with loaded_kinds(PACKAGE):
        assert conformance.main(argv) == 2
    err = capsys.readouterr()
    assert err.out == "" and message in one_line(err.err) and one_line(err.err).startswith("conformance: ")


def _command(target: str, folder) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(folder)}
    return subprocess.run([sys.executable, "-m", "harness.conformance", target], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # two processes that import torch and generate
def test_the_example_passes_through_the_command_and_its_broken_copy_fails(tmp_path):
    folder = copy_example(tmp_path / "outside")
    ok = _command(EXAMPLE, folder)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[:-1] == [f"ok    {name}" for name in conformance.CHECKS]
    assert ok.stdout.splitlines()[-1] == f"recent ({EXAMPLE}): 9 of 9 checks passed"
    broken = _command(BROKEN, folder)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "FAIL  keeps its slots: [budget=8,sinks=1]" in broken.stdout
    assert _command(EXAMPLE, tmp_path / "empty").returncode == 2  # the package is not on the path

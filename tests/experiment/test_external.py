"""A cache kind from outside the repository (harness.experiment.external, harness.core.kinds): ``cache=external
cache.target=package.module:ClassName`` loads the example kind from a folder on PYTHONPATH and runs it to ``ok``,
its options typed and sweepable, its record naming the class's kind and target; an installed package's
``kvlab.cache_kinds`` entry point is a ``cache=<kind>`` like a built-in one, and a broken one breaks nothing else;
every mistake is one line; records of such a kind read back where it is not loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from harness import measurements
from harness.common.errors import ConfigError
from harness.core import kinds
from harness.experiment import external
from harness.experiment.config import config_id, read, register
from models.kv_cache import CACHE_KINDS
from tests.helpers import REPO, TINY, one_line, run_py
from tests.helpers.external import EXAMPLE, PACKAGE, copy_example, fake_distribution, loaded_kinds
from tests.helpers.inproc import run_here

RUN = [*TINY, "measurements=[equivalence,memory]", "tracking=disabled"]
OTHER = '''
from dataclasses import dataclass

from models.kv_cache.prealloc import PreallocKVCache


@dataclass(frozen=True)
class SpareOptions:
    spare: int = 0  # a toy option of this kind alone
    budget: int = 4  # shares its name (and type) with the example's


class SpareKVCache(PreallocKVCache):
    kind, Options = "spare", SpareOptions


@dataclass(frozen=True)
class TextBudget:
    budget: str = "all"


class TextBudgetKVCache(PreallocKVCache):
    kind, Options = "text_budget", TextBudget


class NamedLikeH2O(PreallocKVCache):
    kind = "h2o"


class Nameless(PreallocKVCache):
    kind = ""
'''


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """The example package and a module of other kinds (``otherkinds``) in a folder outside the repository, on
    sys.path; whatever the test loads is taken back out after it."""
    folder = copy_example(tmp_path / "outside")
    (folder / "otherkinds.py").write_text(OTHER)
    monkeypatch.syspath_prepend(str(folder))
    with loaded_kinds(PACKAGE, "otherkinds"):
        yield folder


def composed(overrides: list[str]):
    register(overrides)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_the_example_runs_as_a_kind_its_options_typed_and_its_record_naming_kind_and_target(outside, tmp_path,
                                                                                          monkeypatch):
    args = [*RUN, "cache=external", f"cache.target={EXAMPLE}", "cache.budget=8", "cache.sinks=2"]
    register(args)
    rec = run_here(monkeypatch, args, tmp_path / "run")
    assert rec["status"] == "ok", rec.get("error")
    assert (rec["cache"], rec["cache_target"], rec["cache_label"]) == ("recent", EXAMPLE, "recent B8 sinks=2")
    assert (rec["cache_budget"], rec["cache_sinks"], rec["cache_allocation"]) == (8, 2, "uniform")
    assert rec["cache_exact"] is True and rec["tokens_identical"] is True and rec["nbytes_match"] is True
    assert measurements.undeclared(rec) == []
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["cache_target"] == EXAMPLE and saved["config_id"] == rec["config_id"]
    with pytest.raises(Exception, match="budget"):  # typed as the class types it
        composed(["cache=external", f"cache.target={EXAMPLE}", "cache.budget=eight"])


def test_a_sweep_types_the_union_of_its_targets_and_each_run_is_its_own_target(outside):
    alone = composed(["cache=external", f"cache.target={EXAMPLE}", "cache.budget=8"])
    register(["cache=external", f"cache.target={EXAMPLE},otherkinds:SpareKVCache"])  # a sweep over both targets
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):  # each of its runs composed
        a = compose(config_name="config", overrides=["cache=external", f"cache.target={EXAMPLE}", "cache.budget=8"])
        b = compose(config_name="config", overrides=["cache=external", "cache.target=otherkinds:SpareKVCache",
                                                     "cache.budget=8", "cache.spare=3"])
        wrong = compose(config_name="config", overrides=["cache=external", f"cache.target={EXAMPLE}",
                                                         "cache.spare=3"])
    assert {"kind", "target", "budget", "sinks", "spare"} <= set(a.cache) and a.cache.sinks is None
    ra, rb = read(a), read(b)
    assert (ra.cache.kind, ra.cache.options["sinks"], ra.cache.target) == ("recent", 1, EXAMPLE)
    assert ra.resolved["cache"] == {"kind": "recent", "target": EXAMPLE, **ra.cache.options}  # W&B's config
    assert (rb.cache.kind, rb.cache.options, rb.cache.target) == ("spare", {"spare": 3, "budget": 8},
                                                                  "otherkinds:SpareKVCache")
    assert config_id(a) != config_id(b) and config_id(a) == config_id(alone)  # one target's id, whatever the sweep
    with pytest.raises(ConfigError) as e:
        read(wrong)
    assert str(e.value) == (f"cache.spare=3 is not an option of {EXAMPLE} (kind recent): its options are budget, "
                            "group_score, allocation, beta, floor, sinks")
    with pytest.raises(ConfigError, match=r"^cache.budget is int in mykinds.recent:RecentKVCache but str in "
                                          r"otherkinds:TextBudgetKVCache: sweep targets that type a shared option"):
        register(["cache=external", f"cache.target=choice({EXAMPLE},otherkinds:TextBudgetKVCache)"])


def test_a_target_reaches_the_other_kinds_of_its_sweep_and_changes_nothing_of_theirs(outside):
    """A sweep over external and a kind of kvlab's (experiment=leaderboard's methods) hands every run the command
    line's cache.target: the other kind composes with it, runs as itself and keeps its id."""
    register(["cache=external,snapkv", f"cache.target={EXAMPLE}", "cache.budget=8"])
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        given = compose(config_name="config", overrides=["cache=snapkv", f"cache.target={EXAMPLE}", "cache.budget=8"])
        plain = compose(config_name="config", overrides=["cache=snapkv", "cache.budget=8"])
    rc = read(given)
    assert (rc.cache.kind, rc.cache.target, rc.cache.options["budget"]) == ("snapkv", None, 8)
    assert "target" not in rc.cache.options and config_id(given) == config_id(plain)


@pytest.mark.parametrize("argv,message", [
    ([], "cache=external needs cache.target=package.module:ClassName: the class of your kind"),
    (["mykinds.recent"], "cache.target='mykinds.recent' is not package.module:ClassName (the module importable from "
                         "PYTHONPATH, a colon, the class's name)"),
    (["nowhere.kinds:Kind"], "cache.target=nowhere.kinds:Kind: no module 'nowhere' on the path: put the folder that "
                             "holds it on PYTHONPATH"),
    (["mykinds.recent:Recent"], "cache.target=mykinds.recent:Recent: module mykinds.recent ("),
    (["mykinds.recent:RecentOptions"], "cache.target=mykinds.recent:RecentOptions: RecentOptions is not a subclass "
                                       "of models.kv_cache.KVCache"),
    (["otherkinds:Nameless"], "cache.target=otherkinds:Nameless: its kind '' is not a name a run can take"),
    (["otherkinds:NamedLikeH2O"], "cache.target=otherkinds:NamedLikeH2O: its kind 'h2o' is already kvlab's built-in "
                                  "kind (models.kv_cache.h2o.H2OKVCache)"),
])
def test_each_mistake_in_a_target_is_one_line(outside, argv, message):
    before = dict(CACHE_KINDS)
    with pytest.raises(ConfigError) as e:
        register(["cache=external", *(f"cache.target={t}" for t in argv)])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert CACHE_KINDS == before  # nothing registered


@pytest.mark.parametrize("argv,message", [
    ([f"cache.target={EXAMPLE}"], f"cache.target={EXAMPLE} names the class cache=external runs, and this command runs "
                                  "the default kind: add cache=external"),
    (["cache=h2o,snapkv", f"cache.target={EXAMPLE}"], "and this command runs cache=h2o,snapkv: add cache=external"),
])
def test_a_target_where_nothing_runs_external_is_one_line(outside, argv, message):
    with pytest.raises(ConfigError) as e:
        register(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_run_py_refuses_a_target_in_one_line_exit_2_and_writes_nothing(tmp_path):
    """What run.py does with any of the mistakes above (each a ConfigError from register, before Hydra starts)."""
    out = tmp_path / "run"
    proc = run_py([*RUN, "cache=external", "cache.target=models.kv_cache.h2o:H2OOptions", f"hydra.run.dir={out}"],
                  tmp_path)
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    assert one_line(proc.stderr) == ("kvlab: cache.target=models.kv_cache.h2o:H2OOptions: H2OOptions is not a "
                                     "subclass of models.kv_cache.KVCache: a cache kind subclasses it (or one of its "
                                     "kinds, e.g. models.kv_cache.evict.EvictingKVCache)")


EP_MODULE = '''
from dataclasses import dataclass

from models.kv_cache.prealloc import PreallocKVCache


@dataclass(frozen=True)
class PaddedOptions:
    spare: int = 0  # typed here, as a built-in kind's option is


class PaddedKVCache(PreallocKVCache):
    kind, Options = "padded", PaddedOptions
'''


def test_an_installed_packages_entry_point_is_a_kind_and_a_broken_one_breaks_nothing_else(tmp_path, monkeypatch,
                                                                                          capsys):
    folder = fake_distribution(tmp_path, "kvlab_extra", {"padded": "epkinds:PaddedKVCache",
                                                         "ghost": "epkinds_gone:GhostKVCache"},
                               {"epkinds.py": EP_MODULE})
    monkeypatch.syspath_prepend(str(folder))
    with loaded_kinds("epkinds"):
        kinds._SCANNED.clear()  # this process read the entry points before the package was installed
        cfg = composed(["cache=padded", "cache.spare=2"])
        warned = capsys.readouterr().err.strip().splitlines()
        assert len(warned) == 1 and warned[0].startswith("kvlab: warning: kvlab_extra's kvlab.cache_kinds entry "
                                                         "point ghost = \"epkinds_gone:GhostKVCache\" did not load")
        assert "no module 'epkinds_gone' on the path" in warned[0]
        assert warned[0].endswith("(cache=ghost is refused; every other kind runs)")
        rc = read(cfg)
        assert (rc.cache.kind, rc.cache.options, rc.cache.target) == ("padded", {"spare": 2}, "epkinds:PaddedKVCache")
        with pytest.raises(Exception, match="spare"):  # typed
            composed(["cache=padded", "cache.spare=two"])
        with pytest.raises(ConfigError) as e:
            register(["cache=ghost"])
        assert str(e.value).startswith("cache=ghost: kvlab_extra's kvlab.cache_kinds entry point ghost = "
                                       "\"epkinds_gone:GhostKVCache\" did not load: epkinds_gone:GhostKVCache: no "
                                       "module 'epkinds_gone'")
        assert read(composed(["cache=prealloc"])).cache.kind == "prealloc"  # every other kind runs as before
    assert "padded" not in CACHE_KINDS


def test_the_cache_option_keys_follow_the_registry_and_a_reader_accepts_an_unloaded_kinds(outside):
    with pytest.raises(AttributeError, match="'cache_spare' is not a results.json key"):
        measurements.KEYS.cache_spare
    external.load("otherkinds:SpareKVCache")
    assert measurements.KEYS.cache_spare == "cache_spare" and "cache_spare" in measurements.declared_names()
    CACHE_KINDS.pop("spare")
    with pytest.raises(AttributeError):
        measurements.KEYS.cache_spare
    rec = {"status": "ok", "run_name": "r", "model": "tiny", "cache": "spare", "dtype": "fp32", "cache_spare": 3}
    assert measurements.undeclared(rec) == ["cache_spare"]
    assert measurements.undeclared({**rec, "cache_target": "otherkinds:SpareKVCache"}) == []


@pytest.mark.slow  # run.py in a process of its own (PYTHONPATH is read as Python starts), then two readers
def test_run_py_runs_the_example_from_pythonpath_and_a_fresh_process_reads_its_record(tmp_path):
    folder = copy_example(tmp_path / "outside")
    out = tmp_path / "run"
    proc = run_py([*RUN, "cache=external", f"cache.target={EXAMPLE}", "cache.budget=8", f"hydra.run.dir={out}"],
                  tmp_path, {"PYTHONPATH": str(folder)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((out / "results.json").read_text())
    assert (rec["status"], rec["cache"], rec["cache_target"], rec["cache_budget"]) == ("ok", "recent", EXAMPLE, 8)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the kind is nowhere on this one's path
    code = ("from harness.results import load_runs\nfrom harness import measurements\nimport json, sys\n"
            f"df = load_runs({str(out)!r})\nrec = json.load(open({str(out / 'results.json')!r}))\n"
            "print(df.cache_target[0], df.cache_sinks[0], measurements.undeclared(rec), 'mykinds' in sys.modules)")
    read_back = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=300)
    assert read_back.stdout.split() == [EXAMPLE, "1", "[]", "False"], read_back.stderr[-2000:]
    report = subprocess.run([sys.executable, "-m", "harness.report", str(out), "--out", str(tmp_path / "report")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0 and (tmp_path / "report" / "report.html").is_file(), report.stderr[-2000:]
    assert "recent B8 sinks=1" in (tmp_path / "report" / "report.html").read_text()

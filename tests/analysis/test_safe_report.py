"""The sweep report writes only into folders it may write (issue 18): the user's files in ``--out`` survive byte for
byte, a run's folder is never a report folder, a ``wandb/`` folder kvlab did not make is left alone, only kvlab's own
files go into the W&B artifact, one report writer at a time holds a report folder, folder names that are not UTF-8
are read without a traceback, and a not_equivalent run is a failure on the page, never a plotted good run.

Fast tests build a fake sweep (kvlab-shaped results.json records and tables, Hydra's .hydra folders) directly; one
slow test runs a real tiny sweep."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from omegaconf import OmegaConf

from harness.experiment import runner as experiment
from harness.common import ownership
from harness.analysis import plots
from harness.analysis import report
from harness.experiment import records
from harness.analysis import results
from harness.experiment import tracking
from harness.analysis import wandb_report as wrep
from tests.helpers import QUICK, REPO, run_py

CASES = [
    ("report-out-foreign-files",
     "`harness.analysis.report PATH --out DIR` on a folder holding files kvlab did not write exits 2 with one line naming them; "
     "DIR is left byte for byte as it was (no manifest, no lock, nothing added)"),
    ("report-wandb-not-ours",
     "a report/wandb folder kvlab did not write is never deleted: the report (CLI with --wandb offline, or the sweep's "
     "own report, which then counts as not ok with one line on stderr) refuses the folder and leaves it as it was"),
    ("report-wandb-ours-replaced",
     "the report's own wandb/ (listed in the report folder's manifest) is replaced by the new aggregate W&B run"),
    ("report-artifact-only-ours",
     "the aggregate W&B run's artifact holds exactly the files this report wrote (tables, PNGs, report.html): not "
     "the manifest, the lock, nor other files kvlab wrote there earlier"),
    ("report-claims-before-writing",
     "every file the report writes (tables, PNGs, report.html, wandb_report.json, wandb/) is listed in the report "
     "folder's manifest; the sweep folder's manifest (if any) lists report/"),
    ("report-out-run-folder",
     "--out at a run folder (it holds results.json, is a Hydra job folder, or its manifest lists a run's tables) is "
     "refused in one line ('DIR is a run folder ...: give --out a folder of its own'); the run's CSVs are unchanged"),
    ("report-legacy-folder-adopted",
     "a report folder an earlier kvlab wrote before manifests (its report.html is kvlab's, its wandb/ holds only the "
     "report's own W&B run) is adopted and rewritten; with anything else in it, it is refused"),
    ("report-one-writer-at-a-time",
     "a second report writer on one report folder waits for the first (one line says so), then writes"),
    ("report-non-utf8-names",
     "a run folder whose name is not UTF-8 (b'\\xff\\xfe') is read: its name is shown escaped ('\\xff\\xfe') in the "
     "tables, the page and the summary; a folder named like HTML is escaped on the page; no traceback"),
    ("report-not-equivalent",
     "a not_equivalent run is listed with the failures (summary line, stderr, the failed-runs table with its status "
     "and error) and in a red 'Not equivalent' section of report.html; it has no rows in the step/drift/memory "
     "tables and is not drawn in any plot"),
    ("report-started-by-notes",
     "the sweep's report lists as unfinished exactly the run folders this invocation noted it started "
     "(experiment.invocation_folders), a refused one without .hydra included; another invocation's are not listed"),
    ("report-spec-not-ours",
     "`harness.analysis.wandb_report GROUP --spec-only FILE` does not overwrite a FILE that is not a kvlab W&B report spec"),
]

INV = "inv000000001"


# ---- a fake sweep --------------------------------------------------------------------------------------------------

def _record(name: str, cache: str = "concat", dtype: str = "fp32", status: str = "ok", **kw) -> dict:
    """A kvlab-shaped results.json record (the keys the report and its plots read)."""
    exact = dtype == "fp32"
    rec = dict(run_name=name, group="quick-s", status=status, model="tiny", cache=cache, cache_label=cache,
               dtype=dtype, device="cpu", engine="kvlab", serve_batch=1, prompt_lengths="uniform", error=None,
               experiment="quick", weights="random", weights_detail="random init (seed 0)", cache_exact=True,
               tokens_identical=True, max_abs_logit_diff=3e-7 if exact else 2e-3, first_diff_step=None,
               nbytes_match=True, cache_nbytes=13312, predicted_nbytes=13312,
               bytes_per_token=1024.0 if exact else 512.0, drift_kl=None if exact else 1e-5,
               step_ms_cached_at_max_context=16.0, step_ms_uncached_at_max_context=100.0,
               speedup_at_max_context=6.2, batch=1, context_lengths="8,32", invocation=INV, config_id=name[-6:],
               torch_version="2.x", device_name="cpu", threads=2, attn_backend="sdpa:cpu", tf32=False,
               git_commit="unknown", weights_source="random", python_version="3.11")
    rec.update(kw)
    return rec


def _tables(rec: dict) -> dict[str, pd.DataFrame]:
    keys = {k: rec[k] for k in ("model", "engine", "cache", "cache_label", "dtype", "device")}
    steps = pd.DataFrame([dict(keys, context_len=c, mode=m, ms_median=16.0 if m == "cached" else 100.0 + c)
                          for c in (8, 32) for m in ("cached", "uncached")])
    drift = pd.DataFrame([dict(keys, step=s, eq_max_abs_diff=rec["max_abs_logit_diff"], eq_top1_agreement=1.0,
                               drift_kl=rec["drift_kl"]) for s in range(4)])
    memory = pd.DataFrame([dict(keys, tokens=t, nbytes_formula=1024 * t, nbytes_measured=1024 * t)
                           for t in (0, 4, 8)])
    return dict(steps=steps, drift=drift, memory=memory)


def _run(sweep: Path, rec: dict, hydra: bool = True) -> Path:
    """A run folder as kvlab writes it: .hydra, the tables, results.json, each listed in the folder's manifest."""
    folder = sweep / rec["run_name"]
    if hydra:
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "config.yaml").write_text("model: {name: tiny}\n")
    tracking.write_run_files(folder, rec, _tables(rec))
    return folder


@pytest.fixture
def sweep(tmp_path, monkeypatch) -> Path:
    """A sweep of three ok runs, each folder and the sweep folder with kvlab's manifest."""
    monkeypatch.setenv("KVLAB_INVOCATION", INV)
    s = tmp_path / "sweep"
    for cache, dtype in (("concat", "fp32"), ("prealloc", "fp32"), ("concat", "fp16")):
        _run(s, _record(f"tiny_{cache}_{dtype}_cpu_{cache[:3]}{dtype}"[:40], cache, dtype))
    (s / "multirun.yaml").write_text("hydra: {}\n")
    ownership.claim(s, "multirun.yaml", *[p.name for p in s.iterdir() if p.is_dir()])
    return s


@pytest.fixture
def one_plot(monkeypatch):
    """Only the cache-bytes figure (a real one, drawn from the ok rows): the report's other figures take seconds."""
    def makers(runs, steps, drift, memory=None, layers=None, batches=None):
        return {"cache_bytes": (plots.cache_bytes_plot, runs)}

    monkeypatch.setattr(report.figures, "figures_for", lambda runs, frames: makers(
        runs, *[frames.get(k) for k in ("steps", "drift", "memory", "layers", "batches")]))


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "harness.report", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, timeout=timeout)


def _snapshot(folder: Path) -> dict:
    """Every file under ``folder`` (relative name -> bytes), folders too (-> None)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), folder)] = None
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = Path(p).read_bytes()
    return out


def _one_line(stderr: bytes) -> str:
    text = stderr.decode("utf-8", "replace")
    assert text.count("\n") == 1 and "Traceback" not in text, text
    return text


# ---- report-out-foreign-files ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_users_files_in_out_survive_byte_for_byte(sweep, tmp_path):
    out = tmp_path / "mine"
    (out / "wandb").mkdir(parents=True)
    (out / "notes.txt").write_bytes(b"my notes\n")
    (out / "results.csv").write_bytes(b"my,own\n1,2\n")  # the name of a report table
    (out / "wandb" / "run.wandb").write_bytes(b"\x00\x01mine")
    before = _snapshot(out)
    proc = _cli(sweep, "--out", out)
    assert proc.returncode == 2
    err = _one_line(proc.stderr)
    assert "kvlab did not write" in err and "notes.txt" in err and "results.csv" in err
    assert _snapshot(out) == before  # no manifest, no lock, not a byte changed
    with pytest.raises(ownership.NotOurs, match="did not write"):
        report.build_report(sweep, out)
    assert _snapshot(out) == before


def test_save_table_never_replaces_a_file_kvlab_did_not_write(tmp_path):
    (tmp_path / "steps.parquet").write_bytes(b"theirs")
    with pytest.raises(ownership.NotOurs, match="steps.parquet"):
        results.save_table(pd.DataFrame({"a": [1]}), tmp_path, "steps")
    assert (tmp_path / "steps.parquet").read_bytes() == b"theirs" and not (tmp_path / "steps.csv").exists()


# ---- report-wandb-not-ours / report-wandb-ours-replaced / report-artifact-only-ours -------------------------------

def test_a_wandb_folder_kvlab_did_not_write_survives(sweep, one_plot, capsys):
    report.build_report(sweep)  # the sweep's report/, kvlab's
    mine = sweep / "report" / "wandb"
    mine.mkdir()
    (mine / "user.txt").write_bytes(b"my own W&B folder")
    before = _snapshot(sweep / "report")
    assert report.main([str(sweep), "--wandb", "offline"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds files kvlab did not write (wandb)" in err
    assert _snapshot(sweep / "report") == before
    # the sweep's own report at the end of a multirun: one line, and the sweep is not ok
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "experiment": "quick",
                            "tracking": {"mode": "offline", "project": "kvlab", "entity": None, "group": "quick-s"}})
    from harness.experiment import invocation

    notes = invocation._notes(experiment.invocation())
    try:
        report.SweepReport().on_multirun_end(cfg)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "sweep report not written" in err and "wandb" in err
        assert "python -m harness.report" in err and "--out DIR" in err
        assert any("the sweep report" in f for f in experiment.invocation_failures())
    finally:
        for f in notes.glob("failure-*.json"):  # the failure noted here, not this process's other notes
            f.unlink()
    assert _snapshot(sweep / "report") == before


class _FakeWandb:
    """What log_wandb_aggregate calls on wandb, recorded: the artifact's files above all."""

    def __init__(self, folder: Path):
        self.added: list[tuple[str, str]] = []
        self.run = types.SimpleNamespace(id="rid", dir=str(folder / "wandb" / "offline-run-x" / "files"),
                                         log=lambda row: None, log_artifact=lambda art: None,
                                         summary={}, finish=lambda **k: None)
        self.Table = lambda dataframe: None
        self.Image = self.Html = lambda *a, **k: None
        self.plot = types.SimpleNamespace(line_series=lambda **k: None)

    def Artifact(self, *a, **k):  # noqa: N802 (wandb's name)
        return types.SimpleNamespace(add_file=lambda path, name: self.added.append((path, name)))


def test_the_artifact_holds_only_the_files_this_report_wrote(sweep, one_plot, monkeypatch):
    out = sweep / "report"
    old = out / "wandb" / "offline-run-old"
    old.mkdir(parents=True)
    ownership.claim(out, "wandb", "notes.md", "stale.png")  # kvlab's, from earlier
    (out / "notes.md").write_text("# notes\n")
    (out / "stale.png").write_bytes(b"png")
    fakes = []

    def fake_run(mode, project, entity, group, name, folder, config, job_type, run_id=None, **kw):
        assert not old.exists()  # kvlab's own wandb/ was cleared first (it is listed in the manifest)
        fakes.append(_FakeWandb(Path(folder)))
        return fakes[-1], fakes[-1].run, "offline"

    monkeypatch.setattr(tracking, "_wandb_run", fake_run)
    rep = report.report_and_log(sweep, "offline", "kvlab", None, "quick-s")
    (fake,) = fakes
    names = sorted(name for _, name in fake.added)
    written = sorted(p.name for p in rep["files"])
    assert names == written and "report.html" in names and "cache_bytes.png" in names
    assert {"results.csv", "results.parquet", "steps.csv", "drift.csv", "memory.csv"} <= set(names)
    assert not {"notes.md", "stale.png", ownership.MANIFEST, ownership.LOCK, "wandb_report.json"} & set(names)
    assert all(Path(p).parent == out for p, _ in fake.added)
    # report-claims-before-writing: all it wrote is listed, and the sweep folder lists report/
    mine = ownership.owned(out)
    assert set(written) | {"wandb", "wandb_report.json"} <= mine
    assert (out / "wandb_report.json").is_file() and wrep.spec_from_file(out)["group"] == "quick-s"
    assert "report" in ownership.owned(sweep) and not ownership.foreign(out)
    assert not (out / ownership.LOCK).exists()  # released
    assert (out / "notes.md").read_text() == "# notes\n"  # another kvlab file, left as it was


def test_a_table_over_wandbs_row_limit_goes_in_the_files_only(sweep, one_plot, monkeypatch):
    """W&B cuts a table longer than its row limit short, saying so only in a log line: such a table (a big sweep's
    per-position rows) is not logged as a table at all; the run's summary names it, and its files are in the
    artifact."""
    logged, fakes = {}, []

    class Table:
        MAX_ARTIFACT_ROWS = 3

        def __init__(self, dataframe):
            self.rows = len(dataframe)

    def fake_run(mode, project, entity, group, name, folder, config, job_type, run_id=None, **kw):
        fakes.append(_FakeWandb(Path(folder)))
        fakes[-1].Table = Table
        fakes[-1].run.log = logged.update
        return fakes[-1], fakes[-1].run, "offline"

    monkeypatch.setattr(tracking, "_wandb_run", fake_run)
    rep = report.report_and_log(sweep, "offline", "kvlab", None, "quick-s")
    frames = {k: df for k, df in rep["frames"].items() if df is not None and len(df)}
    long = sorted(k for k, df in frames.items() if len(df) > 3)
    assert long and fakes[0].run.summary["tables_in_files_only"] == ", ".join(long)
    assert {f"{k}_table" for k in frames} - {f"{k}_table" for k in long} == {k for k in logged if k.endswith("_table")}
    assert all(t.rows <= 3 for k, t in logged.items() if k.endswith("_table"))
    assert {f"{k}.csv" for k in long} <= {name for _, name in fakes[0].added}


# ---- report-out-run-folder -------------------------------------------------------------------------------------

def test_out_at_a_run_folder_is_refused_and_its_tables_are_unchanged(sweep, tmp_path, capsys):
    run = next(p for p in sweep.iterdir() if (p / "results.json").is_file())
    before = _snapshot(run)
    assert report.main([str(sweep), "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run} is a run folder" in err and "give --out a folder of its own" in err
    assert _snapshot(run) == before
    # a run still going (no results.json yet), or one of Hydra's job folders: also a run's folder
    going = tmp_path / "going"
    ownership.claim(going, "results.json", "steps.csv")
    (going / "steps.csv").write_text("context_len,mode,ms_median\n8,cached,1.0\n")
    job = tmp_path / "job"
    (job / ".hydra").mkdir(parents=True)
    for folder, why in ((going, "holds a run's steps.csv"), (job, "Hydra job folder")):
        assert why in records.run_folder(folder)
        with pytest.raises(ownership.NotOurs, match="is a run folder"):
            report.build_report(sweep, folder)
        with pytest.raises(ownership.NotOurs, match="is a run folder"):
            results.save_table(pd.DataFrame({"a": [1]}), folder, "steps")
    assert (going / "steps.csv").read_text().startswith("context_len") and list(job.iterdir()) == [job / ".hydra"]


# ---- report-legacy-folder-adopted ---------------------------------------------------------------------------------

def _legacy(out: Path, rid: str | None = None) -> Path:
    """A report folder as kvlab wrote it before manifests: its page, a table, a figure, its aggregate W&B run."""
    rid = rid or experiment.wandb_id(out, "report")
    (out / "wandb" / f"offline-run-20260101_000000-{rid}").mkdir(parents=True)
    (out / "wandb" / "latest-run").symlink_to(f"offline-run-20260101_000000-{rid}")
    (out / "report.html").write_text("<!doctype html><html><head><meta charset='utf-8'><title>kvlab report: "
                                     "sweep</title></head></html>")
    (out / "results.csv").write_text("run_name\nx\n")
    (out / "step_time.png").write_bytes(b"png")
    return out


def test_a_report_folder_from_before_manifests_is_adopted(sweep, one_plot, tmp_path):
    out = _legacy(sweep / "report")
    rep = report.build_report(sweep)
    assert "kvlab report: sweep" in rep["html"].read_text() and len(pd.read_csv(out / "results.csv")) == 3
    assert {"report.html", "results.csv", "step_time.png", "wandb"} <= ownership.owned(out)
    # the same with a file of the user's beside it, or a wandb/ holding another W&B run: refused, untouched
    mine = _legacy(tmp_path / "mine")
    (mine / "mine.txt").write_text("mine")
    other = _legacy(tmp_path / "other", rid="0123456789abcdef")
    for folder, named in ((mine, "(mine.txt)"), (other, "(wandb)")):
        before = _snapshot(folder)
        with pytest.raises(ownership.NotOurs, match=re.escape(named)):
            report.build_report(sweep, folder)
        assert _snapshot(folder) == before


# ---- report-one-writer-at-a-time ----------------------------------------------------------------------------------

def test_a_second_report_writer_waits_for_the_first(sweep, one_plot, monkeypatch, capsys):
    monkeypatch.setattr(ownership, "POLL_S", 0.05)
    out = sweep / "report"
    held, release = threading.Event(), threading.Event()

    def first():
        with ownership.locked(out, "report folder", "other"):
            held.set()
            release.wait(10)

    class Watch:  # the first writer lets go 0.5 s after the second says it waits (however long loading took)
        def __init__(self, inner):
            self.inner, self.waited_at = inner, None

        def write(self, text):
            if "is in use by kvlab process" in text and self.waited_at is None:
                self.waited_at = time.monotonic()
                threading.Timer(0.5, release.set).start()
            return self.inner.write(text)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    t = threading.Thread(target=first)
    t.start()
    assert held.wait(10)
    watch = Watch(sys.stderr)
    monkeypatch.setattr(sys, "stderr", watch)
    rep = report.build_report(sweep)
    t.join()
    assert watch.waited_at is not None and time.monotonic() - watch.waited_at >= 0.4 and rep["html"].is_file()
    monkeypatch.setattr(sys, "stderr", watch.inner)
    err = capsys.readouterr().err
    assert err.count("is in use by kvlab process") == 1 and "waiting for it to finish" in err


# ---- report-non-utf8-names ---------------------------------------------------------------------------------------

def test_folder_names_that_are_not_utf8_are_read_and_shown_escaped(sweep, one_plot, tmp_path, capsys):
    src = next(p for p in sorted(sweep.iterdir()) if (p / "results.json").is_file())
    odd = os.fsencode(str(sweep)) + b"/\xff\xfe"
    os.mkdir(odd)
    shutil.copy(src / "results.json", odd + b"/results.json")
    html_name = sweep / "<b>bold"
    html_name.mkdir()
    rec = json.loads((src / "results.json").read_text())
    (html_name / "results.json").write_text(json.dumps(dict(rec, run_name="<i>r</i>", config_id="html")))
    (sweep / "killed\udcff" / ".hydra").mkdir(parents=True)  # a job that never finished, odd name too
    rep = report.build_report(sweep, tmp_path / "out")
    shown = f"{sweep}/\\xff\\xfe"
    assert shown in set(rep["runs"].run_dir) and len(rep["runs"]) == 5
    assert shown in set(pd.read_parquet(tmp_path / "out" / "results.parquet").run_dir)
    assert shown in (tmp_path / "out" / "results.csv").read_text(encoding="utf-8")
    page = rep["html"].read_text(encoding="utf-8")
    assert "\\xff\\xfe" in page and "killed\\xff" in page
    assert "&lt;i&gt;r&lt;/i&gt;" in page and "<i>r</i>" not in page
    assert "<b>bold" not in page and "&lt;b&gt;bold" in page
    report.print_summary(rep)
    err = capsys.readouterr().err
    assert "\\xff\\xfe" in err and "\udcff" not in err


def test_text_that_is_not_utf8_in_a_record_is_shown_escaped(tmp_path):
    rec = _record("r")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "results.json").write_text(json.dumps(dict(rec, sample_text="\udcff\ud800x")))
    record, why = records.read_record(tmp_path / "r" / "results.json")
    assert why is None and record["sample_text"].encode("utf-8")
    results.save_table(results.load_runs(tmp_path), tmp_path / "t", "results")  # parquet takes it


# ---- report-not-equivalent ----------------------------------------------------------------------------------------

def test_a_not_equivalent_run_is_a_failure_and_never_plotted(sweep, one_plot, capsys):
    why = ("cache prealloc is an exact kind in fp32 but not equivalent to its reference: max |dlogit| 3.2e-03 > "
           "tolerance 1e-04")
    bad = _run(sweep, _record("tiny_prealloc_fp32_cpu_broken", "prealloc", status="not_equivalent", error=why,
                              max_abs_logit_diff=3.2e-3, cache_nbytes=777777, predicted_nbytes=777777,
                              equivalence_tol=1e-4, invocation=INV))
    assert (bad / "steps.csv").is_file()  # its numbers are kept...
    rep = report.build_report(sweep, invocation=INV)
    runs = rep["runs"]
    assert len(runs) == 4 and (runs.status == "not_equivalent").sum() == 1
    name = "tiny_prealloc_fp32_cpu_broken"
    assert name not in set(plots._ok(runs).run_name)  # ...but it is not a good run: not plotted
    for key, df in rep["frames"].items():
        assert name not in set(df.get("run_name", [])), key
    fig = plots.cache_bytes_plot(runs)
    assert 777777 not in [p.get_height() for p in fig.axes[0].patches]
    plt.close("all")
    page = rep["html"].read_text(encoding="utf-8")
    assert "Not equivalent" in page and "3 ok, 1 not ok (1 not equivalent)" in page
    failed = page[page.index("<h2>Failed runs</h2>"):page.index("<h2>Runs</h2>")]
    assert name in failed and "not_equivalent" in failed and "tolerance 1e-04" in failed
    noteq = page[page.index("Not equivalent"):page.index("<h2>Failed runs</h2>")]
    assert name in noteq and "0.0032" in noteq
    report.print_summary(rep)
    out, err = capsys.readouterr()
    assert "4 runs (1 not ok, 1 not equivalent)" in out
    assert f"kvlab: run {name} not_equivalent: {why}" in err


# ---- report-started-by-notes --------------------------------------------------------------------------------------

def test_the_sweep_report_lists_the_unfinished_runs_this_invocation_started(sweep, one_plot, monkeypatch):
    (sweep / "mine_killed" / ".hydra").mkdir(parents=True)
    (sweep / "theirs_killed" / ".hydra").mkdir(parents=True)
    (sweep / "mine_refused").mkdir()  # refused before Hydra's files: no .hydra
    monkeypatch.setattr(report.invocations, "invocation_folders",
                        lambda inv: [sweep / "mine_killed", sweep / "mine_refused"] if inv == INV else [])
    rep = report.build_report(sweep, invocation=INV)
    listed = {Path(f).name for f, _ in rep["skipped"] if f}
    assert listed == {"mine_killed", "mine_refused"}  # never another invocation's theirs_killed


# ---- report-spec-not-ours -----------------------------------------------------------------------------------------

def test_spec_only_never_overwrites_a_file_that_is_not_a_kvlab_spec(tmp_path, capsys):
    theirs = tmp_path / "wandb_report.json"
    theirs.write_text('{"mine": true}\n')
    assert wrep.main(["quick-s", "--spec-only", str(theirs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a kvlab W&B report spec" in err
    assert theirs.read_text() == '{"mine": true}\n'
    assert wrep.main(["quick-s", "--spec-only", str(tmp_path / "new.json")]) == 0
    assert wrep.main(["quick-t", "--spec-only", str(tmp_path / "new.json")]) == 0  # its own: replaced
    assert wrep.spec_from_file(tmp_path / "new.json")["group"] == "quick-t"


# ---- a real sweep -------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_real_sweep_reports_safely(tmp_path):
    """A real two-run sweep: a copy of one run under a non-UTF-8 name is read, the CLI says so without a traceback;
    --out at one of its runs is refused with the run's CSVs unchanged; a report folder holding a user's file is
    refused and left as it was."""
    s = tmp_path / "s"
    proc = run_py(["-m", "cache=concat,prealloc", *QUICK, "tracking=disabled", f"hydra.sweep.dir={s}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (s / "report" / "report.html").is_file() and not ownership.foreign(s / "report")
    run = next(p for p in sorted(s.iterdir()) if (p / "results.json").is_file())
    odd = os.fsencode(str(s)) + b"/\xff\xfe"
    os.mkdir(odd)
    shutil.copy(run / "results.json", odd + b"/results.json")
    out = tmp_path / "by-hand"
    cli = _cli(s, "--out", out)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert b"Traceback" not in cli.stderr and b"\\xff\\xfe" in cli.stderr and b"3 runs (0 not ok)" in cli.stdout
    assert "\\xff\\xfe" in (out / "report.html").read_text(encoding="utf-8")
    before = _snapshot(run)
    refused = _cli(s, "--out", run)
    assert refused.returncode == 2 and b"is a run folder" in refused.stderr
    _one_line(refused.stderr)
    assert _snapshot(run) == before
    (out / "notes.txt").write_text("mine")
    again = _snapshot(out)
    refused = _cli(s, "--out", out)
    assert refused.returncode == 2 and b"notes.txt" in refused.stderr and _snapshot(out) == again

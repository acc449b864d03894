"""Safe runs, second pass (issue 44): adoption only with proof, manifests that prove their folder, sweeps sharing a
folder never taking each other's runs, nothing of kvlab's inside a run's folder, locks that say how to clear them
and are taken over when their holder is provably gone, and prompts files sized before they are read. Each case has
an id; docs/faults.md's fault table lists them (``CASES``)."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from harness.common import signals
from harness.core import inputs
from harness.experiment import folder
from harness.experiment import runner as experiment
from harness.common import ownership
from harness.analysis import report
from harness.analysis import results
from harness.experiment.config import ConfigError
from tests.helpers import NO_REPORT, QUICK, TINY, run_py

CASES = [
    ("adopt-copied-record", "a folder holding a results.json copied from another run folder plus the user's own "
                            "steps.csv or run.log is not adopted: refused in one line naming why, every file kept"),
    ("adopt-foreign-table", "a run folder from before manifests whose steps.csv or run.log is not its record's is "
                            "not adopted"),
    ("manifest-not-kvlab", "a .kvlab-manifest.json kvlab did not write is never merged into or overwritten; a sweep "
                           "into its folder is refused in one line, exit 2"),
    ("manifest-copied", "a kvlab manifest copied from another folder lists nothing here; a folder renamed whole "
                        "keeps its manifest"),
    ("sweeps-share-a-folder", "a second sweep that skips a run the first one measured adds its invocation to the "
                              "run's record; the first sweep's report still counts the run"),
    ("report-out-inside-run", "python -m harness.report S --out RUN/sub is refused: nothing of kvlab's goes into a "
                              "run's folder"),
    ("report-out-a-file", "python -m harness.report S --out FILE (or FILE/sub): one line, exit 2"),
    ("sweep-dir-a-run-folder", "hydra.sweep.dir at a finished run's folder (or inside it) is refused in one line, "
                               "exit 2; the run is unchanged"),
    ("run-dir-inside-run", "hydra.run.dir inside another run's folder is refused in one line, exit 2; that run "
                           "unchanged"),
    ("sweep-subdir-outside", "hydra.sweep.subdir=../x (a run outside its sweep folder) is refused in one line "
                             "naming the setting, for each run"),
    ("lock-other-host", "a lock held from another host: the waiting line says how to clear it; one not refreshed "
                        "for STALE_S seconds is taken over, in one line"),
    ("lock-heartbeat", "a held lock is refreshed every HEARTBEAT_S seconds, so another host can tell it is live"),
    ("prompts-not-regular", "prompts_file=/dev/zero, /dev/urandom or a FIFO: refused before a byte is read"),
    ("prompts-too-big", "a prompts file over 64 MiB is refused by its size, before it is read"),
    ("report-record-device", "a results.json that is a link to /dev/zero, or over 16 MiB, in a folder a report "
                             "reads: skipped with why, never read"),
    ("report-record-deep-json", "a results.json nested 1,000,000 deep, or holding a 5,000-digit integer: skipped "
                                "with why, no traceback"),
    ("report-many-records", "more than RECORDS_TOTAL_MAX bytes of records under one scan: the rest skipped with why"),
    ("report-table-huge", "a run's table over 1 GiB (or not a regular file): skipped with why, never read"),
    ("wandb-spec-device", "python -m harness.wandb_report --from-spec /dev/zero: one line, exit 2, nothing read"),
    ("manifest-not-a-file", "a .kvlab-manifest.json that is a FIFO, a device or a 3 GB file: never opened or read; "
                            "the folder is refused in one line"),
    ("lock-not-a-file", "a .kvlab.lock that is a folder, FIFO or device: one line naming it, never removed, no hang"),
    ("lock-huge-or-garbage", "a .kvlab.lock of 3 GB, or one that names no host and integer pid: never read whole; "
                             "taken over as an unreadable lock"),
    ("lock-same-host-not-kvlab", "a lock naming a live process of this host: the waiting line says how to clear it"),
    ("lock-future-time", "a lock from another host whose time lies more than STALE_S in the future: taken over"),
    ("sweep-subdir-report", "hydra.sweep.subdir=report (the sweep's report folder) is refused for each run"),
    ("sweep-dir-inside-report", "hydra.sweep.dir at or inside a report folder (or report --out inside one) is "
                                "refused in one line, exit 2"),
    ("prompts-one-huge-line", "a prompts file that is one 50 MB line: at most PARAGRAPH_MAX characters of a "
                              "paragraph are tokenized"),
    ("report-signal", "SIGTERM (or SIGHUP, SIGUSR2) during python -m harness.report: one line, exit 128 + n, its lock "
                      "released"),
    ("report-walks-bounded", "python -m harness.report / (or any folder holding more than WALK_MAX entries): one "
                             "line; other filesystems and kvlab's own wandb/report folders are never searched, a "
                             "folder reached twice through a link is searched once"),
    ("report-huge-int-table", "a record holding an integer beyond 64 bits: the report's parquet table keeps it as "
                              "text, no traceback"),
    ("sweep-launcher-slurm-composed", "a Slurm launcher chosen in a config file (not on the command line) with no "
                                      "Slurm reachable: the sweep's callback refuses it in one line, exit 2"),
    ("wandb-spec-trailing-slash", "--spec-only DIR/ for a folder not made yet writes DIR/wandb_report.json, not a "
                                  "file named DIR"),
    ("drift-evicting-diagnosis", "the divergence diagnosis of a kind that drops keys names eviction's cost, never "
                                 "'look for a bug'"),
]

FAST = [*TINY, "tracking=disabled"]
# the finished run's command: equivalence and step times alone, for the tests below read (and replace) its steps.csv
# and run.log, and no other measurement's keys or tables
FINISHED = [*FAST, "measurements=[equivalence,step_time]"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished tiny run, made once for this file (treat as read-only: copy it to change it)."""
    tmp = tmp_path_factory.mktemp("finished")
    out = tmp / "run"
    proc = run_py([*FINISHED, f"hydra.run.dir={out}"], tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def copy_run(src: Path, dst: Path) -> Path:
    """A finished run copied to ``dst`` as if measured there: its manifest and record name ``dst``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(ownership.MANIFEST, ownership.LOCK))
    ownership.claim(dst, *ownership.owned(src))
    record = json.loads((dst / "results.json").read_text())
    record["run_dir"] = str(dst)
    (dst / "results.json").write_text(json.dumps(record))
    return dst


# ---- adoption needs proof ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("theirs", ["steps.csv", "run.log"])
def test_a_copied_record_does_not_make_the_users_file_kvlabs(finished, tmp_path, theirs):
    out = tmp_path / "mine"
    out.mkdir()
    shutil.copy(finished / "results.json", out / "results.json")
    (out / theirs).write_text("the user's own numbers\n")
    assert "written for another folder" in folder.adoption_problem(out)
    assert not ownership.adopt(out, set(folder.partial_files()), folder._is_kvlab_run)
    with pytest.raises(ownership.NotOurs, match="written for another folder"):
        folder.take_folder(out)
    assert sorted(os.listdir(out)) == sorted(["results.json", theirs])  # no manifest added


@pytest.mark.slow
def test_a_copied_record_is_refused_and_resume_false_overwrites_nothing(finished, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    shutil.copy(finished / "results.json", out / "results.json")
    (out / "steps.csv").write_text("my,own\n1,2\n")
    before = snapshot(out)
    proc = run_py([*FINISHED, "resume=false", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "written for another folder" in proc.stderr and "holds files kvlab did not write" in proc.stderr
    assert snapshot(out) == before


@pytest.mark.parametrize("theirs", ["steps.csv", "run.log"])
def test_a_legacy_folder_with_a_file_that_is_not_its_records_is_not_adopted(finished, tmp_path, theirs):
    out = tmp_path / "run"
    shutil.copytree(finished, out, ignore=shutil.ignore_patterns(ownership.MANIFEST, ownership.LOCK))
    record = json.loads((out / "results.json").read_text())
    record["run_dir"] = str(out)  # as if measured here by a kvlab from before manifests
    (out / "results.json").write_text(json.dumps(record))
    assert folder.adoption_problem(out) is None  # the whole run, its own: adopted
    (out / theirs).write_text("run_name,x\nsomeone-else,1\n")
    assert f"its {theirs} is not this run" in folder.adoption_problem(out)
    with pytest.raises(ownership.NotOurs, match=f"its {theirs} is not this run"):
        folder.take_folder(out)
    assert not (out / ownership.MANIFEST).exists()


# ---- manifests prove their folder --------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["not json", '["names"]', '{"names": ["notes.txt"], "by": "me"}'])
def test_a_manifest_kvlab_did_not_write_is_never_merged_or_overwritten(tmp_path, text):
    (tmp_path / ownership.MANIFEST).write_text(text)
    (tmp_path / "notes.txt").write_text("mine")
    assert ownership.owned(tmp_path) == set()
    assert ownership.MANIFEST in ownership.foreign(tmp_path) and "notes.txt" in ownership.foreign(tmp_path)
    with pytest.raises(ownership.NotOurs, match="not a manifest kvlab wrote"):
        ownership.claim(tmp_path, "multirun.yaml")
    assert (tmp_path / ownership.MANIFEST).read_text() == text


def test_a_copied_manifest_lists_nothing_and_a_renamed_folder_keeps_its_own(tmp_path):
    a = tmp_path / "a"
    ownership.claim(a, "report", "multirun.yaml")
    assert ownership.owned(a) == {"report", "multirun.yaml"}
    b = tmp_path / "b"
    b.mkdir()
    shutil.copy(a / ownership.MANIFEST, b / ownership.MANIFEST)
    (b / "report").mkdir()
    assert ownership.owned(b) == set() and "report" in ownership.foreign(b)
    with pytest.raises(ownership.NotOurs, match="written for another folder"):
        ownership.claim(b, "multirun.yaml")
    moved = tmp_path / "moved"
    a.rename(moved)  # the same folder under another name: its manifest still proves it
    assert ownership.owned(moved) == {"report", "multirun.yaml"}
    ownership.claim(moved, "x")
    assert json.loads((moved / ownership.MANIFEST).read_text())["folder"] == str(moved)


def test_a_manifest_from_before_folders_were_named_is_trusted_and_upgraded(tmp_path):
    (tmp_path / ownership.MANIFEST).write_text(json.dumps({"names": ["report"], "by": "kvlab"}))
    assert ownership.owned(tmp_path) == {"report"}
    ownership.claim(tmp_path, "report")
    assert json.loads((tmp_path / ownership.MANIFEST).read_text())["folder"] == str(tmp_path)


@pytest.mark.slow
def test_a_sweep_into_a_folder_with_the_users_manifest_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / ownership.MANIFEST).write_text('{"names": ["notes.txt"], "by": "me"}')
    before = snapshot(sweep)
    proc = run_py(["-m", "cache=concat,prealloc", *FAST, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "not a manifest kvlab wrote" in proc.stderr and snapshot(sweep) == before


# ---- sweeps sharing a folder ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_sweep_never_takes_the_first_ones_run(tmp_path):
    sweep = tmp_path / "sweep"
    quick = [*QUICK, "tracking=disabled", NO_REPORT]  # the test builds the first sweep's report itself, below
    a = run_py(["-m", "cache=concat,prealloc", *quick, f"hydra.sweep.dir={sweep}"], tmp_path)
    b = run_py(["-m", "cache=prealloc", *quick, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert a.returncode == b.returncode == 0 and "is complete" in b.stdout
    records = {f.parent.name: json.loads(f.read_text()) for f in sweep.glob("*/results.json")}
    first = {r["invocation"] for r in records.values() if len(r["invocations"].split()) == 1}
    assert len(records) == 2 and len(first) == 1
    (inv_a,) = first
    shared = [r for r in records.values() if len(r["invocations"].split()) == 2]
    assert len(shared) == 1 and shared[0]["invocations"].split()[0] == inv_a  # made by the first, confirmed after
    rep = report.build_report(sweep, out=tmp_path / "again", invocation=inv_a)  # the first sweep's report, now
    assert len(rep["runs"]) == 2


def test_a_confirmed_run_keeps_every_invocation_that_counted_it(finished, tmp_path):
    out = copy_run(finished, tmp_path / "run")
    record = json.loads((out / "results.json").read_text())
    first = record["invocation"]
    assert record["invocations"] == first
    experiment._confirm(out, record, "second0000ab", record["run_name"])
    again = json.loads((out / "results.json").read_text())
    assert again["invocations"].split() == [first, "second0000ab"]
    for inv in (first, "second0000ab"):
        assert [f for f, _ in results.scan(out, inv)["runs"]] == [out]
    assert results.scan(out, "someone-else")["runs"] == []


# ---- nothing of kvlab's inside a run's folder --------------------------------------------------------------------

@pytest.mark.parametrize("sub", ["", "sub", "sub/deeper"])
def test_a_report_is_never_written_into_or_under_a_run_folder(finished, tmp_path, capsys, sub):
    before = snapshot(finished)
    out = finished / sub if sub else finished
    assert report.main([str(finished), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("is a run folder" if not sub else "lies inside the run folder") in err
    assert snapshot(finished) == before and sorted(os.listdir(finished)) == sorted(
        p.name for p in finished.iterdir())
    assert not (finished / "sub").exists()


@pytest.mark.parametrize("sub", ["", "/sub"])
def test_report_out_at_a_file_is_one_line(finished, tmp_path, capsys, sub):
    f = tmp_path / "a-file"
    f.write_text("mine")
    assert report.main([str(finished), "--out", f"{f}{sub}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a file, not a folder" in err and f.read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["at", "inside"])
def test_a_sweep_or_run_into_a_finished_runs_folder_is_refused(finished, tmp_path, where):
    run = copy_run(finished, tmp_path / "run")
    before = snapshot(run)
    target = run if where == "at" else run / "sub"
    sweep = run_py(["-m", "cache=concat,prealloc", *FAST, f"hydra.sweep.dir={target}"], tmp_path)
    assert sweep.returncode == 2 and "Traceback" not in sweep.stderr
    assert ("is a run's folder" if where == "at" else "lies inside the run folder") in sweep.stderr
    if where == "inside":
        single = run_py([*FAST, f"hydra.run.dir={run / 'sub' / 'deeper'}"], tmp_path)
        assert single.returncode == 2 and "lies inside the run folder" in single.stderr
    assert snapshot(run) == before and not (run / "sub").exists()


@pytest.mark.slow
def test_a_sweep_subdir_outside_the_sweep_folder_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_py(["-m", "cache=concat,prealloc", *FAST, f"hydra.sweep.dir={sweep}",
                   "hydra.sweep.subdir=../x${cache.kind}"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.count("not inside the sweep folder") >= 2  # each run refused, naming the setting
    assert not list(tmp_path.glob("x*/results.json"))


# ---- locks -------------------------------------------------------------------------------------------------------

def _foreign_lock(folder: Path, age_s: float) -> Path:
    path = folder / ownership.LOCK
    path.write_text(json.dumps({"pid": 4242, "host": "another-host", "since": "2020-01-01T00:00:00"}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_lock_from_another_host_says_how_to_clear_it(tmp_path, capsys):
    path = _foreign_lock(tmp_path, 5)
    with pytest.raises(TimeoutError, match="in use by kvlab process 4242 on another-host"):
        with ownership.locked(tmp_path, "run folder", wait_s=0.6):
            pass
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"delete {path}" in err and "is taken over" in err
    assert path.exists()


def test_a_lock_from_another_host_not_refreshed_is_taken_over(tmp_path, capsys):
    _foreign_lock(tmp_path, ownership.STALE_S + 60)
    with ownership.locked(tmp_path, "run folder", wait_s=0.6):
        assert json.loads((tmp_path / ownership.LOCK).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert "took over the lock" in err and "another-host" in err


def test_a_held_lock_is_refreshed(tmp_path, monkeypatch):
    monkeypatch.setattr(ownership, "HEARTBEAT_S", 0.05)
    path = tmp_path / ownership.LOCK
    with ownership.locked(tmp_path, "run folder"):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
        deadline = time.monotonic() + 10
        while time.time() - path.stat().st_mtime > 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.time() - path.stat().st_mtime < 60
    assert not path.exists()


@pytest.mark.parametrize("make", ["fifo", "huge", "folder"])
def test_a_manifest_that_is_not_a_small_file_is_never_read(tmp_path, make):
    target = tmp_path / ownership.MANIFEST
    if make == "fifo":
        os.mkfifo(target)
    elif make == "huge":
        with open(target, "wb") as f:
            f.truncate(3 * 2 ** 30)
    else:
        target.mkdir()
    assert ownership.owned(tmp_path) == set()
    assert ownership.manifest_problem(tmp_path) == f"its {ownership.MANIFEST} is not a manifest kvlab wrote"
    with pytest.raises(ownership.NotOurs, match="not a manifest kvlab wrote"):
        folder.take_folder(tmp_path)


@pytest.mark.parametrize("make", ["fifo", "folder", "dangling-link"])
def test_a_lock_that_is_not_a_file_is_one_line_and_kept(tmp_path, make):
    target = tmp_path / ownership.LOCK
    {"fifo": os.mkfifo, "folder": os.mkdir, "dangling-link": lambda p: p.symlink_to(tmp_path / "nowhere")}[make](
        target)
    with pytest.raises(OSError, match="is not a lock kvlab wrote"):
        with ownership.locked(tmp_path, "run folder", wait_s=0.5):
            pass
    assert target.exists() or target.is_symlink()


@pytest.mark.parametrize("content", ["huge", '{"host": "HOST", "pid": "abc"}', '{"pid": 1}'])
def test_a_lock_that_is_huge_or_not_kvlabs_is_taken_over_as_unreadable(tmp_path, content):
    import socket

    path = tmp_path / ownership.LOCK
    if content == "huge":
        with open(path, "wb") as f:
            f.truncate(3 * 2 ** 30)
    else:
        path.write_text(content.replace("HOST", socket.gethostname()))
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    with ownership.locked(tmp_path, "run folder", wait_s=2):
        assert json.loads(path.read_text())["pid"] == os.getpid()


def test_a_lock_of_a_live_process_here_says_how_to_clear_it(tmp_path, capsys):
    import socket
    import subprocess

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / ownership.LOCK).write_text(json.dumps(
            {"pid": sleeper.pid, "host": socket.gethostname(), "since": "now",
             "started": ownership._started(sleeper.pid)}))
        with pytest.raises(TimeoutError):
            with ownership.locked(tmp_path, "run folder", wait_s=0.6):
                pass
    finally:
        sleeper.kill()
        sleeper.wait()
    err = capsys.readouterr().err
    assert f"if process {sleeper.pid} is not a kvlab run, delete {tmp_path / ownership.LOCK}" in err


def test_a_lock_with_a_time_far_in_the_future_is_taken_over(tmp_path, capsys):
    _foreign_lock(tmp_path, -(ownership.STALE_S + 3600))
    with ownership.locked(tmp_path, "run folder", wait_s=0.6):
        assert json.loads((tmp_path / ownership.LOCK).read_text())["pid"] == os.getpid()
    assert "from kvlab process 4242 on another-host: its time lies in the future" in capsys.readouterr().err


def test_a_lock_being_written_or_unreadable_is_said_so(tmp_path, capsys):
    (tmp_path / ownership.LOCK).write_text("{half")
    with pytest.raises(TimeoutError):
        with ownership.locked(tmp_path, "run folder", wait_s=0.6):
            pass
    err = capsys.readouterr().err
    assert "has a lock kvlab cannot read" in err and "process None" not in err


def test_a_signal_lost_inside_another_error_is_still_one_line(finished, tmp_path, monkeypatch, capsys):
    import signal

    def broken(*a, **k):  # a signal mid-import, then the half-loaded module's next use fails
        try:
            raise signals.Interrupted(signal.SIGTERM)
        except KeyboardInterrupt:
            raise AttributeError("module 'matplotlib' has no attribute 'get_data_path'")

    monkeypatch.setattr(report, "report_and_log", broken)
    monkeypatch.setattr(experiment, "catch_signals", lambda: None)
    assert report.main([str(finished), "--out", str(tmp_path / "out")]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().startswith("kvlab report: interrupted (SIGTERM)")


@pytest.mark.slow
def test_runs_and_sweeps_never_go_into_a_report_folder(finished, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    proc = run_py(["-m", "seed=1,2", *FAST, f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=report"], tmp_path)
    assert proc.returncode == 1 and proc.stderr.count("puts this run in the sweep's report folder") >= 2
    assert not (sweep / "report" / "results.json").exists()
    made = tmp_path / "made"
    assert report.main([str(finished), "--out", str(made / "report")]) == 0
    before = snapshot(made)
    for target in (made / "report", made / "report" / "sub"):
        proc = run_py(["-m", "seed=1", *FAST, f"hydra.sweep.dir={target}"], tmp_path)
        assert proc.returncode == 2 and "report folder" in proc.stderr and "Traceback" not in proc.stderr
    capsys.readouterr()
    assert report.main([str(finished), "--out", str(made / "report" / "sub")]) == 2
    assert "lies inside the report folder" in capsys.readouterr().err
    assert snapshot(made) == before


def test_a_record_too_deep_or_with_a_huge_integer_is_skipped(tmp_path):
    for name, text in (("deep", "[" * 1_000_000), ("int", '{"status": ' + "9" * 5000 + "}")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(text)
    why = {f.name: w for f, w in results.scan(tmp_path)["skipped"]}
    assert why == {"deep": "unreadable results.json (RecursionError)", "int": "unreadable results.json (ValueError)"}


def test_a_scan_reads_a_bounded_total_of_records(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RECORDS_TOTAL_MAX", 3000)
    for i in range(4):
        (tmp_path / f"r{i}").mkdir()
        (tmp_path / f"r{i}" / "results.json").write_text(json.dumps({"pad": "x" * 900}))
    found = results.scan(tmp_path)
    why = [w for _, w in found["skipped"]]
    assert len(found["runs"]) == 0 and len(why) == 4  # three unreadable (not kvlab records), one line for the rest
    assert sum(w.startswith("1 results.json files not read") and "more than the 3,000 bytes" in w for w in why) == 1


def test_one_huge_paragraph_is_tokenized_only_in_part(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "PARAGRAPH_MAX", 1000)
    f = tmp_path / "one-line.txt"
    f.write_text("word " * 100_000)

    class Counting:
        seen = []

        def encode(self, text):
            self.seen.append(len(text))
            return list(range(len(text) // 5))

    tok = Counting()
    prompts = inputs.text_prompts(f, 2, 16, tok)
    assert len(prompts) == 2 and max(tok.seen) <= 1000 + 2


def test_a_signal_during_a_report_is_one_line_and_releases_its_lock(finished, tmp_path):
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO

    code = ("import sys, time, harness.analysis.report as r\n"
            "real = r._write\n"
            "def slow(*a, **k):\n"
            "    print('writing', flush=True); time.sleep(30); return real(*a, **k)\n"
            "r._write = slow\n"
            "sys.exit(r.main(sys.argv[1:]))\n")
    out = tmp_path / "rep"
    proc = subprocess.Popen([sys.executable, "-c", code, str(finished), "--out", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err
    assert err.strip().splitlines() == ["kvlab report: interrupted (SIGTERM); the report may be incomplete (each "
                                        "file in it is whole): run the same command again to make it"]
    assert not (out / ownership.LOCK).exists()


def test_a_scan_is_bounded_and_searches_each_folder_once(finished, tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    copy_run(finished, sweep / "a")
    (sweep / "a" / "loop").symlink_to(sweep)  # a link back up
    (sweep / "b").mkdir()
    (sweep / "b" / "same").symlink_to(sweep / "a")  # the same run reached a second way
    found = results.scan(sweep)
    assert [f.name for f, _ in found["runs"]] == ["a"]
    monkeypatch.setattr(results, "WALK_MAX", 5)
    with pytest.raises(FileNotFoundError, match="holds more than 5 files and folders"):
        results.scan(sweep)


def test_a_record_with_a_huge_integer_still_makes_a_report(finished, tmp_path):
    run = copy_run(finished, tmp_path / "s" / "run")
    record = json.loads((run / "results.json").read_text())
    record["seed"] = 10 ** 23
    (run / "results.json").write_text(json.dumps(record))
    rep = report.build_report(tmp_path / "s", out=tmp_path / "out")
    assert len(rep["runs"]) == 1 and (tmp_path / "out" / "results.parquet").exists()


# ---- prompts files are sized before they are read -----------------------------------------------------------------

@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/urandom"])
def test_a_device_as_prompts_file_is_refused_before_reading(dev):
    with pytest.raises(ConfigError, match="is not a regular file"):
        inputs.check_prompts_file(Path(dev))


def test_a_fifo_as_prompts_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):
        inputs.check_prompts_file(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):
        inputs.text_prompts(fifo, 2, 4, tokenizer=None)


def test_a_prompts_file_too_big_is_refused_by_its_size(tmp_path, monkeypatch):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: no disk used
        f.truncate(inputs.PROMPTS_FILE_MAX + 1)
    read = []
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: read.append(self) or "")
    with pytest.raises(ConfigError, match="more than the 67,108,864 kvlab reads"):
        inputs.text_prompts(big, 2, 4, tokenizer=None)
    assert read == []


@pytest.mark.slow
def test_a_run_on_dev_zero_is_one_line(tmp_path):
    proc = run_py(["model=tiny", "model.preset=gpt2", *FAST[1:], "prompts_file=/dev/zero",
                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "is not a regular file" in proc.stderr


def test_a_report_never_reads_a_device_or_a_huge_record(finished, tmp_path):
    sweep = tmp_path / "sweep"
    copy_run(finished, sweep / "good")
    (sweep / "zero").mkdir()
    (sweep / "zero" / "results.json").symlink_to("/dev/zero")
    (sweep / "huge").mkdir()
    with open(sweep / "huge" / "results.json", "wb") as f:
        f.truncate(results.RECORD_MAX + 1)
    found = results.scan(sweep)
    why = {f.name: w for f, w in found["skipped"]}
    assert [f.name for f, _ in found["runs"]] == ["good"]
    assert why["zero"] == "results.json is not a regular file" and f"more than the {results.RECORD_MAX:,}" in why["huge"]


def test_a_huge_table_is_skipped_unread(finished, tmp_path, monkeypatch):
    run = copy_run(finished, tmp_path / "run")
    with open(run / "steps.csv", "r+b") as f:
        f.truncate(results.TABLE_MAX + 1)
    monkeypatch.setattr(results.pd, "read_csv", lambda *a, **k: pytest.fail("read a table over the bound"))
    df, why = results.read_table(run / "steps.csv")
    assert df is None and f"more than the {results.TABLE_MAX:,} kvlab reads" in why


def test_a_wandb_spec_that_is_a_device_is_one_line(tmp_path, capsys):
    from harness.analysis import wandb_report

    assert wandb_report.main(["--from-spec", "/dev/zero"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a regular file" in err


# ---- what a diagnosis says ---------------------------------------------------------------------------------------

def test_a_kind_that_drops_keys_is_not_told_to_look_for_a_bug():
    from harness.core.engines import KvlabEngine
    from harness.core.measure import CacheSpec, diagnose_divergence
    from models.gpt2 import GPT2, GPT2Config

    torch.manual_seed(0)
    engine = KvlabEngine(GPT2(GPT2Config.preset("tiny")).eval())
    prompt = torch.randint(0, 300, (1, 12))
    tokens = [1, 2, 3, 4]
    said = {kind: diagnose_divergence(engine, engine, CacheSpec(kind, opts, torch.float32), prompt, tokens, 2,
                                      margin=50.0, max_abs=1e-3)["drift_divergence_diagnosis"]
            for kind, opts in (("h2o", {"budget": 8}), ("window", {"budget": 8}), ("quant", {}))}
    assert "look for a bug" not in said["h2o"] and "drops keys" in said["h2o"]
    assert "look for a bug" not in said["window"] and "drops keys" in said["window"]
    assert "look for a bug" in said["quant"]  # a lossy kind that keeps every key: a jump is worth a look


def test_a_slurm_launcher_from_a_config_file_is_refused_by_the_sweeps_callback(tmp_path, monkeypatch, capsys):
    from hydra import compose, initialize_config_dir

    from harness.experiment.config import register
    from tests.helpers import REPO

    register()
    sweep = tmp_path / "sweep"
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm_cpu", f"hydra.sweep.dir={sweep}"],
                      return_hydra_config=True)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))
    with pytest.raises(SystemExit) as stop:
        report.SweepReport().on_multirun_start(cfg)
    assert stop.value.code == 2 and not sweep.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-slurm.conf does not exist" in err


def test_a_spec_path_with_a_trailing_slash_is_a_folder():
    from harness.analysis import wandb_report

    assert wandb_report._spec_path("no/such/folder/") == Path("no/such/folder") / wandb_report.SPEC_FILE
    assert wandb_report._spec_path("no/such/file.json") == Path("no/such/file.json")

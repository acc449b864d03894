"""Sweeps through a real Slurm (the single-node cluster scripts/slurm-up starts; `make test` and CI start it): a
three-run sweep through hydra/launcher=slurm_cpu, one failing run among them, pre-emption by `scontrol requeue`
mid-run, `scancel` mid-run, a job that runs out of time, and the job id in every record and in the report.

Needs SLURM_CONF pointing at a cluster that answers. Without one these tests are skipped, and say why; where
KVLAB_REQUIRE_SLURM=1 (CI) they fail instead."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers import NO_REPORT, QUICK, REPO, TINY, run_py

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

LAUNCH = ["hydra/launcher=slurm_cpu", "hydra.launcher.partition=debug", "hydra.launcher.cpus_per_task=1",
          "hydra.launcher.mem_gb=1"]
# a run of a few tens of seconds, long enough to be pre-empted or cancelled in the middle
LONG = ["model=tiny", "n_prompts=4", "full_prompts=4", "new_tokens=100", "prompt_len=8", "repeats=20",
        "warmup=2", "context_lengths=[8,32,64]"]


def slurm_up() -> str | None:
    """Why there is no usable Slurm here (None: there is)."""
    conf = os.environ.get("SLURM_CONF")
    if not conf or not Path(conf).is_file():
        return "SLURM_CONF is not set to a slurm.conf: run `scripts/slurm-up DIR` and export what it prints"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo did not answer ({e})"
    if out.returncode or not out.stdout.strip():
        return f"sinfo failed: {out.stderr.strip()[:200]}"
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm():
    why = slurm_up()
    if why is not None:
        if os.environ.get("KVLAB_REQUIRE_SLURM") == "1":
            pytest.fail(f"Slurm is required here (KVLAB_REQUIRE_SLURM=1) and is not up: {why}")
        pytest.skip(f"no Slurm cluster: {why}")


def records(sweep: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(sweep.glob("*/results.json"))}


def wandb_env(tmp_path) -> dict:
    return {v: str(tmp_path / v.lower()) for v in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                                                   "WANDB_CONFIG_DIR")}


def start(args, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **wandb_env(tmp_path))
    return subprocess.Popen([sys.executable, "run.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def running_job(sweep: Path, timeout: float = 240, not_this: Path | None = None) -> tuple[str, Path]:
    """(job id, run folder) of a run whose measurement has started inside a running Slurm job: the job's log
    (submitit's, under the sweep's .submitit/) names both ("kvlab: run NAME in Slurm job ID (FOLDER)") and its
    progress bars have begun."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for out in sweep.glob(".submitit/**/*_log.out"):
            for line in out.read_text(errors="replace").splitlines():
                m = re.match(r"kvlab: run \S+ in Slurm job (\S+) \((.+)\)$", line)
                err = out.with_name(out.name.replace("_log.out", "_log.err"))
                started = err.is_file() and "generate+check" in err.read_text(errors="replace")
                if m and started and Path(m.group(2)) != not_this and squeue_state(m.group(1)) == "RUNNING":
                    return m.group(1), Path(m.group(2))
        time.sleep(0.5)
    raise AssertionError(f"no run started measuring in a Slurm job within {timeout} s under {sweep}")


def squeue_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def test_a_sweep_through_slurm_cpu_records_its_job_ids_and_one_failure(tmp_path):
    sweep = tmp_path / "sweep"
    ok = run_py(["-m", *LAUNCH, "cache=concat,prealloc,quant", *QUICK, "tracking=disabled",
                 f"hydra.sweep.dir={sweep}"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    runs = records(sweep)
    assert len(runs) == 3 and all(r["status"] == "ok" for r in runs.values())
    ids = {r["slurm_job_id"] for r in runs.values()}
    assert len(ids) == 3 and all(r["slurm_array_task_id"] is not None for r in runs.values())
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(ids)],
                          capture_output=True, text=True).stdout
    assert {line.split("|")[0] for line in acct.split()} == ids  # the scheduler ran exactly these jobs
    assert ok.stdout.count("kvlab report:") == 1
    table = pd.read_csv(sweep / "report" / "results.csv")
    assert set(table.slurm_job_id.astype(str)) == ids
    assert "slurm_job_id" in (sweep / "report" / "report.html").read_text()

    bad = tmp_path / "bad"
    one_fails = run_py(["-m", *LAUNCH, "max_len=64,1000,128", *QUICK, "tracking=disabled", NO_REPORT,
                        f"hydra.sweep.dir={bad}"], tmp_path)  # the exit code comes from the runs' files
    assert one_fails.returncode == 1, one_fails.stderr[-3000:]
    runs = records(bad)
    assert sorted(r["status"] for r in runs.values()) == ["failed", "ok", "ok"]
    assert any("max_len=1000" in (r["error"] or "") for r in runs.values())


def test_a_requeued_job_resumes_and_a_cancelled_one_is_finished_by_the_same_command(tmp_path):
    """Two runs at once; mid-run, one job is requeued (`scontrol requeue`: pre-emption) and the other cancelled
    (`scancel`). Each records `interrupted` (SIGTERM); the requeued job comes back and measures its run once more
    (one W&B run for it); the sweep exits non-zero for the cancelled one, and the same command then completes the
    sweep without measuring the finished run again."""
    sweep = tmp_path / "sweep"
    args = ["-m", *LAUNCH, "hydra.launcher.array_parallelism=2", "cache=concat,prealloc", *LONG, "tracking=offline",
            f"hydra.sweep.dir={sweep}"]
    proc = start(args, tmp_path)
    requeued, a = running_job(sweep)
    cancelled, b = running_job(sweep, not_this=a)
    subprocess.run(["scontrol", "requeue", requeued], check=True)
    subprocess.run(["scancel", cancelled], check=True)
    stopped = {}
    deadline = time.time() + 120
    while len(stopped) < 2 and time.time() < deadline:  # each first attempt records that it was stopped
        for folder in (a, b):
            rec = json.loads((folder / "results.json").read_text()) if (folder / "results.json").is_file() else {}
            if rec.get("status") == "interrupted":
                stopped.setdefault(folder, rec)
        time.sleep(0.2)
    assert set(stopped) == {a, b}, stopped
    assert [stopped[f]["slurm_job_id"] for f in (a, b)] == [requeued, cancelled]
    assert all(r["signal"] == "SIGTERM" for r in stopped.values())
    _, err = proc.communicate(timeout=600)
    assert proc.returncode != 0  # the cancelled run is not done
    deadline = time.time() + 300
    while squeue_state(requeued) and time.time() < deadline:  # the sweep's command may end first; the job runs on
        time.sleep(1)
    runs = records(sweep)
    assert runs[a.name]["status"] == "ok" and runs[a.name]["slurm_job_id"] == requeued  # came back, measured again
    assert runs[a.name]["started_at"] >= stopped[a]["started_at"]
    assert runs[b.name]["status"] == "interrupted"
    again = run_py(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    after = records(sweep)
    assert all(r["status"] == "ok" for r in after.values()) and len(after) == 2
    assert after[a.name]["finished_at"] == runs[a.name]["finished_at"]  # finished: confirmed, not measured again
    assert after[b.name]["slurm_job_id"] not in (cancelled, None)
    for name in after:
        assert len(list((sweep / name / "wandb").glob("offline-run-*"))) == 1


def attempt_started(sweep: Path, attempt: int, timeout: float = 240) -> str:
    """The Slurm job id once the ``attempt``-th start of the sweep's one run has begun measuring: its log names the
    run once per start ("kvlab: run NAME in Slurm job ID", printed once the run's handlers are in place), and its
    progress bars (on stderr) have been redrawn since that line was first seen."""
    deadline, seen = time.time() + timeout, None
    while time.time() < deadline:
        for out in sweep.glob(".submitit/**/*_log.out"):
            starts = re.findall(r"(?m)^kvlab: run \S+ in Slurm job (\S+) ", out.read_text(errors="replace"))
            err = out.with_name(out.name.replace("_log.out", "_log.err"))
            text = err.read_text(errors="replace") if err.is_file() else ""
            if len(starts) >= attempt:
                seen = len(text) if seen is None else seen
                if "generate+check" in text[seen:] and squeue_state(starts[-1]) == "RUNNING":
                    return starts[-1]
        time.sleep(0.5)
    raise AssertionError(f"start {attempt} of the run did not begin measuring within {timeout} s under {sweep}")


def test_a_job_out_of_time_is_requeued_then_recorded_failed_with_why(tmp_path):
    """A job warned of its time limit (SIGUSR2) mid-run: submitit requeues it once (max_num_timeout=1); warned
    again, it fails and its record says it ran out of its time limit. The warning is the one Slurm sends
    (hydra.launcher.signal_delay_s before the limit), sent here with `scancel --signal=USR2` once each start has
    begun measuring: Slurm checks time limits every 30 s and sends its warning up to that much early, so at the
    shortest limit (one minute) it can land while Python is still importing, before any handler exists."""
    sweep = tmp_path / "sweep"
    proc = start(["-m", *LAUNCH, "hydra.launcher.timeout_min=5", "hydra.launcher.max_num_timeout=1",
                  "hydra.launcher.signal_delay_s=10", "cache=concat", *LONG, "tracking=disabled",
                  f"hydra.sweep.dir={sweep}"], tmp_path)
    for attempt in (1, 2):
        job = attempt_started(sweep, attempt)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    (rec,) = records(sweep).values()
    assert rec["status"] == "failed" and "time limit" in rec["error"], rec["error"]
    assert "requeued 1" in rec["error"] and rec["slurm_job_id"] == job


def test_a_job_killed_before_its_run_began_fails_that_run_and_the_sweep_goes_on(tmp_path):
    """A job killed as soon as it runs (SIGKILL, before Python has loaded torch) leaves no result: the sweep says
    so in one line naming the job and its overrides, measures its other run, writes its report and exits 1 (it
    used to stop at that job with a traceback from submitit, the report unwritten); the same command measures the
    lost run."""
    sweep = tmp_path / "sweep"
    args = ["-m", *LAUNCH, "cache=concat,prealloc", *QUICK, "tracking=disabled", f"hydra.sweep.dir={sweep}"]
    proc = start(args, tmp_path)
    deadline, killed = time.time() + 120, None
    while killed is None and time.time() < deadline:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], capture_output=True, text=True).stdout.split("\n")
        mine = [line.split()[0] for line in out if line.endswith(" RUNNING run")]
        if mine:
            killed = mine[0]
            subprocess.run(["scancel", "--signal=KILL", killed], check=True)
        time.sleep(0.05)
    assert killed, "no job of the sweep ran within 120 s"
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    lost = [line for line in err.splitlines() if line.startswith(f"kvlab: Slurm job {killed} (")]
    assert len(lost) == 1 and "ended without returning a result" in lost[0], err[-3000:]
    assert f"kvlab: not ok: Slurm job {killed} (" in err
    assert out.count("kvlab report:") == 1
    runs = records(sweep)
    assert [r["status"] for r in runs.values()] == ["ok"]  # the other run, measured; the lost one has no record
    again = run_py(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(r["status"] for r in records(sweep).values()) == ["ok", "ok"]


def test_what_this_cluster_cannot_take_is_refused_in_one_line_before_anything_is_written(tmp_path):
    """harness/experiment/slurm_check.py against the real cluster: a launcher that asks for a GPU on its CPU node, a partition it
    lacks, and a slurm.conf whose controller port nothing listens on (the real `scontrol ping` says DOWN). Each is
    one line, exit 2, and the sweep folder is never made (it used to be ~40 lines of traceback from submitit, with a
    manifest, multirun.yaml and .submitit/ left behind)."""
    dead = tmp_path / "dead-slurm.conf"
    conf = Path(os.environ["SLURM_CONF"]).read_text()
    dead.write_text(re.sub(r"(?m)^SlurmctldPort=.*$", "SlurmctldPort=1", conf))
    for args, env, says in [
        (["hydra/launcher=slurm"], {}, "it asks for 1 GPU per job (hydra.launcher.gpus_per_node=1) and no node of "
                                       "partition 'debug' has one (Gres=gpu); nothing was written: use "
                                       "hydra/launcher=slurm_cpu"),
        ([*LAUNCH, "hydra.launcher.partition=nosuch"], {}, "the cluster has no partition 'nosuch' "
                                                           "(hydra.launcher.partition); nothing was written: give "
                                                           "hydra.launcher.partition= one of debug"),
        (LAUNCH, {"SLURM_CONF": str(dead)}, "the Slurm controller does not answer (`scontrol ping`: "),
    ]:
        sweep = tmp_path / "sweep"
        p = run_py(["-m", *args, "cache=concat,prealloc", *TINY, "tracking=disabled", f"hydra.sweep.dir={sweep}"],
                   tmp_path, env)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
        assert lines[0].startswith("kvlab: hydra/launcher=") and says in lines[0], lines[0]
        assert not sweep.exists()

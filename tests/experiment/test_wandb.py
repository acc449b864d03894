"""W&B as researchers use it, read back with wandb's own reader (``wandb leet inspect --json``) from what an offline
run wrote: step-time curves against ``context_len``, the values the run really used (``config.effective``), tags and
notes, every results.json key accounted for in the summary, the run's files as an artifact, nothing written outside
the run's folder, and a run killed with SIGKILL left crashed and resumable under the same id."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY
from tests.helpers.wandb_runs import of_type, wandb_records

pytestmark = pytest.mark.slow

def clean_env(home: Path) -> dict:
    """A HOME of its own and none of W&B's folder variables: whatever W&B writes by default would land in HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env = {k: v for k, v in env.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), HF_HUB_OFFLINE="1", WANDB_SILENT="true", MPLCONFIGDIR=str(home.parent / "mpl"))
    return env


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wandb")
    home, out = tmp / "home", tmp / "run"
    home.mkdir()
    args = [*TINY, "dtype=fp16", "tracking=offline", f"hydra.run.dir={out}"]
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=REPO, env=clean_env(home), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, home, args, json.loads((out / "results.json").read_text()), wandb_records(out)


def test_step_times_are_curves_against_context_len(offline_run):
    out, _, _, record, recs = offline_run
    got = {int(h["item"]["context_len"]): h["item"] for h in of_type(recs, "history") if "context_len" in h["item"]}
    assert sorted(got) == [8, 32]
    for ctx, h in got.items():
        for key in ("step_ms/cached", "step_ms/uncached", "step_ms/cached_p10", "step_ms/cached_p90",
                    "step_ms/speedup"):
            assert key in h, (ctx, sorted(h))
    metrics = {m.get("glob_name") or m.get("name"): m for m in of_type(recs, "metric")}
    assert metrics["step_ms/*"]["step_metric"] == "context_len"
    assert metrics["step/*"]["step_metric"] == "decode_step"


def test_config_holds_the_values_the_run_used(offline_run):
    _, _, _, record, recs = offline_run
    updates = {}
    for c in of_type(recs, "config") + [r["config"] for r in of_type(recs, "run")]:
        updates.update(c.get("update", {}))
    eff = updates["effective"]
    assert eff["max_len"] == record["max_len"] == 128 and eff["context_lengths"] == [8, 32]
    assert eff["full_prompts"] == record["full_prompts"] and eff["storage_dtype"] == "float16"
    assert eff["compute_dtype"] == "float32" and eff["n_params"] == record["n_params"]
    assert eff["weights"] == "random" and eff["torch_version"] == record["torch_version"]


def test_tags_notes_group_and_id(offline_run):
    out, _, args, record, recs = offline_run
    (run,) = of_type(recs, "run")
    assert set(run["tags"]) == {"quick", "tiny", "engine-kvlab", "prealloc", "fp16", "cpu", "random-weights"}
    assert run["notes"] == " ".join(a for a in args if not a.startswith("hydra."))  # the job's overrides
    assert run["run_group"] == record["group"] == f"quick-{out.name}"
    assert run["run_id"] == record["wandb_id"] and record["wandb"].startswith(str(out / "wandb"))


def test_every_results_key_is_in_the_summary_or_listed_as_null(offline_run):
    _, _, _, record, recs = offline_run
    summary = {}
    for s in of_type(recs, "summary"):
        summary.update(s.get("update", {}))
    nulls = set(summary["null_keys"])
    assert nulls == {k for k, v in record.items() if v is None}
    missing = [k for k in record if k not in summary and k not in nulls]
    assert not missing and summary["wandb_id"] == record["wandb_id"] and summary["status"] == "ok"


def test_the_run_files_go_up_as_an_artifact_and_nothing_is_written_outside(offline_run):
    out, home, _, _, recs = offline_run
    arts = [a for a in of_type(recs, "artifact") if a.get("type") == "kvlab-run"]
    assert len(arts) == 1
    names = {c["path"] for c in arts[0]["manifest"]["contents"]}
    assert {"results.json", "steps.csv", "drift.csv", "memory.csv", "layers.csv", "run.log"} <= names
    assert any(n.startswith(".hydra/") for n in names)
    for c in arts[0]["manifest"]["contents"]:  # staged inside the run folder: a copied outputs/ syncs anywhere
        assert c["local_path"].startswith(str(out)), c["local_path"]
    assert list(home.rglob("*")) == []  # HOME stays empty: W&B's data, cache and staging are in the run folder
    assert of_type(recs, "exit")[0]["exit_code"] == 0
    code = [a for a in of_type(recs, "artifact") if a.get("type") == "kvlab-code"]
    assert len(code) == 1
    files = {c["path"] for c in code[0]["manifest"]["contents"]}
    assert {"run.py", "harness/experiment/runner.py", "models/gpt2.py", "conf/config.yaml"} <= files
    assert not any(f.startswith((".venv", "outputs", "tests")) for f in files)


def test_a_killed_run_is_left_crashed_and_resumes_under_its_id(tmp_path):
    home, out = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    args = ["model=tiny", "n_prompts=6", "full_prompts=6", "new_tokens=60", "prompt_len=8", "repeats=3", "warmup=1",
            "context_lengths=[8,32]", "dtype=fp16", "tracking=offline", f"hydra.run.dir={out}"]
    proc = subprocess.Popen([sys.executable, "run.py", *args], cwd=REPO, env=clean_env(home),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    def flushed():  # the run record is on disk (more than the file's header)
        return any(f.stat().st_size > 100 for f in (out / "wandb").glob("offline-run-*/run-*.wandb"))

    while time.time() < deadline and not flushed():
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (out / "results.json").exists()
    recs = wandb_records(out)
    (run,) = of_type(recs, "run")
    assert of_type(recs, "exit") == []  # no exit record: W&B shows it crashed once synced
    again = subprocess.run([sys.executable, "run.py", *args], cwd=REPO, env=clean_env(home), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "ok" and record["wandb_id"] == run["run_id"]  # the same W&B run, resumed

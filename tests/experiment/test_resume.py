"""Sweeps that survive crashes and scale out: a sweep killed with SIGKILL mid-run resumes into its folder (nothing
lost, nothing doubled, nothing complete redone), two sweeps into one folder stay apart, the exit code comes from the
runs' files, Hydra's submitit launcher runs the same sweep, and config values cannot steer files out of place."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.experiment.config import slug
from tests.helpers import NO_REPORT, QUICK, REPO, TINY, run_py

pytestmark = pytest.mark.slow

LONGER = ["model=tiny", "n_prompts=6", "full_prompts=6", "new_tokens=60", "prompt_len=8", "repeats=3", "warmup=1",
          "context_lengths=[8,32]"]  # a few seconds a run: long enough to be killed in the middle of one


def records(sweep: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(sweep.glob("*/results.json"))}


def test_a_killed_sweep_resumes_into_its_folder(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "cache=concat,prealloc,window", *LONGER, "tracking=offline", f"hydra.sweep.dir={sweep}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", **{v: str(tmp_path / v.lower()) for v in
                                                   ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                                                    "WANDB_CONFIG_DIR")})
    proc = subprocess.Popen([sys.executable, "run.py", *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:  # until the first run is complete and the second has started
        if len(records(sweep)) == 1 and len(list(sweep.glob("*/.hydra"))) == 2:
            break
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    first = records(sweep)
    assert len(first) == 1 and len(list(sweep.glob("*/.hydra"))) == 2  # killed mid-run, one run complete
    (done, record), = first.items()

    again = run_py(args, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    after = records(sweep)
    assert len(after) == 3 and all(r["status"] == "ok" for r in after.values())
    assert after[done]["finished_at"] == record["finished_at"]  # not measured again...
    assert after[done]["invocation"] != record["invocation"]  # ...but confirmed by this invocation
    assert f"run {done} is complete" in again.stdout
    assert {r["invocation"] for r in after.values()} == {after[done]["invocation"]}
    for name in after:  # one W&B run per config: the killed one was cleared before it was measured again
        assert len(list((sweep / name / "wandb").glob("offline-run-*"))) == 1
    table = pd.read_csv(sweep / "report" / "results.csv")
    assert len(table) == 3 and table.config_id.is_unique


def test_resume_false_measures_again_and_failed_runs_are_redone(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "max_len=64,1000", *QUICK, "tracking=disabled", NO_REPORT,  # it reads the records alone
            f"hydra.sweep.dir={sweep}"]
    first = run_py(args, tmp_path)
    assert first.returncode == 1  # max_len 1000 > 128
    before = records(sweep)
    again = run_py(args, tmp_path)
    assert again.returncode == 1 and "is complete" in again.stdout
    after = records(sweep)
    for name, r in after.items():
        if r["status"] == "ok":
            assert r["finished_at"] == before[name]["finished_at"]
        else:  # a failed run is always measured again
            assert r["started_at"] >= before[name]["started_at"] and r["invocation"] != before[name]["invocation"]
    redo = run_py([*args, "resume=false"], tmp_path)
    assert "is complete" not in redo.stdout
    assert all(r["invocation"] != after[n]["invocation"] for n, r in records(sweep).items())


def test_two_sweeps_into_one_folder_stay_apart(tmp_path):
    sweep = tmp_path / "sweep"
    a = run_py(["-m", "cache=concat,prealloc", *QUICK, "tracking=disabled", f"hydra.sweep.dir={sweep}"], tmp_path)
    b = run_py(["-m", "cache=quant", "dtype=fp16", *QUICK, "tracking=disabled", f"hydra.sweep.dir={sweep}"],
               tmp_path)
    assert a.returncode == b.returncode == 0
    runs = records(sweep)
    assert len(runs) == 3 and len({r["config_id"] for r in runs.values()}) == 3
    assert "kvlab report: 1 runs" in b.stdout  # the second sweep's report counts its own run...
    assert "skipped" not in b.stderr  # ...and does not take the first sweep's runs for interrupted ones
    assert len(pd.read_csv(sweep / "report" / "results.csv")) == 1


def test_the_exit_code_comes_from_the_files(tmp_path):
    ok = run_py([*QUICK, "tracking=disabled", f"hydra.run.dir={tmp_path / 'ok'}"], tmp_path)
    assert ok.returncode == 0
    bad = run_py([*TINY, "max_len=1000", "tracking=disabled", f"hydra.run.dir={tmp_path / 'bad'}"], tmp_path)
    assert bad.returncode == 1 and "kvlab: not ok:" in bad.stderr and "max_len=1000" in bad.stderr


def test_submitit_local_launcher_runs_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_py(["-m", "hydra/launcher=submitit_local", "max_len=64,1000", *QUICK, "tracking=disabled",
                   f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]  # one of the two runs is impossible: the exit code says so
    runs = records(sweep)
    assert sorted(r["status"] for r in runs.values()) == ["failed", "ok"]
    assert proc.stdout.count("kvlab report:") == 1  # one report, after both jobs
    assert len(pd.read_csv(sweep / "report" / "results.csv")) == 2


def test_config_values_cannot_steer_files_out_of_place(tmp_path):
    assert slug("../../x") == "x" and slug("org/ckpt") == "org-ckpt" and "/" not in slug("a/../../b")
    sweep = tmp_path / "deep" / "sweep"
    proc = run_py(["-m", "model.name=../../escaped", *QUICK, "tracking=disabled", f"hydra.sweep.dir={sweep}"],
                  tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = records(sweep).values()
    assert Path(record["run_dir"]).resolve().parent == sweep.resolve()  # inside the sweep folder
    assert record["model"] == "../../escaped"  # the label is kept as given
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.glob("*escaped*"))


def test_an_api_key_never_reaches_a_file_or_the_console(tmp_path):
    secret = "kvlab0secret0key0" + "7" * 23  # a 40-character W&B-style key
    out = tmp_path / "run"
    proc = run_py([*QUICK, "tracking=offline", f"hydra.run.dir={out}"], tmp_path, {"WANDB_API_KEY": secret})
    assert proc.returncode == 0
    assert secret not in proc.stdout + proc.stderr
    for f in out.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f


def test_nested_job_folders_count_for_the_exit_code(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_py(["-m", "max_len=64,1000", *QUICK, "tracking=disabled", f"hydra.sweep.dir={sweep}",
                   "hydra.sweep.subdir=${cache.kind}/${kvlab_id:}"], tmp_path)
    assert proc.returncode == 1 and "max_len=1000" in proc.stderr
    assert len(list(sweep.glob("*/*/results.json"))) == 2


def test_printing_the_config_is_not_a_failure(tmp_path):
    proc = run_py([*TINY, "--cfg", "job"], tmp_path)
    assert proc.returncode == 0 and "kind: prealloc" in proc.stdout


def test_one_config_in_two_folders_is_two_runs_and_two_wandb_runs(tmp_path):
    from harness.experiment.runner import wandb_id
    from harness.analysis.results import scan

    record = {"status": "ok", "run_name": "r", "model": "tiny", "cache": "prealloc", "dtype": "fp32",
              "device": "cpu", "config_id": "abc", "group": "paper"}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(record))
    assert len(scan(tmp_path)["runs"]) == 2  # same config, same tracking.group, two measurements: both kept
    assert wandb_id(tmp_path / "a", "abc") != wandb_id(tmp_path / "b", "abc")
    assert wandb_id(tmp_path / "a", "abc") == wandb_id(tmp_path / "a", "abc")


def test_a_finished_run_on_other_weights_is_measured_again(tmp_path):
    """The identity hashes model.weights as asked (auto); a finished run whose weights came from elsewhere than they
    would now (an offline fallback, then the hub answers) is measured again, not mixed into the sweep."""
    out = tmp_path / "run"
    args = [*QUICK, "prompts=random", "tracking=disabled", f"hydra.run.dir={out}"]
    assert run_py(args, tmp_path).returncode == 0
    record = json.loads((out / "results.json").read_text())
    record["weights_source"] = "openai-community/gpt2"  # as if measured on the real checkpoint
    (out / "results.json").write_text(json.dumps(record))
    again = run_py(args, tmp_path)
    assert again.returncode == 0 and "is measured again: it was measured on openai-community/gpt2" in again.stderr
    assert json.loads((out / "results.json").read_text())["weights_source"] == "random"

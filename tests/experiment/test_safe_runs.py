"""Safe runs: kvlab never touches files it did not write, a refused config changes nothing on disk, an exact kind
that is not equivalent is a failure, signals leave a record, one kvlab process at a time per run folder, and a
changed input is measured again. Each case has an id; docs/faults.md's fault table lists them (``CASES``)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.experiment import folder
from harness.experiment import describe
from harness.experiment import runner as experiment
from harness.common import ownership
from tests.helpers import QUICK, REPO, TINY, run_py

CASES = [
    ("run-dir-foreign-files", "a run folder holding files kvlab did not write is refused in one line; every file "
                              "in it survives byte for byte, nothing is added"),
    ("run-dir-repo-root", "hydra.run.dir=. in a clone is refused: the project's files (and a ./wandb) are untouched"),
    ("refused-config-over-a-finished-run", "a refused config sent to a finished run's folder changes nothing there, "
                                           ".hydra/ included; one line, exit 1"),
    ("refused-config-no-wandb", "a refused config opens no W&B run"),
    ("legacy-run-folder", "a run folder an earlier kvlab wrote (no manifest) is adopted and resumed"),
    ("exact-kind-small-error", "an exact kind in fp32 whose max |dlogit| exceeds equivalence_tol (default 1e-4) "
                               "ends status not_equivalent, exit 1, its numbers kept"),
    ("exact-kind-tokens-differ", "an exact kind in fp32 whose tokens differ ends status not_equivalent, exit 1"),
    ("equivalence-tol-bad", "equivalence_tol <= 0 is refused in one line"),
    ("failed-late-keeps-measured", "a run that fails late keeps what it measured, status failed, the stage named"),
    ("signal-sigterm", "SIGTERM mid-run: status interrupted naming SIGTERM, one line, exit 143; the same command "
                       "resumes"),
    ("signal-sigusr2", "SIGUSR2 mid-run: status interrupted naming SIGUSR2, exit 140"),
    ("signal-sighup", "SIGHUP mid-run: status interrupted naming SIGHUP, exit 129"),
    ("lock-second-process-waits", "a second kvlab process on a busy run folder says so in one line and waits; "
                                  "then finds the run complete and skips it"),
    ("lock-dead-holder", "a lock left by a process that is gone is taken over"),
    ("resume-prompts-changed", "editing the prompts file measures the run again and says why"),
    ("resume-checkpoint-changed", "a changed checkpoint measures the run again and says why"),
    ("resume-code-changed", "a change to kvlab's code measures the run again and says why"),
    ("run-dir-unwritable-record", "a failed attempt's results.json that cannot be replaced (read-only, immutable): "
                                  "one line, exit 1, no traceback"),
    ("sweep-dir-foreign-multirun-yaml", "a sweep folder holding a multirun.yaml kvlab did not write is refused "
                                        "(Hydra would overwrite it): one line, exit 2, nothing run"),
    ("memory-batch-too-big", "batch=200000 on gpt2 is refused before anything is built, naming the sizes and the "
                             "largest batch that fits"),
    ("memory-checkpoint-too-big", "a checkpoint whose config.json asks for 64 layers x 4096 beside a small weights "
                                  "file is refused in one line before the model is built"),
    ("bad-input-over-a-finished-run", "a prompts file made unreadable, or a NaN put in the checkpoint, after a run "
                                      "finished: the run is refused in one line and its files stay as they were"),
    ("run-dir-report-folder", "hydra.run.dir at a sweep's report/ folder is refused: the report stays whole"),
    ("run-dir-other-config", "a finished run of another config in the folder (a hydra.sweep.subdir that collides) "
                             "is never replaced: one line, exit 1"),
    ("run-dir-table-deleted", "a finished run missing one of its files is measured again, not skipped"),
    ("signal-while-writing", "a signal while a finished run writes its files and closes W&B: the files are written "
                             "whole first, then one line, exit 128 + n"),
    ("lock-pid-reused", "a lock whose pid now belongs to another process is taken over"),
    ("run-dir-files-in-kvlab-subfolders", "a file of the user's put inside a run's .hydra/ or wandb/ keeps kvlab "
                                          "from clearing that folder: one line, the file kept"),
    ("exit-code-own-runs-only", "the exit code counts this invocation's runs alone, never another's in progress"),
]

FAST = [*TINY, "tracking=disabled"]
# FAST measuring equivalence alone: for the tests that read no other measurement's keys or tables
QUICK_FAST = [*QUICK, "tracking=disabled"]
# FAST measuring equivalence and step times alone: for the tests that read steps.csv (and no other table)
STEPS = [*FAST, "measurements=[equivalence,step_time]"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_patched(patch: str, args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python run.py ARGS`` with ``patch`` (Python code) run first in the same process."""
    code = textwrap.dedent(patch) + textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["run.py", *{args!r}]
        runpy.run_path("run.py", run_name="__main__")
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        env[var] = str(tmp_path / var.lower())
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ---- ownership --------------------------------------------------------------------------------------------------

def test_ownership_lists_claims_and_removes_only_what_kvlab_wrote(tmp_path):
    (tmp_path / "mine.txt").write_text("the user's")
    ownership.claim(tmp_path, "results.json", "wandb")
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "x").write_text("run")
    (tmp_path / ".results.json.abc.tmp").write_text("half")
    assert ownership.foreign(tmp_path) == ["mine.txt"]
    with pytest.raises(ownership.NotOurs, match="holds files kvlab did not write \\(mine.txt\\)"):
        ownership.refuse_foreign(tmp_path, "run folder", "use another")
    ownership.remove(tmp_path, ["results.json", "wandb", "mine.txt"])
    assert sorted(os.listdir(tmp_path)) == [ownership.MANIFEST, "mine.txt"]
    assert (tmp_path / "mine.txt").read_text() == "the user's"


@pytest.mark.slow
def test_a_folder_with_the_users_files_is_refused_and_left_byte_for_byte(tmp_path):
    out = tmp_path / "mine"
    (out / "wandb").mkdir(parents=True)
    (out / "wandb" / "their-run.wandb").write_bytes(os.urandom(64))
    (out / "results.json").write_text('{"score": 3}')
    (out / "notes.txt").write_text("keep me")
    before = snapshot(out)
    proc = run_py([*TINY, "tracking=offline", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "holds files kvlab did not write" in proc.stderr and "notes.txt" in proc.stderr
    assert snapshot(out) == before and sorted(os.listdir(out)) == ["notes.txt", "results.json", "wandb"]


@pytest.mark.slow
def test_the_repository_itself_is_never_a_run_folder(tmp_path):
    before = sorted(os.listdir(REPO))
    proc = run_py([*FAST, "hydra.run.dir=."], tmp_path)
    assert proc.returncode == 1 and "holds files kvlab did not write" in proc.stderr
    assert sorted(os.listdir(REPO)) == before  # no .hydra, results.json, manifest or lock left in the clone


@pytest.mark.slow
def test_a_refused_config_changes_nothing_in_a_finished_runs_folder(tmp_path):
    out = tmp_path / "run"
    assert run_py([*QUICK, "tracking=offline", f"hydra.run.dir={out}"], tmp_path).returncode == 0
    before = snapshot(out)
    for bad in (["new_tokens=0"], ["repeats=0"], ["equivalence_tol=0"]):
        proc = run_py([*QUICK, *bad, "tracking=offline", f"hydra.run.dir={out}"], tmp_path)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert "left as it was" in proc.stderr
        assert snapshot(out) == before  # results, tables, W&B files and .hydra/ all as they were
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1  # no W&B run opened for the refusals


@pytest.mark.slow
def test_a_run_folder_of_an_earlier_kvlab_is_adopted_and_resumed(tmp_path):
    out = tmp_path / "run"
    assert run_py([*QUICK_FAST, f"hydra.run.dir={out}"], tmp_path).returncode == 0
    (out / ownership.MANIFEST).unlink()  # as an earlier kvlab left it
    again = run_py([*QUICK_FAST, f"hydra.run.dir={out}"], tmp_path)
    assert again.returncode == 0 and "is complete" in again.stdout
    assert "results.json" in ownership.owned(out)


@pytest.mark.slow
def test_a_record_that_cannot_be_replaced_is_one_line(tmp_path):
    out = tmp_path / "run"
    args = [*FAST, "max_len=1000", f"hydra.run.dir={out}"]  # refused: a failed record
    assert run_py(args, tmp_path).returncode == 1
    before = snapshot(out)
    patch = """
import harness.common.ownership as o
def remove(folder, names):
    raise PermissionError(1, "Operation not permitted")
o.remove = remove
"""
    proc = run_patched(patch, args, tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"cannot write in {out}: Operation not permitted" in proc.stderr
    assert proc.stderr.count("kvlab: not ok:") == 1 and snapshot(out) == before


@pytest.mark.slow
def test_a_sweep_never_overwrites_a_multirun_yaml_it_did_not_write(tmp_path):
    sweep = tmp_path / "mine"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("my: own\n")
    proc = run_py(["-m", "cache=concat,prealloc", *FAST, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 2 and "holds a multirun.yaml kvlab did not write" in proc.stderr
    assert os.listdir(sweep) == ["multirun.yaml"] and (sweep / "multirun.yaml").read_text() == "my: own\n"


@pytest.mark.slow
def test_a_run_too_big_for_the_machine_is_refused_before_anything_is_built(tmp_path):
    from tests.helpers.checkpoints import edit_config, hf_checkpoint

    out = tmp_path / "big-batch"
    proc = run_py([*FAST, "model=gpt2", "model.weights=random", "batch=200000", f"hydra.run.dir={out}"], tmp_path)
    record = json.loads((out / "results.json").read_text())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "the run needs about" in record["error"] and "would fit" in record["error"]
    assert record["failed_stage"] == "check the config" and record.get("n_params") is None  # nothing was built

    ckpt = hf_checkpoint(tmp_path / "ckpt")
    edit_config(ckpt, lambda c: {**c, "n_layer": 64, "n_embd": 4096, "n_head": 32})
    out = tmp_path / "big-ckpt"
    proc = run_py([*FAST, f"model.weights={ckpt}", "prompts=random", f"hydra.run.dir={out}"], tmp_path)
    record = json.loads((out / "results.json").read_text())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "\n" not in record["error"]
    assert "the run needs about" in record["error"] or "model.safetensors" in record["error"]
    assert record["failed_stage"] == "check the config"


@pytest.mark.slow
def test_bad_input_after_a_finished_run_leaves_it_as_it_was(tmp_path):
    from tests.helpers.checkpoints import edit_weights, hf_checkpoint, nan_weight

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The tide came in over the flats.\n")
    out = tmp_path / "run"
    args = [*QUICK_FAST, f"prompts_file={prompts}", f"hydra.run.dir={out}"]
    assert run_py(args, tmp_path).returncode == 0
    before = snapshot(out)
    prompts.write_bytes(b"\x00\xff\xfe" * 100)  # binary now
    proc = run_py(args, tmp_path)
    assert proc.returncode == 1 and "is not UTF-8 text" in proc.stderr and "left as it was" in proc.stderr
    assert snapshot(out) == before

    ckpt = hf_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run-ckpt"
    args = [*QUICK_FAST, f"model.weights={ckpt}", "prompts=random", f"hydra.run.dir={out}"]
    assert run_py(args, tmp_path).returncode == 0
    before = snapshot(out)
    edit_weights(ckpt, nan_weight)
    proc = run_py(args, tmp_path)
    assert proc.returncode == 1 and "non-finite" in proc.stderr and snapshot(out) == before


@pytest.mark.slow
def test_a_report_folder_or_another_configs_run_is_never_replaced(tmp_path):
    sweep = tmp_path / "sweep"
    assert run_py(["-m", "cache=concat,prealloc", *STEPS, f"hydra.sweep.dir={sweep}"], tmp_path).returncode == 0
    report = snapshot(sweep / "report")
    proc = run_py([*STEPS, f"hydra.run.dir={sweep / 'report'}"], tmp_path)
    assert proc.returncode == 1 and "is a sweep report folder" in proc.stderr
    assert snapshot(sweep / "report") == report
    (concat,) = [p for p in sweep.iterdir() if "concat" in p.name]
    before = snapshot(concat)
    proc = run_py([*STEPS, "cache=prealloc", f"hydra.run.dir={concat}"], tmp_path)
    assert proc.returncode == 1 and "holds a finished run of another config" in proc.stderr
    assert snapshot(concat) == before
    (concat / "steps.csv").unlink()  # a finished run missing a file: measured again
    again = run_py([*STEPS, "cache=concat", f"hydra.run.dir={concat}"], tmp_path)
    assert again.returncode == 0 and "is complete" not in again.stdout and (concat / "steps.csv").exists()


@pytest.mark.slow
def test_a_signal_while_the_results_are_written_waits_for_them(tmp_path):
    out = tmp_path / "run"
    patch = """
import os, signal, harness.experiment.tracking as t
_write = t.write_run_files
def write(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)  # lands while the files are written
    return _write(*a, **k)
t.write_run_files = write
"""
    proc = run_patched(patch, [*STEPS, f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr
    assert "SIGTERM arrived as run run wrote its results: they are complete" in proc.stderr
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "ok" and (out / "steps.csv").exists()


def test_a_lock_whose_pid_is_another_process_now_is_taken_over(tmp_path):
    (tmp_path / ownership.LOCK).write_text(json.dumps({"pid": 1, "host": __import__("socket").gethostname(),
                                                       "started": "0", "since": "long ago"}))
    with ownership.locked(tmp_path, "run folder", wait_s=1.0):  # pid 1 lives, but it is not the lock's process
        assert json.loads((tmp_path / ownership.LOCK).read_text())["pid"] == os.getpid()


@pytest.mark.slow
def test_a_users_file_inside_a_runs_own_subfolders_is_kept(tmp_path):
    out = tmp_path / "run"
    args = [*QUICK, "tracking=offline", f"hydra.run.dir={out}"]
    assert run_py(args, tmp_path).returncode == 0
    for sub in (".hydra", "wandb"):
        (out / sub / "mynotes.txt").write_text("mine")
        proc = run_py([*args, "resume=false"], tmp_path)
        assert proc.returncode == 1 and f"its {sub}/ holds files kvlab did not write (mynotes.txt)" in proc.stderr
        assert (out / sub / "mynotes.txt").read_text() == "mine"
        (out / sub / "mynotes.txt").unlink()


# ---- equivalence is a verdict -------------------------------------------------------------------------------------

BROKEN_K = """
import models.kv_cache.prealloc as p
_update = p.PreallocKVCache.update
def update(self, layer, k, v):
    K, V = _update(self, layer, k, v)
    K = K.clone()
    K[0, 0, 0, :{width}] += {delta}  # the first key of head 0, in {width} of its dimensions
    return K, V
p.PreallocKVCache.update = update
"""


@pytest.mark.slow
@pytest.mark.parametrize("delta,width", [(0.05, 1), (100.0, 32)], ids=["small-error", "tokens-differ"])
def test_an_exact_kind_that_is_not_equivalent_is_a_failure(tmp_path, delta, width):
    out = tmp_path / "run"
    proc = run_patched(BROKEN_K.format(delta=delta, width=width), [*STEPS, "model=mini", f"hydra.run.dir={out}"],
                       tmp_path)  # a trained model: its tokens follow its attention
    record = json.loads((out / "results.json").read_text())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert record["status"] == "not_equivalent" and "not equivalent" in record["error"]
    assert record["max_abs_logit_diff"] > 1e-4 and (out / "steps.csv").exists()  # the numbers are kept
    assert "NOT EQUIVALENT" in proc.stderr and "kvlab: not ok:" in proc.stderr
    if width > 1:
        assert record["tokens_identical"] is False and "tokens differ" in record["error"]


def test_the_verdict_is_for_exact_kinds_in_fp32_only():
    cfg = {"equivalence_tol": 1e-4}
    base = dict(cache_exact=True, storage_dtype="float32", compute_dtype="float32", tokens_identical=True,
                max_abs_logit_diff=2e-5, cache_label="prealloc")
    assert describe.verdict(cfg, base) == ("ok", None)
    assert describe.verdict(cfg, dict(base, max_abs_logit_diff=3e-3))[0] == "not_equivalent"
    assert describe.verdict(cfg, dict(base, tokens_identical=False, first_diff_step=4))[0] == "not_equivalent"
    assert describe.verdict(cfg, dict(base, serve_tokens_identical=False))[0] == "not_equivalent"
    assert describe.verdict({"equivalence_tol": 1e-2}, dict(base, max_abs_logit_diff=3e-3))[0] == "ok"
    # reduced precision and lossy kinds are findings, not verdicts
    assert describe.verdict(cfg, dict(base, storage_dtype="float16", tokens_identical=False))[0] == "ok"
    assert describe.verdict(cfg, dict(base, cache_exact=False, max_abs_logit_diff=0.5))[0] == "ok"


@pytest.mark.slow
def test_a_run_that_fails_late_keeps_what_it_measured(tmp_path):
    out = tmp_path / "run"
    patch = """
import harness.core.measure as m
def boom(*a, **k):
    raise RuntimeError("the served batch broke")
m.serve_batch = boom
"""
    # the measurements it reads; the served batch, which fails, is measured after the other two
    args = [*FAST, "measurements=[equivalence,memory,serving]", f"hydra.run.dir={out}"]
    proc = run_patched(patch, args, tmp_path)
    record = json.loads((out / "results.json").read_text())
    assert proc.returncode == 1 and record["status"] == "failed" and "served batch broke" in record["error"]
    assert record["failed_stage"] == "served batch" and "failed in served batch" in proc.stderr
    assert record["tokens_identical"] is True and record["cache_nbytes"] > 0  # measured before it failed


# ---- signals ----------------------------------------------------------------------------------------------------

LONG = ["model=tiny", "n_prompts=8", "full_prompts=8", "new_tokens=60", "prompt_len=8", "repeats=30",
        "context_lengths=[8,32,64]", "tracking=disabled"]  # some seconds of work: a signal lands in the middle


def start(args, tmp_path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_DIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "run.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and not path.exists() and proc.poll() is None:
        time.sleep(0.2)
    assert path.exists(), proc.communicate()[1][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_mid_run_leaves_a_record_naming_it(tmp_path, sig):
    out = tmp_path / "run"
    proc = start([*LONG, f"hydra.run.dir={out}"], tmp_path)
    wait_for(out / ".hydra" / "config.yaml", proc)
    time.sleep(1.5)  # well into the measurements
    assert not (out / "results.json").exists() and proc.poll() is None
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr[-1500:]
    assert "Traceback" not in stderr and f"interrupted ({sig.name})" in stderr
    assert len([line for line in stderr.splitlines() if "interrupted" in line]) == 1
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "interrupted" and record["signal"] == sig.name and "resume" in record["error"]
    assert not list(out.glob(".*.tmp")) and not (out / "steps.csv").exists()
    if sig == signal.SIGTERM:  # the same command resumes (shorter here: a new config is measured from scratch)
        again = run_py([*LONG, f"hydra.run.dir={out}"], tmp_path)
        assert again.returncode == 0 and json.loads((out / "results.json").read_text())["status"] == "ok"


# ---- locks ------------------------------------------------------------------------------------------------------

HOLD = """
import sys, time
from harness.common import ownership
with ownership.locked(sys.argv[1], "run folder"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_busy_folder_is_waited_for_and_a_dead_holder_is_taken_over(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError, match=f"in use by kvlab process {holder.pid}"):
            with ownership.locked(tmp_path, "run folder", wait_s=1.0):
                pass
        assert capsys.readouterr().err.count(f"in use by kvlab process {holder.pid}") == 1  # said once
    finally:
        holder.kill()  # SIGKILL: its lock stays behind
        holder.wait()
    assert (tmp_path / ownership.LOCK).exists()
    with ownership.locked(tmp_path, "run folder", wait_s=1.0):
        assert json.loads((tmp_path / ownership.LOCK).read_text())["pid"] == os.getpid()
    assert not (tmp_path / ownership.LOCK).exists()


@pytest.mark.slow
def test_a_second_process_on_the_same_run_waits_then_skips(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "n_prompts=6", "full_prompts=6", "new_tokens=30", "tracking=offline", f"hydra.run.dir={out}"]
    first = start(args, tmp_path)
    wait_for(out / ownership.LOCK, first)
    second = run_py(args, tmp_path)
    first.communicate(timeout=300)
    assert first.returncode == 0 and second.returncode == 0, second.stderr[-2000:]
    assert "is in use by kvlab process" in second.stderr and "is complete" in second.stdout
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1  # the live W&B run was never deleted


# ---- honest resume ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_changed_prompts_file_or_checkpoint_is_measured_again(tmp_path):
    from tests.helpers.checkpoints import edit_weights, hf_checkpoint

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("In the beginning was the word.\nAnd the word was with the cache.\n")
    out = tmp_path / "run"
    args = [*QUICK_FAST, f"prompts_file={prompts}", f"hydra.run.dir={out}"]
    assert run_py(args, tmp_path).returncode == 0
    assert "is complete" in run_py(args, tmp_path).stdout
    prompts.write_text("Another text entirely, for another measurement.\n")
    again = run_py(args, tmp_path)
    assert again.returncode == 0 and "measured again: the prompts file changed" in again.stderr

    ckpt = hf_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run-ckpt"
    args = [*QUICK_FAST, f"model.weights={ckpt}", "prompts=random", f"hydra.run.dir={out}"]
    assert run_py(args, tmp_path).returncode == 0

    def scaled(state):
        state["transformer.h.0.mlp.c_fc.weight"] *= 1.5
        return state
    edit_weights(ckpt, scaled)
    again = run_py(args, tmp_path)
    assert again.returncode == 0 and "measured again: the checkpoint changed" in again.stderr


def test_the_code_is_part_of_a_runs_inputs(tmp_path, monkeypatch):
    src = tmp_path / "model.py"
    src.write_text("x = 1\n")
    monkeypatch.setattr(experiment.tracking, "sources", lambda: [src])
    before = folder.input_ids(None, 0, None)  # prompts=random, random init of seed 0
    src.write_text("x = 2\n")
    after = folder.input_ids(None, 0, None)
    assert before["inputs_code"] != after["inputs_code"] and before["inputs_prompts"] == after["inputs_prompts"]
    assert folder.changed_inputs(before, after) == [
        f"kvlab's code changed ({before['inputs_code']} -> {after['inputs_code']})"]
    assert folder.changed_inputs(after, after) == []


def test_a_large_checkpoint_is_identified_by_samples(tmp_path, monkeypatch):
    monkeypatch.setattr(folder, "WHOLE_FILE", 1024)
    f = tmp_path / "w.bin"
    f.write_bytes(bytes(300_000))
    a = folder.file_id(f)
    data = bytearray(f.read_bytes())
    data[len(data) // 2: len(data) // 2 + 8] = b"retrain!"  # a change where a sample lies
    f.write_bytes(bytes(data))
    assert folder.file_id(f) != a


# ---- the exit code ----------------------------------------------------------------------------------------------

def test_the_exit_code_counts_only_this_invocations_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_INVOCATION", "other0000001")
    (tmp_path / "theirs").mkdir()
    experiment.note_started(tmp_path / "theirs")  # another invocation's run, still in progress
    monkeypatch.setenv("KVLAB_INVOCATION", "mine00000001")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "results.json").write_text(json.dumps(
        {"status": "ok", "run_name": "d", "model": "tiny", "cache": "prealloc", "dtype": "fp32", "config_id": "x"}))
    experiment.note_started(tmp_path / "done")
    (tmp_path / "killed").mkdir()
    experiment.note_started(tmp_path / "killed")
    experiment.note_started(tmp_path / "refused", refused="n_prompts=0 must be at least 1")
    try:
        bad = experiment.invocation_failures()
        assert len(bad) == 2 and any("killed (no complete results.json)" in b for b in bad)
        assert any("refused: n_prompts=0" in b for b in bad) and not any("theirs" in b for b in bad)
        assert sorted(p.name for p in experiment.invocation_folders()) == ["done", "killed", "refused"]
    finally:
        experiment.forget_invocation("mine00000001")
        experiment.forget_invocation("other0000001")

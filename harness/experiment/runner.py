"""One run, one straight path: read Hydra's config once into plain values (``run``, the door:
``harness.experiment.config.read`` -> a ``RunConfig``) -> validate it and resolve the weights (``plan_run``: pure,
once -> a ``Plan``) -> take the folder -> load the model, engine and prompts (``load``) -> run the measurements
(``measure_run``, from the registry ``harness.measurements``) -> write the record and tables -> log to W&B. Only
``run`` holds the DictConfig; everything after it gets the ``RunConfig``, the ``Plan`` or the part of one it needs
(``harness.experiment.plan``). This module holds the run's sequence alone: its steps live in ``prepare`` (plan, load,
measure: every measurement reached through the registry's hooks), ``folder`` (taking a folder, resume, the inputs'
ids), ``describe`` (the record's words, the verdict, the summary), ``tracking`` (W&B and the run's files) and
``slurm_jobs`` (signals, Slurm).

A run never raises: whatever goes wrong (an impossible config, CUDA asked on a machine without it, out of memory,
non-finite logits) is recorded as ``status: failed`` with its error, so a sweep goes on and keeps the runs around it.

A run's identity is ``config_id``: a hash of the measurement-relevant config (everything but ``tracking`` and
``resume``). A run whose folder already holds a complete, ok results.json of the same identity is skipped
(``resume=true``, the default); anything else in the folder (a failed or interrupted attempt, W&B files included)
is cleared and measured again. Every run stamps the id of the ``run.py`` invocation that made or confirmed it, so
the sweep report and ``run.py``'s exit code read exactly this invocation's runs from their files
(``invocation_failures``).
"""

from __future__ import annotations

import copy
import datetime as dt
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness.experiment.describe import (asked_measurements, config_record, run_tags, summary_text, verdict,
                                         weights_record)
from harness.experiment.folder import (_finished_other, _fresh_or_failed_attempt, _misplaced, changed_inputs, completed,
                                       partial_files, take_folder)
from harness.experiment.prepare import load, measure_run, plan_run
from harness.experiment.slurm_jobs import catch_signals, slurm_record
from harness.common import signals
from harness.common.errors import one_line
from harness.common.signals import interruption
from harness.core import measure
from harness.common import ownership
from harness.experiment import tracking
from harness.experiment.tracking import default_group, wandb_id
from harness.experiment.config import read
from harness.experiment.plan import Plan, RunConfig
from harness.experiment.invocation import (concurrent_runs, forget_invocation, invocation, invocation_failures,
                                invocation_folders, mark_active, new_invocation, note_failure, note_started)

# the invocation's bookkeeping lives in harness.experiment.invocation; these names stay importable from here
__all__ = ["concurrent_runs", "forget_invocation", "invocation", "invocation_failures", "invocation_folders",
           "new_invocation", "note_failure", "note_started", "run", "Plan", "RunConfig"]


# ---- the run ---------------------------------------------------------------------------------------------------

def _hydra_dirs() -> tuple[Path, str, str]:
    """(run folder, the sweep's folder name (the run's, for a single run), run name) from Hydra's runtime; a plain
    call (no Hydra) uses outputs/adhoc/<time>."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        group = Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else run_dir.name
        return run_dir, group, run_dir.name
    name = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return measure.REPO / "outputs" / "adhoc" / name, "adhoc", name


@dataclass(frozen=True)
class HydraJob:
    """What a run keeps of Hydra's side, read at the door: the job's ``.hydra/`` files (file name -> text: its
    config, Hydra's, the overrides), the command line's overrides (the W&B run's notes) and, in a sweep, its folder
    and the subdir pattern that placed this run (None for a single run)."""

    files: dict
    notes: str
    sweep: tuple[str, str] | None = None


def hydra_job(cfg: DictConfig) -> HydraJob:
    """The job's ``.hydra/`` files and overrides, as text (written by kvlab once the config is valid and the folder is
    its own: Hydra's own writing of them is off, conf/config.yaml)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    files, sweep = {"config.yaml": OmegaConf.to_yaml(cfg)}, None
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        files["hydra.yaml"] = OmegaConf.to_yaml(OmegaConf.create({"hydra": OmegaConf.to_container(hc)}))
        files["overrides.yaml"] = OmegaConf.to_yaml(OmegaConf.create(list(hc.overrides.task)))
        if hc.mode == RunMode.MULTIRUN:
            sweep = (str(hc.sweep.dir), str(hc.sweep.subdir))
    return HydraJob(files, hydra_overrides(), sweep)


def run(cfg: DictConfig, progress: bool = True) -> dict:
    """One run from a composed config: the door. Hydra is read here once (the config into a ``RunConfig``, the job's
    .hydra/ files and overrides); below, only plain values travel. The config is checked first, purely; then the
    run folder must be kvlab's (new, empty, or holding only what kvlab wrote) and is locked; then the run is
    measured, its files and W&B run written. Never raises for a failed run; Ctrl-C, SIGTERM, SIGHUP or SIGUSR2
    record it as interrupted and stop the process with exit code 128 + the signal's number."""
    run_dir, folder, name = _hydra_dirs()
    catch_signals()
    try:
        try:
            rc, job = read(cfg), hydra_job(cfg)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a config that cannot even be read (a value that does not resolve): nothing written
            return _refuse(run_dir, name, one_line(e))
        return _run(rc, job, run_dir, folder, name, progress)
    except KeyboardInterrupt as e:  # outside the measurement: nothing of this attempt was written
        what, code = interruption(e)
        print(f"kvlab: run {name} interrupted ({what}) before its measurement started; the same command runs it",
              file=sys.stderr)
        raise SystemExit(code) from None


def _refuse(run_dir: Path, name: str, why: str) -> dict:
    """A run that writes nothing at all: one line, counted as not ok for the exit code."""
    print(f"kvlab: run {name} refused: {why}", file=sys.stderr)
    note_started(run_dir, refused=why)
    return dict(status="failed", error=why, run_name=name, run_dir=str(run_dir))


def _run(rc: RunConfig, job: HydraJob, run_dir: Path, folder: str, name: str, progress: bool) -> dict:
    group = rc.tracking.group or default_group(rc.experiment, folder)
    ident, inv = rc.config_id, invocation()
    note_started(run_dir)
    misplaced = _misplaced(run_dir, job.sweep)
    if misplaced:
        return _refuse(run_dir, name, misplaced)
    try:
        plan, refused = plan_run(rc), None
    except KeyboardInterrupt:
        raise
    except Exception as e:  # recorded below, in a folder that holds nothing of an earlier run
        plan, refused = None, one_line(e)
    try:
        take_folder(run_dir)
    except ownership.NotOurs as e:
        return _refuse(run_dir, name, str(e))
    if refused is not None and not _fresh_or_failed_attempt(run_dir, ident):
        return _refuse(run_dir, name, f"{refused} (the earlier run in {run_dir} is left as it was)")
    try:
        with ownership.locked(run_dir, "run folder", inv):
            return _locked_run(rc, job, plan, refused, run_dir, name, group, ident, inv, progress)
    except OSError as e:  # the folder cannot be written: nothing was measured
        why = f"cannot write in {run_dir}: {e.strerror or e}"
        print(f"kvlab: run {name} failed: {why}", file=sys.stderr)
        note_started(run_dir, refused=why)
        return dict(status="failed", error=why, run_name=name, run_dir=str(run_dir))


def _locked_run(rc: RunConfig, job: HydraJob, plan: Plan | None, refused: str | None, run_dir: Path, name: str,
                group: str, ident: str, inv: str, progress: bool) -> dict:
    """A run in its locked folder: a finished run of the same config and inputs is confirmed; otherwise what it
    reads is loaded, the folder cleared of kvlab's earlier attempt, and it is measured and written."""
    prior = _resumable(rc, plan, run_dir, name, ident)
    if prior is not None:
        return _confirm(run_dir, prior, inv, name)
    other = _finished_other(run_dir, ident)
    if other:
        return _refuse(run_dir, name, other)
    loaded = None
    if refused is None:
        try:  # the checkpoint's tensors and the prompts file are read before anything here is cleared
            loaded = load(plan)
        except KeyboardInterrupt:
            raise
        except Exception as e:
            refused = one_line(e)
            if not _fresh_or_failed_attempt(run_dir, ident):
                return _refuse(run_dir, name, f"{refused} (the earlier run in {run_dir} is left as it was)")
    ownership.remove(run_dir, partial_files())  # what an earlier attempt of kvlab's left here, and nothing else
    _write_hydra(run_dir, job.files)
    record = dict(status="failed", error=refused, failed_stage=None if refused is None else "check the config",
                  run_name=name, group=group, run_dir=str(run_dir), config_id=ident, invocation=inv, invocations=inv,
                  device=rc.device, **weights_record(plan.weights if plan else None, rc.model),
                  started_at=dt.datetime.now().isoformat(timespec="seconds"), **config_record(rc),
                  measurements=asked_measurements(rc.measurements), **(plan.inputs if plan else {}),
                  **slurm_record())
    if record["slurm_job_id"]:  # the job's log says which run it measures (a user's scancel needs the id)
        print(f"kvlab: run {name} in Slurm job {record['slurm_job_id']} ({run_dir})", flush=True)
    t0 = time.perf_counter()
    wb, tables = None, {}
    if refused is not None:
        print(f"kvlab: run {name} failed: {refused}", file=sys.stderr)
    else:
        wb, tables = _measured(plan, job.notes, loaded, record, run_dir, name, group, ident, progress, t0)
    return _finish(run_dir, record, tables, wb, name, t0)


def _resumable(rc: RunConfig, plan: Plan | None, run_dir: Path, name: str, ident: str) -> dict | None:
    """The finished record in ``run_dir`` to keep (resume): same config, same inputs, same weights; None (and,
    where one exists, a line saying why it is measured again) otherwise."""
    if plan is None or not rc.resume:
        return None
    prior = completed(run_dir, ident)
    if prior is None:
        return None
    why = changed_inputs(prior, plan.inputs)
    if prior.get("weights_source") not in (None, plan.weights.source):
        why.insert(0, f"it was measured on {prior['weights_source']} but model.weights={rc.model.weights} "
                      f"now gives {plan.weights.source}")
    if not why:
        return prior
    print(f"kvlab: run {name} is measured again: {'; '.join(why)}", file=sys.stderr)
    return None


def _measured(plan: Plan, notes: str, loaded: dict, record: dict, run_dir: Path, name: str, group: str, ident: str,
              progress: bool, t0: float):
    """Open the W&B run and measure; the verdict into ``record``. A failure is recorded, never raised (the sweep
    goes on); a signal writes an interrupted record and stops the process. -> (W&B run, tables)."""
    active = mark_active()
    wb, tables = None, {}
    try:
        wb = _open_wandb(plan.config, record, group, name, run_dir, ident, notes)
        tables = measure_run(plan, loaded, record, progress)
        record["status"], record["error"] = verdict(plan.config.options, record)
    except KeyboardInterrupt as e:
        what, code = interruption(e)
        signals.ignore_signals()
        record.update(status="interrupted", signal=what, duration_s=round(time.perf_counter() - t0, 2),
                      error=f"interrupted ({what}); run the same command again to resume")
        _write(run_dir, record)
        _close_wandb(wb, record, {}, run_dir, exit_code=code)
        print(f"kvlab: run {name} interrupted ({what}); its record says so ({run_dir}). The same command "
              "resumes.", file=sys.stderr)
        raise SystemExit(code) from None
    except Exception as e:  # recorded, never raised: the sweep goes on
        record["error"] = one_line(e)
        stage = record.get("failed_stage")
        print(f"kvlab: run {name} failed{f' in {stage}' if stage else ''}: {record['error']}", file=sys.stderr)
    finally:
        active.unlink(missing_ok=True)
    return wb, tables


def _finish(run_dir: Path, record: dict, tables: dict, wb, name: str, t0: float) -> dict:
    """The record's end, the run's files and its W&B run, written whole (signals held meanwhile); the summary."""
    if record["status"] == "not_equivalent":
        print(f"kvlab: run {name} NOT EQUIVALENT: {record['error']}", file=sys.stderr)
    record["duration_s"] = round(time.perf_counter() - t0, 2)
    record["finished_at"] = dt.datetime.now().isoformat(timespec="seconds")
    tables = tracking.with_identity(tables, record)
    text = summary_text(record, tables)
    with signals.held_signals() as pending:  # the measurement is done: its files and W&B run are finished whole
        written = _write(run_dir, record, tables, text)
        _close_wandb(wb, record, tables, run_dir, exit_code=0 if written and record["status"] == "ok" else 1)
    if written:
        print(text)
    if pending:
        what, code = interruption(signals.Interrupted(pending[0]))
        print(f"kvlab: {what} arrived as run {name} wrote its results: they are complete ({run_dir}); stopping",
              file=sys.stderr)
        raise SystemExit(code)
    return record


def _write_hydra(run_dir: Path, files: dict) -> None:
    """The job's ``.hydra/`` (``HydraJob.files``: its config, Hydra's, the overrides), written by kvlab once the
    config is valid and the folder is its own (Hydra's own writing of it is off: conf/config.yaml)."""
    ownership.claim(run_dir, ".hydra")
    for fname, text in files.items():
        tracking.atomic_write(Path(run_dir) / ".hydra" / fname, text.encode())


def hydra_overrides() -> str:
    """The command line's overrides of this job (W&B notes), or "defaults"."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "defaults"
    return " ".join(HydraConfig.get().overrides.task) or "defaults"


def _open_wandb(rc: RunConfig, record: dict, group: str, name: str, run_dir: Path, ident: str, notes: str):
    """The run's W&B run, opened as the measurement starts; trouble with W&B never costs the measurement. W&B gets
    the tracking choice and the resolved config as a plain dict (``RunConfig.resolved``)."""
    try:
        t = rc.tracking
        wb = tracking.WandbRun(t.mode, t.project, t.entity, group, name, run_dir, copy.deepcopy(rc.resolved),
                               run_id=wandb_id(run_dir, ident), tags=run_tags(rc, record), notes=notes)
        record.update(wandb=wb.where, wandb_id=wb.id)
        return wb
    except Exception as e:
        record.update(wandb=f"failed: {one_line(e)}", wandb_id=None)
        print(f"kvlab: W&B could not start ({record['wandb']}); the run goes on, results in {run_dir}",
              file=sys.stderr)
        return None


def _close_wandb(wb, record: dict, tables: dict, run_dir: Path, exit_code: int) -> None:
    if wb is None:
        return
    files = [run_dir / n for n in (*tracking.run_files(), ".hydra")]
    try:
        wb.finish(record, tables, files, exit_code)
    except Exception as e:  # the measurements are on disk already
        record["wandb"] = f"failed: {one_line(e)}"
        print(f"kvlab: W&B logging failed ({record['wandb']}); results are in {run_dir}", file=sys.stderr)
        _write(run_dir, record)


def _confirm(run_dir: Path, record: dict, inv: str, name: str) -> dict:
    """A complete run of the same config: keep its measurements, add this invocation to those that made or confirmed
    it (``invocations``), so every sweep that counts it, one running beside this one included, still finds it."""
    record = dict(record, invocation=inv, invocations=" ".join(dict.fromkeys(
        [*str(record.get("invocations") or record.get("invocation") or "").split(), inv])))
    _write(run_dir, record)
    print(f"kvlab: run {name} is complete (config {record['config_id']}, measured {record.get('finished_at')}): "
          "skipped; resume=false measures it again")
    return record


def _write(run_dir: Path, record: dict, tables: dict | None = None, log: str | None = None) -> bool:
    """Write the run's files; a write error is one line on stderr (the run then has no complete record)."""
    try:
        tracking.write_run_files(run_dir, record, tables, log)
        return True
    except OSError as e:
        note_failure(f"{run_dir} (cannot write: {e.strerror or e})")
        print(f"kvlab: cannot write the results of run {record['run_name']} to {run_dir}: {e.strerror or e}",
              file=sys.stderr)
        return False



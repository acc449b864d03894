"""Where results go: the run's own files (written atomically) and Weights & Biases (offline by default).

Files in the run's folder: ``steps.csv`` (decode-step time per context length, cached and uncached), ``drift.csv``
(equivalence and drift per decode step), ``memory.csv`` (cache bytes vs tokens: formula, and measured where the
generation reached), ``layers.csv`` (relative error of K and V per layer against fp32; no rows without drift) and
``results.json`` (one flat record), written last: a folder with a
results.json is a finished run. Every file goes to a temporary name first and is renamed into place, so a crash
never leaves a half-written one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import pandas as pd

RESULTS, STEPS, DRIFT, MEMORY, LAYERS = "results.json", "steps.csv", "drift.csv", "memory.csv", "layers.csv"
TABLES = {"steps": STEPS, "drift": DRIFT, "memory": MEMORY, "layers": LAYERS}  # a run's tables and their files
_UMASK = os.umask(0)
os.umask(_UMASK)


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are for everyone who may read the folder
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):  # numpy / torch scalars
        return _jsonable(v.item())
    return v


def write_run_files(run_dir: Path, record: dict, tables: dict[str, pd.DataFrame] | None = None) -> None:
    """The run's tables (``TABLES``: steps, drift, memory, layers), then results.json, last."""
    run_dir = Path(run_dir)
    for key, df in (tables or {}).items():
        if df is not None:
            _atomic_write(run_dir / TABLES[key], lambda f, df=df: df.to_csv(f, index=False))
    clean = {k: _jsonable(v) for k, v in record.items()}
    _atomic_write(run_dir / RESULTS, lambda f: json.dump(clean, f, indent=2, sort_keys=True))


INIT_TIMEOUT_S = 15  # how long an online W&B run may take to start before kvlab logs offline instead
ONLINE_FAILED: list[str] = []  # why online W&B failed in this process: later runs go offline at once


def _offline_env() -> None:
    # wandb's process-wide settings, not the run's mode, decide whether it sends usage telemetry and error
    # reports: say offline there too, before wandb sets itself up, so an offline run opens no connection.
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_ERROR_REPORTING"] = "false"


def _wandb_run(mode: str, project: str, entity: str | None, group: str, name: str, folder: Path, config: dict,
               job_type: str, run_id: str | None = None):
    """(wandb, run, mode it really runs in). ``online`` that cannot start within INIT_TIMEOUT_S (no API key, no
    network, a server that does not answer) falls back to ``offline`` with one line on stderr: nothing is lost,
    ``wandb sync`` sends it later."""
    if mode == "online" and ONLINE_FAILED:
        mode = "offline"
    if mode == "offline":
        _offline_env()
    import wandb

    folder.mkdir(parents=True, exist_ok=True)

    def start(m: str):
        return wandb.init(mode=m, project=project, entity=entity, group=group, name=name, job_type=job_type,
                          dir=str(folder), config=config, reinit="create_new", id=run_id,
                          resume="allow" if run_id else None,
                          settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                  init_timeout=INIT_TIMEOUT_S))

    if mode != "online":
        return wandb, start(mode), mode
    try:
        return wandb, start("online"), "online"
    except Exception as e:  # no key, no network, no answer: keep the run, offline
        why = " ".join(str(e).split()).split(" Consider increasing")[0][:160] or type(e).__name__
        ONLINE_FAILED.append(why)
        print(f"kvlab: W&B online could not start ({type(e).__name__}: {why}); logging offline instead, "
              "`wandb sync` sends it later", file=sys.stderr)
        _offline_env()
        return wandb, start("offline"), "offline"


def _where(run, mode: str) -> str:
    return str(Path(run.dir).parent) if mode == "offline" else (run.url or "online")


def log_wandb(mode: str, project: str, entity: str | None, group: str, name: str, run_dir: Path, config: dict,
              record: dict, tables: dict[str, pd.DataFrame | None], run_id: str | None = None) -> str:
    """One W&B run, finished before returning: config = the resolved config, summary = the record, history = one
    row per decode step (equivalence and drift), Tables of the step-time, drift and memory rows. Returns where it
    went."""
    if mode == "disabled":
        return "disabled"
    wandb, run, mode = _wandb_run(mode, project, entity, group, name, Path(run_dir), config, "run", run_id)
    steps, drift, memory, layers = (tables.get(k) for k in ("steps", "drift", "memory", "layers"))
    try:
        if drift is not None:
            run.define_metric("decode_step")
            run.define_metric("step/*", step_metric="decode_step")
            for row in drift.to_dict("records"):
                run.log({"decode_step": row["step"], **{f"step/{k}": _jsonable(v) for k, v in row.items()
                                                        if isinstance(v, (int, float)) and k != "step"
                                                        and _jsonable(v) is not None}})
            run.log({"drift_table": wandb.Table(dataframe=drift)})
        if steps is not None:
            run.log({"step_time_table": wandb.Table(dataframe=steps)})
        if memory is not None:
            run.log({"memory_table": wandb.Table(dataframe=memory)})
        if layers is not None and len(layers):
            run.log({"layers_table": wandb.Table(dataframe=layers)})
        run.summary.update({k: _jsonable(v) for k, v in record.items()})
        where = _where(run, mode)
    finally:
        run.finish(exit_code=0 if record.get("status") == "ok" else 1)
    return where


def log_wandb_aggregate(mode: str, project: str, entity: str | None, group: str, folder: Path,
                        runs: pd.DataFrame, images: dict[str, Path], run_id: str | None = None) -> str:
    """The sweep's aggregate W&B run (job_type "aggregate", the sweep's group): the runs table and the plots."""
    if mode == "disabled":
        return "disabled"
    wandb, run, mode = _wandb_run(mode, project, entity, group, f"{group}-report", Path(folder),
                                  {"n_runs": len(runs)}, "aggregate", run_id)
    try:
        table = runs.map(lambda v: v if isinstance(v, (bool, int, float, str)) or v is None else str(v))
        run.log({"runs": wandb.Table(dataframe=table),
                 **{f"plots/{stem}": wandb.Image(str(path)) for stem, path in images.items()}})
        run.summary.update({"n_runs": len(runs), "n_failed": int((runs["status"] != "ok").sum())})
        where = _where(run, mode)
    finally:
        run.finish()
    return where

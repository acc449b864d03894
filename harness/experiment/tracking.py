"""Where results go: the run's own files (written atomically) and Weights & Biases (offline by default).

Files in the run's folder: ``steps.csv`` (decode-step time per context length, cached and uncached), ``drift.csv``
(equivalence and drift per decode step), ``memory.csv`` (cache bytes vs tokens: formula, and measured where the
generation reached), ``layers.csv`` (relative error of K and V per layer against fp32; no rows without drift) and
``results.json`` (one flat record), written last: a folder with a
results.json is a finished run. Every file goes to a temporary name first and is renamed into place, so a crash
never leaves a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import pandas as pd

from harness.common import ownership
from harness.measurements import KEYS
from harness.common.ownership import atomic_write

RESULTS, LOG = "results.json", "run.log"  # run.log: the run's summary, as printed; the tables' files are declared
# by the measurements that write them (harness.measurements.tables())


def table_files() -> dict[str, str]:
    """A run's tables -> their files, from the measurements that write them (``harness.measurements``)."""
    from harness import measurements

    return {name: t["file"] for name, t in measurements.tables().items()}


def run_files() -> tuple[str, ...]:
    """Every file a run writes in its folder (besides .hydra/ and wandb/)."""
    return (RESULTS, LOG, *table_files().values())


def with_identity(tables: dict, record: dict) -> dict:
    """The run's tables, each starting with the columns that say which run a row is of
    (``harness.measurements.IDENTITY_COLUMNS``)."""
    from harness.measurements import IDENTITY_COLUMNS

    out = {}
    for name, df in tables.items():
        if df is not None:
            df = df.drop(columns=[c for c in IDENTITY_COLUMNS if c in df])
            for i, k in enumerate(IDENTITY_COLUMNS):
                df.insert(i, k, record.get(k))
        out[name] = df
    return out


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):  # numpy / torch scalars
        return _jsonable(v.item())
    return v


def write_run_files(run_dir: Path, record: dict, tables: dict[str, pd.DataFrame] | None = None,
                    log: str | None = None) -> None:
    """The run's tables (``table_files``), its summary (``run.log``), then results.json, last; each name listed in
    the folder's manifest before it is written (kvlab's own, to clear or replace)."""
    run_dir = Path(run_dir)
    tables = {k: df for k, df in (tables or {}).items() if df is not None}
    files = table_files()
    ownership.claim(run_dir, RESULTS, *(files[k] for k in tables), *([LOG] if log is not None else []))
    for key, df in tables.items():
        atomic_write(run_dir / files[key], lambda f, df=df: df.to_csv(f, index=False))
    if log is not None:
        atomic_write(run_dir / LOG, (log + "\n").encode())
    clean = {k: _jsonable(v) for k, v in record.items()}
    atomic_write(run_dir / RESULTS, lambda f: json.dump(clean, f, indent=2, sort_keys=True))


FLUSH_S = 2.0  # the run's .wandb file is flushed this often: a run killed mid-way is on disk, and shows as crashed
INIT_TIMEOUT_S = 15  # how long an online W&B run may take to start before kvlab logs offline instead
ONLINE_FAILED: list[str] = []  # why online W&B failed in this process: later runs go offline at once


def _offline_env() -> None:
    # wandb's process-wide settings, not the run's mode, decide whether it sends usage telemetry and error
    # reports: say offline there too, before wandb sets itself up, so an offline run opens no connection.
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_ERROR_REPORTING"] = "false"


def keep_inside(folder: Path) -> None:
    """Point W&B's data and cache folders (artifact staging, the artifact file cache) into ``folder``: everything a
    run writes stays in its own folder, so a copied ``outputs/`` syncs from anywhere."""
    os.environ["WANDB_DATA_DIR"] = str(Path(folder) / "wandb" / "data")
    os.environ["WANDB_CACHE_DIR"] = str(Path(folder) / "wandb" / "cache")


def _wandb_run(mode: str, project: str, entity: str | None, group: str, name: str, folder: Path, config: dict,
               job_type: str, run_id: str | None = None, tags: list[str] | None = None, notes: str | None = None):
    """(wandb, run, mode it really runs in). ``online`` that cannot start within INIT_TIMEOUT_S (no API key, no
    network, a server that does not answer) falls back to ``offline`` with one line on stderr: nothing is lost,
    ``wandb sync`` sends it later."""
    if mode == "online" and ONLINE_FAILED:
        mode = "offline"
    if mode == "offline":
        _offline_env()
    ownership.claim(folder, "wandb")  # listed before W&B writes it: kvlab's to clear when the run is redone
    keep_inside(folder)
    import wandb

    def start(m: str):
        return wandb.init(mode=m, project=project, entity=entity, group=group, name=name, job_type=job_type,
                          dir=str(folder), config=config, reinit="create_new", id=run_id,
                          resume="allow" if run_id else None, tags=tags, notes=notes,
                          settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                  init_timeout=INIT_TIMEOUT_S,
                                                  x_transaction_log_flush_interval=FLUSH_S))

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


REPO = Path(__file__).resolve().parents[2]


def sources() -> list[Path]:
    """kvlab's own code and configs: run.py and the .py / .yaml files under conf/, harness/ and models/."""
    found = [REPO / "run.py"] + [p for d in ("conf", "harness", "models") for ext in ("py", "yaml")
                                 for p in (REPO / d).rglob(f"*.{ext}")]
    return sorted(p for p in found if p.is_file())


def log_history(run, tables: dict) -> None:
    """Each measurement's per-step series (``history_rows``), one W&B row per step value, against its step metric
    (``decode_step``, ``context_len``); the keys are the registry's ``history_keys``."""
    from harness import measurements

    by: dict[str, dict[int, dict]] = {}
    for cls in measurements.MEASUREMENTS.values():
        for metric, x, values in cls.history_rows(tables):
            by.setdefault(metric, {}).setdefault(x, {}).update(values)
    keys = measurements.history_keys()
    for metric, rows in by.items():
        run.define_metric(metric)
        for glob in sorted({k.split("/")[0] + "/*" for k, m in keys.items() if m == metric}):
            run.define_metric(glob, step_metric=metric, summary="none")
        for x in sorted(rows):
            run.log({metric: x, **{k: _jsonable(v) for k, v in rows[x].items() if _jsonable(v) is not None}})


class WandbRun:
    """The W&B run of one measurement, open from its start (true start time; a process killed mid-way leaves it
    crashed, and the same id resumes it) to ``finish``. Mode ``disabled``: nothing at all."""

    def __init__(self, mode: str, project: str, entity: str | None, group: str, name: str, run_dir: Path,
                 config: dict, run_id: str | None = None, tags: list[str] | None = None, notes: str | None = None):
        self.run = None
        self.where, self.id = "disabled", None
        if mode == "disabled":
            return
        self.wandb, self.run, self.mode = _wandb_run(mode, project, entity, group, name, Path(run_dir), config, "run",
                                                     run_id, tags, notes)
        self.where, self.id = _where(self.run, self.mode), self.run.id
        try:  # the code that measured it: kvlab's own sources and configs (a "kvlab-code" artifact)
            code = self.wandb.Artifact(f"source-{self.id}", type="kvlab-code")
            for f in sources():
                code.add_file(str(f), name=str(f.relative_to(REPO)))
            self.run.log_artifact(code)
        except Exception as e:  # never worth a run
            print(f"kvlab: W&B could not save the code ({type(e).__name__}); the run goes on", file=sys.stderr)

    def finish(self, record: dict, tables: dict, files: list[Path], exit_code: int) -> None:
        """Log what the run measured and close it: each measurement's history (``log_history``: per decode step,
        step times against ``context_len``), the tables, the record as the summary (keys whose value is null are
        left out, listed in ``null_keys``), the effective config, and the run's files as an artifact."""
        if self.run is None:
            return
        run, wandb = self.run, self.wandb
        try:
            run.config.update({"effective": effective(record)}, allow_val_change=True)
            log_history(run, tables)
            for key, df in tables.items():
                if df is not None and len(df):
                    run.log({f"{key}_table": wandb.Table(dataframe=df)})
            summary = {k: _jsonable(v) for k, v in record.items()}
            nulls = sorted(k for k, v in summary.items() if v is None)
            run.summary.update({k: v for k, v in summary.items() if v is not None})
            run.summary["null_keys"] = nulls
            art = wandb.Artifact(f"run-{self.id}", type="kvlab-run",
                                 description=f"kvlab run {record.get('run_name')}: results and tables")
            for f in map(Path, files):  # file by file: add_dir prints to the console
                for one in sorted(f.rglob("*")) if f.is_dir() else [f]:
                    if one.is_file():
                        art.add_file(str(one), name=str(one.relative_to(f.parent)))
            run.log_artifact(art)
        finally:
            run.finish(exit_code=exit_code)


def effective(record: dict) -> dict:
    """The values a run really used, where its config says null / auto: what W&B can group and filter by."""
    ctx = record.get("context_lengths")
    return dict(
        max_len=record.get("max_len"),
        context_lengths=[int(c) for c in str(ctx).split(",")] if ctx else None,
        full_prompts=record.get("full_prompts"), storage_dtype=record.get("storage_dtype"),
        compute_dtype=record.get("compute_dtype"), device=record.get("device"),
        device_name=record.get("device_name"), n_params=record.get("n_params"), weights=record.get("weights"),
        weights_source=record.get("weights_source"), torch_version=record.get("torch_version"),
        cache_label=record.get("cache_label"),
    )


def log_wandb_aggregate(mode: str, project: str, entity: str | None, group: str, folder: Path,
                        runs: pd.DataFrame, images: dict[str, Path], run_id: str | None = None,
                        tables: dict[str, pd.DataFrame] | None = None, page: Path | None = None,
                        files: list[Path] | None = None) -> str:
    """The sweep's aggregate W&B run (job_type "aggregate", the sweep's group): the sweep-wide tables, the plots as
    images, step time vs context as a line series per cache and mode, report.html as ``wandb.Html``, and the report's
    own ``files`` (what kvlab wrote there, nothing else) as an artifact."""
    if mode == "disabled":
        return "disabled"
    wandb, run, mode = _wandb_run(mode, project, entity, group, f"{group}-report", Path(folder),
                                  {"n_runs": len(runs)}, "aggregate", run_id, tags=["report"])
    try:
        def cells(df):
            return df.map(lambda v: v if isinstance(v, (bool, int, float, str)) or v is None else str(v))

        # a table over W&B's row limit would be cut short there, silently: it goes in the artifact's files only
        cap = getattr(wandb.Table, "MAX_ARTIFACT_ROWS", 200_000)
        shown = {k: df for k, df in (tables or {}).items() if df is not None and 0 < len(df) <= cap}
        run.summary["tables_in_files_only"] = ", ".join(sorted(k for k, df in (tables or {}).items()
                                                               if df is not None and len(df) > cap)) or "none"
        run.log({"runs": wandb.Table(dataframe=cells(runs)),
                 **{f"{k}_table": wandb.Table(dataframe=cells(df)) for k, df in shown.items()},
                 **{f"plots/{stem}": wandb.Image(str(path)) for stem, path in images.items()}})
        steps = (tables or {}).get("steps")
        if steps is not None and len(steps) and "cache_label" in steps:
            ok = steps[steps["status"] == "ok"] if "status" in steps else steps
            ctx, ms = KEYS.context_len, KEYS.ms_median
            series = ok.groupby(["model", "cache_label", "dtype", "mode", ctx], as_index=False)[ms].median()
            xs = sorted(series[ctx].unique().tolist())
            keys, ys = [], []
            for key, g in series.groupby(["model", "cache_label", "dtype", "mode"]):
                by = dict(zip(g[ctx], g[ms]))
                keys.append(" · ".join(map(str, key)))
                ys.append([float(by.get(x, float("nan"))) for x in xs])
            run.log({"lines/step_time": wandb.plot.line_series(xs=xs, ys=ys, keys=keys, xname="context_len",
                                                               title="decode-step time (ms) vs context length")})
        if page is not None and Path(page).is_file():
            run.log({"report": wandb.Html(Path(page).read_text(encoding="utf-8"))})
        art = wandb.Artifact(f"report-{run.id}", type="kvlab-report", description=f"kvlab sweep report {group}")
        for f in sorted(map(Path, files or [])):
            if f.is_file():
                art.add_file(str(f), name=f.name)
        run.log_artifact(art)
        run.summary.update({"n_runs": len(runs), "n_failed": int((runs["status"] != "ok").sum())})
        where = _where(run, mode)
    finally:
        run.finish()
    return where


def default_group(experiment_name: str, folder: str) -> str:
    """The W&B group of a sweep's runs (or of a single run): ``<experiment>-<sweep folder>``, the folder being named
    by the time it started."""
    return f"{experiment_name}-{folder}"[:128]


def wandb_id(folder: Path, ident: str) -> str:
    """The W&B run id of a config measured in ``folder``: the same when the run is resumed there, so W&B continues
    it instead of adding one; a different folder (another sweep, a single run) is another W&B run."""
    return hashlib.sha256(f"{Path(folder).resolve()}/{ident}".encode()).hexdigest()[:16]

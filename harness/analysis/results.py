"""Load any outputs/ tree (one run, one sweep, several) into tidy pandas DataFrames.

    from harness.analysis.results import load_runs, load_steps, load_drift
    runs = load_runs("outputs/multirun")     # one row per run: config columns, metrics, fingerprint, status
    steps = load_steps("outputs/multirun")   # one row per (run, context length, cached/uncached): step times
    drift = load_drift("outputs/multirun")   # one row per (run, decode step): equivalence and drift vs fp32
    memory = load_memory("outputs/multirun") # one row per (run, tokens): cache bytes, formula and measured
    layers = load_layers("outputs/multirun") # one row per (run, layer): K and V relative error vs fp32

A run is a folder with a ``results.json`` (written last, atomically, by every run, failed ones included). A Hydra
job folder without one (a run that was killed, or is still going), an unreadable or foreign results.json and an
unreadable table are skipped with a warning; a run that is not ok (failed, interrupted, not_equivalent) is kept,
with its ``status`` and ``error``, and has no step or drift rows: the tables (and so the plots) hold ok runs only.
A folder whose name is not UTF-8 is read like any other; its name is shown with the odd bytes escaped (``shown``).
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path

import pandas as pd

from harness import measurements
from harness.common import ownership
from harness.experiment import tracking
from harness.measurements import IDENTITY_COLUMNS
from harness.experiment.records import RECORD_MAX, of_invocations, read_record, run_folder, shown
from harness.experiment.tracking import RESULTS

# the columns that say which run a row belongs to, first in every table
KEYS = list(IDENTITY_COLUMNS)
# the readable order of the runs table; everything else follows, alphabetically
FIRST = KEYS + ["error", "experiment", "weights", "cache_exact", *measurements.shown_keys()]
SKIP_DIRS = {"wandb", "report", ".hydra"}


class IncompleteRunWarning(UserWarning):
    pass


def _skipped(path: Path) -> bool:
    return any(part in SKIP_DIRS for part in path.parts)


def required_columns(file: str) -> tuple[str, ...]:
    """The columns that make a run table kvlab's: those its first measurement declares."""
    for name, t in measurements.tables().items():
        if t["file"] == file:
            first = measurements.MEASUREMENTS[t["by"][0]]
            return next(x.columns for x in first.tables if x.name == name)
    return ()


RECORDS_TOTAL_MAX = 256 * 2 ** 20  # bytes of records one scan reads (250,000 runs of 1 KB)
TABLE_MAX = 256 * 2 ** 20  # bytes: a run's CSV table (a 1,000-step serve of many sequences is a few MB)
TABLES_TOTAL_MAX = 512 * 2 ** 20  # bytes of one table's files one load reads, over every run (pandas holds ~5x)


WALK_MAX = 1_000_000  # folder entries one scan looks at (a sweep of 1,000 runs holds some 20,000)


def _walk(root: Path) -> tuple[list[Path], list[Path]]:
    """(every results.json, every .hydra folder) under ``root``, sorted: a folder reached twice (a link back up) is
    searched once, other filesystems (/proc, /sys, a mount below) are not entered, kvlab's own wandb/report/.hydra folders are not
    searched, and at most ``WALK_MAX`` entries are looked at (FileNotFoundError in one line beyond: a report on ``/``
    would otherwise walk the machine)."""
    records, jobs, seen = [], [], 0
    st = os.stat(root)
    dev, visited = st.st_dev, {(st.st_dev, st.st_ino)}
    for folder, dirs, files in os.walk(root, onerror=lambda e: None, followlinks=True):
        seen += len(dirs) + len(files)
        if seen > WALK_MAX:
            raise FileNotFoundError(f"{shown(root)} holds more than {WALK_MAX:,} files and folders: kvlab does not "
                                    "search that far for runs; pass a sweep or run folder (under outputs/)")
        here = Path(folder)
        if RESULTS in files or RESULTS in dirs:
            records.append(here / RESULTS)
        if ".hydra" in dirs:
            jobs.append(here / ".hydra")
        keep = []
        for d in dirs:
            try:
                sub = os.stat(here / d)
            except OSError:
                continue
            if d not in SKIP_DIRS and sub.st_dev == dev and (sub.st_dev, sub.st_ino) not in visited:
                visited.add((sub.st_dev, sub.st_ino))  # each folder once: a link back up ends there
                keep.append(d)
        dirs[:] = sorted(keep)
    return sorted(records), sorted(jobs)


def scan(path: str | Path, invocation: str | None = None) -> dict:
    """Every run under ``path``: ``runs`` [(folder, record)] sorted by folder (a resumed sweep measures each config in
    one folder, so each appears once), ``skipped`` [(folder, why)] for what could not be read, and ``interrupted``
    [folder] for job folders without a results.json. With ``invocation``, only the runs that invocation of run.py
    made or confirmed."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder; pass a run or sweep folder under outputs/")
    found, jobs = _walk(root)
    runs, skipped, recorded, read, unread = [], [], set(), 0, 0
    for f in found:
        if _skipped(f.relative_to(root).parent):
            continue
        recorded.add(f.parent)
        with contextlib.suppress(OSError):
            size = os.stat(f).st_size if f.is_file() else 0
            read += size if size <= RECORD_MAX else 0  # one over the per-file bound is refused by read_record
        if read > RECORDS_TOTAL_MAX:
            unread += 1
            continue
        record, why = read_record(f)
        if record is None:
            skipped.append((f.parent, why))
        elif invocation is None or invocation in of_invocations(record):
            runs.append((f.parent, record))
    if unread:  # one line for all of them
        skipped.append((root, f"{unread:,} results.json files not read: the records under it hold more than the "
                              f"{RECORDS_TOTAL_MAX:,} bytes kvlab reads in one scan (report on fewer folders)"))
    interrupted = [h.parent for h in jobs if h.parent not in recorded and not _skipped(h.parent.relative_to(root))]
    return dict(runs=runs, skipped=skipped, interrupted=interrupted)


def run_folders(path: str | Path, invocation: str | None = None) -> list[tuple[Path, dict]]:
    """(folder, record) of every finished run under ``path``, sorted by folder; warns about what
    it skips: unreadable or foreign results.json files, and job folders without one (the first ``SKIPPED_WARNED``,
    then one warning counting the rest: ``scan`` lists them all)."""
    found = scan(path, invocation)
    why_skipped = [(folder, why) for folder, why in found["skipped"]]
    why_skipped += [(folder, f"no {RESULTS} (the run was interrupted or is still going)")
                    for folder in found["interrupted"]]
    for folder, why in why_skipped[:SKIPPED_WARNED]:
        warnings.warn(f"skipping {shown(folder)}: {why}", IncompleteRunWarning, stacklevel=2)
    if len(why_skipped) > SKIPPED_WARNED:
        warnings.warn(f"skipping {len(why_skipped) - SKIPPED_WARNED:,} more folders under {shown(path)} "
                      "(harness.analysis.results.scan lists each, and why)", IncompleteRunWarning, stacklevel=2)
    return found["runs"]


SKIPPED_WARNED = 10  # skipped folders run_folders warns about one by one


def _order(df: pd.DataFrame, first: list[str]) -> pd.DataFrame:
    head = [c for c in first if c in df.columns]
    return df[head + sorted(c for c in df.columns if c not in head)]


def load_runs(path: str | Path, invocation: str | None = None) -> pd.DataFrame:
    """One row per run: the run's results.json, flat; ``run_dir`` is its folder (``shown``: a name that is not
    UTF-8 has its odd bytes escaped)."""
    rows = [dict(record, run_dir=shown(folder)) for folder, record in run_folders(path, invocation)]
    if not rows:
        return pd.DataFrame(columns=FIRST)
    return _order(pd.DataFrame(rows), FIRST).reset_index(drop=True)


def read_table(f: Path) -> tuple[pd.DataFrame | None, str | None]:
    """A run's CSV table, or (None, why not)."""
    why = ownership.file_problem(f, TABLE_MAX)
    if why:
        return None, why
    try:
        df = pd.read_csv(f)
    except (OSError, UnicodeDecodeError, ValueError, pd.errors.ParserError) as e:
        return None, f"unreadable {f.name} ({type(e).__name__})"
    if df.empty:
        return None, f"{f.name} has no rows"
    missing = [c for c in required_columns(f.name) if c not in df.columns]
    if missing:
        return None, f"{f.name} is not kvlab's (no {', '.join(missing)} column)"
    return df, None


def _writer(file: str) -> str | None:
    """The measurement whose run writes ``file`` (the first that declares it)."""
    return next((t["by"][0] for t in measurements.tables().values() if t["file"] == file), None)


def _made(record: dict, writer: str) -> bool:
    """Whether a run should have made the table measurement ``writer`` writes: it was asked for (``measurements``;
    records from before that key: every measurement was) and did not record why it was skipped."""
    asked = record.get("measurements")
    return (asked is None or writer in str(asked).split(",")) and f"{writer}_skipped" not in record


def _long(path: str | Path, name: str, invocation: str | None = None, required: bool = True) -> pd.DataFrame:
    """One run table (file ``name``) of every ok run under ``path``, stacked. A ``required`` table is missed (a
    warning) in a run whose record shows its measurement ran; a run that did not make it (``measurements=[...]``)
    has none to miss."""
    frames, read = [], 0
    writer = _writer(name)
    for folder, record in run_folders(path, invocation):
        f = folder / name
        if record.get("status") != "ok":
            continue
        with contextlib.suppress(OSError):  # a file over the per-file bound is refused by read_table, unread
            size = os.stat(f).st_size if f.is_file() else 0
            read += size if size <= TABLE_MAX else 0
        if read > TABLES_TOTAL_MAX:
            warnings.warn(f"{shown(folder)}: its {name} is not read: the {name} files under {shown(path)} hold more "
                          f"than the {TABLES_TOTAL_MAX:,} bytes kvlab reads in one load; its rows are missing",
                          IncompleteRunWarning, stacklevel=3)
            continue
        if not f.is_file():
            made = writer is None or _made(record, writer)
            if not (required and made):  # a table this run did not make, or that earlier kvlab versions did not
                continue
            warnings.warn(f"{shown(folder)}: finished but has no {name}; its rows are missing", IncompleteRunWarning,
                          stacklevel=3)
            continue
        df, why = read_table(f)
        if df is None and not required and why.endswith("has no rows"):
            continue  # an optional table a run had nothing for (layers.csv of an exact fp32 run)
        if df is None:
            warnings.warn(f"{shown(folder)}: {why}; its rows are missing", IncompleteRunWarning, stacklevel=3)
            continue
        for k in KEYS:
            df[k] = record.get(k)
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=KEYS)
    return _order(pd.concat(frames, ignore_index=True), KEYS)


def load_table(path: str | Path, name: str, invocation: str | None = None) -> pd.DataFrame:
    """Any run table by its name (``harness.measurements.tables()``): one row per (run, row of its table), the
    identity columns first; runs that have no such file are left out."""
    return _long(path, measurements.table(name)["file"], invocation, required=False)


def load_tables(path: str | Path, invocation: str | None = None) -> dict[str, pd.DataFrame]:
    """Every run table the registry knows, by name."""
    return {name: _long(path, t["file"], invocation, required=name in REQUIRED_TABLES)
            for name, t in measurements.tables().items()}


REQUIRED_TABLES = ("steps", "drift", "memory")  # every ok run of a default sweep writes these


def load_steps(path: str | Path, invocation: str | None = None) -> pd.DataFrame:
    """Decode-step times: one row per (run, context_len, mode) with ms_median, ms_p10, ms_p90, speedup."""
    return _long(path, measurements.table("steps")["file"], invocation)


def load_drift(path: str | Path, invocation: str | None = None) -> pd.DataFrame:
    """Per decode step: eq_max_abs_diff (cached vs the kind's reference) and drift_* vs fp32 full attention (NaN
    where the run has no drift)."""
    return _long(path, measurements.table("drift")["file"], invocation)


def load_memory(path: str | Path, invocation: str | None = None) -> pd.DataFrame:
    """Cache bytes vs tokens: one row per (run, tokens) with nbytes_formula and nbytes_measured (NaN where the
    generation did not reach that length)."""
    return _long(path, measurements.table("memory")["file"], invocation)


def load_layers(path: str | Path, invocation: str | None = None) -> pd.DataFrame:
    """Per layer: k_rel_err and v_rel_err, the relative error of the K and V attention read against fp32 (no rows
    for runs without drift)."""
    return _long(path, measurements.table("layers")["file"], invocation, required=False)


def load_batches(path: str | Path, invocation: str | None = None) -> pd.DataFrame:
    """Decode throughput vs batch size: one row per (run, batch) with ms_median, tokens_per_s, weight_bytes,
    kv_bytes (runs without ``batch_sizes`` have none)."""
    return _long(path, measurements.table("batches")["file"], invocation, required=False)


def save_table(df: pd.DataFrame, folder: str | Path, stem: str) -> list[Path]:
    """Write ``stem.parquet`` and ``stem.csv`` into ``folder``, each listed in its manifest first and written
    atomically. Refused (``ownership.NotOurs``, one line) in a run's folder, or where a file of that name is not
    kvlab's."""
    folder = Path(folder)
    why = run_folder(folder)
    if why:
        raise ownership.NotOurs(f"{shown(folder)} is a run folder ({why}): a report's {stem} table is not written "
                                "there; give the report a folder of its own")
    pq, csv = folder / f"{stem}.parquet", folder / f"{stem}.csv"
    mine = ownership.owned(folder)
    theirs = [p.name for p in (pq, csv) if (p.exists() or p.is_symlink()) and p.name not in mine]
    if theirs:
        raise ownership.NotOurs(f"{shown(folder)} holds {theirs[0]}, which kvlab did not write: it is not replaced; "
                                "give the report a folder of its own")
    mixed = [c for c in df.columns if df[c].dtype == object and df[c].dropna().map(type).nunique() > 1]
    if mixed:  # a column that holds numbers and text (a record written by hand): parquet needs one type
        df = df.astype({c: "string" for c in mixed})
    ownership.claim(folder, pq.name, csv.name)
    buf = io.BytesIO()
    try:
        df.to_parquet(buf, index=False)
    except (OverflowError, ValueError, TypeError, ImportError):  # e.g. an integer beyond 64 bits in a hand-made record
        df = df.astype({c: "string" for c in df.columns if df[c].dtype == object})
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
    tracking.atomic_write(pq, buf.getvalue())
    tracking.atomic_write(csv, lambda f: df.to_csv(f, index=False))
    return [pq, csv]

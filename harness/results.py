"""Load any outputs/ tree (one run, one sweep, several) into tidy pandas DataFrames.

    from harness.results import load_runs, load_steps, load_drift
    runs = load_runs("outputs/multirun")     # one row per run: config columns, metrics, fingerprint, status
    steps = load_steps("outputs/multirun")   # one row per (run, context length, cached/uncached): step times
    drift = load_drift("outputs/multirun")   # one row per (run, decode step): equivalence and drift vs fp32
    memory = load_memory("outputs/multirun") # one row per (run, tokens): cache bytes, formula and measured

A run is a folder with a ``results.json`` (written last, atomically, by every run, failed ones included). A Hydra
job folder without one (a run that was killed, or is still going) is skipped with a warning; a failed run is kept,
with its ``status`` and ``error``, and simply has no step or drift rows.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd

from harness.tracking import DRIFT, MEMORY, RESULTS, STEPS

# the columns that say which run a row belongs to, first in every table
KEYS = ["run_name", "group", "status", "model", "cache", "cache_label", "dtype", "device"]
# the readable order of the runs table; everything else follows, alphabetically
FIRST = KEYS + ["error", "experiment", "weights", "cache_exact", "tokens_identical", "max_abs_logit_diff",
                "first_diff_step", "nbytes_match", "cache_nbytes", "predicted_nbytes", "bytes_per_token", "drift_kl",
                "drift_max_abs", "drift_top1_agreement", "drift_token_match_rate", "ttft_ms",
                "step_ms_cached_at_max_context", "step_ms_uncached_at_max_context", "speedup_at_max_context"]
SKIP_DIRS = {"wandb", "report", ".hydra"}


class IncompleteRunWarning(UserWarning):
    pass


def _skipped(path: Path) -> bool:
    return any(part in SKIP_DIRS for part in path.parts)


def run_folders(path: str | Path) -> list[tuple[Path, dict]]:
    """(folder, record) of every finished run under ``path``, sorted by folder; warns about incomplete ones."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such folder; pass a run or sweep folder under outputs/")
    found = []
    for f in sorted(root.rglob(RESULTS)):
        if _skipped(f.relative_to(root).parent):
            continue
        try:
            found.append((f.parent, json.loads(f.read_text())))
        except (OSError, json.JSONDecodeError) as e:
            warnings.warn(f"skipping {f.parent}: unreadable {RESULTS} ({e})", IncompleteRunWarning, stacklevel=2)
    done = {folder for folder, _ in found}
    for hydra in sorted(root.rglob(".hydra")):
        job = hydra.parent
        if job not in done and not _skipped(job.relative_to(root)):
            warnings.warn(f"skipping {job}: no {RESULTS} (the run was interrupted or is still going)",
                          IncompleteRunWarning, stacklevel=2)
    return found


def _order(df: pd.DataFrame, first: list[str]) -> pd.DataFrame:
    head = [c for c in first if c in df.columns]
    return df[head + sorted(c for c in df.columns if c not in head)]


def load_runs(path: str | Path) -> pd.DataFrame:
    """One row per run: the run's results.json, flat."""
    rows = [dict(record, run_dir=str(folder)) for folder, record in run_folders(path)]
    if not rows:
        return pd.DataFrame(columns=FIRST)
    return _order(pd.DataFrame(rows), FIRST).reset_index(drop=True)


def _long(path: str | Path, name: str) -> pd.DataFrame:
    frames = []
    for folder, record in run_folders(path):
        f = folder / name
        if record.get("status") != "ok":
            continue
        if not f.is_file():
            warnings.warn(f"{folder}: finished but has no {name}; its rows are missing", IncompleteRunWarning,
                          stacklevel=3)
            continue
        df = pd.read_csv(f)
        for k in KEYS:
            df[k] = record.get(k)
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=KEYS)
    return _order(pd.concat(frames, ignore_index=True), KEYS)


def load_steps(path: str | Path) -> pd.DataFrame:
    """Decode-step times: one row per (run, context_len, mode) with ms_median, ms_p10, ms_p90, speedup."""
    return _long(path, STEPS)


def load_drift(path: str | Path) -> pd.DataFrame:
    """Per decode step: eq_max_abs_diff (cached vs uncached) and drift_* vs fp32 (NaN for fp32 runs)."""
    return _long(path, DRIFT)


def load_memory(path: str | Path) -> pd.DataFrame:
    """Cache bytes vs tokens: one row per (run, tokens) with nbytes_formula and nbytes_measured (NaN where the
    generation did not reach that length)."""
    return _long(path, MEMORY)


def save_table(df: pd.DataFrame, folder: str | Path, stem: str) -> list[Path]:
    """Write ``stem.parquet`` and ``stem.csv`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pq, csv = folder / f"{stem}.parquet", folder / f"{stem}.csv"
    df.to_parquet(pq, index=False)
    df.to_csv(csv, index=False)
    return [pq, csv]

"""Two runs of any kinds side by side, paired text by text and sequence by sequence: what the claims of a paper preset
do within one sweep, for runs a preset's grid cannot hold (another cache kind at the same bytes). For each pair of
run folders, the ratio of their mean KL on the texts both scored and the difference of their copy accuracy on the
sequences both copied, each with its 95% t-interval over those units (``harness.analysis.intervals``), and each
run's bytes held.

    .venv/bin/python scripts/probes/paired_runs.py RUN_A RUN_B [RUN_A2 RUN_B2 ...]

Used for docs/papers.md (DuoAttention against SnapKV and a window at the same bytes): each run folder is one a
sweep wrote (``results.json``, ``text_positions.csv``, ``retrieval_positions.csv``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import pandas as pd  # noqa: E402

from harness.analysis import intervals  # noqa: E402


def _rows(folder: Path, metric) -> pd.DataFrame:
    table = pd.read_csv(folder / f"{metric.table}.csv")
    return intervals.rows_of({metric.table: table.assign(run_name=folder.name)}, folder.name, metric)


def compared(a: Path, b: Path) -> dict:
    """Run ``a`` against run ``b``: mean KL a / b and copy accuracy a − b, each an ``Interval``, and their labels
    and bytes."""
    ra, rb = (json.loads((f / "results.json").read_text()) for f in (a, b))
    kl, copy = intervals.METRICS["kl"], intervals.METRICS["copy"]
    return dict(a=ra["cache_label"], b=rb["cache_label"], model=ra["model"],
                bytes=(ra.get("cache_nbytes"), rb.get("cache_nbytes")),
                kl=intervals.compare(_rows(a, kl), _rows(b, kl), kl.column, kl.stat, "ratio", unit=kl.unit),
                copy=intervals.compare(_rows(a, copy), _rows(b, copy), copy.column, copy.stat, unit=copy.unit),
                kl_each=(ra.get("drift_kl"), rb.get("drift_kl")), copy_each=(ra.get("retrieval_acc"),
                                                                          rb.get("retrieval_acc")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders, in pairs: A B [A2 B2 ...]")
    args = p.parse_args(argv)
    if len(args.runs) % 2:
        p.error("give run folders in pairs (A B ...)")
    for a, b in zip(args.runs[::2], args.runs[1::2]):
        c = compared(Path(a), Path(b))
        print(f"{c['model']}: {c['a']} ({c['bytes'][0]:,} B) against {c['b']} ({c['bytes'][1]:,} B)")
        print(f"  mean KL {c['kl_each'][0]:.4g} / {c['kl_each'][1]:.4g}: ratio {c['kl'].text('.3g')}x "
              f"(n = {c['kl'].n})")
        print(f"  copy {c['copy_each'][0]:.3f} - {c['copy_each'][1]:.3f}: {c['copy'].text('+.3f')} "
              f"(n = {c['copy'].n})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

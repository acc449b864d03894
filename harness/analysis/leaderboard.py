"""The compression leaderboard of an ``experiment=leaderboard`` sweep: which method keeps the most per byte, on which
task (the runs come from ``harness.experiment.leaderboard``, which says what each ratio means for each method).

    from harness.analysis import leaderboard
    board = leaderboard.table(runs, frames)   # one row per model x method x ratio (and full attention, ratio 0)
    leaderboard.markdown(board)               # the same as tables, a model each, best per column marked

Each task's score is a mean over its own units with a 95% t-interval over them (``harness.analysis.intervals``:
texts for text drift, sequences for copy, needle probes for niah, sequences for mqar), read from the run's own
per-position table. Text drift is the mean KL(fp32 full attention || the run) over every scored position (lower is
better); the three retrieval tasks are top-1 accuracy on the answer ids (higher is better). Full attention's row
is the runs' fp32 full-attention reference (every run of a model reads the same sequences: its text KL is 0 by
definition). A task fp32 full attention cannot do on a model (``<task>_ref_ok`` false) measures the model, not the
cache: its column says so and marks no best.

Within a ratio, the best score of a column is marked, and so is every score whose interval overlaps the best's (a
tie: the data cannot order them). The bytes are the cache's own formula at the leaderboard's context (``max_len``
of the runs) per sequence; the step time is the run's median cached decode step at its longest timed context.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pandas as pd

from harness.analysis import intervals

EXPERIMENT = "leaderboard"
FILE = "leaderboard.md"  # beside the report's tables (leaderboard.csv / .parquet: ``table``)
FULL = "full attention"
RATIO_DIGITS = 3  # an asked ratio, as worked out from a run's options


@dataclass(frozen=True)
class Task:
    """A leaderboard column: its score key in a run's record, the per-position metric its interval is made from,
    the fp32 full-attention reference's key and whether that reference can do the task."""

    name: str
    label: str
    key: str
    metric: str  # intervals.METRICS name
    ref_key: str | None
    ref_ok: str | None
    better: str  # "low" or "high"


TASKS = (Task("text", "text KL (nats) ↓", "drift_kl", "kl", None, None, "low"),
         Task("copy", "copy ↑", "retrieval_acc", "copy", "retrieval_acc_ref", None, "high"),
         Task("niah", "niah ↑", "niah_acc", "niah", "niah_acc_ref", "niah_ref_ok", "high"),
         Task("mqar", "mqar ↑", "mqar_acc", "mqar", "mqar_acc_ref", "mqar_ref_ok", "high"))


def ran(runs: pd.DataFrame) -> bool:
    """Whether ``runs`` hold runs of experiment=leaderboard."""
    return "experiment" in runs and bool((runs["experiment"] == EXPERIMENT).any())


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def method_of(row: pd.Series) -> str:
    """The leaderboard's name for a run's method: quant<bits>, <kind> (window, duo, an evicting kind spending its
    budget uniformly, an external kind) or <kind>-<allocation>."""
    kind = str(row.get("cache"))
    if kind == "quant":
        return f"quant{int(row['cache_k_bits'])}"
    allocation = row.get("cache_allocation")
    return kind if _missing(allocation) or allocation == "uniform" else f"{kind}-{allocation}"


def held(row: pd.Series) -> tuple[float, float]:
    """(bytes the run's cache holds per sequence at ``max_len`` tokens, by its kind's formula; the fraction of fp32
    full attention's bytes that removes), from the run's memory measurement; NaN where it has none."""
    nbytes, full = row.get("nbytes_at_max_len"), row.get("full_nbytes_at_max_len")
    if _missing(nbytes) or _missing(full) or not full:
        return math.nan, math.nan
    return float(nbytes), 1 - float(nbytes) / float(full)


def asked_ratio(row: pd.Series, asked: list[float]) -> float:
    """The ratio a run stands in: a budget's (1 - budget / max_len), a duo share's (its inverse), else (quant) the
    asked ratio nearest the bytes it removes."""
    from harness.experiment import leaderboard as grid

    L = row.get("max_len")
    if not _missing(row.get("cache_budget")) and row["cache_budget"] and not _missing(L):
        return round(1 - row["cache_budget"] / L, RATIO_DIGITS)
    if row.get("cache") == "duo" and not _missing(L):
        a = min(1.0, (grid.DUO_SINKS + grid.DUO_RECENT) / L)
        return round(1 - (row["cache_retrieval"] * (1 - a) + a), RATIO_DIGITS)
    own = row.get("ratio_held", math.nan)
    return min(asked, key=lambda r: abs(r - own)) if asked and not _missing(own) else own


def _score(positions: dict | None, run_name: str, task: Task, column: str | None = None) -> intervals.Interval | None:
    metric = intervals.METRICS[task.metric]
    if column is not None:
        metric = dataclasses.replace(metric, column=column)
    rows = intervals.rows_of(positions, run_name, metric)
    if rows is None or not len(rows):
        return None
    return metric.clipped(intervals.single(rows, metric.column, metric.stat, unit=metric.unit))


def _cells(iv: intervals.Interval | None, name: str) -> dict:
    if iv is None:
        return {name: math.nan, f"{name}_lo": math.nan, f"{name}_hi": math.nan, f"{name}_n": 0}
    shown = iv.shown
    return {name: iv.estimate, f"{name}_lo": iv.lo if shown else math.nan, f"{name}_hi": iv.hi if shown else math.nan,
            f"{name}_n": iv.n}


def _asked(group: pd.DataFrame) -> list[float]:
    """The ratios a model's runs were asked for: those their budgets say (the leaderboard's defaults if none)."""
    from harness.experiment import leaderboard as grid

    L, budgets = group.get("max_len"), group.get("cache_budget")
    if budgets is None or L is None:
        return list(grid.RATIOS)
    found = {round(1 - b / n, RATIO_DIGITS) for b, n in zip(budgets, L) if not _missing(b) and b and not _missing(n)}
    return sorted(found) or list(grid.RATIOS)


def _run_row(r: pd.Series, asked: list[float], positions: dict | None) -> dict:
    nbytes, ratio = held(r)
    row = dict(model=r["model"], method=method_of(r), ratio=math.nan, ratio_held=ratio, bytes_held=nbytes,
               step_ms=r.get("step_ms_cached_at_max_context", math.nan),
               timed_beside=r.get("concurrent_runs_while_timing", math.nan), cache_label=r.get("cache_label"),
               run_name=r["run_name"], status=r["status"],
               error=None if r["status"] == "ok" or _missing(r.get("error")) else str(r.get("error")))
    row["ratio"] = asked_ratio(pd.Series({**r.to_dict(), "ratio_held": ratio}), asked)
    for task in TASKS:
        row.update(_cells(_score(positions, r["run_name"], task) if r["status"] == "ok" else None, task.name))
    return row


def _full_row(group: pd.DataFrame, positions: dict | None) -> dict:
    """Full attention's row of a model: each retrieval task's fp32 reference, from the first run that has it (every
    run of a model reads the same sequences); text KL 0 (the reference itself)."""
    first = group.iloc[0]
    full = first.get("full_nbytes_at_max_len", math.nan)
    row = dict(model=first["model"], method=FULL, ratio=0.0, ratio_held=0.0, bytes_held=full, step_ms=math.nan,
               timed_beside=math.nan,
               cache_label=FULL, run_name=None, status="ok", error=None)
    for task in TASKS:
        if task.ref_key is None:
            row.update({task.name: 0.0, f"{task.name}_lo": math.nan, f"{task.name}_hi": math.nan,
                        f"{task.name}_n": 0})
            continue
        iv = next((iv for name in group["run_name"] if (iv := _score(positions, name, task, "correct_ref"))), None)
        row.update(_cells(iv, task.name))
    return row


def table(runs: pd.DataFrame, frames: dict | None) -> pd.DataFrame:
    """The leaderboard: a row per model x method x ratio (the runs of experiment=leaderboard, failed ones with their
    status and no scores) and full attention's per model, each task's score with its 95% interval and n
    (``<task>``, ``<task>_lo``, ``<task>_hi``, ``<task>_n``), whether fp32 full attention can do the task on the
    model (``<task>_ref_ok``), the bytes held at max_len and the share of full attention's they remove
    (``ratio_held``), the median cached step at the longest timed context; ordered by model, ratio, method."""
    board = runs[runs["experiment"] == EXPERIMENT] if "experiment" in runs else runs.iloc[:0]
    rows = []
    for model, group in board.groupby("model", sort=True):
        ok = group[group["status"] == "ok"]
        asked = _asked(ok)
        if len(ok):
            rows.append(_full_row(ok, frames))
        rows += [_run_row(r, asked, frames) for _, r in group.iterrows()]
        for row in rows:
            if row["model"] == model:
                for task in TASKS:
                    row[f"{task.name}_ref_ok"] = ref_ok(ok, task)
    out = pd.DataFrame(rows)
    if not len(out):
        return out
    from harness.experiment import leaderboard as grid

    order = {"model": {m: i for i, m in enumerate(sorted(out["model"].drop_duplicates()))},
             "method": {m: i for i, m in enumerate((FULL, *grid.METHODS))}}

    def rank(column: pd.Series) -> pd.Series:  # models by name, methods in the grid's order (others after)
        known = order.get(column.name)
        return column if known is None else column.map(lambda v: (known.get(v, len(known)), str(v)))

    return out.sort_values(["model", "ratio", "method"], key=rank, kind="stable").reset_index(drop=True)


def ref_ok(ok: pd.DataFrame, task: Task) -> bool:
    """Whether fp32 full attention does ``task`` on the runs' model (every run that says so says yes)."""
    if task.ref_ok is None or task.ref_ok not in ok:
        return True
    said = ok[task.ref_ok].dropna()
    return bool(said.astype(bool).all()) if len(said) else True


def marks(board: pd.DataFrame) -> pd.DataFrame:
    """Per row and task: "best" (the best score of its model and ratio), "tie" (its interval overlaps the best's:
    the data cannot order them) or "" (full attention's row, a failed run, a task full attention cannot do)."""
    out = pd.DataFrame("", index=board.index, columns=[t.name for t in TASKS])
    rivals = board[(board["method"] != FULL) & (board["status"] == "ok")]
    for _, group in rivals.groupby(["model", "ratio"], sort=False):
        for task in TASKS:
            scored = group[group[task.name].notna()]
            if not len(scored) or not bool(scored[f"{task.name}_ref_ok"].iloc[0]):
                continue
            best = scored[task.name].idxmin() if task.better == "low" else scored[task.name].idxmax()
            b_lo, b_hi = _span(scored.loc[best], task.name)
            for i, r in scored.iterrows():
                lo, hi = _span(r, task.name)
                out.loc[i, task.name] = "best" if i == best else ("tie" if lo <= b_hi and hi >= b_lo else "")
    return out


def _span(row: pd.Series, name: str) -> tuple[float, float]:
    """A score's interval, or the score itself where it has none (too few units, or no width)."""
    lo, hi = row[f"{name}_lo"], row[f"{name}_hi"]
    return (row[name], row[name]) if _missing(lo) or _missing(hi) else (lo, hi)


def _cell(row: pd.Series, task: Task, mark: str) -> str:
    value = row[task.name]
    if row["status"] != "ok":
        return str(row["status"])
    if _missing(value):
        return "—"
    fmt = ".3f"
    text = f"{value:{fmt}}" + ("" if _missing(row[f"{task.name}_lo"]) else
                               f" [{row[f'{task.name}_lo']:{fmt}}, {row[f'{task.name}_hi']:{fmt}}]")
    return f"**{text}**" if mark == "best" else f"**{text}** =" if mark == "tie" else text


COLUMNS = ("ratio", "method", "removed", "KV bytes", "step ms")


def _beside(row: pd.Series) -> bool:
    """The run's steps were timed while other kvlab runs measured on the machine (its step time shares cores)."""
    n = row.get("timed_beside")
    return not _missing(n) and n > 0


def markdown(board: pd.DataFrame) -> str:
    """The leaderboard as Markdown: a table per model, rows by ratio then method, each task's score with its 95%
    interval; the best of each column at a ratio in bold, ties (intervals overlapping the best's) bold with =."""
    lines = ["# Compression leaderboard", "",
             "Ratio: the fraction of the context's K/V bytes a method removes (asked; `removed`: what its bytes at "
             "the context remove). Scores: mean over the task's units with a 95% t-interval (n units: texts, "
             "sequences, probes). **Bold**: the best of its column at that ratio; **bold** =: its interval overlaps "
             "the best's (a tie). Text KL is against fp32 full attention (lower is better); copy, niah and mqar are "
             "top-1 accuracy on the answer ids (higher is better). Step: the median cached decode step at the longest "
             "timed context, in ms (*: timed while other kvlab runs measured on the machine: not comparable).", ""]
    if not len(board):
        return "\n".join(lines + ["No run of experiment=leaderboard finished.", ""])
    marked = marks(board)
    for model, group in board.groupby("model", sort=False):
        lines += [f"## {model}", ""]
        units = ", ".join(f"{t.name} n = {int(group[f'{t.name}_n'].max())}" for t in TASKS
                          if f"{t.name}_n" in group and group[f"{t.name}_n"].max() > 0)
        cannot = [t.name for t in TASKS if not bool(group[f"{t.name}_ref_ok"].iloc[0])]
        lines += [f"Units: {units}." + (f" fp32 full attention cannot do {', '.join(cannot)} on this model: those "
                                        "columns measure the model, not the cache (no best marked)." if cannot
                                        else ""), ""]
        lines += ["| " + " | ".join(COLUMNS + tuple(t.label for t in TASKS)) + " |",
                  "|" + "---|" * (len(COLUMNS) + len(TASKS))]
        for i, r in group.iterrows():
            cells = [f"{r['ratio']:g}", r["method"], "—" if _missing(r["ratio_held"]) else f"{r['ratio_held']:.3f}",
                     "—" if _missing(r["bytes_held"]) else f"{r['bytes_held']:,.0f}",
                     "—" if _missing(r["step_ms"]) else f"{r['step_ms']:.2f}" + ("*" if _beside(r) else "")]
            cells += [_cell(r, t, marked.loc[i, t.name]) for t in TASKS]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        failed = group[group["status"] != "ok"]
        if len(failed):  # what a run that could not be made says: the reason is a finding too
            lines += [f"Not run ({len(failed)}):", ""]
            lines += [f"- {r['method']} at {r['ratio']:g}: {r['status']}: {r.get('error') or 'no error recorded'}"
                      for _, r in failed.iterrows()]
            lines.append("")
    return "\n".join(lines)


def task_plot(board: pd.DataFrame, task: str):
    """One task's score against the compression ratio (the bytes each run removes), a line per method with its 95%
    interval as a band, full attention as a dashed line, a panel per model: the chart of kvpress's leaderboard."""
    from harness.analysis.plots import plt

    t = next(x for x in TASKS if x.name == task)
    models = list(board["model"].drop_duplicates())
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.4), squeeze=False, sharey=True)
    methods = [m for m in board["method"].drop_duplicates() if m != FULL]
    palette = plt.get_cmap("tab20").colors
    colours = dict(zip(methods, palette[0::2] + palette[1::2]))  # the strong ten first, then their light twins
    for ax, model in zip(axes[0], models):
        g = board[(board["model"] == model) & (board["status"] == "ok")]
        for method in methods:
            m = g[(g["method"] == method) & g[task].notna()].sort_values("ratio_held")
            if not len(m):
                continue
            x = m["ratio_held"].where(m["ratio_held"].notna(), m["ratio"])
            alone = len(m) == 1  # a quant method: one point, at the ratio its bits fix
            ax.plot(x, m[task], marker="D" if alone else "o", ms=7 if alone else 4, lw=1.4, color=colours[method],
                    label=method)
            if m[f"{task}_lo"].notna().any():
                ax.fill_between(x, m[f"{task}_lo"], m[f"{task}_hi"], color=colours[method], alpha=0.12, lw=0)
        full = g[g["method"] == FULL]
        if len(full) and full[task].notna().any() and t.ref_key is not None:
            ax.axhline(float(full[task].iloc[0]), color="k", ls="--", lw=1, label=FULL)
        ok = bool(g[f"{task}_ref_ok"].iloc[0]) if len(g) else True
        ax.set_title(f"{model}" + ("" if ok else " (fp32 full attention cannot do this task)"))
        ax.set_xlabel("compression ratio (K/V bytes removed)")
        if t.better == "low" and (g[task] > 0).any():
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(t.label)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle(f"Leaderboard: {t.label} against the compression ratio")
    fig.tight_layout()
    return fig


def html_section(board: pd.DataFrame) -> str:
    """The leaderboard for report.html: ``markdown``'s tables as HTML, the marks in bold."""
    import html
    import re

    def bold(text: str) -> str:
        return re.sub(r"[*][*](.+?)[*][*]", r"<b>\1</b>", html.escape(text))

    parts, in_table = [], False
    for line in markdown(board).splitlines():
        if line.startswith("|---"):
            continue
        if line.startswith("| "):
            tag = "td" if in_table else "th"
            if not in_table:
                parts.append("<div style='overflow-x:auto'><table class='t'>")
                in_table = True
            parts.append("<tr>" + "".join(f"<{tag}>{bold(c.strip())}</{tag}>" for c in line.strip("|").split(" | "))
                         + "</tr>")
            continue
        if in_table:
            parts.append("</table></div>")
            in_table = False
        if line.startswith("## "):
            parts.append(f"<h3>{html.escape(line[3:])}</h3>")
        elif line.startswith("# "):
            parts.append(f"<h2>{html.escape(line[2:])}</h2>")
        elif line.strip():
            parts.append(f"<p>{bold(line)}</p>")
    return "".join(parts) + ("</table></div>" if in_table else "")

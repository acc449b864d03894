"""Every figure of the sweep report, declared in one place.

    from harness.analysis.figures import FIGURES     # Figure(stem, table, draw, caption, by, when), in report order

A figure names the measurements whose keys or table it reads (``by``: one, or several for the figures that set
one measurement against others: budget, pareto), the table it is drawn from (``"runs"``: one row per run, or a
run table's name), its drawing function (``harness.analysis.plots``; ``harness.analysis.depth`` for retrieval by
depth) and its caption. The measurements themselves declare keys and tables only; what is drawn from them lives
here, beside the code that draws it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd

import functools

from harness.analysis import depth, leaderboard, plots, server, stream


@dataclass(frozen=True)
class Figure:
    """A figure of the sweep report: ``stem`` (its PNG's name), the table it is drawn from (``"runs"``: one row per
    run), ``draw`` (DataFrame -> matplotlib Figure), its caption, the measurements it reads (``by``); drawn when
    its table has ok rows and ``when`` (if given) says so; a figure of the runs table without a ``when`` also needs
    its first measurement to have run in one of them."""

    stem: str
    table: str
    draw: Callable[[pd.DataFrame], Any]
    caption: str
    by: tuple[str, ...]
    when: Callable[[pd.DataFrame], bool] | None = None


def _served(runs: pd.DataFrame) -> bool:
    return "tokens_per_s" in runs and runs["tokens_per_s"].notna().any()


def _board(task: str) -> Callable[[pd.DataFrame], bool]:
    return lambda board: task in board and board[task].notna().any()


def _retrieved(runs: pd.DataFrame) -> bool:
    return "retrieval_acc" in runs and runs["retrieval_acc"].notna().any()


LEADERBOARD_BY = {"text": "text_drift", "copy": "retrieval", "niah": "niah", "mqar": "mqar"}

FIGURES: tuple[Figure, ...] = tuple(
    Figure(f"leaderboard_{t.name}", "leaderboard", functools.partial(leaderboard.task_plot, task=t.name),
           f"Leaderboard, {t.name}: {t.label} against the compression ratio (the fraction of the context's K/V bytes "
           "removed), a line per method, bands: 95% t-intervals over the task's units; dashed: fp32 full attention "
           "(experiment=leaderboard; leaderboard.md).", by=(LEADERBOARD_BY[t.name],), when=_board(t.name))
    for t in leaderboard.TASKS) + (
    Figure("equivalence", "runs", plots.equivalence_grid,
           "Cached vs the kind's uncached reference: max |Δlogit| per model × cache/dtype, coloured against the "
           "equivalence tolerance (green within it, red over it; grey: lossy or reduced precision, not held to it); "
           "✓ = identical greedy tokens.", by=("equivalence",)),
    Figure("drift", "drift", plots.drift_plot,
           "Drift vs fp32 full attention per decode step: KL, max |Δlogit|, top-1 agreement.",
           by=("generation_drift",), when=plots.drift_measured),
    Figure("layers", "layers", plots.layers_plot,
           "Relative error of the K and V attention read, per layer, against fp32.", by=("text_drift",)),
    Figure("budget", "runs", plots.budget_plot,
           "Quality against budget: text ΔNLL against fp32 full attention and retrieval, per kind, at each budget "
           "(kinds swept over cache.budget); bars: 95% intervals over texts (ΔNLL) or sequences (retrieval).",
           by=("text_drift", "retrieval"),
           when=lambda runs: not plots.budget_quality(runs).empty),
    Figure("pareto", "runs", plots.pareto_plot,
           "Quality against cost, a point per setting: text ΔNLL, KL p99 and retrieval against the KV bytes held and "
           "the step at the longest context; the line joins the frontier; bars: 95% intervals over texts or "
           "sequences. A cost all settings share is drawn against the setting that differs instead.",
           by=("text_drift", "generation_drift", "retrieval", "memory", "step_time"),
           when=lambda runs: not plots.pareto_points(runs).empty),
    Figure("retrieval", "runs", plots.retrieval_plot,
           "Retrieval: copy accuracy on random sequences shown twice, through each cache vs fp32 full attention; "
           "whiskers: 95% intervals over the sequences.",
           by=("retrieval",), when=_retrieved),
    Figure("retrieval_depth", "retrieval_depth", depth.depth_plot,
           "Retrieval by depth: top-1 accuracy on spans copied from each depth of a context of random tokens (x: "
           "where the source sits, 0% the start; y: the context's length), a heatmap per setting beside fp32 full "
           "attention's. A window of W slots loses the sources more than W tokens back; the spans are asked newest "
           "first, so the oldest are also asked last.", by=("retrieval",)),
    Figure("stream", "text_positions", stream.stream_plot,
           "Streaming past the trained length (StreamingLLM's Figure 3): text NLL against position through a window "
           "that re-positions its keys within the cache (cache.positions=cache), per number of sinks, and dense "
           "attention at absolute positions (dashed; past the positions the model was trained for it degrades). "
           "Mean over 128-token buckets and the texts.", by=("text_drift",), when=stream.streamed),
    Figure("cache_bytes", "runs", plots.cache_bytes_plot,
           "Cache bytes: measured vs the formula, and bytes per cached token.", by=("memory",)),
    Figure("memory", "memory", plots.memory_plot,
           "Cache bytes held vs tokens in the sequence: the kind's formula (line), measured (dots).", by=("memory",)),
    Figure("heads", "heads", plots.heads_plot,
           "Slots per layer and K/V head after the generation, for each run that spends them unevenly "
           "(cache.allocation pyramid or ada, cache=duo; R: a retrieval head kept whole).", by=("memory",),
           when=lambda heads: not plots.spent_unevenly(heads).empty),
    Figure("step_time", "steps", plots.step_time_plot,
           "Decode-step time vs context length: cached (by cache) vs uncached (full recompute).", by=("step_time",)),
    Figure("speedup", "steps", plots.speedup_plot,
           "Speedup of a cached decode step over the uncached one (uncached / cached).", by=("step_time",)),
    Figure("cost_model", "steps", plots.cost_plot,
           "Cost model: cached step time vs context, measured (dots) and fitted per run (lines).", by=("step_time",)),
    Figure("batches", "batches", plots.batch_plot,
           "Decode throughput vs batch size, and the K/V bytes a step reads against the weights.", by=("batches",)),
    Figure("server_rate", "runs", server.rate_plot,
           "Continuous batching under one K/V budget (experiment=serving): output tokens/s and the p99 latencies "
           "against the request rate, a line per cache kind; bars: 95% t-intervals over the workload seeds. As in "
           "vLLM's Figure 12, a kind that fits more requests in the budget keeps its latency down to a higher rate.",
           by=("server",), when=server.served),
    Figure("server_memory", "runs", server.memory_plot,
           "What the K/V budget holds, per kind, at the heaviest load: the share of the bytes held that hold tokens "
           "(over time), and the most bytes held and holding tokens (vLLM's Figure 2: a reserving kind holds slots "
           "for tokens a request may never make).", by=("server",), when=server.served),
    Figure("server_running", "timeline", server.running_plot,
           "Requests running at once over the server's time, a line per cache kind, a panel per request rate "
           "(seed 0): the budget caps how many run together.", by=("server",)),
    Figure("serving", "runs", plots.serving_plot,
           "A served batch per run: generated tokens/s vs batch size, and KV waste (held slots holding no token).",
           by=("serving",), when=_served),
)


def captions() -> dict[str, str]:
    """Figure stem -> its caption."""
    return {f.stem: f.caption for f in FIGURES}


def figures_for(runs: pd.DataFrame, frames: dict[str, pd.DataFrame | None]) -> dict:
    """stem -> (figure function, its table) for every figure whose table (``runs`` or one of ``frames``) has ok
    rows; a figure of the runs table without a ``when`` also needs its measurement to have run in one of them."""
    from harness.measurements import MEASUREMENTS

    out = {}
    for fig in FIGURES:
        df = runs if fig.table == "runs" else frames.get(fig.table)
        if df is None or plots._ok(df).empty or (fig.when is not None and not fig.when(df)):
            continue
        if fig.table == "runs" and fig.when is None and not plots._measured(plots._ok(df),
                                                                           MEASUREMENTS[fig.by[0]].keys()):
            continue  # a sweep that left this figure's measurement out (a figure with a ``when`` decides itself)
        out[fig.stem] = (fig.draw, df)
    return out


def figure_makers(runs: pd.DataFrame, steps: pd.DataFrame, drift: pd.DataFrame,
                  memory: pd.DataFrame | None = None, layers: pd.DataFrame | None = None,
                  batches: pd.DataFrame | None = None) -> dict:
    """stem -> (figure function, its table), for every figure whose table has ok rows (``figures_for`` with the
    seed's five tables)."""
    return figures_for(runs, dict(steps=steps, drift=drift, memory=memory, layers=layers, batches=batches))


def all_figures(runs: pd.DataFrame, steps: pd.DataFrame, drift: pd.DataFrame,
                memory: pd.DataFrame | None = None, layers: pd.DataFrame | None = None,
                batches: pd.DataFrame | None = None) -> dict:
    """Every figure keyed by file stem. A figure whose input table has no ok rows is skipped (absent from the dict).

    "drift" is still made when none of its ok rows drifts: it then says so.
    """
    return {stem: fn(df) for stem, (fn, df) in figure_makers(runs, steps, drift, memory, layers, batches).items()}

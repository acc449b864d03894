"""Retrieval by depth: the needle-in-a-haystack heatmap of the retrieval measurement's depth view.

The depth view (``harness.measurements.retrieval``, ``retrieval_depth.csv``) asks, after a context of random tokens,
for short spans copied from each depth of it; every copied token is a row with its context length, its source's
depth bucket and whether the run's top-1 (``correct``) and fp32 full attention's (``correct_ref``) are that token.

    depth_cells(depth)   the numbers drawn: one row per (panel, context length, depth bucket) with the tokens
                         scored and their accuracy; a panel per setting (model, cache label, dtype) from ``correct``,
                         and per model one "fp32 full attention" panel from ``correct_ref`` (what the model copies
                         with nothing lost; first; a token that several runs scored, the same sequence, counts once)
    depth_plot(depth)    those cells as heatmaps, a panel each: x the depth bucket (0% = the start of the context,
                         100% = its end), y the context length, colour the accuracy on a fixed 0 .. 1 scale, each
                         cell annotated (— where nothing was scored). A window of W slots loses the cells whose
                         sources lie more than W tokens back: the older depths, more of them the longer the context.

Only the rows of ok runs are drawn; several runs of one setting pool their tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from harness.analysis.plots import MODEL_ORDER, _cache_levels, _levels, _message_figure, _ok, _with_prec, plt

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REFERENCE = "fp32 full attention"  # the panel drawn from correct_ref
CELL_COLUMNS = ["model", "panel", "buckets", "context_len", "depth_bucket", "tokens", "accuracy"]


def _panels(df: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame, str]]:
    """(model, panel title, its rows, the column scored) in drawing order: per model its reference, then its
    settings ordered by kind name."""
    df, precs = _with_prec(df)
    models = _levels(df["model"], MODEL_ORDER)
    out = []
    for model in models:
        sub = df[df["model"] == model]
        name = lambda label: f"{model} · {label}" if len(models) > 1 else label  # noqa: E731
        same = [c for c in ("seq_id", "context_len", "position") if c in sub]  # a token fp32 scored in several runs
        out.append((model, name(REFERENCE), sub.drop_duplicates(same), "correct_ref"))
        for cache in _cache_levels(sub["cache"]):
            for prec in precs:
                rows = sub[(sub["cache"] == cache) & (sub["prec"] == prec)]
                if len(rows):
                    out.append((model, name(f"{cache} · {prec}" if len(precs) > 1 else cache), rows, "correct"))
    return out


def depth_cells(depth: pd.DataFrame) -> pd.DataFrame:
    """Accuracy per (panel, context length, depth bucket) over the ok runs' rows: ``tokens`` scored, ``accuracy``
    their mean (``CELL_COLUMNS``); a panel's cells are every (length, bucket) it scored."""
    df = _ok(depth)
    if df.empty:
        return pd.DataFrame(columns=CELL_COLUMNS)
    parts = []
    for model, title, rows, col in _panels(df):
        g = rows.groupby(["buckets", "context_len", "depth_bucket"])[col].agg(["size", "mean"]).reset_index()
        parts.append(g.rename(columns={"size": "tokens", "mean": "accuracy"}).assign(model=model, panel=title))
    return pd.concat(parts, ignore_index=True)[CELL_COLUMNS]


def _bucket_labels(buckets: int) -> list[str]:
    edges = [round(100 * b / buckets) for b in range(buckets + 1)]
    return [f"{lo}–{hi}%" for lo, hi in zip(edges, edges[1:])]


def _heatmap(ax, cells: pd.DataFrame, lengths: list[int], buckets: int, cmap) -> None:
    """One panel: a row per context length (the shortest at the bottom), a column per depth bucket."""
    grid = np.full((len(lengths), buckets), np.nan)
    for r in cells.itertuples():
        grid[lengths.index(r.context_len), int(r.depth_bucket)] = r.accuracy
    ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, origin="lower", aspect="auto")
    for i in range(len(lengths)):
        for j in range(buckets):
            v = grid[i, j]
            ax.text(j, i, "—" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8,
                    color="black" if np.isnan(v) or 0.25 < v < 0.8 else "white")
    ax.set_xticks(range(buckets), _bucket_labels(buckets), rotation=45 if buckets > 5 else 0,
                  ha="right" if buckets > 5 else "center", fontsize=8)
    ax.set_yticks(range(len(lengths)), [str(L) for L in lengths], fontsize=8)


def depth_plot(depth: pd.DataFrame) -> Figure:
    """Top-1 accuracy by depth (x) and context length (y), a heatmap per setting and one of fp32 full attention
    per model; from ``depth_cells``."""
    cells = depth_cells(depth)
    if cells.empty:
        return _message_figure("no ok run measured retrieval by depth (retrieval_depth.csv has no rows)")
    keys = list(dict.fromkeys(zip(cells["panel"], cells["buckets"])))
    several = cells["buckets"].nunique() > 1
    lengths = sorted(cells["context_len"].unique().tolist())
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    width = max(3.0, 0.5 * cells["buckets"].max() + 1.0)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols + 1.0, (0.4 * len(lengths) + 1.5) * nrows),
                             squeeze=False, layout="constrained")
    cmap = plt.colormaps["RdYlGn"].with_extremes(bad="#eeeeee")  # a cell not asked
    for ax, (panel, buckets) in zip(axes.flat, keys):
        sub = cells[(cells["panel"] == panel) & (cells["buckets"] == buckets)]
        _heatmap(ax, sub, lengths, int(buckets), cmap)
        scored = int(sub["tokens"].sum())
        acc = float((sub["accuracy"] * sub["tokens"]).sum() / scored)
        ax.set_title(f"{panel}{f' ({buckets} buckets)' if several else ''}\n{acc:.2f} on {scored:,} copied tokens",
                     fontsize=9)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("context (tokens)", fontsize=9)
    for ax in axes.flat[max(0, len(keys) - ncols):len(keys)]:  # the lowest panel of each column
        ax.set_xlabel("depth of the source in the context\n(0% = its start, 100% = its end)", fontsize=9)
    mappable = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1))
    fig.colorbar(mappable, ax=axes, shrink=0.9, label="top-1 accuracy on the copied tokens")
    gaps = len(cells) < sum(len(lengths) * int(b) for _, b in keys)  # a setting not asked at every length
    fig.suptitle("Retrieval by depth: copy accuracy by where the source sits in the context"
                 + (" (—: not asked at that length)" if gaps else ""), fontsize=11)
    return fig

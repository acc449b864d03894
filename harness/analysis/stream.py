"""The stream figure: text NLL along a stream longer than the model was trained for, through a window that
re-positions its keys (``cache=window cache.positions=cache``: StreamingLLM), per number of sinks, beside dense
attention at absolute positions (text_drift's fp32 reference: ``nll_fp32``). StreamingLLM's Figure 3, on kvlab's
models (``experiment=streaming``).

    stream_curves(text_positions)   the numbers drawn: one row per (model, series, position bucket) with the mean NLL
                                    of the tokens there (every text's, pooled) and how many were scored; a series per
                                    re-positioned window setting and one "dense attention" series per model (its
                                    fp32 reference, which keeps every token at its absolute position; a token that
                                    several runs scored counts once)
    stream_plot(text_positions)     those curves, a panel per model: NLL against position
    streamed(text_positions)        whether any ok run streamed through a re-positioned window (the figure's ``when``)

Only the rows of ok runs are drawn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from harness.analysis.plots import MODEL_ORDER, _levels, _message_figure, _ok, plt

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DENSE = "dense attention (absolute positions)"  # the series drawn from nll_fp32
REPOSITIONED = "@cache"  # the window kind's label mark for keys re-positioned within the cache
BUCKET = 128  # positions pooled into one point
CURVE_COLUMNS = ["model", "series", "position", "tokens", "nll"]


def _repositioned(df: pd.DataFrame) -> pd.DataFrame:
    df = _ok(df)
    if df.empty or "cache" not in df:
        return df.iloc[:0]
    return df[df["cache"].astype(str).str.endswith(REPOSITIONED)]


def streamed(text_positions: pd.DataFrame) -> bool:
    return not _repositioned(text_positions).empty


def stream_curves(text_positions: pd.DataFrame, bucket: int = BUCKET) -> pd.DataFrame:
    """Mean NLL per (model, series, bucket of ``bucket`` positions); ``position``: the bucket's first position."""
    df = _repositioned(text_positions)
    if df.empty:
        return pd.DataFrame(columns=CURVE_COLUMNS)
    parts = []
    for model in _levels(df["model"], MODEL_ORDER):
        sub = df[df["model"] == model]
        dense = sub.drop_duplicates(["text_id", "position"] if "text_id" in sub else ["text", "position"])
        dense, sub = (d.assign(position=(d["position"] // bucket) * bucket) for d in (dense, sub))
        parts.append(dense.groupby("position")["nll_fp32"].agg(["size", "mean"]).reset_index().assign(
            model=model, series=DENSE))
        for label, rows in sub.groupby("cache", sort=True):
            parts.append(rows.groupby("position")["nll"].agg(["size", "mean"]).reset_index().assign(
                model=model, series=label))
    out = pd.concat(parts, ignore_index=True).rename(columns={"size": "tokens", "mean": "nll"})
    return out[CURVE_COLUMNS]


def stream_plot(text_positions: pd.DataFrame) -> Figure:
    """NLL against position, a line per series, a panel per model; the dense line dashed."""
    curves = stream_curves(text_positions)
    if curves.empty:
        return _message_figure("no ok run streamed through a re-positioned window (cache.positions=cache)")
    models = list(dict.fromkeys(curves["model"]))
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 4.2), squeeze=False, layout="constrained")
    for ax, model in zip(axes[0], models):
        sub = curves[curves["model"] == model]
        for series, rows in sub.groupby("series", sort=False):
            dense = series == DENSE
            ax.plot(rows["position"] + BUCKET / 2, rows["nll"], label=series, lw=1.4,
                    ls="--" if dense else "-", color="black" if dense else None)
        ax.set_title(model, fontsize=10)
        ax.set_xlabel(f"position in the stream (tokens; mean over {BUCKET}-token buckets and texts)", fontsize=9)
        ax.set_ylabel("NLL (nats/token)", fontsize=9)
        finite = sub["nll"][sub["series"] != DENSE]
        top = max(float(finite.max()) * 1.3, float(sub["nll"].min()) + 1.0)
        ax.set_ylim(bottom=max(0.0, float(sub["nll"].min()) - 0.5), top=top)  # dense past its length runs off
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Streaming: NLL along a stream through a re-positioned window (sinks + recent tokens) vs dense "
                 "attention", fontsize=11)
    return fig

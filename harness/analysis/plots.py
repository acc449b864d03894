"""Figures for the KV-cache experiments, drawn from the tidy results tables (never from files).

Inputs are five DataFrames: ``runs`` (one row per run), ``steps`` (decode-step timing per run, context length and
mode), ``drift`` (per decode step: equivalence, and drift against fp32 full attention), ``memory`` (cache bytes vs
tokens) and ``layers`` (K/V relative error per layer). Rows whose ``status`` is not "ok" are dropped before anything
is drawn. A run's cache is shown by its
``cache_label`` (kind + options: "quant k4/v8 g32", "window S4+W256"), so two settings of one kind are two series;
kinds are ordered as the registry lists them. Every function returns a matplotlib Figure; nothing is shown or saved.

    step_time_plot(steps)     time of ONE decode step (ms, log) against context length (tokens, log2): a line per
                              cache ("cached (prealloc)", "cached (quant k4/v4 g32)", ...) plus the "uncached" full
                              forward, which every run measures and is therefore averaged per (model, dtype,
                              context). The band is the p10-p90 spread. Columns are models, rows dtypes.
    speedup_plot(steps)       uncached / cached step time against context length: colour = cache, line style
                              = dtype, one panel per model. The dotted line at 1x is break-even.
    cost_plot(steps)          cached step time vs context: the measured medians and each run's fitted cost model
                              a + b·T (the weights' fixed cost, and what each cached token adds).
    cache_bytes_plot(runs)    (a) measured cache bytes next to the formula's prediction, one bar pair per run
                              (a red ✗ over a run where they differ); (b) KV bytes per cached token by model,
                              cache and dtype (caches that cost the same share a bar); legends below the panels.
    memory_plot(memory)       cache bytes held vs tokens in the sequence: the kind's formula out to max_len as a
                              line, the bytes measured during generation as dots; concat grows, prealloc is flat
                              at max_len, window flat at sinks + window, quant a fraction of prealloc.
    drift_plot(drift)         how far logits drift from fp32 full attention per decode step (reduced precision,
                              lossy or windowed caches): KL(fp32 ‖ run), max |Δlogit| and top-1 agreement;
                              colour = cache, line style = dtype, one line per run, one row of panels per model.
                              Runs without drift are left out; with none left the figure says why: nothing
                              drifts (all fp32 full attention), or generation_drift was not measured.
    serving_plot(runs)        each run's served batch: generated tokens/s against batch size, and KV waste (held
                              slots that hold no token): colour = cache, line style = uniform / ragged prompts.
    equivalence_grid(runs)    cached-vs-reference check as a heatmap: rows = model, columns = cache/dtype, colour =
                              max |Δlogit| on a log scale fixed on the equivalence tolerance (green within it, red
                              at or over it; grey: lossy kinds and reduced precision, not held to it), each cell
                              annotated with the value, ✓/✗ for whether the generated tokens were identical, and
                              "lossy" for lossy kinds (whose difference is their error). Several runs in one cell
                              show the worst of them.
    layers_plot(layers)       relative error of K and of V per layer against fp32, a line per run, with the
                              tolerance from which a layer counts as disagreeing.
    batch_plot(batches)       decode tokens/s against batch size, and the K/V bytes a step reads against the weights
                              (flat): where batching stops paying.
    all_figures(runs, steps, drift, memory, layers, batches)   all of the above keyed by file stem; a figure whose input
                              table has no ok rows is left out of the dict.

When runs from more than one device are mixed, the dtype label becomes "dtype · device" wherever timings or drift
are grouped by dtype (a CPU and a GPU step time must not be averaged together). Every axis of bytes reads in B / kB
/ MB / GB (decimal); every figure that compares settings on quality (retrieval, budget, pareto) draws each run's
95% interval over its texts or sequences (``<key>_lo`` / ``<key>_hi``, from ``intervals.with_intervals``) as an
error bar where the runs table carries one.
"""

from __future__ import annotations

import importlib
import itertools
import math
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from harness.measurements import KEYS, declared_names
from harness.common.stats import LAYER_TOL, cost_model

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class _OnFirstUse:
    """A module imported when it is first used, with matplotlib on its file-only backend: a run that draws nothing
    (every run but a sweep's report) does not pay the second matplotlib and seaborn take to import."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if "_module" not in self.__dict__:
            importlib.import_module("matplotlib").use("Agg")  # figures are saved, never shown
            self.__dict__["_module"] = importlib.import_module(self._name)
        return getattr(self.__dict__["_module"], attr)


plt = _OnFirstUse("matplotlib.pyplot")
sns = _OnFirstUse("seaborn")
_colors = _OnFirstUse("matplotlib.colors")
_ticker = _OnFirstUse("matplotlib.ticker")

# known levels in a sensible order; anything unknown goes after them, sorted
MODEL_ORDER = ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]


DTYPE_ORDER = ["fp32", "fp16", "bf16"]


@lru_cache(maxsize=1)
def _palette() -> list:
    return sns.color_palette("tab10")


UNCACHED_STYLE = ((0.4, 0.4, 0.4), "--")
DASHES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D"]


def drift_metrics() -> list[tuple[str, str]]:
    """drift_plot's panels: (column, axis label)."""
    return [(KEYS.drift_kl, "KL(fp32 ‖ run) (nats)"), (KEYS.drift_max_abs, "max |Δlogit| (logit units)"),
            (KEYS.drift_top1_agreement, "top-1 agreement (fraction)")]


# -----------------------------------------------------------------------------
# helpers


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    """Only the rows of successful runs, with ``cache`` holding the run's cache label (kind + options) where the
    table has one, so two settings of one kind are two series."""
    df = df[df[KEYS.status] == "ok"] if KEYS.status in df else df
    if KEYS.cache_label in df and KEYS.cache in df:
        df = df.assign(cache=df[KEYS.cache_label].fillna(df[KEYS.cache]))
    return df


def _measured(df: pd.DataFrame, keys: list[str]) -> bool:
    """Some row has a value for one of ``keys`` (a measurement's results)."""
    present = [k for k in keys if k in df]
    return bool(present) and bool(df[present].notna().any().any())


def _levels(values, known: list[str]) -> list[str]:
    present = set(values.dropna())
    return [v for v in known if v in present] + sorted(present - set(known))


def _cache_levels(values) -> list[str]:
    """Cache labels by their kinds' names, then by label (a kind's runs are labelled "<kind> <options>")."""
    return sorted(set(values.dropna()), key=lambda label: (label.split(" ")[0].split("(")[0], label))


def _cache_color(levels: list[str], cache: str):
    return _palette()[levels.index(cache) % len(_palette())] if cache in levels else "k"


def _with_prec(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Adds 'prec': the dtype, or "dtype · device" when several devices are mixed. Returns the frame and its levels."""
    df = df.copy()
    df["prec"] = df[KEYS.dtype]
    if KEYS.device in df and df[KEYS.device].nunique() > 1:
        df["prec"] = df[KEYS.dtype] + " · " + df[KEYS.device]
    order = df.assign(r=df[KEYS.dtype].map({d: i for i, d in enumerate(DTYPE_ORDER)}).fillna(len(DTYPE_ORDER)))
    levels = order.sort_values(["r", "prec"])["prec"].drop_duplicates().tolist()
    return df, levels


def _levels_of(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str], list[str], list[str]]:
    """What every per-model figure starts from: the frame with 'prec', and the precision, model and cache levels."""
    df, precs = _with_prec(df)
    return df, precs, _levels(df[KEYS.model], MODEL_ORDER), _cache_levels(df[KEYS.cache])


def _line(ax, data: pd.DataFrame, x: str, y: str, label: str, **kw) -> None:
    """One labelled seaborn line (seaborn leaves its lines unlabelled; the label lets a legend and a reader find it)."""
    sns.lineplot(data=data, x=x, y=y, errorbar=None, legend=False, ax=ax, **kw)
    ax.get_lines()[-1].set_label(label)


def _log2_x(ax, ticks) -> None:
    """Log2 x axis with the measured context lengths as plain-number ticks."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(ticks)))
    ax.xaxis.set_major_formatter(_ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(_ticker.NullLocator())


def _log_y_if_decades(ax, values) -> None:
    """Log y when all values are positive and span at least two decades."""
    v = np.asarray(pd.Series(values).dropna(), dtype=float)
    if v.size and (v > 0).all() and v.max() / v.min() >= 100:
        ax.set_yscale("log")


def _fig_legend(fig: Figure, axes) -> None:
    """One legend for the whole figure, each label once."""
    seen = {}
    for ax in np.ravel(axes):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if seen:
        fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center", ncol=min(4, len(seen)),
                   frameon=False)


def human_bytes(n) -> str:
    """A byte count in decimal units to three significant figures: 393216 -> "393 kB", 75497472 -> "75.5 MB",
    512 -> "512 B" (what every axis of bytes shows: raw integers of six or more digits do not read)."""
    n = float(n)
    if not np.isfinite(n):
        return ""
    units = ("B", "kB", "MB", "GB", "TB")
    i = 0
    while abs(n) >= 999.5 and i < len(units) - 1:  # 999.6 kB rounds to "1e+03 kB": call it 1 MB
        n, i = n / 1000, i + 1
    return f"{n:.3g} {units[i]}"


def _bytes_axis(ax, which: str = "y") -> None:
    """Ticks of bytes read as B / kB / MB / GB; on a log axis at the decades only (1 kB, 10 kB, ...), unlabelled
    minor ticks between. Call after the axis's scale is set (setting a scale resets its formatters)."""
    axis = ax.yaxis if which == "y" else ax.xaxis
    axis.set_major_formatter(_ticker.FuncFormatter(lambda v, _pos: human_bytes(v)))
    if axis.get_scale() == "log":
        axis.set_major_locator(_ticker.LogLocator(base=10))
        axis.set_minor_formatter(_ticker.NullFormatter())


def interval_units() -> dict[str, str]:
    """Each quality figure that carries an interval, and what its interval resamples (``intervals.RUN_KEYS``)."""
    return {KEYS.drift_kl: "texts", KEYS.drift_kl_p99: "texts", KEYS.drift_delta_nll: "texts",
            KEYS.retrieval_acc: "sequences"}


def _yerr(df: pd.DataFrame, key: str):
    """The 95% interval of ``key`` around each row's value as matplotlib's ``yerr`` (a row of lengths below, a row
    above; NaN where a run has none, which draws no bar), or None where the table carries no interval for it (an
    older sweep: no ``<key>_lo`` / ``<key>_hi``, or all NaN)."""
    lo, hi = f"{key}_lo", f"{key}_hi"
    if lo not in df or hi not in df or not df[[lo, hi]].notna().any().any():
        return None
    y = df[key].to_numpy(dtype=float)
    # a percentile interval need not hold the estimate on every resampling: a bar never has a negative length
    return np.vstack([np.clip(y - df[lo].to_numpy(dtype=float), 0, None),
                      np.clip(df[hi].to_numpy(dtype=float) - y, 0, None)])


def _with_bounds(df: pd.DataFrame, key: str) -> pd.Series:
    """``key``'s values and their intervals' ends, as one series (for choosing a scale that shows the bars too)."""
    return pd.concat([df[k] for k in (key, f"{key}_lo", f"{key}_hi") if k in df], ignore_index=True)


def interval_note(keys) -> str:
    """'bars: 95% intervals over texts' (or sequences, or both) for the quality ``keys`` a figure drew bars for."""
    units = list(dict.fromkeys(unit for k, unit in interval_units().items() if k in set(keys)))
    return f"bars: 95% intervals over {' / '.join(units)}" if units else ""


def _label_points(fig: Figure, todo: dict) -> None:
    """Labels beside points that do not cover one another (``todo``: axes -> [(x, y, text)]): each starts up and to
    the right of its point (to the left in the right third of its panel, so that it stays on the panel) and moves a
    line up or down, then two, ... until it overlaps no label placed before it. Called once the figure is drawn
    but for the labels: it draws the figure once to learn where each label lands."""
    todo = {ax: pts for ax, pts in todo.items() if pts}
    if not todo:
        return
    fig.canvas.draw()  # the constrained layout and the autoscaled limits: where each label would land
    renderer = fig.canvas.get_renderer()
    for ax, points in todo.items():
        placed = []
        for x, y, text in sorted(points, key=lambda p: (p[1], p[0])):
            right = ax.transAxes.inverted().transform(ax.transData.transform((x, y)))[0] > 2 / 3
            dx = -4 if right else 4
            label = ax.annotate(text, (x, y), xytext=(dx, 3), textcoords="offset points", fontsize="x-small",
                                ha="right" if right else "left", va="bottom")
            box = label.get_window_extent(renderer)
            line = box.height * 72 / fig.dpi + 1  # one label's height, in points
            for k in range(1, 40):
                if not any(box.overlaps(p) for p in placed):
                    break
                step = (k + 1) // 2 * (1 if k % 2 else -1)  # up 1, down 1, up 2, down 2, ...
                label.set_position((dx, 3 + step * line))
                box = label.get_window_extent(renderer)
            placed.append(box)


def _message_figure(msg: str) -> Figure:
    fig, ax = plt.subplots(figsize=(6, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, msg, ha="center", va="center", fontsize=12)
    return fig


# -----------------------------------------------------------------------------
# the figures


def step_time_plot(steps: pd.DataFrame) -> Figure:
    """Decode-step time vs context length; lines cached (concat), cached (prealloc), uncached; facets model × dtype.
    Where the runs measured it, each cached kind's roofline (``roofline_ms``: its bytes at the probe's bandwidth,
    the least a memory-bound step can take) is a dotted line of the kind's colour beneath its step times."""
    df = _ok(steps)
    if df.empty:
        return _message_figure("no ok runs with step timings")
    df, precs, models, caches = _levels_of(df)
    fig, axes = plt.subplots(len(precs), len(models), figsize=(4 * len(models) + 2, 3.2 * len(precs)),
                             squeeze=False, sharex=True, sharey=True, layout="constrained")
    cols = [KEYS.ms_median, KEYS.ms_p10, KEYS.ms_p90]
    for i, prec in enumerate(precs):
        for j, model in enumerate(models):
            ax = axes[i, j]
            sub = df[(df[KEYS.model] == model) & (df["prec"] == prec)]
            cached = sub[sub[KEYS.mode] == "cached"]
            series = {f"cached ({c})": (g.groupby(KEYS.context_len, as_index=False)[cols].mean(),
                                        (_cache_color(caches, c), "-")) for c, g in cached.groupby(KEYS.cache)}
            # every run also timed the uncached forward: average those duplicates per context
            uncached = sub[sub[KEYS.mode] == "uncached"]
            series["uncached"] = (uncached.groupby(KEYS.context_len, as_index=False)[cols].mean(),
                                  UNCACHED_STYLE)
            if KEYS.roofline_ms in cached and cached[KEYS.roofline_ms].notna().any():
                for c, g in cached.groupby(KEYS.cache):
                    roof = g.groupby(KEYS.context_len, as_index=False)[KEYS.roofline_ms].mean().dropna()
                    _line(ax, roof, KEYS.context_len, KEYS.roofline_ms, f"roofline ({c})",
                          color=_cache_color(caches, c), linestyle=":", linewidth=1)
            for name, (d, (color, ls)) in series.items():
                if d.empty:
                    continue
                _line(ax, d, KEYS.context_len, KEYS.ms_median, name, color=color, linestyle=ls, marker="o")
                ax.fill_between(d[KEYS.context_len], d[KEYS.ms_p10], d[KEYS.ms_p90], color=color, alpha=0.15,
                                linewidth=0)
            ax.set_title(f"{model} · {prec}")
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("decode-step time (ms)")
    _log2_x(axes[0, 0], df[KEYS.context_len])  # shared by all panels
    axes[0, 0].set_yscale("log")
    fig.suptitle("Time of one decode step vs context length (median, band = p10–p90)")
    _fig_legend(fig, axes)
    return fig


def speedup_plot(steps: pd.DataFrame) -> Figure:
    """Speedup (uncached / cached) vs context length; colour = cache layout, line style = dtype; a panel per model."""
    df = _ok(steps)
    if df.empty:
        return _message_figure("no ok runs with step timings")
    df, precs = _with_prec(df)
    df = df[df[KEYS.mode] == "cached"]  # speedup is repeated on both rows of a context; one is enough
    models = _levels(df[KEYS.model], MODEL_ORDER)
    caches = _cache_levels(df[KEYS.cache])
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models) + 2, 3.5), squeeze=False, sharex=True,
                             sharey=True, layout="constrained")
    for j, model in enumerate(models):
        ax = axes[0, j]
        sub = df[df[KEYS.model] == model]
        for cache, (k, prec) in itertools.product(_cache_levels(sub[KEYS.cache]), enumerate(precs)):
            g = sub[(sub[KEYS.cache] == cache) & (sub["prec"] == prec)]
            if g.empty:
                continue
            d = g.groupby(KEYS.context_len, as_index=False)[KEYS.speedup].mean()
            _line(ax, d, KEYS.context_len, KEYS.speedup, f"{cache} · {prec}", color=_cache_color(caches, cache),
                  linestyle=DASHES[k % len(DASHES)], marker=MARKERS[k % len(MARKERS)])
        ax.axhline(1.0, color="0.5", linestyle=":", linewidth=1, label="_break-even")
        ax.set_title(model)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("speedup, uncached / cached (×)")
    _log2_x(axes[0, 0], df[KEYS.context_len])
    _log_y_if_decades(axes[0, 0], df[KEYS.speedup])
    fig.suptitle("KV-cache speedup of one decode step")
    _fig_legend(fig, axes)
    return fig


def cost_plot(steps: pd.DataFrame) -> Figure:
    """The cost model over the points: cached step time vs context length (dots: medians; line: the run's fit
    a + b·T drawn from 0 to the longest context, its coefficients in the legend). One line per run, a panel per
    model; where two lines cross, one kind's per-token cost has overtaken the other's head start."""

    df = _ok(steps)
    df = df[df[KEYS.mode] == "cached"] if KEYS.mode in df else df.iloc[0:0]
    if df.empty:
        return _message_figure("no ok runs with step timings")
    df, precs, models, caches = _levels_of(df)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models) + 2, 4), squeeze=False, layout="constrained")
    for j, model in enumerate(models):
        ax = axes[0, j]
        sub = df[df[KEYS.model] == model]
        top = float(sub[KEYS.context_len].max())
        for run, g in sub.groupby(KEYS.run_name):
            cache, prec = g[KEYS.cache].iloc[0], g["prec"].iloc[0]
            fit = cost_model(g)
            color, ls = _cache_color(caches, cache), DASHES[precs.index(prec) % len(DASHES)]
            ax.scatter(g[KEYS.context_len], g[KEYS.ms_median], color=color, s=14, zorder=3, label="_points")
            if fit[KEYS.cost_a_ms] is None:
                continue
            T = np.linspace(0, top, 64)
            ax.plot(T, fit[KEYS.cost_a_ms] + fit[KEYS.cost_b_ms_per_token] * T, color=color, linestyle=ls,
                    label=f"{cache} · {prec}: {fit['cost_a_ms']:.3g} ms + {fit['cost_b_ms_per_token']:.2g} ms × T")
        ax.set_title(model)
        ax.set_xlabel("context length T (tokens)")
        ax.set_ylabel("cached decode step (ms)")
    fig.suptitle("Cost model: cached step time vs context (dots: measured medians, lines: a + b·T fitted per run)")
    _fig_legend(fig, axes)
    return fig


def _run_labels(df: pd.DataFrame) -> pd.Series:
    """'model/cache/dtype' per run; adds the device, then falls back to run_name, if that is not unique."""
    label = df[KEYS.model] + "/" + df[KEYS.cache] + "/" + df[KEYS.dtype]
    if label.duplicated().any() and KEYS.device in df:
        label = label + "/" + df[KEYS.device]
    if label.duplicated().any():
        label = df[KEYS.run_name].astype(str)
    return label


def cache_bytes_plot(runs: pd.DataFrame) -> Figure:
    """(a) measured vs predicted cache bytes per run; (b) KV bytes per cached token by model, cache and dtype. Bytes
    read in kB / MB; each panel's legend sits below the figure, under its panel, never on the bars."""
    df = _ok(runs).copy()
    if df.empty:
        return _message_figure("no ok runs")
    df["run"] = _run_labels(df)
    models = _levels(df[KEYS.model], MODEL_ORDER)
    rank = {m: i for i, m in enumerate(models)}
    df = df.sort_values([KEYS.model, KEYS.cache, KEYS.dtype], key=lambda s: s.map(rank) if s.name == KEYS.model else s)
    order = df["run"].tolist()

    fig, (a, b) = plt.subplots(1, 2, figsize=(0.7 * len(order) + 7, 4.5), layout="constrained",
                               gridspec_kw={"width_ratios": [max(len(order), 3), 3]})
    # (a) one pair of bars per run; bar containers come out in hue order: measured, then predicted
    long = df.melt(id_vars="run", value_vars=[KEYS.cache_nbytes, KEYS.predicted_nbytes], var_name="kind",
                   value_name="bytes")
    long["kind"] = long["kind"].map({KEYS.cache_nbytes: "measured", KEYS.predicted_nbytes: "predicted"})
    sns.barplot(data=long, x="run", y="bytes", hue="kind", order=order, hue_order=["measured", "predicted"],
                errorbar=None, ax=a)
    _log_y_if_decades(a, long["bytes"])
    _bytes_axis(a)
    for i, (_, r) in enumerate(df.iterrows()):
        if not r[KEYS.nbytes_match]:  # mark runs where the formula is off
            a.annotate("✗", (i, max(r[KEYS.cache_nbytes], r[KEYS.predicted_nbytes])), ha="center", va="bottom",
                       color="red")
    a.tick_params(axis="x", labelrotation=60)
    plt.setp(a.get_xticklabels(), ha="right", rotation_mode="anchor")
    a.set_xlabel("run (model/cache/dtype)")
    a.set_ylabel("cache size (bytes)")
    a.set_title("(a) KV-cache bytes: measured vs formula")

    # (b) bytes per token is a property of (model, dtype, kind): caches that cost the same share a bar
    bpt = (df.groupby([KEYS.model, KEYS.dtype, KEYS.bytes_per_token])[KEYS.cache]
           .agg(lambda c: ", ".join(_cache_levels(c))).reset_index())
    bpt["series"] = bpt[KEYS.cache] + " · " + bpt[KEYS.dtype]
    sns.barplot(data=bpt, x=KEYS.model, y=KEYS.bytes_per_token, hue="series", order=models,
                hue_order=sorted(bpt["series"].unique()), errorbar=None, ax=b)
    _log_y_if_decades(b, bpt[KEYS.bytes_per_token])
    _bytes_axis(b)
    b.set_xlabel("model")
    b.set_ylabel("KV bytes per cached token (bytes)")
    b.set_title("(b) bytes per cached token")
    # outside the panels, below each: a legend inside would sit on the bars (and a long one runs off the panel)
    for ax, loc, title, ncol in ((a, "outside lower left", "(a)", 2), (b, "outside lower right", "(b) cache · dtype",
                                                                      1 if len(bpt) > 6 else 2)):
        handles, labels = ax.get_legend_handles_labels()
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        if handles:
            fig.legend(handles, labels, loc=loc, title=title, ncol=ncol, frameon=False, fontsize="small",
                       title_fontsize="small")
    return fig


def _would_drift(df: pd.DataFrame) -> pd.Series:
    """Per row of a run table: the run is not fp32 full attention, so generation_drift, had it run, measured drift
    (it skips only an exact kind that is full attention in fp32, its own reference). Read from the identity columns
    every table has: the dtype, and whether the run's kind with its options is full attention
    (``cache_full_attention``; a table without it counts as not)."""
    return (df[KEYS.dtype] != "fp32") | ~_full_attention(df)


def _full_attention(df: pd.DataFrame) -> pd.Series:
    """Per row: the run's record says its kind, with its options, is exactly full attention."""
    if KEYS.cache_full_attention not in df:
        return pd.Series(False, df.index)
    return df[KEYS.cache_full_attention].map(lambda v: v is True or v is np.True_ or v in ("True", "true"))


def drift_unmeasured(drift: pd.DataFrame) -> list[str]:
    """The ok runs of a drift table that would drift from fp32 full attention but have no drift in it: runs whose
    measurements left out generation_drift (their drift.csv holds the equivalence columns only)."""
    df = drift[drift[KEYS.status] == "ok"] if KEYS.status in drift else drift
    if df.empty or KEYS.run_name not in df:
        return []
    has = df[KEYS.drift_kl].notna() if KEYS.drift_kl in df else pd.Series(False, df.index)
    runs = df.assign(has=has, would=_would_drift(df)).groupby(KEYS.run_name)[["has", "would"]].any()
    return sorted(runs.index[~runs["has"] & runs["would"]].astype(str))


def drift_measured(drift: pd.DataFrame) -> bool:
    """Whether the drift figure has something true to show: some ok run has per-step drift, or none would have any
    (all fp32 full attention: "nothing drifts" is then a finding). False when the runs that would drift did not
    measure it (generation_drift left out of their measurements): the figure would only say that."""
    df = drift[drift[KEYS.status] == "ok"] if KEYS.status in drift else drift
    if df.empty:
        return False
    return bool(KEYS.drift_kl in df and df[KEYS.drift_kl].notna().any()) or not drift_unmeasured(drift)


def drift_plot(drift: pd.DataFrame) -> Figure:
    """Drift from fp32 full attention per decode step (reduced precision, lossy or windowed caches): KL, max
    |Δlogit|, top-1 agreement; a row per model, colour = cache, line style = dtype. With no drift to draw the
    figure says why, truthfully: generation_drift was not among the runs' measurements (runs that would drift have
    none), or nothing drifts (every run is fp32 full attention). Runs that would drift but were not measured,
    beside others that were, are named in the title."""
    df = _ok(drift)
    unmeasured = drift_unmeasured(drift)
    df = df[df[KEYS.drift_kl].notna()] if KEYS.drift_kl in df else df.iloc[0:0]
    if df.empty and unmeasured:
        return _message_figure("generation drift was not measured: these runs' measurements leave out\n"
                               "generation_drift (add it: measurements=[...,generation_drift])")
    if df.empty:
        return _message_figure("no reduced-precision runs (fp16/bf16) and no lossy or windowed caches:\n"
                               "nothing drifts from fp32 full attention")
    df, precs, models, caches = _levels_of(df)
    metrics = drift_metrics()
    fig, axes = plt.subplots(len(models), len(metrics), figsize=(4.2 * len(metrics) + 2, 3.2 * len(models)),
                             squeeze=False, sharex=True, layout="constrained")
    for i, model in enumerate(models):
        sub = df[df[KEYS.model] == model]
        for j, (col, ylabel) in enumerate(metrics):
            ax = axes[i, j]
            for _, g in sub.groupby(KEYS.run_name):  # one line per run, never averaged across runs
                prec, cache = g["prec"].iloc[0], g[KEYS.cache].iloc[0]
                _line(ax, g.sort_values(KEYS.step), KEYS.step, col, f"{prec} · {cache}",
                      color=_cache_color(caches, cache),
                      linestyle=DASHES[precs.index(prec) % len(DASHES)])
            if col == KEYS.drift_top1_agreement:
                ax.set_ylim(-0.02, 1.02)
            else:
                _log_y_if_decades(ax, sub[col])
            ax.set_title(f"{model}: {ylabel.split(' (')[0]}")
            ax.set_xlabel("decode step (tokens generated)")
            ax.set_ylabel(ylabel)
    left_out = (f"\nnot measured (no generation_drift in their measurements): {', '.join(unmeasured[:4])}"
                + (f" and {len(unmeasured) - 4} more" if len(unmeasured) > 4 else "")) if unmeasured else ""
    fig.suptitle("Drift from fp32 full attention per decode step (colour = cache, line style = dtype)" + left_out)
    _fig_legend(fig, axes)
    return fig


def layers_plot(layers: pd.DataFrame) -> Figure:
    """Relative error of the K and V attention read, per layer, against fp32 (what the cache stored, plus what the
    layers before it already changed): a panel for K and one for V per model, a line per run (colour = cache, line
    style = dtype); the dotted line is the tolerance from which a layer counts as disagreeing."""
    df = _ok(layers)
    df = df[df[KEYS.k_rel_err].notna() | df[KEYS.v_rel_err].notna()] if KEYS.k_rel_err in df else df.iloc[0:0]
    if df.empty:
        return _message_figure("no runs with per-layer K/V errors (exact fp32 runs have none)")
    df, precs, models, caches = _levels_of(df)
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.2 * len(models)), squeeze=False, layout="constrained")
    for i, model in enumerate(models):
        sub = df[df[KEYS.model] == model]
        for j, (col, what) in enumerate(((KEYS.k_rel_err, "K"), (KEYS.v_rel_err, "V"))):
            ax = axes[i, j]
            for _, g in sub.groupby(KEYS.run_name):
                prec, cache = g["prec"].iloc[0], g[KEYS.cache].iloc[0]
                _line(ax, g.sort_values(KEYS.layer), KEYS.layer, col, f"{prec} · {cache}", marker="o", markersize=3,
                      color=_cache_color(caches, cache), linestyle=DASHES[precs.index(prec) % len(DASHES)])
            ax.axhline(LAYER_TOL, color="0.5", linestyle=":", linewidth=1)
            if (sub[col] > 0).all():
                ax.set_yscale("log")
            ax.set_title(f"{model}: {what}")
            ax.set_xlabel("layer")
            ax.set_ylabel(f"‖{what} − {what}_fp32‖ / ‖{what}_fp32‖")
    fig.suptitle(f"K and V relative error per layer vs fp32 (dotted: tolerance {LAYER_TOL:g})")
    _fig_legend(fig, axes)
    return fig


def _by_batch(top, bottom, sub: pd.DataFrame, keys: list[str], top_y: str, bottom_y: str, label, style) -> None:
    """A line per group of ``keys`` in two panels over batch size: ``top_y`` above, ``bottom_y`` below (medians per
    batch); ``label(key)`` names the line, ``style(key)`` gives its (colour, line style)."""
    for key, g in sub.groupby(keys):
        g = g.groupby(KEYS.batch, as_index=False)[[top_y, bottom_y]].median()
        color, ls = style(key)
        for ax, y in ((top, top_y), (bottom, bottom_y)):
            _line(ax, g, KEYS.batch, y, label(key), color=color, linestyle=ls, marker="o")


def batch_plot(batches: pd.DataFrame) -> Figure:
    """Decode throughput against batch size (tokens/s, log-log), a line per cache (and dtype), one panel per model;
    with the bytes a step reads: the weights (flat) and every sequence's K/V (growing with the batch)."""
    df = _ok(batches)
    if df.empty:
        return _message_figure("no runs with batch_sizes")
    df, precs, models, caches = _levels_of(df)
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models) + 2, 7), squeeze=False, layout="constrained")
    for j, model in enumerate(models):
        sub = df[df[KEYS.model] == model]
        top, bottom = axes[0, j], axes[1, j]
        _by_batch(top, bottom, sub, [KEYS.cache, "prec"], KEYS.tokens_per_s, KEYS.kv_bytes,
                  lambda k: f"{k[0]} · {k[1]}" if len(precs) > 1 else k[0],
                  lambda k: (_cache_color(caches, k[0]), DASHES[precs.index(k[1]) % len(DASHES)]))
        w = float(sub[KEYS.weight_bytes].max())
        bottom.axhline(w, color="0.3", linestyle=":", label="weights (read once per step)")
        for ax in (top, bottom):
            _log2_x(ax, sub[KEYS.batch])
            ax.set_yscale("log")
            ax.set_xlabel("batch size (sequences decoded together)")
        top.set_title(f"{model}: decode throughput")
        top.set_ylabel("tokens / s")
        _bytes_axis(bottom)
        bottom.set_title(f"{model}: bytes read per step")
        bottom.set_ylabel("K/V bytes read per step (bytes)")
    fig.suptitle("Batching amortises the weight read until the K/V reads dominate")
    _fig_legend(fig, axes)
    return fig


def serving_plot(runs: pd.DataFrame) -> Figure:
    """The served batch of every run (``batch`` sequences, ``prompt_lengths`` uniform or ragged): generation
    throughput (tokens/s) against batch size, and the share of the cache's held slots that hold no token (KV
    waste); colour = cache, line style = prompt lengths, one column of panels per model."""
    df = _ok(runs)
    df = df[df[KEYS.tokens_per_s].notna()] if KEYS.tokens_per_s in df else df.iloc[0:0]
    if df.empty:
        return _message_figure("no runs with a served batch")
    df = df.assign(prompt_lengths=df[KEYS.prompt_lengths].fillna("uniform") if KEYS.prompt_lengths in df else "uniform",
                   batch=df[KEYS.serve_batch].astype(int), waste=100 * df[KEYS.kv_waste].astype(float))
    df, precs, models, caches = _levels_of(df)
    shapes = _levels(df[KEYS.prompt_lengths], ["uniform", "ragged"])
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models) + 2, 7), squeeze=False, layout="constrained")
    for j, model in enumerate(models):
        sub = df[df[KEYS.model] == model]
        top, bottom = axes[0, j], axes[1, j]
        _by_batch(top, bottom, sub, [KEYS.cache, "prec", KEYS.prompt_lengths], KEYS.tokens_per_s, "waste",
                  lambda k: " · ".join([k[0]] + ([k[1]] if len(precs) > 1 else []) + [f"{k[2]} prompts"]),
                  lambda k: (_cache_color(caches, k[0]), DASHES[shapes.index(k[2]) % len(DASHES)]))
        for ax in (top, bottom):
            _log2_x(ax, sub[KEYS.batch])
            ax.set_xlabel("batch (sequences served together)")
        top.set_yscale("log")
        top.set_title(f"{model}: generation throughput")
        top.set_ylabel("generated tokens / s")
        bottom.set_ylim(-2, 102)
        bottom.set_title(f"{model}: KV waste after the generation")
        bottom.set_ylabel("held slots holding no token (%)")
    fig.suptitle("Serving a batch: throughput, and what each layout reserves in vain")
    _fig_legend(fig, axes)
    return fig


def equivalence_tolerance(runs: pd.DataFrame) -> float:
    """The max |Δlogit| an exact kind in fp32 may show: the runs' own ``equivalence_tol`` (the most common, should
    they differ), else the equivalence measurement's default."""
    if KEYS.equivalence_tol in runs and runs[KEYS.equivalence_tol].notna().any():
        return float(runs[KEYS.equivalence_tol].dropna().astype(float).mode().iloc[0])
    from harness.measurements import MEASUREMENTS

    return float(MEASUREMENTS["equivalence"].Options().equivalence_tol)


DECADES_AROUND_TOL = 4  # the equivalence grid's colours run from tol / 10^4 (calm) to tol × 10^4 (alarm)


def tolerance_norm(tol: float):
    """A log colour scale fixed on the tolerance, never on the data: ``tol`` at its middle (0.5), four decades
    either side; with ``tolerance_cmap`` the calm half (below) is green, the alarm half (at and above) red."""
    return _colors.LogNorm(tol / 10 ** DECADES_AROUND_TOL, tol * 10 ** DECADES_AROUND_TOL, clip=True)


@lru_cache(maxsize=1)
def tolerance_cmap():
    """Green far below the tolerance, paling towards it; red from the tolerance up, darkening: a cell is alarm
    red only at or over the tolerance, whatever else the grid holds."""
    return _colors.LinearSegmentedColormap.from_list(
        "kvlab_tolerance", [(0.0, "#1a7f37"), (0.25, "#7fc97f"), (0.4999, "#eef8ea"), (0.5, "#f4a582"),
                            (0.75, "#d6604d"), (1.0, "#8b0016")], N=1024)


def _held(df: pd.DataFrame) -> pd.Series:
    """Runs held to the tolerance: an exact kind in fp32 storage and compute (the runner's verdict); a lossy kind's
    difference is its error, reduced precision's its rounding."""
    exact = df[KEYS.cache_exact].fillna(True).astype(bool) if KEYS.cache_exact in df else pd.Series(True, df.index)
    if KEYS.storage_dtype in df and KEYS.compute_dtype in df:
        fp32 = (df[KEYS.storage_dtype] == "float32") & (df[KEYS.compute_dtype] == "float32")
        fp32 |= df[KEYS.storage_dtype].isna() & (df[KEYS.dtype] == "fp32")  # a record from before those keys
    else:
        fp32 = df[KEYS.dtype] == "fp32"
    return exact & fp32


def equivalence_grid(runs: pd.DataFrame) -> Figure:
    """Heatmap model × cache/dtype of max |Δlogit| (cached vs uncached), annotated ✓/✗ for identical tokens. The
    colours are fixed on the equivalence tolerance (``equivalence_tol``, 1e-4 by default), not on the data's
    range: green within it, red at or over it, the tolerance marked on the colour bar; cells not held to it (lossy
    kinds, reduced precision) are grey, their value still written."""
    df = _ok(runs).copy()
    if df.empty:
        return _message_figure("no ok runs")
    df["cell"] = df[KEYS.cache] + "/" + df[KEYS.dtype]
    df["held"] = _held(df)
    models = _levels(df[KEYS.model], MODEL_ORDER)
    cells = [f"{c}/{d}" for c in _cache_levels(df[KEYS.cache]) for d in _levels(df[KEYS.dtype], DTYPE_ORDER)]
    cells = [c for c in cells if c in set(df["cell"])]
    # several runs in one cell (e.g. two devices): show the worst
    diff = df.pivot_table(index=KEYS.model, columns="cell", values=KEYS.max_abs_logit_diff, aggfunc="max")
    same = df.groupby([KEYS.model, "cell"])[KEYS.tokens_identical].all().unstack()
    held = df.groupby([KEYS.model, "cell"])["held"].all().unstack()
    diff, same = diff.reindex(index=models, columns=cells), same.reindex(index=models, columns=cells)
    held = held.reindex(index=models, columns=cells).fillna(True).astype(bool)
    lossy = set(df.loc[df[KEYS.cache_exact] == False, "cell"]) if KEYS.cache_exact in df else set()  # noqa: E712

    annot = np.full(diff.shape, "", dtype=object)
    for (i, j), v in np.ndenumerate(diff.to_numpy()):
        if not np.isnan(v):
            annot[i, j] = f"{v:.1e}\n" + ("✓" if same.iat[i, j] else "✗") + ("\nlossy" if cells[j] in lossy else "")
    tol = equivalence_tolerance(df)
    norm = tolerance_norm(tol)

    # the rotated cache/dtype labels take their length in height: a single model's row stays readable under them
    labels_in = 0.085 * max(len(c) for c in cells)
    fig, ax = plt.subplots(figsize=(max(1.5 * len(cells) + 3.5, 10), max(0.9 * len(models), 1.2) + 2.2 + labels_in),
                           layout="constrained")
    # an exact zero (log colours need positive values) is as calm as the scale's floor
    sns.heatmap(diff.clip(lower=norm.vmin), annot=annot, fmt="", norm=norm, cmap=tolerance_cmap(), linewidths=0.5,
                ax=ax, cbar_kws={"label": "max |Δlogit| (logit units)", "extend": "both"})
    for (i, j), h in np.ndenumerate(held.to_numpy()):
        if not h and not np.isnan(diff.iat[i, j]):  # not held to the tolerance: grey, whatever its value
            ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor="0.87", edgecolor="white", linewidth=0.5, zorder=2))
    for text in ax.texts:  # dark annotations on grey (seaborn chose theirs for the colour beneath)
        x, y = text.get_position()
        if not held.iat[int(y), int(x)]:
            text.set_color("0.15")
    cbar = ax.collections[0].colorbar
    ticks = [tol * 10.0 ** k for k in range(-DECADES_AROUND_TOL, DECADES_AROUND_TOL + 1, 2)]
    cbar.set_ticks(ticks, labels=[f"{t:.0e}" + (" tolerance" if t == tol else "") for t in ticks])
    cbar.ax.minorticks_off()
    cbar.ax.axhline(tol, color="black", linewidth=1.5)
    ax.set_xlabel("cache / dtype")
    ax.set_ylabel("model")
    ax.set_title(f"Cached vs the kind's uncached reference: max |Δlogit| against the tolerance {tol:.0e}\n"
                 "green: within it, red: over it; grey: not held to it (lossy, or reduced precision); "
                 "✓ = identical tokens", fontsize="medium")
    return fig


def memory_plot(memory: pd.DataFrame) -> Figure:
    """Cache bytes vs tokens in the sequence: a line per cache (and dtype) from the kind's formula, out to max_len,
    and dots where a generation measured them; one panel per model."""
    df = _ok(memory)
    if df.empty:
        return _message_figure("no ok runs with a memory table")
    df, precs, models, caches = _levels_of(df)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models) + 2, 4), squeeze=False, layout="constrained")
    for j, model in enumerate(models):
        ax = axes[0, j]
        sub = df[df[KEYS.model] == model]
        for (cache, prec), g in sub.groupby([KEYS.cache, "prec"]):
            curve = g.groupby(KEYS.tokens, as_index=False)[[KEYS.nbytes_formula, KEYS.nbytes_measured]].max()
            name = f"{cache} · {prec}" if len(precs) > 1 else cache
            color, ls = _cache_color(caches, cache), DASHES[precs.index(prec) % len(DASHES)]
            _line(ax, curve, KEYS.tokens, KEYS.nbytes_formula, name, color=color, linestyle=ls)
            pts = curve[curve[KEYS.nbytes_measured].notna()]
            ax.scatter(pts[KEYS.tokens], pts[KEYS.nbytes_measured], color=color, s=12, zorder=3, label="_measured")
        _log_y_if_decades(ax, sub[KEYS.nbytes_formula])
        if ax.get_yscale() == "linear":
            ax.set_ylim(bottom=0)  # bytes from nothing: a flat line at 393 kB is not drawn as a wide range
        _bytes_axis(ax)
        ax.set_title(model)
        ax.set_xlabel("tokens in the sequence (prompt + generated)")
        ax.set_ylabel("cache bytes held (bytes)")
    fig.suptitle("KV-cache bytes vs tokens (line: the kind's formula, dots: measured during generation)")
    _fig_legend(fig, axes)
    return fig



HEAD_PANELS = 12  # runs drawn side by side in the heads figure, at most


def spent_unevenly(heads: pd.DataFrame) -> pd.DataFrame:
    """The ok rows of the runs whose K/V heads hold different numbers of slots (an allocation or duo)."""
    df = _ok(heads)
    if df.empty or KEYS.slots not in df:
        return df.iloc[:0]
    uneven = df.groupby(KEYS.run_name)[KEYS.slots].transform("nunique") > 1
    return df[uneven]


def heads_plot(heads: pd.DataFrame) -> Figure:
    """Slots held per layer (rows) and K/V head (columns) of each run that spends them unevenly: one panel per
    run (at most ``HEAD_PANELS``), the count written in each cell, R on a duo run's retrieval heads."""
    df = spent_unevenly(heads)
    if df.empty:
        return _message_figure("no run spends its slots unevenly over layers or heads")
    runs = list(dict.fromkeys(df[KEYS.run_name]))[:HEAD_PANELS]
    cols = min(len(runs), 4)
    rows = math.ceil(len(runs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1, 2.8 * rows + 0.6), squeeze=False,
                             layout="constrained")
    top = float(df[KEYS.slots].max())
    for ax, run in zip(axes.flat, runs):
        g = df[df[KEYS.run_name] == run]
        grid = g.pivot(index=KEYS.layer, columns=KEYS.kv_head, values=KEYS.slots)
        im = ax.imshow(grid.values, cmap="viridis", vmin=0, vmax=top, aspect="auto")
        roles = g.set_index([KEYS.layer, KEYS.kv_head])[KEYS.role].fillna("")
        for (i, layer), (j, head) in itertools.product(enumerate(grid.index), enumerate(grid.columns)):
            mark = " R" if roles.get((layer, head), "") == "retrieval" else ""
            ax.text(j, i, f"{int(grid.loc[layer, head])}{mark}", ha="center", va="center", fontsize=7,
                    color="w" if grid.loc[layer, head] < top / 2 else "k")
        ax.set_title(f"{g[KEYS.model].iloc[0]} · {g[KEYS.cache].iloc[0]}", fontsize=8)
        ax.set_xlabel("K/V head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(grid.shape[0]))
    for ax in list(axes.flat)[len(runs):]:
        ax.set_visible(False)
    fig.colorbar(im, ax=axes, label="slots held (tokens)", shrink=0.8)
    fig.suptitle("Slots per layer and K/V head (R: a duo retrieval head)")
    return fig


def retrieval_plot(runs: pd.DataFrame) -> Figure:
    """Copy accuracy on random sequences shown twice, per run: through its cache (bars, with the 95% interval over
    the run's sequences where the table carries ``retrieval_acc_lo`` / ``_hi``) against fp32 full attention (a black
    tick): what windows and eviction lose; one panel per model, the legend below them."""
    df = _ok(runs)
    df = df[df[KEYS.retrieval_acc].notna()] if KEYS.retrieval_acc in df else df.iloc[0:0]
    if df.empty:
        return _message_figure("no runs measured retrieval")
    df, precs, models, caches = _levels_of(df)
    fig, axes = plt.subplots(1, len(models), figsize=(max(5, 1.1 * df[KEYS.run_name].nunique()) * len(models) + 1, 4),
                             squeeze=False, layout="constrained")
    bars = False
    for j, model in enumerate(models):
        ax = axes[0, j]
        sub = df[df[KEYS.model] == model].sort_values([KEYS.cache, "prec"])
        labels = [f"{c} · {p}" if len(precs) > 1 else c for c, p in zip(sub[KEYS.cache], sub["prec"])]
        x = np.arange(len(sub))
        ax.bar(x, sub[KEYS.retrieval_acc], color=[_cache_color(caches, c) for c in sub[KEYS.cache]])
        yerr = _yerr(sub, KEYS.retrieval_acc)
        if yerr is not None:
            ax.errorbar(x, sub[KEYS.retrieval_acc], yerr=yerr, fmt="none", ecolor="0.2", elinewidth=1.2, capsize=4,
                        zorder=4, label="95% interval over sequences")
            bars = True
        if KEYS.retrieval_acc_ref in sub:
            ax.scatter(x, sub[KEYS.retrieval_acc_ref], marker="_", s=400, color="black", zorder=3,
                       label="fp32 full attention")
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_ylim(0, 1.02)
        ax.set_title(model)
        ax.set_ylabel("top-1 accuracy on the second copy")
    fig.suptitle("Retrieval: random sequences shown twice\n(bars: through the cache; tick: fp32 full attention"
                 + ("; whiskers: 95% intervals over sequences)" if bars else ")"))
    _fig_legend(fig, axes)
    return fig


def as_written(v):
    """A table value as written in a config: 8 rather than 8.0 (a column with gaps is float)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def budget_quality(runs: pd.DataFrame) -> pd.DataFrame:
    """The ok runs of kinds with a budget (``cache.budget`` > 0: the evicting kinds, a window given one) measured at
    two or more budgets, with a quality figure (text ΔNLL or retrieval): what ``budget_plot`` draws, a row per run,
    ``slots`` its budget and ``series`` the line it is on: its kind, dtype, prompt length and every option that is
    not set by the budget (an H2O ``recent`` ablation is two lines; a window's ``window``, budget - sinks, is not)."""
    quality = [k for k in (KEYS.drift_delta_nll, KEYS.retrieval_acc) if k in runs]
    if not {KEYS.status, KEYS.cache, KEYS.cache_budget} <= set(runs) or not quality:
        return runs.iloc[0:0]
    df = runs[(runs[KEYS.status] == "ok") & (runs[KEYS.cache_budget] > 0) & runs[quality].notna().any(axis=1)]
    df = df.assign(slots=df[KEYS.cache_budget], kind=df[KEYS.cache])
    several_prompts = KEYS.prompt_len in df and df[KEYS.prompt_len].nunique() > 1
    swept = {kind: [c for c in option_columns(same) if c != KEYS.cache_budget
                    and (same.groupby("slots")[c].nunique() > 1).any()]
             for kind, same in df.groupby("kind")}  # per kind: options that take two values at one budget
    series = []
    for _, row in df.iterrows():
        own = swept[row["kind"]]
        parts = [row["kind"], row[KEYS.dtype]] + ([f"prompt {row[KEYS.prompt_len]}"] if several_prompts else [])
        series.append(" · ".join([*map(str, parts), *(f"{c[len('cache_'):]}={as_written(row[c])}" for c in own)]))
    df = df.assign(series=series)
    sizes = df.groupby(["model", "series"])["slots"].transform("nunique")
    return df[sizes >= 2]


def budget_plot(runs: pd.DataFrame) -> Figure:
    """Quality against the slots a cache holds, one line per kind and setting: text ΔNLL against fp32 full
    attention (lower is better) and retrieval (copy accuracy, higher is better; the dotted line is fp32 full
    attention's), a row per model. Eviction and windows at each budget side by side. Where the table carries a
    run's 95% interval (``<key>_lo`` / ``_hi``, over its texts or sequences) each point has it as a vertical bar."""
    df = budget_quality(runs)
    if df.empty:
        return _message_figure("no cache kind was measured at two or more budgets")
    models, kinds = _levels(df[KEYS.model], MODEL_ORDER), _cache_levels(df["kind"])
    panels = [(k, label) for k, label in ((KEYS.drift_delta_nll, "text ΔNLL vs fp32 full (nats/token)"),
                                          (KEYS.retrieval_acc, "retrieval: copy accuracy")) if k in df]
    fig, axes = plt.subplots(len(models), len(panels), figsize=(5 * len(panels) + 2, 3.6 * len(models)),
                             squeeze=False, layout="constrained")
    barred = set()
    for i, model in enumerate(models):
        sub = df[df[KEYS.model] == model]
        for j, (col, ylabel) in enumerate(panels):
            ax = axes[i, j]
            for (kind, name), g in sub.groupby(["kind", "series"]):
                g = g[g[col].notna()].sort_values("slots")
                nth = sorted(sub[sub["kind"] == kind]["series"].unique()).index(name)  # line style within a kind
                if not g.empty:
                    color = _cache_color(kinds, kind)
                    ax.plot(g["slots"], g[col], marker="o", color=color, linestyle=DASHES[nth % len(DASHES)],
                            label=name)
                    yerr = _yerr(g, col)
                    if yerr is not None:
                        ax.errorbar(g["slots"], g[col], yerr=yerr, fmt="none", ecolor=color, elinewidth=1,
                                    capsize=3, alpha=0.8, label="_interval")
                        barred.add(col)
            ref = sub[KEYS.retrieval_acc_ref] if KEYS.retrieval_acc_ref in sub else None
            if col == KEYS.retrieval_acc and ref is not None and ref.notna().any():
                ax.axhline(ref.mean(), color="black", linestyle=":", label="fp32 full attention")
                ax.set_ylim(-0.02, 1.02)
            _log2_x(ax, sub["slots"].astype(int))
            ax.set_title(f"{model}: {ylabel.split(':')[0].split(' (')[0]}")
            ax.set_xlabel("slots held per sequence, layer and head (budget)")
            ax.set_ylabel(ylabel)
    note = interval_note(barred)
    fig.suptitle("Quality against budget: what each kind keeps buys (colour = kind, line style = setting"
                 + (f"; {note})" if note else ")"))
    _fig_legend(fig, axes)
    return fig


def _pareto_axes() -> tuple[tuple, tuple]:
    """(quality: (key, label, "low" | "high" is better), cost: (key, label)) of the quality-vs-cost figure."""
    return (((KEYS.drift_delta_nll, "text ΔNLL vs fp32 full (nats/token)", "low"),
             (KEYS.drift_kl_p99, "KL p99 vs fp32 full (nats)", "low"),
             (KEYS.retrieval_acc, "retrieval: copy accuracy", "high")),
            ((KEYS.cache_nbytes, "KV bytes held at the run's end (scales and positions included)"),
             (KEYS.step_ms_cached_at_max_context, "cached decode step at the longest context (ms)")))


def is_full_attention(row: pd.Series) -> bool:
    """The run's kind, with its options, is exactly full attention, whatever its dtype (its record's
    ``cache_full_attention``)."""
    return bool(_full_attention(pd.DataFrame([row])).iloc[0])


OWN_REFERENCE = "its own fp32 reference"  # in <measurement>_skipped: why a drift measurement skipped fp32 full
# attention itself (harness/measurements/text_drift.py and generation_drift.py, ``skip``)


def with_reference_at_zero(df: pd.DataFrame, keys) -> pd.DataFrame:
    """``df`` with the missing drift ``keys`` of each run that is its own fp32 reference set to 0: the measurement
    that records the key skipped the run for that reason (``<measurement>_skipped``), and its equivalence check held
    it to its reference. A run whose drift was not asked for, or skipped for any other reason, keeps no figure: never
    measured is not 0."""
    from harness.measurements import MEASUREMENTS

    df = df.copy()
    if not len(df):
        return df
    for key in (k for k in keys if k in df):
        owner = next((m.name for m in MEASUREMENTS.values() if key in m.keys()), None)
        col = f"{owner}_skipped"
        if owner is None or col not in df:
            continue
        own = df[col].map(lambda why: isinstance(why, str) and OWN_REFERENCE in why).astype(bool)
        df.loc[own & df[key].isna(), key] = 0.0
    return df


def pareto_points(runs: pd.DataFrame) -> pd.DataFrame:
    """The ok runs as points of the quality-vs-cost figure: a row per run with ``point`` (its cache label · dtype),
    ``kind`` (its kind's name) and the quality and cost columns it has. A kind that is exactly full attention, in
    fp32 storage and compute, is the fp32 reference itself (its drift measurements skip it): its drift is drawn at
    0, which its equivalence check holds it to. Empty when fewer than two settings have a quality and a cost."""
    if KEYS.status not in runs:
        return runs.iloc[0:0]
    df = runs[runs[KEYS.status] == "ok"]  # the kind's name in cache (swept_setting asks it), not its label
    quality_axes, cost_axes = _pareto_axes()
    quality = [q for q, _, _ in quality_axes if q in df]
    cost = [c for c, _ in cost_axes if c in df]
    if not quality or not cost:
        return df.iloc[0:0]
    df = df.assign(kind=df[KEYS.cache])  # the kind's name (swept_setting asks it), before _ok puts the label in cache
    # cache: the label (kind + options), so two settings of one kind are two points
    df = _ok(with_reference_at_zero(df, [q for q in quality if q != KEYS.retrieval_acc]))
    df["point"] = df[KEYS.cache] + " · " + df[KEYS.dtype]
    df = df[df[quality].notna().any(axis=1) & df[cost].notna().any(axis=1)]
    return df if df["point"].nunique() >= 2 else df.iloc[0:0]


def pareto_front(x: pd.Series, y: pd.Series, better: str) -> pd.Index:
    """The points no other point beats on both (cost ``x``, lower is better; quality ``y``), in order of x."""
    order = pd.DataFrame({"x": x, "y": y}).dropna().sort_values(["x", "y"], ascending=[True, better == "low"])
    front, best = [], None
    for i, row in order.iterrows():
        if best is None or (row.y < best if better == "low" else row.y > best):
            front.append(i)
            best = row.y
    return pd.Index(front)


def option_columns(df: pd.DataFrame) -> list[str]:
    """The columns of ``df`` that hold a cache option (``cache_<option>``, as a run records its kind's options) with a
    value in some row: every ``cache_`` column no measurement or run part declares (cache_label, cache_nbytes, ...)."""
    recorded = declared_names(cache_options=False)
    return [c for c in df if c.startswith("cache_") and c not in recorded and df[c].notna().any()]


def swept_setting(points: pd.DataFrame) -> tuple[str, str] | None:
    """The one setting that differs between ``points`` (rows of ``pareto_points``: one kind's runs): (its column,
    its name in a config: "cache.sinks", or "dtype"); None when the points are of several kinds, or none or several
    of their options differ. An option whose value the others imply in every point (``cache_implied``: a window's
    window, budget - sinks) is not a setting of its own: the one it follows is."""
    kinds = points["kind"].dropna().unique() if "kind" in points else []
    if len(kinds) != 1:
        return None
    options = option_columns(points)
    implied = points[KEYS.cache_implied].fillna("").astype(str).str.split(",") if KEYS.cache_implied in points \
        else pd.Series([[]] * len(points), points.index)
    differ = lambda col: col in points and points[col].astype(str).nunique() > 1  # noqa: E731 (NaN is a value too)
    found = [(c, "cache." + c.removeprefix("cache_")) for c in options
             if differ(c) and not all(c.removeprefix("cache_") in names for names in implied)]
    found += [(KEYS.dtype, "dtype")] if differ(KEYS.dtype) else []
    return found[0] if len(found) == 1 else None


def _one_cost(points: pd.DataFrame, cost: str) -> str | None:
    """What every point costs, in words ("hold 393 kB", "take 12.3 ms"), when they all cost the same on ``cost``
    (every point on one vertical line: a frontier along it says nothing); None when the costs differ."""
    values = points[cost].dropna().unique()
    if len(points) < 2 or len(values) != 1:
        return None
    return f"hold {human_bytes(values[0])}" if cost == KEYS.cache_nbytes else f"take {values[0]:.3g} ms"


def _against_setting(ax, sub: pd.DataFrame, q: str, setting, caches, labels: list) -> tuple[str, np.ndarray]:
    """Quality ``q`` of ``sub`` (points that all cost the same) against the setting that differs between them:
    its values on x (numbers on a numeric axis with a tick at each, anything else a tick per value), or a tick per
    point where no one setting differs; a grey line joins a model's points. Points of several models at one x get
    labels (added to ``labels``). Returns the x axis's name and each point's x."""
    col, name = setting if setting else ("point", "setting (cache · dtype)")
    values = sub[col].map(as_written)
    numeric = setting is not None and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numeric:
        x = values.to_numpy(dtype=float)
    else:
        if col == "point":  # kinds by name, then label, then dtype
            order = list(dict.fromkeys(p for c in _cache_levels(sub[KEYS.cache])
                                       for p in sorted(sub.loc[sub[KEYS.cache] == c, "point"])))
        else:
            order = _levels(values.astype(str), DTYPE_ORDER if col == KEYS.dtype else [])
        x = values.astype(str).map({v: i for i, v in enumerate(order)}).to_numpy(dtype=float)
    sub = sub.assign(_x=x)
    for _, g in sub.groupby(KEYS.model):
        g = g.sort_values("_x")
        ax.plot(g["_x"], g[q], color="0.6", linewidth=1, zorder=2, label="_joins")
    ax.scatter(sub["_x"], sub[q], color=[_cache_color(caches, k) for k in sub[KEYS.cache]], zorder=3)
    if numeric:
        ticks = sorted(set(x))
        if min(ticks) > 0 and max(ticks) / min(ticks) >= 8:
            _log2_x(ax, [as_written(float(t)) for t in ticks])
        else:
            ax.set_xticks(ticks, [str(as_written(float(t))) for t in ticks])
    else:
        ax.set_xticks(range(len(order)), order, rotation=30, ha="right")
    if sub["_x"].duplicated().any():  # several models at one setting: say which point is which
        labels += [(r["_x"], r[q], f"{r[KEYS.model]}: {r['point']}") for _, r in sub.iterrows()]
    return name, x


def pareto_plot(runs: pd.DataFrame) -> Figure:
    """Quality against what it costs, a point per setting (cache label · dtype; a model's runs together): rows are
    text ΔNLL, KL p99 and retrieval, columns the KV bytes held (in kB / MB) and the step at the longest context;
    the line joins the frontier (the settings no other beats on both). kvpress's headline plot, with measured
    bytes. Each point carries its 95% interval (a vertical bar) where the table has ``<key>_lo`` / ``_hi``. Where
    every setting costs the same on a column (five windows of one budget hold the same bytes: one vertical line,
    their labels on top of one another) that column draws quality against the setting that differs instead, and
    its title says why. Labels are moved apart until none covers another."""
    df = pareto_points(runs)
    if df.empty:
        return _message_figure("fewer than two settings with a quality and a cost measured")
    quality_axes, cost_axes = _pareto_axes()
    rows = [q for q in quality_axes if q[0] in df and df[q[0]].notna().any()]
    cols = [c for c in cost_axes if c[0] in df and df[c[0]].notna().any()]
    caches = _cache_levels(df[KEYS.cache])
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(5.5 * len(cols) + 1, 3.6 * len(rows)), squeeze=False,
                             layout="constrained")
    labels, barred, drawn = {}, set(), set()
    for i, (q, qlabel, better) in enumerate(rows):
        for j, (c, clabel) in enumerate(cols):
            ax = axes[i, j]
            labels[ax] = []
            points = df[df[q].notna() & df[c].notna()]
            same = _one_cost(points, c)
            if same:
                name, xs = _against_setting(ax, points, q, swept_setting(points), caches, labels[ax])
                ax.set_title(f"all settings {same}: quality against {name} instead", fontsize="small")
                ax.set_xlabel(name)
                drawn.add(f"grey line: the settings in order of {name}" if name.startswith(("cache.", "dtype"))
                          else "grey line: the settings side by side")
            else:
                for model, sub in points.groupby(KEYS.model):
                    ax.scatter(sub[c], sub[q], color=[_cache_color(caches, k) for k in sub[KEYS.cache]], zorder=3)
                    labels[ax] += [(r[c], r[q], r["point"]) for _, r in sub.iterrows()]
                    front = sub.loc[pareto_front(sub[c], sub[q], better)]
                    ax.plot(front[c], front[q], color="black", linewidth=1, label=f"frontier ({model})")
                ax.set_xlabel(clabel)
                drawn.add("black line: the frontier")
                xs = points[c].to_numpy(dtype=float)
                if c == KEYS.cache_nbytes:
                    _bytes_axis(ax, "x")
            yerr = _yerr(points, q)
            if yerr is not None:
                ax.errorbar(xs, points[q], yerr=yerr, fmt="none", ecolor="0.3", elinewidth=1, capsize=3, zorder=2,
                            label="_interval")
                barred.add(q)
            ax.set_ylabel(qlabel)
            _log_y_if_decades(ax, _with_bounds(points, q))
    notes = sorted(drawn) + ([interval_note(barred)] if barred else [])
    fig.suptitle(f"Quality against cost, a point per setting\n({'; '.join(notes)})")
    _fig_legend(fig, axes)
    _label_points(fig, labels)
    return fig

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
                              cache and dtype (caches that cost the same share a bar).
    memory_plot(memory)       cache bytes held vs tokens in the sequence: the kind's formula out to max_len as a
                              line, the bytes measured during generation as dots; concat grows, prealloc is flat
                              at max_len, window flat at sinks + window, quant a fraction of prealloc.
    drift_plot(drift)         how far logits drift from fp32 full attention per decode step (reduced precision,
                              lossy or windowed caches): KL(fp32 ‖ run), max |Δlogit| and top-1 agreement;
                              colour = cache, line style = dtype, one line per run, one row of panels per model.
                              Runs without drift are left out; with none left the figure just says so.
    serving_plot(runs)        each run's served batch: generated tokens/s against batch size, and KV waste (held
                              slots that hold no token): colour = cache, line style = uniform / ragged prompts.
    equivalence_grid(runs)    cached-vs-reference check as a heatmap: rows = model, columns = cache/dtype, colour =
                              max |Δlogit| (log scale), each cell annotated with the value, ✓/✗ for whether the
                              generated tokens were identical, and "lossy" for lossy kinds (whose difference is
                              their error). Several runs in one cell show the worst of them.
    layers_plot(layers)       relative error of K and of V per layer against fp32, a line per run, with the
                              tolerance from which a layer counts as disagreeing.
    batch_plot(batches)       decode tokens/s against batch size, and the K/V bytes a step reads against the weights
                              (flat): where batching stops paying.
    all_figures(runs, steps, drift, memory, layers, batches)   all of the above keyed by file stem; a figure whose input
                              table has no ok rows is left out of the dict.

When runs from more than one device are mixed, the dtype label becomes "dtype · device" wherever timings or drift
are grouped by dtype (a CPU and a GPU step time must not be averaged together).
"""

from __future__ import annotations

import importlib
import itertools
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from harness.measurements import KEYS
from harness.core.stats import LAYER_TOL, cost_model

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


@lru_cache(maxsize=1)
def cache_order() -> tuple[str, ...]:
    """The cache kinds in the registry's order (a kind's runs are labelled "<kind> <options>"); the engine's registry
    is read when a figure is drawn, never when this module is imported."""
    from models.kv_cache import CACHE_KINDS

    return tuple(CACHE_KINDS)
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
    """Cache labels in the registry's order of their kinds, then by label."""
    def key(label: str):
        kind = label.split(" ")[0].split("(")[0]
        order = cache_order()
        return (order.index(kind) if kind in order else len(order), label)

    return sorted(set(values.dropna()), key=key)


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
    """(a) measured vs predicted cache bytes per run; (b) KV bytes per cached token by model, cache and dtype."""
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
    for i, (_, r) in enumerate(df.iterrows()):
        if not r[KEYS.nbytes_match]:  # mark runs where the formula is off
            a.annotate("✗", (i, max(r[KEYS.cache_nbytes], r[KEYS.predicted_nbytes])), ha="center", va="bottom",
                       color="red")
    a.tick_params(axis="x", labelrotation=60)
    plt.setp(a.get_xticklabels(), ha="right", rotation_mode="anchor")
    a.set_xlabel("run (model/cache/dtype)")
    a.set_ylabel("cache size (bytes)")
    a.set_title("(a) KV-cache bytes: measured vs formula")
    a.legend(title=None, frameon=False)

    # (b) bytes per token is a property of (model, dtype, kind): caches that cost the same share a bar
    bpt = (df.groupby([KEYS.model, KEYS.dtype, KEYS.bytes_per_token])[KEYS.cache]
           .agg(lambda c: ", ".join(_cache_levels(c))).reset_index())
    bpt["series"] = bpt[KEYS.cache] + " · " + bpt[KEYS.dtype]
    sns.barplot(data=bpt, x=KEYS.model, y=KEYS.bytes_per_token, hue="series", order=models,
                hue_order=sorted(bpt["series"].unique()), errorbar=None, ax=b)
    _log_y_if_decades(b, bpt[KEYS.bytes_per_token])
    b.set_xlabel("model")
    b.set_ylabel("KV bytes per cached token (bytes)")
    b.set_title("(b) bytes per cached token")
    b.legend(title="cache · dtype", frameon=False, fontsize="small")
    return fig


def drift_plot(drift: pd.DataFrame) -> Figure:
    """Drift from fp32 full attention per decode step (reduced precision, lossy or windowed caches): KL, max
    |Δlogit|, top-1 agreement; a row per model, colour = cache, line style = dtype."""
    df = _ok(drift)
    df = df[df[KEYS.drift_kl].notna()] if KEYS.drift_kl in df else df.iloc[0:0]
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
    fig.suptitle("Drift from fp32 full attention per decode step (colour = cache, line style = dtype)")
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


def equivalence_grid(runs: pd.DataFrame) -> Figure:
    """Heatmap model × cache/dtype of max |Δlogit| (cached vs uncached), annotated ✓/✗ for identical tokens."""
    df = _ok(runs).copy()
    if df.empty:
        return _message_figure("no ok runs")
    df["cell"] = df[KEYS.cache] + "/" + df[KEYS.dtype]
    models = _levels(df[KEYS.model], MODEL_ORDER)
    cells = [f"{c}/{d}" for c in _cache_levels(df[KEYS.cache]) for d in _levels(df[KEYS.dtype], DTYPE_ORDER)]
    cells = [c for c in cells if c in set(df["cell"])]
    # several runs in one cell (e.g. two devices): show the worst
    diff = df.pivot_table(index=KEYS.model, columns="cell", values=KEYS.max_abs_logit_diff, aggfunc="max")
    same = df.groupby([KEYS.model, "cell"])[KEYS.tokens_identical].all().unstack()
    diff, same = diff.reindex(index=models, columns=cells), same.reindex(index=models, columns=cells)
    lossy = set(df.loc[df[KEYS.cache_exact] == False, "cell"]) if KEYS.cache_exact in df else set()  # noqa: E712

    annot = np.full(diff.shape, "", dtype=object)
    for (i, j), v in np.ndenumerate(diff.to_numpy()):
        if not np.isnan(v):
            annot[i, j] = f"{v:.1e}\n" + ("✓" if same.iat[i, j] else "✗") + ("\nlossy" if cells[j] in lossy else "")
    pos = diff.to_numpy()[diff.to_numpy() > 0]  # log colour needs positive values; exact zeros are left uncoloured
    norm = _colors.LogNorm(pos.min(), pos.max()) if pos.size and pos.max() > pos.min() else None

    fig, ax = plt.subplots(figsize=(1.5 * len(cells) + 3, 0.9 * len(models) + 2), layout="constrained")
    sns.heatmap(diff, annot=annot, fmt="", norm=norm, cmap="rocket_r", linewidths=0.5, ax=ax,
                cbar_kws={"label": "max |Δlogit| (logit units)"})
    ax.set_xlabel("cache / dtype")
    ax.set_ylabel("model")
    ax.set_title("Cached vs the kind's uncached reference: max |Δlogit|, ✓ = identical tokens")
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
        ax.set_title(model)
        ax.set_xlabel("tokens in the sequence (prompt + generated)")
        ax.set_ylabel("cache bytes held (bytes)")
    fig.suptitle("KV-cache bytes vs tokens (line: the kind's formula, dots: measured during generation)")
    _fig_legend(fig, axes)
    return fig



def retrieval_plot(runs: pd.DataFrame) -> Figure:
    """Copy accuracy on random sequences shown twice, per run: through its cache (bars) against fp32 full
    attention (a black tick): what windows and eviction lose; one panel per model."""
    df = _ok(runs)
    df = df[df[KEYS.retrieval_acc].notna()] if KEYS.retrieval_acc in df else df.iloc[0:0]
    if df.empty:
        return _message_figure("no runs measured retrieval")
    df, precs, models, caches = _levels_of(df)
    fig, axes = plt.subplots(1, len(models), figsize=(max(5, 1.1 * df[KEYS.run_name].nunique()) * len(models) + 1, 4),
                             squeeze=False, layout="constrained")
    for j, model in enumerate(models):
        ax = axes[0, j]
        sub = df[df[KEYS.model] == model].sort_values([KEYS.cache, "prec"])
        labels = [f"{c} · {p}" if len(precs) > 1 else c for c, p in zip(sub[KEYS.cache], sub["prec"])]
        x = np.arange(len(sub))
        ax.bar(x, sub[KEYS.retrieval_acc], color=[_cache_color(caches, c) for c in sub[KEYS.cache]])
        if KEYS.retrieval_acc_ref in sub:
            ax.scatter(x, sub[KEYS.retrieval_acc_ref], marker="_", s=400, color="black", zorder=3,
                       label="fp32 full attention")
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_ylim(0, 1.02)
        ax.set_title(model)
        ax.set_ylabel("top-1 accuracy on the second copy")
        ax.legend(frameon=False, fontsize="small")
    fig.suptitle("Retrieval: random sequences shown twice (bars: through the cache; tick: fp32 full attention)")
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
    swept = {kind: [c for c in same if c.startswith("cache_") and c not in (KEYS.cache_budget, KEYS.cache_label)
                    and same[c].notna().any() and (same.groupby("slots")[c].nunique() > 1).any()]
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
    attention's), a row per model. Eviction and windows at each budget side by side."""
    df = budget_quality(runs)
    if df.empty:
        return _message_figure("no cache kind was measured at two or more budgets")
    models, kinds = _levels(df[KEYS.model], MODEL_ORDER), _cache_levels(df["kind"])
    panels = [(k, label) for k, label in ((KEYS.drift_delta_nll, "text ΔNLL vs fp32 full (nats/token)"),
                                          (KEYS.retrieval_acc, "retrieval: copy accuracy")) if k in df]
    fig, axes = plt.subplots(len(models), len(panels), figsize=(5 * len(panels) + 2, 3.6 * len(models)),
                             squeeze=False, layout="constrained")
    for i, model in enumerate(models):
        sub = df[df[KEYS.model] == model]
        for j, (col, ylabel) in enumerate(panels):
            ax = axes[i, j]
            for (kind, name), g in sub.groupby(["kind", "series"]):
                g = g[g[col].notna()].sort_values("slots")
                nth = sorted(sub[sub["kind"] == kind]["series"].unique()).index(name)  # line style within a kind
                if not g.empty:
                    ax.plot(g["slots"], g[col], marker="o", color=_cache_color(kinds, kind),
                            linestyle=DASHES[nth % len(DASHES)], label=name)
            ref = sub[KEYS.retrieval_acc_ref] if KEYS.retrieval_acc_ref in sub else None
            if col == KEYS.retrieval_acc and ref is not None and ref.notna().any():
                ax.axhline(ref.mean(), color="black", linestyle=":", label="fp32 full attention")
                ax.set_ylim(-0.02, 1.02)
            _log2_x(ax, sub["slots"].astype(int))
            ax.set_title(f"{model}: {ylabel.split(':')[0].split(' (')[0]}")
            ax.set_xlabel("slots held per sequence, layer and head (budget)")
            ax.set_ylabel(ylabel)
    fig.suptitle("Quality against budget: what each kind keeps buys (colour = kind, line style = setting)")
    _fig_legend(fig, axes)
    return fig


def _pareto_axes() -> tuple[tuple, tuple]:
    """(quality: (key, label, "low" | "high" is better), cost: (key, label)) of the quality-vs-cost figure."""
    return (((KEYS.drift_delta_nll, "text ΔNLL vs fp32 full (nats/token)", "low"),
             (KEYS.drift_kl_p99, "KL p99 vs fp32 full (nats)", "low"),
             (KEYS.retrieval_acc, "retrieval: copy accuracy", "high")),
            ((KEYS.cache_nbytes, "KV bytes held at the run's end (scales and positions included)"),
             (KEYS.step_ms_cached_at_max_context, "cached decode step at the longest context (ms)")))


def _is_fp32_reference(row: pd.Series) -> bool:
    """The run is fp32 full attention itself: a kind that is exactly full attention with these options (asked of
    the kind's class), in fp32 storage and compute, on an engine that ran its equivalence check."""
    return (row.get(KEYS.storage_dtype) == "float32" and row.get(KEYS.compute_dtype) == "float32"
            and is_full_attention(row))


def is_full_attention(row: pd.Series) -> bool:
    """The run's kind, with the options its ``cache_<name>`` columns record, is exactly full attention (asked of the
    kind's class), whatever its dtype."""
    from models.kv_cache import CACHE_KINDS

    cls = CACHE_KINDS.get(row.get(KEYS.cache))
    if cls is None:
        return False
    options = {name: as_written(row[f"cache_{name}"]) for name in cls.option_types()
               if f"cache_{name}" in row and pd.notna(row[f"cache_{name}"])}
    try:
        return cls.full_attention(cls.parse_options(**options))
    except (TypeError, ValueError):
        return False


def with_reference_at_zero(df: pd.DataFrame, keys) -> pd.DataFrame:
    """``df`` with the fp32 full-attention reference's missing ``keys`` (drift) set to 0: its drift measurements skip
    it, and its equivalence check holds it to 0."""
    df = df.copy()
    if not len(df):
        return df
    reference = df.apply(_is_fp32_reference, axis=1).astype(bool)
    for key in (k for k in keys if k in df):
        df.loc[reference & df[key].isna(), key] = 0.0
    return df


def pareto_points(runs: pd.DataFrame) -> pd.DataFrame:
    """The ok runs as points of the quality-vs-cost figure: a row per run with ``point`` (its cache label · dtype)
    and the quality and cost columns it has. A kind that is exactly full attention, in fp32 storage and compute, is
    the fp32 reference itself (its drift measurements skip it): its drift is drawn at 0, which its equivalence
    check holds it to. Empty when fewer than two settings have a quality and a cost."""
    if KEYS.status not in runs:
        return runs.iloc[0:0]
    df = runs[runs[KEYS.status] == "ok"]  # the kind's name in cache (for _is_fp32_reference), not its label
    quality_axes, cost_axes = _pareto_axes()
    quality = [q for q, _, _ in quality_axes if q in df]
    cost = [c for c, _ in cost_axes if c in df]
    if not quality or not cost:
        return df.iloc[0:0]
    df = _ok(with_reference_at_zero(df, [q for q in quality if q != KEYS.retrieval_acc]))  # cache: the label (kind + options), so two settings of one kind are two points
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


def pareto_plot(runs: pd.DataFrame) -> Figure:
    """Quality against what it costs, a point per setting (cache label · dtype; a model's runs together): rows are
    text ΔNLL, KL p99 and retrieval, columns bytes per cached token and the step at the longest context; the line
    joins the frontier (the settings no other beats on both). kvpress's headline plot, with measured bytes."""
    df = pareto_points(runs)
    if df.empty:
        return _message_figure("fewer than two settings with a quality and a cost measured")
    quality_axes, cost_axes = _pareto_axes()
    rows = [q for q in quality_axes if q[0] in df and df[q[0]].notna().any()]
    cols = [c for c in cost_axes if c[0] in df and df[c[0]].notna().any()]
    caches = _cache_levels(df[KEYS.cache])
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(5.5 * len(cols) + 1, 3.6 * len(rows)), squeeze=False,
                             layout="constrained")
    for i, (q, qlabel, better) in enumerate(rows):
        for j, (c, clabel) in enumerate(cols):
            ax = axes[i, j]
            for model, sub in df.groupby(KEYS.model):
                sub = sub[sub[q].notna() & sub[c].notna()]
                ax.scatter(sub[c], sub[q], color=[_cache_color(caches, k) for k in sub[KEYS.cache]], zorder=3)
                for _, r in sub.iterrows():
                    ax.annotate(r["point"], (r[c], r[q]), fontsize="x-small", xytext=(3, 3),
                                textcoords="offset points")
                front = sub.loc[pareto_front(sub[c], sub[q], better)]
                ax.plot(front[c], front[q], color="black", linewidth=1, label=f"frontier ({model})")
            ax.set_xlabel(clabel)
            ax.set_ylabel(qlabel)
            _log_y_if_decades(ax, df[q])
    fig.suptitle("Quality against cost, a point per setting (line: the frontier)")
    _fig_legend(fig, axes)
    return fig

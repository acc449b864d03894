"""The server's figures and comparisons (``experiment=serving``): continuous batching per cache kind under one K/V
budget, at several request rates, over several workload seeds.

    server_points(runs)              one row per ok server run: kind, rate, seed, budget and its figures
    server_compare(runs, a, b, key)  per workload, rate and budget: the ratio a / b of ``key`` paired by seed, its
                                     mean and a 95% t-interval over the seeds (n = seeds both ran); runs of other
                                     workloads (a trace against a drawn stream, other settings) never pair
    rate_plot(runs)                  throughput and p99 latency against request rate, a line per kind (vLLM's
                                     Figure 12 shape); bars: 95% t-intervals over seeds
    memory_plot(runs)                K/V bytes holding tokens vs held, per kind (vLLM's Figure 2)
    running_plot(timeline)           requests running over time, a line per kind, a panel per rate (seed 0)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from harness.common.stats import mean_interval as t_interval  # mean, 95% t-interval, n (NaN bounds from one)
from harness.analysis.plots import _message_figure, _ok, plt

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ALL_AT_ONCE = "all at once"
PREFIX = " + prefix cache"  # a kind's label when its runs shared prompt blocks (serve.prefix_caching)
POINT_COLUMNS = ["kind", "series", "workload", "workload_name", "rate", "seed", "budget", "requests_per_s",
                 "tokens_per_s", "ttft_p99", "e2e_p99", "normalized", "ttft_median", "prefilled", "peak_running",
                 "mean_running", "token_share", "held_peak", "used_peak", "preemptions"]
POINT_KEYS = {"requests_per_s": "server_requests_per_s", "tokens_per_s": "server_output_tokens_per_s",
              "ttft_p99": "server_ttft_ms_p99", "e2e_p99": "server_e2e_ms_p99",
              "normalized": "server_normalized_latency_ms", "ttft_median": "server_ttft_ms_median",
              "prefilled": "server_prefilled_tokens", "peak_running": "server_peak_running",
              "mean_running": "server_mean_running", "token_share": "server_kv_token_share",
              "held_peak": "server_kv_held_peak", "used_peak": "server_kv_used_peak",
              "preemptions": "server_preemptions"}


def served(runs: pd.DataFrame) -> bool:
    """Whether any ok run served requests (the figures' ``when``)."""
    return "server_requests" in runs and _ok(runs)["server_requests"].notna().any()


def _rate(x) -> float:
    return math.inf if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _workloads(df: pd.DataFrame) -> list[str]:
    """Each run's workload id (``server_workload_id``: the trace or drawn distribution and the server's settings);
    "" for a run of an earlier kvlab that did not record it."""
    if "server_workload_id" not in df:
        return [""] * len(df)
    return ["" if not isinstance(w, str) else w for w in df["server_workload_id"]]


def _workload_names(df: pd.DataFrame) -> list[str]:
    """Each run's workload for people: a trace by its file, a drawn workload by its id."""
    traces = df["server_trace"] if "server_trace" in df else [None] * len(df)
    return [f"trace {str(t).rsplit('/', 1)[-1]}" if isinstance(t, str) and t else f"workload {w or 'not recorded'}"
            for w, t in zip(_workloads(df), traces)]


def server_points(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per ok server run (and one per peer beside it): ``kind``, ``series`` (what a figure draws a line
    for: the kind, and where the runs served more than one workload, which one, so no line joins two workloads),
    ``workload`` (its id), rate, seed, budget and the figures."""
    df = _ok(runs)
    if "server_requests" not in df:
        return pd.DataFrame(columns=POINT_COLUMNS)
    df = df[df["server_requests"].notna()]
    shared = df["server_prefix_caching"].fillna(False).astype(bool) if "server_prefix_caching" in df else False
    kinds = df["cache_label"].astype(str) + np.where(shared, PREFIX, "")
    out = _points(df, list(kinds), POINT_KEYS)
    if "server_hf_requests_per_s" in df:
        ran = df["server_hf_requests_per_s"].notna()
        out = pd.concat([out, _points(df[ran], [PEER] * int(ran.sum()), PEER_KEYS)], ignore_index=True)
    several = out["workload"].nunique() > 1
    out["series"] = out["kind"] + " · " + out["workload_name"] if several else out["kind"]
    return out[POINT_COLUMNS]


def _points(df: pd.DataFrame, kinds: list[str], keys: dict) -> pd.DataFrame:
    """Rows of ``server_points`` from ``df``'s runs: the figures ``keys`` names (a key a run of an earlier kvlab did
    not record, or the peer does not observe: NaN); ``series`` is filled in by ``server_points``."""
    out = pd.DataFrame({"kind": kinds, "series": None, "workload": _workloads(df),
                        "workload_name": _workload_names(df), "rate": [_rate(x) for x in df["server_rate"]],
                        "seed": df["seed"] if "seed" in df else 0, "budget": df["server_kv_budget"]}).reset_index(drop=True)
    for col in POINT_COLUMNS[7:]:
        key = keys.get(col)
        out[col] = df[key].astype(float).to_numpy() if key in df else np.nan
    return out


PEER = "HF continuous batching"
PEER_KEYS = {"requests_per_s": "server_hf_requests_per_s", "tokens_per_s": "server_hf_output_tokens_per_s",
             "ttft_p99": "server_hf_ttft_ms_p99", "e2e_p99": "server_hf_e2e_ms_p99",
             "normalized": "server_hf_normalized_latency_ms", "peak_running": "server_hf_peak_running",
             "held_peak": "server_hf_kv_held"}


def server_compare(runs: pd.DataFrame, a: str, b: str, key: str) -> pd.DataFrame:
    """Per (workload, rate, budget): ``key`` of kind ``a`` over kind ``b`` (cache labels), paired by seed: the
    geometric mean of the ratios and its 95% t-interval (made on their logarithms), and n. Runs pair only on equal
    workloads (``server_workload_id``): a traced run never pairs with a drawn one, nor runs of other settings."""
    p = server_points(runs)
    rows = []
    for (workload, rate, budget), sub in p.groupby(["workload", "rate", "budget"], sort=True):
        # a seed that several runs of a kind share (a sweep over another axis too): their mean
        x = sub[sub["kind"] == a].groupby("seed")[key].mean()
        y = sub[sub["kind"] == b].groupby("seed")[key].mean()
        both = x.index.intersection(y.index)
        logs = [math.log(float(x[s]) / float(y[s])) for s in both if float(y[s]) > 0 and float(x[s]) > 0]
        m, lo, hi, n = (math.exp(v) if i < 3 and math.isfinite(v) else v for i, v in enumerate(t_interval(logs)))
        rows.append(dict(workload=workload, workload_name=sub["workload_name"].iloc[0], rate=rate, budget=budget, a=a,
                         b=b, key=key, ratio=m, low=lo, high=hi, n=n))
    return pd.DataFrame(rows, columns=["workload", "workload_name", "rate", "budget", "a", "b", "key", "ratio", "low",
                                       "high", "n"])


def unpaired(runs: pd.DataFrame, a: str, b: str) -> str | None:
    """A line when kinds ``a`` and ``b`` both served but on no common workload: "not paired: different workloads"
    and what each ran (None when some of their runs pair)."""
    p = server_points(runs)
    wa, wb = set(p.loc[p["kind"] == a, "workload"]), set(p.loc[p["kind"] == b, "workload"])
    if not wa or not wb or wa & wb:
        return None
    ok = _ok(runs)
    words = {}
    if "server_workload" in ok and "server_workload_id" in ok:
        words = dict(zip(ok["server_workload_id"].astype(str), ok["server_workload"].astype(str)))

    def say(ids):
        return "; or ".join(words.get(w, "not recorded (an earlier kvlab)") for w in sorted(ids))

    return f"{a} over {b}: not paired: different workloads ({a}: {say(wa)}. {b}: {say(wb)})."


def _x(rates: list[float]) -> dict[float, int]:
    """Where each rate sits on the x axis: evenly, in order, "all at once" last."""
    return {r: i for i, r in enumerate(sorted(rates))}


def _rate_label(r: float) -> str:
    return ALL_AT_ONCE if math.isinf(r) else f"{r:g}/s"


def rate_plot(runs: pd.DataFrame) -> Figure:
    p = server_points(runs)
    if p.empty:
        return _message_figure("no ok run served requests (serve.requests > 0)")
    xs = _x(sorted(set(p["rate"])))
    panels = (("tokens_per_s", "output tokens / s"), ("normalized", "normalized latency (ms / output token)"),
              ("e2e_p99", "p99 arrival to last token (ms)"), ("ttft_p99", "p99 time to first token (ms)"))
    fig, grid = plt.subplots(2, 2, figsize=(12, 7.5), layout="constrained")
    axes = grid.ravel()
    for ax, (col, label) in zip(axes, panels):
        for kind, sub in p.groupby("series", sort=False):  # a kind, and its workload where there are several
            stats = [(xs[r], *t_interval(s[col])[:3]) for r, s in sub.groupby("rate")]
            x, m, lo, hi = (np.array(v, dtype=float) for v in zip(*stats))
            err = np.vstack([m - np.where(np.isnan(lo), m, lo), np.where(np.isnan(hi), m, hi) - m])
            ax.errorbar(x, m, yerr=err, marker="o", capsize=3, label=kind)
        ax.set_xticks(list(xs.values()), [_rate_label(r) for r in xs])
        ax.set_xlabel("request rate (Poisson arrivals; a trace's, measured from its arrivals)")
        ax.set_ylabel(label)
        if col != "tokens_per_s":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    budget = ", ".join(f"{b / 1e6:g} MB" for b in sorted(set(p["budget"])))
    fig.suptitle(f"Continuous batching under a K/V budget of {budget}: throughput and tail latency per cache kind")
    return fig


def memory_plot(runs: pd.DataFrame) -> Figure:
    p = server_points(runs)
    if p.empty:
        return _message_figure("no ok run served requests (serve.requests > 0)")
    top = p[p["rate"] == max(p["rate"])]  # the heaviest load: memory is what limits
    kinds = list(dict.fromkeys(top["series"]))  # a kind, and its workload where there are several
    top = top.assign(kind=top["series"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    share = [100 * t_interval(top[top["kind"] == k]["token_share"])[0] for k in kinds]
    axes[0].bar(kinds, share, color="tab:green", label="holding tokens")
    axes[0].bar(kinds, [100 - s for s in share], bottom=share, color="tab:grey", label="held, holding no token")
    axes[0].set_ylabel("share of the K/V bytes held, over time (%)")
    axes[0].legend(fontsize=8)
    held = [t_interval(top[top["kind"] == k]["held_peak"])[0] / 1e6 for k in kinds]
    used = [t_interval(top[top["kind"] == k]["used_peak"])[0] / 1e6 for k in kinds]
    w = 0.38
    pos = np.arange(len(kinds))
    axes[1].bar(pos - w / 2, held, w, label="most held")
    axes[1].bar(pos + w / 2, used, w, label="most holding tokens")
    axes[1].set_xticks(pos, kinds)
    axes[1].set_ylabel("K/V MB")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    rate = max(top["rate"])
    fig.suptitle(f"What the K/V budget holds, per kind (rate {_rate_label(rate)}, mean over seeds)")
    return fig


def running_plot(timeline: pd.DataFrame) -> Figure:
    df = _ok(timeline)
    if df.empty or "running" not in df:
        return _message_figure("no ok run served requests (serve.requests > 0)")
    df = df.assign(rate=[_rate(x) for x in df["server_rate"]])
    if "seed" in df and df["seed"].notna().any():
        df = df[df["seed"] == df["seed"].min()]
    rates = sorted(set(df["rate"]))
    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 3.8), squeeze=False, layout="constrained")
    shared = df["server_prefix_caching"].fillna(False).astype(bool) if "server_prefix_caching" in df else False
    df = df.assign(kind=df["cache_label"].astype(str) + np.where(shared, PREFIX, ""))
    for ax, rate in zip(axes[0], rates):
        for kind, sub in df[df["rate"] == rate].groupby(["kind", "run_name"], sort=False):
            kind = kind[0]
            ax.step(sub["time_s"], sub["running"], where="post", label=str(kind), lw=1.2)
        ax.set_title(f"rate {_rate_label(rate)}", fontsize=10)
        ax.set_xlabel("server time (s)")
        ax.set_ylabel("requests running")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Requests running at once under the K/V budget (seed 0)")
    return fig


# ---- findings -------------------------------------------------------------------------------------------------

VLLM_THROUGHPUT = ("vLLM (Kwon et al., SOSP 2023, arXiv 2309.06180, abstract): \"vLLM improves the throughput of "
                   "popular LLMs by 2-4× with the same level of latency compared to the state-of-the-art systems, "
                   "such as FasterTransformer and Orca.\"")
VLLM_MEMORY = ("vLLM (§1): \"only 20.4% - 38.2% of the KV cache memory is used to store the actual token states in "
               "the existing systems\" (Figure 2 gives vLLM's own share as 96.3).")
BASELINE = "prealloc"  # the reserving kind every other is compared with
HOW = "geometric mean of the per-seed ratios, 95% t-interval over the seeds on their logarithms"


def _interval(m: float, lo: float, hi: float, n: int) -> str:
    """A ratio and its 95% interval; none from one seed, or where every seed gave the same ratio (no width: it says
    the seeds agreed, not how far the ratio could move)."""
    if n < 2 or not math.isfinite(lo):
        return f"{m:.2f}× (n = {n}: no interval)"
    if not lo < hi:
        return f"{m:.2f}× (n = {n} seeds, no spread: no interval)"
    return f"{m:.2f}× [{lo:.2f}, {hi:.2f}] (n = {n} seeds)"


def _against(lo: float, hi: float, n: int, low: float = 2.0, high: float = 4.0) -> str:
    """Where an interval of a ratio lies against vLLM's 2-4× (no interval, no verdict)."""
    if n < 2 or not math.isfinite(lo):
        return "inconclusive (one seed)"
    if not lo < hi:
        return "inconclusive (no spread over the seeds: no interval)"
    if lo >= low and hi <= high:
        return "within vLLM's 2-4×"
    if hi < low:
        return "below vLLM's 2-4×"
    if lo > high:
        return "above vLLM's 2-4×"
    return "inconclusive against vLLM's 2-4× (the interval crosses its bounds)"


def findings(runs: pd.DataFrame) -> list[tuple[str, tuple[str, ...]]]:
    """Sentences about a sweep's server runs, each with the runs it reads: every kind against the reserving
    baseline (prealloc), at each rate and budget, for concurrency and throughput; and what the budget held."""
    p = server_points(runs)
    if p.empty:
        return []
    ok = _ok(runs)
    ok = ok[ok["server_requests"].notna()]
    names = tuple(ok["run_name"].astype(str))
    shared = ok["server_prefix_caching"].fillna(False).astype(bool) if "server_prefix_caching" in ok else False
    labels = ok["cache_label"].astype(str) + np.where(shared, PREFIX, "")

    def of(*kinds):  # the runs a sentence about these kinds reads (the peer's are the paged runs it ran beside)
        peer = ok["server_hf_requests_per_s"].notna() if "server_hf_requests_per_s" in ok else False
        mask = labels.isin(kinds) | ((PEER in kinds) & peer)
        return tuple(ok.loc[mask, "run_name"].astype(str))

    out = _prefix_findings(runs, p, of)
    if BASELINE not in set(p["kind"]):
        return out
    for kind in [k for k in dict.fromkeys(p["kind"]) if k != BASELINE and not k.endswith(PREFIX)]:
        said = False
        for key, what in (("peak_running", "requests running at once (peak)"),
                          ("tokens_per_s", "output tokens/s")):
            cmp = server_compare(runs, kind, BASELINE, key)
            top = cmp.groupby("workload")["rate"].max()  # the heaviest load of each workload: where the claim is judged
            parts = [f"{_at(r, cmp)}: {_interval(r.ratio, r.low, r.high, r.n)}"
                     + (f", {_against(r.low, r.high, r.n)}" if key == "tokens_per_s" and r.rate == top[r.workload]
                        else "")
                     for r in cmp.itertuples() if r.n]
            if parts:
                said = True
                budget = ", ".join(f"{b / 1e6:g} MB" for b in sorted(set(cmp["budget"])))
                out.append((f"{kind} over {BASELINE} under {budget}, {what}: " + "; ".join(parts)
                            + f" ({HOW}).", of(kind, BASELINE)))
        if not said and (line := unpaired(runs, kind, BASELINE)):
            out.append((line, of(kind, BASELINE)))
    share = p[p["token_share"].notna()].groupby("series", sort=False)["token_share"].agg(["mean", "min", "max"])
    held = "; ".join(f"{k} {100 * r['mean']:.1f}% (runs {100 * r['min']:.1f}-{100 * r['max']:.1f}%)"
                     for k, r in share.iterrows())
    if PEER in set(p["kind"]):
        held += f" ({PEER}'s is not observable from outside it)"
    out.append((f"K/V bytes holding tokens over bytes held, over time: {held}. {VLLM_MEMORY}", names))
    models = ", ".join(dict.fromkeys(ok.loc[ok["server_requests"].notna(), "model"].astype(str)))
    out.append((f"Throughput against the paper: {VLLM_THROUGHPUT} Here: model {models} on this machine's "
                f"{'GPU' if (ok['device'] == 'cuda').any() else 'CPU'}; the ratio that bears on the claim is the "
                "throughput where the baseline is saturated (the highest rate).", names))
    return out


def _prefix_findings(runs: pd.DataFrame, p: pd.DataFrame, of) -> list[tuple[str, tuple[str, ...]]]:
    """What sharing prompt blocks bought: each kind with its prefix cache against itself without, paired by seed
    and rate: tokens the prefills computed, median and p99 time to first token, and the most requests running at
    once (the budget is full either way: the blocks a shared prefix saves hold more requests)."""
    out = []
    for kind in [k for k in dict.fromkeys(p["kind"]) if k.endswith(PREFIX)]:
        base = kind[:-len(PREFIX)]
        if base not in set(p["kind"]):
            continue
        parts = []
        for key, what in (("prefilled", "tokens prefilled"), ("ttft_median", "median TTFT"),
                          ("ttft_p99", "p99 TTFT"), ("peak_running", "most requests running at once")):
            cmp = server_compare(runs, kind, base, key)
            parts += [f"{what} {_at(r, cmp)} {_interval(r.ratio, r.low, r.high, r.n)}"
                      for r in cmp.itertuples() if r.n]
        if parts:
            out.append((f"{kind} over {base} (the same requests, a shared system prompt): " + "; ".join(parts)
                        + f" ({HOW}; below 1× is a saving, above 1× more running).", of(kind, base)))
        elif line := unpaired(runs, kind, base):
            out.append((line, of(kind, base)))
    return out


def _at(r, cmp: pd.DataFrame) -> str:
    """Where a paired ratio was measured: its rate, and its workload where the sweep paired on several."""
    several = cmp.loc[cmp["n"] > 0, "workload"].nunique() > 1
    return f"at {_rate_label(r.rate)}" + (f" ({r.workload_name})" if several else "")

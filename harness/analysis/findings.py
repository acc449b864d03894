"""What a sweep found, in sentences made from its own numbers, and, for the paper presets, each paper's claim beside
kvlab's number from the same sweep.

Every sweep's report opens with its findings (``sweep_findings``): the quality-per-byte frontier; what each swept
axis did (a sentence per axis: the median of each value's runs, as a multiple of the best value's); and anything
that contradicts what a kind promises (an exact kind that is not equivalent, a lossy kind that moved nothing, a kind
that holds fewer bytes than full attention and steps slower). Each sentence names the runs it reads.

A sweep made by a paper preset (``experiment=paper_streamingllm`` and the others in
``harness.analysis.papers.PAPERS``) also gets a claims table: one row per claim with the paper's setting and number
(cited: paper, table or PR), kvlab's setting and number from this sweep, and whether the direction holds (made in
``harness.analysis.papers``). Both go into ``report/findings.md``, the top of report.html and the W&B Report.

    from harness.analysis import findings
    from harness.analysis import results
    runs = results.load_runs("outputs/multirun/2026-12-02_01-00-00")
    for f in findings.sweep_findings(runs): print(f.text, f.runs)
    findings.make(runs)              # the preset's claims (if any) and the sentences, for findings.md and the page

Pure: DataFrames in, dataclasses and text out; no writing, no printing.
"""

from __future__ import annotations

import html
import math
import numbers
from dataclasses import dataclass

import pandas as pd

from harness.measurements import KEYS
from harness.analysis import intervals, papers, server
from harness.analysis.papers import (ClaimRow, adjusted_text, claim_rows, names, num, ok_runs, preset_of,
                                     value, verdict_text)
from harness.analysis.plots import as_written, is_full_attention, option_columns, pareto_front, with_reference_at_zero

FILE = "findings.md"


@dataclass(frozen=True)
class Finding:
    """One sentence about the sweep, and the runs (``run_name``) it reads."""

    text: str
    runs: tuple[str, ...]
    kind: str  # "frontier" | "axis" | "paired" | "surprise" | "serving"


# ---- what every sweep found --------------------------------------------------------------------------------------

QUALITY = ((KEYS.drift_kl_p99, "KL p99", "low"), (KEYS.drift_delta_nll, "text ΔNLL", "low"),
           (KEYS.retrieval_acc, "retrieval", "high"))
STEP = (KEYS.step_ms_cached_at_max_context, "step at the longest context (ms)", "low")
# the config columns a sweep varies that a sentence is written about, beside every cache option (cache_<name>)
AXIS_COLUMNS = (KEYS.model, KEYS.engine, KEYS.cache, KEYS.dtype, KEYS.batch, KEYS.compile, KEYS.prompt_len,
                KEYS.prompt_lengths)


def _label(row: pd.Series) -> str:
    return f"{row.get(KEYS.cache_label, row.get(KEYS.cache))} · {row.get(KEYS.dtype)}"


# the per-position metric behind each quality key, for its interval (harness.analysis.papers.METRICS)
QUALITY_METRIC = {KEYS.drift_kl_p99: "kl_p99", KEYS.drift_delta_nll: "nll", KEYS.retrieval_acc: "copy",
                  KEYS.drift_kl: "kl"}


def _rows_of(frames: dict | None, ok: pd.DataFrame) -> papers.Runs | None:
    return None if not frames else papers.Runs(ok, {}, frames)


def _single(at: papers.Runs | None, row: pd.Series, key: str) -> intervals.Interval | None:
    """One run's quality figure with its interval over its texts (None: no per-position rows)."""
    m = papers.METRICS.get(QUALITY_METRIC.get(key, ""))
    if at is None or m is None:
        return None
    try:
        return at.single(row, m)
    except (papers.NoRows, KeyError, ValueError):
        return None


def _versus(at: papers.Runs | None, a: pd.Series, b: pd.Series, key: str) -> tuple[intervals.Interval, str] | None:
    """Run ``a`` against run ``b`` on a quality key, paired over the units both scored: a ratio (ΔNLL, which may
    sit near zero: a difference), and how it reads; None without per-position rows for both."""
    m = papers.METRICS.get(QUALITY_METRIC.get(key, ""))
    if at is None or m is None:
        return None
    how = "difference" if m.name == "nll" else "ratio"
    try:
        return at.compare(a, b, m, how), how
    except (papers.NoRows, intervals.NotPaired, KeyError, ValueError):
        return None


def frontier_findings(ok: pd.DataFrame, frames: dict | None = None) -> list[Finding]:
    """Per model: the settings on the quality-vs-bytes frontier (text ΔNLL, else KL p99, against cache_nbytes)."""
    out = []
    quality = next(((k, name) for k, name, _ in QUALITY[1::-1] if k in ok and ok[k].notna().any()), None)
    if quality is None or KEYS.cache_nbytes not in ok:
        return out
    key, name = quality
    for model, sub in ok.groupby(KEYS.model):
        sub = sub[sub[key].notna() & sub[KEYS.cache_nbytes].notna()]
        if sub.apply(_label, axis=1).nunique() < 2:
            continue
        front = sub.loc[pareto_front(sub[KEYS.cache_nbytes], sub[key], "low")]
        at = _rows_of(frames, ok)
        points = [f"{_label(r)} ({name} {_with_interval(at, r, key)} at {_bytes(r[KEYS.cache_nbytes])})"
                  for _, r in front.iterrows()]
        beaten = len(sub) - len(front)
        out.append(Finding(
            f"Quality per byte ({model}): the frontier, from fewest bytes held to best {name}, is "
            + "; ".join(points) + (f". The other {beaten} setting{'s' * (beaten != 1)} hold as many bytes or more "
                                   f"for a worse {name}." if beaten else "."),
            names(*[r for _, r in front.iterrows()]), "frontier"))
    return out


def _with_interval(at, row, key) -> str:
    iv = _single(at, row, key)
    if iv is None:
        return num(row[key], signed=True)
    if not iv.shown:
        return f"{num(row[key], signed=True)} ({iv.missing}: no interval)"
    return f"{num(row[key], signed=True)} [{num(iv.lo, True)}, {num(iv.hi, True)}; {iv.n} texts]"


def _signed(x: float) -> str:
    return num(x, True)


def _axes(ok: pd.DataFrame) -> list[str]:
    cols = [c for c in AXIS_COLUMNS if c in ok] + sorted(option_columns(ok))
    return [c for c in cols if ok[c].dropna().map(as_written).nunique() >= 2]


def _axis_name(col: str) -> str:
    return f"cache.{col[len('cache_'):]}" if col.startswith("cache_") else col


def _split(runs: pd.DataFrame, col: str) -> frozenset:
    """How ``col``'s values split the runs (sets of row labels): two axes that split them alike move together."""
    return frozenset(frozenset(idx) for idx in runs.groupby(runs[col].map(as_written), sort=False).groups.values())


def axis_findings(ok: pd.DataFrame, frames: dict | None = None) -> list[Finding]:
    """A sentence per swept axis: each value's median over its runs, for the quality keys that vary and the step
    time, as a multiple of the best value's. An axis that splits the runs exactly as an earlier one does (a window
    that is the budget less the sinks) is named in that one's sentence instead of getting its own. Where each
    value has one run and per-position rows (``frames``), each value is set against the best one with a paired 95%
    interval over the texts (or sequences) both scored. A sweep of several models compares within each model, a
    sentence per axis and model ("cache.k_bits (mini): ..."); the models themselves in one sentence, ``model``'s."""
    base = ok[KEYS.model].map(papers.base_model) if KEYS.model in ok else pd.Series(dtype=object)
    models = list(dict.fromkeys(base.dropna()))
    if len(models) < 2:
        return _axis_findings(ok, frames)
    out = _axis_findings(ok, frames, only=KEYS.model)  # model against model: the one comparison across models
    for m in models:
        out += _axis_findings(ok[base == m], frames, model=m)
    return out


def _axis_findings(ok: pd.DataFrame, frames: dict | None = None, model: str = "", only: str = "") -> list[Finding]:
    """``axis_findings`` on runs of one model (``model``: named in each sentence), or of the axis ``only``."""
    out, said = [], {}  # the runs' split by an axis -> [its sentence's index in out, the axes that follow it]
    metrics = [(k, n, b) for k, n, b in (*QUALITY, STEP) if k in ok and ok[k].dropna().nunique() >= 2]
    for col in [c for c in _axes(ok) if c == only or not only]:
        sub = ok[ok[col].notna()]
        split = _split(sub, col)
        if split in said:
            said[split][1].append(_axis_name(col))
            continue
        parts = [_axis_part(sub, col, *m, at=_rows_of(frames, ok)) for m in metrics]
        parts = [p for p in parts if p]
        if parts:
            said[split] = [len(out), []]
            how = ("one run per value; [..]: a paired 95% interval against the best value's run" if
                   any("] " in p for p in parts) else "one run per value, each against the best value's run" if
                   any(": no interval)" in p for p in parts) else "median of each value's runs")
            out.append(Finding(f"{_axis_name(col)}{f' ({model})' if model else ''}: " + "; ".join(parts)
                               + f" ({how})", tuple(sub[KEYS.run_name].astype(str)), "axis"))
    for i, follow in said.values():
        f = out[i]
        out[i] = Finding(f.text + (f"; {', '.join(follow)} varied with it." if follow else "."), f.runs, f.kind)
    return out


def paired_findings(ok: pd.DataFrame, frames: dict | None = None) -> list[Finding]:
    """An axis of two values whose runs pair one to one on every other swept axis, in two pairs or more (kvlab's
    blocks against llama.cpp's types at each of K alone, V alone and both): per pair, the second value's run over
    the first's in mean KL (else text ΔNLL), paired over the texts both scored, with its 95% interval. (With one run
    per value, ``axis_findings`` already says so.)"""
    key = next((k for k in (KEYS.drift_kl, KEYS.drift_delta_nll) if k in ok and ok[k].notna().any()), None)
    at = _rows_of(frames, ok)
    if key is None or at is None:
        return []
    exact = ok[KEYS.cache_exact].eq(True) if KEYS.cache_exact in ok else pd.Series(False, index=ok.index)
    full = ok.apply(is_full_attention, axis=1).astype(bool) if len(ok) else exact
    # an exact run of full attention drifts by nothing but rounding: no ratio to take; an exact evicting or windowed
    # kind (exact against its own keep-mask) drifts from full attention, and pairs like any other
    drifted = ok[ok[key].notna() & (ok[key] != 0) & ~(exact & full)]
    axes, out, seen = _axes(drifted), [], set()
    splits = {c: _split(drifted, c) for c in axes}
    axes = [c for c in axes if not (splits[c] in seen or seen.add(splits[c]))]  # axes that move together: the first
    for col in axes:
        values = sorted(drifted[col].dropna().map(as_written).unique(), key=_order)
        others = [c for c in axes if c != col]
        if len(values) != 2 or not others:
            continue
        said, used, n, shown = _paired_parts(at, _pairs(drifted, col, values, others), key)
        if len(said) >= 2:
            name, how = ("mean KL", "over") if key == KEYS.drift_kl else ("text ΔNLL", "minus")
            texts = f"{min(n)}" if min(n) == max(n) else f"{min(n)}-{max(n)}"
            least = intervals.MIN_SHOWN
            tail = (f"each a paired 95% interval over the {texts} texts both scored" if all(shown) else
                    f"paired over the {texts} texts both scored: fewer than {least}, so no interval" if max(n) < least
                    else f"a paired 95% interval over the {texts} texts both scored where one is shown; none from "
                         f"fewer than {least} texts or where every resample agrees")
            out.append(Finding(
                f"{_axis_name(col)} {values[1]} {how} {values[0]}, run for run at the same "
                f"{', '.join(_axis_name(c) for c in others)}: {name} " + "; ".join(said) + f" ({tail}).",
                names(*used), "paired"))
    return out


def _paired_parts(at: papers.Runs, pairs: list, key: str) -> tuple[list[str], list, list[int], list[bool]]:
    """Each pair's "<label> <ratio>× [lo, hi]" (ΔNLL: a difference), the runs behind them, each one's texts and
    whether its interval is shown; a pair whose figure or interval is not finite says nothing."""
    said, used, n, shown = [], [], [], []
    for label, (a, b) in pairs:
        got = _versus(at, b, a, key)
        if got is None or not math.isfinite(got[0].estimate) or (got[0].n >= intervals.MIN_SHOWN and not all(
                math.isfinite(x) for x in (got[0].lo, got[0].hi))):
            continue
        iv, how = got
        said.append(f"{label} " + (iv.text(".3g", "×") if how == "ratio" else iv.text(_signed)))
        used += [a, b]
        n.append(iv.n)
        shown.append(iv.shown)
    return said, used, n, shown


def _pairs(ok: pd.DataFrame, col: str, values: list, others: list[str]) -> list[tuple[str, tuple]]:
    """[(the other axes' values, (the run at values[0], the run at values[1]))] where exactly one run of each value
    has them."""
    keyed = ok.assign(_at=ok[others].apply(lambda r: tuple(_short(v) for v in r.fillna("—")), axis=1))
    out = []
    for at, g in keyed.groupby("_at"):
        rows = [g[g[col].map(as_written) == v] for v in values]
        if all(len(r) == 1 for r in rows):
            out.append(("/".join(at), (rows[0].iloc[0], rows[1].iloc[0])))
    return out


def _axis_part(sub: pd.DataFrame, col: str, key: str, name: str, better: str, at=None) -> str:
    """"<metric> <value> <median> (<ratio>× <best value>'s), ..." for one axis, or "" where fewer than two values
    have the metric. With one run per value and per-position rows (``at``), the comparison with the best value is
    paired and carries its interval: "(1.31× [1.12, 1.52] 8's)", or for ΔNLL "(+0.031 [+0.012, +0.050] over 8's)";
    from one text, or with no spread, no interval: "(1.31× 8's; n = 1: no interval)"."""
    groups = sub.groupby(sub[col].map(as_written), sort=False)
    med = groups[key].median().dropna()
    med = med.iloc[sorted(range(len(med)), key=lambda i: _order(med.index[i]))]
    if len(med) < 2:
        return ""
    top = med.idxmin() if better == "low" else med.idxmax()
    one = {v: g[g[key].notna()] for v, g in groups if v in med.index}
    single = all(len(g) == 1 for g in one.values())

    def against_top(value, m):
        if m == med[top]:
            return ""
        got = _versus(at, one[value].iloc[0], one[top].iloc[0], key) if single else None
        if got is not None and got[0].shown:
            iv, how = got
            return (f" ({iv.text('.3g', '×')} {_short(top)}'s)" if how == "ratio" else
                    f" ({iv.text(_signed)} over {_short(top)}'s)")
        if got is not None and math.isfinite(got[0].estimate):
            iv, how = got
            return (f" ({iv.estimate:.3g}× {_short(top)}'s; {iv.missing}: no interval)" if how == "ratio" else
                    f" ({num(iv.estimate, True)} over {_short(top)}'s; {iv.missing}: no interval)")
        return f" ({m / med[top]:.3g}× {_short(top)}'s)" if med[top] else ""

    shown = [f"{_short(value)} {num(m)}" + against_top(value, m) for value, m in med.items()]
    return f"{name} " + ", ".join(shown)


def _order(value) -> tuple:
    """Numbers in their order (numpy's too), then text in its own (an axis may mix them)."""
    return (0, value, "") if isinstance(value, numbers.Real) and not isinstance(value, bool) else (1, 0, str(value))


def _short(value) -> str:
    return str(as_written(value))


def surprise_findings(runs: pd.DataFrame, ok: pd.DataFrame) -> list[Finding]:
    """What contradicts what a kind promises."""
    out = []
    if KEYS.status in runs:
        for _, r in runs[runs[KEYS.status] == "not_equivalent"].iterrows():
            out.append(Finding(
                f"{_label(r)} is an exact kind whose output differs from its reference (max |Δlogit| "
                f"{num(value(r, KEYS.max_abs_logit_diff))}): a failure, not a finding; its numbers are left out.",
                names(r), "surprise"))
    drift_keys = [k for k in (KEYS.drift_kl, KEYS.drift_max_abs, KEYS.drift_delta_nll) if k in ok]
    if KEYS.cache_exact in ok and drift_keys:
        lossy = ok[(ok[KEYS.cache_exact].map(as_written) == False) & ok[drift_keys].notna().any(axis=1)]  # noqa: E712
        for _, r in lossy.iterrows():
            measured = [k for k in drift_keys if pd.notna(r[k])]  # a figure never measured says nothing
            if all(r[k] == 0 for k in measured):
                out.append(Finding(f"{_label(r)} is a lossy kind but moved nothing ({', '.join(measured)} "
                                   f"{'all ' * (len(measured) > 1)}0): check that it quantised or evicted at all in "
                                   "this setting.", names(r), "surprise"))
    out += _slower_than_bytes(ok)
    return out


def _slower_than_bytes(ok: pd.DataFrame) -> list[Finding]:
    """A run that holds fewer bytes than a full-attention run of the same model, engine, device, batch and dtype,
    and whose step at the longest context is slower than that run's."""
    key, nb = KEYS.step_ms_cached_at_max_context, KEYS.cache_nbytes
    if key not in ok or nb not in ok or not len(ok):
        return []
    out = []
    same = [c for c in (KEYS.model, KEYS.engine, KEYS.device, KEYS.batch, KEYS.dtype, KEYS.max_context_len) if c in ok]
    full = ok.apply(is_full_attention, axis=1).astype(bool)
    timed = ok[ok[key].notna() & ok[nb].notna()]
    for _, group in timed.groupby(timed[same].astype(str).agg("|".join, axis=1)):  # mixed types group as text
        base = group[full.loc[group.index]]
        if base.empty:
            continue
        b = base.sort_values(nb).iloc[0]
        for _, r in group[~full.loc[group.index]].iterrows():
            if r[nb] < b[nb] and r[key] > b[key]:
                out.append(Finding(
                    f"{_label(r)} holds {r[nb] / b[nb]:.2f}× {_label(b)}'s bytes but its step at context "
                    f"{int(value(r, KEYS.max_context_len) or 0)} takes {r[key] / b[key]:.2f}× its time: it costs "
                    "more than its bytes say (a step that reads K/V where they lie would cost less).",
                    names(r, b), "surprise"))
    return out


def sweep_findings(runs: pd.DataFrame, frames: dict | None = None) -> list[Finding]:
    """Every finding of a sweep: the frontier, the swept axes, and what contradicts expectations; intervals where
    ``frames`` holds the runs' per-position rows."""
    if runs is None or not len(runs) or KEYS.status not in runs:
        return []
    ok = with_reference_at_zero(ok_runs(runs), [k for k, _, _ in QUALITY[:2]])
    served = [Finding(text, runs_, "serving") for text, runs_ in server.findings(runs)]
    return (frontier_findings(ok, frames) + axis_findings(ok, frames) + paired_findings(ok, frames)
            + surprise_findings(runs, ok) + served)


# ---- as text -----------------------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


INTERVAL_HOW = ("a paired t-interval over the texts (or copied sequences) both runs scored: Student's t with n − 1 "
                "degrees of freedom times the jackknife standard error over them, a ratio's on its logarithm")
HOLM = "after Holm"  # the scorecard's column: each verdict after the family's multiplicity correction


def scorecard_words(claims: list[ClaimRow]) -> str:
    """What the scorecard's correction is over, in words ("" when no row counts)."""
    family = next((r.family for r in claims if r.family), "")
    if not family:
        return ""
    return (f"The scorecard is the family of {family}: the \"{HOLM}\" column is each claim's verdict after Holm's "
            f"step-down correction (every interval of a claim widened to 1 − {papers.ALPHA:.2f} / k for the k claims "
            f"not yet decided), which holds the chance of any wrong verdict among them to {papers.ALPHA:.0%}; "
            "\"verdict\" is the claim's own at 95%.")


def _source(r: ClaimRow) -> str:
    if r.kind == papers.CONSTRUCTION:
        return f"{r.source} [{r.kind}: {r.why_fixed}]" if r.why_fixed else f"{r.source} [{r.kind}]"
    return r.source if r.kind == papers.PAPER else f"{r.source} [{r.kind}]"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


@dataclass(frozen=True)
class Made:
    """A sweep's findings, made once: the paper preset (if any), its claims and the sweep's sentences."""

    preset: str | None
    claims: list[ClaimRow]
    sentences: list[Finding]


def make(runs: pd.DataFrame, frames: dict[str, pd.DataFrame] | None = None) -> Made:
    """The findings of ``runs``; ``frames`` (``results.load_tables``) gives the per-position rows every interval is
    made from (without them, claims are not judged and sentences carry no interval)."""
    return Made(preset_of(runs), claim_rows(runs, frames), sweep_findings(runs, frames))


def by_claim(claims: list[ClaimRow]) -> tuple[list[str], list[list[ClaimRow]]]:
    """(the models, each claim's rows in that order): a sweep of one model has one row a claim and no model names;
    one of several (``claim_rows`` made a row per claim and model) a column group per model."""
    models = list(dict.fromkeys(r.model for r in claims if r.model))
    if not models:
        return [], [[r] for r in claims]
    groups: dict[str, list[ClaimRow]] = {}
    for r in claims:
        groups.setdefault(r.claim, []).append(r)
    return models, list(groups.values())


def _claims_markdown(made: Made) -> list[str]:
    """The claims table: the paper's columns, then kvlab's number, n and verdict (a group of three per model)."""
    models, rows = by_claim(made.claims)
    ours = [(f"kvlab ({m})", f"n ({m})", f"verdict ({m})", f"{HOLM} ({m})") for m in models] or [
        ("kvlab", "n", "verdict", HOLM)]
    head = ["claim", "source", "paper's words", "paper's setting", "paper", "kvlab's setting",
            *(h for group in ours for h in group), "runs"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in rows:
        r = group[0]
        cells = [r.claim, _source(r), r.quote, r.paper_setting, r.paper_number, r.our_setting]
        for g in group:
            cells += [g.our_number, g.n or "—", verdict_text(g), adjusted_text(g)]
        cells.append(", ".join(name for g in group for name in g.runs))
        out.append("| " + " | ".join(_md(x) for x in cells) + " |")
    return out


def markdown(made: Made) -> str:
    """findings.md: the claims table (paper presets) and the sweep's findings, each naming its runs."""
    out = ["# Findings", ""]
    if made.claims:
        metric = papers.METRICS[made.claims[0].metric]
        out += [f"Claims checked by `experiment={made.preset}` (harness/analysis/papers.py says how each is tested). "
                f"The text claims are decided by {metric.label}, the others shown beside it. Each figure in brackets "
                f"is a 95% interval: {INTERVAL_HOW}; n is the number of units resampled (from one unit, or with no "
                f"spread, a figure has no interval; from fewer than {intervals.MIN_UNITS} a claim has no verdict: "
                f"\"not judged: n = ...\"). A verdict is \"holds\" or "
                "\"does not hold\" only when the interval lies wholly on one side of the claim's bound (or margin), "
                "otherwise \"inconclusive\". Each verdict reads only runs of the setting its row states (conf/"
                f"experiment/{made.preset}.yaml); \"not judged\" says which setting the runs differ in, why they "
                "cannot show the effect, or which premise of the claim the model lacks. Rows marked \"kvlab's own "
                "check\" have no paper number behind them. \"by construction\" rows are decided by their own "
                "setting (an injected cause, a control that cannot reach; the source column says how): sanity "
                "checks, shown with what they gave, in no scorecard. " + scorecard_words(made.claims)
                + (" The sweep ran several models: each claim is judged on each model's runs alone, a "
                   "column group per model." if by_claim(made.claims)[0] else ""), "",
                *_claims_markdown(made)]
        out.append("")
    if made.sentences:
        out += ["## What this sweep found", ""]
        out += [f"- {f.text} (runs: {', '.join(f.runs)})" for f in made.sentences]
    else:
        out.append("Nothing to say: fewer than two ok settings, or no quality or cost measured.")
    return "\n".join(out) + "\n"


def html_section(made: Made) -> str:
    """The Findings section at the top of report.html ("" when there is nothing to say)."""
    if not made.claims and not made.sentences:
        return ""
    parts = ["<h2>Findings</h2>"]
    if made.claims:
        metric = papers.METRICS[made.claims[0].metric]
        models, rows = by_claim(made.claims)
        ours = [h for m in models for h in (f"kvlab ({m})", f"n ({m})", f"verdict ({m})", f"{HOLM} ({m})")] or [
            "kvlab", "n", "verdict", HOLM]
        head = "".join(f"<th>{html.escape(h)}</th>" for h in ("claim", "source", "paper's words", "paper's setting",
                                                               "paper", "kvlab's setting", *ours))

        def cell(x) -> str:
            return f"<td>{html.escape(str(x))}</td>"

        def judged(r: ClaimRow) -> str:
            adjusted = {intervals.HOLDS: "#070", intervals.FAILS: "#c00"}.get(r.adjusted, "#666")
            return (cell(r.our_number) + cell(r.n or "—") + f"<td style='color:"
                    f"{'#070' if r.holds else '#c00' if r.holds is False else '#666'}'><b>{verdict_text(r)}</b></td>"
                    f"<td style='color:{adjusted}'><b>{html.escape(adjusted_text(r))}</b></td>")

        body = "".join("<tr>" + "".join(cell(x) for x in (g[0].claim, _source(g[0]), g[0].quote, g[0].paper_setting,
                                                          g[0].paper_number, g[0].our_setting))
                       + "".join(judged(r) for r in g) + "</tr>" for g in rows)
        parts.append(f"<p>Text claims decided by {html.escape(metric.label)}; brackets: 95% intervals "
                     f"({html.escape(INTERVAL_HOW)}). {html.escape(scorecard_words(made.claims))}</p>"
                     f"<table class='t findings'><tr>{head}</tr>{body}</table>")
    if made.sentences:
        parts.append("<ul>" + "".join(f"<li>{html.escape(f.text)} <small>(runs: {html.escape(', '.join(f.runs))})"
                                      "</small></li>" for f in made.sentences) + "</ul>")
    return "".join(parts)

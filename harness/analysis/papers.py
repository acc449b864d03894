"""The papers' claims kvlab checks, each beside kvlab's number from a paper preset's sweep.

A claim is about one setting, stated once, in its preset's YAML (conf/experiment/<preset>.yaml, read here by
``preset``); ``PAPERS`` maps each preset to its claims, one to one with the paper_*.yaml files (a test holds them
to it). A claim's verdict reads only runs that recorded its setting, and only when its control can show the effect
(full attention that copies, a window that costs something); otherwise it is "not judged", and says which setting
differs or why nothing can be judged.

    from harness.analysis import papers
    papers.claim_rows(runs)          # [] for a sweep that is not a paper preset
    papers.preset("paper_h2o")       # what its YAML fixes, links and sweeps

Pure but for reading the presets' YAML: DataFrames in, dataclasses and text out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
from omegaconf import OmegaConf

from harness.analysis import intervals
from harness.analysis.plots import as_written
from harness.measurements import KEYS


PAPER, OWN, CONSTRUCTION = "paper", "kvlab's own check", "by construction"


@dataclass(frozen=True)
class Claim:
    """A paper's claim and how to test it on a preset's runs. Its setting is its preset's (the cache kind, dtype,
    engine and cache options conf/experiment/<preset>.yaml states) and the top-level keys of that YAML it names in
    ``about`` ("weights": a trained model). ``quote`` is the paper's own sentence or table cell, verbatim; ``kind``
    says whether the row is a paper's claim (``PAPER``), a check of kvlab's own with no paper number behind it
    (``OWN``), or decided by its own setting (``CONSTRUCTION``, ``why_fixed`` says how: an injected cause, a
    control that cannot reach; shown as a sanity check, never counted in a scorecard).
    ``test(runs of that setting)`` returns (what it compares, our numbers with their intervals, the verdict:
    ``intervals.HOLDS`` / ``FAILS`` / ``INCONCLUSIVE``, None when there is no direction to judge, or ``NotJudged``
    when its control cannot show the effect; the runs read)."""

    claim: str
    source: str  # paper (arXiv id) and table, or PR
    quote: str  # the paper's own words or table cells
    paper_setting: str
    paper_number: str
    test: Callable[["Runs"], tuple[str, str, "str | None | NotJudged", tuple[str, ...]]]
    about: tuple[str, ...] = ()
    kind: str = PAPER
    why_fixed: str = ""  # a CONSTRUCTION row: why its setting decides it whatever the model does


@dataclass(frozen=True)
class ClaimRow:
    claim: str
    source: str
    quote: str
    paper_setting: str
    paper_number: str
    kind: str  # PAPER, OWN or CONSTRUCTION
    metric: str  # the metric that decides the preset's text claims (``PRESET_METRIC``)
    our_setting: str
    our_number: str  # "not judged: <why>" when not judged
    verdict: str | None  # intervals.HOLDS / FAILS / INCONCLUSIVE; None: not judged, nothing to judge, or missing
    runs: tuple[str, ...]
    not_judged: str = ""  # why there is no verdict: a setting the runs differ in, or a control that cannot show it
    n: str = ""  # the units each interval resampled: "40 texts"
    model: str = ""  # the model whose runs it read, when the sweep ran several (a column each in findings.md)
    why_fixed: str = ""  # a CONSTRUCTION row: why its setting decides it
    adjusted: str | None = None  # the verdict after the scorecard's multiplicity correction (``scorecard``)
    family: str = ""  # the family of tests that correction was made over, in words
    decide: Callable[[float], "str | None"] | None = dataclasses.field(default=None, compare=False, repr=False)
    # the verdict at another level (the claim's test run again with every interval at it): what a correction reads

    @property
    def holds(self) -> bool | None:
        """True or False only for a paper's claim (or kvlab's own check) whose interval decides it."""
        if self.kind == CONSTRUCTION:
            return None
        return {intervals.HOLDS: True, intervals.FAILS: False}.get(self.verdict)


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs[KEYS.status] == "ok"] if KEYS.status in runs else runs.iloc[0:0]


def value(row: pd.Series | None, key: str) -> float | None:
    if row is None or key not in row or pd.isna(row[key]):
        return None
    return float(row[key])


def names(*rows) -> tuple[str, ...]:
    return tuple(str(r[KEYS.run_name]) for r in rows if r is not None and KEYS.run_name in r)


def num(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:+.2e}" if signed else f"{x:.2e}"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def absent(*rows) -> bool:
    """Whether any of the runs an arm needs was not found."""
    return any(r is None for r in rows)


def missing(*rows) -> tuple[str, str, None, tuple]:
    return "—", "not in this sweep (a run failed or was not asked for)", None, names(*rows)


def ppl_change(row: pd.Series | None) -> float | None:
    """Perplexity change of the text against fp32 full attention, in percent."""
    nll, ref = value(row, KEYS.text_nll), value(row, KEYS.text_nll_fp32)
    return None if nll is None or ref is None else 100.0 * (math.exp(nll - ref) - 1.0)


# ---- the papers' claims ------------------------------------------------------------------------------------------
#
# A claim is about one setting, and its verdict reads only runs of that setting. The setting has one home: the
# preset's YAML (conf/experiment/<preset>.yaml), read here (``preset``): the cache kind, dtype and engine its defaults
# pick, every cache option it sets to a value, and the top-level keys the claim names (``Claim.about``: the texts'
# length, the copies', the prompts), with ``weights`` (a trained model) for a claim about quality. What a claim
# compares (its arms: 0 vs 4 sinks, K per channel vs per token) are values the preset sweeps. A run that has an arm
# but not the setting is not read: the claim gives no verdict and says which setting differs ("not judged"), as it
# does when a control cannot show the effect (full attention that does not copy, a window that costs nothing).

CONF = Path(__file__).resolve().parents[2] / "conf" / "experiment"
GROUPS = ("cache", "dtype", "engine")  # the config groups a preset's defaults pick that its claims are about
TRAINED = "weights"  # in Claim.about: about a trained model (a random init's drift and copying say nothing)
TEXT = ("drift_text_len", "prompts", TRAINED)  # a claim read from drift on the prompts' text, as long as the preset
# says (shorter texts may never fill a quantisation group, or never leave a window: they measure something else)
COPY = ("retrieval_n", TRAINED)  # a claim read from copying random sequences
# options of a preset's cache kind that its claims are not about, and why; every other option the preset sets (or
# links to another: v_bits: ${cache.k_bits}) or sweeps (tests/analysis/test_findings.py holds each preset to this)
GPT2_KEYS = ("the papers quantise the keys attention reads (after any rotation): k_pre_rope stays off, and GPT-2's "
             "keys carry no rotation at all")
NOT_ABOUT = {
    "paper_streamingllm": {"cache.window": "set by the budget: the budget less the sinks",
                           "cache.positions": "absolute on both models: GPT-2's learned positions cannot be "
                                              "re-positioned (experiment=streaming re-positions on mini-llama)"},
    "paper_rotation": {"cache.v_bits": "V is not quantised (quantize k)", "cache.v_axis": "V is not quantised "
                                                                                          "(quantize k)",
                       "cache.tail": "K is grouped per token, whose tail is the residual whatever tail says",
                       "cache.k_pre_rope": GPT2_KEYS},
    "paper_kv_types": {"cache.tail": "K and V are grouped per token, whose tail is the residual whatever tail says",
                       "cache.k_pre_rope": GPT2_KEYS},
    "paper_kivi": {"cache.k_pre_rope": GPT2_KEYS},
    "paper_pyramidkv": {"cache.floor": "allocation=ada's; the pyramid splits each layer's slots evenly among its heads"},
    "paper_adakv": {"cache.beta": "allocation=pyramid's; Ada-KV splits a layer's budget, not the layers' total"},
    "paper_h2o": {"cache.beta": "allocation=pyramid's; H2O spends the same budget in every layer and head",
                  "cache.floor": "allocation=ada's; H2O spends the same budget in every layer and head"},
}


@dataclass(frozen=True)
class Preset:
    """What conf/experiment/<name>.yaml fixes: ``fixed`` ("cache": the kind, "dtype", "engine", "model": what its
    defaults pick; "cache.<option>": each option it sets to a value; each top-level key it sets), ``linked`` (cache
    options it sets to another's value, as written) and ``swept`` ("cache.<option>" -> the values its sweep takes)."""

    name: str
    fixed: dict
    linked: dict
    swept: dict


def _parsed(text: str):
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return text


def preset(name: str) -> Preset:
    """The paper preset ``name`` as its YAML states it (the one home of every setting its claims are about)."""
    y = OmegaConf.load(CONF / f"{name}.yaml")
    fixed, linked = {}, {}
    for item in y.get("defaults") or []:
        if OmegaConf.is_dict(item):  # "override /cache: h2o"
            for k, v in item.items():
                fixed[str(k).split()[-1].strip("/")] = v
    cache = y.get("cache") or {}
    for k in cache:
        if OmegaConf.is_interpolation(cache, k):
            linked[f"cache.{k}"] = OmegaConf.to_container(cache)[k]
        else:
            fixed[f"cache.{k}"] = cache[k]
    for k in y:
        if k not in ("defaults", "cache", "hydra", "experiment"):
            fixed[k] = OmegaConf.to_container(y[k]) if OmegaConf.is_config(y[k]) else y[k]
    params = OmegaConf.select(y, "hydra.sweeper.params") or {}
    swept = {k: tuple(_parsed(v) for v in str(vals).split(",")) for k, vals in params.items()}
    return Preset(name, fixed, linked, swept)


def claim_setting(preset_name: str, claim: Claim) -> dict:
    """The setting ``claim`` is about, key (as on the command line) -> value: its preset's cache kind, dtype,
    engine and cache options, and the keys of ``claim.about``."""
    p = preset(preset_name)
    groups = [k for k in GROUPS[1:] if k not in p.swept]  # a group the preset sweeps (engine) is an arm, a column
    out = {k: p.fixed[k] for k in ("cache", *(k for k in p.fixed if k.startswith("cache.")), *groups)}
    for k in claim.about:
        if k == TRAINED:
            out[k] = "pretrained"
        elif k in p.fixed:
            out[k] = p.fixed[k]
        else:
            raise KeyError(f"conf/experiment/{preset_name}.yaml does not state {k}, which the claim "
                           f"{claim.claim!r} is about")
    return out


def recorded(row: pd.Series, key: str):
    """What a run recorded for the setting ``key`` (None: nothing). ``drift_text_len`` is the texts' length as run
    (the drift scores each of its texts, drift_texts of them (n_prompts before that key), at its length less one
    positions; max_len cuts them)."""
    if key == "drift_text_len":
        pos = value(row, KEYS.drift_text_positions)
        n = value(row, KEYS.drift_texts) or value(row, KEYS.n_prompts)
        return None if pos is None or not n else round(pos / n) + 1
    col = f"cache_{key[len('cache.'):]}" if key.startswith("cache.") else key
    v = row.get(col)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else as_written(v)


def as_run(row: pd.Series, key: str, v):
    """The setting ``key`` = ``v`` as a run of it records it: ``retrieval_n`` is clamped to what fits twice in the
    run's max_len behind its first token, if any (a model trained with one copies 511 tokens of an asked 512 in
    1,024 positions); every other setting as given."""
    if key != "retrieval_n" or not isinstance(v, int):
        return v
    max_len, first = row.get("max_len"), row.get("first_token")
    if max_len is None or (isinstance(max_len, float) and math.isnan(max_len)):
        return v
    lead = 0 if first is None or (isinstance(first, float) and math.isnan(first)) else 1
    if lead == 0 or v > int(max_len) // 2:  # clamped by max_len itself: another setting, which the claim names
        return v
    return min(v, (int(max_len) - lead) // 2)


class Runs:
    """The ok runs of a preset's sweep as one claim reads them: only those of ``setting`` (``claim_setting``), and
    their per-position rows (``positions``: table name -> rows of every run, e.g. ``text_positions``), from which
    each comparison's interval is made (``harness.analysis.intervals``)."""

    def __init__(self, ok: pd.DataFrame, setting: dict, positions: dict[str, pd.DataFrame] | None = None,
                 metric: str = "kl", level: float = intervals.LEVEL):
        self.ok, self.setting, self.positions, self.metric = ok, setting, positions or {}, metric
        self.level = level  # every interval's level: 95%, or stricter when a multiplicity correction re-judges a claim
        self.differ: dict[str, set] = {}  # setting -> what the runs an arm found have instead
        self.units: set[tuple[int, str]] = set()  # (n, unit) of every interval made: what the row says n is
        self._rows: dict = {}  # (run name, table) -> its per-position rows, looked up once

    def run(self, **arm) -> pd.Series | None:
        """The first ok run with the cache options (and ``outlier_scale``) ``arm`` and the claim's setting; when
        no run with the arm has the setting, the first with the arm, what it has instead kept in ``differ`` (the
        claim names it and gives no verdict); None when no run has the arm."""
        sel = self.ok
        for name, value in arm.items():
            if name in RECORD_ARMS:
                col = name
                have = sel[col] if col in sel else pd.Series(RECORD_ARMS[name], index=sel.index)
                sel = sel[have.fillna(RECORD_ARMS[name]).map(as_written) == value]
                continue
            col = f"cache_{name}"
            if col not in sel:
                return None
            sel = sel[sel[col].map(as_written) == value]
        rows = [r for _, r in sel.iterrows()]
        diffs = [{k: recorded(r, k) for k, v in self.setting.items() if recorded(r, k) != as_run(r, k, v)}
                 for r in rows]
        for r, d in zip(rows, diffs):
            if not d:
                return r
        for d in diffs:
            for k, v in d.items():
                self.differ.setdefault(k, set()).add(v)
        return rows[0] if rows else None

    def differences(self) -> str:
        """'the runs have <key> <theirs>, the claim is about <ours>; ...' ("" when every run read is of the
        setting)."""
        if not self.differ:
            return ""
        parts = [f"{k} {' / '.join(setting_value(k, v) for v in sorted(self.differ[k], key=str))}, the claim is "
                 f"about {setting_value(k, v)}" for k, v in self.setting.items() if k in self.differ]
        return "the runs have " + "; ".join(parts)

    def rows(self, run: pd.Series, metric: "Metric") -> pd.DataFrame:
        """``run``'s per-position rows of ``metric``'s table, with its column; ``NoRows`` when it has none."""
        key = (run.get(KEYS.run_name), metric.table, metric.column)
        if key not in self._rows:
            self._rows[key] = intervals.rows_of(self.positions, run.get(KEYS.run_name), metric)
        sel = self._rows[key]
        if sel is None:
            raise NoRows(f"run {run.get(KEYS.run_name)} has no per-position rows ({metric.table}.csv, one row per "
                         "scored position) to put an interval on")
        return sel

    def compare(self, a: pd.Series, b: pd.Series, metric: "Metric", how: str = "difference") -> intervals.Interval:
        """``metric`` of run ``a`` against run ``b`` (a − b, or a / b), paired over the units both scored."""
        iv = intervals.compare(self.rows(a, metric), self.rows(b, metric), metric.column, metric.stat, how,
                               unit=metric.unit, level=self.level)
        self.units.add((iv.n, metric.unit_name))
        return iv

    def combine(self, arms: dict[str, pd.Series], metric: "Metric", fn) -> intervals.Interval:
        """Any function of several runs' ``metric`` (``intervals.paired``)."""
        iv = intervals.paired({k: self.rows(r, metric) for k, r in arms.items()}, metric.column, fn, metric.stat,
                              unit=metric.unit, level=self.level)
        self.units.add((iv.n, metric.unit_name))
        return iv

    def against_full(self, run: pd.Series, metric: "Metric") -> intervals.Interval:
        """``run``'s copy accuracy less full attention's (fp32, uncached) on the same sequences and positions, the
        per-position ``correct_ref`` each run records beside its own."""
        rows = self.rows(run, metric)
        if "correct_ref" not in rows:
            raise NoRows(f"run {run.get(KEYS.run_name)} has no full-attention column (correct_ref) in "
                         f"{metric.table}.csv to compare with")
        iv = intervals.compare(rows, rows.assign(**{metric.column: rows["correct_ref"]}), metric.column, metric.stat,
                               unit=metric.unit, level=self.level)
        self.units.add((iv.n, metric.unit_name))
        return iv

    def single(self, run: pd.Series, metric: "Metric") -> intervals.Interval:
        iv = intervals.single(self.rows(run, metric), metric.column, metric.stat, unit=metric.unit, level=self.level)
        self.units.add((iv.n, metric.unit_name))
        return metric.clipped(iv)


RECORD_ARMS = {"outlier_scale": 1.0}  # arms read from a run's record rather than its cache options (the default a
# run that predates the key had)


class NoRows(LookupError):
    """A run without the per-position rows an interval needs."""


def setting_value(key: str, v) -> str:
    """A setting's value as a not-judged row shows it."""
    if v is None:
        return "nothing recorded"
    if key == TRAINED:
        return {"pretrained": "pretrained (a trained model)", "random": "random (a random init)"}.get(v, str(v))
    return str(v)


def setting_text(setting: dict) -> str:
    """The setting in words, every key once: 'quant, groups of 32, no residual, rotate none, fp32, ...'."""
    def one(k, v):
        if k == "cache.residual":
            return "no residual" if v == 0 else f"residual {v}"
        if k == TRAINED:
            return "trained weights" if v == "pretrained" else f"weights {v}"
        form = {"cache": "{}", "cache.budget": "{} slots", "cache.group_size": "groups of {}",
                "cache.k_axis": "K per {}", "cache.v_axis": "V per {}", "dtype": "{}", "engine": "engine {}",
                "drift_text_len": "texts of {:,} tokens", "retrieval_n": "copies of {:,} tokens",
                "prompts": "prompts={}"}.get(k)
        return form.format(v) if form else f"{k[len('cache.'):] if k.startswith('cache.') else k} {v}"
    return ", ".join(one(k, v) for k, v in setting.items())


@dataclass(frozen=True)
class NotJudged:
    """In a claim's verdict's place: why its runs cannot show the effect it is about."""

    why: str


Metric, METRICS = intervals.Metric, intervals.METRICS
# the metric that decides each preset's text claims (KL by default, as docs/drift.md argues: it is what a lossy
# cache does to the model's whole next-token distribution); the others are shown beside it. StreamingLLM's claims
# are about perplexity collapsing and being restored (its Tables 1 and 2 are perplexities), so that preset reads
# ΔNLL, the log of the perplexity ratio.
PRESET_METRIC = {"paper_streamingllm": "nll", "paper_kivi": "kl", "paper_h2o": "kl", "paper_kv_types": "kl",
                 "paper_rotation": "kl", "paper_pyramidkv": "kl", "paper_adakv": "kl", "paper_duo": "kl"}
BESIDE = ("kl", "kl_p99", "nll")  # shown beside the deciding metric, as points


def metric_of(at: "Runs") -> Metric:
    return METRICS[at.metric]


def _fig(x: float, m: Metric) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{m.fmt}}"


def _iv(iv: intervals.Interval, m: Metric | None = None, fmt: str | None = None) -> str:
    return iv.text(fmt or (m.fmt if m else "+.3f"))


def _ratio(iv: intervals.Interval) -> str:
    """'1.67 [1.52, 1.83]×', or '1.67× (n = 1: no interval)'."""
    return f"{iv.text('.3g')}×" if iv.shown else iv.text(".3g", "×")


def all_of(*verdicts: str) -> str:
    """A claim made of parts: holds when every part holds, does not hold when any part does not, else
    inconclusive."""
    if any(v == intervals.FAILS for v in verdicts):
        return intervals.FAILS
    return intervals.HOLDS if all(v == intervals.HOLDS for v in verdicts) else intervals.INCONCLUSIVE


def _beside(at: "Runs", *rows, skip: str = "") -> str:
    """The other metrics' points for ``rows``, '(KL p99 0.1 / 0.2; ΔNLL +0.01 / +0.02)'."""
    parts = []
    for name in BESIDE:
        m = METRICS[name]
        if name == skip:
            continue
        try:
            parts.append(f"{m.label.split(' (')[0]} " + " / ".join(_fig(at.single(r, m).estimate, m) for r in rows))
        except NoRows:
            continue
    return f" ({'; '.join(parts)})" if parts else ""


def _copy_control(row) -> NotJudged | None:
    """Full attention (fp32, uncached) must copy more of the second showing than anything gets right of the first
    (nothing to copy yet), or no cache can be shown to lose copying."""
    ref, first = value(row, KEYS.retrieval_acc_ref), value(row, KEYS.retrieval_first_copy_acc)
    if ref is None:
        return NotJudged("full attention's copying is not recorded, so a cache cannot be shown to lose copying")
    if ref <= (first or 0.0):
        return NotJudged(f"full attention itself copies {ref:.1%} of the second copy (the first, with nothing to "
                         f"copy yet: {first or 0.0:.1%}), so a cache cannot be shown to lose copying")
    return None


# ---- StreamingLLM ------------------------------------------------------------------------------------------------

SINKS = (0, 1, 2, 4, 8)  # StreamingLLM Table 2's sink counts
COLLAPSE = math.log(2)  # Table 1's collapse, as the preset states it: the window's perplexity at least twice full
# attention's (ΔNLL >= ln 2 nats/token). The paper's window is 955x its 4-sink perplexity (5158.07 vs 5.40).
ENOUGH = 0.10  # "four are enough": 8 sinks close at most this share of the gap 4 sinks close (Table 2: 0.09%)


def _streaming_rows(at: Runs) -> dict[int, pd.Series | None]:
    return {s: at.run(sinks=s) for s in SINKS}


def _collapse(at: Runs, row) -> tuple[intervals.Interval, str]:
    iv = at.single(row, METRICS["nll"])
    return iv, intervals.verdict(iv, ">", COLLAPSE)


def _streaming_collapses(at):
    r = _streaming_rows(at)
    if r[0] is None:
        return missing(r[0])
    iv, v = _collapse(at, r[0])
    return (f"0 sinks + {int(r[0]['cache_window'])} recent; ΔNLL against fp32 full attention, collapse at "
            f"ln 2 = {COLLAPSE:.3f} (perplexity ×2)",
            f"ΔNLL {_iv(iv)} (perplexity ×{math.exp(iv.estimate):.2f})" + _beside(at, r[0], skip="nll"), v,
            names(r[0]))


def _streaming_restored(at):
    r = _streaming_rows(at)
    if r[0] is None or r[4] is None:
        return missing(r[0], r[4])
    iv0, v0 = _collapse(at, r[0])
    iv4, _ = _collapse(at, r[4])
    number = f"ΔNLL {_iv(iv4)} with 4 sinks, {_iv(iv0)} without"
    if v0 != intervals.HOLDS:
        return (f"4 sinks + {int(r[4]['cache_window'])} recent", number, NotJudged(
            f"the window without sinks does not collapse (ΔNLL {_iv(iv0)}, "
            f"{'below' if v0 == intervals.FAILS else 'not clearly above'} ln 2): there is no collapse for sinks to "
            "restore"), names(r[0], r[4]))
    gap = at.compare(r[0], r[4], METRICS["nll"])
    return (f"4 sinks + {int(r[4]['cache_window'])} recent vs 0 + {int(r[0]['cache_window'])}", number +
            f"; 0 − 4 sinks {_iv(gap)}", all_of(intervals.verdict(iv4, "<", COLLAPSE), intervals.verdict(gap, ">")),
            names(r[0], r[4]))


def _sink_gap(at, r, m) -> tuple[intervals.Interval, NotJudged | None]:
    """What 4 sinks buy over none; a control: when it is not clearly positive there is nothing for fewer or more
    sinks to fall short of or add to."""
    gap = at.compare(r[0], r[4], m)
    if intervals.verdict(gap, ">") != intervals.HOLDS:
        return gap, NotJudged(f"4 sinks do not clearly lower the window's {m.label.split(' (')[0]} (0 − 4 sinks "
                              f"{_iv(gap, m)}), so there is no gap for fewer sinks to fall short of or more to close")
    return gap, None


def _streaming_one_two(at):
    """"Not enough", the converse of "four are enough" on the same margin: 1 sink (and 2) leave more than ENOUGH of
    the 0-to-4-sink gap open ((s - 4 sinks) / (0 - 4 sinks) > ENOUGH), each."""
    r = _streaming_rows(at)
    if absent(r[0], r[1], r[2], r[4]):
        return missing(r[0], r[1], r[2], r[4])
    m = metric_of(at)
    gap, nj = _sink_gap(at, r, m)
    left = {k: at.combine({"0": r[0], "k": r[k], "4": r[4]}, m, lambda s: (s["k"] - s["4"]) / (s["0"] - s["4"]))
            for k in (1, 2)}
    phrase = (f"1 and 2 sinks against 4: the share of the 0-to-4-sink gap each leaves open, more than {ENOUGH:.0%} "
              f"(the margin \"four are enough\" reads); {m.label}")
    number = (f"1 sink leaves {_iv(left[1], fmt='+.1%')}, 2 sinks {_iv(left[2], fmt='+.1%')} (1 − 4 sinks "
              f"{_iv(at.compare(r[1], r[4], m), m)}; 0 − 4 sinks {_iv(gap, m)})")
    return (phrase, number, nj or all_of(*(intervals.verdict(iv, ">", ENOUGH) for iv in left.values())),
            names(r[1], r[2], r[4], r[0]))


def _streaming_four(at):
    r = _streaming_rows(at)
    if absent(r[0], r[4], r[8]):
        return missing(r[0], r[4], r[8])
    m = metric_of(at)
    gap, nj = _sink_gap(at, r, m)
    share = at.combine({"0": r[0], "4": r[4], "8": r[8]}, m, lambda s: (s["4"] - s["8"]) / (s["0"] - s["4"]))
    return (f"8 sinks against 4: the share of the 0-to-4-sink gap that 4 more sinks close, about the same within "
            f"±{ENOUGH:.0%}; {m.label}",
            f"{_iv(share, fmt='+.1%')} (4 sinks {_fig(at.single(r[4], m).estimate, m)}, 8 sinks "
            f"{_fig(at.single(r[8], m).estimate, m)}; 0 − 4 sinks {_iv(gap, m)})",
            nj or intervals.verdict_within(share, -ENOUGH, ENOUGH), names(r[4], r[8], r[0]))


def _streaming_one_enough(at):
    """A model trained with a token fixed at position 0 (results.json ``first_token``): 4 sinks close about the same
    share of the window's cost as that one token does, within ±ENOUGH of the 0-to-1-sink gap."""
    r = _streaming_rows(at)
    if absent(r[0], r[1], r[4]):
        return missing(r[0], r[1], r[4])
    m = metric_of(at)
    first = value(r[1], KEYS.first_token)
    phrase = f"4 sinks against the 1 the model was trained with: the share of the 0-to-1-sink gap that 3 more close, " \
             f"about nothing within ±{ENOUGH:.0%}; {m.label}"
    if first is None and not at.differences():  # (a run of another setting is named as such instead)
        return (phrase, "—", NotJudged("the model was not trained with a token fixed at position 0 (results.json "
                                       "first_token is null): its first token is not a sink token"), names(r[1]))
    if first is None:
        return phrase, "—", None, names(r[1])
    premise = _sink_premise(r[1])
    if premise is not None:
        return phrase, "—", premise, names(r[1])
    gap = at.compare(r[0], r[1], m)
    if intervals.verdict(gap, ">") != intervals.HOLDS:
        return (phrase, f"0 − 1 sink {_iv(gap, m)}", NotJudged(
            f"the one sink does not clearly lower the window's {m.label.split(' (')[0]} (0 − 1 sink {_iv(gap, m)}): "
            "there is no gap for more sinks to add to"), names(r[0], r[1]))
    share = at.combine({"0": r[0], "1": r[1], "4": r[4]}, m, lambda s: (s["1"] - s["4"]) / (s["0"] - s["1"]))
    return (phrase, f"{_iv(share, fmt='+.1%')} (1 sink {_fig(at.single(r[1], m).estimate, m)}, 4 sinks "
            f"{_fig(at.single(r[4], m).estimate, m)}; 0 − 1 sink {_iv(gap, m)})",
            intervals.verdict_within(share, -ENOUGH, ENOUGH), names(r[1], r[4], r[0]))


SINK_SHARE = 0.3  # the share of a head's attention from which its first token counts as a sink: the recipe's own
# sink target (harness/train/recipe.py, sink_head_max), the threshold Gu et al. (arXiv 2410.10781) count a sink at


def _sink_premise(row) -> NotJudged | None:
    """§3.3's premise: the model uses its first token as a sink (some head puts at least SINK_SHARE of its
    attention on it, results.json ``first_token_share``); otherwise why the claim is not judged."""
    share = value(row, KEYS.first_token_share)
    if share is None:
        return NotJudged("how much attention the first token draws is not recorded (results.json first_token_share), "
                         "so whether the model uses it as a sink, the claim's premise, cannot be told")
    if share < SINK_SHARE:
        return NotJudged(f"the claim's premise is a token the model uses as a sink, and this model's first token is "
                         f"none: no head puts more than {share:.1%} of its attention on it (first_token_share), under "
                         f"the {SINK_SHARE:.0%} a sink head puts there")
    return None


def _streaming_copy(at):
    r = _streaming_rows(at)
    if absent(*r.values()):
        return missing(*r.values())
    m = METRICS["copy"]
    ivs = [at.single(row, m) for row in r.values()]
    return (" / ".join(map(str, SINKS)) + f" sinks; {m.label} on the second copy, {value(r[0], KEYS.retrieval_n):.0f}"
            " tokens back",
            " / ".join(_iv(iv, m) for iv in ivs) + f" (full attention {num(value(r[0], KEYS.retrieval_acc_ref))})",
            None, names(*r.values()))


# ---- KIVI --------------------------------------------------------------------------------------------------------

KIVI_RESIDUALS = (0, 32)  # the newest tokens every arm keeps in full precision, the same for K and V and for either
# axis (the preset's cache.tail=residual quantises a per-channel group before it fills, zero-padded, so that no axis
# keeps more than the residual): 0, every token quantised, is KIVI Table 1's own study and decides the verdict; 32 is
# shown beside it


def _kivi(at, k_axis, v_axis, residual, scale):
    return at.run(k_axis=k_axis, v_axis=v_axis, residual=residual, outlier_scale=scale)


def _kivi_axis(at, scale, which):
    """K (``which`` "k": per channel against per token, V per token) or V ("v": per token against per channel,
    for either K axis), the full-precision tail matched (the same residual for every axis): with none (the
    verdict) and with 32 (beside), at outlier scale ``scale``."""
    m = metric_of(at)
    out, verdicts, read = [], {}, []
    for R in KIVI_RESIDUALS:
        if which == "k":
            pairs = [(_kivi(at, "channel", "token", R, scale), _kivi(at, "token", "token", R, scale))]
        else:
            pairs = [(_kivi(at, k, "token", R, scale), _kivi(at, k, "channel", R, scale)) for k in ("channel", "token")]
        if any(x is None for p in pairs for x in p):
            if R == KIVI_RESIDUALS[0]:
                return missing(*[x for p in pairs for x in p])
            continue
        ivs = [at.compare(a, b, m, how="ratio") for a, b in pairs]
        verdicts[R] = all_of(*(intervals.verdict(iv, "<", 1.0) for iv in ivs))
        out.append(f"residual {R}: " + "; ".join(_ratio(iv) for iv in ivs))
        read += [x for p in pairs for x in p]
    what = ("K per channel / K per token (V per token)" if which == "k" else
            "V per token / V per channel (K per channel; K per token)")
    rest = [f"residual {R} {v}" for R, v in verdicts.items() if R != KIVI_RESIDUALS[0]]
    return (f"2-bit, outlier scale {scale:g}: {what}, ratio of {m.label}, the tail matched; the verdict reads "
            f"residual {KIVI_RESIDUALS[0]} (every token quantised, as Table 1)",
            "; ".join(out) + (f" (beside: {', '.join(rest)})" if rest else ""), verdicts[KIVI_RESIDUALS[0]],
            names(*read))


# ---- H2O ---------------------------------------------------------------------------------------------------------

def _h2o(at, role):
    """H2O's ablation at the preset's budget: heavy hitters alone (recent 0), both (recent half the budget) and
    the newest tokens alone ("local": recent the whole budget)."""
    budget = at.setting["cache.budget"]
    return at.run(recent={"heavy": 0, "both": budget // 2, "local": budget}[role])


def _h2o_both(at):
    heavy, both, local = _h2o(at, "heavy"), _h2o(at, "both"), _h2o(at, "local")
    if absent(heavy, both, local):
        return missing(both, local, heavy)
    m = metric_of(at)
    bl, bh = at.compare(both, local, m, "ratio"), at.compare(both, heavy, m, "ratio")
    budget, text = at.setting["cache.budget"], at.setting["drift_text_len"]
    return (f"a budget of {100 * budget / text:.0f}% of the text: both (recent {budget // 2}) against local (recent "
            f"{budget}) and heavy only (recent 0); ratio of {m.label}",
            f"both / local {_ratio(bl)}; both / heavy {_ratio(bh)}" + _beside(at, both, local, heavy),
            all_of(intervals.verdict(bl, "<", 1.0), intervals.verdict(bh, "<", 1.0)), names(both, local, heavy))


def _h2o_heavy_text(at):
    return _less_on_text(at, _h2o(at, "heavy"), _h2o(at, "local"),
                         "heavy hitters alone against the newest tokens alone; ratio of {}")


def _less_on_text(at, a, b, what: str):
    """Run ``a``'s text metric over run ``b``'s, paired over the texts, below 1; ``what`` says what is compared
    ("{}": the metric's label)."""
    if a is None or b is None:
        return missing(a, b)
    m = metric_of(at)
    iv = at.compare(a, b, m, "ratio")
    return what.format(m.label), f"{_ratio(iv)}" + _beside(at, a, b), intervals.verdict(iv, "<", 1.0), names(a, b)


COPY_MARGIN = 0.05  # "keeps what full attention copies": heavy hitters' copy accuracy at most this far below it


def _h2o_heavy_copy(at):
    """Heavy hitters alone (recent 0) against full attention on the same copies: within COPY_MARGIN below it
    (non-inferiority). Not against the newest tokens: a window of the budget cannot reach a source that far back,
    so that comparison is decided by construction."""
    heavy = _h2o(at, "heavy")
    if heavy is None:
        return missing(heavy)
    return _keeps_full_copy(at, heavy, "heavy only", f"heavy only − full attention; {METRICS['copy'].label} on the "
                            f"second copy, {value(heavy, KEYS.retrieval_n):.0f} tokens back")


def _keeps_full_copy(at, run, name: str, what: str):
    """``run``'s copy accuracy against full attention's on the same copies, within COPY_MARGIN below it
    (non-inferiority); ``what`` says what is compared, ``name`` names the run's figure."""
    m = METRICS["copy"]
    iv = at.against_full(run, m)
    return (f"{what}, keeping it means no more than {COPY_MARGIN:.2f} below",
            f"{_iv(iv, m, '+.3f')} ({name} {_fig(at.single(run, m).estimate, m)}, full attention "
            f"{num(value(run, KEYS.retrieval_acc_ref))})",
            _copy_control(run) or intervals.verdict(iv, ">", -COPY_MARGIN), names(run))


# ---- PyramidKV and Ada-KV: the same scorer, its budget spent unevenly -------------------------------------------

def _spent(at, allocation, budget):
    return at.run(allocation=allocation, budget=budget)


def _spent_beats_uniform(at, allocation: str, budget: int):
    """``allocation`` (pyramid: per layer; ada: per head) against uniform on the same scorer at the same total:
    the ratio of the text metric below 1."""
    return _less_on_text(at, _spent(at, allocation, budget), _spent(at, "uniform", budget),
                         f"{budget} slots a K/V head on average: {allocation} / uniform at the same total, ratio "
                         "of {}")


# ---- DuoAttention: retrieval heads whole, streaming heads a sink and a window --------------------------------------

def _duo(at, heads: str, share: float):
    """The duo run with ``share`` of its K/V heads whole, chosen by the model's heads file ("ranked": whichever
    file the sweep gave, one per model) or at random."""
    if heads == "ranked":
        files = [h for h in at.ok.get("cache_heads", pd.Series(dtype=object)).dropna().unique() if h != "random"]
        if not files:
            return None
        heads = files[0]
    return at.run(heads=heads, retrieval=share)


def _pct(share: float) -> str:
    return f"{share:.0%} of the K/V heads"


def _duo_copy_beats(at, a: tuple, b: tuple, what: str):
    """Copy accuracy of duo run ``a`` less run ``b`` ((heads, share) each), above 0."""
    ra, rb = _duo(at, *a), _duo(at, *b)
    if ra is None or rb is None:
        return missing(ra, rb)
    m = METRICS["copy"]
    iv = at.compare(ra, rb, m)
    return (f"{what}; {m.label} on the second copy, the first showing beyond a streaming head's reach",
            f"{_iv(iv, m, '+.3f')} ({_fig(at.single(ra, m).estimate, m)} vs {_fig(at.single(rb, m).estimate, m)}, "
            f"full attention {num(value(ra, KEYS.retrieval_acc_ref))})",
            _copy_control(ra) or intervals.verdict(iv, ">", 0.0), names(ra, rb))


def _duo_ranked_beats_random(at):
    return _duo_copy_beats(at, ("ranked", 0.25), ("random", 0.25),
                           f"{_pct(0.25)} whole: ranked by their score − drawn at random (the same bytes)")


def _duo_ranked_beats_window(at):
    return _duo_copy_beats(at, ("ranked", 0.25), ("ranked", 0.0),
                           f"{_pct(0.25)} whole (ranked) − none (every head a sink and a window)")


def _duo_keeps_copy(at, share: float):
    """Duo at ``share`` ranked heads against full attention on the same copies: within COPY_MARGIN below it."""
    run = _duo(at, "ranked", share)
    if run is None:
        return missing(run)
    return _keeps_full_copy(at, run, "duo", f"{_pct(share)} whole (ranked) − full attention; "
                            f"{METRICS['copy'].label} on the second copy")


def _duo_text(at):
    """On text: ranked heads whole against as many drawn at random, ratio of the text metric below 1."""
    return _less_on_text(at, _duo(at, "ranked", 0.25), _duo(at, "random", 0.25),
                         f"{_pct(0.25)} whole: ranked / drawn at random (the same bytes), ratio of " + "{}")


# ---- llama.cpp's K and V types, and the rotation -----------------------------------------------------------------

def _kv_type(at, quantize, bits=8):
    return at.run(k_bits=bits, v_bits=bits, quantize=quantize)


def _kv_types_k_more(at, bits=8):
    k, v = _kv_type(at, "k", bits), _kv_type(at, "v", bits)
    if k is None or v is None:
        return missing(k, v)
    m = metric_of(at)
    iv = at.compare(k, v, m, "ratio")
    return (f"{bits}-bit: K alone / V alone, ratio of {m.label}",
            f"{_ratio(iv)} ({_fig(at.single(k, m).estimate, m)} vs {_fig(at.single(v, m).estimate, m)})",
            intervals.verdict(iv, ">", 1.0), names(k, v))


BOTH_WITHIN = 1.25  # "both cost about what K alone costs": the ratio within 1 / 1.25 .. 1.25 (PR 7412: 1.04)


def _kv_types_both(at):
    k, v, both = _kv_type(at, "k"), _kv_type(at, "v"), _kv_type(at, "kv")
    if absent(k, v, both):
        return missing(k, v, both)
    m = metric_of(at)
    iv = at.compare(both, k, m, "ratio")
    return (f"8-bit: both / K alone, ratio of {m.label}, about the same within {BOTH_WITHIN}×",
            f"{_ratio(iv)} (both {_fig(at.single(both, m).estimate, m)}, K alone "
            f"{_fig(at.single(k, m).estimate, m)}, V alone {_fig(at.single(v, m).estimate, m)})",
            intervals.verdict_within(iv, 1 / BOTH_WITHIN, BOTH_WITHIN), names(both, k, v))


def _rotation(at, bits, rotate, scale):
    return at.run(k_bits=bits, rotate=rotate, outlier_scale=scale)


def _rotation_helps(at, bits, scale):
    plain, rot = _rotation(at, bits, "none", scale), _rotation(at, bits, "hadamard", scale)
    if plain is None or rot is None:
        return missing(plain, rot)
    m = metric_of(at)
    iv = at.compare(rot, plain, m, "ratio")
    return (f"K alone, {bits}-bit, outlier scale {scale:g}: with / without rotate=hadamard, ratio of {m.label}",
            f"{_ratio(iv)}" + _beside(at, rot, plain) + _ppl_text(rot, plain), intervals.verdict(iv, "<", 1.0),
            names(rot, plain))


def _ppl_text(*rows) -> str:
    """'; perplexity +0.92% vs +11.30% against fp32' ('' when a run has no text NLL)."""
    changes = [ppl_change(r) for r in rows]
    return "" if None in changes else "; perplexity " + " vs ".join(f"{c:+.2f}%" for c in changes) + " against fp32"


def _rotation_cost(at):
    plain, rot = _rotation(at, 4, "none", 1), _rotation(at, 4, "hadamard", 1)
    a, b = (value(r, KEYS.step_ms_cached_at_max_context) for r in (plain, rot))
    if a is None or b is None:
        return missing(plain, rot)
    ctx = int(value(plain, KEYS.max_context_len) or 0)
    return (f"the 4-bit runs' decode step at context {ctx}", f"{a:.2f} vs {b:.2f} ms ({b / a:.2f}×)", None,
            names(plain, rot))


STREAMINGLLM = "StreamingLLM (Xiao et al., arXiv 2309.17453)"
KIVI = "KIVI (Liu et al., arXiv 2402.02750)"
H2O = "H2O (Zhang et al., arXiv 2306.14048)"
LLAMACPP = "llama.cpp PR 7412"
ROTATION = "ik_llama.cpp pull request 1034"
PYRAMIDKV = "PyramidKV (Cai et al., arXiv 2406.02069)"
ADAKV = "Ada-KV (Feng et al., arXiv 2407.11550)"
DUO = "DuoAttention (Xiao et al., arXiv 2410.10819)"
SPENT_TEXT = (*TEXT, "prompt_len")  # the pyramid and ada claims: after a prompt longer than the budget
WINDOW_TEXT = TEXT  # the window and H2O claims: the texts must be long against the budget
OUTLIERS = (1, 20)  # model.outliers.scale the KIVI and rotation presets sweep: the mini as trained, and with one K
# and one V channel per head made 20x larger (the function kept): the claims' cause absent, then put in. Put in, it
# decides the claim by how it is made (``FIXED``): those rows are sanity checks of the injection, not findings
FIXED = {
    "k": "model.outliers.scale=20 makes one K channel per head 20x larger (the matching query channel divided by as "
         "much); a per-channel scale takes that channel's range whole and a per-token one spreads it over the token's "
         "group, so K per channel must win",
    "v": "model.outliers.scale=20 makes one V channel per head 20x larger (the matching output column divided by as "
         "much): the outlier KIVI says V lacks, put into V, so V per token must lose",
    "rotation": "model.outliers.scale=20 makes one K channel per head 20x larger; the rotation spreads it over all 64 "
                "channels of the block, so the block's scale no longer follows one channel and the rotation must help",
}


def _outlier_kind(scale, kind=PAPER) -> dict:
    """A claim's kind at outlier scale ``scale``: its own at 1, by construction once the cause is put in."""
    return {"kind": kind} if scale == 1 else {"kind": CONSTRUCTION}
PAPERS: dict[str, tuple[Claim, ...]] = {
    "paper_streamingllm": (
        Claim("window attention collapses once the text outgrows the window", f"{STREAMINGLLM}, Table 1",
              "Table 1: \"Window attention has poor performance on long text.\"",
              "Llama-2-13B, first PG19 book: 0 + 1024 (Window); perplexity", "5158.07", _streaming_collapses,
              WINDOW_TEXT),
        Claim("four initial tokens restore it", f"{STREAMINGLLM}, Table 1",
              "Table 1: \"The perplexity is restored when we reintroduce the initial four tokens alongside the recent "
              "1020 tokens (4+1020).\"", "Llama-2-13B, first PG19 book: 4 + 1020; perplexity", "5.40",
              _streaming_restored, WINDOW_TEXT),
        Claim("one or two sinks are not enough", f"{STREAMINGLLM}, §4.4 and Table 2",
              "§4.4: \"The results show the insufficiency of introducing merely one or two initial tokens, whereas "
              "a threshold of four initial tokens appears enough\"", "Llama-2-7B, PG19: 1+4095 / 2+4094 vs 4+4092; "
              "perplexity", "11.88 / 10.51 vs 9.59", _streaming_one_two, WINDOW_TEXT),
        Claim("four are enough: eight change little", f"{STREAMINGLLM}, §4.4 and Table 2",
              "§4.4: \"a threshold of four initial tokens appears enough, with subsequent additions contributing "
              "marginal effects\"", "Llama-2-7B, PG19: 4+4092 vs 8+4088 (0+4096: 3359.95); perplexity",
              "9.59 vs 9.54", _streaming_four, WINDOW_TEXT),
        Claim("a window cannot copy what it no longer holds, sinks or not", "kvlab: a window of 64 slots, each "
              "copied token's source 200 tokens back", "—", "—", "—", _streaming_copy, COPY, kind=CONSTRUCTION,
              why_fixed="the source lies 200 tokens back and a window of 64 slots, sinks or not, holds none of it"),
        Claim("a model trained with a sink token needs only that one sink", f"{STREAMINGLLM}, abstract and §3.3",
              "abstract: \"we discover that adding a placeholder token as a dedicated attention sink during "
              "pre-training can further improve streaming deployment\"", "models pre-trained with a sink token at "
              "the start of every sample (§3.3, Table 3: 160M, \"Learnable Sink\"); the sink token alone kept, "
              "perplexity", "1235 (0 + 1024) vs 18.01 (1 + 1023)", _streaming_one_enough,
              WINDOW_TEXT),
    ),
    "paper_kivi": tuple(
        c for scale in OUTLIERS for c in (
            Claim(f"K wants a scale per channel{'' if scale == 1 else ' (with outlier channels)'}", f"{KIVI}, "
                  "abstract and Table 1", "\"the key cache should be quantized per-channel, i.e., group elements "
                  "along the channel dimension and quantize them together\"", "Llama-2-13B, 2-bit, group 32, every "
                  "token quantised, CoQA (higher is better): 2bit (K - ℂ, V - 𝕋) vs 2bit (K - 𝕋, V - 𝕋)",
                  "63.53 vs 52.93", lambda at, s=scale: _kivi_axis(at, s, "k"), TEXT, **_outlier_kind(scale),
                  why_fixed="" if scale == 1 else FIXED["k"]),
            Claim(f"V wants a scale per token{'' if scale == 1 else ' (with outlier channels)'}", f"{KIVI}, "
                  "abstract and Table 1", "\"In contrast, the value cache should be quantized per-token.\"",
                  "Llama-2-13B, 2-bit, group 32, CoQA: 2bit (K - ℂ, V - ℂ) / 2bit (K - 𝕋, V - ℂ) against V - 𝕋",
                  "2.88 / 2.80 vs 63.53 / 52.93", lambda at, s=scale: _kivi_axis(at, s, "v"), TEXT,
                  **_outlier_kind(scale), why_fixed="" if scale == 1 else FIXED["v"]))),
    "paper_h2o": (
        Claim("heavy hitters plus recent tokens beat either alone", f"{H2O}, Table 6 (Table 9 in the NeurIPS "
              "version)", "\"only retaining the embeddings of H2 or local tokens can't maintain a similar "
              "performance as the model using full embeddings\"", "OPT-30B, PiQA: Full / w. Local / w. H2 / w. "
              "Local + H2; accuracy", "78.51 / 55.82 / 67.25 / 78.45", _h2o_both, WINDOW_TEXT),
        Claim("heavy hitters alone beat recent tokens alone", f"{H2O}, Table 6 (Table 9 in the NeurIPS version)",
              "Table 6, PiQA, OPT-30B: w. H2 67.25, w. Local 55.82", "OPT-30B, PiQA: w. H2 vs w. Local; accuracy",
              "67.25 vs 55.82", _h2o_heavy_text, WINDOW_TEXT),
        Claim("heavy hitters alone keep what full attention copies from far back", "kvlab (no paper figure: "
              "H2O does not measure copying)", "—", "—", "—", _h2o_heavy_copy, COPY, kind=OWN),
    ),
    "paper_kv_types": (
        Claim("at 8 bits the K cache is the more sensitive", f"{LLAMACPP} (the \"Some first results\" table)",
              "KLD f16/q8_0/f16 (K q8_0) 0.000944 ± 0.000004; f16/f16/q8_0 (V q8_0) 0.000743 ± 0.000003",
              "LLaMA weights f16, cache q8_0 (blocks of 32, a scale only): K alone vs V alone; KL divergence",
              "0.000944 vs 0.000743", _kv_types_k_more, TEXT),
        Claim("K dominates: both cost about what K alone costs", f"{LLAMACPP} (the \"Some first results\" table)",
              "KLD f16/q8_0/q8_0 (both) 0.000980 ± 0.000004; f16/q8_0/f16 (K) 0.000944 ± 0.000004",
              "both vs K alone; KL divergence", "0.000980 vs 0.000944 (1.04×)", _kv_types_both, TEXT),
        Claim("K the more sensitive at 4 bits too", "kvlab (PR 7412's first table has no 4-bit rows)", "—",
              "—", "—", lambda at: _kv_types_k_more(at, bits=4), TEXT, kind=OWN),
    ),
    "paper_rotation": (
        *(Claim(f"a Hadamard rotation rescues a 4-bit K cache{'' if s == 1 else ' (with outlier channels)'}",
                ROTATION, "Qwen3-30B-A3B table, K-cache Q4_0: PPL 11.7625 without, 10.6654 with; diff to f16 "
                "11.30% and 0.92% (V cache f16)", "Qwen3-30B-A3B (IQ2_XXS weights), K cache Q4_0, V f16, without / "
                "with the Hadamard transform; perplexity against an f16 cache", "11.30% vs 0.92%",
                lambda at, s=s: _rotation_helps(at, 4, s), TEXT, **_outlier_kind(s),
                why_fixed="" if s == 1 else FIXED["rotation"]) for s in OUTLIERS),
        *(Claim(f"... and a 2-bit one{'' if s == 1 else ' (with outlier channels)'}", "kvlab (the pull request "
                "has no 2-bit K cache)", "—", "—", "—", lambda at, s=s: _rotation_helps(at, 2, s), TEXT, kind=OWN)
          for s in OUTLIERS),  # at 2 bits every channel's error is the coarse grid's, and the outlier does not
        # decide it: on the GPT-2 mini at scale 20 the rotation changes nothing the texts can see (docs/papers.md)
        Claim("what the rotation costs a step", "kvlab (no paper figure)", "—", "—", "—", _rotation_cost,
              kind=OWN),
    ),
    "paper_pyramidkv": (
        Claim("a pyramid beats a uniform budget at the same total, at 64 slots", f"{PYRAMIDKV}, abstract and "
              "Table 1", "\"In scenarios emphasizing memory efficiency, where only 0.7% of the KV cache is maintained, "
              "PyramidKV surpasses other KV cache compression techniques, achieving up to a 20.5 absolute accuracy "
              "improvement on TREC dataset.\"", "Llama-3-8B-Instruct, LongBench average, KV cache size 64: PyramidKV "
              "vs SnapKV", "34.76 vs 33.05", lambda at: _spent_beats_uniform(at, "pyramid", 64), SPENT_TEXT),
        Claim("... and at 128 slots", "kvlab (the paper's 12% claim is against the full cache)", "—", "—", "—",
              lambda at: _spent_beats_uniform(at, "pyramid", 128), SPENT_TEXT, kind=OWN),
    ),
    "paper_adakv": (
        Claim("a head-wise budget beats a uniform one on the same scorer at the same total, at 64 slots",
              f"{ADAKV}, abstract", "\"Extensive evaluations on 13 datasets from Ruler and 16 datasets from "
              "LongBench, all conducted under both question-aware and question-agnostic scenarios, demonstrate "
              "substantial quality improvements over existing methods.\"", "Ruler and LongBench: Ada-KV's "
              "allocation on SnapKV's and PyramidKV's scorers against theirs", "— (the abstract gives no figure)",
              lambda at: _spent_beats_uniform(at, "ada", 64), SPENT_TEXT),
        Claim("... and at 128 slots", "kvlab (no paper figure)", "—", "—", "—",
              lambda at: _spent_beats_uniform(at, "ada", 128), SPENT_TEXT, kind=OWN),
    ),
    "paper_duo": (
        Claim("the heads that lose most as streaming heads are the ones to keep whole: they copy from far back where "
              "as many heads drawn at random do not", f"{DUO}, section 2", "\"we define “retrieval heads” as the "
              "attention heads that: significantly alter model outputs when restricted to recent tokens and "
              "attention sinks.\"", "— (the paper trains a gate per head; it reports no random-heads control)",
              "—", _duo_ranked_beats_random, COPY, kind=OWN),
        Claim("... and on text", "kvlab (no paper figure)", "—", "—", "—", _duo_text, TEXT, kind=OWN),
        Claim("retrieval heads keep the far copy that a sink and a window lose", f"{DUO}, section 2",
              "\"streaming heads can be optimized by retaining only the KV states of attention sinks and recent "
              "tokens\"", "—", "—", _duo_ranked_beats_window, COPY, kind=OWN),
        Claim("with 25% of the heads whole, copying is kept (MHA)", f"{DUO}, abstract and section 3.2",
              "\"with minimal accuracy loss compared to full attention\"; \"We configure DuoAttention with a 25% "
              "retrieval head ratio for Llama-2-7B-32K-Instruct and a 50% ratio for "
              "Llama-3-8B-Instruct-Gradient-1048k.\"", "Llama-2-7B-32K-Instruct (MHA), 25% retrieval heads, "
              "LongBench and needle in a haystack, against full attention", "memory \"up to 2.55× for MHA\"",
              lambda at: _duo_keeps_copy(at, 0.25), COPY),
        Claim("with 50% of the heads whole, copying is kept (GQA)", f"{DUO}, abstract and section 3.2",
              "\"with minimal accuracy loss compared to full attention\"", "Llama-3-8B-Instruct-Gradient-1048k "
              "(GQA), 50% retrieval heads, against full attention", "memory \"1.67× for GQA\"",
              lambda at: _duo_keeps_copy(at, 0.5), COPY),
    ),
}


def preset_of(runs: pd.DataFrame) -> str | None:
    """The paper preset the sweep's runs were made by (their ``experiment``), if it is one and they agree."""
    if KEYS.experiment not in runs:
        return None
    names = set(runs[KEYS.experiment].dropna())
    return names.pop() if len(names) == 1 and next(iter(names)) in PAPERS else None


def claim_row(claim: Claim, preset_name: str, ok: pd.DataFrame,
              positions: dict[str, pd.DataFrame] | None = None) -> ClaimRow:
    """One claim with kvlab's answer from the ok runs of its setting and their per-position rows; "not judged"
    (``not_judged`` says why) when the runs it needs are of another setting, have no per-position rows, scored
    fewer than ``intervals.MIN_UNITS`` texts (or sequences), or its control cannot show the effect."""
    row = ClaimRow(claim.claim, claim.source, claim.quote, claim.paper_setting, claim.paper_number, claim.kind,
                   PRESET_METRIC.get(preset_name, "kl"), "—", "—", None, (), why_fixed=claim.why_fixed)
    try:
        setting = claim_setting(preset_name, claim)
        at = Runs(ok, setting, positions, row.metric)
        try:
            phrase, number, verdict, names = claim.test(at)
        except NoRows as e:
            phrase, number, verdict, names = "—", "—", NotJudged(str(e)), ()
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OSError) as e:
        return dataclasses.replace(row, our_number=f"could not be read ({type(e).__name__}: {e})")
    ours = setting_text(setting) + ("" if phrase == "—" else f": {phrase}")
    n = "; ".join(f"{k} {u[:-1] if k == 1 else u}" for k, u in sorted(at.units))
    few = too_few(at.units) if verdict is not None else ""
    # from too few units, a control's reading (a collapse, a gap) is no more a reading than the verdict's
    why = [w for w in (at.differences(), few or (verdict.why if isinstance(verdict, NotJudged) else "")) if w]
    if why and number.startswith("not in this sweep"):
        why.append("and some of its runs are not in this sweep")
    if why:
        return dataclasses.replace(row, our_setting=ours, our_number="not judged: " + "; ".join(why), runs=names,
                                   not_judged="; ".join(why), n=n)
    return dataclasses.replace(row, our_setting=ours, our_number=number, verdict=verdict, runs=names, n=n,
                               decide=_decider(claim, at))


def _decider(claim: Claim, at: Runs) -> Callable[[float], str]:
    """The claim's verdict with every interval of its test at ``level`` (holds, does not hold, or inconclusive:
    a control that no longer shows its effect at that level decides nothing)."""
    def decide(level: float) -> str:
        at.level = level
        try:
            verdict = claim.test(at)[2]
        finally:
            at.level = intervals.LEVEL
        return verdict if verdict in (intervals.HOLDS, intervals.FAILS) else intervals.INCONCLUSIVE
    return decide


# ---- the scorecard: a family of verdicts, corrected for their number ----------------------------------------------

ALPHA = 1 - intervals.LEVEL  # the family-wise error rate a scorecard is held to: 5%


def counts(row: ClaimRow) -> bool:
    """Whether a row is one of its scorecard's tests: a claim (a paper's, or kvlab's own check) with a verdict; not
    a row decided by construction, not one not judged, not one with nothing to judge."""
    return (row.kind != CONSTRUCTION and not row.not_judged and row.decide is not None
            and row.verdict in (intervals.HOLDS, intervals.FAILS, intervals.INCONCLUSIVE))


def scorecard(rows: list[ClaimRow], family: str) -> list[ClaimRow]:
    """``rows`` with Holm's step-down correction over those that count (``counts``; m of them), ``family`` naming
    them in words: the claims decided with every interval at 1 − ALPHA / m keep that verdict; of the rest, those
    decided at 1 − ALPHA / (m − k) (k decided so far) keep theirs; and so on, until a step decides none: the rest
    are inconclusive. The same as Holm (1979) on each claim's p-value, the least alpha at which its intervals decide
    it, and it holds the chance of any wrong verdict in the family to ALPHA. ``adjusted`` is each counted row's
    verdict after it (None for the rest)."""
    left = [i for i, r in enumerate(rows) if counts(r)]
    m, adjusted = len(left), {}
    while left:
        level = 1 - ALPHA / len(left)
        now = {i: rows[i].decide(level) for i in left}
        done = [i for i in left if now[i] in (intervals.HOLDS, intervals.FAILS)]
        if not done:
            break
        adjusted.update((i, now[i]) for i in done)
        left = [i for i in left if i not in done]
    adjusted.update((i, intervals.INCONCLUSIVE) for i in left)
    words = f"{m} claim{'s' if m != 1 else ''}: {family}; Holm's step-down, {ALPHA:.0%} family-wise"
    return [dataclasses.replace(r, adjusted=adjusted[i], family=words) if i in adjusted else r
            for i, r in enumerate(rows)]


def too_few(units: set[tuple[int, str]]) -> str:
    """'n = 1 (at least 10 texts needed)' for the units an interval was made from that are fewer than
    ``intervals.MIN_UNITS`` ("" when none are): no verdict reads such an interval."""
    return "; ".join(f"n = {k} (at least {intervals.MIN_UNITS} {u} needed)" for k, u in sorted(units)
                     if k < intervals.MIN_UNITS)


def claim_rows(runs: pd.DataFrame, positions: dict[str, pd.DataFrame] | None = None) -> list[ClaimRow]:
    """The claims of the paper preset that made ``runs``, each with kvlab's answer from them and their
    per-position rows (``positions``: ``results.load_tables``' frames, or any dict with ``text_positions`` and
    ``retrieval_positions``); [] for any other sweep."""
    preset_name = preset_of(runs)
    if preset_name is None:
        return []
    ok = ok_runs(runs)
    base = ok[KEYS.model].map(base_model) if KEYS.model in ok else pd.Series(dtype=object)
    engines = ok[KEYS.engine].fillna("kvlab") if KEYS.engine in ok else pd.Series("kvlab", index=ok.index)
    if engines.nunique() > 1:  # each engine's runs are a column group of their own: "mini, engine llamacpp"
        base = base + engines.map(lambda e: "" if e == "kvlab" else f"{ENGINE_MARK}{e}")
    models = sorted(set(base.dropna()), key=str)  # the same order whatever order the runs were read in
    if len(models) < 2:
        rows = [claim_row(c, preset_name, ok, positions) for c in PAPERS[preset_name]]
    else:
        rows = [dataclasses.replace(claim_row(c, preset_name, ok[base == m], positions), model=m)
                for c in PAPERS[preset_name] for m in models]  # each claim on each model's runs alone
    where = f" on {', '.join(models)}" if models else ""
    return scorecard(rows, f"experiment={preset_name}'s claims judged{where}")


OUTLIERS_MARK = " · outliers x"  # how a run's model label names injected outlier channels (runner.model_label)
ENGINE_MARK = ", engine "  # a column group's label for a peer engine's runs of a model (claim_rows)


def base_model(label):
    """The model a run's label names, without its injected outliers (an arm some presets sweep, not a model)."""
    return label.split(OUTLIERS_MARK)[0] if isinstance(label, str) else label


NOT_JUDGED = "not judged"


def verdict_text(row: ClaimRow) -> str:
    """The verdict column: holds, does not hold, inconclusive, not judged, "by construction (holds)" (a sanity
    check: what its setting decides, outside the scorecard), or — (nothing to judge, or its runs are missing)."""
    if row.not_judged:
        return NOT_JUDGED
    if row.kind == CONSTRUCTION:
        return f"{CONSTRUCTION} ({row.verdict})" if row.verdict else CONSTRUCTION
    return row.verdict or "—"


def adjusted_text(row: ClaimRow) -> str:
    """The scorecard's column: the verdict after Holm's correction ("—" for a row outside the scorecard)."""
    return row.adjusted or "—"

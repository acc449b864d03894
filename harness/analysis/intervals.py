"""Intervals on comparisons between runs, and the verdicts they allow.

A quality figure of a run (mean KL, KL p99, ΔNLL, copy accuracy) is a statistic of per-position values grouped in
units: the texts drift is scored on, the sequences retrieval copies. Two runs of a sweep score the same units (the
same texts, identified by their tokens), so a comparison reads units, not positions, and the same units for both
arms (paired): the interval says how much the figure would move on other texts like these.

How an interval is made (``Interval.how`` says it beside every figure):

- a mean (mean KL, ΔNLL, copy accuracy, and any function of several runs' means: a difference, a ratio, the share
  of a gap) gets a **t-interval**: the figure ± Student's t quantile (n − 1 degrees of freedom) × its jackknife
  standard error over the units (each unit left out in turn, from every arm at once). For a difference of two
  runs' means over units of one length it is exactly the paired t-interval on the per-unit differences; for a
  ratio it is made on the logarithm (a ratio's interval is never below 0). Its coverage is honest at small n: 95%
  at n = 3 on normal units, where a percentile bootstrap covers about 75%
  (tests/analysis/test_intervals.py::test_t_interval_covers_95_in_100_at_small_n);
- a quantile (KL p99), where the jackknife fails, gets the paired **percentile bootstrap** over units (``N_BOOT``
  resamples, seeded): it is shown, never a verdict's reading.

    from harness.analysis import intervals
    iv = intervals.compare(a, b, "kl", how="ratio", unit="text_id")  # a, b: one run's text_positions rows each
    iv.lo, iv.hi, iv.n                                               # 95% interval, over iv.n texts
    iv.at(0.99)                                                      # the same figure's 99% interval
    intervals.verdict(iv, "<", 1.0)                                  # holds / does not hold / inconclusive
    iv.text()                                                        # "+0.051 [+0.032, +0.070]"

No verdict reads an interval from fewer than ``MIN_UNITS`` units: per-text KL is skewed, and a t-interval's
coverage on skewed units falls short of 95% at a handful (a claim says "not judged: n = 4 (at least 10 texts
needed)", ``harness.analysis.papers``). An interval over one unit has no width at all, and one of no width (every
unit alike) says the units did not vary, not how far the figure could move: ``text`` prints the figure alone,
``+0.268 (n = 1: no interval)``, and ``with_intervals`` leaves it out.

``unit`` is the column that names a unit: for kvlab's tables ``text_id`` (text_positions.csv) or ``seq_id``
(retrieval_positions.csv), which name a text or sequence by its tokens, so that two runs pair only on the same tokens.
Reproducible: the same rows give the same interval. Pure: numpy and pandas in, dataclasses out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd

from harness.common.stats import t_quantile, t_within  # noqa: F401 (Student's t: its home is harness.common)

N_BOOT = 2_000  # resamples
LEVEL = 0.95
SEED = 0
CHUNK = 200  # resamples held at once for a quantile (a resample is a weight per position)

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
# the fewest units (texts or sequences) a verdict reads an interval from: a t-interval covers 95% on normal units at
# any n, but per-text KL is skewed, and on skewed units it covers less, the fewer they are: lognormal units of sigma
# 0.5 about 91% at n = 4 and 92-94% at 10; of sigma 1 about 82% at 4 and 84% at 10, where the percentile bootstrap
# kvlab used before covers 69% and 80% (tests/analysis/test_intervals.py::test_skewed_units_need_ten). Every paper preset scores more (24 to 40 texts,
# H2O's 16 copied sequences; conf/experiment/paper_*.yaml)
MIN_UNITS = 10
# the fewest units an interval is printed from: over one unit there is no spread to read. Between MIN_SHOWN and
# MIN_UNITS an interval is printed (it says how far the figure moves over the units there are) but no verdict reads it
MIN_SHOWN = 2


@dataclass(frozen=True)
class Metric:
    """A quality figure a claim reads: ``stat`` of ``column`` over the per-position rows of ``table``, its interval
    resampling ``unit`` (texts or sequences); ``better``: which way is better."""

    name: str
    label: str
    table: str
    unit: str
    column: str
    stat: str
    better: str  # "low" | "high"
    fmt: str = ".3g"
    low: float = -math.inf  # the figure's own range (an accuracy lies in [0, 1], a KL at or above 0): one run's
    high: float = math.inf  # interval is cut to it (a t-interval is symmetric; the figure cannot leave its range)

    def clipped(self, iv: "Interval") -> "Interval":
        """One run's interval of this figure, cut to the figure's range."""
        if not (np.isfinite(iv.lo) and np.isfinite(iv.hi)):
            return iv
        return dataclasses.replace(iv, lo=max(iv.lo, self.low), hi=min(iv.hi, self.high))

    @property
    def unit_name(self) -> str:
        return {"text_id": "texts", "seq_id": "sequences"}.get(self.unit, self.unit)


METRICS = {
    "kl": Metric("kl", "mean KL (nats)", "text_positions", "text_id", "kl", "mean", "low", low=0.0),
    "kl_p99": Metric("kl_p99", "KL p99 (nats)", "text_positions", "text_id", "kl", "p99", "low", low=0.0),
    "nll": Metric("nll", "ΔNLL (nats/token)", "text_positions", "text_id", "dnll", "mean", "low", "+.3f"),
    "copy": Metric("copy", "copy accuracy", "retrieval_positions", "seq_id", "correct", "mean", "high", ".3f", 0.0,
                   1.0),
    "niah": Metric("niah", "niah accuracy", "niah_positions", "seq_id", "correct", "mean", "high", ".3f", 0.0, 1.0),
    "mqar": Metric("mqar", "mqar accuracy", "mqar_positions", "seq_id", "correct", "mean", "high", ".3f", 0.0, 1.0),
}


def rows_of(positions: dict | None, run_name, metric: Metric) -> pd.DataFrame | None:
    """One run's per-position rows of ``metric``'s table (``positions``: table name -> every run's rows, with
    ``run_name``), its derived column added (ΔNLL: ``dnll``); None when it has none."""
    table = (positions or {}).get(metric.table)
    if table is None or "run_name" not in table:
        return None
    sel = table[table["run_name"] == run_name]
    if not len(sel):
        return None
    return sel.assign(dnll=sel["nll"] - sel["nll_fp32"]) if metric.column == "dnll" else sel


RUN_KEYS = (("drift_kl", "kl"), ("drift_kl_p99", "kl_p99"), ("drift_delta_nll", "nll"), ("retrieval_acc", "copy"),
            ("niah_acc", "niah"), ("mqar_acc", "mqar"))


def with_intervals(runs: pd.DataFrame, positions: dict | None) -> pd.DataFrame:
    """``runs`` with a 95% interval on each run's quality figures over its own texts or sequences: ``<key>_lo`` and
    ``<key>_hi`` for drift_kl, drift_kl_p99, drift_delta_nll, retrieval_acc, niah_acc and mqar_acc (NaN where a run has no per-position
    rows, or its interval is none: fewer than ``MIN_SHOWN`` units, or no width). What the report's tables carry and
    its figures draw as error bars."""
    out = runs.copy()
    if not len(out) or "run_name" not in out:
        return out
    for key, name in RUN_KEYS:
        lo, hi = [], []
        for run_name in out["run_name"]:
            rows = rows_of(positions, run_name, METRICS[name])
            iv = None if rows is None else METRICS[name].clipped(single(rows, METRICS[name].column,
                                                                        METRICS[name].stat, unit=METRICS[name].unit))
            lo.append(iv.lo if iv is not None and iv.shown else np.nan)
            hi.append(iv.hi if iv is not None and iv.shown else np.nan)
        if not all(np.isnan(lo)):
            out[f"{key}_lo"], out[f"{key}_hi"] = lo, hi
    return out

@dataclass(frozen=True)
class Interval:
    """A figure (``estimate``: on the runs' own units, every one once) and its interval [lo, hi] at ``level``, from
    ``n`` units. ``method``: "t" (a mean: the figure ± Student's t quantile × ``se``, its jackknife standard error,
    on the log scale when ``log``) or "bootstrap" (a quantile: the percentile interval of ``draws``, ``n_boot``
    resamples); ``at(level)`` gives the same figure's interval at another level."""

    estimate: float
    lo: float
    hi: float
    n: int
    level: float = LEVEL
    n_boot: int = N_BOOT
    method: str = "t"
    se: float = float("nan")
    log: bool = False
    draws: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def how(self) -> str:
        """How the interval was made, in words (what a findings row says beside it)."""
        if self.method == "t":
            return (f"t-interval over {self.n} units (t with {self.n - 1} degrees of freedom × the jackknife "
                    f"standard error over units, the same units for every run of a comparison"
                    f"{', on the log scale' if self.log else ''}), {100 * self.level:.0f}%")
        return (f"bootstrap over {self.n} units (the same units for both runs of a comparison), "
                f"{self.n_boot:,} resamples, {100 * self.level:.0f}% percentile interval")

    def at(self, level: float) -> "Interval":
        """The same figure's interval at ``level`` (a claim judged at a stricter level, as a multiplicity
        correction does)."""
        if not 0 < level < 1:
            raise ValueError(f"level={level!r}: give a level in (0, 1), e.g. 0.95")
        if self.method == "t":
            lo, hi = t_bounds(self.estimate, self.se, self.n, level, self.log)
        elif len(self.draws):
            lo, hi = _bounds(np.asarray(self.draws), level)
        else:
            lo, hi = self.lo, self.hi
        return dataclasses.replace(self, lo=lo, hi=hi, level=level)

    @property
    def enough(self) -> bool:
        """Made from at least ``MIN_UNITS`` units: an interval a verdict may read."""
        return self.n >= MIN_UNITS

    @property
    def shown(self) -> bool:
        """Printed as an interval: from at least ``MIN_SHOWN`` units, finite, and of some width (a verdict reads it
        only from ``MIN_UNITS``: ``enough``)."""
        return self.n >= MIN_SHOWN and bool(np.isfinite(self.lo) and np.isfinite(self.hi)) and self.lo < self.hi

    def text(self, fmt: "str | Callable[[float], str]" = "+.3g", suffix: str = "") -> str:
        """'+0.051 [+0.032, +0.070]' (``suffix`` after the figure: '1.31× [1.12, 1.52]'); where it is no interval,
        the figure alone and why: '+0.268 (n = 1: no interval)', '+0 (n = 24, no spread: no interval)'. ``fmt``:
        a format spec or a function of a number."""
        def f(x: float) -> str:
            return fmt(x) if callable(fmt) else f"{x:{fmt}}"

        if self.shown:
            return f"{f(self.estimate)}{suffix} [{f(self.lo)}, {f(self.hi)}]"
        return f"{f(self.estimate)}{suffix} ({self.missing}: no interval)"

    @property
    def missing(self) -> str:
        """Why it is no interval (``shown`` false): 'n = 1', 'n = 24, no spread'."""
        if self.n < MIN_SHOWN:
            return f"n = {self.n}"
        return f"n = {self.n}, " + ("no spread" if np.isfinite(self.lo) and np.isfinite(self.hi) else "not finite")


def t_bounds(estimate: float, se: float, n: int, level: float, log: bool = False) -> tuple[float, float]:
    """[estimate ∓ t × se] at ``level`` with n − 1 degrees of freedom (on the log scale when ``log``: ``se`` is the
    log's); NaN with fewer than two units or a standard error that is not finite."""
    if n < 2 or not (math.isfinite(se) and math.isfinite(estimate)):
        return math.nan, math.nan
    half = t_quantile(level, n - 1) * se
    if log:
        if estimate <= 0:
            return math.nan, math.nan
        centre = math.log(estimate)
        return math.exp(centre - half), math.exp(centre + half)
    return estimate - half, estimate + half


class NotPaired(ValueError):
    """Two runs whose units differ: their figures cannot be compared unit by unit."""


def units(rows: pd.DataFrame, unit: str) -> list:
    """The distinct units of one run's rows, sorted."""
    return sorted(rows[unit].unique().tolist())


def _matrix(rows: pd.DataFrame, column: str, unit: str, order: list) -> tuple[np.ndarray, np.ndarray]:
    """(values, unit index of each value) for the units in ``order``."""
    index = {u: i for i, u in enumerate(order)}
    return rows[column].to_numpy(dtype=float), rows[unit].map(index).to_numpy(dtype=int)


def _counts(n_units: int, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, n_units): how many times each unit is drawn in each resample (n_units draws with replacement)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=n_boot).astype(float)


def _stat(values: np.ndarray, which: np.ndarray, counts: np.ndarray, stat: str) -> np.ndarray:
    """The statistic of each resample (one per row of ``counts``): every position of a unit drawn k times counts
    k times."""
    if stat == "mean":
        sums = np.bincount(which, weights=values, minlength=counts.shape[1])
        sizes = np.bincount(which, minlength=counts.shape[1]).astype(float)
        return (counts @ sums) / (counts @ sizes)
    q = quantile_of(stat)
    order = np.argsort(values, kind="stable")
    v, w_unit = values[order], which[order]
    out = np.empty(len(counts))
    for a in range(0, len(counts), CHUNK):  # a weight per position: (CHUNK, positions) at a time
        w = counts[a:a + CHUNK][:, w_unit]
        cum = np.cumsum(w, axis=1)
        at = (cum < q * cum[:, -1:]).sum(axis=1)  # the first position whose cumulative weight reaches q
        out[a:a + CHUNK] = v[np.minimum(at, len(v) - 1)]
    return out


def quantile_of(stat: str) -> float:
    """'p99' -> 0.99."""
    if not (stat.startswith("p") and stat[1:].isdigit() and 0 < int(stat[1:]) < 100):
        raise ValueError(f"stat={stat!r}: use mean or p1 .. p99")
    return int(stat[1:]) / 100


def point(values: np.ndarray, stat: str) -> float:
    """The statistic on every position once (a quantile interpolated, as the run's own record has it)."""
    return float(values.mean()) if stat == "mean" else float(np.quantile(values, quantile_of(stat)))


def _bounds(draws: np.ndarray, level: float) -> tuple[float, float]:
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    return float(lo), float(hi)


def single(rows: pd.DataFrame, column: str, stat: str = "mean", unit: str = "text", n_boot: int = N_BOOT,
           seed: int = SEED, level: float = LEVEL) -> Interval:
    """One run's figure (``stat`` of ``column`` over its positions) with its interval over its units."""
    return paired({"a": rows}, column, lambda s: s["a"], stat, unit, n_boot, seed, level)


def compare(a: pd.DataFrame, b: pd.DataFrame, column: str, stat: str = "mean", how: str = "difference",
            unit: str = "text", n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL) -> Interval:
    """``stat`` of ``column`` in run ``a`` against run ``b`` (``how``: a − b, or a / b, the ratio's interval made on
    its logarithm), paired: the same units for both. Raises ``NotPaired`` when the runs' units differ."""
    if how not in ("difference", "ratio"):
        raise ValueError(f"how={how!r}: use difference or ratio")
    fn = (lambda s: s["a"] - s["b"]) if how == "difference" else (lambda s: s["a"] / s["b"])
    iv = paired({"a": a, "b": b}, column, fn, stat, unit, n_boot, seed, level, log=how == "ratio")
    if how == "ratio" and not iv.log and np.isfinite(iv.lo) and (a[column] >= 0).all() and (b[column] >= 0).all():
        iv = dataclasses.replace(iv, lo=max(iv.lo, 0.0))  # a ratio of figures that cannot be negative cannot be
    return iv  # (made on the linear scale when a figure, or a leave-one-out figure, is 0: no logarithm)


def paired(arms: dict[str, pd.DataFrame], column: str, fn, stat: str = "mean", unit: str = "text",
           n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL, log: bool = False) -> Interval:
    """Any function of several runs' figures (``fn``: {arm: its ``stat`` of ``column``} -> a number, written with
    numpy operations so that it also takes an array per arm), with its paired interval: the same units for every
    arm. E.g. the share of a gap a third run closes: ``fn=lambda s: (s["4"] - s["8"]) / (s["0"] - s["4"])``. A mean
    gets the t-interval (``log``: made on the figure's logarithm, for a ratio), a quantile the percentile bootstrap
    (the module's docstring). Raises ``NotPaired`` when the runs' units differ."""
    names = list(arms)
    order = units(arms[names[0]], unit)
    for name in names[1:]:
        other = units(arms[name], unit)
        if other != order:
            raise NotPaired(f"the runs scored different {unit}s ({len(order)} and {len(other)}, not the same ones): "
                            "they cannot be compared unit by unit")
    matrices = {name: _matrix(arms[name], column, unit, order) for name in names}
    points = {name: np.float64(point(values, stat)) for name, (values, _) in matrices.items()}
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = float(fn(points))
    if stat == "mean":
        return _t_interval(matrices, fn, estimate, len(order), level, log)
    quantile_of(stat)  # a bad stat is refused before any resampling
    counts = _counts(len(order), n_boot, seed)
    draws = {name: _stat(values, which, counts, stat) for name, (values, which) in matrices.items()}
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = np.asarray(fn(draws), dtype=float)
    return Interval(estimate, *_bounds(spread, level), n=len(order), level=level, n_boot=n_boot, method="bootstrap",
                    draws=tuple(spread.tolist()))


def _t_interval(matrices: dict, fn, estimate: float, n: int, level: float, log: bool) -> Interval:
    """The t-interval of ``fn`` of the arms' means: its jackknife standard error over the n units (each left out of
    every arm at once), on the log scale when ``log`` and the figure and every leave-one-out figure are positive."""
    left_out = {}
    for name, (values, which) in matrices.items():
        sums = np.bincount(which, weights=values, minlength=n)
        sizes = np.bincount(which, minlength=n).astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            left_out[name] = (sums.sum() - sums) / (sizes.sum() - sizes)
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = np.asarray(fn(left_out), dtype=float) * np.ones(n)
    log = log and estimate > 0 and bool(np.all(theta > 0))
    if log:
        theta = np.log(theta)
    se = float(np.sqrt((n - 1) / n * np.sum((theta - theta.mean()) ** 2))) if n > 1 else math.nan
    lo, hi = t_bounds(estimate, se, n, level, log)
    if n > 1 and se == 0:
        lo = hi = estimate
    return Interval(estimate, lo, hi, n=n, level=level, n_boot=0, method="t", se=se, log=log)


def verdict(iv: Interval, direction: str, bound: float = 0.0) -> str:
    """Whether the claim "the figure is ``direction`` ``bound``" (direction "<" or ">") holds: "holds" when the whole
    interval is on the claim's side of the bound, "does not hold" when the whole interval is on the other side (or
    at the bound), otherwise "inconclusive" (the data cannot tell, as from fewer than ``MIN_UNITS`` units)."""
    if direction not in ("<", ">"):
        raise ValueError(f"direction={direction!r}: use < or >")
    if not (iv.enough and np.isfinite(iv.lo) and np.isfinite(iv.hi)):
        return INCONCLUSIVE
    if direction == "<":
        return HOLDS if iv.hi < bound else FAILS if iv.lo >= bound else INCONCLUSIVE
    return HOLDS if iv.lo > bound else FAILS if iv.hi <= bound else INCONCLUSIVE


def verdict_within(iv: Interval, low: float, high: float) -> str:
    """Whether the claim "the figure lies between ``low`` and ``high``" (a margin: "about the same") holds: "holds"
    when the whole interval is inside, "does not hold" when the whole interval is outside, otherwise
    "inconclusive" (as from fewer than ``MIN_UNITS`` units)."""
    if not (iv.enough and np.isfinite(iv.lo) and np.isfinite(iv.hi)):
        return INCONCLUSIVE
    if low <= iv.lo and iv.hi <= high:
        return HOLDS
    if iv.hi < low or iv.lo > high:
        return FAILS
    return INCONCLUSIVE

"""harness.analysis.intervals: the paired t-interval over units (means), the paired percentile bootstrap (quantiles)
and their verdicts, on synthetic runs whose answers are known (a true difference, none, the other way round, units
that differ), and the coverage each has at small n on simulated data."""

import math

import numpy as np
import pandas as pd
import pytest

from harness.analysis import intervals
from harness.analysis.intervals import FAILS, HOLDS, INCONCLUSIVE, Interval


def run(per_text: list[np.ndarray], column: str = "kl") -> pd.DataFrame:
    """One run's per-position rows: text i's positions hold per_text[i]."""
    return pd.DataFrame([dict(text=f"t{i}", position=j, **{column: float(v)})
                         for i, values in enumerate(per_text) for j, v in enumerate(values)])


def test_the_figure_is_the_runs_own_statistic():
    rng = np.random.default_rng(1)
    texts = [rng.exponential(size=50) for _ in range(8)]
    rows = run(texts)
    pooled = np.concatenate(texts)
    assert intervals.single(rows, "kl").estimate == pytest.approx(pooled.mean())
    assert intervals.single(rows, "kl", stat="p99").estimate == pytest.approx(np.quantile(pooled, 0.99))
    iv = intervals.single(rows, "kl")
    assert iv.lo < iv.estimate < iv.hi and iv.n == 8 and iv.method == "t" and iv.se > 0
    per_text = np.array([t.mean() for t in texts])  # texts of one length: the t-interval on the texts' means
    half = intervals.t_quantile(0.95, 7) * per_text.std(ddof=1) / math.sqrt(8)
    assert (iv.lo, iv.hi) == pytest.approx((per_text.mean() - half, per_text.mean() + half))
    q = intervals.single(rows, "kl", stat="p99")
    assert q.method == "bootstrap" and q.n_boot == intervals.N_BOOT and q.lo < q.hi


def test_the_95_interval_covers_a_known_difference_about_95_times_in_100():
    """Texts whose difficulty varies, the same texts under two settings, a true difference of 0.05: over 300 draws
    of 30 texts, the interval holds 0.05 in 90% to 99% of them (95% expected)."""
    rng = np.random.default_rng(7)
    covered = 0
    for trial in range(300):
        level = rng.normal(1.0, 0.5, size=30)  # each text's own difficulty, shared by both settings
        a = [lv + 0.05 + rng.normal(0, 0.1, 10) for lv in level]
        b = [lv + rng.normal(0, 0.1, 10) for lv in level]
        iv = intervals.compare(run(a), run(b), "kl")
        covered += iv.lo <= 0.05 <= iv.hi
    assert 0.90 <= covered / 300 <= 0.99, covered


def test_pairing_sees_a_difference_that_separate_intervals_hide():
    rng = np.random.default_rng(3)
    level = rng.normal(1.0, 1.0, size=16)  # texts differ far more than the settings do
    a = run([lv + 0.1 + rng.normal(0, 0.02, 30) for lv in level])
    b = run([lv + rng.normal(0, 0.02, 30) for lv in level])
    ia, ib = intervals.single(a, "kl"), intervals.single(b, "kl")
    assert ia.lo < ib.hi  # apart, the two intervals overlap: nothing could be said
    paired = intervals.compare(a, b, "kl")
    assert 0.08 < paired.lo < paired.estimate < paired.hi < 0.12
    assert intervals.verdict(paired, ">") == HOLDS and intervals.verdict(paired, "<") == FAILS


def test_no_difference_is_inconclusive():
    """The settings differ text by text, +0.2 on half the texts and −0.2 on the other half: no difference in the
    mean, and the interval says the data cannot tell either way."""
    base = [np.full(10, 1.0) for _ in range(12)]
    a = run([t + (0.2 if i % 2 else -0.2) for i, t in enumerate(base)])
    iv = intervals.compare(a, run(base), "kl")
    assert iv.estimate == pytest.approx(0.0, abs=1e-12) and iv.lo < 0 < iv.hi
    assert intervals.verdict(iv, "<") == INCONCLUSIVE and intervals.verdict(iv, ">") == INCONCLUSIVE


def test_a_ratio_and_the_other_way_round():
    a = run([np.full(5, 2.0 + 0.01 * i) for i in range(10)])
    b = run([np.full(5, 1.0 + 0.01 * i) for i in range(10)])
    iv = intervals.compare(a, b, "kl", how="ratio")
    assert 1.8 < iv.lo <= iv.estimate <= iv.hi < 2.0
    assert intervals.verdict(iv, "<", 1.0) == FAILS and intervals.verdict(iv, ">", 1.0) == HOLDS


def test_units_are_resampled_not_positions():
    """Ten times more positions per text, each text's values repeated: the same texts, so the same interval (a
    bootstrap over positions would narrow it by about three)."""
    rng = np.random.default_rng(5)
    texts = [rng.normal(i % 3, 1.0, size=8) for i in range(10)]
    once, ten = intervals.single(run(texts), "kl"), intervals.single(run([np.tile(t, 10) for t in texts]), "kl")
    assert (once.estimate, once.lo, once.hi) == pytest.approx((ten.estimate, ten.lo, ten.hi))


def test_a_quantile_resamples_whole_texts():
    """p99 of texts that are constant within: every resample's p99 is one of the texts' values, and the interval
    runs between them."""
    values = [0.1, 0.2, 0.3, 5.0]
    rows = run([np.full(25, v) for v in values])
    iv = intervals.single(rows, "kl", stat="p99")
    assert iv.lo in values and iv.hi in values and iv.lo <= iv.estimate <= iv.hi
    assert intervals.single(run([np.full(25, 0.7)] * 4), "kl", stat="p99").text() == "+0.7 (n = 4, no spread: no interval)"


def test_the_same_rows_give_the_same_interval():
    rng = np.random.default_rng(9)
    a, b = run([rng.normal(1, 1, 9) for _ in range(7)]), run([rng.normal(1, 1, 9) for _ in range(7)])
    assert intervals.compare(a, b, "kl") == intervals.compare(a, b, "kl")
    assert intervals.compare(a, b, "kl", "p99") == intervals.compare(a, b, "kl", "p99")  # the bootstrap is seeded
    assert intervals.compare(a, b, "kl", "p99", seed=1).draws != intervals.compare(a, b, "kl", "p99").draws


def test_runs_of_different_texts_are_not_compared():
    a, b = run([np.ones(3)] * 3), run([np.ones(3)] * 4)
    with pytest.raises(intervals.NotPaired, match="scored different texts"):
        intervals.compare(a, b, "kl")


def test_bad_arguments_are_one_line():
    rows = run([np.ones(3)] * 3)
    with pytest.raises(ValueError, match="stat='median': use mean or p1 .. p99"):
        intervals.single(rows, "kl", stat="median")
    with pytest.raises(ValueError, match="how='sum': use difference or ratio"):
        intervals.compare(rows, rows, "kl", how="sum")
    with pytest.raises(ValueError, match="direction='='"):
        intervals.verdict(Interval(0, 0, 0, 1), "=")


@pytest.mark.parametrize("lo,hi,want", [(-0.5, -0.1, HOLDS), (0.1, 0.5, FAILS), (-0.1, 0.1, INCONCLUSIVE),
                                        (0.0, 0.3, FAILS), (float("nan"), 0.1, INCONCLUSIVE)])
def test_verdict_reads_the_whole_interval(lo, hi, want):
    assert intervals.verdict(Interval((lo + hi) / 2, lo, hi, 10), "<") == want


@pytest.mark.parametrize("lo,hi,want", [(-0.05, 0.05, HOLDS), (0.2, 0.3, FAILS), (-0.05, 0.2, INCONCLUSIVE)])
def test_about_the_same_is_a_margin(lo, hi, want):
    assert intervals.verdict_within(Interval((lo + hi) / 2, lo, hi, 10), -0.1, 0.1) == want


def test_each_runs_quality_gets_its_interval_over_its_own_texts():
    """with_intervals: a run's <key>_lo / <key>_hi are intervals.single over its rows (ΔNLL from nll - nll_fp32,
    copy accuracy over sequences); a run without rows gets NaN, and the figure itself is left as it was."""
    rng = np.random.default_rng(3)
    text = pd.DataFrame(dict(run_name=np.repeat(["a", "b"], 120), text_id=np.tile(np.repeat(list("abcdefghijkl"), 10),
                                                                                  2),
                             kl=rng.gamma(2.0, 0.05, 240), nll=3 + rng.random(240), nll_fp32=3.0))
    copy = pd.DataFrame(dict(run_name="a", seq_id=np.repeat([f"s{i}" for i in range(12)], 5),
                             correct=rng.integers(0, 2, 60)))
    runs = pd.DataFrame(dict(run_name=["a", "b", "c"], drift_kl=[0.1, 0.2, 0.3]))
    out = intervals.with_intervals(runs, {"text_positions": text, "retrieval_positions": copy})
    a = text[text.run_name == "a"]
    iv = intervals.single(a, "kl", unit="text_id")
    assert (out.loc[0, "drift_kl_lo"], out.loc[0, "drift_kl_hi"]) == (iv.lo, iv.hi)
    d = intervals.single(a.assign(dnll=a.nll - a.nll_fp32), "dnll", unit="text_id")
    assert (out.loc[0, "drift_delta_nll_lo"], out.loc[0, "drift_delta_nll_hi"]) == (d.lo, d.hi)
    c = intervals.single(copy, "correct", unit="seq_id")
    assert (out.loc[0, "retrieval_acc_lo"], out.loc[0, "retrieval_acc_hi"]) == (c.lo, c.hi)
    assert np.isnan(out.loc[1, "retrieval_acc_lo"]) and np.isnan(out.loc[2, "drift_kl_lo"])
    assert out.loc[1, "drift_kl_p99_lo"] <= np.quantile(text[text.run_name == "b"].kl, 0.99)
    assert out["drift_kl"].tolist() == [0.1, 0.2, 0.3]
    paired = intervals.paired({"x": a, "y": text[text.run_name == "b"]}, "kl",
                              lambda s: s["x"] - s["y"], unit="text_id")
    assert paired == intervals.compare(a, text[text.run_name == "b"], "kl", unit="text_id")


def test_no_interval_from_too_few_units_or_of_no_width():
    """interval-zero-width (tests/analysis/test_findings.py lists it): an interval from fewer than MIN_UNITS units,
    or of no width, is printed as the figure and why, never as '[x, x]'; the report's table leaves it out (NaN); a
    verdict does not read it below MIN_UNITS, however far from the bound it lies."""
    one = intervals.single(run([np.array([0.268])]), "kl")
    assert one.estimate == 0.268 and one.n == 1 and not one.shown
    assert one.text() == "+0.268 (n = 1: no interval)" and one.text(".3g", "×") == "0.268× (n = 1: no interval)"
    alike = intervals.single(run([np.full(3, 0.5)] * 12), "kl")
    assert alike.enough and not alike.shown and alike.text("+.3f") == "+0.500 (n = 12, no spread: no interval)"
    assert intervals.verdict(alike, ">", 0.4) == HOLDS  # every text says so: the verdict stands
    wide = intervals.single(run([np.full(3, 0.5 + 0.1 * i) for i in range(12)]), "kl")
    assert wide.shown and wide.text(lambda x: f"<{x:.1f}>") == "<1.1> [<0.8>, <1.3>]"
    far = Interval(0.3, 0.2, 0.4, intervals.MIN_UNITS - 1)
    assert intervals.verdict(far, ">") == INCONCLUSIVE and intervals.verdict(far, "<") == INCONCLUSIVE
    assert intervals.verdict_within(Interval(0.0, -0.01, 0.01, 2), -0.1, 0.1) == INCONCLUSIVE
    assert intervals.verdict(Interval(0.3, 0.2, 0.4, intervals.MIN_UNITS), ">") == HOLDS
    rows = pd.DataFrame(dict(run_name=["a"] * 3 + ["b"] * 36, text_id=["t0"] * 3 + [f"t{i // 3}" for i in range(36)],
                             kl=[0.2] * 3 + [0.1 + 0.01 * (i // 3) for i in range(36)], nll=3.0, nll_fp32=3.0))
    out = intervals.with_intervals(pd.DataFrame(dict(run_name=["a", "b"], drift_kl=[0.2, 0.155])),
                                   {"text_positions": rows})
    assert np.isnan(out.loc[0, "drift_kl_lo"]) and np.isnan(out.loc[0, "drift_kl_hi"])  # one text: none
    assert out.loc[1, "drift_kl_lo"] < 0.155 < out.loc[1, "drift_kl_hi"]  # twelve: one


def _coverage(draw, n, truth, trials, make=None):
    """How often the 95% interval of one run's mean over n units (each one value, ``draw(n)``) holds ``truth``."""
    make = make or (lambda v: intervals.single(run([np.array([x]) for x in v]), "kl"))
    return np.mean([(lambda iv: iv.lo <= truth <= iv.hi)(make(draw(n))) for _ in range(trials)])


@pytest.mark.slow  # seconds: not in make test-fast
def test_t_interval_covers_95_in_100_at_small_n():
    """The t-interval holds the true mean of normal units about 95 times in 100 at n = 3, 4 and 10 (600 draws each:
    93% or more), where a 95% percentile bootstrap of the same means covers about 75% at n = 3 (the method kvlab
    used before; intervals under 10 units were then never read)."""
    rng = np.random.default_rng(11)
    for n in (3, 4, 10):
        assert _coverage(lambda k: rng.normal(size=k), n, 0.0, 600) >= 0.93, n

    def boot(v):
        lo, hi = intervals._bounds(intervals._counts(len(v), 400, 0) @ v / len(v), 0.95)
        return Interval(float(v.mean()), lo, hi, len(v))

    assert _coverage(lambda k: rng.normal(size=k), 3, 0.0, 600, boot) < 0.82


@pytest.mark.slow  # seconds: not in make test-fast
def test_skewed_units_need_ten():
    """Why MIN_UNITS stays 10 under the t-interval: on skewed units (lognormal) it covers less than 95%, and less
    the fewer they are: sigma 0.5 (moderate skew) covers about 92% at 10 units (90% or more here); sigma 1 covers
    under 88% at 4."""
    rng = np.random.default_rng(12)
    assert _coverage(lambda k: rng.lognormal(0, 0.5, k), intervals.MIN_UNITS, math.exp(0.125), 800) >= 0.90
    assert _coverage(lambda k: rng.lognormal(0, 1.0, k), 4, math.exp(0.5), 800) < 0.88


def test_students_t_is_its_density_integrated():
    """t_within is P(|T| < x): against the density integrated numerically (trapezoids), odd and even df; the
    quantile inverts it."""
    for df in (1, 2, 3, 6, 29):
        x = np.linspace(0, 3, 30_001)
        dens = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi) * \
            (1 + x ** 2 / df) ** (-(df + 1) / 2)
        assert intervals.t_within(3.0, df) == pytest.approx(2 * np.trapezoid(dens, x), abs=1e-7), df
        q = intervals.t_quantile(0.95, df)
        assert intervals.t_within(q, df) == pytest.approx(0.95, abs=1e-10)
    assert intervals.t_quantile(0.95, 10_000) == pytest.approx(1.96, abs=1e-3)  # the normal's, far out
    with pytest.raises(ValueError, match="df=0: give a positive whole number"):
        intervals.t_within(1.0, 0)


def test_an_interval_at_another_level():
    """at(level): the same figure, a wider interval at a higher level (as a multiplicity correction reads it); a
    ratio's interval (made on its log) stays above 0 however few and noisy the texts."""
    rng = np.random.default_rng(13)
    a, b = run([rng.lognormal(0, 1, 5) for _ in range(4)]), run([rng.lognormal(0, 1, 5) for _ in range(4)])
    iv = intervals.compare(a, b, "kl", how="ratio")
    assert iv.log and 0 < iv.lo < iv.estimate < iv.hi
    wide = iv.at(0.999)
    assert wide.estimate == iv.estimate and 0 < wide.lo < iv.lo and wide.hi > iv.hi and wide.level == 0.999
    assert iv.at(0.95) == iv
    q = intervals.compare(a, b, "kl", "p99")
    assert q.at(0.99).lo <= q.lo and q.at(0.99).hi >= q.hi
    with pytest.raises(ValueError, match="level=1.5: give a level in"):
        iv.at(1.5)


def test_a_ratio_of_figures_that_cannot_be_negative_never_reaches_below_0():
    """Copy accuracies of 0 on most sequences: no logarithm to make the interval on, and the linear one is cut at
    0, where a ratio of two figures that cannot be negative ends."""
    a = run([np.array([1.0 if i == 0 else 0.0]) for i in range(12)], "correct")
    b = run([np.array([0.5])] * 12, "correct")
    iv = intervals.compare(a, b, "correct", how="ratio")
    assert not iv.log and iv.lo == 0.0 < iv.estimate < iv.hi

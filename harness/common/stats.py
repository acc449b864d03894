"""Student's t, exact, with no dependency beyond the standard library: what every interval kvlab puts on a mean reads
(``harness.analysis.intervals``' t-intervals, the serving comparisons' over seeds, training's retrieval targets);
and what the measurements compute with and the analysis layer reads back: the drift tolerance per layer
(``LAYER_TOL``) and the cost model fitted to step times (``cost_model``).

    from harness.common.stats import t_quantile, mean_interval
    t_quantile(0.95, 3)                 # 3.182...: the two-sided 95% quantile with 3 degrees of freedom
    mean_interval([0.9, 1.0, 0.95])     # (mean, lo, hi, n): the 95% t-interval of a mean
"""

from __future__ import annotations

import functools
import math

LAYER_TOL = 1e-2  # relative K/V error (vs fp32) from which a layer counts as disagreeing


def cost_model(steps) -> dict:
    """Least-squares fit of the cached step time (ms) against context length T: a + b*T, from a steps table (a
    DataFrame with ``mode``, ``context_len`` and ``ms_median``). One decode step reads (and, for a kind that copies
    its history, copies) T tokens of K/V: linear in T for every kind, a kind that copies having the larger b; only a
    whole generation (a sum of steps) is quadratic. ``a`` is what a step costs with no history (the weights), ``b``
    what each cached token adds. Needs two context lengths or more."""
    c = steps[steps["mode"] == "cached"]
    pairs = sorted(zip(map(float, c["context_len"]), map(float, c["ms_median"])))
    if len({t for t, _ in pairs}) < 2:
        return dict(cost_model=None, cost_a_ms=None, cost_b_ms_per_token=None)
    mt = math.fsum(t for t, _ in pairs) / len(pairs)
    my = math.fsum(y for _, y in pairs) / len(pairs)
    b = math.fsum((t - mt) * (y - my) for t, y in pairs) / math.fsum((t - mt) ** 2 for t, _ in pairs)
    return dict(cost_model="a + b*T", cost_a_ms=my - b * mt, cost_b_ms_per_token=b)


def t_within(x: float, df: int) -> float:
    """P(|T| < x) for Student's t with ``df`` (a positive integer) degrees of freedom: the exact finite series of
    Abramowitz and Stegun 26.7.3 (odd df) and 26.7.4 (even df), in theta = atan(x / sqrt(df))."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df={df!r}: give a positive whole number of degrees of freedom")
    if x <= 0:
        return 0.0
    if not math.isfinite(x):
        return 1.0
    theta = math.atan(x / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2.4/3.5 cos^4 + ...)), the sum for df > 1 only
        term, total = 1.0, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return (2 / math.pi) * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    term, total = 1.0, 0.0  # even: sin (1 + 1/2 cos^2 + 1.3/2.4 cos^4 + ...)
    for k in range(1, df // 2 + 1):
        total += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return s * total


@functools.lru_cache(maxsize=4096)
def t_quantile(level: float, df: int) -> float:
    """The x with P(|T| < x) = ``level`` (two-sided: the 0.975 quantile for level 0.95), by bisection."""
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: give a level in (0, 1)")
    hi = 1.0
    while t_within(hi, df) < level:
        hi *= 2
    lo = 0.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_within(mid, df) < level else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


def mean_interval(values, level: float = 0.95) -> tuple[float, float, float, int]:
    """The mean of ``values`` (the finite ones) and its t-interval at ``level``: (mean, lo, hi, n); NaN bounds from
    fewer than two values, and the mean itself as both bounds when they do not vary."""
    a = [float(v) for v in values if math.isfinite(float(v))]
    n = len(a)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    m = sum(a) / n
    if n < 2:
        return m, math.nan, math.nan, n
    sd = math.sqrt(sum((x - m) ** 2 for x in a) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half, n

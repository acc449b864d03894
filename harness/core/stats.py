"""What the core measures with and the analysis layer reads back, without torch: the drift tolerance per layer and
the cost model fitted to step times (numpy and pandas only, so plots import it without loading the engine)."""

from __future__ import annotations

import numpy as np
import pandas as pd

LAYER_TOL = 1e-2  # relative K/V error (vs fp32) from which a layer counts as disagreeing


def cost_model(steps: pd.DataFrame) -> dict:
    """Least-squares fit of the cached step time (ms) against context length T: a + b*T. One decode step reads (and,
    for a kind that copies its history, copies) T tokens of K/V: linear in T for every kind, a kind that copies
    having the larger b; only a whole generation (a sum of steps) is quadratic. ``a`` is what a step costs with no
    history (the weights), ``b`` what each cached token adds. Needs two context lengths or more."""
    c = steps[steps["mode"] == "cached"].sort_values("context_len")
    T, y = c["context_len"].to_numpy(float), c["ms_median"].to_numpy(float)
    if len(T) < 2:
        return dict(cost_model=None, cost_a_ms=None, cost_b_ms_per_token=None)
    a, b = (float(x) for x in np.polynomial.polynomial.polyfit(T, y, 1))
    return dict(cost_model="a + b*T", cost_a_ms=a, cost_b_ms_per_token=b)

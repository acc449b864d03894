"""The figures carry the numbers they were given: lines, bars and heatmap cells read back equal the input tables,
and nothing of a failed run shows up anywhere."""

import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from harness.analysis.figures import all_figures, figure_makers, figures_for  # noqa: E402
from tests.helpers.claims import kind_facts  # noqa: E402
from harness.analysis.plots import (  # noqa: E402
    cache_bytes_plot,
    drift_plot,
    equivalence_grid,
    memory_plot,
    serving_plot,
    speedup_plot,
    step_time_plot,
)

MODELS, CACHES, DTYPES = ["tiny", "gpt2"], ["concat", "prealloc"], ["fp32", "fp16"]
CONTEXTS, N_STEPS = [32, 128, 512], 5
SENTINEL, BYTES_SENTINEL = 777.125, 777_125  # every number of the failed run; must never be drawn


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def tables():
    """2 models x 2 caches x 2 dtypes of ok runs, plus one failed gpt2/prealloc/fp16 run (a duplicate of an ok one)."""
    runs, steps, drift = [], [], []
    combos = list(itertools.product(MODELS, CACHES, DTYPES))
    for k, (model, cache, dtype) in enumerate(combos + [("gpt2", "prealloc", "fp16")]):
        failed = k == len(combos)
        m, c, d = MODELS.index(model), CACHES.index(cache), DTYPES.index(dtype)
        name = f"run{k}"
        meta = dict(run_name=name, model=model, cache=cache, dtype=dtype, device="cpu",
                    status="failed" if failed else "ok", **kind_facts(cache, {}))
        bpt = (m + 1) * 1000 * (4 if dtype == "fp32" else 2)
        tokens = 40 if cache == "concat" else 1024
        runs.append(dict(meta, error="boom" if failed else "", tokens_identical=(k % 3 != 0),
                         max_abs_logit_diff=10.0 ** -(5 - d - m) * (1 + c + 0.1 * k),
                         cache_nbytes=bpt * tokens + 64 * (k == 3),  # run 3: measured != formula
                         predicted_nbytes=bpt * tokens, nbytes_match=(k != 3), cache_tokens=tokens,
                         bytes_per_token=bpt, drift_kl=np.nan, drift_max_abs=np.nan,
                         drift_top1_agreement=np.nan, ttft_ms=1.0 + k))
        for ctx in CONTEXTS:
            cached = (m + 1) * (1 + c) * (1 + ctx / 256) + 0.01 * k
            uncached = (m + 1) * ctx / 8 * (1 + 0.05 * k)  # differs per run: the plot must average them
            for mode, ms in (("cached", cached), ("uncached", uncached)):
                steps.append(dict(meta, context_len=ctx, mode=mode, ms_median=ms, ms_p10=0.9 * ms, ms_p90=1.2 * ms,
                                  speedup=uncached / cached))
        for step in range(N_STEPS):
            low = dtype != "fp32"
            drift.append(dict(meta, step=step, eq_max_abs_diff=1e-6 * (step + 1),
                              drift_max_abs=(0.01 * (step + 1) * (m + 1) + 0.001 * c) if low else np.nan,
                              drift_mean_abs=(0.001 * (step + 1)) if low else np.nan,
                              drift_kl=(1e-5 * 10 ** step * (m + 1) * (c + 1)) if low else np.nan,
                              drift_top1_agreement=(1.0 - 0.1 * step * (m + 1) - 0.01 * c) if low else np.nan))
    runs, steps, drift = pd.DataFrame(runs), pd.DataFrame(steps), pd.DataFrame(drift)
    # the failed run: NaN almost everywhere, a sentinel wherever a number is left
    fail = runs["status"] == "failed"
    runs.loc[fail, "max_abs_logit_diff"] = SENTINEL
    runs.loc[fail, ["cache_nbytes", "predicted_nbytes", "bytes_per_token"]] = BYTES_SENTINEL
    runs.loc[fail, ["ttft_ms"]] = np.nan
    fail = steps["status"] == "failed"
    steps.loc[fail, ["ms_median", "speedup"]] = SENTINEL
    steps.loc[fail, ["ms_p10", "ms_p90"]] = np.nan
    fail = drift["status"] == "failed"
    drift.loc[fail, ["drift_kl", "drift_max_abs", "drift_top1_agreement"]] = SENTINEL
    drift = drift[~(fail & (drift["step"] > 2))]  # and some of its rows are missing
    return runs, steps, drift


def lines_by_label(ax):
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


def axes_by_title(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def all_line_values(fig):
    return np.concatenate([np.asarray(line.get_ydata(), float) for ax in fig.axes for line in ax.get_lines()])


def test_step_time_plot_draws_each_kinds_roofline_where_measured(tables):
    _, steps, _ = tables
    steps = steps.copy()
    steps["roofline_ms"] = np.where(steps["mode"] == "cached", 0.25 * steps["context_len"] / 256 + 0.1, np.nan)
    ok = steps[steps["status"] == "ok"]
    for title, ax in axes_by_title(step_time_plot(steps)).items():
        model, dtype = title.split(" · ")
        lines = lines_by_label(ax)
        for cache in CACHES:
            want = ok[(ok["model"] == model) & (ok["dtype"] == dtype) & (ok["cache"] == cache)
                      & (ok["mode"] == "cached")].groupby("context_len")["roofline_ms"].mean()
            np.testing.assert_allclose(lines[f"roofline ({cache})"].get_ydata(), want.to_numpy())
            assert lines[f"roofline ({cache})"].get_linestyle() == ":"


def test_step_time_lines_equal_medians(tables):
    _, steps, _ = tables
    ok = steps[steps["status"] == "ok"]
    fig = step_time_plot(steps)
    axes = axes_by_title(fig)
    assert set(axes) == {f"{m} · {d}" for m in MODELS for d in DTYPES}
    for (model, dtype), ax in ((k.split(" · "), v) for k, v in axes.items()):
        facet = ok[(ok["model"] == model) & (ok["dtype"] == dtype)]
        lines = lines_by_label(ax)
        assert set(lines) == {"cached (concat)", "cached (prealloc)", "uncached"}
        for cache in CACHES:
            want = facet[(facet["mode"] == "cached") & (facet["cache"] == cache)].sort_values("context_len")
            np.testing.assert_array_equal(lines[f"cached ({cache})"].get_xdata(), CONTEXTS)
            np.testing.assert_allclose(lines[f"cached ({cache})"].get_ydata(), want["ms_median"])
        # uncached: the mean of both runs' measurements at each context
        want = facet[facet["mode"] == "uncached"].groupby("context_len")["ms_median"].mean()
        np.testing.assert_array_equal(lines["uncached"].get_xdata(), CONTEXTS)
        np.testing.assert_allclose(lines["uncached"].get_ydata(), want.loc[CONTEXTS])
        assert "ms" in ax.get_ylabel() and "tokens" in ax.get_xlabel()
        assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
    assert not np.isclose(all_line_values(fig), SENTINEL).any()


def test_speedup_lines_equal_speedups(tables):
    _, steps, _ = tables
    ok = steps[(steps["status"] == "ok") & (steps["mode"] == "cached")]
    fig = speedup_plot(steps)
    axes = axes_by_title(fig)
    assert set(axes) == set(MODELS)
    for model, ax in axes.items():
        lines = lines_by_label(ax)
        assert set(lines) == {f"{c} · {d}" for c in CACHES for d in DTYPES}
        for cache, dtype in itertools.product(CACHES, DTYPES):
            want = ok[(ok["model"] == model) & (ok["cache"] == cache) & (ok["dtype"] == dtype)]
            line = lines[f"{cache} · {dtype}"]
            np.testing.assert_array_equal(line.get_xdata(), CONTEXTS)
            np.testing.assert_allclose(line.get_ydata(), want.sort_values("context_len")["speedup"])
        assert "×" in ax.get_ylabel() and "tokens" in ax.get_xlabel()
    assert not np.isclose(all_line_values(fig), SENTINEL).any()


def test_cache_bytes_bars_equal_bytes(tables):
    runs, _, _ = tables
    ok = runs[runs["status"] == "ok"]
    fig = cache_bytes_plot(runs)
    a, b = fig.axes[:2]
    # (a): containers in hue order (measured, predicted), bars in tick order; one tick per ok run
    ticks = [t.get_text() for t in a.get_xticklabels()]
    assert sorted(ticks) == sorted(ok["model"] + "/" + ok["cache"] + "/" + ok["dtype"])
    legend_a, legend_b = fig.legends  # below the panels, never on the bars
    assert a.get_legend() is None and b.get_legend() is None
    assert [t.get_text() for t in legend_a.get_texts()] == ["measured", "predicted"]
    by_label = ok.set_index(ok["model"] + "/" + ok["cache"] + "/" + ok["dtype"])
    for container, col in zip(a.containers, ["cache_nbytes", "predicted_nbytes"]):
        heights = [bar.get_height() for bar in container]
        np.testing.assert_allclose(heights, by_label.loc[ticks, col])
    assert a.get_yscale() == "log"  # tiny concat vs gpt2 prealloc spans decades
    assert "bytes" in a.get_ylabel() and "bytes" in b.get_ylabel()
    assert [t.get_text() for t in a.texts] == ["✗"]  # only run 3's measured bytes differ from the formula
    # (b): bytes per token per (model, dtype); caches of the same cost share a bar
    models = [t.get_text() for t in b.get_xticklabels()]
    assert models == MODELS
    series = [t.get_text() for t in legend_b.get_texts()]
    assert series == sorted(f"concat, prealloc · {d}" for d in DTYPES)
    for container, name in zip(b.containers, series):
        dtype = name.split(" · ")[1]
        want = [ok[(ok["model"] == m) & (ok["dtype"] == dtype)]["bytes_per_token"].iloc[0] for m in models]
        np.testing.assert_allclose([bar.get_height() for bar in container], want)
    heights = [p.get_height() for ax in (a, b) for p in ax.patches]
    assert not np.isclose(heights, BYTES_SENTINEL).any()


def test_cache_bytes_legends_sit_off_the_panels_and_bytes_read_in_units(tables):
    runs, _, _ = tables
    fig = cache_bytes_plot(runs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax.get_window_extent(renderer) for ax in fig.axes[:2]]
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(p) for p in panels)  # on neither panel's data
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)  # nor off the figure
    for ax in fig.axes[:2]:
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert labels and all(lab.endswith("B") and not lab.replace(",", "").isdigit() for lab in labels), labels
        assert ax.yaxis.get_major_formatter()(393216, 0) == "393 kB"


def test_bytes_read_in_decimal_units():
    from harness.analysis.plots import human_bytes

    assert human_bytes(393216) == "393 kB"
    assert human_bytes(512) == "512 B"
    assert human_bytes(75_497_472) == "75.5 MB"
    assert human_bytes(999_999) == "1 MB"  # not "1e+03 kB"
    assert human_bytes(2.5e9) == "2.5 GB"
    assert human_bytes(0) == "0 B"


DRIFT_PANELS = {"KL": "drift_kl", "max |Δlogit|": "drift_max_abs", "top-1": "drift_top1_agreement"}


def test_drift_lines_equal_drift_reduced_only(tables):
    _, _, drift = tables
    ok = drift[(drift["status"] == "ok") & (drift["dtype"] == "fp16")]
    fig = drift_plot(drift)
    assert len(fig.axes) == len(MODELS) * 3
    for ax in fig.axes:
        model = ax.get_title().split(":")[0]
        lines = lines_by_label(ax)
        assert set(lines) == {f"fp16 · {c}" for c in CACHES}  # no fp32 line
        col = next(c for prefix, c in DRIFT_PANELS.items() if ax.get_ylabel().startswith(prefix))
        for cache in CACHES:
            want = ok[(ok["model"] == model) & (ok["cache"] == cache)].sort_values("step")
            np.testing.assert_array_equal(lines[f"fp16 · {cache}"].get_xdata(), range(N_STEPS))
            np.testing.assert_allclose(lines[f"fp16 · {cache}"].get_ydata(), want[col])
        assert "step" in ax.get_xlabel()
    assert not np.isclose(all_line_values(fig), SENTINEL).any()


def test_drift_without_reduced_precision_says_so(tables):
    _, _, drift = tables
    fig = drift_plot(drift[drift["dtype"] == "fp32"])
    assert any("nothing drifts" in t.get_text() for t in fig.texts + fig.axes[0].texts)
    assert not fig.axes[0].get_lines()


def test_drift_not_measured_says_so_and_is_not_drawn_in_a_report():
    """Five windows measured without generation_drift: their drift.csv has the equivalence columns only. The figure
    names the measurement that was left out (not "nothing drifts": windows do drift), and the report leaves it out;
    exact fp32 runs alone still get their "nothing drifts"."""
    from harness.analysis.plots import drift_measured, drift_unmeasured

    rows = [dict(run_name=f"w{s}", status="ok", model="mini", cache="window", cache_label=f"window S{s}+W{64 - s}",
                 dtype="fp32", device="cpu", step=step, eq_max_abs_diff=1e-6, drift_kl=np.nan, drift_max_abs=np.nan,
                 drift_top1_agreement=np.nan, **kind_facts("window", dict(cache_window=64 - s, cache_sinks=s)))
            for s in (0, 1, 2, 4, 8) for step in range(3)]
    drift = pd.DataFrame(rows)
    assert drift_unmeasured(drift) == ["w0", "w1", "w2", "w4", "w8"]
    fig = drift_plot(drift)
    said = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "generation_drift" in said and "not measured" in said and "nothing drifts" not in said
    runs = pd.DataFrame([dict(r, max_abs_logit_diff=1e-6, tokens_identical=True) for r in rows[::3]])
    assert not drift_measured(drift) and "drift" not in figures_for(runs, {"drift": drift})
    exact = drift.assign(cache="prealloc", cache_label="prealloc",  # fp32 full attention: nothing would drift
                         **kind_facts("prealloc", {}))
    assert drift_measured(exact) and "drift" in figures_for(runs, {"drift": exact})
    # a window measured beside one that was not: drawn, the unmeasured one named in the title
    mixed = drift.copy()
    mixed.loc[mixed.run_name == "w4", ["drift_kl", "drift_max_abs", "drift_top1_agreement"]] = [0.1, 1.0, 0.9]
    assert drift_measured(mixed)
    title = drift_plot(mixed).get_suptitle()
    assert "not measured" in title and "w0" in title and "w4" not in title


def test_equivalence_grid_cells_equal_logit_diffs(tables):
    runs, _, _ = tables
    ok = runs[runs["status"] == "ok"]
    fig = equivalence_grid(runs)
    ax = fig.axes[0]
    rows = [t.get_text() for t in ax.get_yticklabels()]
    cols = [t.get_text() for t in ax.get_xticklabels()]
    assert rows == MODELS and sorted(cols) == sorted(f"{c}/{d}" for c in CACHES for d in DTYPES)
    cells = np.asarray(ax.collections[0].get_array()).reshape(len(rows), len(cols))
    marks = iter(t.get_text() for t in ax.texts)  # annotations in row-major order
    for (i, model), (j, col) in itertools.product(enumerate(rows), enumerate(cols)):
        cache, dtype = col.split("/")
        run = ok[(ok["model"] == model) & (ok["cache"] == cache) & (ok["dtype"] == dtype)].iloc[0]
        assert cells[i, j] == pytest.approx(run["max_abs_logit_diff"])
        value, mark = next(marks).split("\n")
        assert float(value) == pytest.approx(run["max_abs_logit_diff"], rel=0.05)
        assert mark == ("✓" if run["tokens_identical"] else "✗")
    assert not np.isclose(cells, SENTINEL).any()
    assert "max |Δlogit|" in fig.axes[1].get_ylabel()  # the colour bar


def _cell_colours(ax, shape):
    ax.figure.canvas.draw()  # colours are mapped when drawn
    mesh = ax.collections[0]
    return np.asarray(mesh.get_facecolors()).reshape(*shape, 4)


def test_equivalence_colours_are_fixed_on_the_tolerance_not_the_data():
    """1e-4 (equivalence_tol) sits at the middle of the colour scale whatever the cells hold; a cell at 1.9e-5 is
    calm green even when it is the grid's worst, a cell at 2e-4 alarm red; lossy and fp16 cells are grey."""

    def grid(values, **kw):
        rows = [dict(run_name=f"r{i}", status="ok", model="mini", cache=c, cache_label=c, dtype="fp32",
                     cache_exact=True, storage_dtype="float32", compute_dtype="float32", equivalence_tol=1e-4,
                     tokens_identical=True, max_abs_logit_diff=v) for i, (c, v) in enumerate(values.items())]
        rows = [dict(r, **kw.get(r["cache"], {})) for r in rows]
        fig = equivalence_grid(pd.DataFrame(rows))
        return fig, fig.axes[0]

    fig, ax = grid({"concat": 3e-6, "prealloc": 1.9e-5})  # both far inside: before, 1.9e-5 was the darkest cell
    norm = ax.collections[0].norm
    assert norm(1e-4) == pytest.approx(0.5)
    concat, prealloc = _cell_colours(ax, (1, 2))[0, :, :3].tolist()
    assert prealloc[1] > prealloc[0] and concat[1] > concat[0]  # green over red: calm
    fig, ax = grid({"concat": 1.9e-5, "prealloc": 2e-4, "quant": 0.8},
                   quant=dict(cache_exact=False), prealloc=dict())
    assert ax.collections[0].norm(1e-4) == pytest.approx(0.5)  # the same scale, other data
    calm, alarm, _ = _cell_colours(ax, (1, 3))[0, :, :3].tolist()
    assert calm[1] > calm[0] and alarm[0] > 1.5 * alarm[1]  # 2e-4 is over the tolerance: red
    grey = [p for p in ax.patches if p.get_x() == 2]  # the lossy quant cell is covered grey, not red
    assert len(grey) == 1 and np.allclose(grey[0].get_facecolor()[:3], [0.87] * 3)
    cbar = fig.axes[1]
    assert any("tolerance" in t.get_text() and "1e-04" in t.get_text() for t in cbar.get_yticklabels())
    assert "1e-04" in ax.get_title()


def test_all_figures_keys_and_skips(tables):
    runs, steps, drift = tables
    figs = all_figures(runs, steps, drift)
    assert set(figs) == {"step_time", "speedup", "cost_model", "cache_bytes", "drift", "equivalence"}
    # a table with only failed rows skips its figures
    figs = all_figures(runs, steps[steps["status"] != "ok"], drift[drift["status"] != "ok"])
    assert set(figs) == {"cache_bytes", "equivalence"}


def test_memory_lines_follow_the_formula_and_dots_the_measurements():
    rows = []
    for run, (label, per_token, fixed) in enumerate([("concat", 10, 0), ("prealloc", 0, 1280),
                                                    ("window S4+W32", 0, 360), ("quant k4/v4 g32", 0, 300)]):
        for n in range(0, 129, 16):
            measured = per_token * n + fixed if 32 <= n <= 64 else np.nan
            rows.append(dict(run_name=f"r{run}", status="ok", model="tiny", cache=label.split()[0], cache_label=label,
                             dtype="fp32", device="cpu", tokens=n, nbytes_formula=per_token * n + fixed,
                             nbytes_measured=measured))
    rows.append(dict(rows[0], run_name="bad", status="failed", cache_label="concat", nbytes_formula=SENTINEL))
    memory = pd.DataFrame(rows)
    fig = memory_plot(memory)
    ax = fig.axes[0]
    lines = lines_by_label(ax)
    assert list(lines) == ["concat", "prealloc", "quant k4/v4 g32", "window S4+W32"]  # the registry's order
    ok = memory[memory.status == "ok"]
    for label, line in lines.items():
        want = ok[ok.cache_label == label].sort_values("tokens")
        np.testing.assert_array_equal(line.get_xdata(), want.tokens)
        np.testing.assert_allclose(line.get_ydata(), want.nbytes_formula)
    dots = np.concatenate([c.get_offsets() for c in ax.collections])
    want = ok.dropna(subset=["nbytes_measured"])
    assert sorted(map(tuple, dots.tolist())) == sorted(zip(want.tokens.astype(float), want.nbytes_measured))
    assert not np.isclose(all_line_values(fig), SENTINEL).any()
    assert ax.yaxis.get_major_formatter()(393216, 0) == "393 kB" and ax.get_ylim()[0] == 0  # bytes from nothing


def test_cost_lines_are_each_runs_fit(tables):
    from harness.common.stats import cost_model
    from harness.analysis.plots import cost_plot

    _, steps, _ = tables
    ok = steps[(steps["status"] == "ok") & (steps["mode"] == "cached")]
    fig = cost_plot(steps)
    for model, ax in axes_by_title(fig).items():
        lines = {ln.get_label().split(":")[0]: ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
        assert set(lines) == {f"{c} · {d}" for c in CACHES for d in DTYPES}
        for cache, dtype in itertools.product(CACHES, DTYPES):
            run = ok[(ok["model"] == model) & (ok["cache"] == cache) & (ok["dtype"] == dtype)]
            fit = cost_model(run)
            line = lines[f"{cache} · {dtype}"]
            T = np.asarray(line.get_xdata())
            want = fit["cost_a_ms"] + fit["cost_b_ms_per_token"] * T
            np.testing.assert_allclose(line.get_ydata(), want)


def test_serving_lines_are_the_runs_throughput_and_waste_per_cache_and_prompt_shape():
    rows = []
    for cache, waste in (("prealloc", 0.9), ("paged(block_size=16)", 0.05)):
        for shape in ("uniform", "ragged"):
            for b in (1, 4, 16):
                rows.append(dict(run_name=f"{cache}-{shape}-{b}", status="ok", model="gpt2",
                                 cache=cache.split("(")[0], cache_label=cache, dtype="fp32", device="cpu",
                                 serve_batch=b, prompt_lengths=shape,
                                 tokens_per_s=100.0 * b + (7 if shape == "ragged" else 0),
                                 kv_waste=waste + (0.01 if shape == "ragged" else 0)))
    rows.append(dict(rows[0], run_name="bad", status="failed", tokens_per_s=SENTINEL, kv_waste=SENTINEL))
    runs = pd.DataFrame(rows)
    fig = serving_plot(runs)
    titles = axes_by_title(fig)
    top, bottom = titles["gpt2: generation throughput"], titles["gpt2: KV waste after the generation"]
    lines = lines_by_label(top)
    assert set(lines) == {f"{c} · {s} prompts" for c in ("prealloc", "paged(block_size=16)")
                          for s in ("uniform", "ragged")}
    ok = runs[runs.status == "ok"]
    for label, line in lines.items():
        cache, shape = label.split(" · ")[0], label.split(" · ")[1].split()[0]
        want = ok[(ok.cache_label == cache) & (ok.prompt_lengths == shape)].sort_values("serve_batch")
        assert list(line.get_xdata()) == want.serve_batch.tolist()
        assert np.allclose(line.get_ydata(), want.tokens_per_s)
        waste = lines_by_label(bottom)[label]
        assert np.allclose(waste.get_ydata(), 100 * want.kv_waste)
    assert "serving" in figure_makers(runs, runs.iloc[0:0], runs.iloc[0:0])
    assert "serving" not in figure_makers(runs.drop(columns=["tokens_per_s"]), runs.iloc[0:0], runs.iloc[0:0])


def test_a_figure_of_a_measurement_the_sweep_left_out_is_not_drawn():
    """A sweep with measurements=[equivalence,text_drift] has no cache bytes: no cache_bytes figure (and no error)."""

    base = dict(status="ok", run_name="r", model="tiny", cache="prealloc", cache_label="prealloc", dtype="fp32",
                engine="kvlab", tokens_identical=True, max_abs_logit_diff=1e-6, cache_exact=True)
    runs = pd.DataFrame([base])
    assert "cache_bytes" not in figures_for(runs, {})
    measured = pd.DataFrame([dict(base, cache_nbytes=1024, predicted_nbytes=1024, bytes_per_token=64.0)])
    assert "cache_bytes" in figures_for(measured, {})


def test_quality_against_budget_draws_budgeted_kinds_one_line_per_setting():
    """Only kinds given a budget are drawn (a prealloc swept over max_len is not); an option swept at one budget
    (H2O's recent) splits its kind into lines, an option the budget sets (a window's window) does not."""
    from harness.analysis.plots import budget_plot, budget_quality

    def run(cache, budget, **kw):
        return dict(status="ok", model="mini", cache=cache, dtype="fp32", cache_budget=budget,
                    drift_delta_nll=1 / (1 + budget), retrieval_acc=0.1, retrieval_acc_ref=0.2, **kw)

    runs = pd.DataFrame([run("h2o", 64, cache_recent=0), run("h2o", 64, cache_recent=8),
                         run("h2o", 128, cache_recent=0), run("h2o", 128, cache_recent=8),
                         run("window", 64, cache_window=60, cache_sinks=4),
                         run("window", 128, cache_window=124, cache_sinks=4), run("tova", 64),
                         dict(run("prealloc", 0), cache_tokens=1024), dict(run("prealloc", 0), cache_tokens=512)])
    got = budget_quality(runs)
    assert sorted(got["series"].unique()) == ["h2o · fp32 · recent=0", "h2o · fp32 · recent=8", "window · fp32"]
    assert set(got["slots"]) == {64, 128}  # tova at one budget alone is no line
    fig = budget_plot(runs)
    assert {line.get_label() for ax in fig.axes for line in ax.get_lines()} >= set(got["series"])
    plt.close(fig)


def test_the_pareto_frontier_is_the_settings_nothing_beats_on_both():
    from harness.analysis.plots import pareto_front, pareto_plot, pareto_points

    x = pd.Series([1.0, 2.0, 3.0, 4.0, 2.5])
    low = pd.Series([5.0, 3.0, 3.5, 1.0, 2.0])  # the third is beaten by the second (cheaper and better)
    assert list(pareto_front(x, low, "low")) == [0, 1, 4, 3]
    high = pd.Series([0.1, 0.5, 0.4, 0.9, 0.5])  # the fifth ties the second's quality at a higher cost
    assert list(pareto_front(x, high, "high")) == [0, 1, 3]

    def run(cache, dtype, nbytes, **kw):
        return dict(status="ok", run_name=f"{cache}-{dtype}", model="mini", cache=cache, cache_label=cache,
                    dtype=dtype, cache_exact=True, storage_dtype={"fp32": "float32"}.get(dtype, "float16"),
                    compute_dtype="float32", cache_nbytes=nbytes, **kw)

    own = "an exact kind in fp32 storage and compute is its own fp32 reference: nothing to drift from"  # text_drift's
    runs = pd.DataFrame([run("prealloc", "fp32", 100, text_drift_skipped=own),
                         run("prealloc", "fp16", 50, drift_delta_nll=0.01),
                         run("window", "fp32", 10, drift_delta_nll=0.5), run("h2o", "fp32", 20, cache_budget=8.0),
                         dict(run("paged", "fp32", 90, cache_block_size=16.0, text_drift_skipped=own),
                              cache_label="paged(block_size=16)")])
    pts = pareto_points(runs).set_index("point")
    assert pts.loc["prealloc · fp32", "drift_delta_nll"] == 0.0  # the fp32 reference itself, as text_drift said
    assert pts.loc["window · fp32", "drift_delta_nll"] == 0.5  # a window drifts, measured
    assert "h2o · fp32" not in pts.index  # it evicts: no drift measured is no point, never a zero
    assert pts.loc["paged(block_size=16) · fp32", "drift_delta_nll"] == 0.0
    unasked = runs.assign(text_drift_skipped=None)  # drift never measured: no point at 0 (findings-unmeasured-drift)
    assert "prealloc · fp32" not in pareto_points(unasked).set_index("point").index
    assert pareto_points(runs.iloc[:1]).empty  # one setting: nothing to compare
    fig = pareto_plot(runs)
    frontier = [line for ax in fig.axes for line in ax.get_lines() if line.get_label().startswith("frontier")]
    assert frontier and list(frontier[0].get_xdata()) == [10, 50, 90]  # paged beats prealloc: fewer bytes, same 0
    plt.close(fig)


def _errorbars(ax):
    """(x, lo, hi) of every vertical error bar drawn on ``ax``."""
    from matplotlib.container import ErrorbarContainer

    out = []
    for c in ax.containers:
        if isinstance(c, ErrorbarContainer):
            for seg in c.lines[2][0].get_segments():
                out.append((seg[0][0], min(seg[0][1], seg[1][1]), max(seg[0][1], seg[1][1])))
    return sorted(out)


SINKS = [0, 1, 2, 4, 8]


def windows_of_one_budget(intervals=True):
    """Five windows of 64 slots (sinks 0 .. 8, window the rest): the same bytes held, quality that differs."""
    rows = []
    for s in SINKS:
        nll, acc = 1.0 / (1 + s), 0.5 + 0.05 * s
        row = dict(status="ok", run_name=f"w{s}", model="mini", cache="window", cache_label=f"window S{s}+W{64 - s}",
                   dtype="fp32", cache_exact=True, storage_dtype="float32", compute_dtype="float32",
                   cache_budget=64, cache_sinks=s, cache_window=64 - s, cache_nbytes=393216,
                   drift_delta_nll=nll, retrieval_acc=acc, retrieval_acc_ref=0.97,
                   **kind_facts("window", dict(cache_budget=64, cache_sinks=s, cache_window=64 - s)))
        if intervals:
            row.update(drift_delta_nll_lo=nll - 0.1, drift_delta_nll_hi=nll + 0.2,
                       retrieval_acc_lo=acc - 0.05, retrieval_acc_hi=min(acc + 0.04, 1.0))
        rows.append(row)
    return pd.DataFrame(rows)


def test_a_pareto_whose_settings_hold_the_same_bytes_is_drawn_against_the_swept_option():
    """Five windows of one budget hold 393 kB each: on a bytes axis they are one vertical line of overlapping labels.
    The figure draws quality against cache.sinks instead (the window, budget - sinks, follows it and is not the
    setting), says why in the panel's title, and carries each point's interval."""
    from harness.analysis.plots import pareto_plot, swept_setting, pareto_points

    runs = windows_of_one_budget()
    assert swept_setting(pareto_points(runs)) == ("cache_sinks", "cache.sinks")
    fig = pareto_plot(runs)
    for ax in fig.axes:
        assert ax.get_xlabel() == "cache.sinks"
        assert "393 kB" in ax.get_title() and "cache.sinks" in ax.get_title()
        assert [float(t) for t in ax.get_xticks()] == SINKS
        dots = ax.collections[0].get_offsets()
        quality = "drift_delta_nll" if "ΔNLL" in ax.get_ylabel() else "retrieval_acc"
        assert sorted(map(tuple, np.asarray(dots).tolist())) == sorted(zip(map(float, SINKS), runs[quality]))
        want = sorted(zip(map(float, SINKS), runs[f"{quality}_lo"], runs[f"{quality}_hi"]))
        np.testing.assert_allclose(_errorbars(ax), want)
        assert not [t for t in ax.texts if t.get_text()]  # the ticks name the points: no labels on one line
    assert "95% intervals over texts / sequences" in fig.get_suptitle() and "frontier" not in fig.get_suptitle()
    # without the intervals (a sweep from before them): the same points, no bars
    fig = pareto_plot(windows_of_one_budget(intervals=False))
    assert all(not _errorbars(ax) for ax in fig.axes) and "95%" not in fig.get_suptitle()


def test_pareto_labels_do_not_cover_one_another_and_bytes_read_in_units():
    """Five settings close together on both axes (a sixth far off squeezes them): each label moves until it covers
    none of the others."""
    from harness.analysis.plots import pareto_plot

    rows = [dict(status="ok", run_name=f"q{b}", model="mini", cache="quant", cache_label=f"quant k{b}/v{b} g32",
                 dtype="fp32", cache_exact=False, storage_dtype="float32", compute_dtype="float32",
                 cache_k_bits=b, cache_v_bits=b, cache_nbytes=100_000 + 100 * b if b < 8 else 400_000,
                 drift_delta_nll=0.01 + 0.0001 * b if b < 8 else 0.5)
            for b in (2, 3, 4, 5, 6, 8)]
    fig = pareto_plot(pd.DataFrame(rows))
    ax = fig.axes[0]
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.texts if t.get_text()]
    assert len(boxes) == 6
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    assert ax.get_xlabel().startswith("KV bytes")
    assert ax.xaxis.get_major_formatter()(105_000, 0) == "105 kB"
    assert all(fig.bbox.contains(b.x0, b.y0) and fig.bbox.contains(b.x1, b.y1) for b in boxes)  # none off it


def test_retrieval_and_budget_draw_each_runs_interval_where_the_table_has_one():
    from harness.analysis.plots import budget_plot, retrieval_plot

    runs = windows_of_one_budget()
    ax = retrieval_plot(runs).axes[0]
    got = _errorbars(ax)  # bars in tick order: the window labels, sorted
    order = runs.sort_values("cache_label")
    np.testing.assert_allclose(got, list(zip(range(5), order["retrieval_acc_lo"], order["retrieval_acc_hi"])))
    assert not _errorbars(retrieval_plot(windows_of_one_budget(intervals=False)).axes[0])
    assert "95%" in retrieval_plot(runs).get_suptitle()
    # two budgets of one setting: a line with a bar at each point
    two = pd.concat([runs.iloc[[2]], runs.iloc[[2]].assign(run_name="w2b", cache_budget=128, cache_window=126,
                                                            drift_delta_nll=0.1, drift_delta_nll_lo=0.05,
                                                            drift_delta_nll_hi=0.2)])
    fig = budget_plot(two)
    nll = next(ax for ax in fig.axes if "ΔNLL" in ax.get_ylabel())
    np.testing.assert_allclose(_errorbars(nll), [(64, 1 / 3 - 0.1, 1 / 3 + 0.2), (128, 0.05, 0.2)])
    assert "95% intervals" in fig.get_suptitle()

"""Analysis: a real tiny sweep (plus one failed run) loads into tidy DataFrames, and its report holds the tables,
the plots (drawn from the ok runs only) and a self-contained report.html."""

import re
import shutil
import subprocess
import sys
import warnings

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from harness.analysis import plots
from harness.analysis.report import build_report
from harness.analysis.results import IncompleteRunWarning, load_drift, load_layers, load_memory, load_runs, load_steps
from tests.helpers import REPO, TINY, run_py

pytestmark = pytest.mark.slow  # every test here reads the session's real sweep


@pytest.fixture(scope="module")
def tree(tiny_sweep, tmp_path_factory):
    """A copy of the sweep with a failed run beside the four good ones, and a job folder that never finished."""
    sweep, proc, _ = tiny_sweep
    assert proc.returncode == 0, proc.stderr[-2000:]
    root = tmp_path_factory.mktemp("tree") / "sweep"
    shutil.copytree(sweep, root, ignore=shutil.ignore_patterns("report", "wandb"))
    failed = run_py(["max_len=1000", "tracking=disabled", *TINY, f"hydra.run.dir={root / '9_failed'}"], root.parent)
    assert failed.returncode == 1
    (root / "7_killed" / ".hydra").mkdir(parents=True)  # a job that died before writing results.json
    return root


def test_load_runs_one_row_per_run(tree):
    with pytest.warns(IncompleteRunWarning, match="7_killed"):
        runs = load_runs(tree)
    assert len(runs) == 5 and list(runs.columns[:8]) == ["run_name", "group", "status", "model", "cache",
                                                          "cache_label", "dtype", "device"]
    ok = runs[runs.status == "ok"]
    assert len(ok) == 4 and set(zip(ok.cache, ok.dtype)) == {("concat", "fp32"), ("concat", "fp16"),
                                                              ("prealloc", "fp32"), ("prealloc", "fp16")}
    assert ok.nbytes_match.all() and (ok.cache_nbytes == ok.predicted_nbytes).all()
    fp32 = ok[ok.dtype == "fp32"]
    assert fp32.tokens_identical.all() and (fp32.max_abs_logit_diff <= 1e-4).all() and fp32.drift_kl.isna().all()
    assert (ok[ok.dtype == "fp16"].drift_kl > 0).all()
    bad = runs[runs.status == "failed"].iloc[0]
    assert "max_len=1000" in bad.error and bad.model == "tiny"
    # pandas slicing works as users do it
    per_token = ok.groupby("dtype").bytes_per_token.first()
    assert per_token["fp32"] == 2 * per_token["fp16"]


def test_layers_hold_every_layer_of_the_drifting_runs_only(tree):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        layers, runs = load_layers(tree), load_runs(tree)
    assert set(layers.run_name) == set(runs.run_name[(runs.status == "ok") & (runs.dtype == "fp16")])
    for _, g in layers.groupby("run_name"):
        assert list(g.layer) == list(range(2)) and (g.k_rel_err > 0).all() and g.v_rel_err.iloc[0] <= 2 ** -11


def test_load_steps_and_drift_have_every_context_and_step(tree):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        steps, drift, runs = load_steps(tree), load_drift(tree), load_runs(tree)
    assert set(steps.run_name) == set(runs.run_name[runs.status == "ok"])  # the failed run has no rows
    for _, g in steps.groupby("run_name"):
        assert set(zip(g.context_len, g["mode"])) == {(c, m) for c in (8, 32) for m in ("cached", "uncached")}
    assert {"model", "cache", "dtype", "device", "status"} <= set(steps.columns)
    assert len(drift) == 4 * 8 and set(drift.step) == set(range(8))
    assert drift[drift.dtype == "fp32"].drift_kl.isna().all() and drift[drift.dtype == "fp16"].drift_kl.notna().all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        memory = load_memory(tree)
    assert memory.groupby("run_name").nbytes_measured.count().eq(8).all()  # after the prefill and 7 steps
    assert (memory.dropna().nbytes_measured == memory.dropna().nbytes_formula).all()


def test_report_tables_plots_and_html(tree, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IncompleteRunWarning)
        rep = build_report(tree, tmp_path / "report")
    out = rep["folder"]
    table = pd.read_parquet(out / "results.parquet")
    assert len(table) == 5 and (table.status == "failed").sum() == 1  # kept in the table...
    assert len(pd.read_csv(out / "results.csv")) == 5
    assert set(pd.read_parquet(out / "steps.parquet").context_len) == {8, 32}
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["cache_bytes.png", "cost_model.png", "drift.png", "equivalence.png", "layers.png", "memory.png",
                    "pareto.png", "retrieval.png", "retrieval_depth.png", "serving.png", "speedup.png",
                    "step_time.png"]  # several settings
    page = (out / "report.html").read_text()
    for name in pngs:
        assert name in page
    assert page.count('src="data:image/png;base64,') == len(pngs)
    # self-contained: nothing fetched from anywhere
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page) and "<script" not in page
    assert "Failed runs" in page and "max_len=1000" in page and "random init" in page
    # the findings open the page, and name only ok runs of this sweep
    found = (out / "findings.md").read_text()
    assert found.startswith("# Findings") and "- dtype:" in found and "- cache:" in found
    assert page.index("<h2>Findings</h2>") < page.index("<h2>Runs</h2>")
    named = set(re.findall(r"\(runs: ([^)]*)\)", found)[0].split(", "))
    assert named and named <= set(table.run_name[table.status == "ok"])
    # ...and left out of the plots: one measured and one predicted bar per ok run
    fig = plots.cache_bytes_plot(rep["runs"])
    heights = [p.get_height() for p in fig.axes[0].patches if p.get_height() > 0]
    ok = rep["runs"][rep["runs"].status == "ok"]
    assert sorted(heights) == sorted(list(ok.cache_nbytes) + list(ok.predicted_nbytes))
    plt.close("all")


def test_sweep_end_wrote_the_report_and_an_aggregate_wandb_run(tiny_sweep):
    sweep, proc, trip = tiny_sweep
    assert (sweep / "report" / "report.html").is_file() and (sweep / "report" / "results.parquet").is_file()
    runs = list((sweep / "report" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert "kvlab report: 4 runs (0 not ok)" in proc.stdout
    assert trip.hits == 0
    from tests.helpers.wandb_runs import of_type, wandb_records

    recs = wandb_records(sweep / "report")
    logged = {k.split(".")[0] for h in of_type(recs, "history") for k in h["item"]}  # media keys come as key.field
    assert {"runs", "steps_table", "drift_table", "lines/step_time_table", "report", "plots/step_time"} <= logged
    arts = [a for a in of_type(recs, "artifact") if a.get("type") == "kvlab-report"]
    assert len(arts) == 1 and "report.html" in {c["path"] for c in arts[0]["manifest"]["contents"]}
    (run,) = of_type(recs, "run")
    assert run["run_group"].startswith("quick-") and run["job_type"] == "aggregate"


def test_the_sweep_leaves_a_wandb_report_spec_whose_metrics_its_runs_log(tiny_sweep):
    """Offline, the W&B Report's spec is written beside report.html; every metric a panel plots is a key the
    sweep's runs really logged (history or summary), decoded from their .wandb files."""
    from harness.analysis.wandb_report import spec_from_file
    from tests.helpers.wandb_runs import of_type, wandb_records

    sweep, proc, _ = tiny_sweep
    spec = spec_from_file(sweep / "report" / "wandb_report.json")
    assert "python -m harness.wandb_report --from-spec" in proc.stdout
    logged: set[str] = set()
    groups = set()
    for job in [p.parent.parent for p in sweep.glob("*/wandb/offline-run-*")]:
        recs = wandb_records(job)
        logged |= {k for h in of_type(recs, "history") for k in h["item"]}
        logged |= {k for s in of_type(recs, "summary") for k in s.get("update", {})}
        groups |= {r["run_group"] for r in of_type(recs, "run")}
    assert groups == {spec["group"]}
    plotted = {y for p in spec["panels"] for y in p.get("y") or []} | {p["x"] for p in spec["panels"] if p.get("x")}
    assert plotted and plotted <= logged, sorted(plotted - logged)
    assert all(spec["group"] in p["filters"] for p in spec["panels"])


def test_report_command_line(tree, tmp_path):
    out = tmp_path / "by-hand"
    proc = subprocess.run([sys.executable, "-m", "harness.report", str(tree), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "report.html").is_file() and "5 runs (1 not ok)" in proc.stdout
    missing = subprocess.run([sys.executable, "-m", "harness.report", str(tmp_path / "nope")], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such folder" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_several_sweep_folders_make_one_report(tiny_sweep, tmp_path):
    """Sweeps from several machines (here: the session's sweep split in two folders, one run in both) make one
    report, each run once; without --out the command says what it needs."""
    sweep, proc, _ = tiny_sweep
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = sorted(p.parent for p in sweep.glob("*/results.json"))
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    for dest, part in ((a, runs[:3]), (b, runs[2:])):
        for folder in part:
            shutil.copytree(folder, dest / folder.name, ignore=shutil.ignore_patterns("wandb"))
    out = tmp_path / "all"
    done = subprocess.run([sys.executable, "-m", "harness.report", str(a), str(b), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    table = pd.read_csv(out / "results.csv")
    assert sorted(table.run_name) == sorted(f.name for f in runs)  # four runs, the shared one once
    assert "node-a + node-b" in (out / "report.html").read_text()
    refused = subprocess.run([sys.executable, "-m", "harness.report", str(a), str(b)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "needs --out" in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert not (a / "report").exists() and not (b / "report").exists()


# ---- retrieval by depth: the heatmap, from runs written here (fast: no sweep) --------------------------------------

def _retrieval_sweep(root, tiny_model, settings) -> None:
    """A folder of runs that made the retrieval measurement alone on the tiny model, one per (name, kind, options,
    retrieval_depth_buckets), written as a run writes its files."""
    import torch

    from harness import measurements
    from harness.core.engines import KvlabEngine
    from harness.core.measure import CacheSpec
    from harness.experiment import tracking

    engine = KvlabEngine(tiny_model)
    for name, kind, opts, buckets in settings:
        rec, tables = measurements.run_on(engine, CacheSpec(kind, opts, torch.float32), [torch.tensor([[464, 3290]])],
                                          2, names=["retrieval"], max_len=128, retrieval_n=20, retrieval_k=1,
                                          retrieval_depth_buckets=buckets)
        label = " ".join([kind, *(f"{k}={v}" for k, v in opts.items())])
        rec.update(run_name=name, group="depth", status="ok", model="tiny", cache=kind, cache_label=label,
                   dtype="fp32", device="cpu", engine="kvlab", serve_batch=1, prompt_lengths="uniform",
                   measurements="retrieval", config_id=name, weights="random")
        tracking.write_run_files(root / name, rec, tracking.with_identity(tables, rec))


def test_the_depth_heatmap_is_written_when_retrieval_ran_by_depth(tmp_path, tiny_model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", IncompleteRunWarning)  # every table these runs made is read
        _retrieval_sweep(tmp_path / "sweep", tiny_model, [("full", "prealloc", {}, 5),
                                                          ("window", "window", {"window": 8}, 5)])
        rep = build_report(tmp_path / "sweep", tmp_path / "report")
        _retrieval_sweep(tmp_path / "flat", tiny_model, [("full", "prealloc", {}, 0)])
        flat = build_report(tmp_path / "flat", tmp_path / "flat-report")
    out, page = rep["folder"], rep["html"].read_text()
    assert (out / "retrieval_depth.png").stat().st_size > 0 and 'alt="retrieval_depth"' in page
    assert "Retrieval by depth" in page
    depth = pd.read_csv(out / "retrieval_depth.csv")
    assert set(depth.run_name) == {"full", "window"} and depth.depth_bucket.nunique() == 5
    assert (flat["folder"] / "retrieval.png").is_file()  # retrieval ran, its depth view did not: no heatmap
    assert not (flat["folder"] / "retrieval_depth.png").exists()
    assert 'alt="retrieval_depth"' not in flat["html"].read_text()
    plt.close("all")

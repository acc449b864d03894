"""The W&B Report of a sweep (harness.analysis.wandb_report): its spec names exactly what runs log, every chart is grouped and
filtered to the sweep's group and job type "run", the wr.Report builds with no network, and the CLI answers in one
line (spec offline; no key: exit 2, quickly). Nothing here reaches a W&B server."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import types

import pytest
import torch

from harness.core import measure
from harness.analysis import report
from harness.experiment import tracking
from harness.analysis import wandb_report as wrep
from harness.measurements import step_time
from harness.experiment.config import KvlabConfig, cache_schema
from models.kv_cache import CACHE_KINDS
from tests.helpers import REPO, Tripwire

GROUP = "quick-2026-11-30_23-51-40"
N_STEPS = 3
BACKEND_KEY = {"config.cache.kind": "cache.value.kind", "config.dtype.name": "dtype.value.name",  # nested config
               "config.effective.cache_label": "effective.value.cache_label",
               "config.batch": "batch.value", "config.prompt_lengths": "prompt_lengths.value"}  # top-level keys


def _drift_table():
    """drift.csv as measure makes it: the equivalence columns joined with the drift columns, per decode step."""
    ones, zeros = torch.ones(N_STEPS), torch.zeros(N_STEPS)
    checks = [dict(eq=dict(max_abs=zeros, top1_agree=ones, ref_margin=ones), loop=None, first_wrong=None,
                   drift=dict(stats=dict(max_abs=ones, mean_abs=ones, kl=ones, top1_agree=ones, ref_margin=ones),
                              first_divergence=None, match_rate=1.0))]
    _, eq = measure.equivalence_summary(checks, N_STEPS)
    _, drift = measure.drift_summary_of(checks, N_STEPS)
    return eq.join(drift)


def _steps_table():
    import pandas as pd

    return pd.DataFrame([dict(context_len=ctx, mode=mode, **measure._spread([1e-3, 2e-3]), speedup=2.0)
                         for ctx in (8, 32) for mode in ("cached", "uncached")])


class _FakeRun:
    """What WandbRun.finish calls on a wandb run, recorded."""

    def __init__(self):
        self.id, self.logged, self.metrics, self.summary = "abc", [], {}, {}
        self.config = types.SimpleNamespace(update=lambda *a, **k: None)

    def define_metric(self, name, step_metric=None, **kw):
        self.metrics[name] = step_metric

    def log(self, row):
        self.logged.append(row)

    def log_artifact(self, art):
        pass

    def finish(self, exit_code=0):
        pass


def _logged_history() -> tuple[dict, _FakeRun]:
    """Run tracking.WandbRun.finish on measure's tables with a recording fake: history key -> the step metric that
    was logged in the same row."""
    fake_wandb = types.SimpleNamespace(Table=lambda dataframe: None, Artifact=lambda *a, **k: types.SimpleNamespace(
        add_file=lambda *a, **k: None, add_dir=lambda *a, **k: None))
    wb = tracking.WandbRun.__new__(tracking.WandbRun)
    wb.run, wb.wandb, wb.id = _FakeRun(), fake_wandb, "abc"
    wb.finish({"run_name": "r", "context_lengths": "8,32"}, {"drift": _drift_table(), "steps": _steps_table()}, [], 0)
    keys = {}
    for row in wb.run.logged:
        step = [m for m in wrep.STEP_METRICS if m in row]
        for k in row:
            if k.startswith(("step/", "step_ms/")):
                keys[k] = step[0] if len(step) == 1 else None
    return keys, wb.run


def test_history_keys_are_exactly_what_a_run_logs():
    logged, run = _logged_history()
    assert logged == wrep.HISTORY_KEYS
    assert run.metrics == {"decode_step": None, "step/*": "decode_step", "context_len": None,
                           "step_ms/*": "context_len"}
    # the same names, from their sources: the step_time measurement's STEP_MS mapping and measure's drift.csv columns
    assert {k for k in wrep.HISTORY_KEYS if k.startswith("step_ms/")} == {
        f"step_ms/{m}{sfx}" for m in ("cached", "uncached") for sfx in step_time.STEP_MS.values()} | {"step_ms/speedup"}
    assert {k for k in wrep.HISTORY_KEYS if k.startswith("step/")} == {
        f"step/{c}" for c in _drift_table().columns if c != "step"}


def test_summary_and_config_keys_are_what_runs_record():
    assert set(wrep.SUMMARY_KEYS) <= set(report.summary_cols())  # results.json keys the static report shows
    cfg = dataclasses.asdict(KvlabConfig(cache=cache_schema(CACHE_KINDS["prealloc"])()))
    cfg["effective"] = tracking.effective({})
    for key in wrep.CONFIG_KEYS:
        node = cfg
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"config key {key} is not in a run's config"
            node = node[part]
    assert {g.removeprefix("config.") for g in wrep.GROUP_BY.values()} <= set(wrep.CONFIG_KEYS)


def test_every_panel_names_logged_metrics_and_is_grouped_and_filtered():
    from wandb_workspaces import expr

    spec = wrep.build_spec(GROUP)
    assert json.loads(json.dumps(spec)) == spec  # plain JSON
    assert (spec["entity"], spec["project"], spec["group"], spec["job_type"]) == (None, "kvlab", GROUP, "run")
    kinds = {p["kind"] for p in spec["panels"]}
    assert kinds == {"line", "bar", "table"}
    ok_only = wrep.runs_filter(GROUP, ok=True)
    for p in spec["panels"]:
        if p["kind"] != "table":  # a chart draws ok runs only: a failed or not_equivalent run is never a good one
            assert p["filters"] == ok_only
        if p["kind"] == "line":
            assert p["y"] and all(wrep.HISTORY_KEYS[y] == p["x"] == p["step_metric"] for y in p["y"])
        else:
            assert p["y"] and set(p["y"]) <= set(wrep.SUMMARY_KEYS) and p["step_metric"] is None
        if p["kind"] != "table":  # the runs table lists runs one by one
            assert p["groupby"] and set(p["groupby"]) <= set(wrep.GROUP_BY.values())
    titles = " | ".join(p["title"] for p in spec["panels"])
    for want in ("Decode-step time", "Speedup", "Bytes per token", "Drift vs decode step", "Drift on text", "Runs"):
        assert want in titles
    by_title = {p["title"]: p for p in spec["panels"]}
    assert by_title["Speedup vs context length"]["y"] == ["step_ms/speedup"]
    assert {tuple(p["groupby"]) for p in spec["panels"] if p["x"] == "decode_step"} == {
        ("config.dtype.name",), ("config.cache.kind",)}
    # the filter is wandb-workspaces' expression for: group == GROUP and job type == "run"
    def leaves(f):
        v2 = expr.filters_tree_to_v2(expr.expr_to_filters(f))
        assert all(x.get("connector", "AND") == "AND" for x in v2["filters"])
        return {(x["key"]["section"], x["key"]["name"], x["op"], x["value"]) for x in v2["filters"]}

    group = {("run", "group", "=", GROUP), ("run", "jobType", "=", "run")}
    assert leaves(spec["filters"]) == group == leaves(by_title["Runs"]["filters"])  # every run, in the runs table
    assert leaves(ok_only) == group | {("summary", "status", "=", "ok")}
    (not_ok,) = [p for p in spec["panels"] if "not ok" in p["title"]]  # failed, interrupted, not equivalent
    assert not_ok["kind"] == "table" and leaves(not_ok["filters"]) == group | {("summary", "status", "!=", "ok")}
    assert {"summary:status", "summary:error"} <= set(not_ok["columns"])


def test_to_report_builds_the_panels_offline(monkeypatch):
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.reports.v2.interface as wri

    def no_network(*a, **k):
        raise AssertionError("building the report must not call W&B")

    monkeypatch.setattr(wri, "_get_api", no_network)
    monkeypatch.setattr(wri, "execute_graphql", no_network)
    spec = wrep.build_spec(GROUP, entity="me")
    rep = wrep.to_report(spec)
    assert isinstance(rep, wr.Report) and (rep.entity, rep.project) == ("me", "kvlab")
    grids = [b for b in rep.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == len(spec["panels"])
    for grid, p in zip(grids, spec["panels"]):
        (rs,) = grid.runsets
        assert (rs.entity, rs.project, rs.filters, rs.groupby) == ("me", "kvlab", p["filters"], p["groupby"])
        plotted = [m for panel in grid.panels for m in (panel.y if isinstance(panel, wr.LinePlot) else panel.metrics)]
        assert plotted == ([] if p["kind"] == "table" else p["y"])
        for panel in grid.panels:
            assert isinstance(panel, wr.LinePlot if p["kind"] == "line" else wr.BarPlot)
            if isinstance(panel, wr.LinePlot):
                assert panel.x == p["x"]
    # what save() would send: the run set lookup answered locally, the rest is the report's own JSON
    monkeypatch.setattr(wri, "execute_graphql", lambda api, q, v: {"project": {"internalId": "P1"}})
    monkeypatch.setattr(wri, "_get_api", lambda: None)
    sent = json.loads(rep._to_model().spec.model_dump_json(by_alias=True, exclude_none=True))
    sent_grids = [b for b in sent["blocks"] if b.get("type") == "panel-grid"]
    assert len(sent_grids) == len(spec["panels"])
    for g, p in zip(sent_grids, spec["panels"]):
        (rs,) = g["metadata"]["runSets"]
        assert rs["project"] == {"name": "kvlab", "entityName": "me", "id": "P1"}
        status = set() if p["filters"] == spec["filters"] else {("status", "ok")}  # charts: ok runs only
        assert {(f["key"]["name"], f["value"]) for f in rs["filters"]["filters"]} == {("group", GROUP),
                                                                                      ("jobType", "run")} | status
        assert [k["name"] for k in rs["grouping"]] == [BACKEND_KEY[k] for k in p["groupby"]]
        assert all(k["section"] == "config" for k in rs["grouping"])
        panels = g["metadata"]["panelBankSectionConfig"]["panels"]
        assert [m for q in panels for m in q["config"]["metrics"]] == ([] if p["kind"] == "table" else p["y"])
        for q in panels:
            if p["kind"] == "line":
                assert q["viewType"] == "Run History Line Plot" and q["config"]["xAxis"] == p["x"]
    table = sent_grids[-1]["metadata"]["runSets"][0]["runFeed"]
    assert "summary:bytes_per_token" in table["columnOrder"] and "config:cache.value.kind" not in table["columnOrder"]
    assert "config:effective.value.cache_label" in table["columnOrder"]


def test_the_sweeps_findings_open_the_report():
    import wandb_workspaces.reports.v2 as wr

    md = "# Findings\n\n- cache.k_bits: KL p99 2 0.500 (25× 8's), 8 0.020 (median of each value's runs). (runs: a, b)\n"
    spec = wrep.build_spec(GROUP, entity="me", findings=md)
    blocks = wrep.to_report(spec).blocks
    first_grid = next(i for i, b in enumerate(blocks) if isinstance(b, wr.PanelGrid))
    assert [b.text for b in blocks[:first_grid] if isinstance(b, wr.MarkdownBlock)][-1] == md
    assert not any(isinstance(b, wr.MarkdownBlock) and "Findings" in b.text
                   for b in wrep.to_report(wrep.build_spec(GROUP, entity="me")).blocks)


def test_to_report_needs_an_entity():
    with pytest.raises(ValueError, match="entity"):
        wrep.to_report(wrep.build_spec(GROUP))


def test_spec_round_trips_through_its_file(tmp_path):
    spec = wrep.build_spec(GROUP, project="p", entity="e")
    path = wrep.write_spec(tmp_path / "report", spec)
    assert path == tmp_path / "report" / wrep.SPEC_FILE
    assert [p.name for p in path.parent.iterdir()] == [wrep.SPEC_FILE]  # no temporary file left
    assert wrep.spec_from_file(path) == spec == wrep.spec_from_file(path.parent)
    (tmp_path / "bad.json").write_text('{"title": "x"}')
    with pytest.raises(ValueError, match="not a kvlab W&B report spec"):
        wrep.spec_from_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="no such file"):
        wrep.spec_from_file(tmp_path / "missing.json")


@pytest.mark.parametrize("group", ["", " ", "a/b", "a\\b", "x#1", "what?", "50%", "c:d", "it's"])
def test_a_bad_group_is_one_line_and_exit_2(group, capsys):
    assert wrep.main([group, "--spec-only", os.devnull]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "group" in err


def _cli(args, tmp_path, **env):
    full = {**os.environ, "HOME": str(tmp_path / "home"), "WANDB_MODE": "offline"}
    full.pop("WANDB_API_KEY", None)  # no key unless the test gives one; no ~/.netrc in this HOME
    full.update(env)
    (tmp_path / "home").mkdir(exist_ok=True)
    # a hang (no bounded wait) ends in TimeoutExpired: the guard is the timeout, no time is asserted
    return subprocess.run([sys.executable, "-m", "harness.wandb_report", *args], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=60, check=False)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.slow
def test_cli_spec_only_writes_the_json_with_no_network(tmp_path):
    trip = Tripwire()
    url = f"http://127.0.0.1:{trip.port}"
    proxies = dict(WANDB_BASE_URL=url, HTTP_PROXY=url, HTTPS_PROXY=url, http_proxy=url, https_proxy=url)
    out = tmp_path / "out"
    out.mkdir()
    proc = _cli([GROUP, "--project", "p", "--spec-only", str(out)], tmp_path, **proxies)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / wrep.SPEC_FILE).read_text()) == wrep.build_spec(GROUP, "p")
    proc = _cli([GROUP, "--entity", "e", "--spec-only", str(tmp_path / "x.json")], tmp_path, **proxies)
    assert proc.returncode == 0, proc.stderr
    assert wrep.spec_from_file(tmp_path / "x.json") == wrep.build_spec(GROUP, entity="e")
    assert trip.hits == 0


@pytest.mark.slow
def test_cli_online_without_a_key_says_what_to_do_and_exits_2(tmp_path):
    proc = _cli([GROUP], tmp_path, WANDB_BASE_URL=f"http://127.0.0.1:{_closed_port()}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "wandb login" in proc.stderr and "--spec-only" in proc.stderr


@pytest.mark.slow
def test_cli_publishing_a_spec_when_the_server_does_not_answer_exits_2_in_bounded_time(tmp_path):
    path = wrep.write_spec(tmp_path, wrep.build_spec(GROUP))
    proc = _cli(["--from-spec", str(path), "--entity", "e", "--timeout", "2"], tmp_path,
                WANDB_API_KEY="0" * 40, WANDB_BASE_URL=f"http://127.0.0.1:{_closed_port()}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "wandb login" in proc.stderr


def test_a_measurement_that_runs_only_when_named_is_charted_only_where_the_runs_made_it():
    """The long-context tasks (niah, mqar) run only when named: a sweep whose runs logged none of their keys gets
    neither their charts nor their columns in the runs table; one that logged niah's gets niah's, not mqar's."""
    from harness.analysis.wandb_report import build_spec

    def titled(spec):
        return {p["title"] for p in spec["panels"]}, next(p for p in spec["panels"] if p["title"] == "Runs")

    plain, runs = titled(build_spec("g", logged=["drift_kl", "status"]))
    assert "Needle in a haystack" not in plain and "Multi-query associative recall" not in plain
    assert "niah_acc" not in runs["y"] and "summary:mqar_acc" not in runs["columns"]
    named, runs = titled(build_spec("g", logged=["drift_kl", "niah_acc", "niah_acc_ref"]))
    assert "Needle in a haystack" in named and "Multi-query associative recall" not in named
    assert "niah_acc" in runs["y"] and "mqar_acc" not in runs["y"]
    every, _ = titled(build_spec("g"))  # no runs read: every chart
    assert {"Needle in a haystack", "Multi-query associative recall"} <= every

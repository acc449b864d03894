"""The server measurement in a run (``serve.*``), its tables, its refusals, and the sweep's server figures and
findings (``harness.analysis.server``)."""

import hashlib
import json
import math

import numpy as np
import pandas as pd
import pytest

from harness.analysis import server as A
from harness.measurements.server import budget_bytes, check_serve, serve_options
from tests.helpers import TINY, run_py

SERVE = ["measurements=[server]", "serve.requests=4", "serve.kv_budget=300KB", "serve.max_tokens=16",
         "serve.prompt_most=40", "serve.prompt_median=16", "serve.output_median=8", "tracking=disabled"]


@pytest.mark.slow
def test_serve_peer_hf_serves_the_same_requests_through_transformers_beside_a_paged_run(tmp_path):
    out = tmp_path / "run"
    proc = run_py([*TINY, *SERVE, "cache=paged", "serve.peer=hf", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((out / "results.json").read_text())
    assert rec["server_hf_requests_identical"] == rec["server_requests"] == 4
    assert rec["server_hf_output_tokens_per_s"] > 0 and 0 < rec["server_hf_kv_held"] <= rec["server_kv_budget"]
    assert "ContinuousBatchingLogger" not in proc.stderr


def _refused(proc, out) -> str:
    """A refused run: exit 1, one line saying why, a failed record and none of the server's tables."""
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("kvlab: run ")]
    assert len(said) == 1
    assert json.loads((out / "results.json").read_text())["status"] == "failed"
    assert not (out / "requests.csv").exists() and not (out / "timeline.csv").exists()
    return said[0]


@pytest.mark.slow
def test_a_budget_too_small_for_one_request_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "run"
    line = _refused(run_py([*TINY, *SERVE, "serve.kv_budget=2KB", f"hydra.run.dir={out}"], tmp_path), out)
    assert "too small for one request" in line and line.endswith("give serve.kv_budget >= 58,368")


@pytest.mark.slow
def test_a_budget_beyond_the_machine_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "run"
    assert "free" in _refused(run_py([*TINY, *SERVE, "serve.kv_budget=900GB", f"hydra.run.dir={out}"], tmp_path), out)


@pytest.mark.parametrize("bad,why", [({"kv_budget": "lots"}, "give bytes as an integer or a size"),
                                     ({"kv_budget": "0"}, "positive size"),
                                     ({"rate": 0.0}, "requests per second > 0"),
                                     ({"max_tokens": 5000}, "is more than max_len"),
                                     ({"max_batch": 0}, "serve.max_batch=0: give an integer >= 1")])
def test_bad_serve_options_are_refused_in_one_line(bad, why):
    with pytest.raises(ValueError, match=why):
        check_serve(serve_options({"requests": 4, **bad}), 1024)
    check_serve(serve_options({"requests": 0, **bad}), 1024)  # not serving: nothing of it is read


def test_a_kind_that_cannot_serve_is_refused_before_anything_runs():
    import torch
    from hydra import compose, initialize_config_dir

    from harness.common.errors import ConfigError
    from harness.experiment.config import read, register
    from harness.experiment.prepare import check_with_model
    from models.families import preset_config
    from tests.helpers import REPO

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        def check(*overrides):
            cfg = compose(config_name="config", overrides=["model=tiny-gqa", "measurements=[server]",
                                                           "serve.requests=4", *overrides])
            check_with_model(read(cfg), preset_config("tiny-gqa"), 128, torch.float32, torch.float32)

        check("cache=paged", "serve.prefix_caching=true", "serve.max_tokens=16", "serve.prompt_most=32")
        for overrides, why in ((["cache=prealloc", "serve.prefix_caching=true"], "needs a pooled kind"),
                               (["cache=paged", "cache.blocks=40"], "leave it at 0"),
                               (["cache=window", "cache.positions=cache"], "stores keys before the rotary rotation")):
            with pytest.raises(ConfigError, match=why):
                check(*overrides, "serve.max_tokens=16", "serve.prompt_most=32")


def test_sizes_read_as_bytes():
    assert [budget_bytes(x) for x in ("16MB", "512KB", "1GiB", "2_000", 64, "1.5 MB")] == [
        16_000_000, 512_000, 2**30, 2000, 64, 1_500_000]
    with pytest.raises(ValueError, match="serve has no option 'rates'"):
        serve_options({"rates": 3})


def _runs(rows, **extra):
    base = dict(status="ok", model="m", device="cpu", server_requests=10, server_kv_budget=10**6, **extra)
    cols = {k: k for k in A.POINT_KEYS.values()}
    out = []
    for i, (kind, rate, seed, tps, peak) in enumerate(rows):
        r = {**base, "run_name": f"r{i}", "cache_label": kind, "server_rate": rate, "seed": seed}
        r.update({c: 1.0 for c in cols})
        r.update(server_output_tokens_per_s=tps, server_peak_running=peak, server_kv_token_share=0.5)
        out.append(r)
    return pd.DataFrame(out)


def test_the_comparison_pairs_seeds_and_makes_its_interval_on_log_ratios():
    runs = _runs([("prealloc", None, 0, 100.0, 4), ("paged", None, 0, 200.0, 8),
                  ("prealloc", None, 1, 100.0, 4), ("paged", None, 1, 300.0, 10),
                  ("prealloc", None, 2, 50.0, 4), ("paged", None, 2, 150.0, 8),
                  ("paged", None, 3, 999.0, 99)])  # seed 3 has no baseline: left out
    cmp = A.server_compare(runs, "paged", "prealloc", "tokens_per_s")
    (row,) = cmp.itertuples()
    logs = np.log([2.0, 3.0, 3.0])
    h = 4.302653 * logs.std(ddof=1) / math.sqrt(3)  # t(0.975, 2 df), exact to 6 digits
    assert row.n == 3 and math.isinf(row.rate)
    assert row.ratio == pytest.approx(math.exp(logs.mean()))
    assert (row.low, row.high) == pytest.approx((math.exp(logs.mean() - h), math.exp(logs.mean() + h)))
    text = " ".join(t for t, _ in A.findings(runs))
    assert f"{math.exp(logs.mean()):.2f}×" in text and "n = 3 seeds" in text


def test_a_verdict_against_the_papers_range_is_inconclusive_when_the_interval_crosses_it():
    assert A._against(2.1, 3.9, 3) == "within vLLM's 2-4×"
    assert A._against(1.2, 1.8, 3) == "below vLLM's 2-4×"
    assert A._against(1.5, 2.5, 3).startswith("inconclusive")
    assert A._against(2.5, math.nan, 1).startswith("inconclusive")


def test_the_figures_draw_a_line_per_kind():
    runs = _runs([("prealloc", 4.0, 0, 100.0, 4), ("paged", 4.0, 0, 200.0, 8), ("prealloc", None, 0, 90.0, 4),
                  ("paged", None, 0, 180.0, 8)])
    fig = A.rate_plot(runs)
    assert len(fig.axes[0].lines) >= 2
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["4/s", A.ALL_AT_ONCE]
    timeline = pd.DataFrame([dict(status="ok", cache_label=k, run_name=k, server_rate=None, seed=0, time_s=t,
                                  running=n, server_prefix_caching=shared)
                             for k, shared in (("prealloc", False), ("paged", False), ("paged", True))
                             for t, n in ((0.0, 1), (1.0, 3))])
    timeline.loc[timeline["server_prefix_caching"], "run_name"] = "paged-shared"
    ax = A.running_plot(timeline).axes[0]
    assert len(ax.lines) == 3  # a line per run: the prefix-cache run apart from the one without
    assert sorted(line.get_label() for line in ax.lines) == ["paged", "paged" + A.PREFIX, "prealloc"]
    assert A.served(runs) and not A.served(runs.assign(server_requests=np.nan))


def test_a_prefix_cache_is_compared_with_the_same_kind_without_it():
    plain = _runs([("paged(block_size=16)", 16.0, seed, 100.0, 8) for seed in (0, 1, 2)], server_prefix_caching=False)
    shared = _runs([("paged(block_size=16)", 16.0, seed, 100.0, 8) for seed in (0, 1, 2)], server_prefix_caching=True)
    plain["server_prefilled_tokens"] = [1000.0, 1200.0, 900.0]
    shared["server_prefilled_tokens"] = [500.0, 600.0, 450.0]
    runs = pd.concat([plain, shared.assign(run_name=[f"s{i}" for i in range(3)])], ignore_index=True)
    assert set(A.server_points(runs)["kind"]) == {"paged(block_size=16)", "paged(block_size=16)" + A.PREFIX}
    (text,) = [t for t, _ in A.findings(runs) if "prefix cache over" in t]
    assert "tokens prefilled at 16/s 0.50× (n = 3 seeds, no spread: no interval)" in text


@pytest.mark.slow
def test_a_trace_file_gives_the_requests_their_times_prompts_and_lengths(tmp_path):
    from harness.measurements.server import read_trace, traced

    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,prompt_ids,output_tokens\n0.0,12,,5\n0.25,,7 8 9,3\n1.5,30,,8\n")
    rows = read_trace(str(trace), 128, 8, vocab=50257)
    assert rows == [(0.0, 12, 5), (0.25, (7, 8, 9), 3), (1.5, 30, 8)]
    # the trace gives the arrivals and lengths: serve.requests=0 serves all its rows, and no drawn setting is given
    traced_run = [*TINY, "measurements=[server]", "serve.kv_budget=300KB", "serve.max_tokens=16", "tracking=disabled"]
    out = run_py([*traced_run, f"serve.trace={trace}", "cache=paged", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    req = pd.read_csv(tmp_path / "run" / "requests.csv")
    assert req["arrival_s"].tolist() == [0.0, 0.25, 1.5] and req["output_tokens"].tolist() == [5, 3, 8]
    assert req["prompt_tokens"].tolist() == [12, 3, 30] and req["identical"].all()
    rec = json.loads((tmp_path / "run" / "results.json").read_text())
    assert rec["server_rate"] == pytest.approx(2 / 1.5) == rec["server_rate_measured"]  # from the arrivals, not 4/s
    assert rec["server_trace"] == str(trace) and rec["server_prompt_median"] is None and rec["server_sigma"] is None
    assert rec["server_trace_sha256"] == hashlib.sha256(trace.read_bytes()).hexdigest()
    assert "trace trace.csv" in rec["server_workload"] and "max_batch 32, max_tokens 16" in rec["server_workload"]
    assert "(trace trace.csv, 1.33333/s measured)" in out.stdout
    requests = traced([(0.0, (7, 8, 9), 2)], list(range(100)), 0, [50256])
    assert requests[0].prompt == (50256, 7, 8, 9)


@pytest.mark.parametrize("text,why", [("arrival_s,output_tokens\n0,4\n", "missing prompt_tokens"),
                                      ("arrival_s,prompt_tokens,output_tokens\n-1,4,4\n", "row 1"),
                                      ("arrival_s,prompt_tokens,output_tokens\n0,4,99\n", "output_tokens <= serve"),
                                      ("arrival_s,prompt_ids,output_tokens\n0,99999999,4\n", "ids below 50257")])
def test_a_bad_trace_is_refused_in_one_line(tmp_path, text, why):
    from harness.measurements.server import read_trace

    trace = tmp_path / "trace.csv"
    trace.write_text(text)
    with pytest.raises(ValueError, match=why):
        read_trace(str(trace), 128, 8, vocab=50257)
    with pytest.raises(ValueError, match="no such file"):
        read_trace(str(tmp_path / "none.csv"), 128, 8)


def test_a_request_whose_first_times_are_unknown_counts_in_no_ttft_and_no_slo():
    from harness.core import server as S

    def done(i, times):
        s = S.Served(S.Request(i, 0.0, (1, 2), len(times)), admitted_s=0.0, tokens=[0] * len(times),
                     times=list(times))
        s.first_token_s, s.finish_s = times[0], times[-1]
        return s

    served = [done(0, [0.1, 0.2]), done(1, [math.nan, 0.3, 0.5])]  # the peer reset request 1 after its first token
    rec = S.summary(S.ServeLog(served, [dict(time_s=0.0, running=1, kv_used_bytes=1, kv_held_bytes=2)], 0.5),
                    slo_ttft_ms=1000, slo_tpot_ms=1000)
    assert rec["server_ttft_ms_mean"] == pytest.approx(100) and rec["server_slo_met"] == pytest.approx(0.5)
    assert rec["server_itl_ms_mean"] == pytest.approx(np.mean([100, 200]))  # the unknown gap is no ITL
    rows = S.request_rows(served)
    assert rows[1]["ttft_ms"] is None and rows[1]["tpot_ms"] is None and rows[1]["e2e_ms"] == pytest.approx(500)

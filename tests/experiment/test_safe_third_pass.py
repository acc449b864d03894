"""Safe runs, third pass (issue 64), the serving and resume side: a served run's record names its whole workload and
the report pairs runs only on equal workloads; the resume fingerprint covers every file a run reads; serving
settings are bounded, and those that would do nothing are refused; the HF peer waits on arrivals and its failure
never discards kvlab's own results. Each case has an id; docs/faults.md's fault table lists them (``CASES``)."""

import json
import math
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.analysis import server as A
from harness.experiment.config import read
from harness.experiment.prepare import check_with_model
from harness.experiment.folder import input_ids
from harness.experiment.weights import Weights
from harness.measurements.server import (ServeOptions, check_serve, read_trace, serve_options, workload,
                                         workload_record)
from models.families import preset_config
from models.hf_checkpoint import files_read
from tests.helpers import REPO, TINY, run_py, untested_cases

CASES = [
    ("serve-trace-recorded", "a run with serve.trace records the trace (path, sha256), the rate measured from its "
                             "arrivals (not serve.rate), max_batch, max_tokens, the SLO bounds and the workload in "
                             "words and as an id; it prints `(trace FILE, R/s measured)`, never serve.rate"),
    ("serve-drawn-recorded", "a drawn workload's record names its distribution and parameters (rate, medians, "
                             "sigma, most), max_batch, max_tokens and the SLO bounds"),
    ("server-report-unequal-workloads", "a traced run and a drawn run (or runs of other max_batch, SLO bounds, "
                                        "...) at the same rate never pair: the findings say `not paired: different "
                                        "workloads` and what each ran"),
    ("resume-every-checkpoint-file", "the input fingerprint covers every file a run reads: each shard of a sharded "
                                     "checkpoint, its index, tokenizer.json; an edit to any one is a new "
                                     "measurement"),
    ("resume-trace-changed", "an edited serve.trace measures the run again: `measured again: the serving trace "
                             "changed`"),
    ("serve-sigma-bounds", "serve.sigma=inf (or -1, or 5): `serve.sigma=inf: give the spread of the lengths' "
                           "logarithms, 0 .. 4` before anything runs (was: a raw OverflowError mid-run)"),
    ("serve-slo-not-positive", "serve.slo_ttft_ms=-5 (or 0; slo_tpot_ms too): `give a bound in milliseconds > 0 "
                               "(inf: no bound)` (was: accepted, every request outside its SLO)"),
    ("serve-rate-span", "serve.rate so low that the requests would arrive over more than 1,000,000 s refused "
                        "naming the least rate; with serve.peer=hf (which replays arrivals on the wall clock) more "
                        "than 3,600 s"),
    ("serve-trace-arrival-bounds", "a trace whose arrivals span more than 1,000,000 s (arrival_s 1e300) refused in "
                                   "one line (was: every latency 0.0 ms, status ok); arrivals in Unix time are "
                                   "counted from the trace's first"),
    ("serve-trace-not-a-file", "serve.trace at a folder, /dev/zero, a FIFO or a dangling link: `serve.trace=X: is a "
                               "folder, not a regular file (...)`, `is a character device`, `is a FIFO (named "
                               "pipe)`, `is a link to Y, which does not exist` (was: `no such file`); never opened"),
    ("serve-trace-both-prompts", "a trace row with both prompt_tokens and prompt_ids: `row N gives both "
                                 "prompt_tokens and prompt_ids: give one of them in each row`"),
    ("serve-requests-under-trace", "serve.requests=N under a trace serves its first N requests by arrival (recorded "
                                   "as `its first N`); N beyond its rows refused; 0 serves them all (was: ignored)"),
    ("serve-drawn-setting-under-trace", "serve.rate, prompt_median, prompt_most, output_median or sigma set under a "
                                        "trace: `serve.rate=16 does nothing under serve.trace` (was: ignored, and "
                                        "recorded as the run's rate)"),
    ("serve-peer-not-paged", "serve.peer=hf on a kind other than paged: `serve.peer=hf serves the same requests "
                             "through transformers' paged continuous batching, the counterpart of cache=paged, not "
                             "of cache=prealloc: use cache=paged, serve.peer=auto in a sweep over kinds ...` (was: "
                             "accepted, the peer never ran); serve.peer=auto (experiment=serving's) runs it beside "
                             "the paged runs alone"),
    ("serve-peer-dtype", "serve.peer=hf dtype=bf16 (K/V stored bf16, computed fp32): refused, since HF's paged cache "
                         "stores K/V in the model's dtype; dtype.compute=bf16 too runs both in bf16 (was: the peer "
                         "kept fp32 K/V, half the blocks, under the same reported budget)"),
    ("serve-peer-waits-on-arrivals", "the HF peer waits on the next arrival however far off; only a request in "
                                     "flight with no result for STALL_S is a stall (was: a 700 s gap failed as "
                                     "`its worker stopped` after 600 s)"),
    ("server-zero-width-interval", "a server ratio every seed agrees on (the most requests running, 1.00× on each) "
                                   "prints `1.00× (n = 2 seeds, no spread: no interval)` and no verdict against vLLM's "
                                   "2-4× (was `1.00× [1.00, 1.00]` as a 95% interval)"),
    ("serve-without-server", "serve.requests=4 (or serve.trace) with measurements that leave out server: `serve."
                             "requests=4 serves requests, but measurements=[equivalence] leaves out server: add server "
                             "to measurements, ...` (was: accepted, nothing served)"),
    ("serve-peer-failure-kept", "the peer failing records `server_hf_error` with why, prints one line, and keeps "
                                "kvlab's own serving results; the run is ok (was: the run failed, kvlab's results "
                                "discarded)"),
]


def test_every_case_has_a_test():
    assert not untested_cases(__file__, CASES)


def _trace(path: Path, rows: str) -> str:
    path.write_text("arrival_s,prompt_tokens,prompt_ids,output_tokens\n" + rows)
    return str(path)


def _serve_cfg(*overrides):
    return read(_compose(["model=tiny", "measurements=[server]", "serve.kv_budget=300KB", "serve.max_tokens=16",
                          *overrides]))


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from harness.experiment.config import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def _refused(rc, match, storage=torch.float32, compute=torch.float32):
    from harness.common.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as e:
        check_with_model(rc, preset_config("tiny"), 128, storage, compute)
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- a record names its whole workload -------------------------------------------------------------------------

def test_a_traced_run_records_its_trace_and_measured_rate(tmp_path):  # serve-trace-recorded
    """The run itself is tests/analysis/test_server_report.py's trace test (its record and printed line are asserted
    there); here the record's words for two traces with the same rows at other times."""
    a = _trace(tmp_path / "a.csv", "0.0,12,,5\n0.5,,7 8 9,3\n1.0,30,,8\n")
    b = _trace(tmp_path / "b.csv", "0.0,12,,5\n2.5,,7 8 9,3\n5.0,30,,8\n")
    text = list(range(1000, 1400))
    recs = []
    for path in (a, b):
        s = ServeOptions(trace=path, max_tokens=16)
        recs.append(workload_record(s, workload(s, text, None, 0, max_len=128)))
    assert [r["server_rate"] for r in recs] == [pytest.approx(2.0), pytest.approx(0.4)]  # not serve.rate's 4/s
    assert recs[0]["server_rate_measured"] == recs[0]["server_rate"]
    assert recs[0]["server_workload_id"] != recs[1]["server_workload_id"]
    assert recs[0]["server_trace"] == a and len(recs[0]["server_trace_sha256"]) == 64
    assert recs[0]["server_prompt_median"] is None and recs[0]["server_sigma"] is None
    assert "trace a.csv" in recs[0]["server_workload"] and "SLO TTFT 2000 ms, TPOT 200 ms" in recs[0]["server_workload"]


def test_a_drawn_workload_records_its_distribution_and_server_settings():  # serve-drawn-recorded
    text = list(range(1000, 1400))
    s = ServeOptions(requests=6, rate=8.0, prompt_median=16, prompt_most=40, output_median=8, max_tokens=16,
                     sigma=0.5, max_batch=4, slo_ttft_ms=500.0)
    rec = workload_record(s, workload(s, text, None, 0, max_len=128))
    assert rec["server_rate"] == 8.0 and rec["server_rate_measured"] > 0 and rec["server_trace"] is None
    assert (rec["server_prompt_median"], rec["server_prompt_most"], rec["server_output_median"],
            rec["server_sigma"], rec["server_max_batch"], rec["server_max_tokens"]) == (16, 40, 8, 0.5, 4, 16)
    assert "Poisson arrivals at 8/s" in rec["server_workload"] and "max_batch 4" in rec["server_workload"]
    other = workload_record(ServeOptions(**{**s.__dict__, "slo_ttft_ms": 2000.0}), workload(s, text, None, 0,
                                                                                           max_len=128))
    assert other["server_workload_id"] != rec["server_workload_id"]  # the SLO bounds are part of the workload
    inf = ServeOptions(**{**s.__dict__, "rate": math.inf})
    assert workload_record(inf, workload(inf, text, None, 0, max_len=128))["server_rate"] is None


def _runs(rows):
    base = dict(status="ok", model="mini", device="cpu", server_requests=8, server_kv_budget=6_000_000,
                server_prefix_caching=False, server_requests_per_s=1.0, server_peak_running=4,
                server_kv_token_share=0.5)
    return pd.DataFrame([{**base, **r} for r in rows])


def test_the_report_pairs_only_equal_workloads():  # server-report-unequal-workloads
    traced = dict(server_workload_id="t1", server_workload="trace a.csv (sha256 ab): 8 requests",
                  server_trace="/data/a.csv")
    drawn = dict(server_workload_id="d1", server_workload="drawn: 8 requests, Poisson arrivals at 4/s")
    rows = [dict(run_name=f"{k}-{s}", cache_label=k, seed=s, server_rate=4.0, server_output_tokens_per_s=tps, **w)
            for s in (0, 1) for k, tps, w in (("prealloc", 100.0 + s, traced), ("paged", 84.0 + s, drawn))]
    runs = _runs(rows)
    cmp = A.server_compare(runs, "paged", "prealloc", "tokens_per_s")
    assert (cmp["n"] == 0).all()  # nothing paired: the 0.84x of two different workloads is never reported
    lines = [line for line, _ in A.findings(runs)]
    assert not any("×" in line and "paged over prealloc" in line for line in lines), lines
    line = next(line for line in lines if "not paired" in line)
    assert "paged over prealloc: not paired: different workloads" in line and "trace a.csv" in line \
        and "Poisson arrivals at 4/s" in line
    # the figures draw a line per kind and workload, never one line across two workloads
    assert set(A.server_points(runs)["series"]) == {"prealloc · trace a.csv", "paged · workload d1"}
    same = _runs([{**r, **drawn, "server_trace": None} for r in rows])  # the same workload: paired, as before
    assert set(A.server_points(same)["series"]) == {"prealloc", "paged"}
    cmp = A.server_compare(same, "paged", "prealloc", "tokens_per_s")
    assert list(cmp["n"]) == [2] and cmp["ratio"].iloc[0] == pytest.approx(math.sqrt(84 / 100 * 85 / 101))


# ---- the input fingerprint covers every file a run reads -------------------------------------------------------

def test_every_checkpoint_file_a_run_reads_is_in_its_fingerprint(tmp_path):  # resume-every-checkpoint-file
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    files = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json"]
    for name in files:
        (ckpt / name).write_bytes(name.encode())
    (ckpt / "notes.md").write_text("not read by a run")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": files[1], "b": files[2]}}))
    (ckpt / "consolidated.safetensors").write_bytes(b"another format's copy, which no load reads")
    (ckpt / "pytorch_model.bin").write_bytes(b"read only where there is no safetensors")
    assert [p.name for p in files_read(ckpt)] == sorted(files)
    w = Weights("pretrained", str(ckpt), str(ckpt), "a folder")
    before = input_ids(None, 0, w)["inputs_checkpoint"]
    for name in files:
        old = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(old + b" edited")
        assert input_ids(None, 0, w)["inputs_checkpoint"] != before, name
        (ckpt / name).write_bytes(old)
        assert input_ids(None, 0, w)["inputs_checkpoint"] == before
    for name in ("notes.md", "consolidated.safetensors", "pytorch_model.bin"):
        (ckpt / name).write_text("edited")
        assert input_ids(None, 0, w)["inputs_checkpoint"] == before, name  # a file no load reads changes nothing


@pytest.mark.slow
def test_an_edited_trace_is_measured_again(tmp_path):  # resume-trace-changed
    trace = _trace(tmp_path / "trace.csv", "0.0,12,,5\n0.25,,7 8 9,3\n")
    args = [*TINY, "measurements=[server]", "serve.kv_budget=300KB", "serve.max_tokens=16", "cache=paged",
            "tracking=disabled", f"serve.trace={trace}", f"hydra.run.dir={tmp_path / 'run'}"]
    assert run_py(args, tmp_path).returncode == 0
    assert "is complete" in run_py(args, tmp_path).stdout
    _trace(tmp_path / "trace.csv", "0.0,12,,5\n0.75,,7 8 9,3\n")
    again = run_py(args, tmp_path)
    assert again.returncode == 0 and "measured again: the serving trace changed" in again.stderr, again.stderr
    rec = json.loads((tmp_path / "run" / "results.json").read_text())
    assert rec["server_rate"] == pytest.approx(1 / 0.75)


# ---- serving settings bounded; settings that would do nothing refused ------------------------------------------

@pytest.mark.parametrize("sigma", [math.inf, -1.0, 5.0])
def test_sigma_is_bounded(sigma):  # serve-sigma-bounds
    with pytest.raises(ValueError, match=r"serve.sigma=.*: give the spread of the lengths' logarithms, 0 \.\. 4"):
        check_serve(ServeOptions(requests=4, sigma=sigma), 1024)


@pytest.mark.parametrize("name", ["slo_ttft_ms", "slo_tpot_ms"])
@pytest.mark.parametrize("value", [-5.0, 0.0])
def test_slo_bounds_are_positive(name, value):  # serve-slo-not-positive
    with pytest.raises(ValueError, match=rf"serve.{name}=.*: give a bound in milliseconds > 0 \(inf: no bound\)"):
        check_serve(ServeOptions(requests=4, **{name: value}), 1024)
    check_serve(ServeOptions(requests=4, **{name: math.inf}), 1024)  # no bound


def test_a_drawn_workload_spans_a_bounded_time():  # serve-rate-span
    with pytest.raises(ValueError, match=r"serve.rate=1e-06: .* arrive over about 4,000,000 s.*serve.rate >= 4e-06"):
        check_serve(ServeOptions(requests=4, rate=1e-6), 1024)
    with pytest.raises(ValueError, match=r"serve.peer=hf replays arrivals on the wall clock.*serve.rate >= 0.00111"):
        check_serve(ServeOptions(requests=4, rate=0.001, peer="hf"), 1024)
    check_serve(ServeOptions(requests=4, rate=0.001), 1024)  # kvlab's own server skips the gaps
    # auto: bounded where the peer runs (beside paged), not beside the kinds it skips
    check_with_model(_serve_cfg("cache=prealloc", "serve.requests=4", "serve.rate=0.001", "serve.peer=auto"),
                 preset_config("tiny"), 128, torch.float32, torch.float32)
    _refused(_serve_cfg("cache=paged", "serve.requests=4", "serve.rate=0.001", "serve.peer=auto"),
             r"serve.peer=auto replays arrivals on the wall clock, and 4 requests at serve.rate=0.001 arrive over "
             r"about 4,000 s")


def test_trace_arrivals_are_bounded_and_counted_from_the_first(tmp_path):  # serve-trace-arrival-bounds
    far = _trace(tmp_path / "far.csv", "0.0,12,,5\n1e300,12,,5\n")
    with pytest.raises(ValueError, match=r"its arrivals span .* beyond kvlab's 1,000,000 s"):
        read_trace(far, 128, 8)
    epoch = _trace(tmp_path / "epoch.csv", "1733500000.0,12,,5\n1733500000.5,12,,5\n1733500700.5,12,,5\n")
    assert [a for a, _, _ in read_trace(epoch, 128, 8)] == [0.0, 0.5, 700.5]
    rc = _serve_cfg("cache=paged", "serve.peer=hf", f"serve.trace={epoch}")
    check_with_model(rc, preset_config("tiny"), 128, torch.float32, torch.float32)  # 700 s: within the peer's hour
    long = _trace(tmp_path / "long.csv", "0.0,12,,5\n4000,12,,5\n")
    _refused(_serve_cfg("cache=paged", "serve.peer=hf", f"serve.trace={long}"),
             r"serve.peer=hf replays arrivals on the wall clock, and serve.trace=.* spans 4,000 s")


def test_a_trace_that_is_not_a_regular_file_is_never_read(tmp_path):  # serve-trace-not-a-file
    with pytest.raises(ValueError, match=r"serve.trace=.*: is a folder, not a regular file .*; give a CSV with"):
        read_trace(str(tmp_path), 128, 8)
    with pytest.raises(ValueError, match="is a character device, not a regular file"):
        read_trace("/dev/zero", 128, 8)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO"):  # opening a FIFO would block: never opened
        read_trace(str(fifo), 128, 8)
    (tmp_path / "gone.csv").symlink_to(tmp_path / "nothing.csv")
    with pytest.raises(ValueError, match="is a link to .*, which does not exist"):
        read_trace(str(tmp_path / "gone.csv"), 128, 8)
    with pytest.raises(ValueError, match="no such file"):
        read_trace(str(tmp_path / "none.csv"), 128, 8)


def test_a_row_gives_its_prompt_once(tmp_path):  # serve-trace-both-prompts
    both = _trace(tmp_path / "both.csv", "0.0,12,,5\n0.5,3,7 8 9,3\n")
    with pytest.raises(ValueError, match="row 2 gives both prompt_tokens and prompt_ids: give one of them"):
        read_trace(both, 128, 8)


def test_serve_requests_under_a_trace_takes_its_first_requests(tmp_path):  # serve-requests-under-trace
    path = _trace(tmp_path / "t.csv", "2.0,12,,5\n0.0,13,,5\n1.0,14,,5\n")
    assert [p for _, p, _ in read_trace(path, 128, 8, first=2)] == [13, 14]  # the first two by arrival
    assert len(read_trace(path, 128, 8, first=0)) == 3
    with pytest.raises(ValueError, match=r"serve.requests=4 but serve.trace=.* has 3 requests: give serve.requests "
                                         r"<= 3"):
        read_trace(path, 128, 8, first=4)
    s = ServeOptions(trace=path, requests=2, max_tokens=16)
    rec = workload_record(s, workload(s, list(range(1000, 1400)), None, 0, max_len=128))
    assert "its first 2 requests" in rec["server_workload"]


def test_a_drawn_setting_under_a_trace_is_refused(tmp_path):  # serve-drawn-setting-under-trace
    path = _trace(tmp_path / "t.csv", "0.0,12,,5\n")
    for name, value in (("rate", 16.0), ("prompt_median", 10), ("prompt_most", 99), ("output_median", 4),
                        ("sigma", 0.3)):
        with pytest.raises(ValueError, match=rf"serve.{name}={value} does nothing under serve.trace"):
            check_serve(serve_options(dict(trace=path, **{name: value})), 1024)
    check_serve(serve_options(dict(trace=path)), 1024)


def test_the_peer_runs_beside_paged_alone():  # serve-peer-not-paged
    from harness.core.engines import ENGINES  # noqa: F401  (the kinds' registry loaded)
    from models.kv_cache import cache_kind
    from harness.measurements.server import peer_runs

    _refused(_serve_cfg("cache=prealloc", "serve.requests=4", "serve.peer=hf"),
             r"serve.peer=hf serves the same requests through transformers' paged continuous batching, the "
             r"counterpart of cache=paged, not of cache=prealloc: use cache=paged, serve.peer=auto in a sweep over "
             r"kinds \(the peer beside its paged runs alone\), or leave serve.peer empty")
    # auto (experiment=serving's): beside the paged runs, none beside the others, and the record's server_hf_* null
    check_with_model(_serve_cfg("cache=prealloc", "serve.requests=4", "serve.peer=auto"), preset_config("tiny"), 128,
                 torch.float32, torch.float32)
    auto = ServeOptions(requests=4, peer="auto")
    assert peer_runs(auto, cache_kind("paged")) and not peer_runs(auto, cache_kind("prealloc"))
    assert peer_runs(ServeOptions(requests=4, peer="hf"), cache_kind("paged"))
    assert not peer_runs(ServeOptions(requests=4), cache_kind("paged"))


def test_the_peer_stores_kv_in_the_runs_dtype():  # serve-peer-dtype
    rc = _serve_cfg("cache=paged", "serve.requests=4", "serve.peer=hf")
    _refused(rc, r"serve.peer=hf: transformers' paged cache stores K/V in its model's dtype, the compute dtype "
                 r"\(fp32\), and this run stores bf16: set dtype.compute=bf16 too", storage=torch.bfloat16,
             compute=torch.float32)
    check_with_model(rc, preset_config("tiny"), 128, torch.bfloat16, torch.bfloat16)  # both bf16: the same bytes


# ---- the peer ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_peer_waits_on_a_far_arrival(monkeypatch):  # serve-peer-waits-on-arrivals
    from harness.core import hf_server
    from harness.core.engines import HFEngine
    from harness.core.server import Request
    from models.families import build

    torch.manual_seed(0)
    model = build(preset_config("tiny")).eval()
    monkeypatch.setattr(hf_server, "STALL_S", 0.5)  # a gap of 2 s between arrivals: 4x the stall bound
    requests = [Request(0, 0.0, (5, 6, 7), 2), Request(1, 2.0, (8, 9), 2)]
    log = hf_server.serve_hf(HFEngine(model), requests, budget=300_000, page_size=16, max_batch_tokens=64)
    assert [len(s.tokens) for s in log.served] == [2, 2]
    assert log.served[1].first_token_s >= 2.0


@pytest.mark.slow
def test_a_failing_peer_keeps_kvlabs_results(tmp_path):  # serve-peer-failure-kept
    """A peer that fails (its serve_hf replaced, in the run's process, by one that raises) is recorded beside kvlab's
    own figures; the run is ok."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import harness.core.hf_server as h\n"
        "def broken(*a, **k):\n    raise RuntimeError('the peer broke on purpose')\n"
        "h.serve_hf = broken\n")
    out = tmp_path / "run"
    args = [*TINY, "measurements=[server]", "serve.requests=3", "serve.kv_budget=300KB", "serve.max_tokens=16",
            "serve.prompt_most=40", "serve.prompt_median=16", "serve.output_median=8", "cache=paged", "serve.peer=hf",
            "tracking=disabled", f"hydra.run.dir={out}"]
    proc = run_py(args, tmp_path, extra_env={"PYTHONPATH": f"{shim}{os.pathsep}{REPO}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((out / "results.json").read_text())
    assert rec["status"] == "ok" and rec["server_requests"] == 3 and rec["server_requests_identical"] == 3
    assert rec["server_hf_error"] == "RuntimeError: the peer broke on purpose"
    assert rec["server_hf_output_tokens_per_s"] is None
    assert "serve.peer=hf failed (RuntimeError: the peer broke on purpose); kvlab's own serving results are kept" \
        in proc.stderr
    assert "serve.peer=hf failed: RuntimeError" in proc.stdout and (out / "requests.csv").is_file()


def test_a_ratio_every_seed_agrees_on_is_no_interval():  # server-zero-width-interval
    same = dict(server_workload_id="d1", server_workload="drawn")
    rows = [dict(run_name=f"{k}-{s}", cache_label=k, seed=s, server_rate=4.0, server_output_tokens_per_s=tps, **same)
            for s in (0, 1) for k, tps in (("prealloc", 100.0), ("paged", 100.0))]
    lines = [line for line, _ in A.findings(_runs(rows))]
    peak = next(line for line in lines if "requests running at once" in line)
    assert "1.00× (n = 2 seeds, no spread: no interval)" in peak and "[1.00, 1.00]" not in peak
    tps = next(line for line in lines if "output tokens/s" in line)
    assert "inconclusive (no spread over the seeds: no interval)" in tps and "below vLLM's" not in tps


def test_serving_settings_without_the_server_measurement_are_refused(tmp_path):  # serve-without-server
    rc = read(_compose(["model=tiny", "measurements=[equivalence]", "serve.requests=4"]))
    _refused(rc, r"serve.requests=4 serves requests, but measurements=\[equivalence\] leaves out server: add server "
                 r"to measurements, or leave serve.requests at 0 and serve.trace empty")
    path = _trace(tmp_path / "t.csv", "0.0,12,,5\n")
    _refused(read(_compose(["model=tiny", "measurements=[equivalence]", f"serve.trace={path}"])),
             r"serve.trace=.*t.csv serves requests, but measurements=\[equivalence\] leaves out server")
    check_with_model(read(_compose(["model=tiny", "measurements=[equivalence]"])), preset_config("tiny"), 128,
               torch.float32, torch.float32)  # serve at its defaults: nothing to refuse

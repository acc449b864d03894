"""The continuous-batching server (``harness.core.server``): admission under a KV budget, first come first served,
pre-emption by recompute and resumption, memory freed at once, shared prefix blocks, and every request's tokens
equal to its own single-sequence greedy run."""

import math

import numpy as np
import pytest
import torch

from harness.core import server as S
from harness.core.engines import KvlabEngine
from harness.core.measure import CacheSpec

CPU = torch.device("cpu")
# tight enough that requests wait and (for the kinds that grow) are pre-empted
WORK = S.Workload(requests=12, rate=math.inf, prompt_median=20, prompt_most=60, output_median=12, output_most=30)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return KvlabEngine(tiny_model)


@pytest.fixture(scope="module")
def text():
    return torch.randint(0, 50257, (2000,), generator=torch.Generator().manual_seed(1)).tolist()


def serve(engine, kind, opts, requests, budget=110_000, max_tokens=30, max_batch=8, prefix=False):
    memory = S.memory_for(engine, CacheSpec(kind, opts), budget, max_tokens, 128, prefix_caching=prefix)
    return S.Server(engine, memory, max_batch, CPU).run(requests), memory


@pytest.mark.slow
@pytest.mark.parametrize("kind,opts", [("prealloc", {}), ("concat", {}), ("paged", {"block_size": 4}),
                                       ("quant", {"k_bits": 8, "v_bits": 8, "group_size": 8}),
                                       ("h2o", {"budget": 16, "recent": 4}), ("window", {"window": 16, "sinks": 2})])
def test_every_request_gets_the_tokens_it_gets_alone_and_the_budget_holds(engine, text, kind, opts):
    requests = S.make_requests(WORK, text, system=text[:8])
    log, memory = serve(engine, kind, opts, requests)
    assert all(S.alone(engine, CacheSpec(kind, opts), log.served, CPU))
    assert [len(s.tokens) for s in log.served] == [r.output_tokens for r in requests]
    assert max(t["kv_held_bytes"] for t in log.timeline) <= 110_000
    assert all(t["kv_used_bytes"] <= t["kv_held_bytes"] for t in log.timeline)
    assert max(t["running"] for t in log.timeline) > 1  # requests did run together
    if kind in ("concat", "paged"):  # they take memory as tokens come: this budget runs out mid-flight
        assert sum(s.preemptions for s in log.served) > 0


@pytest.mark.slow
def test_a_preempted_request_resumes_from_its_prompt_and_tokens(engine, text):
    requests = S.make_requests(WORK, text)
    log, _ = serve(engine, "paged", {"block_size": 4}, requests, budget=100_000)
    hit = [s for s in log.served if s.preemptions]
    assert hit
    for s in hit:  # every admission prefilled its prompt and what it had made: more than the prompt alone
        assert s.prefilled_tokens > len(s.request.prompt)
        assert s.times == sorted(s.times)
    assert all(S.alone(engine, CacheSpec("paged", {"block_size": 4}), hit, CPU))


def test_a_finished_request_frees_its_memory_at_once(engine, text):
    requests = S.make_requests(WORK, text)
    log, memory = serve(engine, "paged", {"block_size": 4}, requests)
    assert memory.pool.used == 0  # every block went back
    assert log.timeline[-1]["running"] == 0 and log.timeline[-1]["kv_held_bytes"] == 0
    log, memory = serve(engine, "prealloc", {}, requests)
    assert memory.reserved == 0
    assert all(s.cache is None for s in log.served)


def test_first_come_first_served(engine, text):
    requests = S.make_requests(S.Workload(requests=12, rate=200.0, prompt_median=20, prompt_most=60,
                                          output_median=12, output_most=30), text)
    log, _ = serve(engine, "prealloc", {}, requests)
    order = sorted(log.served, key=lambda s: (s.admitted_s, s.request.arrival_s))
    assert [s.request.arrival_s for s in order] == sorted(s.request.arrival_s for s in log.served)
    assert all(s.admitted_s >= s.request.arrival_s for s in log.served)
    assert all(s.first_token_s > s.admitted_s and s.finish_s >= s.first_token_s for s in log.served)


def test_paging_runs_more_requests_at_once_than_reserving_at_the_same_budget(engine, text):
    requests = S.make_requests(WORK, text)
    peaks = {kind: max(t["running"] for t in serve(engine, kind, opts, requests, budget=220_000)[0].timeline)
             for kind, opts in (("prealloc", {}), ("paged", {"block_size": 4}))}
    assert peaks["paged"] > peaks["prealloc"]


@pytest.mark.slow
def test_a_shared_system_prompt_is_prefilled_once_and_held_once(engine, text):
    system = text[1000:1032]  # 8 blocks of 4
    requests = S.make_requests(S.Workload(requests=8, rate=math.inf, prompt_median=10, prompt_most=20,
                                          output_median=6, output_most=10), text, system=system)
    plain, _ = serve(engine, "paged", {"block_size": 4}, requests, budget=400_000)
    shared, memory = serve(engine, "paged", {"block_size": 4}, requests, budget=400_000, prefix=True)
    assert sum(s.cached_tokens for s in shared.served) == 32 * 7  # every request after the first finds it
    assert (sum(s.prefilled_tokens for s in plain.served) - sum(s.prefilled_tokens for s in shared.served)
            == 32 * 7)
    assert max(t["kv_held_bytes"] for t in shared.timeline) < max(t["kv_held_bytes"] for t in plain.timeline)
    assert all(S.alone(engine, CacheSpec("paged", {"block_size": 4}), shared.served, CPU))
    assert memory.pool.used == len(memory.prefixes)  # when all is done, only the prefix cache holds blocks


def test_bad_budgets_and_kinds_are_refused_in_one_line(engine, text):
    requests = S.make_requests(WORK, text)
    with pytest.raises(ValueError, match=r"too small for one request: .* give serve.kv_budget >= [\d,]+$"):
        serve(engine, "prealloc", {}, requests, budget=10_000)
    with pytest.raises(ValueError, match="needs a pooled kind"):
        S.memory_for(engine, CacheSpec("prealloc", {}), 10**6, 30, 128, prefix_caching=True)
    with pytest.raises(ValueError, match="leave it at 0"):
        S.memory_for(engine, CacheSpec("paged", {"blocks": 40}), 10**6, 30, 128)


def test_the_workload_is_seeded_bounded_and_poisson():
    text = list(range(5000))
    w = S.Workload(requests=2000, rate=8.0, prompt_median=40, prompt_most=100, output_median=20, output_most=50)
    a, b = S.make_requests(w, text), S.make_requests(w, text)
    assert a == b and S.make_requests(S.Workload(**{**w.__dict__, "seed": 1}), text) != a
    gaps = np.diff([0.0] + [r.arrival_s for r in a])
    assert abs(gaps.mean() - 1 / 8.0) < 4 * (1 / 8.0) / math.sqrt(len(gaps))  # Exp(rate): mean 1/rate, sd 1/rate
    lengths = [len(r.prompt) for r in a]
    assert 1 <= min(lengths) and max(lengths) == 100 and abs(np.median(lengths) - 40) <= 3
    assert max(r.output_tokens for r in a) == 50
    assert [r.arrival_s for r in S.make_requests(S.Workload(requests=5, rate=math.inf), text)] == [0.0] * 5
    with pytest.raises(ValueError, match="need at least"):
        S.make_requests(w, text[:50])


def test_the_summary_is_what_the_requests_times_say():
    def done(i, arrival, times):
        s = S.Served(S.Request(i, arrival, (1, 2, 3), len(times)), admitted_s=arrival, tokens=[0] * len(times),
                     times=list(times))
        s.first_token_s, s.finish_s = times[0], times[-1]
        return s

    served = [done(0, 0.0, [0.1, 0.2, 0.4]), done(1, 0.5, [0.6]), done(2, 1.0, [1.3, 1.4])]
    timeline = [dict(time_s=0.0, running=1, kv_used_bytes=10, kv_held_bytes=20),
                dict(time_s=1.0, running=3, kv_used_bytes=30, kv_held_bytes=40),
                dict(time_s=1.4, running=0, kv_used_bytes=0, kv_held_bytes=0)]
    rec = S.summary(S.ServeLog(served, timeline, 0.9), slo_ttft_ms=150, slo_tpot_ms=120)
    assert rec["server_duration_s"] == pytest.approx(1.4)
    assert rec["server_requests_per_s"] == pytest.approx(3 / 1.4)
    assert rec["server_output_tokens_per_s"] == pytest.approx(6 / 1.4)
    assert rec["server_ttft_ms_mean"] == pytest.approx(np.mean([100, 100, 300]))
    assert rec["server_tpot_ms_median"] == pytest.approx(np.median([150, 100]))
    assert rec["server_itl_ms_p99"] == pytest.approx(np.percentile([100, 200, 100], 99))
    # within the SLO: request 0 (TPOT 150 > 120: no), 1 (yes: one token, no TPOT), 2 (TTFT 300: no)
    assert rec["server_slo_met"] == pytest.approx(1 / 3) and rec["server_goodput"] == pytest.approx(1 / 1.4)
    assert rec["server_mean_running"] == pytest.approx((1 * 1.0 + 3 * 0.4) / 1.4)
    assert rec["server_kv_token_share"] == pytest.approx((10 + 30 * 0.4) / (20 + 40 * 0.4))


@pytest.mark.slow
def test_the_hf_peer_serves_the_same_requests_to_the_same_tokens_within_the_budget(engine, text, tiny_model):
    from harness.core.engines import HFEngine
    from harness.core.hf_server import block_bytes, serve_hf

    requests = S.make_requests(S.Workload(requests=5, rate=50.0, prompt_median=16, prompt_most=40,
                                          output_median=8, output_most=16), text)
    ours, _ = serve(engine, "paged", {"block_size": 16}, requests, budget=300_000)
    hf = HFEngine(tiny_model)
    theirs = serve_hf(hf, requests, 300_000, page_size=16, max_batch_tokens=128)
    assert [s.tokens for s in theirs.served] == [s.tokens for s in ours.served]
    held = theirs.timeline[0]["kv_held_bytes"]
    assert held == (300_000 // block_bytes(hf.model.config, 16, torch.float32)) * block_bytes(
        hf.model.config, 16, torch.float32) and 0 < held <= 300_000
    for s in theirs.served:  # its times are the wall clock's, from the replay's start
        assert s.request.arrival_s <= s.first_token_s <= s.finish_s and len(s.times) == s.request.output_tokens
    rec = S.summary(theirs, 1000, 100)
    assert rec["server_kv_token_share"] is None and rec["server_kv_used_peak"] is None  # not observable
    assert rec["server_peak_running"] >= 1

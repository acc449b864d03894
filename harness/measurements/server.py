"""Server: continuous batching under a KV budget (``harness.core.server``): a seeded stream of chat-like requests
served first come, first served; throughput, latency percentiles, goodput, concurrency, memory, pre-emptions; every
request checked against its own run alone."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass

from harness.common.errors import ConfigError
from harness.measurements.base import Measurement, Table, key, option, register


@dataclass
class ServeOptions:
    """``serve.*``: the workload and the server (``python run.py experiment=serving serve.rate=8``)."""

    requests: int = 0  # requests served; 0: not measured
    rate: float = 4.0  # Poisson arrivals, requests/s; inf: all at once
    kv_budget: str = "16MB"  # bytes the K/V may take (an integer, or a size: 512KB, 16MB, 1GiB)
    prefix_caching: bool = False  # share the blocks of a common prefix (cache=paged)
    max_batch: int = 32  # requests running at once, at most
    max_tokens: int = 128  # tokens a request may generate (what a reserving kind reserves for); outputs stop sooner
    prompt_median: int = 64  # prompt tokens: log-normal around this median ...
    prompt_most: int = 256  # ... clipped to [1, this]
    output_median: int = 32  # output tokens: log-normal around this median, clipped to [1, max_tokens]
    sigma: float = 0.8  # the spread of the lengths' logarithms
    system_prompt: int = 0  # tokens of a system prompt every request starts with (the text's first)
    slo_ttft_ms: float = 2000.0  # goodput counts a request that met both bounds
    slo_tpot_ms: float = 200.0
    peer: str = ""  # hf: a run of cache=paged also serves the same requests through transformers' continuous batching
    # (refused beside any other kind); auto: so does each paged run of a sweep over kinds, the others run no peer
    trace: str = ""  # a CSV of requests instead of the drawn workload: arrival_s, output_tokens, and prompt_tokens
    # (its text drawn from the run's, seeded) or prompt_ids (space-separated token ids)


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def budget_bytes(value) -> int:
    """serve.kv_budget as bytes: an integer, or a number and a unit (B, KB, MB, GB, KiB, MiB, GiB)."""
    text = str(value).strip().replace("_", "")
    number = text.rstrip("BbKkMmGgIi ")
    unit = text[len(number):].strip().upper()
    try:
        n = float(number) * UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"serve.kv_budget={value!r}: give bytes as an integer or a size such as 512KB, 16MB or "
                         "1GiB") from None
    if not math.isfinite(n) or n < 1:
        raise ValueError(f"serve.kv_budget={value!r}: give a positive size, e.g. 16MB")
    return int(n)


def serve_options(value) -> ServeOptions:
    """The ``serve`` node (a dict from the config, or ServeOptions) as ServeOptions; unknown names refused."""
    if isinstance(value, ServeOptions):
        return value
    names = {f.name for f in dataclasses.fields(ServeOptions)}
    unknown = sorted(set(value or {}) - names)
    if unknown:
        raise ValueError(f"serve has no option {unknown[0]!r}: its options are {', '.join(sorted(names))}")
    return ServeOptions(**dict(value or {}))


SIGMA_MAX = 4.0  # the lengths' log spread: e^(4 x 3) already spans five orders of magnitude
SPAN_MAX_S = 1_000_000.0  # a workload's arrivals lie within this of its first (11.6 days; kvlab's server skips gaps)
PEER_SPAN_MAX_S = 3_600.0  # serve.peer=hf replays arrivals on the wall clock: at most an hour of them
PEERS = ("", "hf", "auto")  # hf: beside a paged run (refused beside another kind); auto: beside paged runs alone
DRAWN_ONLY = ("rate", "prompt_median", "prompt_most", "output_median", "sigma")  # what a trace gives instead


def seconds(x: float) -> str:
    """A span of seconds in a line: grouped digits, or a power of ten where they would run on (1e+300)."""
    return f"{x:,.0f}" if x < 1e12 else f"{x:.3g}"


def serving(s: ServeOptions) -> bool:
    """Whether a run serves requests: serve.requests > 0, or a trace (all its rows, or its first serve.requests)."""
    return bool(s.requests or s.trace)


def peer_runs(s: ServeOptions, cls) -> bool:
    """Whether serve.peer serves the run's requests through transformers too: beside the pooled kind (paged), whose
    counterpart it is (serve.peer=hf on another kind is refused by the plan; auto runs it where it applies)."""
    return s.peer in ("hf", "auto") and cls.pooled


def _check_types(s: ServeOptions) -> None:
    """Each setting of the right type: counts whole numbers, the rest numbers (no NaN); one line each."""
    for name in ("max_batch", "max_tokens", "prompt_median", "prompt_most", "output_median"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"serve.{name}={v!r}: give an integer >= 1")
    for name in ("rate", "sigma", "slo_ttft_ms", "slo_tpot_ms"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise ValueError(f"serve.{name}={v!r}: give a number")
    if isinstance(s.system_prompt, bool) or not isinstance(s.system_prompt, int):
        raise ValueError(f"serve.system_prompt={s.system_prompt!r}: give an integer >= 0 (tokens)")


def check_serve(s: ServeOptions, max_len: int) -> None:
    """Refuse, in one line, a workload or server that cannot run, or a setting that would do nothing (before
    anything is built)."""
    if isinstance(s.requests, bool) or not isinstance(s.requests, int) or s.requests < 0:
        raise ValueError(f"serve.requests={s.requests!r}: give an integer >= 0 (0: not measured, or a whole trace)")
    if not isinstance(s.trace, str):
        raise ValueError(f"serve.trace={s.trace!r}: give the path of a CSV file, or leave it empty")
    if not serving(s):  # not measured: the rest is the workload's, checked when it is asked for
        return
    _check_types(s)
    if s.requests > 100_000:
        raise ValueError(f"serve.requests={s.requests:,} is over kvlab's cap of 100,000 per run")
    if not s.rate > 0:
        raise ValueError(f"serve.rate={s.rate}: give requests per second > 0 (inf: all at once)")
    if s.peer not in PEERS:
        raise ValueError(f"serve.peer={s.peer!r}: give hf (transformers' continuous batching beside a cache=paged "
                         "run), auto (beside the paged runs of a sweep over kinds, none beside the others) or leave it "
                         "empty")
    if s.system_prompt < 0:
        raise ValueError(f"serve.system_prompt={s.system_prompt}: give an integer >= 0 (tokens)")
    if not 0 <= s.sigma <= SIGMA_MAX:
        raise ValueError(f"serve.sigma={s.sigma}: give the spread of the lengths' logarithms, 0 .. {SIGMA_MAX:g} (0.8 "
                         "by default; 0: every length its median)")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        if not getattr(s, name) > 0:
            raise ValueError(f"serve.{name}={getattr(s, name)}: give a bound in milliseconds > 0 (inf: no bound)")
    if s.trace:
        default = ServeOptions()
        ignored = [n for n in DRAWN_ONLY if getattr(s, n) != getattr(default, n)]
        if ignored:
            defaults = ", ".join(f"serve.{n}={getattr(default, n)}" for n in ignored)
            raise ValueError(f"serve.{ignored[0]}={getattr(s, ignored[0])} does nothing under serve.trace (the trace "
                             f"gives every request's arrival and lengths; a preset that sweeps it, such as "
                             f"experiment=serving's rates, serves no trace): leave "
                             f"{'it at its default' if len(ignored) == 1 else 'them at their defaults'} ({defaults}), "
                             "or leave serve.trace empty")
    else:
        span = 0.0 if math.isinf(s.rate) else s.requests / s.rate
        if span > SPAN_MAX_S:
            raise ValueError(f"serve.rate={s.rate:g}: {s.requests:,} requests at that rate arrive over about "
                             f"{seconds(span)} s, beyond kvlab's {SPAN_MAX_S:,.0f} s: give serve.rate >= "
                             f"{s.requests / SPAN_MAX_S:g}")
        if s.peer == "hf" and span > PEER_SPAN_MAX_S:  # auto: where it runs (the plan's check_server)
            raise ValueError(f"serve.peer={s.peer} replays arrivals on the wall clock, and {s.requests:,} requests at "
                             f"serve.rate={s.rate:g} arrive over about {seconds(span)} s: give serve.rate >= "
                             f"{s.requests / PEER_SPAN_MAX_S:g} (at most {PEER_SPAN_MAX_S:,.0f} s of arrivals), or "
                             "leave serve.peer empty")
        longest = s.system_prompt + s.prompt_most + s.max_tokens + 1  # and a model's fixed first token
        if longest > max_len:
            raise ValueError(f"serve.system_prompt + serve.prompt_most + serve.max_tokens + 1 (a first token) = "
                             f"{longest} is more than max_len={max_len}: lower them")
    budget_bytes(s.kv_budget)


@register
class Server(Measurement):
    name = "server"
    about = ("continuous batching of serve.requests chat-like requests under serve.kv_budget: throughput, TTFT, "
             "TPOT, ITL, goodput, concurrency, KV held vs used, pre-emptions, each request checked")
    stage = "continuous batching"
    later = ("serve",)

    @classmethod
    def idle(cls, opts, asked):
        o = serve_options(opts.serve)
        if not serving(o):
            return None
        given = f"serve.trace={o.trace}" if o.trace else f"serve.requests={o.requests}"
        return (f"{given} serves requests, but {asked} leaves out server: add server to measurements, or leave "
                "serve.requests at 0 and serve.trace empty")

    @classmethod
    def check_plan(cls, opts, s):
        """A run that serves requests: a kind that cannot serve, a peer that would not run the same workload, or a
        K/V budget too small for its longest possible request, is refused in one line before anything is built."""
        o = serve_options(opts.serve)
        if serving(o):
            check_served(o, s)

    @classmethod
    def inputs(cls, opts, src, s):
        """The running text its workload draws prompts from (``harness.core.inputs.served_stream``)."""
        from harness.core.inputs import served_stream

        o = serve_options(opts.serve)
        if not serving(o):
            return {}
        return dict(stream=served_stream(src.path, o.system_prompt + o.prompt_most + 1, src.tokenizer, src.vocab_size,
                                         src.seed))

    @classmethod
    def files(cls, opts):
        o = serve_options(opts.serve)
        return [o.trace] if serving(o) and o.trace else []

    @classmethod
    def memory(cls, s, opts):
        """Its K/V budget held whole (twice beside the peer), beside a prefill of the longest request, a step of
        the largest running batch (each layer's K/V of the batch gathered in the compute dtype) and the check of a
        request alone."""
        from models.kv_cache.base import itemsize

        o = serve_options(opts.serve)
        if not serving(o):
            return []
        # the longest request: the drawn workload's, or under a trace (rows checked against max_len) the longest a
        # run can hold
        P = s.max_len if o.trace else o.system_prompt + o.prompt_most + o.max_tokens + 1
        budget, B = budget_bytes(o.kv_budget), o.max_batch
        gathered = 2 * budget * itemsize(s.compute) // (itemsize(s.storage) * max(s.model.n_layer, 1))
        transient = (max(s.forward(1, P, 1), s.forward(B, 1, 1) + gathered)
                     + s.cache_at(1, P, cap=P) + s.layer_kv(1, P))
        return [("serve_continuous", budget * (2 if peer_runs(o, s.cls) else 1), transient)]

    @dataclass(frozen=True)
    class Options:
        serve: ServeOptions = option(ServeOptions(), "the server and its workload (serve.requests > 0 measures; "
                                                     "harness.measurements.server.ServeOptions)")

    @dataclass(frozen=True)
    class Result:
        server_kv_budget: int = key("the K/V budget the server ran under", "B")
        server_prefix_caching: bool = key("whether whole prompt blocks were shared across requests (serve."
                                          "prefix_caching)")
        server_system_prompt: int = key("tokens of the system prompt every request started with", "tokens")
        server_rate: float | None = key("the requests' arrival rate: serve.rate for a drawn workload, measured from "
                                        "the arrivals for a trace (null: all at once)", "requests/s")
        server_rate_measured: float | None = key("the arrivals' mean rate, measured: requests - 1 over first to last "
                                                 "arrival (null: all at once)", "requests/s")
        server_workload: str = key("the whole workload in words: the trace (file, sha256, requests) or the drawn "
                                   "distribution and its parameters, the system prompt, max_batch, max_tokens and "
                                   "the SLO bounds")
        server_workload_id: str = key("a hash of server_workload: the report pairs runs only on equal workloads")
        server_trace: str | None = key("serve.trace, the CSV the requests came from (null: drawn)")
        server_trace_sha256: str | None = key("the sha256 of serve.trace's bytes (null: drawn)")
        server_prompt_median: int | None = key("serve.prompt_median of the drawn lengths (null under a trace)",
                                               "tokens")
        server_prompt_most: int | None = key("serve.prompt_most (null under a trace)", "tokens")
        server_output_median: int | None = key("serve.output_median (null under a trace)", "tokens")
        server_sigma: float | None = key("serve.sigma, the spread of the lengths' logarithms (null under a trace)")
        server_max_batch: int = key("serve.max_batch: requests running at once, at most", "requests")
        server_max_tokens: int = key("serve.max_tokens: tokens a request may generate", "tokens")
        server_slo_ttft_ms: float = key("serve.slo_ttft_ms, the goodput's bound on time to first token", "ms")
        server_slo_tpot_ms: float = key("serve.slo_tpot_ms, the goodput's bound on time per output token", "ms")
        server_requests: int = key("requests served", "requests")
        server_duration_s: float = key("first arrival to last token", "s")
        server_busy_s: float = key("of it, time spent computing (prefills and steps)", "s")
        server_requests_per_s: float = key("requests finished per second", "requests/s", shown="report")
        server_output_tokens_per_s: float = key("tokens generated per second", "tokens/s", shown="report")
        server_goodput: float = key("requests per second that met both SLO bounds", "requests/s")
        server_slo_met: float = key("the share of requests within serve.slo_ttft_ms and serve.slo_tpot_ms",
                                    "fraction")
        server_preemptions: int = key("pre-emptions (recompute)", "")
        server_peak_running: int = key("most requests running at once", "requests", shown="report")
        server_mean_running: float = key("requests running, on average over time", "requests")
        server_kv_used_peak: int | None = key("most K/V bytes that held tokens", "B")
        server_kv_held_peak: int = key("most K/V bytes the server held (reserved, grown or pool blocks taken)", "B")
        server_kv_token_share: float | None = key("K/V bytes holding tokens over bytes held, over time", "fraction",
                                                  shown="report")
        server_cached_tokens: int = key("prompt tokens found in the prefix cache (not computed again)", "tokens")
        server_prefilled_tokens: int = key("tokens the prefills computed, re-admissions included", "tokens")
        server_ttft_ms_mean: float = key("time to first token, mean", "ms")
        server_ttft_ms_median: float = key("time to first token, median", "ms")
        server_ttft_ms_p90: float = key("time to first token, 90th percentile", "ms")
        server_ttft_ms_p99: float = key("time to first token, 99th percentile", "ms", shown="report")
        server_tpot_ms_mean: float | None = key("time per output token after the first, mean", "ms")
        server_tpot_ms_median: float | None = key("time per output token, median", "ms")
        server_tpot_ms_p90: float | None = key("time per output token, 90th percentile", "ms")
        server_tpot_ms_p99: float | None = key("time per output token, 99th percentile", "ms")
        server_itl_ms_mean: float | None = key("inter-token latency, mean", "ms")
        server_itl_ms_median: float | None = key("inter-token latency, median", "ms")
        server_itl_ms_p90: float | None = key("inter-token latency, 90th percentile", "ms")
        server_itl_ms_p99: float | None = key("inter-token latency, 99th percentile", "ms")
        server_e2e_ms_mean: float = key("arrival to last token, mean", "ms")
        server_e2e_ms_median: float = key("arrival to last token, median", "ms")
        server_e2e_ms_p90: float = key("arrival to last token, 90th percentile", "ms")
        server_e2e_ms_p99: float = key("arrival to last token, 99th percentile", "ms", shown="report")
        server_normalized_latency_ms: float = key("mean over requests of arrival-to-last-token latency over its "
                                                  "output tokens (vLLM's normalized latency)", "ms/token",
                                                  shown="report")
        server_requests_identical: int = key("requests whose tokens equal their own run alone (same kind)",
                                             "requests")
        server_hf_output_tokens_per_s: float | None = key("the peer (serve.peer=hf: transformers' continuous "
                                                          "batching, same requests and budget): tokens/s; null: "
                                                          "not run", "tokens/s")
        server_hf_requests_per_s: float | None = key("the peer: requests finished per second", "requests/s")
        server_hf_ttft_ms_p99: float | None = key("the peer: time to first token, 99th percentile", "ms")
        server_hf_e2e_ms_p99: float | None = key("the peer: arrival to last token, 99th percentile", "ms")
        server_hf_normalized_latency_ms: float | None = key("the peer: normalized latency", "ms/token")
        server_hf_peak_running: int | None = key("the peer: most requests between first and last token at once",
                                                 "requests")
        server_hf_kv_held: int | None = key("the peer: bytes of its block pool (allocated whole)", "B")
        server_hf_requests_identical: int | None = key("the peer: requests whose tokens equal kvlab's", "requests")
        server_hf_resets: int | None = key("the peer: requests it pre-empted (their times before it are unknown, "
                                           "so they count in no TTFT and in no SLO)", "requests")
        server_hf_error: str | None = key("the peer: why it failed (null: it ran, or was not asked); kvlab's own "
                                          "figures are kept either way")

    tables = (
        Table("requests", "requests.csv", on=("request_id",),
              columns=("request_id", "arrival_s", "admitted_s", "first_token_s", "finish_s", "prompt_tokens",
                       "output_tokens", "preemptions", "cached_tokens", "prefilled_tokens", "ttft_ms", "tpot_ms",
                       "e2e_ms", "identical"),
              meaning="one row per served request"),
        Table("tokens", "tokens.csv", on=("request_id", "index"), columns=("request_id", "index", "time_s", "itl_ms"),
              meaning="one row per generated token: when, and the gap since the request's previous token"),
        Table("timeline", "timeline.csv", on=("step",),
              columns=("step", "time_s", "running", "waiting", "arrived", "kv_used_bytes", "kv_held_bytes"),
              meaning="the server after every iteration: requests running and waiting, K/V bytes used and held"))

    @classmethod
    def check(cls, opts, max_len):
        from harness.common.errors import ConfigError

        try:
            check_serve(serve_options(opts.serve), max_len)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def skip(self):
        s = serve_options(self.opts.serve)
        if not serving(s):
            return "serve.requests is 0 and there is no serve.trace (e.g. experiment=serving, or serve.requests=64)"
        if getattr(self.ctx.engine, "name", "") != "kvlab":
            return f"engine={self.ctx.engine.name} has no continuous batching here: kvlab's server runs engine=kvlab"
        return None

    def run(self):
        import pandas as pd
        from tqdm.auto import tqdm

        from harness.core import server as S

        ctx, s = self.ctx, serve_options(self.opts.serve)
        memory = S.memory_for(ctx.engine, ctx.spec, budget_bytes(s.kv_budget), s.max_tokens, ctx.max_len,
                              prefix_caching=s.prefix_caching)
        requests = workload(s, ctx.stream, ctx.first_token, ctx.seed, ctx.spec.cls.min_prompt(ctx.spec.opts),
                            ctx.max_len)
        S.check_budget(memory, requests)
        bar = tqdm(total=len(requests), desc="serving", unit="request", leave=False, disable=not ctx.progress)
        with bar:
            log = S.Server(ctx.engine, memory, s.max_batch, ctx.device, progress=bar).run(requests)
        same = S.alone(ctx.engine, ctx.spec, log.served, ctx.device)
        rec = S.summary(log, s.slo_ttft_ms, s.slo_tpot_ms)
        rows = pd.DataFrame(S.request_rows(log.served))
        rows["identical"] = same
        timeline = pd.DataFrame([dict(step=i, **t) for i, t in enumerate(log.timeline)])
        peer = dict.fromkeys(k for k in self.keys() if k.startswith("server_hf_"))  # null: the peer did not run
        if peer_runs(s, ctx.spec.cls):
            try:
                peer.update(self.peer(s, requests, log, memory.budget))
            except Exception as e:  # the peer's failure is its own: kvlab's figures stand, the record says why
                peer["server_hf_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
                print(f"kvlab: serve.peer=hf failed ({peer['server_hf_error']}); kvlab's own serving results are "
                      "kept", file=sys.stderr, flush=True)
        result = self.Result(server_kv_budget=memory.budget, server_prefix_caching=bool(s.prefix_caching),
                             server_system_prompt=s.system_prompt, server_requests_identical=int(sum(same)),
                             **workload_record(s, requests), **rec, **peer)
        return result, {"requests": rows, "tokens": pd.DataFrame(S.token_rows(log.served)), "timeline": timeline}

    def peer(self, s: ServeOptions, requests, log, budget: int) -> dict:
        """The same requests through transformers' continuous batching on the same weights, pages of the run's
        block size, the same budget: its figures as server_hf_* keys."""
        from harness.core import server as S
        from harness.core.engines import HFEngine
        from harness.core.hf_server import serve_hf

        hf = HFEngine(self.ctx.engine.model)
        longest = max(len(r.prompt) for r in requests)
        theirs = serve_hf(hf, requests, budget, page_size=self.ctx.spec.opts.block_size,
                          max_batch_tokens=longest + s.max_batch, prefix_caching=s.prefix_caching)
        rec = S.summary(theirs, s.slo_ttft_ms, s.slo_tpot_ms)
        same = sum(a.tokens == b.tokens for a, b in zip(theirs.served, log.served))
        return dict(server_hf_output_tokens_per_s=rec["server_output_tokens_per_s"],
                    server_hf_requests_per_s=rec["server_requests_per_s"],
                    server_hf_ttft_ms_p99=rec["server_ttft_ms_p99"], server_hf_e2e_ms_p99=rec["server_e2e_ms_p99"],
                    server_hf_normalized_latency_ms=rec["server_normalized_latency_ms"],
                    server_hf_peak_running=rec["server_peak_running"],
                    server_hf_kv_held=theirs.timeline[0]["kv_held_bytes"], server_hf_requests_identical=int(same),
                    server_hf_resets=sum(s.preemptions for s in theirs.served))

    @classmethod
    def not_equivalent(cls, r, tol):
        n, same = r.get("server_requests"), r.get("server_requests_identical")
        if n is None or same is None or same == n:
            return []
        return [f"{n - same} of {n} served requests differ from their own run alone"]

    @classmethod
    def summary(cls, r, tables):
        if r.get("server_requests") is None:
            return []
        rate = "all at once" if r["server_rate"] is None else f"{r['server_rate']:g}/s"
        if r.get("server_trace"):
            rate = f"trace {os.path.basename(r['server_trace'])}, {rate}" + (" measured" if r["server_rate"] else "")
        peer = ([] if not r.get("server_hf_error") else
                [f"  server peer       serve.peer=hf failed: {r['server_hf_error']}"])
        return [f"  server            {r['server_requests']} requests ({rate}) under {r['server_kv_budget']:,} B: "
                f"{r['server_output_tokens_per_s']:,.0f} tokens/s, {r['server_requests_per_s']:.2f} requests/s · "
                f"TTFT p50/p99 {r['server_ttft_ms_median']:,.0f}/{r['server_ttft_ms_p99']:,.0f} ms · up to "
                f"{r['server_peak_running']} running · {r['server_preemptions']} pre-emptions · K/V holding tokens "
                f"{_share(r['server_kv_token_share'])} · each = its run alone: {r['server_requests_identical']} of "
                f"{r['server_requests']}"] + peer


def check_served(o: ServeOptions, s) -> None:
    """``Server.check_plan`` for a run that serves (``s``: its ``harness.core.sizes.Shape``)."""
    from harness.core.server import least_budget, refuses_serving
    from models.kv_cache import DTYPES, as_dtype

    cls, opts, kind = s.cls, s.opts, s.kind
    why = refuses_serving(cls, opts, o.prefix_caching)
    if why:
        raise ConfigError(why)
    if o.peer == "hf" and not cls.pooled:
        raise ConfigError(f"serve.peer=hf serves the same requests through transformers' paged continuous batching, "
                          f"the counterpart of cache=paged, not of cache={kind}: use cache=paged, serve.peer=auto in "
                          "a sweep over kinds (the peer beside its paged runs alone), or leave serve.peer empty")
    storage, compute = as_dtype(s.storage), as_dtype(s.compute)
    if peer_runs(o, cls) and storage != compute:
        name = {d: n for n, d in reversed(list(DTYPES.items()))}  # fp32, fp16, bf16 (the short names)
        raise ConfigError(f"serve.peer={o.peer}: transformers' paged cache stores K/V in its model's dtype, the "
                          f"compute dtype ({name[compute]}), and this run stores {name[storage]}: set dtype.compute="
                          f"{name[storage]} too (both engines then store and compute {name[storage]}), or leave "
                          "serve.peer empty")
    span = 0.0 if o.trace or math.isinf(o.rate) else o.requests / o.rate
    if peer_runs(o, cls) and span > PEER_SPAN_MAX_S:
        raise ConfigError(f"serve.peer={o.peer} replays arrivals on the wall clock, and {o.requests:,} requests at "
                          f"serve.rate={o.rate:g} arrive over about {seconds(span)} s: give serve.rate >= "
                          f"{o.requests / PEER_SPAN_MAX_S:g} (at most {PEER_SPAN_MAX_S:,.0f} s of arrivals), or leave "
                          "serve.peer empty")
    if not o.trace and o.system_prompt + o.prompt_most + 1 < cls.min_prompt(opts):
        raise ConfigError(f"cache={kind} takes prompts of at least {cls.min_prompt(opts)} tokens, and the "
                          f"server's are at most {o.system_prompt + o.prompt_most + 1}: raise serve.prompt_most")
    longest = _checked_trace(o, s) if o.trace else o.prompt_most
    n = min(o.system_prompt + longest + o.max_tokens + 1, s.max_len)
    need = least_budget(cls, opts, s.model.n_layer, s.model.n_kv_head, s.model.head_dim, storage, n)
    if budget_bytes(o.kv_budget) < need:
        raise ConfigError(f"serve.kv_budget={o.kv_budget} is too small for one request: the longest (serve."
                          f"system_prompt + the longest prompt + serve.max_tokens + a first token = {n} tokens) holds "
                          f"up to {need:,} B with cache={kind}; give serve.kv_budget >= {need:,}")


def _checked_trace(o: ServeOptions, s) -> int:
    """serve.trace's rows, read and checked before anything is built (a bad trace, a prompt shorter than the kind
    takes, arrivals longer than the peer replays: one line) -> its longest prompt."""
    try:
        rows = read_trace(o.trace, s.max_len - o.system_prompt - 1, o.max_tokens, s.model.vocab_size, o.requests)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    least = s.cls.min_prompt(s.opts)
    short = [i + 1 for i, (_, p, _) in enumerate(rows) if isinstance(p, tuple) and len(p) + o.system_prompt + 1 < least]
    if short:
        raise ConfigError(f"serve.trace={o.trace} row {short[0]}: cache={s.kind} takes prompts of at least {least} "
                          "tokens; give longer prompt_ids")
    if peer_runs(o, s.cls) and trace_span(rows) > PEER_SPAN_MAX_S:
        raise ConfigError(f"serve.peer={o.peer} replays arrivals on the wall clock, and serve.trace={o.trace} spans "
                          f"{seconds(trace_span(rows))} s: give a trace of at most {PEER_SPAN_MAX_S:,.0f} s of "
                          "arrivals, or leave serve.peer empty")
    return max(len(p) if isinstance(p, tuple) else p for _, p, _ in rows)


def _share(x) -> str:
    return "—" if x is None else f"{x:.1%}"


TRACE_MAX_BYTES = 64 * 2**20  # a trace file read at most this large


def workload_record(s: ServeOptions, requests) -> dict:
    """The record's words for the whole workload a run served, and its id (the report pairs runs on equal ids)."""
    import hashlib

    arrivals = [r.arrival_s for r in requests]
    measured = arrival_rate(arrivals)
    drawn = dict(server_prompt_median=s.prompt_median, server_prompt_most=s.prompt_most,
                 server_output_median=s.output_median, server_sigma=float(s.sigma))
    if s.trace:
        sha = trace_sha256(s.trace)
        what = (f"trace {os.path.basename(s.trace)} (sha256 {sha[:16]}): "
                f"{'its first ' if s.requests else ''}{len(requests)} requests")
        rate, drawn = measured, dict.fromkeys(drawn)
    else:
        sha, rate = None, None if math.isinf(s.rate) else float(s.rate)
        what = (f"drawn: {s.requests} requests, "
                + ("all at once" if rate is None else f"Poisson arrivals at {s.rate:g}/s")
                + f", prompts log-normal (median {s.prompt_median}, sigma {s.sigma:g}, at most {s.prompt_most}), "
                  f"outputs log-normal (median {s.output_median}, sigma {s.sigma:g}, at most {s.max_tokens})")
    what += (f"; system prompt {s.system_prompt} tokens; max_batch {s.max_batch}, max_tokens {s.max_tokens}; SLO "
             f"TTFT {s.slo_ttft_ms:g} ms, TPOT {s.slo_tpot_ms:g} ms")
    return dict(server_rate=rate, server_rate_measured=measured, server_workload=what,
                server_workload_id=hashlib.sha256(what.encode()).hexdigest()[:12],
                server_trace=os.path.abspath(s.trace) if s.trace else None,
                server_trace_sha256=sha, server_max_batch=s.max_batch, server_max_tokens=s.max_tokens,
                server_slo_ttft_ms=float(s.slo_ttft_ms), server_slo_tpot_ms=float(s.slo_tpot_ms), **drawn)


def trace_sha256(path: str) -> str:
    """The sha256 of a trace file's bytes (read_trace has bounded its size)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2 ** 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_trace(path: str, max_len: int, max_tokens: int, vocab: int | None = None, first: int = 0) -> list[tuple]:
    """serve.trace's requests as (arrival_s, prompt: int count or tuple of ids, output_tokens), checked, arrivals
    counted from the trace's first (a trace in Unix time works as one from 0); ``first`` > 0: the first that many
    requests by arrival (serve.requests). Refused in one line (ValueError) for a missing, oversized or irregular
    file, a missing column, a value out of range, a row that gives its prompt twice, or arrivals spread over more
    than SPAN_MAX_S."""
    df = _trace_frame(path)
    if first > len(df):
        raise ValueError(f"serve.requests={first:,} but serve.trace={path} has {len(df):,} requests: give serve."
                         f"requests <= {len(df):,} (its first ones by arrival), or 0 for all of them")
    out = [_trace_row(path, i, row, max_len, max_tokens, vocab) for i, row in enumerate(df.itertuples(index=False))]
    start, end = min(a for a, _, _ in out), max(a for a, _, _ in out)
    if end - start > SPAN_MAX_S:
        raise ValueError(f"serve.trace={path}: its arrivals span {seconds(end - start)} s, beyond kvlab's "
                         f"{SPAN_MAX_S:,.0f} s: give a trace whose requests arrive within that of its first")
    out = [(a - start, p, o) for a, p, o in out]
    if first:  # the first requests by arrival (ties in the file's order), in the file's order
        keep = set(sorted(range(len(out)), key=lambda i: (out[i][0], i))[:first])
        out = [r for i, r in enumerate(out) if i in keep]
    return out


def _trace_frame(path: str):
    """A trace's rows as read from a regular CSV file of at most TRACE_MAX_BYTES (its size checked before it is
    opened), with its columns; one line (ValueError) otherwise."""
    import pandas as pd

    from models.hf_checkpoint import CheckpointError, regular_file

    try:
        st = regular_file(path, missing=f"{path}: no such file", what="a trace")
    except CheckpointError as e:  # a folder, FIFO, device or dangling link: never opened
        raise ValueError(f"serve.trace={e}; give a CSV with arrival_s, output_tokens and prompt_tokens or "
                         "prompt_ids") from None
    if st.st_size > TRACE_MAX_BYTES:
        raise ValueError(f"serve.trace={path} is {st.st_size:,} bytes, over kvlab's {TRACE_MAX_BYTES:,}: give a "
                         "shorter trace")
    try:
        df = pd.read_csv(path, dtype={"prompt_ids": str})
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise ValueError(f"serve.trace={path}: not a CSV kvlab can read ({type(e).__name__})") from None
    given = [c for c in ("prompt_tokens", "prompt_ids") if c in df]
    missing = [c for c in ("arrival_s", "output_tokens") if c not in df] + ([] if given else ["prompt_tokens"])
    if missing or df.empty or len(df) > 100_000:
        raise ValueError(f"serve.trace={path}: needs columns arrival_s, output_tokens and prompt_tokens (or "
                         f"prompt_ids), 1 to 100,000 rows; {'missing ' + ', '.join(missing) if missing else 'rows'}")
    return df


def _trace_row(path: str, i: int, row, max_len: int, max_tokens: int, vocab: int | None) -> tuple:
    """Row ``i`` of a trace as (arrival_s, prompt, output_tokens): its prompt given once, as ids or as a count;
    whole numbers; within max_len, serve.max_tokens and the vocabulary. One line (ValueError) otherwise."""
    import pandas as pd

    ids = getattr(row, "prompt_ids", None)
    count = getattr(row, "prompt_tokens", None)
    has_ids = isinstance(ids, str) and bool(ids.strip())
    if has_ids and count is not None and not pd.isna(count):
        raise ValueError(f"serve.trace={path} row {i + 1} gives both prompt_tokens and prompt_ids: give one of "
                         "them in each row (the ids, or a count of the run's text)")
    try:  # a row gives its prompt's ids, or how many tokens it has; whole numbers only
        prompt = tuple(int(t) for t in ids.split()) if has_ids else _whole(count)
        arrival, out_n = float(row.arrival_s), _whole(row.output_tokens)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"serve.trace={path} row {i + 1}: give arrival_s (seconds), output_tokens (a whole "
                         "number) and prompt_tokens (a whole number) or prompt_ids (space-separated token "
                         "ids)") from None
    n = len(prompt) if isinstance(prompt, tuple) else prompt
    bad_ids = isinstance(prompt, tuple) and vocab is not None and any(not 0 <= t < vocab for t in prompt)
    if not (math.isfinite(arrival) and arrival >= 0) or not 1 <= out_n <= max_tokens or n < 1 or bad_ids \
            or n + out_n + 1 > max_len:
        raise ValueError(f"serve.trace={path} row {i + 1}: arrival_s >= 0, 1 <= output_tokens <= serve."
                         f"max_tokens ({max_tokens}), a prompt of at least 1 token (ids below {vocab}), and prompt "
                         f"+ output + 1 <= max_len ({max_len}); got arrival {arrival}, {n} prompt tokens, "
                         f"{out_n} output")
    return arrival, prompt, out_n


def trace_span(rows: list[tuple]) -> float:
    """Seconds from a trace's first arrival to its last."""
    return max(a for a, _, _ in rows) - min(a for a, _, _ in rows)


def arrival_rate(arrivals: list[float]) -> float | None:
    """The mean rate of arrivals, requests/s: (n - 1) over first to last (null: all at once, or one request)."""
    span = max(arrivals) - min(arrivals)
    return (len(arrivals) - 1) / span if len(arrivals) > 1 and span > 0 else None


def _whole(x) -> int:
    """A whole number from a CSV cell (2 or 2.0), else ValueError (2.7, empty, text)."""
    v = float(x)
    if not math.isfinite(v) or v != int(v):
        raise ValueError(x)
    return int(v)


def traced(rows: list[tuple], stream: list[int], seed: int, lead: list[int], least: int = 1):
    """Requests from a trace's rows; a prompt given as a count takes that many tokens of the text at a seeded place."""
    import torch

    from harness.core.server import Request

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (arrival, prompt, n_out) in enumerate(rows):
        if isinstance(prompt, int):
            n = max(prompt, least)
            if n > len(stream):
                raise ValueError(f"serve.trace row {i + 1} asks for {n:,} prompt tokens; the run's text has "
                                 f"{len(stream):,}")
            start = int(torch.randint(0, len(stream) - n + 1, (1,), generator=g))
            prompt = tuple(stream[start:start + n])
        out.append(Request(i, arrival, tuple(lead) + tuple(prompt), n_out))
    return out


def workload(s: ServeOptions, stream: list[int] | None, first_token: int | None, seed: int, least: int = 1,
             max_len: int | None = None):
    """The run's requests: the seeded workload over the text stream (the system prompt its first tokens; a model
    trained with a first token sees it before everything); every prompt at least ``least`` tokens in all (what the
    kind takes: a SnapKV window)."""
    from harness.core import server as S

    if not stream:
        raise ValueError("the server's workload needs text: the run read none (prompts=file)")
    system = stream[:s.system_prompt]
    text = stream[s.system_prompt:]
    lead = [] if first_token is None else [first_token]
    if s.trace:
        rows = read_trace(s.trace, (max_len or 10**9) - len(lead) - len(system), s.max_tokens, first=s.requests)
        return traced(rows, text, seed, lead + system, max(least - len(lead) - len(system), 1))
    w = S.Workload(requests=s.requests, rate=s.rate, prompt_median=s.prompt_median, prompt_most=s.prompt_most,
                   output_median=s.output_median, output_most=s.max_tokens, sigma=s.sigma, seed=seed,
                   prompt_least=max(least - len(lead) - len(system), 1))
    return S.make_requests(w, text, system=lead + system)

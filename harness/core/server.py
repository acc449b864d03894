"""Continuous batching under a KV memory budget: what a server's users see of a cache kind.

Requests arrive at their own times; the server admits them first come, first served, while its KV budget holds
them and the running batch has room (``max_batch``); each is prefilled alone into a one-sequence cache of its own
and then decodes with every other running request, one token each per step (iteration-level scheduling, as Orca
and vLLM do; ``models.kv_cache.batch.joined``). A request that has all its tokens leaves at once and its memory
is free for the next. What each kind pays for (``memory_for``):

- a kind that holds its slots from the start (prealloc, quant, window, the evicting kinds) reserves, on
  admission, what a sequence of prompt + ``max_tokens`` holds: the pre-paging baseline's reservation;
- a kind that grows (concat) holds exactly its tokens, and takes room as they come;
- a pooled kind (paged) takes blocks from one pool of ``kv_budget`` bytes as tokens arrive, and can share the
  blocks of a common prefix (``prefix_caching``: a prompt's whole blocks, found by their tokens, copy-on-write).

When a step would need more memory than is left, the most recently admitted request is pre-empted: its memory
goes back and it waits at the head of the queue, to be prefilled again over its prompt and the tokens it had made
(recompute, vLLM's default). Time is the server's own clock: each prefill and step advances it by the time it
took here; when nothing runs and nothing waits, it moves to the next arrival.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from models.generate import decode_step
from models.kv_cache import kv_bytes
from models.kv_cache.base import itemsize
from models.kv_cache.batch import joined, refuses_joining


@dataclass(frozen=True)
class Request:
    request_id: int
    arrival_s: float
    prompt: tuple[int, ...]
    output_tokens: int  # tokens it generates before it stops (the workload's; the server does not know it)


@dataclass
class Served:
    """One request's life on the server."""

    request: Request
    admitted_s: float | None = None  # its first admission
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each token was made
    preemptions: int = 0
    prefilled_tokens: int = 0  # tokens its prefills computed, all admissions together
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, all admissions together
    cache: object = None
    reserved: int = 0  # bytes set aside for it (a reserving kind)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.output_tokens

    @property
    def context(self) -> list[int]:
        """What a (re)admission prefills: the prompt and every token made so far."""
        return list(self.request.prompt) + self.tokens

    @property
    def length(self) -> int:
        """Tokens its cache holds (the last token made is fed by the next step)."""
        return len(self.request.prompt) + max(len(self.tokens) - 1, 0)


def least_budget(cls, opts, n_layer: int, n_kv_head: int, head_dim: int, dtype, tokens: int) -> int:
    """The bytes one request of ``tokens`` tokens (prompt and output) may come to hold with kind ``cls``: the least
    budget that serves it (a pooled kind: its blocks)."""
    if cls.pooled:
        bs = opts.block_size
        return math.ceil(tokens / bs) * 2 * n_layer * n_kv_head * bs * head_dim * itemsize(dtype)
    return cls.nbytes_formula(n_layer, n_kv_head, head_dim, tokens, 1, dtype, tokens, opts)


def refuses_serving(cls, opts, prefix_caching: bool) -> str | None:
    """Why kind ``cls`` with these options cannot serve here (None: it can)."""
    why = refuses_joining(cls, opts)
    if why:
        return why
    if prefix_caching and not cls.pooled:
        return (f"serve.prefix_caching=true shares the blocks of a common prefix, which needs a pooled kind "
                f"(cache=paged), not cache={cls.kind}")
    if cls.pooled and getattr(opts, "blocks", 0):
        return "cache.blocks is the server's to set from serve.kv_budget: leave it at 0"
    return None


class _Memory:
    """The budget's bookkeeping for one kind: who fits, what a step needs, what is held and what holds tokens."""

    def __init__(self, engine, spec, budget: int, max_tokens: int, max_len: int, probe):
        self.engine, self.spec, self.budget = engine, spec, budget
        self.max_tokens, self.max_len = max_tokens, max_len
        self.cls, self.opts = spec.cls, spec.opts
        self.geometry = (probe.n_layer, probe.n_kv_head, probe.head_dim)
        self.dtype = probe.dtype

    def formula(self, max_len: int, n: int) -> int:
        return self.cls.nbytes_formula(*self.geometry, max_len, 1, self.dtype, n, self.opts)

    def cache_len(self, s: Served) -> int:
        return min(len(s.request.prompt) + self.max_tokens, self.max_len)

    def token_bytes(self, s: Served) -> int:
        """Bytes of what its cache holds that are tokens: the kind's bytes for a sequence of exactly its length."""
        n = s.length
        return self.formula(n, n) if n else 0

    def used(self, running) -> int:
        return sum(self.token_bytes(s) for s in running)

    def most(self, prompt: int) -> int:
        """What one request of ``prompt`` tokens may come to hold: the least budget that serves it alone."""
        n = min(prompt + self.max_tokens, self.max_len)
        return least_budget(self.cls, self.opts, *self.geometry, self.dtype, n)

    def after_prefill(self, s: Served) -> None:
        pass


class _Reserving(_Memory):
    """Its cache holds from the start what it holds at max_len: reserved on admission, never pre-empted."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reserved = 0

    def need(self, s: Served) -> int:
        n = self.cache_len(s)
        return self.formula(n, n)

    def fits(self, s: Served, running) -> bool:
        return self.reserved + self.need(s) <= self.budget

    def open(self, s: Served):
        s.reserved = self.need(s)
        self.reserved += s.reserved
        return self.spec.new(self.engine, self.cache_len(s))

    def room_for_step(self, running) -> bool:
        return True

    def close(self, s: Served) -> None:
        self.reserved -= s.reserved
        s.reserved, s.cache = 0, None

    def held(self, running) -> int:
        return self.reserved


class _Growing(_Memory):
    """Its cache holds exactly its tokens (concat): room is taken as they come, so a step may pre-empt."""

    def growth(self, running) -> int:
        """Bytes the running requests' next step adds."""
        return sum(self.formula(s.length + 1, s.length + 1) - self.formula(s.length, s.length) for s in running)

    def fits(self, s: Served, running) -> bool:
        n = len(s.context) + 1  # its prefill and the first step after it, beside the running requests' next step
        return self.held(running) + self.growth(running) + self.formula(n, n) <= self.budget

    def open(self, s: Served):
        return self.spec.new(self.engine, self.max_len)

    def room_for_step(self, running) -> bool:
        return self.held(running) + self.growth(running) <= self.budget

    def close(self, s: Served) -> None:
        s.cache = None

    def held(self, running) -> int:
        return sum(self.formula(s.length, s.length) for s in running)


class _Pooled(_Memory):
    """One pool of ``budget // block bytes`` blocks, taken as tokens arrive; with ``prefix_caching``, a prompt's
    whole blocks are found by their tokens and shared (the cache keeps a share of each, given up least recently
    used first when blocks run short)."""

    def __init__(self, *args, prefix_caching: bool = False):
        super().__init__(*args)
        bs = self.opts.block_size
        self.bs = bs
        self.block_bytes = 2 * self.geometry[0] * self.geometry[1] * bs * self.geometry[2] * self.dtype.itemsize
        n_blocks = max(self.budget // self.block_bytes, 1)
        self.first = self.engine.new_cache(self.spec.kind, self.max_len, 1, self.spec.dtype,
                                           **{**self.spec.options, "blocks": n_blocks})
        self.pool = self.first.pool
        self.prefix_caching = prefix_caching
        # a prompt's k-th whole block, keyed by a hash chained over its blocks: key -> (block, parent key, tokens);
        # a hit checks the block's tokens and its parent's key, so a hash collision cannot share a wrong block
        self.prefixes: dict[int, tuple[int, int, tuple]] = {}

    def blocks(self, n: int) -> int:
        return math.ceil(n / self.bs)

    def _hits(self, s: Served) -> list[int]:
        """The blocks of its context found in the prefix cache (whole blocks, leaving at least one token to
        prefill)."""
        if not self.prefix_caching:
            return []
        return [block for block, _ in self._walk(s.context, (len(s.context) - 1) // self.bs)]

    def _walk(self, tokens, n: int):
        """(block, key) of the first ``n`` whole blocks of ``tokens`` found in the prefix cache, in order."""
        parent = 0
        for k in range(n):
            piece = tuple(tokens[k * self.bs:(k + 1) * self.bs])
            key = hash((parent, piece))
            entry = self.prefixes.get(key)
            if entry is None or entry[1] != parent or entry[2] != piece:
                return
            yield entry[0], key
            parent = key

    def _spare(self, keep: set) -> int:
        """Blocks only the prefix cache holds (it can give them up), but those in ``keep``."""
        return sum(1 for b, _, _ in self.prefixes.values() if self.pool.refs[b] == 1 and b not in keep)

    def step_need(self, running) -> int:
        """Blocks the running requests' next step takes: one for each whose last block is full."""
        return sum(1 for s in running if s.length % self.bs == 0)

    def fits(self, s: Served, running) -> bool:
        """Its blocks (less those found in the prefix cache) beside the running requests' next step: admitting it
        never pre-empts an older request (vLLM admits only where the running batch's step is provided for)."""
        hits = self._hits(s)
        want = self.blocks(len(s.context) + 1) - len(hits) + self.step_need(running)
        return want <= len(self.pool.free) + self._spare(set(hits))

    def _make_room(self, want: int, keep: set = frozenset()) -> None:
        """Give up prefix-cache blocks that nothing else holds, oldest first, until ``want`` blocks are free."""
        for key in list(self.prefixes):
            if len(self.pool.free) >= want:
                return
            block = self.prefixes[key][0]
            if self.pool.refs[block] == 1 and block not in keep:
                del self.prefixes[key]
                self.pool.release([block])

    def open(self, s: Served):
        hits = self._hits(s)
        self._make_room(self.blocks(len(s.context) + 1) - len(hits), set(hits))
        cache = self.first.empty_like(1)
        if hits:
            self.pool.share(hits)
            cache.tables[0] = list(hits)
            cache.pos = len(hits) * self.bs
            for _, key in list(self._walk(s.context, len(hits))):  # used now: the least recently used go first
                self.prefixes[key] = self.prefixes.pop(key)
        return cache

    def after_prefill(self, s: Served) -> None:
        """Its prompt's whole blocks join the prefix cache (the cache holds a share of each)."""
        if not self.prefix_caching:
            return
        table, prompt, parent = s.cache.tables[0], s.request.prompt, 0
        for k in range(len(prompt) // self.bs):
            piece = tuple(prompt[k * self.bs:(k + 1) * self.bs])
            key = hash((parent, piece))
            entry = self.prefixes.get(key)
            if entry is None:
                self.prefixes[key] = (table[k], parent, piece)
                self.pool.share([table[k]])
            elif entry[1] != parent or entry[2] != piece:  # another chain under this key: keep the cached one
                return
            parent = key

    def room_for_step(self, running) -> bool:
        want = self.step_need(running)
        self._make_room(want)
        return want <= len(self.pool.free)

    def close(self, s: Served) -> None:
        if s.cache is not None:
            s.cache.reset()
        s.cache = None

    def held(self, running) -> int:
        return self.pool.used * self.block_bytes

    def used(self, running) -> int:
        # the running requests' tokens at the storage dtype (block rounding is not a token; a shared block counts
        # once); blocks only the prefix cache holds are held, not holding a running request's tokens
        shared = {}
        for s in running:
            for i, b in enumerate(s.cache.tables[0] if s.cache is not None else []):
                shared[b] = max(shared.get(b, 0), min(self.bs, s.length - i * self.bs))
        return kv_bytes(*self.geometry, sum(shared.values()), 1, self.dtype)



def memory_for(engine, spec, budget: int, max_tokens: int, max_len: int, prefix_caching: bool = False) -> _Memory:
    """The bookkeeping of ``spec``'s kind under ``budget`` bytes (refusing, in one line, a kind that cannot serve)."""
    why = refuses_serving(spec.cls, spec.opts, prefix_caching)
    if why:
        raise ValueError(why)
    probe = spec.new(engine, 1)
    args = (engine, spec, budget, max_tokens, max_len, probe)
    if spec.cls.pooled:
        return _Pooled(*args, prefix_caching=prefix_caching)
    return _Growing(*args) if spec.cls.grows else _Reserving(*args)


def check_budget(memory: _Memory, requests: list[Request]) -> None:
    """Refuse, in one line, a budget too small for the largest request alone (it could never be served)."""
    big = max(requests, key=lambda r: memory.most(len(r.prompt)))
    need = memory.most(len(big.prompt))
    if need > memory.budget:
        raise ValueError(f"serve.kv_budget={memory.budget:,} B is too small for one request: request {big.request_id} "
                         f"({len(big.prompt)} prompt tokens + up to {memory.max_tokens} new) holds up to {need:,} B "
                         f"with cache={memory.spec.kind}; give serve.kv_budget >= {need:,}")


@dataclass
class ServeLog:
    """What a served workload leaves: each request's life, and the server's state after every iteration."""

    served: list[Served]
    timeline: list[dict]
    wall_s: float  # wall time the serving took here (idle waits for arrivals skipped, not slept)


class Server:
    """The scheduler: ``run(requests)`` serves them all and returns the log."""

    def __init__(self, engine, memory: _Memory, max_batch: int, device: torch.device, progress=None):
        self.engine, self.memory, self.max_batch, self.device = engine, memory, max_batch, device
        self.progress = progress
        self.waiting: deque[Served] = deque()
        self.running: list[Served] = []
        self.timeline: list[dict] = []
        self._t0, self._skipped, self._apart = time.perf_counter(), 0.0, 0.0

    @property
    def clock(self) -> float:
        """Server time: the wall time since the run began (the scheduler's work included), plus the idle waits
        skipped to the next arrival, less what only the measurement does (its timeline)."""
        return time.perf_counter() - self._t0 + self._skipped - self._apart

    def _synced(self, fn):
        """``fn()``, its device work finished before the clock is read."""
        out = fn()
        if self.device.type == "cuda":  # the clock is read after the device is done
            torch.cuda.synchronize(self.device)
        return out

    def _emit(self, s: Served, token: int) -> None:
        now = self.clock
        s.tokens.append(token)
        s.times.append(now)
        if s.first_token_s is None:
            s.first_token_s = now
        if s.done:
            s.finish_s = now
            self.memory.close(s)
            if self.progress is not None:
                self.progress.update(1)

    def _admit(self) -> None:
        """First come, first served: the head of the queue while it fits (none behind it overtakes it)."""
        while self.waiting and len(self.running) < self.max_batch and self.memory.fits(self.waiting[0],
                                                                                        self.running):
            s = self.waiting.popleft()
            s.admitted_s = self.clock if s.admitted_s is None else s.admitted_s
            s.cache = self.memory.open(s)
            start = s.cache.pos  # a prefix found in the cache is not computed again
            ctx = torch.tensor([s.context[start:]], device=self.device)
            s.cached_tokens += start
            s.prefilled_tokens += ctx.shape[1]
            logits = self._synced(lambda: self.engine.prefill(ctx, s.cache, last_only=True))
            self.memory.after_prefill(s)
            self._emit(s, int(logits[0, -1].argmax()))
            if not s.done:
                self.running.append(s)

    def _preempt(self) -> None:
        while self.running and not self.memory.room_for_step(self.running):
            if len(self.running) == 1:
                raise RuntimeError("one request alone outgrew the KV budget (the budget check let it in): a bug")
            s = self.running.pop()  # the most recently admitted
            self.memory.close(s)
            s.preemptions += 1
            self.waiting.appendleft(s)

    def _step(self) -> None:
        self._preempt()
        run = list(self.running)
        last = torch.tensor([[s.tokens[-1]] for s in run], device=self.device)

        def step():
            with joined([s.cache for s in run]) as batch:
                return decode_step(self.engine.model, last, batch)[0][:, -1]

        logits = self._synced(step)
        for s, token in zip(run, logits.argmax(-1).tolist()):
            self._emit(s, token)
        self.running = [s for s in run if not s.done]

    def _note(self, arrived: int) -> None:
        t0, m = time.perf_counter(), self.memory
        self.timeline.append(dict(time_s=self.clock, running=len(self.running), waiting=len(self.waiting),
                                  arrived=arrived, kv_used_bytes=m.used(self.running),
                                  kv_held_bytes=m.held(self.running)))
        self._apart += time.perf_counter() - t0  # the measurement's, not the server's

    def run(self, requests: list[Request]) -> ServeLog:
        check_budget(self.memory, requests)
        pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))
        served = [Served(r) for r in pending]
        queue = deque(served)
        arrived = 0
        self._t0, self._skipped, self._apart = time.perf_counter(), 0.0, 0.0
        while queue or self.waiting or self.running:
            while queue and queue[0].request.arrival_s <= self.clock:
                self.waiting.append(queue.popleft())
                arrived += 1
            if not self.waiting and not self.running:
                self._skipped += max(queue[0].request.arrival_s - self.clock, 0.0)  # idle until the next arrival
                continue
            self._admit()
            if self.waiting and not self.running:
                raise RuntimeError(f"request {self.waiting[0].request.request_id} fits no empty server (the budget "
                                   "check let it in): a bug")
            if self.running:
                self._step()
            self._note(arrived)
        busy = time.perf_counter() - self._t0 - self._apart
        return ServeLog(sorted(served, key=lambda s: s.request.request_id), self.timeline, busy)


# ---- the workload ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """A seeded stream of chat-like requests: Poisson arrivals at ``rate`` requests/s (inf: all at once), prompt and
    output lengths log-normal around their medians (``sigma``: the spread of their logarithms), clipped to
    [1, most] (prompts to [prompt_least, most]); each prompt a window of ``text`` ids at a random place, after a ``system`` prompt shared by all."""

    requests: int = 64
    rate: float = 4.0
    prompt_median: int = 48
    prompt_most: int = 256
    output_median: int = 32
    output_most: int = 128
    sigma: float = 0.8
    seed: int = 0
    prompt_least: int = 1  # a kind that needs longer prompts (a SnapKV window) raises the floor


def _lengths(g: torch.Generator, n: int, median: int, most: int, sigma: float, least: int = 1) -> list[int]:
    z = torch.randn(n, generator=g, dtype=torch.float64)
    return [int(min(max(round(median * math.exp(sigma * float(x))), least), most)) for x in z]


def make_requests(w: Workload, text: list[int], system: list[int] = ()) -> list[Request]:
    """The workload's requests over ``text`` (token ids, at least ``prompt_most`` of them)."""
    if len(text) < w.prompt_most + 1:
        raise ValueError(f"the workload's text has {len(text)} tokens: prompts of up to {w.prompt_most} need at least "
                         f"{w.prompt_most + 1}")
    g = torch.Generator().manual_seed(w.seed)
    gaps = ([0.0] * w.requests if math.isinf(w.rate) else
            (torch.empty(w.requests, dtype=torch.float64).exponential_(w.rate, generator=g)).tolist())
    prompts = _lengths(g, w.requests, w.prompt_median, w.prompt_most, w.sigma, min(w.prompt_least, w.prompt_most))
    outputs = _lengths(g, w.requests, w.output_median, w.output_most, w.sigma)
    starts = torch.randint(0, len(text) - w.prompt_most, (w.requests,), generator=g).tolist()
    out, t = [], 0.0
    for i in range(w.requests):
        t += gaps[i]
        out.append(Request(i, t, tuple(system) + tuple(text[starts[i]:starts[i] + prompts[i]]), outputs[i]))
    return out


# ---- what it comes to -----------------------------------------------------------------------------------------

def alone(engine, spec, served: list[Served], device: torch.device) -> list[bool]:
    """Whether each request's tokens are those it gets served alone, greedy from its prompt with the same kind."""
    same = []
    for s in served:
        prompt = torch.tensor([s.request.prompt], device=device)
        out = spec.greedy(engine, prompt, s.request.output_tokens)
        same.append(out.tokens[0].tolist() == s.tokens)
    return same


def _quantiles(seconds: list[float], name: str) -> dict:
    """server_<name>_ms_{mean,median,p90,p99} of durations given in seconds (None where there are none)."""
    import numpy as np

    keys = [f"server_{name}_ms_{q}" for q in ("mean", "median", "p90", "p99")]
    if not seconds:
        return dict.fromkeys(keys)
    a = np.asarray(seconds) * 1e3
    return dict(zip(keys, (float(a.mean()), float(np.median(a)), float(np.percentile(a, 90)),
                           float(np.percentile(a, 99)))))


def request_rows(served: list[Served]) -> list[dict]:
    """One row per request (requests.csv)."""
    rows = []
    for s in served:
        r = s.request
        n = len(s.tokens)
        known = s.times and math.isfinite(s.times[0])  # a peer's request reset mid-way lost its first times
        rows.append(dict(request_id=r.request_id, arrival_s=r.arrival_s, admitted_s=s.admitted_s,
                         first_token_s=s.first_token_s if known else None, finish_s=s.finish_s,
                         prompt_tokens=len(r.prompt), output_tokens=n, preemptions=s.preemptions,
                         cached_tokens=s.cached_tokens, prefilled_tokens=s.prefilled_tokens,
                         ttft_ms=(s.first_token_s - r.arrival_s) * 1e3 if known else None,
                         tpot_ms=(s.finish_s - s.first_token_s) / (n - 1) * 1e3 if known and n > 1 else None,
                         e2e_ms=(s.finish_s - r.arrival_s) * 1e3))
    return rows


def token_rows(served: list[Served]) -> list[dict]:
    """One row per token made (tokens.csv): when, and the gap since the request's previous token."""
    return [dict(request_id=s.request.request_id, index=i, time_s=t if math.isfinite(t) else None,
                 itl_ms=(t - s.times[i - 1]) * 1e3 if i and math.isfinite(t - s.times[i - 1]) else None)
            for s in served for i, t in enumerate(s.times)]


def summary(log: ServeLog, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """Throughput, latency percentiles (ms), goodput under the SLO, concurrency and memory over the run."""
    rows = request_rows(log.served)
    start = min(s.request.arrival_s for s in log.served)
    span = max(s.finish_s for s in log.served) - start
    out_tokens = sum(r["output_tokens"] for r in rows)
    good = [r for r in rows if r["ttft_ms"] is not None and r["ttft_ms"] <= slo_ttft_ms
            and (r["tpot_ms"] is None or r["tpot_ms"] <= slo_tpot_ms)]  # an unknown TTFT is not within the SLO
    itl = [(t - s.times[i - 1]) for s in log.served for i, t in enumerate(s.times)
           if i and math.isfinite(t - s.times[i - 1])]
    rec = dict(server_requests=len(rows), server_duration_s=span, server_busy_s=log.wall_s,
               server_requests_per_s=len(rows) / span, server_output_tokens_per_s=out_tokens / span,
               server_goodput=len(good) / span, server_slo_met=len(good) / len(rows),
               server_preemptions=sum(r["preemptions"] for r in rows),
               server_peak_running=max((t["running"] for t in log.timeline), default=0),
               server_mean_running=_time_mean(log.timeline, "running"),
               server_kv_used_peak=_peak(log.timeline, "kv_used_bytes"),
               server_kv_held_peak=max((t["kv_held_bytes"] for t in log.timeline), default=0),
               server_cached_tokens=sum(r["cached_tokens"] for r in rows),
               server_prefilled_tokens=sum(r["prefilled_tokens"] for r in rows))
    # vLLM's (and Orca's) normalized latency: the mean of every request's end-to-end latency over its output length
    rec["server_normalized_latency_ms"] = sum(r["e2e_ms"] / r["output_tokens"] for r in rows) / len(rows)
    used, held = _time_mean(log.timeline, "kv_used_bytes"), _time_mean(log.timeline, "kv_held_bytes")
    rec["server_kv_token_share"] = used / held if held and math.isfinite(used) else None
    for name, seconds in (("ttft", [r["ttft_ms"] / 1e3 for r in rows if r["ttft_ms"] is not None]),
                          ("tpot", [r["tpot_ms"] / 1e3 for r in rows if r["tpot_ms"] is not None]),
                          ("itl", itl), ("e2e", [r["e2e_ms"] / 1e3 for r in rows])):
        rec.update(_quantiles(seconds, name))
    return rec


def _peak(timeline: list[dict], key: str) -> int | None:
    """A timeline column's largest value (None where it was not observed: NaN)."""
    values = [t[key] for t in timeline if math.isfinite(t[key])]
    return int(max(values)) if values else None


def _time_mean(timeline: list[dict], key: str) -> float:
    """A timeline column's mean over time (each row's value held until the next row)."""
    if len(timeline) < 2:
        return float(timeline[0][key]) if timeline else 0.0
    total = sum(a[key] * (b["time_s"] - a["time_s"]) for a, b in zip(timeline, timeline[1:]))
    span = timeline[-1]["time_s"] - timeline[0]["time_s"]
    return total / span if span > 0 else float(timeline[-1][key])

"""The peer on the same requests: transformers' own continuous batching (``init_continuous_batching``: a paged
cache of ``page_size``-token blocks, FIFO scheduling, requests added while it runs), under the same K/V budget.

Its requests are replayed in real time (each added when its arrival time has passed on the wall clock; our server
skips the idle gaps, this one sleeps through them), greedy, each generating exactly its output length (no stop
token). Its cache is sized from the budget (``num_blocks = budget // bytes per block``, the pool allocated whole,
as ours), and its shared-prefix reuse is turned off unless asked for. It reports each request's times and tokens;
how many run at once comes from those times (a request runs from its first token to its last), and the bytes that
hold tokens are not observable from outside, so they are not reported.
"""

from __future__ import annotations

import math
import time

import torch

from harness.core.server import Request, ServeLog, Served


STALL_S = 600.0  # no request finished for this long while some were in flight: its worker is gone


def block_bytes(config, page_size: int, dtype) -> int:
    """K and V of one block of ``page_size`` tokens, every layer (transformers' own sizing)."""
    n_layer = config.num_hidden_layers
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return n_layer * 2 * n_kv * head_dim * torch.empty(0, dtype=dtype).itemsize * page_size


def _manager(model, budget: int, page_size: int, max_batch_tokens: int, prefix_caching: bool):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    n_blocks = budget // block_bytes(model.config, page_size, model.dtype)
    if n_blocks < 1:
        raise ValueError(f"serve.kv_budget={budget:,} B holds no block of {page_size} tokens for engine=hf")
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=1)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=n_blocks, max_batch_tokens=max_batch_tokens,
                                  allow_block_sharing=prefix_caching)
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb), n_blocks


def _timeline(served: list[Served], held: int) -> list[dict]:
    """Running and waiting requests at every event (arrival, first token, last token), from the requests' times."""
    def first(s):  # a reset request's first known time stands in for its start
        return next(t for t in s.times if math.isfinite(t))

    events = sorted([(s.request.arrival_s, 0, 1) for s in served] + [(first(s), 1, 1) for s in served]
                    + [(s.finish_s, 2, -1) for s in served])
    running = waiting = arrived = 0
    rows = []
    for t, what, _ in events:
        if what == 0:
            waiting, arrived = waiting + 1, arrived + 1
        elif what == 1:
            waiting, running = waiting - 1, running + 1
        else:
            running -= 1
        rows.append(dict(time_s=t, running=running, waiting=waiting, arrived=arrived, kv_used_bytes=float("nan"),
                         kv_held_bytes=held))
    return rows


def serve_hf(engine, requests: list[Request], budget: int, page_size: int = 16, max_batch_tokens: int = 512,
             prefix_caching: bool = False, progress=None) -> ServeLog:
    """Replay ``requests`` through transformers' continuous batching on ``engine`` (an HFEngine)."""
    import logging

    model = engine.model
    # its memory report needs psutil, which kvlab does not install: the budget is given, so nothing is lost
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    manager, n_blocks = _manager(model, budget, page_size, max_batch_tokens, prefix_caching)
    order = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
    served = {r.request_id: Served(r) for r in order}
    busy = time.perf_counter()
    manager.start()
    try:
        t0, i, done = time.perf_counter(), 0, 0
        progressed = t0
        while done < len(order):
            now = time.perf_counter() - t0
            if i == done:  # nothing in flight: it waits on the next arrival, however far off, and is not stalled
                progressed = time.perf_counter()
            elif time.perf_counter() - progressed > STALL_S:
                raise RuntimeError(f"engine=hf's continuous batching finished no request for {STALL_S:.0f} s with "
                                   f"{i - done} in flight ({done} of {len(order)} done): its worker stopped")
            while i < len(order) and order[i].arrival_s <= now:
                r = order[i]
                manager.add_request(list(r.prompt), request_id=str(r.request_id), max_new_tokens=r.output_tokens,
                                    record_timestamps=True)
                served[r.request_id].admitted_s = r.arrival_s
                i += 1
            wait = None if i >= len(order) else max(order[i].arrival_s - now, 0.0)
            out = manager.get_result(timeout=0.05 if wait is None else min(wait, 0.05) or 0.001)
            if out is None or not out.is_finished():
                continue
            if out.error:
                raise RuntimeError(f"engine=hf's continuous batching failed request {out.request_id}: {out.error}")
            s = served[int(out.request_id)]
            s.tokens = list(out.generated_tokens)
            seen = [ts - t0 for ts in out.timestamps]
            # a request it pre-empted ("soft reset") keeps its tokens but times only those made after the reset:
            # its earlier times are unknown (NaN), not guessed
            s.times = [float("nan")] * (len(s.tokens) - len(seen)) + seen
            s.preemptions = int(len(seen) < len(s.tokens))
            s.first_token_s, s.finish_s = s.times[0], s.times[-1]
            s.prefilled_tokens = len(s.request.prompt)
            done += 1
            progressed = time.perf_counter()
            if progress is not None:
                progress.update(1)
    finally:
        manager.stop(block=True)
        if hasattr(manager, "destroy"):
            manager.destroy()
    held = n_blocks * block_bytes(model.config, page_size, model.dtype)
    log = list(served.values())
    return ServeLog(sorted(log, key=lambda s: s.request.request_id), _timeline(log, held),
                    time.perf_counter() - busy)

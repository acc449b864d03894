"""``python -m harness.bench --peers``: one decode step of every engine on the same weights, in one run, as ratios.

The engines: ours eager (``engine=kvlab``), ours compiled (``compile=true``), HF transformers and llama.cpp
(``engine=llamacpp``: kvlab's GGUF conversion of the same weights, llama.cpp's CPU kernels, its K/V in the model's
dtype), each with a pre-allocated cache. For each dtype (fp32, fp16; or only ``--dtype``), batch (1, 8; or only
``--batch``) and depth (``--contexts``, default 128 512 960), every engine's cache is prefilled with the same prompt
of that depth; then each repeat times one decode step of every engine in turn (rotating who goes first) and puts
each cache back, so every timed step runs at exactly that depth. Beside the medians: each engine's time over
llama.cpp's, and the roofline (the bytes a step must read, weights + K/V at the depth, at this run's own bandwidth
probe). The goal it checks: ours, at its best, within 1.2x llama.cpp's step at fp32, batch 1, the deepest context
(when the grid has that row)."""

from __future__ import annotations

import copy
import statistics
import sys

import torch

from harness.core import measure
from harness.core.engines import HFEngine, KvlabEngine
from harness.core.llamacpp import BUILD, LlamaCppEngine, available
from harness.tools.turns import prompt_and_token, time_in_turns

PEER_DTYPES = ("fp32", "fp16")
PEER_BATCHES = (1, 8)
PEER_DEPTHS = [128, 512, 960]
GOAL = 1.2  # ours (best of eager and compiled) over llama.cpp, fp32, batch 1, the deepest context


def peer_engines(model, dtype: torch.dtype) -> list[tuple[str, object]]:
    """(label, engine) for every peer of ``model`` in ``dtype``; llama.cpp only where it is built."""
    m = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    out = [("kvlab", KvlabEngine(m)), ("kvlab compiled", KvlabEngine(m, compile=True)), ("hf", HFEngine(m))]
    if available():
        storage = "fp32" if dtype == torch.float32 else "fp16"
        out.append(("llamacpp", LlamaCppEngine(m, storage=storage)))
    return out


def time_peers(engines, depth: int, batch: int, repeats: int, warmup: int, seed: int) -> dict[str, float]:
    """Median ms of one decode step per engine at ``depth``, ``batch`` sequences, engines in turns."""
    prompt, token = prompt_and_token(engines[0][1].model.config.vocab_size, depth, seed, batch)
    runners = []
    for label, e in engines:
        cache = e.new_cache("prealloc", max_len=depth + 1, batch=batch)
        e.prefill(prompt, cache)
        runners.append((label, e, cache))
    times = time_in_turns(runners, token, repeats, warmup)
    for _, _, cache in runners:
        getattr(cache, "close", lambda: None)()
    return {label: statistics.median(t) * 1e3 for label, t in times.items()}


def roofline_ms(model, depth: int, batch: int, probe_gbps: float) -> float:
    """The ms reading a decode step's bytes takes at ``probe_gbps``: the weights once, every sequence's K and V at
    ``depth``."""
    cfg = model.config
    kv = batch * depth * 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * next(model.parameters()).element_size()
    return (measure.weight_bytes(model) + kv) / (probe_gbps * 1e9) * 1e3


def bench_peers(args, model) -> dict:
    """Prints the table; returns {(dtype, batch, depth): {label: ms}} (for tests)."""
    if not available():
        print(f"bench: llama.cpp is not built here, so its column is empty: {BUILD}", file=sys.stderr)
    probe = measure.bandwidth_probe(torch.device("cpu"), measure.weight_bytes(model))["probe_gbps"]
    print(f"bandwidth probe {probe:.1f} GB/s; ms per decode step (median), each engine / llama.cpp's in brackets")
    results: dict = {}
    dtypes = getattr(args, "peer_dtypes", None) or PEER_DTYPES  # the --dtype and --batch given narrow the grid
    batches = [args.peer_batches] if getattr(args, "peer_batches", None) else PEER_BATCHES
    for dname in dtypes:
        engines = peer_engines(model, torch.float32 if dname == "fp32" else torch.float16)
        labels = [label for label, _ in engines]
        print(f"{'dtype':<5} {'batch':>5} {'depth':>5}  " + "".join(f"{label:>22}" for label in labels)
              + f"{'roofline':>10}")
        for batch in batches:
            for depth in args.contexts:
                ms = time_peers(engines, depth, batch, args.repeats, args.warmup, args.seed)
                results[(dname, batch, depth)] = ms
                ref = ms.get("llamacpp")
                cells = "".join(f"{ms[lb]:>12.2f}" + (f" ({ms[lb] / ref:>5.2f}x)" if ref else " " * 9)
                                for lb in labels)
                roof = roofline_ms(engines[0][1].model, depth, batch, probe)
                print(f"{dname:<5} {batch:>5} {depth:>5}  {cells}{roof:>10.2f}")
    deepest = max(args.contexts)
    ms = results.get(("fp32", 1, deepest), {})
    if not ms:
        print(f"goal: not judged: it is set at fp32, batch 1, depth {deepest}, which this grid did not time")
    elif "llamacpp" in ms:
        best = min(ms["kvlab"], ms["kvlab compiled"])
        ratio = best / ms["llamacpp"]
        print(f"goal: ours at its best within {GOAL}x llama.cpp's step at fp32, batch 1, depth {deepest}: "
              f"{ratio:.2f}x, {'met' if ratio <= GOAL else 'missed; where our eager step goes:'}")
        if ratio > GOAL:
            print(profile_step(KvlabEngine(model), deepest, args.seed))
    return results


def profile_step(engine, depth: int, seed: int, steps: int = 20) -> str:
    """torch.profiler's table of ``steps`` decode steps of ``engine`` at ``depth`` (batch 1), by self CPU time."""
    prompt, token = prompt_and_token(engine.model.config.vocab_size, depth, seed)
    cache = engine.new_cache("prealloc", max_len=depth + 1)
    engine.prefill(prompt, cache)
    back = engine.checkpoint(cache)
    for _ in range(3):  # warm
        engine.decode(token, cache)
        back()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.decode(token, cache)
            back()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)

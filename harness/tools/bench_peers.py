"""``python -m harness.bench --peers``: one decode step of every engine on the same weights, in one run, as ratios,
and where our step stands against the machine's peak read bandwidth and the targets set for it.

The engines: ours eager (``engine=kvlab``), ours compiled (``compile=true``), HF transformers and llama.cpp
(``engine=llamacpp``: kvlab's GGUF conversion of the same weights in the dtype's own type, f32, f16 or bf16, its K/V
in that type too), each with a pre-allocated cache. For each dtype (``--dtype``, a comma list, default fp32, fp16,
bf16: the grid's outer loop, in that order), batch (1, 8; or only ``--batch``) and depth (``--contexts``, default 128
512 960), every engine's cache is prefilled with the same prompt of that depth; then each repeat times one decode
step of every engine in turn (rotating who goes first) and puts each cache back, so every timed step runs at exactly
that depth.

The header gives the machine's read bandwidth: the median of ``PROBE_PASSES`` full reads (the range of the passes
beside it), by all threads with the widest vector loads, of a float32 buffer of max(512 MiB, the model's fp32 weight
bytes), the faster of two ways (``peak_read_gbps``: kvlab's ``read_gbps`` sum and its linear kernel's matrix-vector
product; torch's probe, a floor, where the kernels are not built). Each row gives every engine's median
ms and, in brackets, its ratio to llama.cpp's at the same dtype; then the GB/s our eager step reaches (the bytes it
must read, weights in the dtype + every sequence's K/V at the depth in the dtype, over its median), the probe's
matrix-vector product read in turns with the row's steps (``ProbeTurn``: the median of its passes; the header's
peak where the kernels are not built), and the first over the second, the roofline fraction (1: reading as fast as
the probe beside it).

The targets (``TARGETS``), one line each at the end, met, missed or not judged (a cell the grid did not time), at the
grid's deepest depth: fp32 batch 1, ours at its best (the faster of eager and compiled) within 1.15x llama.cpp's
step; fp16 and bf16 batch 1, ours at its best within 0.65x our own best fp32 step and 1.3x llama.cpp's at the dtype;
fp32 and fp16 batch 8 within 1.3x llama.cpp's; fp32 batch 1, our eager step at 0.8 of the peak or more. Then, from
torch.profiler over our eager step at batch 1 and the deepest depth, the share of its self CPU time in the
projections, in attention and in the rest (each op's time with what runs inside it: ``step_shares``): for fp32
always, and with the profile's table for each dtype a missed target is set at (``print_profiles``)."""

from __future__ import annotations

import copy
import statistics
import sys
import time
from typing import NamedTuple

import torch

from harness.core import measure
from harness.core.engines import HFEngine, KvlabEngine
from harness.core.llamacpp import BUILD, LlamaCppEngine, available
from harness.tools.turns import prompt_and_token, time_in_turns

PEER_DTYPES = ("fp32", "fp16", "bf16")
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PEER_BATCHES = (1, 8)
PEER_DEPTHS = [128, 512, 960]
PROBE_MIN_BYTES = 512 << 20  # the peak probe's buffer: at least this, and at least the model's fp32 weights
PROBE_PASSES = 10  # full reads of it; their median is the read bandwidth the roofline is set against
# what a profile's event names are: the projections (kvlab's kernel, torch's path where it runs) and attention
PROJECTIONS = ("kvlab::linear", "aten::addmm", "aten::mm", "aten::linear")
ATTENTION = ("scaled_dot_product", "attention")
# (dtype, batch, conditions), judged at the grid's deepest depth; a condition (what, bound): "llamacpp", ours at its
# best (min of eager and compiled) <= bound x llama.cpp's step at the dtype; "fp32", ours at its best <= bound x our
# own best fp32 step at batch 1; "roofline", our eager step's GB/s >= bound x the peak read bandwidth
TARGETS = (
    ("fp32", 1, (("llamacpp", 1.15),)),
    ("fp16", 1, (("fp32", 0.65), ("llamacpp", 1.3))),
    ("bf16", 1, (("fp32", 0.65), ("llamacpp", 1.3))),
    ("fp32", 8, (("llamacpp", 1.3),)),
    ("fp16", 8, (("llamacpp", 1.3),)),
    ("fp32", 1, (("roofline", 0.8),)),
)


BEST = "ours at its best "


class Verdict(NamedTuple):
    dtype: str
    batch: int
    verdict: str  # met, missed, not judged
    line: str


def peer_engines(model, dname: str, without: tuple = ()) -> list[tuple[str, object]]:
    """(label, engine) for every peer of ``model`` in dtype ``dname`` (less those named in ``without``: hf);
    llama.cpp only where it is built (its GGUF and K/V in the dtype's own type)."""
    dtype = TORCH_DTYPES[dname]
    m = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    out = [("kvlab", KvlabEngine(m)), ("kvlab compiled", KvlabEngine(m, compile=True))]
    if "hf" not in without:
        out.append(("hf", HFEngine(m)))
    if available():
        out.append(("llamacpp", LlamaCppEngine(m, storage=dname)))
    return out


def time_peers(engines, depth: int, batch: int, repeats: int, warmup: int, seed: int,
               probe: ProbeTurn | None = None) -> dict[str, float]:
    """Median ms of one decode step per engine at ``depth``, ``batch`` sequences, engines in turns; with ``probe``
    its pass in turns with them too (label "probe")."""
    prompt, token = prompt_and_token(engines[0][1].model.config.vocab_size, depth, seed, batch)
    runners = []
    for label, e in engines:
        cache = e.new_cache("prealloc", max_len=depth + 1, batch=batch)
        e.prefill(prompt, cache)
        runners.append((label, e, cache))
    times = time_in_turns(runners + ([("probe", probe, None)] if probe else []), token, repeats, warmup)
    for _, _, cache in runners:
        getattr(cache, "close", lambda: None)()
    return {label: statistics.median(t) * 1e3 for label, t in times.items()}


def step_bytes(model, depth: int, batch: int) -> int:
    """The bytes a decode step must read, in ``model``'s dtype: the weights once (``measure.weight_bytes``), every
    sequence's K and V at ``depth``."""
    cfg = model.config
    kv = batch * depth * 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * next(model.parameters()).element_size()
    return measure.weight_bytes(model) + kv


class ProbeTurn:
    """The peak probe's matrix-vector product, as a runner of ``time_in_turns``: each of its "steps" one product by
    kvlab's linear kernel over a float32 weight of ``nbytes`` (rows of 768), W read once per pass as a decode step
    reads a layer's weight for one sequence. Timed in turns with the engines, it reads while the same neighbours
    share the memory as the steps it is set against: on a shared host the bandwidth left free moves within minutes,
    and a peak read once at the start judged the steps of a busier minute."""

    def __init__(self, mod, nbytes: int):
        self.mod, self.w, self.x = mod, torch.ones(max(1, nbytes // (4 * 768)), 768), torch.ones(1, 1, 768)
        self.nbytes = self.w.numel() * 4

    def decode(self, token, cache) -> None:
        self.mod.linear(self.x, self.w, None, -1)

    def checkpoint(self, cache):
        return lambda: None


def gemv_gbps(mod, nbytes: int, passes: int) -> list[float]:
    """GB/s of each of ``passes`` of ``ProbeTurn``'s matrix-vector product over a float32 weight of ``nbytes``."""
    probe = ProbeTurn(mod, nbytes)
    probe.decode(None, None)  # its pages touched once before any pass is timed
    rates = []
    for _ in range(passes):
        t0 = time.perf_counter()
        probe.decode(None, None)
        rates.append(probe.nbytes / (time.perf_counter() - t0) / 1e9)
    return rates


def probe_turn(nbytes: int) -> ProbeTurn | None:
    """The probe read in turns (``ProbeTurn``) over max(``PROBE_MIN_BYTES``, ``nbytes``); None where kvlab's kernels
    are not built (the roofline is then set against the header's peak)."""
    from models.kv_cache import kernels

    mod = kernels.load_linear()
    return None if mod is None else ProbeTurn(mod, max(PROBE_MIN_BYTES, nbytes))


def peak_read_gbps(nbytes: int, passes: int = PROBE_PASSES) -> tuple[float, str]:
    """The machine's read bandwidth (GB/s) and how it was measured: two ways of reading a float32 buffer of
    max(``PROBE_MIN_BYTES``, ``nbytes``) by kvlab's kernel module, ``passes`` times each, the larger of their medians:
    ``read_gbps`` (every thread its own part, two halves side by side, the widest vector loads, a sum) and the
    linear kernel's own matrix-vector product over the buffer as one weight (``gemv_gbps``). The peak is the faster
    way because neither one reads at the machine's rate on every CPU: on the 2-core machine of docs/engine.md the
    product read faster than the plain sum, and a roofline below what a real step reaches measures nothing. Torch's
    bandwidth probe, a floor, where the kernels are not built. The median, not the best: on a shared host single
    passes range widely (23 to 64 GB/s within minutes on that machine), and the best pass is what neighbours left
    free for a moment, not what a step can count on."""
    from models.kv_cache import kernels

    size = max(PROBE_MIN_BYTES, nbytes)
    mod = kernels.load_linear()
    if mod is None:
        gbps = measure.bandwidth_probe(torch.device("cpu"), size)["probe_gbps"]
        return gbps, f"torch's bandwidth probe over {size / 2**20:,.0f} MiB (kvlab's kernels are not built: a floor)"
    buf = torch.ones(size // 4, dtype=torch.float32)
    ways = {"read_gbps": sorted(mod.read_gbps(buf, passes))}
    del buf
    ways["the linear kernel's matrix-vector product"] = sorted(gemv_gbps(mod, size, passes))
    way, rates = max(ways.items(), key=lambda kv: statistics.median(kv[1]))
    other = statistics.median(next(r for w, r in ways.items() if w != way))
    return statistics.median(rates), (f"the median of {passes} full reads of {size / 2**20:,.0f} MiB by {way} (each "
                                      f"{rates[0]:.1f} .. {rates[-1]:.1f}; the other way's median {other:.1f}), "
                                      f"{torch.get_num_threads()} threads")


def bench_peers(args, model) -> dict:
    """Prints the header, a table per dtype, the targets and the step's shares; returns {(dtype, batch, depth):
    {label: ms}} (for tests)."""
    from models import cpu_kernels

    if not available():
        print(f"bench: llama.cpp is not built here, so its column is empty: {BUILD}", file=sys.stderr)
    peak, how = peak_read_gbps(measure.weight_bytes(model))
    print(f"read bandwidth {peak:.1f} GB/s: {how}\nkvlab's CPU kernels {cpu_kernels.path()}; llama.cpp's GGUF and "
          "K/V in each dtype's own type (f32, f16, bf16)\nms per decode step (median), each engine / llama.cpp's at "
          "the same dtype in brackets;\nkvlab GB/s: (weights + K/V in the dtype) / our eager step's ms; probe: the "
          "peak's matrix-vector product read in turns with the steps (GB/s, median; the header's peak where the "
          "kernels are not built); roof: kvlab GB/s / probe")
    results: dict = {}
    reads: dict = {}
    peaks = {"probe": probe_turn(measure.weight_bytes(model)), "header": peak}
    batches = [args.peer_batches] if getattr(args, "peer_batches", None) else PEER_BATCHES
    dtypes = getattr(args, "peer_dtypes", None) or PEER_DTYPES
    # our compiled step is one graph per cell (static shapes), all of one code object: allow each dtype's cells, and
    # drop them once its engines are gone (so they count against no later compile in this process)
    with torch._dynamo.config.patch(recompile_limit=len(batches) * len(args.contexts) + 8):
        for dname in dtypes:
            try:
                bench_dtype(model, dname, batches, args, peaks, results, reads)
            finally:
                torch._dynamo.reset()
    deepest = max(args.contexts)
    verdicts = judge_targets(results, reads, peaks, deepest)
    for v in verdicts:
        print(v.line)
    print_profiles(model, [v.dtype for v in verdicts if v.verdict == "missed"], deepest, args.seed)
    return results


def print_profiles(model, missed: list[str], depth: int, seed: int) -> None:
    """Our eager step profiled at batch 1, ``depth``: the share line for fp32 always, the profile's table and share
    line for each dtype of ``missed`` (a dtype a missed target is set at), once per dtype."""
    missed = list(dict.fromkeys(missed))
    for dname in dict.fromkeys(["fp32", *missed]):
        m = model if dname == "fp32" else copy.deepcopy(model).to(TORCH_DTYPES[dname])
        table, shares = profile_step(KvlabEngine(m), depth, seed)
        if dname in missed:
            print(f"where our eager step goes at {dname}, batch 1, depth {depth} (a target at {dname} is missed):")
            print(table)
        print(share_line(dname, depth, shares))


def bench_dtype(model, dname: str, batches, args, peaks: dict, results: dict, reads: dict) -> None:
    """One dtype's rows: every engine's median ms and ratio to llama.cpp's, our eager step's GB/s, the probe's in
    turns with it and the roofline fraction; filled into ``results`` ({cell: {label: ms}}), ``reads`` ({cell:
    GB/s}) and ``peaks`` ({cell: the probe's GB/s}; its "probe" is the ``ProbeTurn``, "header" the header's peak)."""
    engines = peer_engines(model, dname, tuple(getattr(args, "without", None) or ()))
    labels = [label for label, _ in engines]
    print(f"{'dtype':<5} {'batch':>5} {'depth':>5}" + "".join(f"{label:>19}" for label in labels)
          + f"{'kvlab GB/s':>11}{'probe':>6}{'roof':>6}")
    for batch in batches:
        for depth in args.contexts:
            ms = time_peers(engines, depth, batch, args.repeats, args.warmup, args.seed, peaks["probe"])
            cell = (dname, batch, depth)
            probe_ms = ms.pop("probe", None)
            peaks[cell] = peaks["header"] if probe_ms is None else peaks["probe"].nbytes / (probe_ms * 1e-3) / 1e9
            results[cell] = ms
            reads[cell] = step_bytes(engines[0][1].model, depth, batch) / (ms["kvlab"] * 1e-3) / 1e9
            ref = ms.get("llamacpp")
            cells = "".join(f"{ms[lb]:>10.2f}" + (f" ({ms[lb] / ref:>5.2f}x)" if ref else " " * 9) for lb in labels)
            print(f"{dname:<5} {batch:>5} {depth:>5}{cells}{reads[cell]:>11.1f}{peaks[cell]:>6.1f}"
                  f"{reads[cell] / peaks[cell]:>6.2f}")


def judge_targets(results: dict, reads: dict, peaks: dict, deepest: int) -> list[Verdict]:
    """Each of ``TARGETS`` judged from the cells timed at ``deepest`` (``results``: {(dtype, batch, depth): {label:
    ms}}; ``reads``: {cell: our eager step's GB/s}; ``peaks``: {cell: the probe's GB/s read in turns with it}): met,
    missed, or not judged (saying which cell it lacks)."""
    out = []
    for dname, batch, conditions in TARGETS:
        head = f"target: {dname} batch {batch} depth {deepest}: "
        parts, why = [], None
        for what, bound in conditions:
            got = _condition(what, bound, dname, batch, results, reads, peaks, deepest)
            if isinstance(got, str):
                why = why or got
            else:
                parts.append(got)
        if why:
            out.append(Verdict(dname, batch, "not judged", f"{head}not judged: {why}"))
            continue
        verdict = "met" if all(ok for _, ok in parts) else "missed"
        text = " and ".join((t if i == 0 else t.removeprefix(BEST)) + (f": {'met' if ok else 'missed'}"
                                                                      if len(parts) > 1 else "") + ")"
                            for i, (t, ok) in enumerate(parts))
        out.append(Verdict(dname, batch, verdict, f"{head}{text}: {verdict}"))
    return out


def _condition(what: str, bound: float, dname: str, batch: int, results: dict, reads: dict, peaks: dict,
               deepest: int) -> tuple[str, bool] | str:
    """One condition of a target: (its text less the closing bracket, met), or why it is not judged."""
    cell = results.get((dname, batch, deepest))
    if cell is None:
        return f"the grid did not time {dname} batch {batch} depth {deepest}"
    best = min(cell["kvlab"], cell["kvlab compiled"])
    if what == "llamacpp":
        if "llamacpp" not in cell:
            return f"llama.cpp's step was not timed (it is not built here: {BUILD})"
        r = best / cell["llamacpp"]
        return f"{BEST}{r:.2f}x llama.cpp's step (bound <= {bound:.2f}x", r <= bound
    if what == "fp32":
        ref = results.get(("fp32", 1, deepest))
        if ref is None:
            return f"it is set against our fp32 step at batch 1 depth {deepest}, which the grid did not time"
        r = best / min(ref["kvlab"], ref["kvlab compiled"])
        return f"{BEST}{r:.2f}x our own best fp32 step (bound <= {bound:.2f}x", r <= bound
    gbps, peak = reads[(dname, batch, deepest)], peaks[(dname, batch, deepest)]
    return (f"our eager step reads {gbps:.1f} GB/s, {gbps / peak:.2f} of the probe's {peak:.1f} GB/s (bound >= "
            f"{bound:.2f}", gbps / peak >= bound)


def profile_step(engine, depth: int, seed: int, steps: int = 20) -> tuple[str, dict[str, float]]:
    """torch.profiler over ``steps`` decode steps of ``engine`` at ``depth`` (batch 1): its table by self CPU time,
    and the shares of that time (``step_shares``)."""
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
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return table, step_shares(prof.events())


def _part(name: str) -> str | None:
    """The part of the step an event of ``name`` is: projections, attention, or None (neither)."""
    if name in PROJECTIONS:
        return "projections"
    return "attention" if any(a in name.lower() for a in ATTENTION) else None


def step_shares(events) -> dict[str, float]:
    """{projections, attention, rest}: the shares of a profile's self CPU time (``prof.events()``) in the
    projections (``PROJECTIONS``), in attention (a name containing one of ``ATTENTION``) and elsewhere. An event
    is its nearest enclosing such op's (itself included): a copy inside ``kvlab::linear`` is the projection's."""
    spent = {"projections": 0.0, "attention": 0.0, "rest": 0.0}
    for e in events:
        up, part = e, None
        while up is not None and part is None:
            part, up = _part(up.name), up.cpu_parent
        spent[part or "rest"] += e.self_cpu_time_total
    total = sum(spent.values())
    return {k: v / total if total else 0.0 for k, v in spent.items()}


def share_line(dname: str, depth: int, shares: dict[str, float]) -> str:
    """The one line of where our eager step's self CPU time goes."""
    return (f"step shares at {dname}, batch 1, depth {depth} (our eager step's self CPU time, torch.profiler): "
            f"projections {shares['projections']:.1%}, attention {shares['attention']:.1%}, "
            f"the rest {shares['rest']:.1%}")

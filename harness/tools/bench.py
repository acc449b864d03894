"""Decode-step benchmarks, every ratio measured in one run.

    python -m harness.bench                      # ours vs HF transformers: gpt2 size, fp32, batch 1, ctx 32 and 512
    python -m harness.bench --model tiny --contexts 16 64 --repeats 20
    python -m harness.bench --kinds              # every cache kind of ours: bytes held and step time vs prealloc
    python -m harness.bench --kinds --cache prealloc --cache quant:k_bits=8,v_bits=8 --cache window:window=256
    python -m harness.bench --prefix             # prefix reuse: time to first token with and without a snapshot
    python -m harness.bench --paged --model mini # a ragged batch served: KV waste per layout, step time, tokens
    python -m harness.bench --peers              # ours (eager, compiled) vs HF vs llama.cpp at fp32, fp16 and bf16
                                                 # (--dtype fp32,bf16 for some): ms, ratios, GB/s against the
                                                 # machine's peak read, targets met/missed (harness/tools/bench_peers)

Ours vs HF: for each context length and each kind transformers has a counterpart of (concat: DynamicCache, prealloc:
StaticCache, quant at its defaults, 4 bits, groups of 32: QuantizedCache with optimum-quanto) both caches are
prefilled with the same prompt; then each repeat times one decode step of each engine, alternating which goes first,
and puts the step back (``checkpoint``), so every timed step runs at exactly that context. Prints the medians and the
ratio ours / HF.

Kinds (``--kinds``): one cache per kind (default: every registered kind, quant at 8, 4 and 2 bits, window 4 + 256),
each owning ``max_len`` = the model's positions; at each context all are prefilled with the same prompt, then each
repeat times one decode step of every kind in turn (rotating who goes first) and puts each cache back with its
``checkpoint``. Prints the bytes each holds at the longest context, that as a fraction of fp32 prealloc's, and the
median step time per context with its ratio to prealloc's.

Prefix reuse (``--prefix``): requests that share a prefix of P tokens and add S of their own (``--suffix``, default
16). Cold: an empty cache prefills all P + S tokens. Reuse: ``cache.restore(snapshot)`` of the prefix (taken once,
untimed), then a prefill of the S new tokens. Both are timed to the first token's logits, alternating, for every
exact kind that snapshots (default concat and prealloc); prints the medians, cold / reuse, the largest |Δlogit|
between the two first-token logits (they must agree), the bytes the snapshot took (a copy of the prefix's K/V; a
paged snapshot shares the prefix's blocks, copy-on-write, and takes none), and the break-even: the shortest prefix
from which reuse is faster.

Paged serving (``--paged``): ``--batch`` requests (default 16) with prompt lengths drawn from 1 .. ``--prompt-max``
and output lengths from 1 .. ``--output-max`` (seeded) are served as one left-padded batch on each layout (default
prealloc, concat, paged), the cache owning the model's ``n_positions`` slots per sequence where a layout reserves
ahead. After every decode step: the slots the cache holds against the tokens of the requests still running (a
request that has its output is done: ``paged`` hands its blocks back with ``cache.end(b)``; the other layouts keep
its slots until the batch ends). Prints the time-averaged and end-of-prefill waste (held slots holding no live
token), the most bytes held, the median decode step (ms) and its ratio to prealloc's (the price of the block-table
gather), and whether every request's tokens equal prealloc's. With ``--compile`` the kinds that read K/V where they
lie do (paged: each sequence's own keys through its block table; compile time apart), the rest run eager (prealloc
with padding has no static step).

The weights are a seeded random init (no pretrained weights needed: the cost of a step and the bytes held do not
depend on their values).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import pandas as pd
import torch

from harness.common.signals import reader_gone
from harness.core.engines import ENGINES, HF_COUNTERPARTS, WARMUP_CALLS, HFEngine, KvlabEngine
from harness.tools.turns import prompt_and_token, time_in_turns
from harness.core import measure
from harness.core import sizes
from harness.experiment import memory
from harness.core.measure import CacheSpec
from models import cpu_kernels
from models.decoder import Decoder
from models.families import PRESETS, build, preset_config
from models.gguf import gguf_refuses
from models.kv_cache import CACHE_KINDS, KVCache, cache_kind
from models.kv_cache.base import DTYPES, itemsize, storage_nbytes

DEFAULT_KINDS = ["concat", "prealloc", "quant:k_bits=8,v_bits=8", "quant:k_bits=4,v_bits=4",
                 "quant:k_bits=2,v_bits=2", "window:window=256,sinks=4", "paged:block_size=16",
                 # the evicting kinds at 256 slots, beside a window of the same 256 (S4 + W252)
                 "window:window=252,sinks=4", "h2o:budget=256,recent=32", "tova:budget=256",
                 "snapkv:budget=256,window=32", "knorm:budget=256", "random:budget=256"]


def default_kinds(head_dim: int) -> list[str]:
    """``DEFAULT_KINDS`` for a model of ``head_dim``: the quant kinds' groups at most the head size (a per-token group
    spans at most the head's channels: ``QuantKVCache.check_head_dim``)."""
    group = cache_kind("quant").Options().group_size
    return [k + f",group_size={head_dim}" if k.startswith("quant:") and head_dim < group else k for k in DEFAULT_KINDS]


def _counterpart_options(kind: str, head_dim: int | None = None) -> dict:
    """The options of ``kind`` both engines run in the HF comparison (``harness.core.engines.counterpart_options``: the
    kind's defaults HF does not honour replaced by what it does, for the model's ``head_dim``)."""
    from harness.core import engines

    return engines.counterpart_options(kind, head_dim)


def time_steps(engines, layout: str, ctx: int, repeats: int, warmup: int, seed: int = 0,
               options: dict | None = None) -> dict[str, list[float]]:
    """Per-engine decode-step times (seconds) at context ``ctx``; engines alternate within each repeat. ``options``:
    the cache kind's, the same for every engine."""
    prompt, token = prompt_and_token(engines[0].model.config.vocab_size, ctx, seed)
    runners = []
    for e in engines:
        cache = e.new_cache(layout, max_len=ctx + 1, **(options or {}))
        e.prefill(prompt, cache)
        runners.append((e.name, e, cache))
    return time_in_turns(runners, token, repeats, warmup)


def parse_kind(text: str) -> CacheSpec:
    """"quant:k_bits=8,v_bits=4" -> CacheSpec("quant", {"k_bits": 8, "v_bits": 4}); options typed by the kind."""
    kind, _, rest = text.partition(":")
    cls = cache_kind(kind)
    types, options = cls.option_types(), {}
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        if not eq or name not in types:
            raise ValueError(f"--cache {text!r}: {item!r} is not NAME=VALUE with NAME one of "
                             f"{', '.join(types) or 'no options'}")
        try:
            options[name] = types[name](value) if types[name] is not bool else value.lower() in ("1", "true", "yes")
        except ValueError:
            raise ValueError(f"--cache {text!r}: {name}={value!r} is not a {getattr(types[name], '__name__', 'value')}"
                             ) from None
    cls.parse_options(**options)
    return CacheSpec(kind, options)


def time_kinds(engine, specs: list[CacheSpec], ctx: int, max_len: int, repeats: int, warmup: int,
               seed: int = 0, batch: int = 1) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Decode-step times (seconds) of each cache at context ``ctx`` for ``batch`` sequences, kinds taking turns
    within each repeat, and the bytes each holds there."""
    device = next(engine.model.parameters()).device
    prompt, token = prompt_and_token(engine.model.config.vocab_size, ctx, seed, batch, device)
    runners = []
    for spec in specs:
        cache = spec.new(engine, max_len, batch)
        engine.prefill(prompt, cache)
        runners.append((spec.label, engine, cache))
    return time_in_turns(runners, token, repeats, warmup), {label: engine.nbytes(c) for label, _, c in runners}


def time_prefix_reuse(engine, spec: CacheSpec, prefix: int, suffix: int, repeats: int, warmup: int,
                      seed: int = 0) -> dict:
    """Time to first token for a request of ``prefix`` shared + ``suffix`` own tokens: cold (prefill everything)
    against reuse (restore the prefix's snapshot, prefill the suffix). Seconds per repeat, and the largest |Δlogit|
    between the two ways' first-token logits."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, engine.model.config.vocab_size, (1, prefix + suffix), generator=g)
    max_len = prefix + suffix + 1
    warm = spec.new(engine, max_len)
    engine.prefill(ids[:, :prefix], warm)
    used = getattr(getattr(warm, "pool", None), "used", 0)
    snap = warm.snapshot()  # once, untimed: what a server keeps for the shared prefix
    if warm.pooled:  # blocks the snapshot took from the pool (sharing: none)
        snap_nbytes = (warm.pool.used - used) * warm.pool.block_nbytes
    else:  # the K/V it copied
        snap_nbytes = storage_nbytes([t for v in snap.values() for t in (v if isinstance(v, list) else [v])
                                      if isinstance(t, torch.Tensor) and t is not snap.get("pad")])
    cold_cache, reuse_cache = spec.new(engine, max_len), warm.empty_like()  # (a paged one shares warm's pool)
    out: dict = {"cold": [], "reuse": [], "snapshot_nbytes": snap_nbytes}

    def cold():
        cold_cache.reset()
        return engine.prefill(ids, cold_cache, last_only=True)

    def reuse():
        reuse_cache.restore(snap)
        return engine.prefill(ids[:, prefix:], reuse_cache, last_only=True)

    for r in range(warmup + repeats):
        for name, fn in ((("cold", cold), ("reuse", reuse)) if r % 2 == 0 else (("reuse", reuse), ("cold", cold))):
            t0 = time.perf_counter()
            logits = fn()
            dt = time.perf_counter() - t0
            out[name + "_logits"] = logits
            if r >= warmup:
                out[name].append(dt)
    out["max_abs"] = float((out.pop("cold_logits") - out.pop("reuse_logits")).abs().max())
    return out


def bench_prefix(args, model: Decoder) -> None:
    kinds = [parse_kind(k) for k in (args.cache or ["concat", "prealloc"])]
    engine = KvlabEngine(model)
    print(f"prefix reuse: {args.suffix} new tokens after a shared prefix; time to first token, ms")
    print(f"{'cache':<22}{'prefix':>8}{'cold ms':>10}{'reuse ms':>10}{'cold/reuse':>11}{'max |dlogit|':>14}"
          f"{'snapshot bytes':>16}")
    for spec in kinds:
        even = None
        for p in args.prefixes:
            t = time_prefix_reuse(engine, spec, p, args.suffix, args.repeats, args.warmup, args.seed)
            cold, reuse = statistics.median(t["cold"]) * 1e3, statistics.median(t["reuse"]) * 1e3
            if even is None and reuse < cold:
                even = p
            print(f"{spec.label:<22}{p:>8}{cold:>10.2f}{reuse:>10.2f}{cold / reuse:>10.2f}x{t['max_abs']:>14.2e}"
                  f"{t['snapshot_nbytes']:>16,}")
        print(f"{spec.label:<22}break-even: " + (f"reuse is faster from a prefix of {even} tokens (of those timed)"
                                                  if even is not None else "reuse was never faster here"))


def serve_ragged(engine, spec: CacheSpec, prompts: list[torch.Tensor], out_lens: list[int], max_len: int) -> dict:
    """Serve ``prompts`` as one left-padded batch until every request has its ``out_lens`` tokens; after every
    decode step, the slots held against the live requests' tokens. Returns each request's tokens, per-step waste,
    the most bytes held and the step times (s; a compiled step's call that compiled, counted in its engine's
    ``compile_s``, is not one of them)."""
    from models.generate import left_pad

    B = len(prompts)
    idx, pad = left_pad(prompts)
    cache = spec.new(engine, max_len, B)
    logits = engine.prefill(idx, cache, last_only=True, pad=pad if bool(pad.any()) else None)[:, -1]
    tokens: list[list[int]] = [[] for _ in range(B)]
    live, waste, peak, times = set(range(B)), [], 0, []
    while True:
        nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
        for b in sorted(live):
            tokens[b].append(int(nxt[b]))
            if len(tokens[b]) == out_lens[b]:
                live.discard(b)
                if hasattr(cache, "end"):
                    cache.end(b)  # a paged cache hands the finished request's blocks back
        held = cache.held_slots
        used = sum(len(prompts[b]) + len(tokens[b]) - 1 for b in live)  # the newest token is not cached yet
        waste.append(1 - used / held if held else 0.0)
        peak = max(peak, engine.nbytes(cache))
        if not live:
            break
        compiled_s = getattr(engine, "compile_stats", {}).get("compile_s")
        t0 = time.perf_counter()
        logits = engine.decode(nxt, cache)[:, -1]
        if getattr(engine, "compile_stats", {}).get("compile_s") == compiled_s:  # a call that compiled is no step
            times.append(time.perf_counter() - t0)
    return dict(tokens=tokens, waste=waste, peak_nbytes=peak, times=times)


def bench_paged(args, model: Decoder) -> None:
    specs = [parse_kind(k) for k in (args.cache or ["prealloc", "concat", "paged"])]
    n_pos = model.config.n_positions  # --prompt-max + --output-max <= n_pos: check_args
    g = torch.Generator().manual_seed(args.seed)
    p_lens = torch.randint(1, args.prompt_max + 1, (args.batch,), generator=g).tolist()
    o_lens = torch.randint(1, args.output_max + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in p_lens]
    engine = KvlabEngine(model, compile=args.compile)
    mean_p = sum(p_lens) / len(p_lens)
    print(f"{args.batch} requests: prompts of {min(p_lens)}..{max(p_lens)} tokens (mean {mean_p:.0f}), outputs of "
          f"{min(o_lens)}..{max(o_lens)} (mean {sum(o_lens) / len(o_lens):.0f}); max_len {n_pos} per "
          "sequence where a layout reserves ahead; waste = held slots holding no live request's token")
    print(f"{'cache':<24}{'mean waste':>11}{'waste@prefill':>14}{'peak bytes':>16}{'step ms':>9}{'vs prealloc':>12}"
          f"{'tokens = prealloc':>18}")
    base = None
    for spec in specs:
        r = serve_ragged(engine, spec, prompts, o_lens, n_pos)
        ms = statistics.median(r["times"]) * 1e3 if r["times"] else float("nan")
        if base is None:
            base = (spec.label, ms, r["tokens"])
        same = r["tokens"] == base[2]
        print(f"{spec.label:<24}{statistics.mean(r['waste']):>10.1%}{r['waste'][0]:>14.1%}{r['peak_nbytes']:>16,}"
              f"{ms:>9.2f}{ms / base[1]:>11.2f}x{str(same):>18}")
    print(f"(ratios and token checks against {base[0]}, the first cache listed)")
    if args.compile:
        fused = ", ".join(s.label for s in specs if cache_kind(s.kind).fuses_decode) or "none of these kinds"
        print(f"read where they lie (--compile): {fused}; compile {engine.compile_stats['compile_s']:.1f} s apart "
              "from the steps; the rest eager")


def bench_hf(args, model: Decoder) -> None:
    engines = [KvlabEngine(model), HFEngine(model)]
    print(f"{'context':>7}  {'kind':<9} {'kvlab ms':>9} {'HF ms':>9} {'HF cache':<15} {'kvlab/HF':>8}")
    for ctx in args.contexts:
        for kind, counterpart in HF_COUNTERPARTS.items():
            hf_name = counterpart.name if hasattr(counterpart, "name") else counterpart[0]
            t = time_steps(engines, kind, ctx, args.repeats, args.warmup, args.seed,
                           _counterpart_options(kind, model.config.head_dim))
            ours, hf = statistics.median(t["kvlab"]) * 1e3, statistics.median(t["hf"]) * 1e3
            print(f"{ctx:>7}  {kind:<9} {ours:>9.2f} {hf:>9.2f} {hf_name:<15} {ours / hf:>7.2f}x")


# what a kind's step should cost beside prealloc's, where its bytes are a small share (issue 24): (kind as --cache
# spells it, batch, context, most step / prealloc's step); checked by --kinds whenever a run has that kind, batch and
# context
KIND_TARGETS = (
    ("quant:k_bits=4,v_bits=4", 8, 960, 1.0),
    ("quant:k_bits=4,v_bits=4", 1, 960, 1.15),
    ("paged:block_size=16", 1, 960, 1.1),
)


def bench_kinds(args, model: Decoder) -> None:
    specs = [parse_kind(k) for k in (args.cache or DEFAULT_KINDS)]
    base = CacheSpec("prealloc")
    if base.label not in {s.label for s in specs}:
        specs.insert(0, base)
    engine, max_len = KvlabEngine(model, compile=args.compile), model.config.n_positions
    ms: dict[str, dict[int, float]] = {s.label: {} for s in specs}
    held = {}
    for ctx in args.contexts:
        t, held = time_kinds(engine, specs, ctx, max_len, args.repeats, args.warmup, args.seed, args.batch)
        for label, ts in t.items():
            ms[label][ctx] = statistics.median(ts) * 1e3
    top = max(args.contexts)
    print(f"max_len {max_len}; bytes held at context {top} + 1; step ms (ratio to prealloc)")
    if args.compile:
        st = engine.compile_stats
        print(f"compiled: {', '.join(s.label for s in specs if engine.compiles(s.kind))}; "
              f"compile {st['compile_s']:.1f} s (apart from the steps), {st['compile_recompiles']} recompiles over "
              f"{st['compiled_steps']} steps; the rest run eager")
    head = "".join(f"{'ctx ' + str(c) + ' ms':>20}" for c in args.contexts)
    print(f"{'cache':<34}{'bytes held':>14}{'vs prealloc':>12}{head}")
    for s in specs:
        cells = "".join(f"{ms[s.label][c]:>11.2f} ({ms[s.label][c] / ms[base.label][c]:.2f}x)"
                        for c in args.contexts)
        print(f"{s.label:<34}{held[s.label]:>14,}{held[s.label] / held[base.label]:>11.3f}x{cells}")
    print(roofline_table(engine, specs, ms, args.contexts, max_len, args.batch))
    targets = kind_targets(specs, ms, base.label, args.batch, args.contexts)
    if targets:
        print("\n".join(targets))


def kind_targets(specs: list[CacheSpec], ms: dict[str, dict[int, float]], base: str, batch: int,
                 contexts: list[int]) -> list[str]:
    """One line per KIND_TARGETS entry this run measured (its kind, batch and context): the step's ratio to
    prealloc's, the bound, and whether it is met."""
    labels = {s.label for s in specs}
    lines = []
    for text, b, ctx, bound in KIND_TARGETS:
        label = parse_kind(text).label
        if label in labels and b == batch and ctx in contexts:
            r = ms[label][ctx] / ms[base][ctx]
            lines.append(f"target: {label} at batch {b}, context {ctx}: {r:.2f}x prealloc's step (bound <= "
                         f"{bound:.2f}x) {'met' if r <= bound else 'NOT met'}")
    return lines


def roofline_table(engine, specs: list[CacheSpec], ms: dict[str, dict[int, float]], contexts: list[int],
                   max_len: int, batch: int = 1) -> str:
    """Each kind's roofline beside its step times, from this run's own bandwidth probe: the ms reading what the
    step must read (weights + every sequence's K/V at the context, as steps.csv's bytes_read) takes at the probe's
    GB/s, and that over the measured step (1: at the machine's limit)."""
    device = next(engine.model.parameters()).device
    probe = measure.bandwidth_probe(device, measure.weight_bytes(engine.model))["probe_gbps"]
    lines = [f"roofline: bytes a step reads / this run's probe ({probe:.1f} GB/s); ms (roofline ms / step ms)",
             f"{'cache':<34}" + "".join(f"{'ctx ' + str(c):>20}" for c in contexts)]
    for s in specs:
        steps = pd.DataFrame({"context_len": contexts, "mode": "cached",
                              "ms_median": [ms[s.label][c] for c in contexts]})
        roof = measure.with_bandwidth(steps, engine, s, max_len, probe, batch)  # steps.csv's own columns
        cells = "".join(f"{r.roofline_ms:>11.2f} ({r.roofline_fraction:.2f})".rjust(20) for r in roof.itertuples())
        lines.append(f"{s.label:<34}{cells}")
    return "\n".join(lines)


class Refused(SystemExit):
    """Exit 2 once the one-line refusal is printed; ``str()`` is the refusal itself (for callers and tests)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _check_specs(args: argparse.Namespace, cfg) -> None:
    """Refuse (ValueError, one line) cache specs that the mode's prompts or caches cannot honour, as a run's
    validation does: a prompt shorter than the kind takes (SnapKV's window), a ragged batch (--paged) on a kind that
    runs none, a pool too small for the caches built (paged ``blocks``), options the model's head size cannot take."""
    if args.paged:
        specs, fills = [parse_kind(k) for k in (args.cache or ["prealloc", "concat", "paged"])], (args.batch,
                                                                                                  cfg.n_positions)
        shortest, what = 1, f"--paged draws prompts of 1 .. {args.prompt_max} tokens"
    elif args.prefix:
        specs, fills = [parse_kind(k) for k in (args.cache or ["concat", "prealloc"])], (1, max(args.prefixes)
                                                                                        + args.suffix)
        shortest, what = min(args.prefixes), f"--prefixes has {min(args.prefixes)}"
    elif args.kinds:
        specs, fills = [parse_kind(k) for k in (args.cache or DEFAULT_KINDS)], (args.batch, max(args.contexts) + 1)
        shortest, what = min(args.contexts), f"--contexts has {min(args.contexts)}"
    else:
        return
    for spec in specs:
        cls, opts = spec.cls, spec.opts
        try:
            cls.check_head_dim(opts, cfg.head_dim)
        except ValueError as e:
            raise ValueError(f"--cache {spec.label}: {e} (model {args.model}'s head size is {cfg.head_dim})") from None
        if cls.min_prompt(opts) > shortest:
            need = cls.min_prompt(opts)
            raise ValueError(f"--cache {spec.label}: this kind needs prompts of at least {need} tokens (its window), "
                             f"but {what}: lower its window" + ("" if args.paged else f", or give {need} or more"))
        if args.paged and cls.why_no_padding:
            raise ValueError(f"--cache {spec.label}: --paged serves a ragged batch, and cache kind {spec.kind!r} does "
                             f"not run ragged batches: {cls.why_no_padding}")
        cls.check_fills(opts, [(f"the benchmark ({spec.label})", *fills)])


# what the benchmark accepts at all (issue 44: every input that scales is bounded before it is read or allocated);
# within these, the memory check below decides what fits this machine
MAX_BATCH = 65_536  # sequences decoded together (--kinds) or requests served (--paged)
MAX_REPEATS = 10_000  # timed steps per point (a run's cap too: harness/experiment/config.py)
MAX_WARMUP = 1_000
MAX_LIST = 64  # entries of --contexts and --prefixes, and --cache given at most this often
MAX_SEED = 2 ** 63  # torch.manual_seed takes 0 <= seed < 2**63


def _forward_bytes(cfg, B: int, T: int, rows: int, isz: int) -> int:
    """Transients of one forward of (B, T) tokens keeping ``rows`` positions' logits: the same terms as
    ``harness.experiment.memory``'s run estimate (activations, fp32 attention scores, masks, logits, ids)."""
    return (B * T * cfg.n_embd * sizes.ACT_WIDTH * isz + B * cfg.n_head * T * T * sizes.F32 + 3 * B * T * T
            + B * rows * cfg.vocab_size * isz + 2 * B * T * sizes.I64)


def _snapshot_bytes(spec: CacheSpec, nbytes: int) -> int:
    """What a kind's ``checkpoint`` copies to put a cache back (0 for a kind that crops back)."""
    return nbytes if spec.cls.checkpoint is not KVCache.checkpoint else 0


def bench_bytes(args: argparse.Namespace, cfg, batch: int | None = None) -> dict[str, int]:
    """The bytes the benchmark as asked holds at its peak, from the arguments alone (nothing is built): the
    weights (the model is built in fp32, then converted; the HF comparison adds transformers' own copy), the caches
    alive together (every kind at the longest context with --kinds, and their snapshots; one layout at a time with
    --paged; cold, warm, reuse and the snapshot with --prefix; two engines' with the HF comparison) and the largest
    forward's transients (``_forward_bytes``). ``batch`` replaces ``args.batch`` (to search what would fit)."""
    B = args.batch if batch is None else batch
    dtype = DTYPES[args.dtype or "fp32"]
    isz = itemsize(dtype)
    P = sizes.param_count(cfg)
    n_pos = cfg.n_positions
    out = {"weights": P * sizes.F32, "cache": 0, "transients": 0}
    if args.paged:
        specs = [parse_kind(k) for k in (args.cache or ["prealloc", "concat", "paged"])]
        out["cache"] = max(sizes.cache_bytes(cfg, s.kind, s.options, dtype, n_pos, B, n_pos) for s in specs)
        out["transients"] = (_forward_bytes(cfg, B, args.prompt_max, 1, sizes.F32)
                             + B * args.output_max * sizes.I64 + 2 * B * cfg.vocab_size * sizes.F32)
    elif args.prefix:
        specs = [parse_kind(k) for k in (args.cache or ["concat", "prealloc"])]
        T = max(args.prefixes) + args.suffix
        out["cache"] = max(3 * (c := sizes.cache_bytes(cfg, s.kind, s.options, dtype, T + 1, 1, T)) +
                           _snapshot_bytes(s, c) for s in specs)
        out["transients"] = _forward_bytes(cfg, 1, T, T, isz)
    elif args.kinds:
        specs = [parse_kind(k) for k in (args.cache or DEFAULT_KINDS)]
        ctx = max(args.contexts)
        for s in specs + ([] if "prealloc" in {s.kind for s in specs} else [CacheSpec("prealloc")]):
            c = sizes.cache_bytes(cfg, s.kind, s.options, dtype, n_pos, B, ctx + 1, prefilled=ctx)
            out["cache"] += c + _snapshot_bytes(s, c)
        out["transients"] = _forward_bytes(cfg, B, ctx, ctx, isz)
    elif args.peers:  # four engines' prealloc caches at the deepest context, batch 8, with their checkpoints; three
        from harness.tools.bench_peers import PROBE_MIN_BYTES

        ctx = max(args.contexts)  # more copies of the weights (HF's, llama.cpp's, an fp16 or bf16 model)
        out["weights"] += 3 * P * sizes.F32
        out["cache"] = 4 * 2 * sizes.cache_bytes(cfg, "prealloc", {}, "fp32", ctx + 1, B, ctx + 1)
        # the peak-bandwidth probe's buffer is freed before the engines are built: what it needs beyond their weights
        probe = max(PROBE_MIN_BYTES, P * sizes.F32) - 3 * P * sizes.F32
        out["transients"] = max(_forward_bytes(cfg, B, ctx, ctx, sizes.F32), probe)
    else:  # ours vs HF: batch 1, fp32, every kind transformers has a counterpart of, in both engines
        ctx = max(args.contexts)
        out["weights"] += P * sizes.F32 if ENGINES["hf"].holds_weight_copy else 0
        for kind in HF_COUNTERPARTS:
            for engine in ("kvlab", "hf"):
                c = sizes.cache_bytes(cfg, kind, _counterpart_options(kind, cfg.head_dim), "fp32", ctx + 1, 1,
                                      ctx + 1, engine, ctx)
                out["cache"] += c + c  # and its checkpoint's copy, at most
        out["transients"] = _forward_bytes(cfg, 1, ctx, ctx, sizes.F32)
    out["transients"] += math.ceil(memory.SLACK * (out["cache"] + out["transients"]))
    return out


def _needs(args: argparse.Namespace, cfg, device: torch.device, batch: int | None = None) -> dict:
    """Where the benchmark holds what: {"cpu": bytes} on a CPU; on CUDA the host builds the fp32 model first and
    the GPU holds the model in --dtype, the caches and the transients."""
    need = bench_bytes(args, cfg, batch)
    if device.type == "cpu":
        return {"cpu": sum(need.values())}
    on_gpu = sizes.param_count(cfg) * itemsize(DTYPES[args.dtype or "fp32"]) + need["cache"] + need["transients"]
    return {"cpu": need["weights"], "gpu": on_gpu}


def check_memory(args: argparse.Namespace, cfg, device: torch.device) -> str | None:
    """One line when the benchmark as asked would not fit this machine (or the GPU) less the runs' margin
    (``harness.experiment.memory.usable``), naming the sizes and what would fit; None when it fits."""
    need, needs = bench_bytes(args, cfg), _needs(args, cfg, device)
    for where, needed in needs.items():
        available = memory.available_bytes("cpu" if where == "cpu" else device)
        budget = memory.usable(available)
        if needed <= budget:
            continue
        fits = ""
        if (args.kinds or args.paged) and args.batch > 1 and _needs(args, cfg, device, 1)[where] <= budget:
            lo, hi = 1, args.batch  # the largest batch that fits (the bytes grow with it)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if _needs(args, cfg, device, mid)[where] <= budget else (lo, mid - 1)
            fits = f"--batch <= {lo} would fit, or "
        mode = next((f"--{m}" for m in ("paged", "prefix", "kinds", "peers") if getattr(args, m)), "ours vs HF")
        name = "this machine" if where == "cpu" else torch.cuda.get_device_name(device)
        smaller = "a smaller --model, " if memory.has_smaller_model(cfg) else ""  # none below tiny (13 MB)
        return (f"the benchmark ({mode}, --model {args.model}, {args.dtype}, batch {args.batch}) needs about "
                f"{memory.size(needed)} (weights {memory.size(need['weights'])}, caches {memory.size(need['cache'])}, "
                f"transients {memory.size(need['transients'])}) but {name} has {memory.size(available)} free "
                f"({memory.size(max(budget, 0))} after a {memory.size(available - budget)} margin): {fits}use "
                f"{smaller}fewer --cache kinds or shorter --contexts")
    return None


def compiled_warmup(device: torch.device) -> int:
    """The untimed steps a compiled decode step gets at least, whatever --warmup says: its first call compiles (on
    CUDA the next ``WARMUP_CALLS`` record its CUDA graphs), so it is never a timed step."""
    return 1 + (WARMUP_CALLS if device.type == "cuda" else 0)


def _bounded(ap: argparse.ArgumentParser, name: str, value: int, lo: int, hi: int, what: str) -> None:
    if not lo <= value <= hi:
        ap.error(f"{name} {value:,} is beyond what the benchmark runs: give {lo:,} .. {hi:,} ({what})")


def _device(ap: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The --device asked for, refused in one line when it is not a device this machine has."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r} is not a device: give cpu or cuda (or cuda:N)")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device!r}: give cpu or cuda (or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device} but torch {torch.__version__} sees no CUDA device here: use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        ap.error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                 f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return device


def _check_lengths(ap: argparse.ArgumentParser, args: argparse.Namespace, cfg) -> None:
    """The lengths each mode runs (contexts, prefixes + suffix, prompt + output) fit the model's positions."""
    if args.paged and min(args.batch, args.prompt_max, args.output_max) < 1:
        ap.error(f"--batch, --prompt-max and --output-max must be >= 1 (got {args.batch}, {args.prompt_max}, "
                 f"{args.output_max})")
    if args.paged and args.prompt_max + args.output_max > cfg.n_positions:
        ap.error(f"--prompt-max {args.prompt_max} + --output-max {args.output_max} exceeds n_positions "
                 f"{cfg.n_positions} of {args.model}")
    if args.cache and not (args.kinds or args.prefix or args.paged):
        ap.error("--cache is for --kinds or --prefix; the HF comparison runs every kind transformers has a counterpart "
                 "of")
    if args.prefix:
        if args.suffix < 1 or min(args.prefixes) < 1:
            ap.error(f"--suffix and --prefixes must be >= 1 token (got {args.suffix}, {args.prefixes})")
        if max(args.prefixes) + args.suffix + 1 > cfg.n_positions:
            ap.error(f"prefix {max(args.prefixes)} + suffix {args.suffix} + 1 exceeds n_positions {cfg.n_positions} "
                     f"of {args.model}")
    for ctx in [] if args.prefix or args.paged else args.contexts:
        if ctx < 1:
            ap.error(f"context {ctx}: contexts must be >= 1 token")
        if ctx + 1 > cfg.n_positions:
            ap.error(f"context {ctx} + 1 decode token exceeds n_positions {cfg.n_positions} of {args.model}")


def peer_models() -> list[str]:
    """The presets --peers runs: those kvlab converts to GGUF for llama.cpp (``models.gguf.gguf_refuses``; asked of
    the config alone, llama.cpp need not be built)."""
    return [name for name in sorted(PRESETS) if gguf_refuses(preset_config(name)) is None]


def _dtype_names(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str] | None:
    """--dtype as a list of names (``DTYPES``' keys), each refused in one line when it names no dtype; a comma list
    is refused with --kinds (it times one dtype); None when not given."""
    if args.dtype is None:
        return None
    names = [d.strip() for d in args.dtype.split(",")]
    bad = [d for d in names if d not in DTYPES]
    if bad:
        ap.error(f"--dtype {args.dtype}: {', '.join(repr(d) for d in bad)} names no dtype: give "
                 + ("a comma list of fp32, fp16, bf16 (default all three)" if args.peers
                    else f"one of {', '.join(sorted(DTYPES))}"))
    if len(names) > 1 and args.kinds:  # (the other modes run fp32: check_args refuses any other --dtype there)
        ap.error(f"--dtype {args.dtype}: --kinds times one dtype: give one of {', '.join(sorted(DTYPES))} (a comma "
                 "list is for --peers)")
    return names


def _peer_grid(ap: argparse.ArgumentParser, args: argparse.Namespace, cfg) -> None:
    """--peers' model (one llama.cpp runs) and grid: the --dtype list (default fp32, fp16, bf16; its order is the
    grid's outer loop) and batches 1 and 8, or only the --batch given (``peer_dtypes``: the list; ``peer_batches``:
    None for both). The model is built in fp32 and each dtype's engines are converted from it."""
    from harness.tools.bench_peers import PEER_DTYPES

    why = gguf_refuses(cfg)
    if why:
        ap.error(f"--peers times llama.cpp on kvlab's GGUF conversion of the model, which cannot convert --model "
                 f"{args.model} ({why}): with --peers give --model one of {', '.join(peer_models())}")
    if args.compile:
        ap.error("--peers times ours eager and compiled already: drop --compile")
    names = _dtype_names(ap, args)
    canon = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    dtypes = [canon[DTYPES[d]] for d in names] if names else list(PEER_DTYPES)
    twice = sorted({d for d in dtypes if dtypes.count(d) > 1})
    if twice:
        ap.error(f"--dtype {args.dtype} gives {', '.join(twice)} more than once (each dtype is timed once): give "
                 "each once")
    args.peer_dtypes, args.peer_batches, args.dtype = dtypes, args.batch, "fp32"


def _mode_args(ap: argparse.ArgumentParser, args: argparse.Namespace, cfg) -> None:
    """--peers' grid, or the one --dtype of the other modes (and no --without: it belongs to --peers)."""
    if args.peers:
        _peer_grid(ap, args, cfg)
        return
    _dtype_names(ap, args)
    if args.without:
        ap.error("--without leaves an engine out of --peers' grid: give it with --peers")


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, cfg) -> torch.device:
    """Refuse, in one line each (exit 2), what the benchmark cannot honour, before anything is built: every count
    bounded (``MAX_*``), then the memory it would need against what is free (``check_memory``); fill in the
    defaults. Returns the device to run on."""
    modes = [m for m in ("kinds", "prefix", "paged", "peers") if getattr(args, m)]
    if len(modes) > 1:
        ap.error(f"{' and '.join('--' + m for m in modes)}: give one of --kinds, --prefix, --paged, --peers (or "
                 "none: ours vs HF)")
    _mode_args(ap, args, cfg)
    args.dtype = args.dtype or "fp32"
    for flag, value, mode in (("--prefixes", args.prefixes, "prefix"), ("--suffix", args.suffix, "prefix"),
                              ("--prompt-max", args.prompt_max, "paged"), ("--output-max", args.output_max, "paged")):
        if value is not None and not getattr(args, mode):
            ap.error(f"{flag} is for --{mode}")
    if args.contexts is not None and (args.prefix or args.paged):
        ap.error("--contexts is for --kinds and the HF comparison; --prefix takes --prefixes, --paged draws its "
                 "lengths from --prompt-max and --output-max")
    args.prefixes = args.prefixes or [16, 64, 256, 512]
    args.suffix = 16 if args.suffix is None else args.suffix
    args.prompt_max = 512 if args.prompt_max is None else args.prompt_max
    args.output_max = 256 if args.output_max is None else args.output_max
    if args.batch is None:
        args.batch = 16 if args.paged else 8 if args.peers else 1
    if args.batch < 1:
        ap.error(f"--batch must be >= 1 (got {args.batch})")
    _bounded(ap, "--batch", args.batch, 1, MAX_BATCH, "sequences decoded or requests served together")
    if args.batch != 1 and not (args.kinds or args.paged or args.peers):
        ap.error("--batch is for --kinds or --paged; the HF comparison and --prefix run one sequence")
    if args.compile and not (args.kinds or args.paged):
        ap.error("--compile is for --kinds or --paged (the compiled decode step beside the eager kinds)")
    if not 0 <= args.seed < MAX_SEED:
        ap.error(f"--seed {args.seed}: use an integer 0 <= seed < 2**63")
    device = _device(ap, args)
    if device.type != "cpu" and not args.kinds:
        ap.error("--device is for --kinds; the HF comparison, --prefix, --paged and --peers run on the CPU")
    if args.dtype != "fp32" and not args.kinds:
        ap.error("--dtype is for --kinds and --peers; the HF comparison, --prefix and --paged run fp32")
    args.contexts = args.contexts or ([32, 128, 512, 960] if args.kinds else [128, 512, 960] if args.peers
                                      else [32, 512])
    _check_counts(ap, args, device)
    if args.kinds and not args.cache:
        args.cache = default_kinds(cfg.head_dim)
    _check_lengths(ap, args, cfg)
    try:
        labels = [parse_kind(k).label for k in args.cache or []]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(f"--cache gives {', '.join(twice)} more than once (a cache is timed once): give each "
                             "cache once")
        _check_specs(args, cfg)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    too_much = check_memory(args, cfg, device)
    if too_much:
        ap.error(too_much)
    return device


def _check_counts(ap: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> None:
    """The timed steps (``--repeats``, ``--warmup``: at least the compiled first calls') and the lists' lengths, each
    given once, refused in one line each; defaults filled in."""
    if args.paged and (args.repeats is not None or args.warmup is not None):
        ap.error("--repeats and --warmup are for the timed modes: --paged times each decode step of the batch it "
                 "serves once (with --compile, a call that compiles is not timed)")
    args.repeats = 30 if args.repeats is None else args.repeats
    args.warmup = 5 if args.warmup is None else args.warmup
    if args.repeats < 1 or args.warmup < 0:
        ap.error(f"--repeats must be >= 1 and --warmup >= 0 (got {args.repeats}, {args.warmup})")
    _bounded(ap, "--repeats", args.repeats, 1, MAX_REPEATS, "timed steps per point")
    _bounded(ap, "--warmup", args.warmup, 0, MAX_WARMUP, "untimed steps first")
    args.warmup_given = args.warmup
    if (args.compile and args.kinds) or args.peers:  # a compiled step's first call compiles: never a timed step
        args.warmup = max(args.warmup, compiled_warmup(device))
    for flag, values in (("--contexts", args.contexts), ("--prefixes", args.prefixes), ("--cache", args.cache or [])):
        if len(values) > MAX_LIST:
            ap.error(f"{flag} has {len(values):,} entries: give at most {MAX_LIST}")
    for flag, values in (("--contexts", [] if args.prefix or args.paged else args.contexts),
                         ("--prefixes", args.prefixes if args.prefix else [])):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            ap.error(f"{flag} {' '.join(map(str, values))} repeats {', '.join(map(str, twice))}: give each length "
                     "once (each is timed once)")




def main(argv=None):
    """The benchmark the flags ask for; a closed stdout (``| head``) ends it quietly (``reader_gone``)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        raise SystemExit(reader_gone()) from None


def _parser() -> argparse.ArgumentParser:
    """bench's flags; its errors one line each (``Refused``, exit 2), never argparse's usage block first."""
    ap = argparse.ArgumentParser(prog="python -m harness.bench", description=__doc__.splitlines()[0])

    def error(message):  # one line, exit 2 (argparse would print the usage first)
        print(f"bench: error: {message} (see python -m harness.bench --help)", file=sys.stderr)
        raise Refused(message)

    ap.error = error
    ap.add_argument("--model", default="gpt2", choices=sorted(PRESETS), metavar="MODEL",
                    help=f"a preset: {', '.join(sorted(PRESETS))} (default gpt2); with --peers one llama.cpp runs "
                         f"(kvlab converts it to GGUF): {', '.join(peer_models())}")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="each length once; default: 32 512 (vs HF); 32 128 512 960 (--kinds); 128 512 960 (--peers)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per point (default 30; not with --paged)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps before them (default 5; not with --paged). A compiled step's first call "
                         "compiles, so it is never timed: with --kinds --compile and with --peers (ours compiled) "
                         f"at least 1 runs (on CUDA {compiled_warmup(torch.device('cuda'))}: its CUDA graphs are "
                         "recorded), --warmup 0 included; the header says how many ran")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", action="store_true", help="compare our cache kinds instead of ours vs HF")
    ap.add_argument("--cache", action="append", metavar="KIND[:OPT=V,...]",
                    help=f"with --kinds or --prefix: a cache to time (repeatable); kinds: {', '.join(CACHE_KINDS)}")
    ap.add_argument("--prefix", action="store_true", help="time to first token with and without prefix reuse")
    ap.add_argument("--prefixes", type=int, nargs="+", default=None, help="with --prefix (default 16 64 256 512)")
    ap.add_argument("--suffix", type=int, default=None, help="with --prefix: each request's own tokens (default 16)")
    ap.add_argument("--paged", action="store_true", help="a ragged batch served on each layout: KV waste, step time")
    ap.add_argument("--peers", action="store_true",
                    help="ours (eager, compiled) vs HF vs llama.cpp: fp32, fp16 and bf16, batch 1 and 8 (or the "
                         "--dtype list and --batch given), as ratios to llama.cpp's step, with the GB/s our step "
                         "reaches against the machine's peak read bandwidth and the targets met or missed")
    ap.add_argument("--without", action="append", choices=["hf"], default=None,
                    help="with --peers: leave this engine out of the grid (hf: its fp16 prefill of a batch runs "
                         "through torch's half-precision GEMM, tens of minutes a cell on a CPU)")
    ap.add_argument("--batch", type=int, default=None,
                    help="with --kinds: sequences decoded together (default 1); with --paged: requests served "
                         "together (default 16); with --peers: only this batch's rows (default both 1 and 8)")
    ap.add_argument("--dtype", default=None, metavar="DTYPE",
                    help=f"the model's and its caches' dtype, one of {', '.join(sorted(DTYPES))} (default fp32); "
                         "with --peers a comma list of fp32, fp16, bf16, timed in that order (default "
                         "fp32,fp16,bf16)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    ap.add_argument("--compile", action="store_true",
                    help="with --kinds or --paged: the kinds our engine compiles decode compiled (compile=true); "
                         "the rest eager")
    ap.add_argument("--prompt-max", type=int, default=None, help="with --paged: longest prompt drawn (default 512)")
    ap.add_argument("--output-max", type=int, default=None, help="with --paged: longest output drawn (default 256)")
    return ap


def _main(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        cpu_kernels.mode_now()  # KVLAB_KERNELS: a path this machine runs, before anything is built
    except ValueError as e:
        ap.error(str(e))
    cfg = preset_config(args.model)
    device = check_args(ap, args, cfg)
    torch.manual_seed(args.seed)
    model = build(cfg).eval().to(device, DTYPES[args.dtype])
    if args.paged:
        print(f"model {args.model} (seeded random init, seed {args.seed}), fp32, torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
        return bench_paged(args, model)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    grid = f"{args.dtype}, batch {args.batch}"
    if args.peers:
        from harness.tools.bench_peers import PEER_BATCHES, PEER_DTYPES

        grid = (f"{', '.join(args.peer_dtypes or PEER_DTYPES)}, batch "
                f"{args.peer_batches or ' and '.join(map(str, PEER_BATCHES))}")
    raised = (f" (--warmup {args.warmup_given} raised: a compiled step's first call compiles, never a timed step)"
              if args.warmup != args.warmup_given else "")
    print(f"model {args.model} (seeded random init, seed {args.seed}), {grid}, "
          f"{args.device}, torch {torch.__version__}, {where}; median of {args.repeats} steps after {args.warmup} "
          f"warm-up{raised}")
    if args.peers:
        from harness.tools.bench_peers import bench_peers

        return bench_peers(args, model)
    (bench_prefix if args.prefix else bench_kinds if args.kinds else bench_hf)(args, model)

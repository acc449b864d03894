"""The cache-kind conformance checks, as a command and as functions: ``python -m harness.conformance
package.module:ClassName [--options JSON | k=v ...]`` runs them on a class written against ``models.kv_cache`` and
prints one line per check (its name and, on failure, what differed); exit 0 when every check passes, 1 when one
fails, 2 when the target does not load or the options do not parse.

The checks (``CHECKS``; each a function of the class and one option set that raises ``Failed``) run with each
option set of the class's ``examples`` (or the one ``--options`` gives), on caches of 2 layers, 3 K/V heads of 8
channels, 40 slots and 2 sequences, written with seeded random K/V as a model writes them:

- contract: a ``KVCache`` subclass with a kind, ``Options`` a frozen dataclass of int/float/bool/str fields whose
  defaults parse, ``exact`` a bool, ``held_tokens`` and ``nbytes_formula`` implemented, a label per option set;
- update/pos: ``update`` returns K and V shaped (batch, heads, keys, head_dim) in the storage dtype and never moves
  ``pos``; ``advance`` does; an update past ``max_len`` is refused and writes nothing;
- what update returns: at the key positions the kind declares, exactly what was written (an exact kind), within
  ``error_bound`` (a lossy one); every key the kind's reference shows a new query among them; an evicting kind:
  what it held plus the new positions;
- keeps its slots (an evicting kind): each head keeps min(its slots, tokens) distinct positions of those;
- nbytes = formula: after every write, the bytes of every tensor the cache holds (``held_buffers``: nothing hides)
  equal ``nbytes_formula``, and ``held`` equals ``held_tokens``;
- reset, crop, snapshot/restore: round trips that the next write tells apart from a cache that never left;
- generation = reference: greedy generation through the kind on a tiny seeded model (GPT-2, or a Llama-family one
  for options that need rotary positions) equals its uncached reference (``model(idx, **cls.reference(opts),
  keep=...)``): tokens identical and logits within 1e-4 in fp32 for an exact kind; a lossy kind's K and V within
  its ``error_bound`` on what the model writes.

Each check takes milliseconds per option set; the model's, a second or so per kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from dataclasses import dataclass
from typing import Callable

import torch

from harness.common.errors import ConfigError, one_line
from harness.core import kinds
from models.generate import decode_step, greedy_loop, prefill
from models.kv_cache import KeepRecord, KVCache
from models.kv_cache.base import held_buffers, storage_nbytes

GEOM = dict(n_layer=2, n_kv_head=3, head_dim=8)  # head_dim 8 is not a multiple of every group size
MAX_LEN, BATCH = 40, 2
CHUNKS = (5, 1, 1, 7, 1, 1, 3, 1, 9, 1, 1, 1, 2, 1)  # a prefill, decode steps and chunks: 35 tokens
PROMPTS, NEW_TOKENS, LOGIT_TOL = (3, 11, 20), 24, 1e-4  # the model check's prompt lengths, tokens, fp32 bound
OPTION_TYPES = (int, float, bool, str)  # what a config file can hold


class Failed(Exception):
    """A check's finding: what differed, in one line."""


def expect(ok: bool, why: str) -> None:
    if not ok:
        raise Failed(why)


@dataclass(frozen=True)
class Outcome:
    """One check over every option set: passed, or the option set and what differed."""

    check: str
    passed: bool
    detail: str = ""

    def line(self) -> str:
        return f"ok    {self.check}" if self.passed else f"FAIL  {self.check}: {self.detail}"


def make(cls: type[KVCache], opts: dict, max_len: int = MAX_LEN, batch: int = BATCH,
         dtype: torch.dtype = torch.float32) -> KVCache:
    return cls(GEOM["n_layer"], GEOM["n_kv_head"], GEOM["head_dim"], max_len, batch, dtype=dtype, **opts)


def random_probs(cache: KVCache, key_pos: torch.Tensor, t: int, g: torch.Generator, dtype) -> torch.Tensor:
    """Attention probabilities (B, nh, t, keys) to hand a kind that scores: random, over the keys each new query may
    see (held, or its own forward's up to itself; a padding query sees every key)."""
    q = torch.arange(cache.pos, cache.pos + t).view(1, t) - (0 if cache.pad is None else cache.pad.view(-1, 1))
    q = q.view(-1, 1, t, 1)
    see = ((key_pos.unsqueeze(2) >= 0) & (key_pos.unsqueeze(2) <= q)) | (q < 0)
    logits = torch.randn(see.shape, generator=g) * 3
    return logits.masked_fill(~see, float("-inf")).softmax(-1).to(dtype)


class Writer:
    """Writes seeded random K/V into a cache as the model does (each layer's update, then for an evicting kind its
    choice after attention, then ``advance``) and remembers everything it wrote. ``pos`` must not move until then."""

    def __init__(self, cache: KVCache, seed: int = 0):
        self.cache, self.g = cache, torch.Generator().manual_seed(seed)
        shape = (cache.batch, cache.n_kv_head, 0, cache.head_dim)
        self.k = [torch.empty(shape) for _ in range(cache.n_layer)]
        self.v = [torch.empty(shape) for _ in range(cache.n_layer)]

    def chunk(self, t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.cache
        shape = (c.batch, c.n_kv_head, t, c.head_dim)
        scale = torch.linspace(0.5, 6.0, c.head_dim)  # K with an outlier channel, as real K has
        return [((torch.randn(shape, generator=self.g) * scale).to(c.dtype), torch.randn(shape, generator=self.g)
                 .to(c.dtype)) for _ in range(c.n_layer)]

    def write(self, t: int, data=None) -> tuple[list, list]:
        """One forward of ``t`` tokens: what each layer's update returned and the key positions declared for it
        (per layer: None for the whole history, or a tensor, (keys,), (B, keys) or (B, nh, keys))."""
        c, data = self.cache, data or self.chunk(t)
        before, returned, declared = c.pos, [], []
        shared = c.key_positions(t)
        for layer, (k, v) in enumerate(data):
            per_head = c.layer_key_positions(layer, t)
            declared.append(per_head if per_head is not None else shared)
            returned.append(c.update(layer, k, v))
            expect(c.pos == before, f"update of layer {layer} moved pos from {before} to {c.pos}: only advance may")
            if c.evicts:
                probs = random_probs(c, per_head, t, self.g, k.dtype) if c.wants_scores else None
                c.after_attention(layer, probs)
            self.k[layer] = torch.cat([self.k[layer], k.float()], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v.float()], dim=2)
        c.advance(t)
        expect(c.pos == before + t, f"advance({t}) moved pos from {before} to {c.pos}, not to {before + t}")
        return returned, declared


def replay(cls, opts, chunks, seed: int = 0, **kw) -> tuple[KVCache, Writer]:
    cache = make(cls, opts, **kw)
    w = Writer(cache, seed)
    for t in chunks:
        w.write(t)
    return cache, w


def same_writes(a: list, b: list) -> bool:
    """Two writes returned the same K/V (``returned`` lists of (K, V) per layer)."""
    return all(torch.equal(x, y) for (ka, va), (kb, vb) in zip(a, b) for x, y in ((ka, kb), (va, vb)))


def next_write_agrees(cache: KVCache, twin: KVCache, what: str, t: int = 2, seed: int = 9) -> None:
    """The same chunk written into both returns the same K/V at the same key positions."""
    data = Writer(twin, seed).chunk(t)
    (a, pa), (b, pb) = Writer(cache).write(t, data), Writer(twin).write(t, data)
    same_pos = all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                   for x, y in zip(pa, pb))
    expect(same_pos and same_writes(a, b), f"{what}: the next write returns other K/V or positions than a cache "
                                           "that never left that state")


# ---- the checks ---------------------------------------------------------------------------------------------------

def check_contract(cls, opts: dict) -> None:
    expect(isinstance(cls, type) and issubclass(cls, KVCache), f"{cls!r} is not a models.kv_cache.KVCache subclass")
    expect(isinstance(cls.kind, str) and kinds.KIND_NAME.fullmatch(cls.kind) is not None,
           f"kind {cls.kind!r} is not a name (lowercase letters, digits, _)")
    params = getattr(cls.Options, "__dataclass_params__", None)
    expect(params is not None and params.frozen, "Options is not a frozen dataclass (@dataclass(frozen=True))")
    hints = typing.get_type_hints(cls.Options)
    bad = [f.name for f in dataclasses.fields(cls.Options) if hints.get(f.name) not in OPTION_TYPES]
    expect(not bad, f"option {', '.join(bad)} is not typed int, float, bool or str (what a config file holds)")
    try:
        cls.parse_options(**cls.option_defaults())
    except (TypeError, ValueError) as e:
        raise Failed(f"Options' defaults do not parse: {one_line(e)}") from None
    expect(isinstance(cls.exact, bool), f"exact is {cls.exact!r}, not a bool")
    expect(isinstance(cls.examples, (tuple, list)) and len(cls.examples) > 0
           and all(isinstance(e, dict) for e in cls.examples), "examples is not a non-empty tuple of option dicts")
    o = cls.parse_options(**opts)
    for what, call in (("held_tokens", lambda: cls.held_tokens(MAX_LEN, 7, o)),
                       ("nbytes_formula", lambda: cls.nbytes_formula(2, 3, 8, MAX_LEN, 2, torch.float32, 7, o))):
        try:
            value = call()
        except NotImplementedError:
            raise Failed(f"{what} is not implemented (docs/cache-kinds.md#adding-a-cache-kind)") from None
        expect(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
               f"{what} gave {value!r}, not a count")
    label = cls.label(o)
    expect(isinstance(label, str) and label.strip() != "", f"label gave {label!r}")
    labels = [cls.label(cls.parse_options(**e)) for e in cls.examples]
    expect(len(set(labels)) == len(labels), f"two examples share a label ({labels}): a sweep's table would merge them")


def check_update(cls, opts: dict) -> None:
    """update/pos, in fp32 and bf16: shapes and dtype of what update returns, pos moved by advance alone, and an
    update past max_len refused without writing anything."""
    for dtype in (torch.float32, torch.bfloat16):
        cache = make(cls, opts, dtype=dtype)
        w = Writer(cache)
        for t in CHUNKS:
            returned, _ = w.write(t)
            for layer, (k, v) in enumerate(returned):
                want = (cache.batch, cache.n_kv_head)
                expect(k.shape == v.shape and tuple(k.shape[:2]) == want and k.shape[3] == cache.head_dim,
                       f"layer {layer} returned K {tuple(k.shape)}, V {tuple(v.shape)}: not (batch, heads, keys, "
                       f"head_dim) = ({want[0]}, {want[1]}, keys, {cache.head_dim})")
                expect(k.dtype == v.dtype == dtype, f"layer {layer} returned {k.dtype}/{v.dtype} from a {dtype} cache")
    cache, w = replay(cls, opts, (7, 3), max_len=12)
    twin, _ = replay(cls, opts, (7, 3), max_len=12)
    k, v = w.chunk(3)[0]
    try:
        cache.update(0, k, v)
        raise Failed("an update of 3 tokens at pos 10 of max_len 12 was taken, not refused")
    except ValueError:
        pass
    expect(cache.pos == 10, f"a refused update moved pos to {cache.pos}")
    next_write_agrees(cache, twin, "after a refused update past max_len")


def _rows(declared, n: int, batch: int, heads: int) -> torch.Tensor:
    """Declared key positions as (B, nh, keys); None: the whole history 0 .. n - 1."""
    pos = torch.arange(n) if declared is None else declared.cpu()
    while pos.dim() < 3:
        pos = pos.unsqueeze(0 if pos.dim() == 1 else 1)
    return pos.expand(batch, heads, pos.shape[-1])


def _visible(q: int, n: int, reference: dict) -> set[int]:
    """Positions the reference lets a query at q see among 0..n-1 (a window's rule; full attention otherwise)."""
    window, sinks = reference.get("window"), reference.get("sinks", 0)
    return {j for j in range(min(n, q + 1)) if window is None or j < sinks or j > q - window}


def check_returns(cls, opts: dict) -> None:
    """What update returns is what was written at the key positions the kind declares: exactly (an exact kind),
    within error_bound (a lossy one); an evicting kind hands over what it held plus the new positions."""
    cache = make(cls, opts)
    w, reference = Writer(cache), cls.reference(cache.opts)
    held = None
    for t in CHUNKS:
        before = cache.pos
        returned, declared = w.write(t)
        for layer, ((k, v), pos) in enumerate(zip(returned, declared)):
            rows = _rows(pos, before + t, cache.batch, cache.n_kv_head)
            bound = cache.error_bound(layer)
            expect(cache.exact == (bound is None), f"error_bound is {'not ' * (bound is None)}None for a kind whose "
                                                   f"exact is {cache.exact}")
            for b in range(cache.batch):
                for h in range(cache.n_kv_head):
                    kp = rows[b, h]
                    valid = kp >= 0
                    got = kp[valid].tolist()
                    where = f"layer {layer} sequence {b} head {h} after {before + t} tokens"
                    expect(len(set(got)) == len(got) and max(got) < before + t,
                           f"{where}: declared key positions {got} repeat one or lie ahead")
                    if cache.evicts:
                        was = [] if held is None else held[layer][b, h][held[layer][b, h] >= 0].tolist()
                        expect(sorted(got) == sorted(was + list(range(before, before + t))),
                               f"{where}: update handed over positions {sorted(got)}, not the {len(was)} held plus "
                               f"{before}..{before + t - 1}")
                    for q in range(before, before + t):
                        missing = _visible(q, before + t, reference) - set(got)
                        expect(cache.evicts or not missing, f"{where}: the reference shows the query at {q} "
                                                            f"positions {sorted(missing)}, which update did not return")
                    bk, bv = (None, None) if bound is None else (bound[0][b, h][valid], bound[1][b, h][valid])
                    _agrees(k[b, h][valid], w.k[layer][b, h][got], bk, cache.dtype, f"{where}: K")
                    _agrees(v[b, h][valid], w.v[layer][b, h][got], bv, cache.dtype, f"{where}: V")
        if cache.evicts:
            held = [cache.kept_positions(layer).cpu() for layer in range(cache.n_layer)]


def _agrees(got: torch.Tensor, written: torch.Tensor, bound, dtype, where: str) -> None:
    want = written.to(dtype)
    if bound is None:
        bad = (got.to(dtype) != want).any(-1).nonzero().flatten().tolist()
        expect(not bad, f"{where} of key {bad[0] if bad else ''} (of those returned) differs from what was written")
        return
    over = (got.float() - want.float()).abs() > bound.float() * (1 + 1e-5) + 1e-6
    expect(not over.any(), f"{where}: {int(over.sum())} values lie beyond error_bound of what was written")


def check_keeps(cls, opts: dict) -> None:
    """An evicting kind: after every forward each head keeps min(its slots, tokens) distinct positions, all among
    those it attended over."""
    if not cls.evicts:
        return
    cache = make(cls, opts)
    w = Writer(cache)
    for t in CHUNKS:
        _, declared = w.write(t)
        for layer in range(cache.n_layer):
            kept = cache.kept_positions(layer).cpu()
            seen = _rows(declared[layer], cache.pos, cache.batch, cache.n_kv_head)
            slots = cache.slots_of(layer) if hasattr(cache, "slots_of") else \
                [[cache.held] * cache.n_kv_head] * cache.batch
            for b in range(cache.batch):
                for h in range(cache.n_kv_head):
                    have = kept[b, h][kept[b, h] >= 0].tolist()
                    want = min(slots[b][h], cache.pos)
                    where = f"layer {layer} sequence {b} head {h} after {cache.pos} tokens"
                    expect(len(set(have)) == len(have) == want,
                           f"{where} keeps {len(set(have))} distinct positions, not min(slots {slots[b][h]}, tokens "
                           f"{cache.pos}) = {want}")
                    expect(set(have) <= set(seen[b, h].tolist()), f"{where} keeps a position it never attended over")


def check_nbytes(cls, opts: dict) -> None:
    """nbytes = formula after every write, in fp32 and fp16; the tensors the cache holds, walked here, too."""
    for dtype in (torch.float32, torch.float16):
        cache = make(cls, opts, dtype=dtype)
        w = Writer(cache)
        for t in (0, *CHUNKS):
            if t:
                w.write(t)
            n = cache.pos
            want = cls.nbytes_formula(GEOM["n_layer"], GEOM["n_kv_head"], GEOM["head_dim"], MAX_LEN, BATCH, dtype, n,
                                      cache.opts)
            tensors, arrays = held_buffers(cache)
            walked = storage_nbytes([x for x in tensors if x is not cache.pad], arrays)
            expect(cache.nbytes == want and (cls.pooled or walked == want),
                   f"{dtype} after {n} tokens: nbytes {cache.nbytes:,}, the tensors held {walked:,}, "
                   f"nbytes_formula {want:,}")
            held = cls.held_tokens(MAX_LEN, n, cache.opts)
            expect(cache.held == held, f"after {n} tokens: held {cache.held}, held_tokens {held}")


def check_reset(cls, opts: dict) -> None:
    cache, _ = replay(cls, opts, (9,), seed=1)
    cache.reset()
    expect(cache.pos == 0, f"reset left pos at {cache.pos}")
    next_write_agrees(cache, make(cls, opts), "after reset", t=6)


def check_crop(cls, opts: dict) -> None:
    """Each length the kind says it can crop to gives the cache that wrote only that many tokens; the others are
    refused (ValueError)."""
    chunks = (6, 1, 1, 5, 1, 1, 1, 1)
    total = sum(chunks)
    for m in range(total + 1):
        cache, w = replay(cls, opts, chunks)
        if not cache.can_crop(m):
            try:
                cache.crop(m)
                raise Failed(f"crop({m}) went through where can_crop({m}) is False")
            except ValueError:
                continue
        cache.crop(m)
        expect(cache.pos == m, f"crop({m}) left pos at {cache.pos}")
        if cache.evicts:  # an evicting cache crops to pos alone: its state is its whole history
            expect(m == total, f"an evicting kind cropped from {total} to {m} tokens")
            twin, _ = replay(cls, opts, chunks)
        else:
            twin = make(cls, opts)
            if m:
                Writer(twin).write(m, [(k[:, :, :m].to(twin.dtype), v[:, :, :m].to(twin.dtype))
                                       for k, v in zip(w.k, w.v)])
        next_write_agrees(cache, twin, f"after crop({m})")
    cache, _ = replay(cls, opts, chunks)
    try:
        cache.crop(total + 1)
        raise Failed(f"crop({total + 1}) of a cache holding {total} tokens went through")
    except ValueError:
        pass


def check_snapshot(cls, opts: dict) -> None:
    """restore(snapshot()) gives back the state (also after writes, twice), checkpoint() too, a snapshot shares no
    storage with the cache (a pooled kind's names its blocks), and a snapshot of another cache is refused."""
    chunks = (6, 1, 1, 4, 1)
    cache, _ = replay(cls, opts, chunks)
    snap = cache.snapshot()
    if not cls.pooled:
        mine = {x.untyped_storage().data_ptr() for x in held_buffers(cache)[0] if x.untyped_storage().nbytes()}
        theirs = {x.untyped_storage().data_ptr() for x in held_buffers(snap)[0] if x.untyped_storage().nbytes()}
        expect(not mine & theirs, "the snapshot shares storage with the cache: later writes would reach it")
    for attempt in ("after restore", "after a second restore"):
        Writer(cache, seed=5).write(3)
        cache.restore(snap)
        expect(cache.pos == sum(chunks), f"{attempt}: pos {cache.pos}, not {sum(chunks)}")
        next_write_agrees(cache, replay(cls, opts, chunks)[0], attempt)
    cache, _ = replay(cls, opts, chunks)
    back = cache.checkpoint()
    Writer(cache, seed=4).write(1)
    back()
    next_write_agrees(cache, replay(cls, opts, chunks)[0], "after checkpoint()()")
    other = make(cls, opts, max_len=MAX_LEN + 1) if not cls.pooled else None
    if other is not None:
        try:
            other.restore(snap)
            raise Failed("a snapshot of a cache of max_len 40 restored into one of max_len 41")
        except ValueError:
            expect(other.pos == 0, "a refused restore moved pos")


_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(rotary: bool = False) -> torch.nn.Module:
    """The model check's model, seeded, built once a process: kvlab's ``tiny`` GPT-2, or ``tiny-gqa`` (the Llama
    family: rotary positions, 4 query heads over 2 K/V heads)."""
    from models.families import build, preset_config

    name = "tiny-gqa" if rotary else "tiny"
    if name not in _MODELS:
        torch.manual_seed(0)
        _MODELS[name] = build(preset_config(name)).eval()
    return _MODELS[name]


def generate(model, prompt: torch.Tensor, cache: KVCache):
    """Greedy generation of ``NEW_TOKENS`` through ``cache`` (its prefill, then a token a step), noting what an
    evicting kind held before each forward: (tokens, logits, keep record or None)."""
    keeps = KeepRecord() if cache.evicts else None

    def forward(ids, first=False):
        if keeps is not None:
            keeps.note(cache, ids.shape[1])
        return (prefill(model, ids, cache, last_only=True) if first else decode_step(model, ids, cache))[0][:, -1]

    out = greedy_loop(lambda: forward(prompt, first=True), forward, NEW_TOKENS)
    if keeps is not None:  # the forward the last token would get: what the cache holds now, and itself
        keeps.note(cache, 1)
    return out.tokens, out.logits, keeps


def bounded(cache: KVCache) -> list[int]:
    """Wrap a lossy cache's update to check, on every call, what it returns against what was written and its
    ``error_bound``; the list counts the calls checked."""
    written = [([], []) for _ in range(cache.n_layer)]
    inner, calls = cache.update, []

    def update(layer, k, v):
        written[layer][0].append(k.to(cache.dtype))
        written[layer][1].append(v.to(cache.dtype))
        kr, vr = inner(layer, k, v)
        kb, vb = cache.error_bound(layer)
        for name, got, want, bound in (("K", kr, written[layer][0], kb), ("V", vr, written[layer][1], vb)):
            want = torch.cat(want, dim=2)
            over = (got.float() - want.float()).abs() > bound * (1 + 1e-5) + 1e-6
            expect(not over.any(), f"layer {layer}, {cache.pos} tokens in: {name} lies beyond error_bound of what the "
                                   f"model wrote at {int(over.sum())} values")
        calls.append(layer)
        return kr, vr

    cache.update = update
    return calls


@torch.inference_mode()
def check_generation(cls, opts: dict) -> None:
    """Greedy generation through the kind equals its uncached reference (an exact kind: tokens identical, logits
    within 1e-4 in fp32), or stays within its error_bound on what the model writes (a lossy kind)."""
    o = cls.parse_options(**opts)
    model = tiny_model(rotary=cls.needs_rotary(o) is not None)
    c, g = model.config, torch.Generator().manual_seed(0)
    for n in PROMPTS:
        n = max(n, cls.min_prompt(o))
        prompt = torch.randint(0, c.vocab_size, (1, n), generator=g)
        cache = cls(c.n_layer, c.n_kv_head, c.head_dim, n + NEW_TOKENS, 1, dtype=torch.float32, **opts)
        calls = None if cls.exact else bounded(cache)
        tokens, logits, keeps = generate(model, prompt, cache)
        if calls is not None:
            expect(len(calls) == NEW_TOKENS * c.n_layer, f"{len(calls)} updates checked, not {NEW_TOKENS * c.n_layer}")
            continue
        ref = model(torch.cat([prompt, tokens], dim=1), **cls.reference(o), **({} if keeps is None else
                                                                                 {"keep": keeps}))[0, n - 1:-1]
        differ = (ref.argmax(-1) != tokens[0]).nonzero().flatten().tolist()
        expect(not differ, f"a prompt of {n} tokens: generated token {differ[0] if differ else ''} is not the "
                           "reference's (the uncached model with the kind's reference mask)")
        worst = (logits[0] - ref).abs().max().item()
        expect(worst <= LOGIT_TOL, f"a prompt of {n} tokens: max |dlogit| {worst:.3g} against the reference, over "
                                   f"{LOGIT_TOL:g}")


CHECKS: dict[str, Callable] = {"contract": check_contract, "update/pos": check_update,
                               "what update returns": check_returns, "keeps its slots": check_keeps,
                               "nbytes = formula": check_nbytes, "reset": check_reset, "crop": check_crop,
                               "snapshot/restore": check_snapshot, "generation = reference": check_generation}


def describe(opts: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in opts.items()) or "defaults"


def run_checks(cls, option_sets=None, only=None) -> list[Outcome]:
    """Every check (or those named in ``only``) on ``cls`` with each option set (default: its ``examples``): one
    ``Outcome`` per check, failed at the first option set it fails on (an exception a check did not expect is a
    failure too)."""
    sets = [dict(o) for o in (cls.examples if option_sets is None else option_sets)]
    out = []
    for name, check in CHECKS.items():
        if only is not None and name not in only:
            continue
        failure = None
        for opts in sets:
            try:
                check(cls, opts)
            except Failed as e:
                failure = f"[{describe(opts)}] {e}"
            except Exception as e:  # the kind raised where the contract says it must not
                failure = f"[{describe(opts)}] {one_line(e)}"
            if failure:
                break
        out.append(Outcome(name, failure is None, failure or ""))
    return out


def parse_options(items: list[str]) -> dict:
    """``--options``: one JSON object, or ``name=value`` items (a value read as JSON when it is JSON: 16, true,
    0.5; text otherwise)."""
    if len(items) == 1 and items[0].lstrip().startswith("{"):
        try:
            value = json.loads(items[0])
        except ValueError as e:
            raise ConfigError(f"--options {items[0]!r} is not a JSON object ({e.msg}): give '{{\"budget\": 16}}' "
                              "or budget=16") from None
        if isinstance(value, dict):
            return value
    out = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or not name.isidentifier():
            raise ConfigError(f"--options {item!r} is not name=value: give budget=16 sinks=2, or one JSON object")
        try:
            out[name] = json.loads(text)
        except ValueError:
            out[name] = text
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.conformance", description="Run kvlab's cache-kind "
                                 "conformance checks on a class written against models.kv_cache.")
    ap.add_argument("target", help="package.module:ClassName, the module importable from PYTHONPATH")
    ap.add_argument("--options", nargs="+", metavar="JSON|NAME=VALUE",
                    help="one option set to check (default: each of the class's examples)")
    args = ap.parse_args(argv)
    try:
        cls = kinds.resolve(args.target)
        sets = None if args.options is None else [parse_options(args.options)]
        for opts in sets or ():
            try:
                cls.parse_options(**opts)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"--options {describe(opts)}: {' '.join(str(e).split())}") from None
    except ConfigError as e:
        print(f"conformance: {e}", file=sys.stderr)
        return 2
    outcomes = run_checks(cls, sets)
    for o in outcomes:
        print(o.line(), flush=True)
    failed = sum(not o.passed for o in outcomes)
    print(f"{cls.kind} ({args.target}): {len(outcomes) - failed} of {len(outcomes)} checks passed")
    return 1 if failed else 0

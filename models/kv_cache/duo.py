"""DuoAttention (Xiao et al. 2024, arXiv 2410.10819): retrieval heads keep every token; streaming heads keep the
``sinks`` first and the ``recent`` newest. Which K/V heads retrieve comes from per-head scores (``heads``: a CSV of
``layer, kv_head, score``, as ``python -m harness.heads`` writes, or ``random``: a seeded draw, the control), the
``retrieval`` share of them with the highest scores kept whole.

DuoAttention finds its retrieval heads by training a gate per head; kvlab ranks heads by a measured retrieval score
(Wu et al. 2024, arXiv 2404.15574: how often a head's most-attended key is the token being copied). The heads' slots
differ within a layer, so every layer is stored ragged (``evict.py``): a retrieval head holds max_len slots, a
streaming head ``sinks + recent``, and the bytes are the sum of the slots. Exact against its own keep-mask."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from models.kv_cache.base import kv_bytes, register
from models.kv_cache.evict import EvictingKVCache

RANDOM = "random"
MAX_HEADS_FILE = 1 << 20  # bytes: a score per (layer, K/V head) is a few dozen bytes a row


@dataclass(frozen=True)
class DuoOptions:
    heads: str = RANDOM  # a CSV of per-head scores (python -m harness.heads), or "random" (a seeded draw: the control)
    retrieval: float = 0.25  # the share of K/V heads kept whole, highest scores first
    sinks: int = 16  # a streaming head's first positions, kept
    recent: int = 64  # and its newest

    def __post_init__(self):
        if not isinstance(self.heads, str) or not self.heads:
            raise ValueError(f"cache option heads must be a heads file's path (python -m harness.heads writes one) or "
                             f"random, got {self.heads!r}")
        if isinstance(self.retrieval, bool) or not isinstance(self.retrieval, (int, float)) \
                or not 0 <= self.retrieval < 1:
            raise ValueError(f"cache option retrieval must be a number in [0, 1) (the share of K/V heads kept whole; "
                             f"1 would be full attention: use cache=prealloc), got {self.retrieval!r}")
        for name in ("sinks", "recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"cache option {name} must be an integer >= 0, got {value!r}")
        if self.sinks + self.recent < 1:
            raise ValueError("cache options sinks + recent must keep at least one position in a streaming head")


def retrieval_count(n_layer: int, n_kv_head: int, share: float) -> int:
    """How many of the model's K/V heads are kept whole: the share of them, rounded half up."""
    return math.floor(share * n_layer * n_kv_head + 0.5)


def read_scores(path: str, n_layer: int, n_kv_head: int) -> dict[tuple[int, int], float]:
    """The per-head scores of a heads file, one line each refused: a file that is missing, too large, lacks the
    columns, repeats or misses a (layer, kv_head) of this model, or holds a score that is not a finite number."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"cache.heads={path}: no such file; write one with `python -m harness.heads --model MODEL "
                         "--out FILE`, or give cache.heads=random")
    if p.stat().st_size > MAX_HEADS_FILE:
        raise ValueError(f"cache.heads={path} is {p.stat().st_size:,} bytes, over the {MAX_HEADS_FILE:,} a heads "
                         "file needs: give the file python -m harness.heads wrote")
    with p.open(newline="", encoding="utf-8", errors="replace") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"layer", "kv_head", "score"} <= set(rows[0]):
        raise ValueError(f"cache.heads={path} has no layer, kv_head and score columns: give the file python -m "
                         "harness.heads wrote")
    scores: dict[tuple[int, int], float] = {}
    for row in rows:
        try:
            key, score = (int(row["layer"]), int(row["kv_head"])), float(row["score"])
        except (TypeError, ValueError):
            raise ValueError(f"cache.heads={path}: a row {dict(row)} is not (layer, kv_head, score) numbers") from None
        if key in scores or not math.isfinite(score):
            raise ValueError(f"cache.heads={path}: layer {key[0]} head {key[1]} is given twice or its score "
                             f"{row['score']} is not a finite number")
        scores[key] = score
    want = {(layer, h) for layer in range(n_layer) for h in range(n_kv_head)}
    if set(scores) != want:
        raise ValueError(f"cache.heads={path} scores {len(scores)} heads, not this model's {n_layer} layers x "
                         f"{n_kv_head} K/V heads: write it for this model (python -m harness.heads)")
    return scores


@register
class DuoKVCache(EvictingKVCache):
    kind = "duo"
    Options = DuoOptions
    description = "DuoAttention: retrieval heads keep every token, streaming heads sinks + recent"
    examples = ({"heads": RANDOM, "retrieval": 0.5, "sinks": 2, "recent": 4},
                {"heads": RANDOM, "retrieval": 0.25, "sinks": 0, "recent": 3})
    wants_scores = False
    sized_by: ClassVar[tuple[str, ...]] = ("retrieval", "recent", "sinks")

    @classmethod
    def parse_options(cls, **options):
        return super(EvictingKVCache, cls).parse_options(**options)

    @classmethod
    def input_files(cls, opts) -> tuple[str, ...]:
        return () if opts.heads == RANDOM else (opts.heads,)

    @classmethod
    def streaming_slots(cls, opts, max_len: int) -> int:
        return min(opts.sinks + opts.recent, max_len)

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        return cls.streaming_slots(opts, max_len)  # a streaming head's (a retrieval head holds max_len)

    @classmethod
    def layer_budgets(cls, n_layer: int, max_len: int, opts) -> list[int]:
        return [cls.streaming_slots(opts, max_len)] * n_layer

    @classmethod
    def check_max_len(cls, opts, max_len: int) -> None:
        if opts.sinks + opts.recent >= max_len:
            raise ValueError(f"cache options sinks {opts.sinks} + recent {opts.recent} keep every one of max_len "
                             f"{max_len} tokens in a streaming head: nothing is evicted; lower them or raise max_len")

    @classmethod
    def check_layers(cls, opts, n_layer: int, max_len: int) -> None:
        """Any depth: a share of the heads is kept whole however many there are."""

    @classmethod
    def nbytes_formula(cls, n_layer: int, n_kv_head: int, head_dim: int, max_len: int, batch: int, dtype,
                       n_tokens: int, opts) -> int:
        whole = retrieval_count(n_layer, n_kv_head, opts.retrieval)
        slots = whole * max_len + (n_layer * n_kv_head - whole) * cls.streaming_slots(opts, max_len)
        return kv_bytes(1, 1, head_dim, slots, batch, dtype) + batch * slots * cls.bookkeeping_bytes()

    @classmethod
    def label(cls, opts) -> str:
        source = "random heads" if opts.heads == RANDOM else Path(opts.heads).name
        return f"duo R{opts.retrieval:g} S{opts.sinks}+W{opts.recent} ({source})"

    def retrieval_heads(self) -> set[tuple[int, int]]:
        """The (layer, kv_head) pairs kept whole: the ``retrieval`` share of heads with the highest scores (ties:
        the lower layer, then head, first)."""
        L, H = self.n_layer, self.n_kv_head
        if self.opts.heads == RANDOM:
            from models.kv_cache.random import hashed
            import torch

            keys = hashed(torch.arange(L * H) + hashed(torch.tensor(7919))).tolist()
            scores = {(i // H, i % H): float(keys[i]) for i in range(L * H)}
        else:
            scores = read_scores(self.opts.heads, L, H)
        ranked = sorted(scores, key=lambda lh: (-scores[lh], lh))
        return set(ranked[:retrieval_count(L, H, self.opts.retrieval)])

    def _initial_caps(self) -> list:
        whole, stream = self.retrieval_heads(), self.streaming_slots(self.opts, self.max_len)
        self.roles = [["retrieval" if (layer, h) in whole else "streaming" for h in range(self.n_kv_head)]
                      for layer in range(self.n_layer)]
        return [tuple([tuple(self.max_len if role == "retrieval" else stream for role in self.roles[layer])]
                      * self.batch) for layer in range(self.n_layer)]

    def head_roles(self, layer: int) -> list[str]:
        return list(self.roles[layer])

    def _priority(self, layer, probs, k_all, pos_all, t):
        # a streaming head keeps its sinks and its newest positions; a retrieval head has room for every token
        return pos_all.double().masked_fill((pos_all >= 0) & (pos_all < self.opts.sinks), math.inf), None

    def _checked_caps(self, caps) -> tuple:
        if caps != tuple(self._first_caps):
            raise ValueError(f"snapshot's 'caps' is not this {self.kind} cache's split of heads: restore takes what "
                             "snapshot() returned, unchanged")
        return caps

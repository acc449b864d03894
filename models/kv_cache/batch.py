"""One decode step for sequences that each keep their own cache: continuous batching's running batch.

A server admits requests one by one, each prefilled alone into a one-sequence cache of its own; every step then
decodes one token for all of them together. ``joined(caches)`` is that step's cache: the model sees one ragged
batch (sequence b of length n_b is left-padded to the longest, so its positions and masks are its own, as in
``set_padding``), and each write, read and eviction goes to sequence b's own cache. Nothing of a sequence's cache
changes but what its own single-sequence step would change, so a request's tokens are those it would get alone.

    with joined([c1, c2, c3]) as step:
        logits = decode_step(model, tokens, step)   # (3, 1, vocab); each cache advanced by one token

Paged caches that share one block pool join without a copy: the step is a paged cache over the same pool whose
block tables are the sequences' own (blocks taken for the new tokens land in them), so attention reads each
sequence through its table, as vLLM's running batch does. Every other kind joins through ``RaggedStep``, which
gathers the sequences' keys into one padded batch per layer.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from models.kv_cache.base import KVCache
from models.kv_cache.paged import PagedKVCache


def refuses_joining(cls, opts) -> str | None:
    """Why a kind with these options cannot join a running batch of sequences of different lengths (None: it can)."""
    if cls.needs_rotary(opts):
        return (f"cache={cls.kind} with these options stores keys before the rotary rotation and rotates a step's keys "
                "by one rule for the whole batch, so sequences of different lengths cannot share a decode step")
    return None


def _check(caches) -> None:
    if not caches:
        raise ValueError("joined() needs at least one cache")
    first = caches[0]
    for c in caches:
        if not isinstance(c, KVCache) or c.batch != 1:
            raise ValueError("joined() takes one-sequence caches (batch=1), one per running request")
        if type(c) is not type(first) or c.opts != first.opts:
            raise ValueError(f"joined() takes caches of one kind and options: got {c.label(c.opts)} beside "
                             f"{first.label(first.opts)}")
        if c.pad is not None:
            raise ValueError("joined() takes unpadded caches: each request is prefilled alone")
        if c.fused and not isinstance(c, PagedKVCache):
            raise ValueError("joined() runs the eager step: turn the cache's fused decode off")
        why = refuses_joining(type(c), c.opts)
        if why:
            raise ValueError(why)


def _pad_to_longest(step, caches) -> None:
    """The step's slots: the longest sequence's length, each shorter one left-padded to it (its own positions and
    masks, as ``set_padding`` gives a ragged batch), and room for no more than the fullest cache takes."""
    lengths = [c.pos for c in caches]
    step.pos = max(lengths)
    pad = torch.tensor([step.pos - n for n in lengths], device=caches[0].device)
    step.pad = pad if bool(pad.any()) else None
    step.pad_min = int(pad.min())
    step.max_len = min(c.max_len - c.pos for c in caches) + step.pos


class RaggedStep:
    """The running batch's cache for one decode step (T = 1): sequence b is its own one-sequence cache; the step's
    keys are each cache's keys, right-filled to the longest with empty slots (position -1, never attended)."""

    fused = False
    fuses_decode = False
    fuses_ragged = False
    prerope = False
    rotary_rule = None

    def __init__(self, caches: list[KVCache]):
        self.caches = caches
        first = caches[0]
        self.kind, self.opts, self.evicts, self.wants_scores = first.kind, first.opts, first.evicts, first.wants_scores
        self.reference = first.reference
        self.device, self.dtype, self.n_layer = first.device, first.dtype, first.n_layer
        self.batch = len(caches)
        _pad_to_longest(self, caches)
        self._keys: list[int] = []

    def key_positions(self, t: int) -> torch.Tensor:
        rows = []
        for c in self.caches:
            p = c.key_positions(t)
            rows.append(torch.arange(c.pos + t, device=self.device) if p is None else p.reshape(-1))
        width = max(len(r) for r in rows)
        return torch.stack([F.pad(r, (0, width - len(r)), value=-1) for r in rows])  # (B, width)

    def layer_key_positions(self, layer: int, t: int) -> torch.Tensor:
        rows = [c.layer_key_positions(layer, t) for c in self.caches]  # each (1, nh, n_b)
        width = max(r.shape[-1] for r in rows)
        return torch.cat([F.pad(r, (0, width - r.shape[-1]), value=-1) for r in rows])  # (B, nh, width)

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = [c.update(layer, k_new[b:b + 1], v_new[b:b + 1]) for b, c in enumerate(self.caches)]
        self._keys = [k.shape[2] for k, _ in kv]
        width = max(self._keys)
        k = torch.cat([F.pad(k, (0, 0, 0, width - k.shape[2])) for k, _ in kv])
        v = torch.cat([F.pad(v, (0, 0, 0, width - v.shape[2])) for _, v in kv])
        return k, v  # (B, nkv, width, hs)

    def after_attention(self, layer: int, probs: torch.Tensor | None) -> None:
        for b, c in enumerate(self.caches):
            c.after_attention(layer, None if probs is None else probs[b:b + 1, :, :, :self._keys[b]])

    def advance(self, t: int) -> None:
        for c in self.caches:
            c.advance(t)
        self.pos += t


def _paged_step(caches: list[PagedKVCache]) -> PagedKVCache:
    first = caches[0]
    step = PagedKVCache(first.n_layer, first.n_kv_head, first.head_dim, first.max_len, len(caches),
                        dtype=first.dtype, device=first.device, pool=first.pool, block_size=first.opts.block_size,
                        blocks=first.opts.blocks)
    step.tables = [c.tables[0] for c in caches]  # the same lists: blocks taken now land in each sequence's table
    _pad_to_longest(step, caches)
    step.fused = first.fused
    return step


@contextmanager
def joined(caches: list[KVCache]):
    """The running batch's cache for one decode step over ``caches`` (one-sequence caches of one kind); after the
    step every cache has advanced by the step's tokens, whether the step ran or raised before writing."""
    caches = list(caches)
    _check(caches)
    pooled = isinstance(caches[0], PagedKVCache) and all(c.pool is caches[0].pool for c in caches)
    if not pooled:
        step = RaggedStep(caches)
        yield step
        return
    step = _paged_step(caches)
    start = step.pos
    try:
        yield step
    finally:
        moved = step.pos - start
        step.tables = []  # the sequences' blocks stay theirs: the step must not hand them back when dropped
        for c in caches:
            c.pos += moved
            c._ready = None

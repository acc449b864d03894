"""What every evicting kind shares: ``budget`` slots per sequence, layer and head, chosen after attention.

A forward attends over what the cache held before it plus its own new positions; then the kind keeps ``budget`` of
those candidates and drops the rest. Which ones is the kind's one decision, ``_priority``: a number per candidate,
the highest ``budget`` kept (-inf: never kept, for empty slots and padding). A kind that ``wants_scores`` gets the
attention probabilities of this forward's queries to decide with; the model computes them explicitly only for such
a kind (every other kind keeps the fused SDPA path).

Storage is ``budget`` slots per layer, sequence and head, allocated once: K and V (L, B, nh, budget, hs), the position
each slot holds (L, B, nh, budget), -1 for an empty slot, and, for a kind that carries a score from one forward to the
next (H2O's accumulated attention), that score in fp32. ``update`` hands attention the slots and the new positions
(B, nh, budget + t, hs); ``after_attention`` writes the kept candidates back into the slots. So the bytes held are what
the budget says, after prefill and in decode alike, and stop at the formula.

Key sets differ by layer and head, so the model masks each layer with ``layer_key_positions(layer, t)``. The kind is
exact against its own keep-mask: ``KeepRecord`` notes what the cache held before each forward of a generation, and
``model(idx, keep=record)`` is the uncached forward in which the query at position t of layer l, head h sees exactly
the positions the cache held before t's forward, plus its own forward's positions up to t (causally).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from models.kv_cache.base import KVCache, kv_bytes

NEG = float("-inf")


GROUP_SCORES = ("mean", "max")  # how the query heads that share a K/V head combine their attention into its score


@dataclass(frozen=True)
class BudgetOptions:
    budget: int = 32  # token slots kept per sequence, layer and K/V head
    # grouped-query attention: a K/V head's score from its group of query heads' probabilities (kvpress and Ada-KV
    # average them; max keeps a key any head of the group needs). No effect where every query head has its own K/V.
    group_score: str = "mean"

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"cache option budget must be an integer >= 1 (token slots kept per sequence, layer and "
                             f"K/V head), got {self.budget!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"cache option group_score={self.group_score!r}: use mean or max (how the query heads "
                             "sharing a K/V head combine their attention)")


class EvictingKVCache(KVCache):
    """The base of the evicting kinds: subclasses set ``kind``, ``Options`` (a ``BudgetOptions``), ``wants_scores``
    and ``carries_score``, and implement ``_priority``."""

    evicts: ClassVar[bool] = True
    sized_by: ClassVar[tuple[str, ...]] = ("budget",)
    carries_score: ClassVar[bool] = False  # a per-slot fp32 score kept from one forward to the next

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # parse_options has checked the options against each other
        # a cache shorter than the budget holds every token it can take (a run's config refuses a budget above its
        # max_len: check_max_len; a measurement's short cache, for a few tokens, simply never evicts)
        self.n_slots = S = self.held_tokens(self.max_len, 0, self.opts)
        shape = (self.n_layer, self.batch, self.n_kv_head, S, self.head_dim)  # (L, B, nh, budget, hs)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kpos = torch.full(shape[:4], -1, dtype=torch.long, device=self.device)  # (L, B, nh, budget)
        self.score = (torch.zeros(shape[:4], dtype=torch.float32, device=self.device) if self.carries_score
                      else None)
        self._pending: list[tuple | None] = [None] * self.n_layer  # update -> after_attention, within one forward

    @classmethod
    def check_options(cls, opts) -> None:
        """Checks between options (``recent`` < ``budget``, ...); one line each."""

    @classmethod
    def check_max_len(cls, opts, max_len: int) -> None:
        if opts.budget > max_len:
            raise ValueError(f"cache option budget {opts.budget} is more than max_len {max_len}: a budget is at most "
                             "the tokens a sequence can hold (lower it, or raise max_len)")
        if opts.budget == max_len:  # every token a sequence can have fits: nothing is ever evicted
            raise ValueError(f"cache option budget {opts.budget} equals max_len {max_len}: it keeps every token a "
                             f"sequence can have, so nothing is ever evicted and the run is full attention; use "
                             f"budget < {max_len} (or raise max_len)")

    @classmethod
    def parse_options(cls, **options):
        opts = super().parse_options(**options)
        if not cls.wants_scores and opts.group_score != "mean":  # nothing to combine: it would be recorded, not run
            raise ValueError(f"cache option group_score={opts.group_score} has no effect on {cls.kind}, which scores "
                             "no attention: leave it at mean")
        cls.check_options(opts)
        return opts

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        return min(opts.budget, max_len)

    @classmethod
    def bookkeeping_bytes(cls) -> int:
        """Bytes per slot beside K and V: its position (int64), and a carried score (fp32)."""
        return 8 + (4 if cls.carries_score else 0)

    @classmethod
    def nbytes_formula(cls, n_layer: int, n_kv_head: int, head_dim: int, max_len: int, batch: int, dtype,
                       n_tokens: int, opts) -> int:
        slots = cls.held_tokens(max_len, n_tokens, opts)
        return kv_bytes(n_layer, n_kv_head, head_dim, slots, batch, dtype) + \
            n_layer * batch * n_kv_head * slots * cls.bookkeeping_bytes()

    @classmethod
    def bytes_per_token(cls, n_layer: int, n_kv_head: int, head_dim: int, dtype, opts) -> float:
        return float(kv_bytes(n_layer, n_kv_head, head_dim, 1, 1, dtype)
                     + n_layer * n_kv_head * cls.bookkeeping_bytes())

    @classmethod
    def label(cls, opts) -> str:
        rest = [f"{name}={value}" for name, value in vars(opts).items()
                if name != "budget" and not (name == "group_score" and value == "mean")]
        return f"{cls.kind} B{opts.budget}" + (f" {' '.join(rest)}" if rest else "")

    # ---- positions ------------------------------------------------------------------------------------------

    def new_positions(self, t: int) -> torch.Tensor:
        """(B, t) the position of each of the next t slots per sequence; -1 for padding."""
        p = torch.arange(self.pos, self.pos + t, device=self.device).unsqueeze(0).expand(self.batch, t)
        if self.pad is not None:
            p = p - self.pad.unsqueeze(1)
        return p.where(p >= 0, -1)

    def layer_key_positions(self, layer: int, t: int) -> torch.Tensor:
        """(B, nh, budget + t): the position of each key ``update(layer, ...)`` returns while t new tokens are
        written (call before the forward advances ``pos``); -1 for a key that holds nothing."""
        new = self.new_positions(t).unsqueeze(1).expand(self.batch, self.n_kv_head, t)
        return torch.cat([self.kpos[layer], new], dim=2)

    def kept_positions(self, layer: int) -> torch.Tensor:
        """(B, nh, budget): the absolute position each slot of ``layer`` holds after the last forward, -1 empty
        (min(budget, max_len) slots)."""
        return self.kpos[layer].clone()

    # ---- the contract ---------------------------------------------------------------------------------------

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._check_room(layer, k_new, v_new)
        if layer == 0:
            self.check_forward(t)
        k_all = torch.cat([self.k[layer], k_new.to(self.dtype)], dim=2)  # (B, nh, budget + t, hs)
        v_all = torch.cat([self.v[layer], v_new.to(self.dtype)], dim=2)
        self._pending[layer] = (k_all, v_all, t)
        return k_all, v_all

    def check_forward(self, t: int) -> None:
        """Refuse a forward the kind cannot take before anything is written (a SnapKV prompt shorter than its
        window, ...)."""

    def after_attention(self, layer: int, probs: torch.Tensor | None) -> None:
        """Keep ``budget`` of this forward's candidates of ``layer``: ``probs`` (B, nh, t, budget + t) are the
        attention probabilities of its queries over the keys ``update`` returned (None for a kind that does not
        want scores)."""
        k_all, v_all, t = self._pending[layer]
        self._pending[layer] = None
        pos_all = self.layer_key_positions(layer, t)  # (B, nh, budget + t)
        if probs is not None and probs.size(1) != self.n_kv_head:  # grouped-query attention: one score per K/V head
            probs = self.group_probs(probs)
        if probs is not None and self.pad is not None:  # padding queries attend to anything; they score nothing
            q = self.new_positions(t)  # (B, t)
            probs = probs * (q >= 0)[:, None, :, None]
        priority, carried = self._priority(layer, probs, k_all, pos_all, t)
        priority = priority.masked_fill(pos_all < 0, NEG)  # empty slots and padding are never kept
        S = self.n_slots
        if self.carries_score:  # the held slots' scores move with this forward's attention, kept or not
            self.score[layer] = carried[:, :, :S]
        if t == 1:  # one victim: the new token takes its slot, unless it is the victim itself
            victim = priority.argmin(-1, keepdim=True)  # (B, nh, 1) among budget + 1 candidates
            stays = victim == S  # the new token is the victim: nothing is written
            slot = victim.clamp(max=S - 1)
            idx = slot.unsqueeze(-1).expand(-1, -1, -1, self.head_dim)  # (B, nh, 1, hs)
            for store, cand in ((self.k[layer], k_all), (self.v[layer], v_all)):
                store.scatter_(2, idx, torch.where(stays.unsqueeze(-1), store.gather(2, idx), cand[:, :, S:]))
            rows = [(self.kpos[layer], pos_all)] + ([(self.score[layer], carried)] if self.carries_score else [])
            for store, cand in rows:
                store.scatter_(2, slot, torch.where(stays, store.gather(2, slot), cand[:, :, S:]))
            return
        # the budget of highest priority, ties to the newer position (so a tie, which SnapKV's pooling makes on
        # purpose, falls the same way however the batch is laid out)
        newest_first = pos_all.argsort(dim=-1, descending=True, stable=True)
        ranked = priority.gather(2, newest_first).argsort(dim=-1, descending=True, stable=True)
        keep = newest_first.gather(2, ranked[..., :S])  # (B, nh, budget): candidates kept
        kept_pos = pos_all.gather(2, keep)
        self.kpos[layer] = kept_pos.where(priority.gather(2, keep) > NEG, -1)
        idx = keep.unsqueeze(-1).expand(-1, -1, -1, self.head_dim)
        self.k[layer] = k_all.gather(2, idx)
        self.v[layer] = v_all.gather(2, idx)
        if self.carries_score:
            self.score[layer] = carried.gather(2, keep)

    def group_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """(B, n_head, t, keys) probabilities of the query heads -> (B, n_kv_head, t, keys): each K/V head's from
        its group of query heads (consecutive heads share one, as attention's ``repeat_interleave``), by
        ``group_score``. Scores are taken per K/V head, never over expanded copies of K/V."""
        B, nh, t, n = probs.shape
        if nh % self.n_kv_head:
            raise ValueError(f"attention probabilities of {nh} query heads cannot be grouped over this cache's "
                             f"{self.n_kv_head} K/V heads")
        grouped = probs.view(B, self.n_kv_head, nh // self.n_kv_head, t, n)
        return grouped.amax(2) if self.opts.group_score == "max" else grouped.mean(2)

    def _priority(self, layer: int, probs: torch.Tensor | None, k_all: torch.Tensor, pos_all: torch.Tensor,
                  t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(priority, carried), each (B, nh, budget + t): the ``budget`` candidates of highest priority are kept;
        ``carried`` is the score a ``carries_score`` kind stores for each kept one (None otherwise)."""
        raise NotImplementedError

    # ---- rewinding and reuse --------------------------------------------------------------------------------

    def can_crop(self, n_tokens: int) -> bool:
        return n_tokens == self.pos

    def _why_no_crop(self, n_tokens: int) -> str:
        return (f"cannot crop a {self.kind} cache from {self.pos} to {n_tokens} tokens: what it dropped and kept "
                "was chosen with every token since; take snapshot() before and restore() instead")

    def _crop(self, n: int) -> None:
        pass  # only a crop to pos, which changes nothing

    def checkpoint(self):
        snap = self.snapshot()
        return lambda: self.restore(snap)

    def _reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
        self.kpos.fill_(-1)
        if self.score is not None:
            self.score.zero_()

    def _state(self) -> dict:
        """The tensors a snapshot copies (a kind with more state adds to it)."""
        state = {"k": self.k, "v": self.v, "kpos": self.kpos}
        if self.score is not None:
            state["score"] = self.score
        return state

    def snapshot(self) -> dict:
        return {**self._snapshot_header(), **{key: t.clone() for key, t in self._state().items()}}

    def restore(self, snap: dict) -> None:
        def expect(pos):
            return {key: (tuple(t.shape), t.dtype) for key, t in self._state().items()}

        pos = self._check_snapshot(snap, expect)
        for key, t in self._state().items():
            t.copy_(snap[key])
        self.pos = pos


def recent_mask(pos_all: torch.Tensor, newest: torch.Tensor, n: int) -> torch.Tensor:
    """(B, nh, keys) bool: the candidates among a sequence's ``n`` newest positions; ``newest`` (B,) its newest."""
    return (pos_all >= 0) & (pos_all > (newest - n).view(-1, 1, 1))


class KeepRecord:
    """What an evicting cache held before each forward of a generation: the input of its keep-mask reference,
    ``model(idx, keep=record)``. ``note(cache, t)`` before each forward of t tokens."""

    def __init__(self, pad: torch.Tensor | None = None):
        self.pad = pad
        self.steps: list[tuple[int, int, list[torch.Tensor]]] = []  # (first slot, slots, per layer (B, nh, n))

    def note(self, cache: KVCache, t: int) -> None:
        if not getattr(cache, "evicts", False):
            return  # a kind that keeps by a rule (or another library's cache) has its reference in its options
        self.steps.append((cache.pos, t, [cache.kept_positions(layer) for layer in range(cache.n_layer)]))

    def sequence(self, b: int) -> KeepRecord:
        """The record of sequence b alone, unpadded: what its own reference run (its tokens only) must see."""
        pad = 0 if self.pad is None else int(self.pad[b])
        alone = KeepRecord()
        for p0, t, held in self.steps:
            start, end = max(p0 - pad, 0), p0 + t - pad
            if end > 0:  # a forward of padding alone is no forward of this sequence
                alone.steps.append((start, end - start, [h[b:b + 1] for h in held]))
        return alone

    @property
    def slots(self) -> int:
        """Slots the recorded forwards wrote (padding included)."""
        return self.steps[-1][0] + self.steps[-1][1] if self.steps else 0

    def mask(self, layer: int, T: int, device=None) -> torch.Tensor:
        """(B, nh, T, T) bool: which of the first T slots the query in each of them may see in ``layer``: what the
        cache held before that query's forward, plus its forward's slots up to its own. Padding is never seen; a
        padding query sees every key (its output is never read, and a query that sees nothing makes attention
        NaN)."""
        if T > self.slots:
            raise ValueError(f"the keep record covers {self.slots} slots (the generation it was noted in); this "
                             f"forward has {T}")
        B, nh = self.steps[0][2][layer].shape[:2]
        pad = torch.zeros(B, dtype=torch.long) if self.pad is None else self.pad.cpu()
        m = torch.zeros(B, nh, T, T + 1, dtype=torch.bool)
        cols = torch.arange(T)
        for p0, t, held in self.steps:
            if p0 >= T:
                break
            h = held[layer].cpu()  # (B, nh, n) positions
            slots = torch.where(h >= 0, h + pad.view(-1, 1, 1), T)  # empty -> the spare column T
            seen = torch.zeros(B, nh, T + 1, dtype=torch.bool).scatter_(2, slots.clamp(max=T), True)
            end = min(p0 + t, T)
            rows = torch.arange(p0, end)
            own = (cols >= p0) & (cols.unsqueeze(0) <= rows.unsqueeze(1))  # (rows, T): the forward's own, causal
            m[:, :, p0:end, :T] = seen[:, :, None, :T] | own
        m = m[..., :T] & (cols.view(1, 1, 1, T) >= pad.view(-1, 1, 1, 1))  # padding is never seen
        m |= (cols.view(1, 1, T, 1) < pad.view(-1, 1, 1, 1))  # padding queries see every key
        return m.to(device) if device is not None else m

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

How the slots are spent over layers and heads is ``allocation`` (every evicting kind has it):
- ``uniform``: ``budget`` slots in every layer and K/V head (the layout above; the default).
- ``pyramid``: PyramidKV's per-layer schedule (Cai et al. 2024, arXiv 2406.02069): the slots beyond the kind's own
  reserved ones (``reserved``: H2O's ``recent``, SnapKV's ``window``) fall linearly from the bottom layer to the top,
  the top holding 1/``beta`` of the mean, the layers' total equal to uniform's; every head of a layer alike.
- ``ada``: Ada-KV's allocation (Feng et al. 2024, arXiv 2407.11550): at the first forward that evicts, each
  sequence's layer total (n_kv_head x budget) goes to the heads holding its highest priorities, each head first
  guaranteed ``floor`` x budget of them (the kind's reserved slots are the highest priorities, so they stay); the
  split then holds for the rest of the generation.
A layer whose heads hold one number of slots is stored as above, (B, nh, slots, hs); one whose heads differ is
*ragged*: its K and V are (B, total, hs), each sequence's heads one after the other, each with its own slots, so the
bytes held are the sum of the slots. Attention reads a ragged layer through a padded copy made for the forward
(``_held``), the slots a head lacks masked as empty; the storage itself is never padded.

Key sets differ by layer and head, so the model masks each layer with ``layer_key_positions(layer, t)``. The kind is
exact against its own keep-mask: ``KeepRecord`` notes what the cache held before each forward of a generation, and
``model(idx, keep=record)`` is the uncached forward in which the query at position t of layer l, head h sees exactly
the positions the cache held before t's forward, plus its own forward's positions up to t (causally).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from models.kv_cache.base import KVCache, kv_bytes

NEG = float("-inf")


GROUP_SCORES = ("mean", "max")  # how the query heads that share a K/V head combine their attention into its score
ALLOCATIONS = ("uniform", "pyramid", "ada")  # how the slots are spent over layers and heads (see above)


@dataclass(frozen=True)
class BudgetOptions:
    budget: int = 32  # token slots kept per sequence, layer and K/V head (their mean, when allocation is not uniform)
    # grouped-query attention: a K/V head's score from its group of query heads' probabilities (kvpress and Ada-KV
    # average them; max keeps a key any head of the group needs). No effect where every query head has its own K/V.
    group_score: str = "mean"
    allocation: str = "uniform"  # uniform | pyramid (PyramidKV, per layer) | ada (Ada-KV, per head)
    beta: float = 20.0  # pyramid: the mean layer's slots over the top layer's (PyramidKV's beta)
    floor: float = 0.2  # ada: the share of budget each head is guaranteed (Ada-KV's safeguard)

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"cache option budget must be an integer >= 1 (token slots kept per sequence, layer and "
                             f"K/V head), got {self.budget!r}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"cache option group_score={self.group_score!r}: use mean or max (how the query heads "
                             "sharing a K/V head combine their attention)")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"cache option allocation={self.allocation!r}: use uniform, pyramid (more slots in lower "
                             "layers) or ada (a layer's slots to the heads with the highest scores)")
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta >= 1:
            raise ValueError(f"cache option beta must be a number >= 1 (the mean layer's slots over the top "
                             f"layer's; 1: uniform), got {self.beta!r}")
        if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) or not 0 <= self.floor <= 1:
            raise ValueError(f"cache option floor must be a number in [0, 1] (the share of budget each head is "
                             f"guaranteed; 1: uniform), got {self.floor!r}")


def pyramid(n_layer: int, budget: int, reserved: int, beta: float) -> list[int]:
    """PyramidKV's slots per layer, bottom first: ``reserved`` in every layer, and the rest (``budget - reserved``
    on average) falling linearly from the bottom layer to the top, the top holding 1/``beta`` of that mean and the
    bottom twice the mean less the top's; rounded (largest remainders) so that the layers hold n_layer x budget in
    all, each at least one slot beyond its reserved ones. One layer, beta 1 or nothing beyond the reserved: uniform."""
    free = budget - reserved
    if n_layer == 1 or beta == 1 or free < 1:
        return [budget] * n_layer
    top = free / beta
    bottom = 2 * free - top
    exact = [bottom - (bottom - top) * layer / (n_layer - 1) for layer in range(n_layer)]
    counts = [max(1, math.floor(x)) for x in exact]
    by_remainder = sorted(range(n_layer), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    short, i = free * n_layer - sum(counts), 0
    while short > 0:  # the largest remainders round up
        counts[by_remainder[i % n_layer]] += 1
        short, i = short - 1, i + 1
    while short < 0:  # a top layer lifted to one slot: the widest layer gives it back
        widest = max(range(n_layer), key=lambda j: (counts[j], -j))
        counts[widest] -= 1
        short += 1
    return [reserved + c for c in counts]


class EvictingKVCache(KVCache):
    """The base of the evicting kinds: subclasses set ``kind``, ``Options`` (a ``BudgetOptions``), ``wants_scores``
    and ``carries_score``, and implement ``_priority`` (reading the held slots through ``width``, ``held_score``)."""

    evicts: ClassVar[bool] = True
    sized_by: ClassVar[tuple[str, ...]] = ("budget",)
    carries_score: ClassVar[bool] = False  # a per-slot fp32 score kept from one forward to the next

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # parse_options has checked the options against each other
        # a cache shorter than the budget holds every token it can take (a run's config refuses a budget above its
        # max_len: check_max_len; a measurement's short cache, for a few tokens, simply never evicts)
        self._widths = self.layer_budgets(self.n_layer, self.max_len, self.opts)  # every head's slots, per layer
        self._first_caps = self._initial_caps()
        self._pending: list[tuple | None] = [None] * self.n_layer  # update -> after_attention, within one forward
        self._allocate(self._first_caps)

    def _initial_caps(self) -> list:
        """Per layer: None (every head holds the layer's width) or, per sequence, each head's slots (a ragged
        layer). Ada-KV's split is made at the first eviction; a kind whose heads differ from the start says so here."""
        return [None] * self.n_layer

    def _allocate(self, caps: list) -> None:
        """Empty storage for ``caps`` (see ``_initial_caps``): (B, nh, width, hs) for a layer of equal heads,
        (B, total, hs) for a ragged one; positions -1 (empty), scores 0."""
        B, nh, hs = self.batch, self.n_kv_head, self.head_dim
        self._caps = list(caps)
        shapes = [(B, nh, w) if c is None else (B, sum(c[0])) for w, c in zip(self._widths, caps)]
        self.k = [torch.zeros((*s, hs), dtype=self.dtype, device=self.device) for s in shapes]
        self.v = [torch.zeros((*s, hs), dtype=self.dtype, device=self.device) for s in shapes]
        self.kpos = [torch.full(s, -1, dtype=torch.long, device=self.device) for s in shapes]
        self.score = ([torch.zeros(s, dtype=torch.float32, device=self.device) for s in shapes]
                      if self.carries_score else None)

    @classmethod
    def check_options(cls, opts) -> None:
        """Checks between options (``recent`` < ``budget``, ...); one line each."""

    @classmethod
    def reserved(cls, opts) -> int:
        """Slots of every layer and head the kind's own rule fills first (H2O's ``recent``, SnapKV's ``window``):
        PyramidKV schedules the rest of the budget."""
        return 0

    @classmethod
    def layer_budgets(cls, n_layer: int, max_len: int, opts) -> list[int]:
        """Each head's slots, per layer, bottom first: ``budget`` (uniform and ada, whose split is within a
        layer), or PyramidKV's schedule; at most max_len."""
        if opts.allocation != "pyramid":
            return [min(opts.budget, max_len)] * n_layer
        return [min(b, max_len) for b in pyramid(n_layer, opts.budget, cls.reserved(opts), opts.beta)]

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
    def check_layers(cls, opts, n_layer: int, max_len: int) -> None:
        """Refuse a pyramid whose bottom layer would hold more slots than max_len (its total would fall short of
        uniform's); validation calls it once the model's depth is known."""
        if opts.allocation == "pyramid":
            want = pyramid(n_layer, opts.budget, cls.reserved(opts), opts.beta)
            if want[0] > max_len:
                raise ValueError(f"cache.allocation=pyramid gives the bottom layer {want[0]} slots at budget "
                                 f"{opts.budget} and beta {opts.beta:g}, more than max_len {max_len}: lower "
                                 "cache.budget or cache.beta, or raise max_len")

    @classmethod
    def parse_options(cls, **options):
        opts = super().parse_options(**options)
        if not cls.wants_scores and opts.group_score != "mean":  # nothing to combine: it would be recorded, not run
            raise ValueError(f"cache option group_score={opts.group_score} has no effect on {cls.kind}, which scores "
                             "no attention: leave it at mean")
        defaults = cls.Options()
        for name, used_by in (("beta", "pyramid"), ("floor", "ada")):
            if getattr(opts, name) != getattr(defaults, name) and opts.allocation != used_by:
                raise ValueError(f"cache option {name}={getattr(opts, name)} has no effect with allocation="
                                 f"{opts.allocation}: it is allocation={used_by}'s; leave it out")
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
        slots = sum(cls.layer_budgets(n_layer, max_len, opts))  # per head, over the layers (ada: a layer's total)
        return kv_bytes(1, n_kv_head, head_dim, slots, batch, dtype) + \
            batch * n_kv_head * slots * cls.bookkeeping_bytes()

    @classmethod
    def bytes_per_token(cls, n_layer: int, n_kv_head: int, head_dim: int, dtype, opts) -> float:
        return float(kv_bytes(n_layer, n_kv_head, head_dim, 1, 1, dtype)
                     + n_layer * n_kv_head * cls.bookkeeping_bytes())

    @classmethod
    def label(cls, opts) -> str:
        rest = [f"{name}={value}" for name, value in vars(opts).items()
                if name not in ("budget", "allocation", "beta", "floor")
                and not (name == "group_score" and value == "mean")]
        spent = {"uniform": "", "pyramid": f" pyramid beta={opts.beta:g}", "ada": f" ada floor={opts.floor:g}"}
        return f"{cls.kind} B{opts.budget}{spent[opts.allocation]}" + (f" {' '.join(rest)}" if rest else "")

    # ---- the held slots, as attention sees them -------------------------------------------------------------

    def width(self, layer: int) -> int:
        """Slots per head attention is handed for ``layer`` before the new tokens: the layer's width, or a ragged
        layer's widest head (the others' missing slots empty)."""
        caps = self._caps[layer]
        return self._widths[layer] if caps is None else max(max(c) for c in caps)

    def _valid(self, layer: int) -> torch.Tensor:
        """(B, nh, width) bool: the slots a ragged layer's heads have."""
        caps = torch.tensor(self._caps[layer], device=self.device)  # (B, nh)
        return torch.arange(self.width(layer), device=self.device) < caps.unsqueeze(-1)

    def _held(self, layer: int, x: torch.Tensor, empty=0) -> torch.Tensor:
        """A stored tensor of ``layer`` as (B, nh, width, ...): itself for a layer of equal heads, a padded copy
        (``empty`` where a head has no slot) for a ragged one."""
        if self._caps[layer] is None:
            return x
        out = x.new_full((self.batch, self.n_kv_head, self.width(layer), *x.shape[2:]), empty)
        out[self._valid(layer)] = x.reshape(-1, *x.shape[2:])
        return out

    def held_score(self, layer: int) -> torch.Tensor:
        """(B, nh, width) the carried score of each held slot (0 where a ragged layer's head has no slot)."""
        return self._held(layer, self.score[layer])

    # ---- positions ------------------------------------------------------------------------------------------

    def new_positions(self, t: int) -> torch.Tensor:
        """(B, t) the position of each of the next t slots per sequence; -1 for padding."""
        p = torch.arange(self.pos, self.pos + t, device=self.device).unsqueeze(0).expand(self.batch, t)
        if self.pad is not None:
            p = p - self.pad.unsqueeze(1)
        return p.where(p >= 0, -1)

    def layer_key_positions(self, layer: int, t: int) -> torch.Tensor:
        """(B, nh, width + t): the position of each key ``update(layer, ...)`` returns while t new tokens are
        written (call before the forward advances ``pos``); -1 for a key that holds nothing."""
        new = self.new_positions(t).unsqueeze(1).expand(self.batch, self.n_kv_head, t)
        return torch.cat([self._held(layer, self.kpos[layer], -1), new], dim=2)

    def kept_positions(self, layer: int) -> torch.Tensor:
        """(B, nh, width): the absolute position each slot of ``layer`` holds after the last forward, -1 empty."""
        return self._held(layer, self.kpos[layer], -1).clone()

    def slots_of(self, layer: int) -> list[list[int]]:
        """Per sequence, each K/V head's slots in ``layer``: what it holds room for."""
        caps = self._caps[layer]
        return [[self._widths[layer]] * self.n_kv_head] * self.batch if caps is None else [list(c) for c in caps]

    # ---- the contract ---------------------------------------------------------------------------------------

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._check_room(layer, k_new, v_new)
        if layer == 0:
            self.check_forward(t)
        k_all = torch.cat([self._held(layer, self.k[layer]), k_new.to(self.dtype)], dim=2)  # (B, nh, width + t, hs)
        v_all = torch.cat([self._held(layer, self.v[layer]), v_new.to(self.dtype)], dim=2)
        self._pending[layer] = (k_all, v_all, t)
        return k_all, v_all

    def check_forward(self, t: int) -> None:
        """Refuse a forward the kind cannot take before anything is written (a SnapKV prompt shorter than its
        window, ...)."""

    def after_attention(self, layer: int, probs: torch.Tensor | None) -> None:
        """Keep each head's slots' worth of this forward's candidates of ``layer``: ``probs`` (B, nh, t, width + t)
        are the attention probabilities of its queries over the keys ``update`` returned (None for a kind that does
        not want scores)."""
        k_all, v_all, t = self._pending[layer]
        self._pending[layer] = None
        pos_all = self.layer_key_positions(layer, t)  # (B, nh, width + t)
        if probs is not None and probs.size(1) != self.n_kv_head:  # grouped-query attention: one score per K/V head
            probs = self.group_probs(probs)
        if probs is not None and self.pad is not None:  # padding queries attend to anything; they score nothing
            q = self.new_positions(t)  # (B, t)
            probs = probs * (q >= 0)[:, None, :, None]
        priority, carried = self._priority(layer, probs, k_all, pos_all, t)
        priority = priority.masked_fill(pos_all < 0, NEG)  # empty slots and padding are never kept
        splits = (getattr(self.opts, "allocation", None) == "ada" and self._caps[layer] is None
                  and int((pos_all >= 0).sum(-1).max()) > self._widths[layer])
        if splits:  # Ada-KV: the layer's first eviction splits its slots among the heads, per sequence
            self._caps[layer] = self._ada_caps(priority, self._widths[layer])
        if t == 1 and not splits:
            self._keep_one(layer, priority, carried, k_all, v_all, pos_all)
        else:
            self._keep_ranked(layer, priority, carried, k_all, v_all, pos_all)

    def _ada_caps(self, priority: torch.Tensor, S: int) -> tuple[tuple[int, ...], ...]:
        """Ada-KV's split of a layer's n_kv_head x S slots, per sequence: the n_kv_head x S highest priorities over
        all its heads are counted per head, and each head gets ``floor`` x S plus (1 - ``floor``) x its count
        (largest remainders, so the layer's total stays n_kv_head x S; at least one slot each)."""
        B, nh, n = priority.shape
        chosen = priority.reshape(B, -1).argsort(dim=-1, descending=True, stable=True)[:, :nh * S] // n  # heads
        counts = torch.zeros(B, nh, dtype=torch.long).scatter_add_(1, chosen.cpu(), torch.ones_like(chosen.cpu()))
        out = []
        for row in counts.tolist():
            exact = [self.opts.floor * S + (1 - self.opts.floor) * c for c in row]
            caps = [max(1, math.floor(x)) for x in exact]
            order = sorted(range(nh), key=lambda h: (-(exact[h] - math.floor(exact[h])), h))
            short, i = nh * S - sum(caps), 0
            while short > 0:
                caps[order[i % nh]] += 1
                short, i = short - 1, i + 1
            while short < 0:  # a head lifted to one slot: the widest gives it back
                caps[max(range(nh), key=lambda h: (caps[h], -h))] -= 1
                short += 1
            out.append(tuple(caps))
        return tuple(out)

    def _keep_one(self, layer, priority, carried, k_all, v_all, pos_all) -> None:
        """A decode step: one victim per head among its slots and the new token; the new token takes the victim's
        slot, unless it is the victim itself."""
        S = self.width(layer)
        ragged = self._caps[layer] is not None
        if ragged:  # a slot a head lacks is never the victim (argmin takes the first of equal priorities: a real one)
            priority = priority.clone()
            priority[:, :, :S].masked_fill_(~self._valid(layer), float("inf"))
        if self.carries_score:  # the held slots' scores move with this forward's attention, kept or not
            self._store(layer, "score", carried[:, :, :S])
        victim = priority.argmin(-1, keepdim=True)  # (B, nh, 1) among width + 1 candidates
        stays = victim == S  # the new token is the victim: nothing is written
        slot = victim.clamp(max=S - 1)
        rows = [(self.k, k_all), (self.v, v_all), (self.kpos, pos_all)]
        rows += [(self.score, carried)] if self.carries_score else []
        if ragged:  # each head's slot in the flat layer: its offset + the slot (one of its own when it stays)
            caps = torch.tensor(self._caps[layer], device=self.device).unsqueeze(-1)  # (B, nh, 1)
            slot = (caps.cumsum(1) - caps) + torch.minimum(slot, caps - 1)
        for store, cand in rows:
            x, new = store[layer], cand[:, :, S:]  # new: (B, nh, 1[, hs])
            if ragged:  # the flat layer (B, total[, hs]): one slot per head
                idx, new, keep_old = slot.squeeze(-1), new.squeeze(2), stays.squeeze(-1)  # (B, nh)
                if x.dim() == 3:
                    idx = idx.unsqueeze(-1).expand(-1, -1, self.head_dim)
                    keep_old = keep_old.unsqueeze(-1)
                x.scatter_(1, idx, torch.where(keep_old, x.gather(1, idx), new))
                continue
            idx = slot if x.dim() == 3 else slot.unsqueeze(-1).expand(-1, -1, -1, self.head_dim)
            keep_old = stays if x.dim() == 3 else stays.unsqueeze(-1)
            x.scatter_(2, idx, torch.where(keep_old, x.gather(2, idx), new))

    def _keep_ranked(self, layer, priority, carried, k_all, v_all, pos_all) -> None:
        """Each head keeps its slots' worth of the candidates of highest priority, ties to the newer position (so a
        tie, which SnapKV's pooling makes on purpose, falls the same way however the batch is laid out)."""
        S = self.width(layer)
        newest_first = pos_all.argsort(dim=-1, descending=True, stable=True)
        ranked = priority.gather(2, newest_first).argsort(dim=-1, descending=True, stable=True)
        keep = newest_first.gather(2, ranked[..., :S])  # (B, nh, width): candidates kept
        kept_pos = pos_all.gather(2, keep).where(priority.gather(2, keep) > NEG, -1)
        idx = keep.unsqueeze(-1).expand(-1, -1, -1, self.head_dim)
        self._store(layer, "kpos", kept_pos, whole=True)
        self._store(layer, "k", k_all.gather(2, idx), whole=True)
        self._store(layer, "v", v_all.gather(2, idx), whole=True)
        if self.carries_score:
            self._store(layer, "score", carried.gather(2, keep), whole=True)

    def _store(self, layer: int, name: str, x: torch.Tensor, whole: bool = False) -> None:
        """Write ``x`` (B, nh, width, ...) as ``layer``'s ``name``: in place for a layer of equal heads (a new
        tensor when ``whole``), each head's own slots for a ragged one."""
        stores = getattr(self, name)
        if self._caps[layer] is not None:
            stores[layer] = x[self._valid(layer)].reshape(self.batch, -1, *x.shape[3:]).contiguous()
        elif whole:
            stores[layer] = x
        else:
            stores[layer].copy_(x)

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
        """(priority, carried), each (B, nh, width + t): each head keeps its slots' worth of the candidates of
        highest priority; ``carried`` is the score a ``carries_score`` kind stores for each kept one (None
        otherwise)."""
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
        self._allocate(self._first_caps)

    def _state(self) -> dict:
        """The per-layer tensors a snapshot copies (a kind with more state adds to it)."""
        state = {"k": self.k, "v": self.v, "kpos": self.kpos}
        if self.score is not None:
            state["score"] = self.score
        return state

    def snapshot(self) -> dict:
        return {**self._snapshot_header(), "caps": tuple(self._caps),
                **{key: [t.clone() for t in ts] for key, ts in self._state().items()}}

    def restore(self, snap: dict) -> None:
        def expect(pos):
            caps = self._checked_caps(snap.get("caps"))
            return {key: [self._spec(key, layer, caps[layer]) for layer in range(self.n_layer)]
                    for key in self._state()}

        pos = self._check_snapshot(snap, expect)
        self._caps = list(snap["caps"])
        for key, ts in self._state().items():
            ts[:] = [t.clone() for t in snap[key]]
        self.pos = pos

    def _checked_caps(self, caps) -> tuple:
        """A snapshot's per-layer split, refused in one line unless it is one this cache could have made: per
        layer None, or (ada) per sequence each head's slots, at least one each, summing to the layer's total."""
        def fits(layer, c):
            if c is None:
                return True
            return (getattr(self.opts, "allocation", None) == "ada" and isinstance(c, tuple) and len(c) == self.batch
                    and all(isinstance(row, tuple) and len(row) == self.n_kv_head and all(
                        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in row)
                        and sum(row) == self.n_kv_head * self._widths[layer] for row in c))

        if not isinstance(caps, tuple) or len(caps) != self.n_layer or not all(
                fits(layer, c) for layer, c in enumerate(caps)):
            raise ValueError(f"snapshot's 'caps' is not a split of this {self.kind} cache's slots over its "
                             f"{self.n_layer} layers and {self.n_kv_head} heads: restore takes what snapshot() "
                             "returned, unchanged")
        return caps

    def _spec(self, key: str, layer: int, caps) -> tuple:
        dtype = {"k": self.dtype, "v": self.dtype, "kpos": torch.long, "score": torch.float32}[key]
        lead = (self.batch, self.n_kv_head, self._widths[layer]) if caps is None else (self.batch, sum(caps[0]))
        return ((*lead, self.head_dim) if key in ("k", "v") else lead), dtype


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

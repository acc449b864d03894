"""Attention sinks + a sliding window (StreamingLLM's cache): the first ``sinks`` positions are kept for good, and
a ring of ``window`` slots keeps the most recent positions, the current one included. The cache owns
``sinks + window`` slots (at most ``max_len``), so its memory stops growing with the sequence.

Its exact reference is the uncached model with the same visibility as a mask, ``model(idx, window=W, sinks=S)``:
the query at position t sees the keys at positions j with j < S or t - W < j <= t.

GPT-2's learned absolute position embeddings enter the residual stream at the input, so cached K and V cannot be
re-positioned as StreamingLLM does for RoPE models: every token keeps the absolute position it was written at, and
a sequence still ends at ``n_positions`` (and at the cache's ``max_len``). What the window buys there is bounded
memory (and a decode step whose cost stops growing once the window is full), at the price of the drift from full
attention.

On a rotary model (``models.llama``), ``positions="cache"`` does what StreamingLLM does: keys are stored before the
rotation and rotated by their place in the cache when attention reads them (the sinks at 0 .. S - 1, the window's
keys after them in order, the query last), so every distance stays within S + W and a sequence runs past the
positions the model was trained for, its bytes flat. Its reference is ``model(idx, window=W, sinks=S,
positions="cache")``. GPT-2 refuses it in one line (``needs_rotary``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.kv_cache.base import KVCache, register


POSITIONS = ("absolute", "cache")


@dataclass(frozen=True)
class WindowOptions:
    window: int = 32  # W: the most recent positions kept, the current one included
    sinks: int = 4  # S: the first positions, always kept
    budget: int = 0  # when > 0: the slots held, sinks + window (window becomes budget - sinks), as the evicting kinds'
    # "absolute": keys keep the positions they were written at; "cache": a rotary model's keys are stored before the
    # rotation and rotated by their place in the cache (StreamingLLM's re-positioning), so a sequence can run past
    # the positions the model was trained for
    positions: str = "absolute"

    def __post_init__(self):
        if self.positions not in POSITIONS:
            raise ValueError(f"cache option positions={self.positions!r}: use absolute (keys keep their positions) or "
                             "cache (re-positioned by their place in the cache, a rotary model's)")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 0:
            raise ValueError(f"cache option budget must be an integer >= 0 (0: window and sinks as given; else the "
                             f"slots held, sinks + window), got {self.budget!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"cache option window must be an integer >= 1 (the most recent positions kept, the "
                             f"current one included), got {self.window!r}")
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"cache option sinks must be an integer >= 0, got {self.sinks!r}")
        if self.budget:
            if self.budget <= self.sinks:
                raise ValueError(f"cache option budget {self.budget} must be more than sinks {self.sinks} (it holds "
                                 f"the sinks and a window of budget - sinks): raise budget or lower sinks")
            given, default = self.window, WindowOptions.__dataclass_fields__["window"].default
            if given not in (default, self.budget - self.sinks):  # a window the budget would silently replace
                raise ValueError(f"cache option window={given} has no effect with budget={self.budget}: the window "
                                 f"is budget - sinks = {self.budget - self.sinks}; give window alone (budget=0) or "
                                 "budget alone")
            object.__setattr__(self, "window", self.budget - self.sinks)


@register
class WindowKVCache(KVCache):
    kind = "window"
    Options = WindowOptions
    description = "attention sinks + sliding window: sinks + window slots, a ring for the window"
    examples = ({"window": 8, "sinks": 2}, {"window": 5, "sinks": 0}, {"window": 1, "sinks": 3}, {"budget": 6, "sinks": 2})
    sized_by = ("budget", "window")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_slots = self.held_tokens(self.max_len, 0, self.opts)
        shape = (self.n_layer, self.batch, self.n_kv_head, self.n_slots, self.head_dim)  # (L, B, nh, S + W, hs)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        return min(opts.sinks + opts.window, max_len)

    @classmethod
    def check_max_len(cls, opts, max_len: int) -> None:
        if opts.budget > max_len:  # as the evicting kinds' budget
            raise ValueError(f"cache option budget {opts.budget} is more than max_len {max_len}: a budget is at most "
                             "the tokens a sequence can hold (lower it, or raise max_len)")
        if opts.sinks + opts.window >= max_len:  # every position a query can see stays: full attention
            raise ValueError(f"sinks {opts.sinks} + window {opts.window} = {opts.sinks + opts.window} slots hold "
                             f"every token a sequence of max_len={max_len} can have: the window never slides at that "
                             f"max_len and the run is full attention; use sinks + window < {max_len} (or "
                             "cache=prealloc for full attention)")

    @classmethod
    def reference(cls, opts) -> dict:
        ref = {"window": opts.window, "sinks": opts.sinks}
        return {**ref, "positions": "cache"} if opts.positions == "cache" else ref

    @classmethod
    def label(cls, opts) -> str:
        return f"window S{opts.sinks}+W{opts.window}" + (" @cache" if opts.positions == "cache" else "")

    @classmethod
    def needs_rotary(cls, opts) -> str | None:
        if opts.positions == "cache":
            return ("positions=cache re-positions keys by their place in the cache, which needs rotary positions "
                    "(a learned position table, GPT-2's, is added at the input and has no row past n_positions)")
        return None

    @classmethod
    def streams(cls, opts) -> bool:
        """Whether a sequence may run past the positions the model was trained for (positions=cache)."""
        return opts.positions == "cache"

    @property
    def prerope(self) -> bool:
        return self.opts.positions == "cache"

    @property
    def rotary_rule(self) -> tuple[int, int] | None:
        return (self.opts.sinks, self.opts.window) if self.prerope else None

    @classmethod
    def refuses_padding(cls, opts) -> str | None:
        if opts.positions == "cache":
            return ("with positions=cache each sequence's keys would need their own places in the cache; run the "
                    "prompts one length at a time")
        return super().refuses_padding(opts)

    def set_padding(self, pad) -> None:
        why = self.refuses_padding(self.opts)
        if why:
            raise ValueError(f"cache kind 'window' does not run ragged batches: {why}")
        super().set_padding(pad)

    # ---- where each position lives --------------------------------------------------------------------------

    def _slot(self, p: torch.Tensor) -> torch.Tensor:
        S, W = self.opts.sinks, self.opts.window
        return torch.where(p < S, p, S + (p - S) % W)

    def _slot_positions(self, n: int) -> torch.Tensor:
        """The absolute position each filled slot holds after ``n`` tokens were written: slots fill in order, so
        the first min(n, slots) are filled; a ring slot holds the latest position that maps to it."""
        S, W = self.opts.sinks, self.opts.window
        s = torch.arange(min(n, self.n_slots), device=self.device)
        r = s - S
        latest = S + r + W * torch.div(n - 1 - S - r, W, rounding_mode="floor")
        return torch.where(s < S, s, latest)

    def _ring_positions(self, n: torch.Tensor, width: int) -> torch.Tensor:
        """A ragged batch's ring: the position each of its first ``width`` slots holds per sequence after sequence b
        wrote n[b] tokens, (B, width); -1 where a sequence has not filled the slot."""
        S, W = self.opts.sinks, self.opts.window
        s = torch.arange(width, device=self.device).unsqueeze(0)  # (1, width)
        n = n.unsqueeze(1)  # (B, 1)
        r = s - S
        latest = S + r + W * torch.div(n - 1 - S - r, W, rounding_mode="floor")
        return torch.where(s < n, torch.where(s < S, s, latest), -1)

    def key_positions(self, t: int) -> torch.Tensor:
        """Slots (n_keys,) of one batch in step; with padding, each sequence's positions (B, n_keys)."""
        if self.pad is not None:  # each sequence wrote pos - pad[b] tokens so far (none while in its padding)
            if t == 1:
                return self._ring_positions((self.pos + 1 - self.pad).clamp(min=0), self._ring_read(1))
            new = torch.arange(self.pos, self.pos + t, device=self.device) - self.pad.unsqueeze(1)  # (B, t)
            ring = self._ring_positions((self.pos - self.pad).clamp(min=0), self._ring_read(0))
            return torch.cat([ring, new], dim=1)
        if t == 1:  # written into its slot, then the ring is returned as is
            return self._slot_positions(self.pos + 1)
        new = torch.arange(self.pos, self.pos + t, device=self.device)
        return torch.cat([self._slot_positions(self.pos), new])

    # ---- the contract ---------------------------------------------------------------------------------------

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._check_room(layer, k_new, v_new)
        if self.pad is not None:
            return self._update_ragged(layer, k_new, v_new, t)
        p0 = self.pos
        if t == 1:  # a decode step: the position it evicts (p0 - W) is exactly the one the new query stops seeing
            s = int(self._slot(torch.tensor(p0)))
            self.k[layer, :, :, s] = k_new[:, :, 0]
            self.v[layer, :, :, s] = v_new[:, :, 0]
            n = min(p0 + 1, self.n_slots)
            return self.k[layer, :, :, :n], self.v[layer, :, :, :n]  # views, in slot order
        # a chunk: its queries may need keys it evicts itself, so attention gets the slots as they were + the chunk
        filled = min(p0, self.n_slots)
        k_all = torch.cat([self.k[layer, :, :, :filled], k_new.to(self.dtype)], dim=2)  # (B, nh, filled + t, hs)
        v_all = torch.cat([self.v[layer, :, :, :filled], v_new.to(self.dtype)], dim=2)
        p = torch.arange(p0, p0 + t, device=self.device)
        keep = (p < self.opts.sinks) | (p >= p0 + t - self.opts.window)  # what the ring holds once the chunk is in
        slots = self._slot(p[keep])
        self.k[layer][:, :, slots] = k_new[:, :, keep].to(self.dtype)
        self.v[layer][:, :, slots] = v_new[:, :, keep].to(self.dtype)
        return k_all, v_all

    def _ring_read(self, t: int) -> int:
        """Ring slots a ragged batch's step hands attention: those its longest sequence has filled (a decode step:
        after writing; at least one, so that a step of padding alone still has a key, masked)."""
        if t == 1:
            return max(1, min(self.pos - self.pad_min + 1, self.n_slots))
        return min(max(self.pos - self.pad_min, 0), self.n_slots)

    def _update_ragged(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor,
                       t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same ring per sequence, at each sequence's own positions; padding is never stored."""
        p0 = self.pos - self.pad  # (B,) tokens each sequence wrote before this forward
        if t == 1:
            live = p0 >= 0  # sequences past their padding
            rows = torch.arange(self.batch, device=self.device)[live]
            slots = self._slot(p0[live])
            self.k[layer, rows, :, slots] = k_new[live, :, 0].to(self.dtype)  # (live, nh, hs), each into its slot
            self.v[layer, rows, :, slots] = v_new[live, :, 0].to(self.dtype)
            n = self._ring_read(1)
            return self.k[layer, :, :, :n], self.v[layer, :, :, :n]
        filled = self._ring_read(t)
        k_all = torch.cat([self.k[layer, :, :, :filled], k_new.to(self.dtype)], dim=2)  # (B, nh, filled + t, hs)
        v_all = torch.cat([self.v[layer, :, :, :filled], v_new.to(self.dtype)], dim=2)
        for b, start in enumerate(p0.tolist()):
            p = torch.arange(start, start + t, device=self.device)
            keep = (p >= 0) & ((p < self.opts.sinks) | (p >= start + t - self.opts.window))
            slots = self._slot(p[keep])
            self.k[layer, b][:, slots] = k_new[b][:, keep].to(self.dtype)
            self.v[layer, b][:, slots] = v_new[b][:, keep].to(self.dtype)
        return k_all, v_all

    # ---- rewinding and reuse --------------------------------------------------------------------------------

    def can_crop(self, n_tokens: int) -> bool:
        if not 0 <= n_tokens <= self.pos:
            return False
        # every position a cache of n_tokens holds must still be here: the ring has evicted nothing yet (pos - W
        # <= S), or the shorter cache holds only sinks
        # (a ragged batch: its longest sequence, pad_min slots shorter than the slots, decides)
        longest, kept = self.pos - self.pad_min, n_tokens - self.pad_min
        return n_tokens == self.pos or longest - self.opts.window <= self.opts.sinks or kept <= self.opts.sinks

    def _why_no_crop(self, n_tokens: int) -> str:
        return (f"cannot crop a window cache from {self.pos} to {n_tokens} tokens: positions it would need again "
                f"were evicted (window {self.opts.window}); take snapshot() before and restore() instead")

    def _crop(self, n: int) -> None:
        pass  # the slots of positions >= n are never read again before they are overwritten

    def checkpoint(self):
        snap = self.snapshot()
        return lambda: self.restore(snap)

    def _reset(self) -> None:
        pass

    def snapshot(self) -> dict:
        n = min(self.pos, self.n_slots)
        return {**self._snapshot_header(), "k": self.k[:, :, :, :n].clone(), "v": self.v[:, :, :, :n].clone()}

    def restore(self, snap: dict) -> None:
        def expect(pos):  # (L, B, nh, filled slots, hs)
            shape = ((self.n_layer, self.batch, self.n_kv_head, min(pos, self.n_slots), self.head_dim), self.dtype)
            return {"k": shape, "v": shape}

        pos = self._check_snapshot(snap, expect)
        n = min(pos, self.n_slots)
        self.k[:, :, :, :n] = snap["k"]
        self.v[:, :, :, :n] = snap["v"]
        self.pos = pos

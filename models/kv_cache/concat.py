"""Layout A: each layer's K and V are re-made by ``torch.cat`` every step. Simple, but every step reallocates and
copies the whole history: an O(n) copy per token, O(n^2) over a generation."""

from __future__ import annotations

import torch

from models.kv_cache.base import KVCache, register


@register
class ConcatKVCache(KVCache):
    kind = "concat"
    description = "layout A: torch.cat per step (grows with the sequence, copies the history every step)"
    grows = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.k: list[torch.Tensor | None] = [None] * self.n_layer
        self.v: list[torch.Tensor | None] = [None] * self.n_layer

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        return n_tokens

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_room(layer, k_new, v_new)
        if self.k[layer] is None:  # a copy of its own: never the caller's tensor
            self.k[layer] = torch.empty(k_new.shape, dtype=self.dtype, device=self.device).copy_(k_new)
            self.v[layer] = torch.empty(v_new.shape, dtype=self.dtype, device=self.device).copy_(v_new)
        else:  # (B, nh, pos + t, hs): a new allocation every step
            self.k[layer] = torch.cat([self.k[layer], k_new.to(self.dtype)], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v_new.to(self.dtype)], dim=2)
        return self.k[layer], self.v[layer]

    def _crop(self, n: int) -> None:
        # copies, not views: a view would keep the longer tensor alive (and nbytes counts what is kept alive)
        self.k = [None if t is None or n == 0 else t[:, :, :n].clone() for t in self.k]
        self.v = [None if t is None or n == 0 else t[:, :, :n].clone() for t in self.v]

    def _reset(self) -> None:
        self.k = [None] * self.n_layer
        self.v = [None] * self.n_layer

    def snapshot(self) -> dict:
        return {**self._snapshot_header(), "k": [None if t is None else t.clone() for t in self.k],
                "v": [None if t is None else t.clone() for t in self.v]}

    def restore(self, snap: dict) -> None:
        def expect(pos):  # one (B, nh, pos, hs) tensor per layer; None before any token
            one = None if pos == 0 else ((self.batch, self.n_kv_head, pos, self.head_dim), self.dtype)
            return {"k": [one] * self.n_layer, "v": [one] * self.n_layer}

        self.pos = self._check_snapshot(snap, expect)
        self.k = [None if t is None else t.clone() for t in snap["k"]]
        self.v = [None if t is None else t.clone() for t in snap["v"]]

"""Layout B: ``max_len`` slots per layer allocated once; a step writes its positions in place at ``pos``: what
inference engines do. It owns all ``max_len`` slots from the start (``filled_nbytes`` is the written part)."""

from __future__ import annotations

import torch

from models.kv_cache.base import KVCache, register


@register
class PreallocKVCache(KVCache):
    kind = "prealloc"
    description = "layout B: max_len slots allocated once, written in place at pos"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shape = (self.n_layer, self.batch, self.n_kv_head, self.max_len, self.head_dim)  # (L, B, nh, max_len, hs)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        return max_len

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._check_room(layer, k_new, v_new)
        end = self.pos + t
        self.k[layer, :, :, self.pos:end] = k_new  # copy_ casts to the storage dtype
        self.v[layer, :, :, self.pos:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # views (B, nh, end, hs), no copy

    def _crop(self, n: int) -> None:
        pass  # slots past pos are never read and are overwritten by the next write

    def _reset(self) -> None:
        pass  # storage kept; stale slots past pos are never read

    def snapshot(self) -> dict:
        return {**self._snapshot_header(), "k": self.k[:, :, :, :self.pos].clone(),
                "v": self.v[:, :, :, :self.pos].clone()}

    def restore(self, snap: dict) -> None:
        def expect(pos):  # (L, B, nh, pos, hs)
            shape = ((self.n_layer, self.batch, self.n_kv_head, pos, self.head_dim), self.dtype)
            return {"k": shape, "v": shape}

        n = self._check_snapshot(snap, expect)
        self.k[:, :, :, :n] = snap["k"]
        self.v[:, :, :, :n] = snap["v"]
        self.pos = n

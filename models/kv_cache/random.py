"""The control: ``budget`` positions kept at random, per sequence, layer and head. Each (layer, head, position) gets
a fixed priority from a seeded integer hash, and after each forward the candidates of highest priority are kept: so
what is kept after n tokens is a uniformly random ``budget`` of them, the same on every device, whatever the batch
or its padding. Any policy worth its scores should beat it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.kv_cache.base import register
from models.kv_cache.evict import BudgetOptions, EvictingKVCache

_M32 = 0xFFFFFFFF
SEEDS = 1 << 32  # distinct seeds: the hash keeps 32 bits of seed * 104729 (odd), so seed mod 2**32 decides


def hashed(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32) of int64 ``x``, elementwise, in [0, 2^32)."""
    x = x & _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _M32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class RandomOptions(BudgetOptions):
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEEDS:
            raise ValueError(f"cache option seed must be an integer 0 <= seed < 2**32 (the hash is 32-bit: seed and "
                             f"seed + 2**32 keep the same positions), got {self.seed!r}")


@register
class RandomKVCache(EvictingKVCache):
    kind = "random"
    Options = RandomOptions
    description = "random eviction (seeded): the control, budget slots per head"
    examples = ({"budget": 8, "seed": 0}, {"budget": 3, "seed": 1}, {"budget": 1, "seed": 2})
    wants_scores = False

    def _priority(self, layer, probs, k_all, pos_all, t):
        head = torch.arange(self.n_kv_head, device=self.device).view(1, -1, 1)
        key = hashed(pos_all + hashed(head + hashed(torch.tensor(layer * 7919 + self.opts.seed * 104729,
                                                                 device=self.device))))
        return key.double(), None  # (B, nh, budget + t); ties have equal positions, which a head never holds twice

"""TOVA (Oren et al. 2024, arXiv 2401.06104): after each forward, keep the keys the current (last) query attends to
most, per sequence, layer and head; nothing is carried from one step to the next."""

from __future__ import annotations

from models.kv_cache.base import register
from models.kv_cache.evict import BudgetOptions, EvictingKVCache


@register
class TOVAKVCache(EvictingKVCache):
    kind = "tova"
    Options = BudgetOptions
    description = "TOVA: the keys the current query attends to most, budget slots per head"
    examples = ({"budget": 8}, {"budget": 3}, {"budget": 1})
    wants_scores = True

    def _priority(self, layer, probs, k_all, pos_all, t):
        return probs[:, :, -1].float(), None  # (B, nh, budget + t): the last query's attention

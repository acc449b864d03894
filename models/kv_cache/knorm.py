"""Key norm (Devoto et al. 2024, arXiv 2406.11430): keys with a small L2 norm draw attention, so after each forward
the ``budget`` candidates with the smallest key norm are kept, per sequence, layer and head. No scores are needed:
attention keeps its fused path."""

from __future__ import annotations

from models.kv_cache.base import register
from models.kv_cache.evict import BudgetOptions, EvictingKVCache


@register
class KNormKVCache(EvictingKVCache):
    kind = "knorm"
    Options = BudgetOptions
    description = "key norm: the keys of smallest L2 norm, budget slots per head (no scores)"
    examples = ({"budget": 8}, {"budget": 3}, {"budget": 1}, {"budget": 5, "allocation": "ada", "floor": 0.0})
    wants_scores = False

    def _priority(self, layer, probs, k_all, pos_all, t):
        return -k_all.float().norm(dim=-1), None  # (B, nh, budget + t)

"""H2O (Zhang et al. 2023, arXiv 2306.14048): heavy hitters, the keys that have drawn the most attention so far,
plus the ``recent`` newest tokens. Each slot carries the attention it has accumulated over every query since it was
written (prefill's queries included); after each forward the ``recent`` newest positions are kept, and the rest of
the budget goes to the highest accumulated scores, per sequence, layer and head. H2O's ablation (its Table 6) is
``recent=0`` (heavy hitters alone), ``recent=budget`` (the newest tokens alone: "local") and both in between."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.kv_cache.base import register
from models.kv_cache.evict import BudgetOptions, EvictingKVCache, recent_mask


@dataclass(frozen=True)
class H2OOptions(BudgetOptions):
    recent: int = 8  # the newest positions always kept ("local"); the rest of the budget (if any): heavy hitters

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 0:
            raise ValueError(f"cache option recent must be an integer >= 0 (the newest positions always kept), "
                             f"got {self.recent!r}")


@register
class H2OKVCache(EvictingKVCache):
    kind = "h2o"
    Options = H2OOptions
    description = "H2O: heavy hitters by accumulated attention + the newest tokens, budget slots per head"
    examples = ({"budget": 8, "recent": 3}, {"budget": 5, "recent": 0}, {"budget": 1, "recent": 0},
                {"budget": 6, "recent": 2, "allocation": "ada"})
    wants_scores = True
    carries_score = True

    @classmethod
    def check_options(cls, opts) -> None:
        if opts.recent > opts.budget:
            raise ValueError(f"cache option recent {opts.recent} must be at most budget {opts.budget}: recent=0 "
                             "keeps heavy hitters alone, recent=budget the newest tokens alone (H2O's 'local')")

    @classmethod
    def reserved(cls, opts) -> int:
        return opts.recent

    def _priority(self, layer, probs, k_all, pos_all, t):
        B, nh = self.batch, self.n_kv_head
        held = self.held_score(layer)
        acc = torch.cat([held, held.new_zeros(B, nh, t)], dim=2) + probs.float().sum(2)
        newest = self.new_positions(t)[:, -1]  # (B,) every sequence's last slot is a token
        return acc.masked_fill(recent_mask(pos_all, newest, self.opts.recent), float("inf")), acc

"""StreamingLLM's rule (Xiao et al. 2023, arXiv 2309.17453) as an evicting kind: keep the first ``sinks`` positions
(attention sinks) and the newest ``budget - sinks``, per sequence, layer and head. kvlab's evicting base holds the
``budget`` slots, attends over them plus the new positions and keeps the candidates of highest priority, so the
kind's one decision is ``_priority``. Run it with ``cache=external cache.target=mykinds.recent:RecentKVCache``."""

from dataclasses import dataclass

from models.kv_cache.evict import BudgetOptions, EvictingKVCache


@dataclass(frozen=True)
class RecentOptions(BudgetOptions):
    sinks: int = 1  # the first positions always kept; the rest of the budget: the newest tokens

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or not 0 <= self.sinks < self.budget:
            raise ValueError(f"cache option sinks must be an integer in [0, budget {self.budget}), got {self.sinks!r}")


class RecentKVCache(EvictingKVCache):
    kind, Options, exact = "recent", RecentOptions, True
    description = "sinks + the newest tokens (StreamingLLM's rule), budget slots per head"
    examples = ({"budget": 8, "sinks": 1}, {"budget": 5, "sinks": 0}, {"budget": 6, "sinks": 2, "allocation": "ada"})

    def _priority(self, layer, probs, k_all, pos_all, t):
        newer = pos_all.double()  # the newest positions first; a sink before any of them
        return newer.masked_fill((pos_all >= 0) & (pos_all < self.opts.sinks), float("inf")), None

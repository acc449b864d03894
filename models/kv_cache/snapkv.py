"""SnapKV (Li et al. 2024, arXiv 2404.14469): the prompt chooses. At prefill, the attention of the prompt's last
``window`` queries, summed over them and max-pooled along the keys with ``kernel`` (so a chosen key brings its
neighbours), picks ``budget - window`` positions of the rest of the prompt; the last ``window`` prompt positions are
kept too.

SnapKV itself compresses the prompt only and lets decode grow the cache. kvlab's decode rule keeps memory bounded:
the positions the prompt chose stay for good, and the rest of the budget is a sliding window of the newest tokens
(the prompt's last ``window`` first), so each decode step evicts the oldest position the prompt did not choose. A
prompt that fits the budget keeps every position, and those before its last ``window`` count as chosen. A later
chunk (a chunked prefill) slides like decode: the choice is made once, by the batch's first forward (a left-padded
sequence whose tokens all come in later chunks chooses nothing: they slide)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.kv_cache.base import register
from models.kv_cache.evict import BudgetOptions, EvictingKVCache, recent_mask

INF = float("inf")


@dataclass(frozen=True)
class SnapKVOptions(BudgetOptions):
    window: int = 8  # the prompt's last queries whose attention chooses (and its last positions, kept)
    kernel: int = 5  # max-pooling width along the keys (odd)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"cache option window must be an integer >= 1 (the prompt's last queries that choose), "
                             f"got {self.window!r}")
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 \
                or self.kernel % 2 == 0:
            raise ValueError(f"cache option kernel must be an odd integer >= 1 (the max-pooling width, centred), "
                             f"got {self.kernel!r}")


@register
class SnapKVKVCache(EvictingKVCache):
    kind = "snapkv"
    Options = SnapKVOptions
    description = "SnapKV: the prompt's last window of queries chooses (max-pooled); decode slides the rest"
    examples = ({"budget": 8, "window": 3, "kernel": 3}, {"budget": 5, "window": 1, "kernel": 1},
                {"budget": 2, "window": 1, "kernel": 5},
                {"budget": 8, "window": 2, "kernel": 3, "allocation": "pyramid", "beta": 3.0})
    wants_scores = True
    carries_score = True  # +inf for a position the prompt chose; its position for one that slides

    @classmethod
    def check_options(cls, opts) -> None:
        if opts.window >= opts.budget:
            raise ValueError(f"cache option window {opts.window} must be below budget {opts.budget}: the prompt "
                             "needs at least one slot to choose into")

    @classmethod
    def reserved(cls, opts) -> int:
        return opts.window

    @classmethod
    def min_prompt(cls, opts) -> int:
        return opts.window

    @classmethod
    def check_max_len(cls, opts, max_len: int) -> None:
        super().check_max_len(opts, max_len)
        if opts.kernel >= 2 * max_len:  # centred on any of at most max_len keys, it already spans them all
            raise ValueError(f"cache option kernel={opts.kernel} is wider than any prompt of max_len={max_len} needs: "
                             f"from {2 * max_len - 1} on, every key's pooling window spans every key, so wider runs "
                             f"the same; use kernel <= {2 * max_len - 1}")

    def check_forward(self, t: int) -> None:
        if self.pos == 0:  # each sequence's tokens in the first forward (a chunk of padding alone has none)
            own = [t - p for p in ([0] if self.pad is None else self.pad.tolist()) if t - p > 0]
            shortest = min(own, default=self.opts.window)
            if shortest < self.opts.window:
                raise ValueError(f"snapkv's window {self.opts.window} is longer than the prompt ({shortest} tokens): "
                                 f"the prompt's last {self.opts.window} queries choose what is kept; lower "
                                 "cache.window or give longer prompts")

    def _priority(self, layer, probs, k_all, pos_all, t):
        S = self.width(layer)
        new_pos = pos_all[:, :, S:].float()  # (B, nh, t)
        if self.pos:  # decode, or a later chunk: the chosen stay, the rest slides
            slide = torch.cat([self.held_score(layer), new_pos], dim=2)
            return slide, slide
        B, nh = self.batch, self.n_kv_head
        obs = probs[:, :, -self.opts.window:, S:].float().sum(2)  # (B, nh, t) what the window attends to
        k = self.opts.kernel
        pooled = F.max_pool1d(obs.reshape(B * nh, 1, t), k, stride=1, padding=k // 2).view(B, nh, t)
        newest = self.new_positions(t)[:, -1]
        in_window = recent_mask(pos_all[:, :, S:], newest, self.opts.window)
        empty = pos_all.new_zeros(B, nh, S, dtype=torch.float32)  # the empty slots of a cache before its prompt
        priority = torch.cat([empty, pooled.masked_fill(in_window, INF)], dim=2)
        carried = torch.cat([empty, torch.where(in_window, new_pos, INF)], dim=2)
        return priority, carried

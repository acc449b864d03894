"""Caches and prompts the model-layer tests share: the seed protocol's prompts, every registered kind with each option
set its class lists in ``examples`` (``CASES``), a writer of random K/V as the model writes them, and the tests' own
count of the bytes a cache holds."""

import pytest
import torch

from models.kv_cache import CACHE_KINDS, KVCache

N_PROMPTS, NEW = 20, 100


def seed_prompts(max_len, n=N_PROMPTS, new=NEW, vocab=50257, seed=0):
    """n prompts of different lengths: one of a single token, one ending exactly at max_len - new."""
    g = torch.Generator().manual_seed(seed)
    longest = max_len - new
    lengths = [1, longest] + torch.randint(2, longest, (n - 2,), generator=g).tolist()
    return [torch.randint(0, vocab, (1, t), generator=g) for t in lengths]


CASES = [pytest.param(kind, opts, id=f"{kind}-{'-'.join(f'{k}{v}' for k, v in opts.items()) or 'default'}")
         for kind, cls in CACHE_KINDS.items() for opts in cls.examples]


def walk_storage_bytes(cache) -> int:
    """The test's own count: the storage behind every tensor the cache object holds, each storage once."""
    storages = {}

    def visit(o):
        if isinstance(o, torch.Tensor):
            storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, (list, tuple, set)):
            for x in o:
                visit(x)
        elif isinstance(o, dict):
            for x in o.values():
                visit(x)

    for value in vars(cache).values():
        visit(value)
    return sum(storages.values())


def own_bytes(cache) -> int:
    """The test's own count of the bytes a cache holds: the storage behind its tensors; for a kind that draws blocks
    from a pool, the blocks the pool has handed out (one cache on the pool, no snapshot alive) at the block's size
    worked out from the geometry."""
    if not cache.pooled:
        return walk_storage_bytes(cache)
    block = 2 * cache.n_layer * cache.n_kv_head * cache.opts.block_size * cache.head_dim * cache.pool.k.element_size()
    return (cache.pool.n_blocks - len(cache.pool.free)) * block


def random_probs(cache: KVCache, key_pos: torch.Tensor, t: int, g: torch.Generator, dtype=torch.float32):
    """Attention probabilities (B, nh, t, keys) to hand an evicting kind that scores: random, over the keys each of
    the t new queries may see (held, or its own forward's up to itself; a padding query sees every key)."""
    q = torch.arange(cache.pos, cache.pos + t).view(1, t) - (0 if cache.pad is None else cache.pad.view(-1, 1))
    q = q.view(-1, 1, t, 1)  # (B or 1, 1, t, 1) positions
    see = ((key_pos.unsqueeze(2) >= 0) & (key_pos.unsqueeze(2) <= q)) | (q < 0)
    logits = torch.randn(see.shape, generator=g) * 3
    return logits.masked_fill(~see, float("-inf")).softmax(-1).to(dtype)


def attend(cache: KVCache, layer: int, t: int, k, v, g: torch.Generator):
    """One layer's part of a forward as the model does it: update, then (an evicting kind) what it keeps."""
    key_pos = cache.layer_key_positions(layer, t)
    out = cache.update(layer, k, v)
    if cache.evicts:
        cache.after_attention(layer, random_probs(cache, key_pos, t, g, k.dtype) if cache.wants_scores else None)
    return out


class Writer:
    """Writes random K/V chunks into a cache, one layer at a time, as the model does, and remembers what it wrote."""

    def __init__(self, cache: KVCache, seed: int = 0, dtype=torch.float32):
        self.cache, self.g, self.dtype = cache, torch.Generator().manual_seed(seed), dtype  # dtype: the compute one
        self.k = [torch.empty(cache.batch, cache.n_kv_head, 0, cache.head_dim) for _ in range(cache.n_layer)]
        self.v = [x.clone() for x in self.k]
        self.handed: dict[int, torch.Tensor | None] = {}  # per layer: the probabilities the last write handed over

    def chunk(self, t: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.cache
        shape = (c.batch, c.n_kv_head, t, c.head_dim)
        # K with an outlier channel, as real K has
        out = []
        for _ in range(c.n_layer):
            k = torch.randn(shape, generator=self.g) * torch.linspace(0.5, 6.0, c.head_dim)
            out.append((k.to(self.dtype), torch.randn(shape, generator=self.g).to(self.dtype)))
        return out

    def probs(self, key_pos: torch.Tensor, t: int) -> torch.Tensor:
        return random_probs(self.cache, key_pos, t, self.g, self.dtype)

    def write(self, t: int, data=None):
        """One forward's worth: every layer's update (and, for an evicting kind, what it keeps after attention),
        then advance. Returns what each layer's update returned (with any key a kind declares empty, position -1,
        zeroed: what it holds there is never read) and the key positions the cache declared for it: one tensor, or
        for a kind whose keys differ by layer and head a list of (B, nh, keys), one per layer."""
        data = data or self.chunk(t)
        pos = self.cache.key_positions(t)
        per_layer, returned = [], []
        for layer, (k, v) in enumerate(data):
            per_layer.append(self.cache.layer_key_positions(layer, t))
            returned.append(self.cache.update(layer, k, v))
            if self.cache.evicts:
                self.handed[layer] = self.probs(per_layer[-1], t) if self.cache.wants_scores else None
                self.cache.after_attention(layer, self.handed[layer])
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        self.cache.advance(t)
        if per_layer[0] is not None:
            pos = per_layer
            returned = [(k.masked_fill((p < 0)[..., None], 0), v.masked_fill((p < 0)[..., None], 0))
                        for (k, v), p in zip(returned, per_layer)]
        elif pos is not None and pos.dim() == 2:
            empty = (pos < 0)[:, None, :, None]  # (B, 1, keys, 1)
            returned = [(k.masked_fill(empty, 0), v.masked_fill(empty, 0)) for k, v in returned]
        return returned, pos, data

"""KV-cache kinds behind one contract, and the registry that names them.

    from models.kv_cache import CACHE_KINDS, make_cache, kv_bytes
    cache = make_cache("prealloc", n_layer, n_kv_head, head_dim, max_len, batch, dtype=torch.float32)
    cache = make_cache("quant", ..., k_bits=4, v_bits=8, group_size=32, residual=0)
    cache = make_cache("window", ..., window=256, sinks=4)
    cache = make_cache("paged", ..., block_size=16)
    cache = make_cache("h2o", ..., budget=64, recent=8)     # or tova, snapkv, knorm, random

``base.py`` holds the contract (``KVCache``) and the registry; each kind is one module with one registered class:
``concat`` (layout A), ``prealloc`` (layout B), ``quant`` (low-bit K/V), ``window`` (sinks + sliding window) and
``paged`` (blocks from a shared pool, a block table per sequence), and the evicting kinds, ``budget`` slots per
sequence, layer and head chosen after attention (``evict.py``): ``h2o``, ``tova``, ``snapkv``, ``knorm``, ``random``;
and ``duo`` (DuoAttention: retrieval heads keep every token, streaming heads sinks + recent).
"""

from models.kv_cache.base import (CACHE_KINDS, DTYPE_NAMES, DTYPES, KVCache, NoOptions, as_dtype, cache_kind,
                                  kv_bytes, make_cache, register)
from models.kv_cache.concat import ConcatKVCache
from models.kv_cache.prealloc import PreallocKVCache
from models.kv_cache.quant import QuantKVCache
from models.kv_cache.window import WindowKVCache
from models.kv_cache.paged import BlockPool, PagedKVCache  # noqa: E402  (the kinds' order is the registry's)
from models.kv_cache.evict import EvictingKVCache, KeepRecord  # noqa: E402
from models.kv_cache.h2o import H2OKVCache  # noqa: E402
from models.kv_cache.tova import TOVAKVCache  # noqa: E402
from models.kv_cache.snapkv import SnapKVKVCache  # noqa: E402
from models.kv_cache.knorm import KNormKVCache  # noqa: E402
from models.kv_cache.random import RandomKVCache  # noqa: E402
from models.kv_cache.duo import DuoKVCache  # noqa: E402

__all__ = ["CACHE_KINDS", "DTYPE_NAMES", "DTYPES", "KVCache", "NoOptions", "as_dtype", "cache_kind",
           "kv_bytes", "make_cache", "register", "ConcatKVCache", "PreallocKVCache", "QuantKVCache",
           "WindowKVCache", "BlockPool", "PagedKVCache", "EvictingKVCache", "KeepRecord", "H2OKVCache",
           "TOVAKVCache", "SnapKVKVCache", "KNormKVCache", "RandomKVCache", "DuoKVCache"]

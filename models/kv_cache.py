"""KV-cache storage in two layouts, behind one contract.

Attention calls ``update(layer, k_new, v_new) -> (K, V)``: it stores the new positions of one layer and returns the
whole history of that layer (old + new). ``pos`` counts the tokens cached so far; the model's forward advances it
once, after its last layer, so every layer of one forward writes at the same offset.

- ``ConcatKVCache`` (layout A) grows with ``torch.cat`` each step: simple, but every step reallocates and copies
  the whole history, an O(n) copy per token and O(n^2) over a generation.
- ``PreallocKVCache`` (layout B) allocates ``max_len`` slots once and writes the new positions in place at ``pos``:
  what inference engines do.

``dtype`` is the STORAGE dtype of K and V. Attention reads them back in the model's compute dtype.
"""

from __future__ import annotations

import torch

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a torch dtype or one of the names fp32/fp16/bf16 (float32/float16/bfloat16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of fp32, fp16, bf16") from None


def kv_bytes(n_layer: int, n_kv_head: int, head_dim: int, n_tokens: int, batch: int = 1,
             dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes of K and V for ``n_tokens`` positions: 2 (K and V) x layers x kv heads x head_dim x tokens x batch x
    bytes per element. GPT-2 small in FP32: 2 x 12 x 12 x 64 x 4 = 73,728 B per token."""
    itemsize = torch.empty((), dtype=as_dtype(dtype)).element_size()
    return 2 * n_layer * n_kv_head * head_dim * n_tokens * batch * itemsize


class KVCache:
    """What both layouts share: shape bookkeeping, ``pos``, the overflow check and the byte formula."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int, max_len: int, batch: int,
                 dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("n_layer", n_layer), ("n_head", n_head), ("head_dim", head_dim),
                            ("max_len", max_len), ("batch", batch)):
            if int(value) < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        self.n_layer, self.n_head, self.head_dim = n_layer, n_head, head_dim
        self.max_len, self.batch = max_len, batch
        self.dtype = as_dtype(dtype)
        self.device = torch.device(device)
        self.pos = 0  # tokens cached so far; advanced by the model's forward, after its last layer

    def _check_room(self, layer: int, k_new: torch.Tensor) -> int:
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} out of range for a cache of {self.n_layer} layers")
        t = k_new.shape[2]  # k_new: (B, nh, t, hs)
        if self.pos + t > self.max_len:
            raise ValueError(f"KV cache overflow: pos {self.pos} + {t} new tokens > max_len {self.max_len}")
        return t

    def advance(self, t: int) -> None:
        """Move ``pos`` past the ``t`` tokens the last forward stored in every layer."""
        self.pos += t

    def crop(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` positions and forget the rest (roll back a speculative or timed step)."""
        if not 0 <= n_tokens <= self.pos:
            raise ValueError(f"cannot crop to {n_tokens} tokens: the cache holds {self.pos}")
        self._crop(n_tokens)
        self.pos = n_tokens

    def formula_nbytes(self, n_tokens: int) -> int:
        return kv_bytes(self.n_layer, self.n_head, self.head_dim, n_tokens, self.batch, self.dtype)

    @property
    def filled_nbytes(self) -> int:
        """Bytes of the positions written so far (``pos`` of them)."""
        return self.formula_nbytes(self.pos)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(n_layer={self.n_layer}, n_head={self.n_head}, head_dim={self.head_dim}, "
                f"max_len={self.max_len}, batch={self.batch}, dtype={self.dtype}, pos={self.pos})")


class ConcatKVCache(KVCache):
    """Layout A: each layer's K and V are re-made by ``torch.cat`` every step."""

    layout = "concat"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.k: list[torch.Tensor | None] = [None] * self.n_layer
        self.v: list[torch.Tensor | None] = [None] * self.n_layer

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_room(layer, k_new)
        k_new, v_new = k_new.to(self.dtype), v_new.to(self.dtype)
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k_new.contiguous(), v_new.contiguous()
        else:
            self.k[layer] = torch.cat([self.k[layer], k_new], dim=2)  # (B, nh, pos + t, hs): a new allocation
            self.v[layer] = torch.cat([self.v[layer], v_new], dim=2)
        return self.k[layer], self.v[layer]

    def _crop(self, n: int) -> None:
        self.k = [None if t is None else t[:, :, :n] for t in self.k]  # views; the next cat allocates afresh
        self.v = [None if t is None else t[:, :, :n] for t in self.v]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def reset(self) -> None:
        self.k = [None] * self.n_layer
        self.v = [None] * self.n_layer
        self.pos = 0

    def snapshot(self) -> dict:
        return {"pos": self.pos, "k": [None if t is None else t.clone() for t in self.k],
                "v": [None if t is None else t.clone() for t in self.v]}

    def restore(self, snap: dict) -> None:
        self.k = [None if t is None else t.clone() for t in snap["k"]]
        self.v = [None if t is None else t.clone() for t in snap["v"]]
        self.pos = snap["pos"]


class PreallocKVCache(KVCache):
    """Layout B: ``max_len`` slots per layer allocated once; a step writes its positions in place at ``pos``."""

    layout = "prealloc"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shape = (self.n_layer, self.batch, self.n_head, self.max_len, self.head_dim)  # (L, B, nh, max_len, hs)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._check_room(layer, k_new)
        end = self.pos + t
        self.k[layer, :, :, self.pos:end] = k_new  # copy_ casts to the storage dtype
        self.v[layer, :, :, self.pos:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # views (B, nh, end, hs), no copy

    def _crop(self, n: int) -> None:
        pass  # slots past pos are never read and are overwritten by the next write

    @property
    def nbytes(self) -> int:
        """Bytes the cache owns: all ``max_len`` slots, filled or not (see ``filled_nbytes``)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def reset(self) -> None:
        self.pos = 0  # storage kept; stale slots past pos are never read

    def snapshot(self) -> dict:
        return {"pos": self.pos, "k": self.k[:, :, :, :self.pos].clone(), "v": self.v[:, :, :, :self.pos].clone()}

    def restore(self, snap: dict) -> None:
        n = snap["pos"]
        if n > self.max_len:
            raise ValueError(f"snapshot of {n} tokens does not fit max_len {self.max_len}")
        self.k[:, :, :, :n] = snap["k"]
        self.v[:, :, :, :n] = snap["v"]
        self.pos = n


LAYOUTS = {"concat": ConcatKVCache, "prealloc": PreallocKVCache}


def make_cache(layout: str, n_layer: int, n_head: int, head_dim: int, max_len: int, batch: int = 1,
               dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu") -> KVCache:
    """A cache of the named layout ("concat" or "prealloc")."""
    try:
        cls = LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"unknown cache layout {layout!r}: use one of {', '.join(LAYOUTS)}") from None
    return cls(n_layer, n_head, head_dim, max_len, batch, dtype=dtype, device=device)

"""Paged K/V (vLLM's PagedAttention layout, without its kernel): K and V live in fixed-size blocks of ``block_size``
tokens drawn from a pool; each sequence keeps a block table, the pool block that holds each of its ``block_size``-
token pieces. A sequence takes a block when it grows past its last one and returns its blocks when it ends
(``end(b)``), is cropped, or the cache is reset.

- ``nbytes`` counts the blocks this cache's sequences use: a sequence of T tokens holds ceil(T / block_size) blocks,
  so at most block_size - 1 slots per sequence are wasted, and padding of a ragged batch takes none. The pool itself
  (``pool_nbytes``) is allocated whole, as engines allocate theirs; what paging buys is that the pool serves
  sequences by what they hold, not by what they might reach.
- Attention reads each sequence's keys through its block table: a gather per layer and step (no paged-attention
  kernel here), so a decode step pays for the indirection. That price is what ``python -m harness.bench --paged``
  measures.
- Blocks are reference-counted. ``snapshot()`` shares the blocks it names instead of copying them, ``fork(n)`` gives
  n sequences that share one sequence's blocks (parallel continuations of one prompt), and ``restore`` shares the
  snapshot's blocks again. A write into a shared block first copies it (copy-on-write), so writes after a restore
  or a fork never reach the snapshot or the other sequences: only the first divergent block is ever copied.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass

import torch

from models.attention import sdpa
from models.kv_cache import kernels
from models.kv_cache.base import KVCache, itemsize, register


@dataclass(frozen=True)
class PagedOptions:
    block_size: int = 16  # tokens per block
    blocks: int = 0  # blocks in the pool; 0: enough for every sequence of the batch to reach max_len, plus one
    # each for the copy-on-write of the block a snapshot shares with it

    def __post_init__(self):
        for name, low in (("block_size", 1), ("blocks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"cache option {name} must be an integer >= {low}, got {value!r}")


class BlockPool:
    """Blocks of K and V for every layer, shared by the sequences (and the caches) that draw from it. Block b of
    head h is rows b * block_size .. (b + 1) * block_size - 1 of ``k[layer, h]``."""

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, block_size: int, n_blocks: int, dtype, device):
        shape = (n_layer, n_kv_head, n_blocks * block_size, head_dim)  # (L, nh, blocks * block_size, hs)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.n_blocks = block_size, n_blocks
        self.refs = [0] * n_blocks
        self.free = list(range(n_blocks - 1, -1, -1))  # pop() hands out the lowest free id first
        self.snapshots, self.held = 0, set()  # snapshots taken; those whose share of blocks is still held

    @property
    def block_nbytes(self) -> int:
        """K and V of one block, every layer and head."""
        L, nh, _, hs = self.k.shape
        return 2 * L * nh * self.block_size * hs * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    @property
    def used(self) -> int:
        return self.n_blocks - len(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise ValueError(f"paged pool out of blocks: {n} more needed, {len(self.free)} of {self.n_blocks} "
                             "free; build the cache with more blocks (cache option blocks) or end sequences "
                             "(cache.end(b))")
        ids = [self.free.pop() for _ in range(n)]
        for b in ids:
            self.refs[b] = 1
        return ids

    def share(self, ids) -> None:
        for b in ids:
            self.refs[b] += 1

    def release(self, ids) -> None:
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def drop_share(self, token: int, ids) -> None:
        """A snapshot was dropped: its share of the blocks goes back."""
        self.held.discard(token)
        self.release(ids)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.k[:, :, dst * bs:(dst + 1) * bs] = self.k[:, :, src * bs:(src + 1) * bs]
        self.v[:, :, dst * bs:(dst + 1) * bs] = self.v[:, :, src * bs:(src + 1) * bs]


class PagedSnapshot(dict):
    """A snapshot that holds a share of the blocks it names; the share is returned when the snapshot is dropped."""


@register
class PagedKVCache(KVCache):
    kind = "paged"
    Options = PagedOptions
    description = "paged: fixed-size blocks from a shared pool, a block table per sequence, copy-on-write sharing"
    examples = ({"block_size": 4}, {"block_size": 16}, {"block_size": 1})
    pooled = True
    fuses_decode = True
    sized_by = ("blocks", "block_size")

    def __init__(self, *args, pool: BlockPool | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        bs = self.opts.block_size
        if pool is None:
            n_blocks = self.opts.blocks or self.batch * (math.ceil(self.max_len / bs) + 1)
            pool = BlockPool(self.n_layer, self.n_kv_head, self.head_dim, bs, n_blocks, self.dtype, self.device)
        elif (pool.block_size != bs or tuple(pool.k.shape[:2]) != (self.n_layer, self.n_kv_head)
              or pool.k.shape[3] != self.head_dim or pool.k.dtype != self.dtype):
            raise ValueError("the pool's blocks do not fit this cache: give a pool of the same layers, heads, "
                             "head_dim, dtype and block_size")
        self.pool = pool
        self.tables: list[list[int]] = [[] for _ in range(self.batch)]  # sequence -> its pool blocks, in order
        self.ended = [False] * self.batch
        self._ready = None  # (pos, t) the forward in progress was prepared for (blocks taken, rows worked out)

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        return math.ceil(n_tokens / opts.block_size) * opts.block_size

    @classmethod
    def check_max_len(cls, opts, max_len: int) -> None:
        if opts.block_size > max_len:
            raise ValueError(f"cache option block_size={opts.block_size} is more than max_len={max_len}: a block's "
                             f"slots past max_len never hold a token; use block_size <= {max_len}")

    @classmethod
    def blocks_needed(cls, opts, batch: int, n_tokens: int) -> int:
        """Blocks a cache of ``batch`` sequences holds once each has ``n_tokens`` tokens written."""
        return batch * math.ceil(n_tokens / opts.block_size)

    @classmethod
    def check_fills(cls, opts, fills: list[tuple[str, int, int]]) -> None:
        """A pool of ``blocks`` blocks (each cache a run builds draws its own) must hold the largest of them."""
        if not opts.blocks or not fills:
            return
        need, what, batch, n = max((cls.blocks_needed(opts, b, n), what, b, n) for what, b, n in fills)
        if need > opts.blocks:
            seqs = "1 sequence" if batch == 1 else f"{batch} sequences"
            raise ValueError(f"cache option blocks={opts.blocks} is too few for this run: {what} holds {seqs} of "
                             f"{n} tokens, {need} blocks of {opts.block_size}; use cache.blocks >= {need} (or "
                             "blocks=0: every sequence can reach max_len)")

    @classmethod
    def fixed_pool(cls, opts) -> bool:
        return bool(opts.blocks)

    @classmethod
    def label(cls, opts) -> str:
        return f"paged(block_size={opts.block_size})"

    # ---- bytes --------------------------------------------------------------------------------------------------

    @property
    def blocks_in_use(self) -> int:
        """Distinct pool blocks this cache's sequences hold (a block two of them share counts once)."""
        return len({b for table in self.tables for b in table})

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks in use."""
        return self.blocks_in_use * self.pool.block_nbytes

    @property
    def pool_nbytes(self) -> int:
        """Bytes of the whole pool, allocated up front."""
        return self.pool.nbytes

    def formula_nbytes(self, n_tokens: int | None = None) -> int:
        """ceil(T_b / block_size) blocks for each sequence b of T_b tokens (padding takes none; unshared blocks)."""
        bs, isz = self.opts.block_size, itemsize(self.dtype)
        blocks = sum(math.ceil(n / bs) for b, n in enumerate(self.lengths(n_tokens)) if not self.ended[b])
        return blocks * 2 * self.n_layer * self.n_kv_head * bs * self.head_dim * isz

    @property
    def held(self) -> int:
        """Token slots held per sequence, on average (blocks in use x block_size / batch)."""
        return self.held_slots // self.batch

    @property
    def held_slots(self) -> int:
        return self.blocks_in_use * self.opts.block_size

    @property
    def occupied_slots(self) -> int:
        """Slots of the blocks in use that hold a token (a block shared by several sequences counts once)."""
        bs, filled = self.opts.block_size, {}
        for b, n in enumerate(self.lengths()):
            for i, block in enumerate(self.tables[b]):
                filled[block] = max(filled.get(block, 0), min(bs, n - i * bs))
        return sum(filled.values())

    # ---- the contract ---------------------------------------------------------------------------------------

    def _prepare(self, t: int) -> None:
        """Before the first layer writes ``t`` slots at ``pos``: take the blocks the new tokens need, copy any shared
        block they write into (copy-on-write), and work out where the new tokens go and which keys attention reads:
        every sequence's blocks, whole, in its own token order."""
        if self.pos + t > self.max_len:
            raise ValueError(f"KV cache overflow: pos {self.pos} + {t} new tokens > max_len {self.max_len}")
        bs = self.opts.block_size
        pads = [0] * self.batch if self.pad is None else self.pad.tolist()
        plan = []  # (sequence, new blocks needed, indexes of shared blocks written into)
        for b in range(self.batch):
            first, end = self.pos - pads[b], self.pos + t - pads[b]  # its positions written now: first .. end - 1
            if self.ended[b] or end <= 0:
                continue
            table = self.tables[b]
            shared = [i for i in range(max(first, 0) // bs, len(table)) if self.pool.refs[table[i]] > 1]
            plan.append((b, math.ceil(end / bs) - len(table), shared))
        want = sum(n + len(shared) for _, n, shared in plan)
        if want > len(self.pool.free):
            self.pool.take(want)  # raises, naming the numbers; nothing was taken or written
        for b, n, shared in plan:
            table = self.tables[b]
            for i in shared:
                (fresh,) = self.pool.take(1)
                self.pool.copy_block(table[i], fresh)
                self.pool.release([table[i]])
                table[i] = fresh
            table += self.pool.take(n)
        self._tab = self._table_tensor()  # (B, width) blocks; padding entries read block 0
        width = self._tab.shape[1]
        # the key positions attention sees: each sequence's tokens 0 .. n - 1, then nothing (-1)
        n = [0 if self.ended[b] else max(self.pos + t - pads[b], 0) for b in range(self.batch)]
        p = torch.arange(width * bs, device=self.device).unsqueeze(0)  # (1, width * bs)
        have = torch.tensor(n, device=self.device).unsqueeze(1)
        floor = torch.tensor([int(e) for e in self.ended], device=self.device).unsqueeze(1)
        seen = torch.maximum(have, floor)  # (B, 1) keys per sequence
        self._positions = torch.where(p < seen, p, -1)  # (B, width * bs); a done sequence keeps one (stale) key,
        # so that its rows stay finite
        self._lens = seen.view(-1).cpu()  # (B,) each sequence's keys, its first table slots: what the kernel reads
        # every sequence alike (no padding, none done): the first pos + t keys are the history in order, and
        # attention needs no mask (its fast path)
        self._uniform = self.pad is None and not any(self.ended)
        # where the t new slots go: pool rows, and which of them are tokens of a live sequence
        q, self._new_rows = self._rows(self._tab, self.pos, self.pos + t)  # (B, t) positions and pool rows
        keep = (q >= 0) & (floor == 0)
        self._keep = None if bool(keep.all()) else keep
        self._ready = (self.pos, t)

    def key_positions(self, t: int) -> torch.Tensor:
        """(B, keys): the position of each key per sequence (its blocks in token order; -1: an empty slot)."""
        if self._ready != (self.pos, t):
            self._prepare(t)
        return None if self._uniform else self._positions

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._write(layer, k_new, v_new)
        k, v = self._blocks(layer, self._tab)
        if self._uniform:
            n = self.pos + t
            return k[:, :, :n], v[:, :, :n]  # (B, nh, pos + t, hs)
        return k, v

    def _write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> int:
        """Write t new tokens' K and V into their pool rows (blocks taken as needed); returns t."""
        t = self._check_room(layer, k_new, v_new)
        if self._ready != (self.pos, t):
            self._prepare(t)
        rows, keep = self._new_rows, self._keep  # (B, t); keep: None when every slot is a live token
        kn, vn = k_new.transpose(0, 1), v_new.transpose(0, 1)  # (nh, B, t, hs)
        if keep is None:
            self.pool.k[layer][:, rows.reshape(-1)] = kn.reshape(self.n_kv_head, -1, self.head_dim).to(self.dtype)
            self.pool.v[layer][:, rows.reshape(-1)] = vn.reshape(self.n_kv_head, -1, self.head_dim).to(self.dtype)
        else:
            self.pool.k[layer][:, rows[keep]] = kn[:, keep].to(self.dtype)  # (nh, kept, hs)
            self.pool.v[layer][:, rows[keep]] = vn[:, keep].to(self.dtype)
        return t

    fuses_ragged = True

    def attend_decode(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's K and V as ``update`` does, then attend through the block tables, every key and value
        row read where it lies in the pool (the CPU kernel ``paged``; no gathered copy). In a ragged batch each
        sequence reads its own first keys: in a decode step the mask (B, 1, 1, keys) lets sequence b see exactly
        its first ``_lens[b]`` keys (tested against the update path). Where the kernel is not built (no C++
        compiler, or a GPU): ``update`` and attention over its gathered copy, under the mask."""
        kernel = kernels.load() if self.device.type == "cpu" else None
        if kernel is None:
            k, v = self.update(layer, k_new, v_new)
            return sdpa(q, k.to(q.dtype), v.to(q.dtype), mask)  # each K/V head for its group of query heads
        self._write(layer, k_new, v_new)
        qf = (q.float() * (1.0 / math.sqrt(self.head_dim)))[:, :, 0].contiguous()  # (B, nh, hs)
        y = kernel.paged(qf, self.pool.k[layer], self.pool.v[layer], self._tab, self.opts.block_size, self._lens)
        return y.unsqueeze(2).to(q.dtype)

    def stored_history(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._blocks(layer, self._tab)
        if not self._uniform:  # every block, as update returns them (key_positions(1) says which hold a key)
            return k, v
        n = self.pos + 1  # inside the step's forward: pos is advanced after the last layer
        return k[:, :, :n], v[:, :, :n]

    def _blocks(self, layer: int, tab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every block of every sequence, whole blocks in table order: (B, nh, width * bs, hs)."""
        B, width = tab.shape
        bs, nh, hs = self.opts.block_size, self.n_kv_head, self.head_dim
        flat = tab.reshape(-1)
        k = self.pool.k[layer].view(nh, -1, bs, hs).index_select(1, flat).view(nh, B, width * bs, hs)
        v = self.pool.v[layer].view(nh, -1, bs, hs).index_select(1, flat).view(nh, B, width * bs, hs)
        return k.transpose(0, 1), v.transpose(0, 1)

    def _table_tensor(self, fill: int = 0) -> torch.Tensor:
        """The block tables as one (B, width) tensor, short tables filled with ``fill``."""
        width = max(1, max(len(t) for t in self.tables))
        return torch.tensor([t + [fill] * (width - len(t)) for t in self.tables], dtype=torch.long,
                            device=self.device)

    def _rows(self, tab: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots start .. end - 1 of every sequence: their positions (B, n), negative in padding, and pool rows
        (B, n) through ``tab``; a padding slot reads its sequence's first token's row, an ended sequence rows of
        block 0 (neither is a token of that sequence)."""
        bs = self.opts.block_size
        p = torch.arange(start, end, device=self.device).unsqueeze(0).expand(self.batch, end - start)  # (B, n)
        if self.pad is not None:
            p = p - self.pad.unsqueeze(1)
        pc = p.clamp(min=0)
        blk = torch.div(pc, bs, rounding_mode="floor").clamp(max=tab.shape[1] - 1)
        return p, tab.gather(1, blk) * bs + pc % bs

    def _slot_rows(self, n: int) -> torch.Tensor:
        """(B, n) the pool row of slots 0 .. n - 1 of every sequence (see ``_rows``)."""
        return self._rows(self._table_tensor(), 0, n)[1]

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every slot written so far, (B, nh, pos, hs), in slot order, gathered through the block tables
        (what padding slots and ended sequences hold is not theirs: see ``_slot_rows``)."""
        rows = self._slot_rows(self.pos)
        B, n = rows.shape
        k = self.pool.k[layer].index_select(1, rows.reshape(-1)).view(self.n_kv_head, B, n, self.head_dim)
        v = self.pool.v[layer].index_select(1, rows.reshape(-1)).view(self.n_kv_head, B, n, self.head_dim)
        return k.transpose(0, 1), v.transpose(0, 1)

    # ---- sequences that end, share, rewind ------------------------------------------------------------------

    def empty_like(self, batch: int | None = None) -> PagedKVCache:
        return type(self)(self.n_layer, self.n_kv_head, self.head_dim, self.max_len, batch or self.batch,
                          dtype=self.dtype, device=self.device, pool=self.pool, **dataclasses.asdict(self.opts))

    def end(self, b: int) -> None:
        """Sequence ``b`` is done: its blocks go back to the pool; later steps store nothing for it."""
        if not 0 <= b < self.batch:
            raise IndexError(f"sequence {b} out of range for a batch of {self.batch}")
        self.pool.release(self.tables[b])
        self.tables[b], self.ended[b] = [], True
        self._ready = None

    def fork(self, n: int) -> PagedKVCache:
        """A cache of ``n`` sequences drawing from the same pool, each sharing this one-sequence cache's blocks
        (parallel continuations of one prompt); the first write into a shared block copies it."""
        if self.batch != 1:
            raise ValueError(f"fork shares one sequence's blocks: this cache holds {self.batch}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fork(n) needs n >= 1 sequences, got {n!r}")
        other = self.empty_like(n)
        other.pos = self.pos
        if self.pad is not None:  # each continuation keeps the prompt's padding, so its positions
            other.pad, other.pad_min = self.pad.repeat(n), self.pad_min
        other.ended = [self.ended[0]] * n
        other.tables = [list(self.tables[0]) for _ in range(n)]
        for table in other.tables:
            self.pool.share(table)
        return other

    def can_crop(self, n_tokens: int) -> bool:
        # a sequence that ended gave its blocks back: no crop brings it back
        return 0 <= n_tokens <= self.pos and (n_tokens == self.pos or not any(self.ended))

    def _why_no_crop(self, n_tokens: int) -> str:
        return (f"cannot crop a paged cache from {self.pos} to {n_tokens} tokens: sequence(s) "
                f"{[b for b, e in enumerate(self.ended) if e]} ended and gave their blocks back; take snapshot() "
                "before and restore() instead")

    def _crop(self, n: int) -> None:
        bs = self.opts.block_size
        for b, kept in enumerate(self.lengths(n)):
            keep = math.ceil(kept / bs)
            self.pool.release(self.tables[b][keep:])
            del self.tables[b][keep:]
        self._ready = None

    def _reset(self) -> None:
        for table in self.tables:
            self.pool.release(table)
        self.tables = [[] for _ in range(self.batch)]
        self.ended = [False] * self.batch
        self._ready = None

    def __del__(self):
        try:
            for table in self.tables:  # a dropped cache hands its blocks back to a pool others may share
                self.pool.release(table)
        except (AttributeError, TypeError):  # interpreter shutdown or a half-built cache
            pass

    def snapshot(self) -> dict:
        """The block tables, sharing their blocks (no K/V is copied): writes after a restore copy a shared block
        before writing into it, so they never reach the snapshot."""
        tables = self._table_tensor(fill=-1).cpu()
        self.pool.snapshots += 1
        token = self.pool.snapshots  # names this snapshot's share of the blocks while it holds it
        snap = PagedSnapshot(**self._snapshot_header(), pool=id(self.pool), tables=tables,
                             ended=torch.tensor(self.ended), share=token)
        ids = [b for t in self.tables for b in t]
        self.pool.share(ids)
        self.pool.held.add(token)
        weakref.finalize(snap, self.pool.drop_share, token, ids)
        return snap

    def set_padding(self, pad) -> None:
        super().set_padding(pad)
        self._ready = None

    def restore(self, snap: dict) -> None:
        if isinstance(snap, dict) and snap.get("kind") == self.kind and snap.get("pool") != id(self.pool):
            raise ValueError("a paged snapshot restores into a cache that draws from the same block pool")
        if isinstance(snap, dict) and snap.get("kind") == self.kind and snap.get("share") not in self.pool.held:
            raise ValueError("this paged snapshot no longer holds its blocks (a copy of a snapshot that was dropped): "
                             "restore the snapshot snapshot() returned, while it is alive")

        def held(snap):  # every block the tables name is in the pool and still held (the snapshot's share)
            named = snap["tables"].flatten().tolist()
            if any(not -1 <= b < self.pool.n_blocks or (b >= 0 and self.pool.refs[b] < 1) for b in named):
                raise ValueError(f"snapshot's 'tables' name blocks it does not hold (the pool has "
                                 f"{self.pool.n_blocks}): restore takes what snapshot() returned, unchanged")

        pos = self._check_snapshot(snap, lambda pos: {"tables": ((self.batch, None), torch.long, "cpu"),
                                                      "ended": ((self.batch,), torch.bool, "cpu")}, held)
        tables = [[b for b in row if b >= 0] for row in snap["tables"].tolist()]
        for table in self.tables:
            self.pool.release(table)
        for table in tables:
            self.pool.share(table)
        self.tables, self.ended, self.pos, self._ready = tables, snap["ended"].tolist(), pos, None

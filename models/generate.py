"""Prefill, one decode step, and greedy generation with or without a KV cache.

Prefill runs the whole prompt through the model once and fills the cache; a decode step runs exactly one token per
sequence through every layer and attends over the cached history. ``greedy(..., layout=None)`` is the uncached
baseline: it re-runs the whole context every step and keeps only the last position's logits. Any cache kind of
``models.kv_cache.CACHE_KINDS`` plugs in by name.
"""

from __future__ import annotations

import itertools
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import torch.nn as nn

from models.attention import check_padding
from models.decoder import Decoder
from models.kv_cache import KeepRecord, KVCache, PreallocKVCache, make_cache


@dataclass
class GreedyOutput:
    tokens: torch.Tensor  # (B, n_new) the chosen tokens
    logits: torch.Tensor  # (B, n_new, vocab) the logits each step chose from
    # an evicting kind's run: what its cache held before each forward, the input of its reference
    # (``greedy(model, prompt, n, keep=out.keeps)``, ``model(idx, keep=out.keeps)``); None for every other run
    keeps: KeepRecord | None = None


def _is_array(x) -> bool:
    np = sys.modules.get("numpy")  # no numpy imported: nothing is a numpy array
    return np is not None and isinstance(x, np.ndarray)


def _as_ids(ids) -> torch.Tensor:
    """Token ids as a tensor, whatever was given; what torch cannot turn into one rectangular array of numbers (a
    string, rows of different lengths, a numpy object array, a list of 2-D tensors) is refused in one line."""
    if isinstance(ids, torch.Tensor):
        return ids
    if isinstance(ids, str):
        raise ValueError("prompt ids must be token ids, got a string: encode text first "
                         "(models.tokenizer.Tokenizer().encode(text))")
    if _is_array(ids) and ids.dtype == object:
        raise ValueError(f"prompt ids must be integers, got a numpy object array of shape {ids.shape} (rows of "
                         "different lengths?): give an integer array, or a list of id lists for prompts of "
                         "different lengths")
    if isinstance(ids, (list, tuple)):
        for i, p in enumerate(ids):
            if (isinstance(p, torch.Tensor) or _is_array(p)) and p.ndim > 1:
                raise ValueError(f"prompt {i} is a {p.ndim}-D {type(p).__name__} of shape {tuple(p.shape)}: a list of "
                                 "prompts takes 1-D tensors or lists of ids, one prompt each; give a batch as one "
                                 "(B, T) tensor (torch.cat the rows)")
    try:
        return torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"prompt ids must be a (B, T) batch of integer token ids (a tensor, an integer array or "
                         f"lists of ids of one length; prompts of different lengths as a list of id lists), got "
                         f"{type(ids).__name__}: {why}") from None


def _as_batch(ids, vocab_size: int | None = None) -> torch.Tensor:
    """Prompt token ids as a (B, T) long tensor; floats, empty prompts and ids outside the vocabulary are refused."""
    t = _as_ids(ids)
    if t.numel() == 0:
        raise ValueError(f"prompt ids must be (B, T) with B, T >= 1, got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"token ids must be integers, got {t.dtype}")
    t = t.long()
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[1] == 0 or t.shape[0] == 0:
        raise ValueError(f"prompt ids must be (B, T) with B, T >= 1, got shape {tuple(t.shape)}")
    if vocab_size is not None and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got {int(t.min())} .. {int(t.max())}")
    return t


def is_prompt_list(prompts) -> bool:
    """Whether ``prompts`` is a list of prompts, each a list of ids or a 1-D tensor or array (of any lengths)."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        return False
    return all(isinstance(p, (list, tuple)) or ((isinstance(p, torch.Tensor) or _is_array(p)) and p.ndim == 1)
               for p in prompts)


def _is_ragged(prompts) -> bool:
    return is_prompt_list(prompts) and len({len(p) for p in prompts}) > 1


def left_pad(prompts, pad_id: int = 0, length: int | None = None,
             vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one left-padded batch: (B, L) ids and (B,) padding per sequence, L the
    longest prompt (or ``length``). The padding's id does not matter: the model never lets a token attend to it."""
    rows = []
    for i, p in enumerate(prompts):
        t = _as_ids(p)
        if t.dim() != 1 or t.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got shape {tuple(t.shape)}")
        rows.append(_as_batch(t, vocab_size)[0])
    if not rows:
        raise ValueError("no prompts: give at least one list of token ids")
    longest = max(len(r) for r in rows)
    L = longest if length is None else length
    if L < longest:
        raise ValueError(f"length {L} is shorter than the longest prompt ({longest} tokens)")
    idx = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, L - len(r):] = r
    return idx, torch.tensor([L - len(r) for r in rows])


def as_prompts(prompts, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A batch (B, T) and its left padding (B,), None when every prompt has the same length."""
    if is_prompt_list(prompts):
        idx, pad = left_pad(prompts, vocab_size=vocab_size)
        return idx, pad if bool(pad.any()) else None
    return _as_batch(prompts, vocab_size), None


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def new_cache(model: Decoder, kind: str, max_len: int, batch: int = 1, dtype=None, **options) -> KVCache:
    """An empty cache of ``kind`` shaped for ``model``; storage dtype defaults to the model's compute dtype;
    ``options`` are the kind's own."""
    c = model.config
    return make_cache(kind, c.n_layer, c.n_kv_head, c.head_dim, max_len, batch,
                      dtype=dtype or model_dtype(model), device=model_device(model), **options)


@torch.inference_mode()
def prefill(model: Decoder, prompt_ids, cache: KVCache, last_only: bool = False,
            pad=None) -> tuple[torch.Tensor, KVCache]:
    """(B, T) prompt in one pass -> logits (B, T, vocab), or (B, 1, vocab) with ``last_only``; the cache then holds
    T more positions.

    Prompts of different lengths (a list of id lists or 1-D tensors) are left-padded into one batch, and ``pad``
    (B,) says how many padding slots an already padded batch has; either way the cache records the padding
    (``set_padding``), so every later step of the batch keeps each sequence's own positions. The logits are in
    the padded layout: the last column is every sequence's last token."""
    if is_prompt_list(prompt_ids):
        if pad is not None:
            raise ValueError("give either a list of prompts or a padded batch with pad, not both")
        prompt_ids, pad = as_prompts(prompt_ids, model.config.vocab_size)
    # shape and dtype; the ids' range only where that needs no device sync (ids not yet on an accelerator)
    on_device = isinstance(prompt_ids, torch.Tensor) and prompt_ids.device.type != "cpu"
    prompt_ids = _as_batch(prompt_ids, None if on_device else model.config.vocab_size).to(model_device(model))
    if pad is not None:  # every sequence keeps a token of its prompt (a chunked prefill calls set_padding itself)
        pad = check_padding(pad, *prompt_ids.shape, prompt_ids.device)
        if pad is not None:
            cache.set_padding(pad)
    return model(prompt_ids, cache=cache, last_only=last_only), cache


@torch.inference_mode()
def decode_step(model: Decoder, last_token: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
    """(B, 1): exactly one new token per sequence -> logits (B, 1, vocab)."""
    if not isinstance(last_token, torch.Tensor):  # ids as lists or an array: a tensor on the model's device
        last_token = _as_ids(last_token).to(model_device(model))
    if last_token.dim() != 2 or last_token.shape[1] != 1:
        raise ValueError(f"decode_step takes exactly one token per sequence, shape (B, 1); got "
                         f"{tuple(last_token.shape)}")
    return model(last_token, cache=cache), cache


def greedy_loop(first, step, max_new_tokens: int) -> GreedyOutput:
    """The greedy loop itself, for any model: ``first()`` gives the logits (B, vocab) of the position after the
    prompt, ``step(token)`` consumes the chosen tokens (B, 1) and gives the next position's logits."""
    tokens, logits = [], []
    last = first()
    for i in range(max_new_tokens):
        nxt = last.argmax(dim=-1, keepdim=True)  # (B, 1)
        logits.append(last)
        tokens.append(nxt)
        if i + 1 < max_new_tokens:
            last = step(nxt)
    return GreedyOutput(tokens=torch.cat(tokens, dim=1), logits=torch.stack(logits, dim=1))


def greedy_uncached(forward_last, idx: torch.Tensor, max_new_tokens: int) -> GreedyOutput:
    """Greedy without a cache: ``forward_last(ctx)`` (B, 1, vocab) re-runs the whole context every step."""
    ctx = idx

    def step(nxt):
        nonlocal ctx
        ctx = torch.cat([ctx, nxt], dim=1)
        return forward_last(ctx)[:, -1]

    return greedy_loop(lambda: forward_last(ctx)[:, -1], step, max_new_tokens)


@torch.inference_mode()
def greedy(model: Decoder, prompt_ids, max_new_tokens: int, layout: str | None = None, cache_dtype=None,
           max_len: int | None = None, pad=None, **options) -> GreedyOutput:
    """Greedy generation of ``max_new_tokens`` tokens after ``prompt_ids`` (B, T), or after each of a list of
    prompts of different lengths (``[[464, 3290], [50256], ...]``: left-padded into one batch, each sequence with
    its own positions; ``out.tokens[i]`` is sequence i's). ``pad`` (B,) gives the padding of a batch padded already.

    ``layout`` None re-runs the whole context every step (the uncached oracle); a cache kind ("concat", "prealloc",
    "quant", "window", ...) prefills a cache of that kind once and then decodes one token per step. ``options``
    are the kind's options, or, uncached, the reference's (``window``, ``sinks``; ``keep``, an evicting kind's
    ``out.keeps``): the options a kind was built with and ``**cache.reference(cache.opts)`` give a cached run and
    the uncached run it must equal.
    ``cache_dtype`` is the cache's storage dtype (default: the model's); ``max_len`` its capacity (default: prompt +
    new tokens).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if pad is None:
        idx, pad = as_prompts(prompt_ids, model.config.vocab_size)
    elif _is_ragged(prompt_ids):
        raise ValueError(f"prompts of different lengths ({', '.join(str(len(p)) for p in prompt_ids)} tokens) are "
                         "left-padded for you: give either a list of prompts or a padded (B, T) batch with pad, not "
                         "both")
    else:
        idx = _as_batch(prompt_ids, model.config.vocab_size)
    idx = idx.to(model_device(model))
    B, T = idx.shape
    if layout is None:
        return greedy_uncached(lambda ctx: model(ctx, last_only=True, pad=pad, **options), idx, max_new_tokens)
    cache = new_cache(model, layout, T + max_new_tokens if max_len is None else max_len, B, cache_dtype, **options)
    keeps = KeepRecord(check_padding(pad, B, T, idx.device)) if cache.evicts else None

    def first():
        if keeps is not None:
            keeps.note(cache, T)
        return prefill(model, idx, cache, last_only=True, pad=pad)[0][:, -1]

    def step(nxt):
        if keeps is not None:
            keeps.note(cache, 1)
        return decode_step(model, nxt, cache)[0][:, -1]

    out = greedy_loop(first, step, max_new_tokens)
    if keeps is not None:  # the forward the last chosen token would get: what the cache holds now, plus itself
        keeps.note(cache, 1)
    out.keeps = keeps
    return out


# ---- a static decode step, for torch.compile -------------------------------------------------------------------

class _StaticWrites:
    """What attention's ``cache.update`` sees inside a compiled decode step: K/V written at a position held in a
    tensor, each layer's whole buffer handed back (static shapes; the mask hides the slots past the position)."""

    pos = 0  # attention reads it only on its no-mask paths, which a static step never takes
    evicts = wants_scores = fused = False  # a pre-allocated cache keeps every position; its step is already compiled

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], input_pos: torch.Tensor):
        self.k, self.v, self.input_pos = k, v, input_pos

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        k, v = self.k[layer], self.v[layer]  # (B, nh, max_len, hs), written in place
        k[:, :, self.input_pos] = k_new.to(k.dtype)
        v[:, :, self.input_pos] = v_new.to(v.dtype)
        return k, v


class StaticDecoder(nn.Module):
    """One decode step of a pre-allocated cache with static shapes, for ``torch.compile`` (gpt-fast's recipe):
    the position is a tensor, not a Python int; each layer's K and V (views of the cache's storage) are registered
    buffers of this module, so the compiled step writes them in place (one buffer for all layers would be copied
    whole by every layer's write: 4x slower on CPU) and CUDA graphs treat them as static; attention reads all
    ``max_len`` slots under a mask. Same weights, same blocks as the model's own forward: only where K/V are
    written and which slots are read differ."""

    def __init__(self, model, cache: PreallocKVCache):
        super().__init__()
        self.model = model
        self.n_layer = cache.n_layer
        self.use(cache)

    def use(self, cache: PreallocKVCache) -> None:
        """Decode into ``cache``: its buffers become this module's (same shapes: no recompile; CUDA graphs
        re-record)."""
        if not isinstance(cache, PreallocKVCache) or cache.pad is not None:
            raise ValueError("a static decode step runs on a prealloc cache of one prompt length (no padding)")
        for layer in range(self.n_layer):
            self.register_buffer(f"k{layer}", cache.k[layer], persistent=False)  # (B, nh, max_len, hs) views
            self.register_buffer(f"v{layer}", cache.v[layer], persistent=False)
        slots = getattr(self, "slots", None)
        if slots is None or slots.numel() != cache.max_len or slots.device != cache.device:
            self.register_buffer("slots", torch.arange(cache.max_len, device=cache.device), persistent=False)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """idx (B, 1), input_pos (1,) long: the position written -> logits (B, 1, vocab)."""
        m = self.model
        x, rope = m.embed(idx, input_pos), m.rotary(input_pos)  # (B, 1, C); a rotary family's angles
        mask = (self.slots <= input_pos).view(1, 1, 1, -1)  # (1, 1, 1, max_len)
        writes = _StaticWrites([getattr(self, f"k{i}") for i in range(self.n_layer)],
                               [getattr(self, f"v{i}") for i in range(self.n_layer)], input_pos)
        for layer, block in enumerate(m.blocks):
            x = block(x, writes, layer, mask, rope)
        return m.head(x)


# ---- a fused kind's decode step, compiled whole ------------------------------------------------------------------

_FUSED_CACHES: dict[int, KVCache] = {}  # FusedDecoder.handle -> the cache its step decodes into, while it runs


@torch.library.custom_op("kvlab::attend_decode", mutates_args=())
def _attend_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, handle: int,
                   layer: int) -> torch.Tensor:
    """One layer's decode attention of a kind that ``fuses_decode``, as one opaque op of a compiled step: the
    cache's own ``attend_decode`` (it writes the step's K/V into the kind's storage, which no tensor of the graph
    is: the graph sees q, k_new, v_new in and a new tensor out). (B, nh, 1, hs) -> (B, nh, 1, hs)."""
    return _FUSED_CACHES[handle].attend_decode(layer, q, k_new, v_new, None).to(q.dtype).contiguous()  # a new tensor


@_attend_decode.register_fake
def _(q, k_new, v_new, handle, layer):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


class _FusedStep:
    """What attention sees inside a compiled fused step: a cache whose every decode step goes to attend_decode."""

    fused, fuses_ragged, evicts, wants_scores, pos = True, False, False, False, 0

    def __init__(self, handle: int):
        self.handle = handle

    def attend_decode(self, layer, q, k_new, v_new, mask=None):
        return torch.ops.kvlab.attend_decode(q, k_new, v_new, self.handle, layer)


class FusedDecoder(nn.Module):
    """One decode step of a kind that ``fuses_decode`` (quant, paged), for ``torch.compile``: the model's blocks with
    static shapes (the position is a tensor), each layer's attention the kind's ``attend_decode`` as one opaque op
    (``kvlab::attend_decode``: it writes and reads K/V where the kind stores them, in the kind's own code). So the
    step around the kernel (projections, MLPs, norms, the vocabulary projection) is compiled as prealloc's
    ``StaticDecoder`` is, and a fused kind's step is compared with prealloc's on equal terms. Runs without
    CUDA graphs (the op's bookkeeping is Python that a replayed graph would skip)."""

    _handles = itertools.count()

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.handle = next(FusedDecoder._handles)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """idx (B, 1), input_pos (1,) long: the position written -> logits (B, 1, vocab). Call inside ``using``."""
        m = self.model
        x, rope = m.embed(idx, input_pos), m.rotary(input_pos)  # (B, 1, C); a rotary family's angles
        step = _FusedStep(self.handle)
        for layer, block in enumerate(m.blocks):
            x = block(x, step, layer, None, rope)
        return m.head(x)

    @contextmanager
    def using(self, cache: KVCache):
        """Inside: this decoder's op decodes into ``cache``, whose ``fused`` is on."""
        _FUSED_CACHES[self.handle], cache.fused = cache, True
        try:
            yield
        finally:
            cache.fused = False
            _FUSED_CACHES.pop(self.handle, None)

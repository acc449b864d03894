"""Attention as every decoder family runs it: the visibility masks (causal, a window's, a ragged batch's, an evicting
kind's per head), and the one place a layer meets its cache (``attend``). A family's attention module projects q, k
and v (and positions them: rotary families rotate q and k first) and hands them here; what the cache stores, returns
and decides after attention is the same for every family.

Grouped-query attention: q has ``n_head`` heads and k, v have ``n_kv_head`` (a divisor; 1 is multi-query). K and V
are never expanded where they are stored: the cache holds ``n_kv_head`` heads, and attention reads each K/V head for
its group of ``n_head // n_kv_head`` query heads (SDPA's ``enable_gqa``; the explicit path expands inside attention
only). A mask per K/V head (an evicting kind's) is repeated over its group's query heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models import cpu_kernels


def attention_mask(past: int, T: int, key_pos: torch.Tensor | None, device, window: int | None = None,
                   sinks: int = 0, pad: torch.Tensor | None = None) -> torch.Tensor | None:
    """Which keys each of the T queries (in slots past .. past + T - 1) may attend: (T, n_keys) bool, (B, 1, T,
    n_keys) for a ragged batch, or None when it is plain causal attention over the whole history in order
    (attention's fast paths handle that).

    ``pad`` (B,): sequence b's first pad[b] slots are padding, and its token in slot s has position s - pad[b].
    ``key_pos`` says where each key the cache returns sits: (n_keys,) the slot of each key, shared by the batch;
    (B, n_keys) the position of each key per sequence (negative: the slot holds nothing); (B, nh, n_keys) the
    position of each key per sequence and head (an evicting kind's layer; the mask is then (B, nh, T, n_keys));
    None: slots 0 .. past + T - 1. A query at position t sees a key at position j when 0 <= j <= t and, with a
    ``window``, when also j < ``sinks`` or t - window < j. A padding query sees every key: its output is never
    read, and a query that sees nothing would make attention NaN."""
    if key_pos is None and window is None and pad is None:
        return None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1
                               or isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0):
        raise ValueError(f"window={window!r}, sinks={sinks!r}: window must be an integer >= 1 and sinks >= 0")
    q = torch.arange(past, past + T, device=device).unsqueeze(1)  # (T, 1) slots
    j = torch.arange(past + T, device=device) if key_pos is None else key_pos
    if j.dim() == 3:  # (B, nh, n_keys): positions per sequence and head (an evicting kind), -1 empty
        off = 0 if pad is None else pad.view(-1, 1, 1, 1)
        q = q.view(1, 1, T, 1) - off  # (B or 1, 1, T, 1) positions
        mask = (j.unsqueeze(2) >= 0) & (j.unsqueeze(2) <= q)  # (B, nh, T, n_keys)
        mask = mask | (q < 0)  # a padding query sees every key
        return None if T == 1 and bool(mask.all()) else mask
    if pad is None and j.dim() == 1:
        j = j.unsqueeze(0)  # (1, n_keys)
        mask = j <= q
    else:
        off = 0 if pad is None else pad.view(-1, 1, 1)
        q = q.unsqueeze(0) - off  # (B, T, 1) positions
        j = j.unsqueeze(1) if j.dim() == 2 else j.view(1, 1, -1) - off  # (B, 1, n_keys) positions
        mask = (j >= 0) & (j <= q)
    if window is not None:
        mask &= (j < sinks) | (j > q - window)
    if mask.dim() == 3:
        mask = (mask | (q < 0)).unsqueeze(1)  # (B, 1, T, n_keys), one mask per sequence for every head
    if T == 1 and bool(mask.all()):
        return None  # a decode step that sees every key it is given
    return mask


def check_padding(pad, B: int, T: int, device) -> torch.Tensor | None:
    """``pad`` as a (B,) long tensor on ``device`` (None when no sequence is padded); each sequence keeps a token."""
    if pad is None:
        return None
    pad = torch.as_tensor(pad)
    if pad.is_floating_point() or pad.dtype == torch.bool or tuple(pad.shape) != (B,):
        raise ValueError(f"pad must be {B} integers (one per sequence), got {pad.dtype} of shape {tuple(pad.shape)}")
    if int(pad.min()) < 0 or int(pad.max()) >= T:
        raise ValueError(f"pad must lie in [0, {T}) so that every sequence of the {T} slots keeps a token, got "
                         f"{pad.tolist()}")
    return pad.to(device=device, dtype=torch.long) if pad.any() else None


def groups_of(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per K/V head (1: multi-head attention)."""
    nh, nkv = q.size(1), k.size(1)
    if nh % nkv:
        raise ValueError(f"{nh} query heads cannot share {nkv} K/V heads: n_kv_head must divide n_head")
    return nh // nkv


def per_query_head(mask: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """A mask with one entry per K/V head, (B, n_kv_head, T, n_keys), repeated over each group's query heads;
    any other mask as given (it broadcasts over heads)."""
    if mask is None or groups == 1 or mask.dim() != 4 or mask.size(1) == 1:
        return mask
    return mask.repeat_interleave(groups, dim=1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention, q (B, nh, T, hs) over k, v (B, nkv, n_keys, hs): each K/V head serves its group
    of query heads; ``mask`` True = may attend."""
    if mask is None and not causal and q.size(2) == 1:  # a decode step: kvlab's CPU kernel, where it runs
        y = cpu_kernels.decode_attention(q, k, v)
        if y is not None:
            return y
    groups = groups_of(q, k)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=per_query_head(mask, groups), is_causal=causal,
                                          enable_gqa=groups > 1)


def scored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its probabilities as a tensor: (output (B, nh, T, hs), probabilities (B, nh, T, n_keys), one
    row per query head), what a cache kind that scores keys is handed; ``mask`` True = may attend (None: every
    key). K and V are expanded to the query heads here, inside attention, never in the cache."""
    groups = groups_of(q, k)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, T, n_keys)
    mask = per_query_head(mask, groups)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    probs = att.softmax(dim=-1)
    return probs @ v, probs


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache=None, layer: int = 0,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention: q (B, nh, T, hs), this forward's k, v (B, nkv, T, hs) -> (B, nh, T, hs) in q's dtype.

    Without a cache: over this forward's keys (causal, or ``mask``). With one: the kind stores k and v and returns
    the keys and values these queries attend over (``update``), in its storage dtype; a kind that ``fuses_decode``
    takes a decode step itself while ``fused`` (``attend_decode``: K/V read where they lie); an evicting kind is
    told what attention saw (``after_attention``, with the probabilities when it ``wants_scores``). ``mask`` (True =
    may attend) is given when visibility is not plain causal over the whole history in order."""
    T = q.size(2)
    past = 0
    if cache is not None:
        if cache.fused and T == 1 and (mask is None or cache.fuses_ragged):  # a decode step read where the kind
            return cache.attend_decode(layer, q, k, v, mask)  # stores K/V
        past = cache.pos
        k, v = cache.update(layer, k, v)  # (B, nkv, n_keys, hs) in the storage dtype
        if T == 1 and mask is None and not cache.evicts:  # a decode step: kvlab's CPU kernel reads K/V as stored
            y = cpu_kernels.decode_attention(q, k, v)
            if y is not None:
                return y
        k, v = k.to(q.dtype), v.to(q.dtype)  # no-op when storage and compute dtypes agree
        if cache.evicts:  # the kind chooses what it keeps after attending (with the probabilities, if it asks)
            y, probs = scored_attention(q, k, v, mask) if cache.wants_scores else (sdpa(q, k, v, mask), None)
            cache.after_attention(layer, probs)
            return y
    if mask is not None:
        return sdpa(q, k, v, mask)
    if T == 1:  # one decode step: the new token sees the whole history, no mask
        return sdpa(q, k, v)
    if past == 0:  # a full forward, or prefill into an empty cache: plain causal
        return sdpa(q, k, v, causal=True)
    # a chunk after history: all of the history, causally within the chunk
    mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return sdpa(q, k, v, mask)

"""What every decoder family shares: one ``forward(idx, cache)`` for the uncached oracle, prefill and decode, and
the references of the cache kinds (``window``/``sinks``, ``pad``, ``keep``). A family subclasses ``Decoder`` and says
how tokens enter (``embed``: GPT-2 adds a learned position row), what its attention positions q and k with
(``rotary``: a rotary family's cos/sin, None for GPT-2), its blocks (``blocks``: each ``block(x, cache, layer, mask,
rope)``) and how the last hidden state becomes logits (``head``). Everything about the cache (positions from
``cache.pos``, the kind's visibility rule as a mask, an evicting kind's per-layer masks, ``advance`` once after the
last layer) happens here, once, for every family.

A family's config gives ``n_layer``, ``n_head``, ``n_kv_head`` (K/V heads: what a cache stores), ``head_dim``,
``n_positions`` (positions the model was built for), ``vocab_size``, and ``num_params()``, ``param_nbytes(dtype)``,
``param_shapes()`` from the config alone.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.attention import attention_mask, check_padding
from models.kv_cache import KVCache


class Decoder(nn.Module):
    """The base of every decoder family (``models.gpt2.GPT2``, ``models.llama.Llama``)."""

    def store_weights_input_major(self) -> None:
        """Keep each projection weight's (out, in) shape but lay its memory out as (in, out), HF GPT-2's Conv1D order,
        where that is the faster one: for every weight with at least as many outputs as inputs.

        A decode step multiplies one row vector by every weight matrix, and on CPU (MKL) that product streams an
        (in, out)-major matrix about 30% faster than an (out, in)-major one when out >= in; a weight that narrows
        (the MLP's down projection, in = 4 x out) streams faster (out, in)-major and keeps nn.Linear's own layout:
        on GPT-2 small that alone takes 8% off a decode step at depth 960
        (``scripts/probes/gemv_probe.py``). Values, shapes and names are unchanged; ``.to()`` keeps the layout. The
        tied embedding / lm_head matrix gets it too: the lm_head product is the biggest of a step, and an embedding
        lookup of a few rows does not mind the strides.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module is not self.lm_head:
                w = module.weight
                if isinstance(module, nn.Embedding) or w.shape[0] >= w.shape[1]:
                    module.weight = nn.Parameter(w.detach().t().contiguous().t())

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) at positions ``pos`` ((T,), or (B, T) for a ragged batch) -> (B, T, C)."""
        raise NotImplementedError

    def rotary(self, pos: torch.Tensor):
        """What the blocks' attention positions q and k with at ``pos`` (None: the family has no rotary positions)."""
        return None

    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last hidden state (B, T, C) -> logits (B, T, vocab)."""
        raise NotImplementedError

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (HF's name for it)."""
        raise NotImplementedError

    @property
    def final_norm(self) -> nn.Module:
        """The norm before the output projection."""
        raise NotImplementedError

    def check_length(self, past: int, T: int) -> None:
        """Refuse a forward past what the family computes exactly (``past`` tokens before it, ``T`` new), in one line.
        Default: the positions the model was built for (a learned position table has no row past them)."""
        if past + T > self.config.n_positions:
            raise ValueError(f"sequence too long: {past} cached + {T} new tokens > n_positions "
                             f"{self.config.n_positions} (the positions the model was built for)")

    def _rope(self, pos, cache, key_pos, n_keys: int, repositioned: bool, rule: tuple):
        """What a rotary family's attention positions q and k with (None: GPT-2); where keys are rotated inside
        attention (a cache that stores them before the rotation, or a re-positioned window), which positions the
        keys it reads hold and the rule that places them (``rule``: the uncached reference's sinks and window)."""
        rope = self.rotary(pos)
        inside = repositioned or (cache is not None and cache.prerope)
        if inside and rope is None:
            raise ValueError(f"{type(self).__name__} has no rotary positions: keys stored before the rotation or "
                             "re-positioned within a cache need them (a learned position table is added at the "
                             "input and has no row past n_positions)")
        if inside:
            rope.keys_at(torch.arange(n_keys, device=pos.device) if key_pos is None else key_pos,
                         rule if cache is None else cache.rotary_rule)
        return rope

    @staticmethod
    def _check_args(idx, cache, window, sinks, pad, keep, positions="absolute"):
        """``forward``'s arguments checked against each other, one line each; returns the padding an uncached
        ``keep`` reference runs with (the record's), else ``pad`` as given."""
        if idx.dim() != 2 or idx.is_floating_point() or idx.dtype == torch.bool:
            raise ValueError(f"idx must be (B, T) integer token ids, got {idx.dtype} of shape {tuple(idx.shape)}")
        B, T = idx.shape
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0 (the first positions every query sees), got {sinks!r}")
        if cache is not None and (window is not None or sinks or pad is not None):
            raise ValueError("window/sinks and pad describe the uncached reference; a cache applies its own kind's "
                             "rule and holds its own padding (cache.set_padding)")
        if keep is not None and (cache is not None or window is not None):
            raise ValueError("keep is the uncached reference of an evicting kind: give it without a cache or window")
        if window is None and sinks:
            raise ValueError(f"sinks={sinks} needs a window: give window=W too (sinks are kept beside the last W "
                             "tokens)")
        if positions not in ("absolute", "cache"):
            raise ValueError(f"positions={positions!r}: use absolute, or cache (the re-positioned window's reference)")
        if positions == "cache" and (window is None or pad is not None):
            raise ValueError("positions='cache' is the reference of a window that re-positions its keys: give "
                             "window=W (and sinks), without pad")
        if keep is not None:
            given = check_padding(pad, B, T, idx.device)
            if given is not None and (keep.pad is None or not torch.equal(given.cpu(), keep.pad.cpu())):
                raise ValueError("pad differs from the keep record's: the reference runs on the batch the record "
                                 "was noted on")
            pad = keep.pad
        return pad

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, last_only: bool = False,
                window: int | None = None, sinks: int = 0, pad=None, keep=None,
                positions: str = "absolute") -> torch.Tensor:
        """idx (B, T) -> logits (B, T, vocab). With a cache, positions start at ``cache.pos`` and ``pos`` advances
        by T once every layer has stored its K and V. ``last_only`` asks for the last position's logits alone,
        (B, 1, vocab), sparing the vocabulary projection of positions nobody reads (generation's choice).

        ``window``/``sinks`` make the uncached forward the reference of the window cache kind: the query at position
        t sees the keys at positions j with j < sinks or t - window < j <= t. A cache applies its own kind's rule
        (``cache.reference``), so they are not given with one.

        ``pad`` (B,) makes idx a left-padded ragged batch: sequence b's first pad[b] columns are padding, its tokens
        start at position 0, and no query attends to padding. With a cache, the padding is the cache's
        (``cache.set_padding``, which ``prefill`` calls), so it is not given here.

        ``keep`` (a ``models.kv_cache.KeepRecord``) makes the uncached forward the reference of an evicting kind:
        in layer l, head h, the query at slot t sees what the cache held before t's forward plus that forward's
        slots up to t (the record's padding is the batch's).

        ``positions="cache"`` (with ``window``/``sinks``, a rotary family) is the reference of a window that
        re-positions its keys: each query sees what the window shows it, at positions within the cache
        (StreamingLLM's), so a sequence may run past the positions the model was trained for."""
        pad = self._check_args(idx, cache, window, sinks, pad, keep, positions)
        B, T = idx.shape
        if cache is None:
            past, pad = 0, check_padding(pad, B, T, idx.device)
            pad_min = 0 if pad is None else int(pad.min())
        else:
            past, pad, pad_min = cache.pos, cache.pad, cache.pad_min
        repositioned = positions == "cache" or (cache is not None and cache.rotary_rule is not None)
        if not repositioned:  # a re-positioning window keeps every distance within its own slots
            self.check_length(past - pad_min, T)
        rule = cache.reference(cache.opts) if cache is not None else (
            {} if window is None else {"window": window, "sinks": sinks})
        key_pos = None if cache is None else cache.key_positions(T)
        mask = None if keep is not None or (cache is not None and cache.evicts) else attention_mask(
            past, T, key_pos, idx.device, pad=pad, window=rule.get("window"), sinks=rule.get("sinks", 0))
        pos = torch.arange(past, past + T, device=idx.device)  # (T,)
        if pad is not None:
            pos = (pos - pad.unsqueeze(1)).clamp(min=0)  # (B, T): each sequence's own positions; padding gets 0
        x = self.embed(idx, pos)  # (B, T, C)
        rope = self._rope(pos, cache, key_pos, past + T, repositioned, (sinks, window))
        per_layer = None  # key sets that differ by layer and head: a mask per layer
        if cache is not None and cache.evicts:
            def per_layer(layer):
                return attention_mask(past, T, cache.layer_key_positions(layer, T), idx.device, pad=pad)
        elif keep is not None:
            def per_layer(layer):
                return keep.mask(layer, T, idx.device)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer, mask if per_layer is None else per_layer(layer), rope)
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]  # (B, 1, C)
        return self.head(x)  # (B, T, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied lm_head counts once

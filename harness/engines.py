"""Ours and HF transformers behind one small interface, so both run through the same measurements.

An engine wraps one model and offers: ``forward(ids)`` (uncached, full causal), ``new_cache(layout, max_len, batch,
dtype)``, ``prefill(ids, cache)``, ``decode(token, cache)`` (both return logits (B, T, vocab)) and ``nbytes(cache)``.
Layout "concat" is a growing cache (ours: ConcatKVCache; HF: DynamicCache); "prealloc" a cache of max_len slots
(ours: PreallocKVCache; HF: StaticCache).
"""

from __future__ import annotations

import torch

from models.generate import decode_step, model_device, model_dtype, new_cache, prefill
from models.gpt2 import _CONV1D, GPT2


class KvlabEngine:
    name = "kvlab"

    def __init__(self, model: GPT2):
        self.model = model.eval()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)

    def new_cache(self, layout: str, max_len: int, batch: int = 1, dtype=None):
        return new_cache(self.model, layout, max_len, batch, dtype)

    def prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        return prefill(self.model, ids, cache)[0]

    def decode(self, token: torch.Tensor, cache) -> torch.Tensor:
        return decode_step(self.model, token, cache)[0]

    def rewind(self, cache, n: int = 1) -> None:
        """Forget the last ``n`` positions (used to time many steps at one context length)."""
        cache.crop(cache.pos - n)

    def nbytes(self, cache) -> int:
        return cache.nbytes


class HFEngine:
    """HF ``GPT2LMHeadModel`` holding the same weights as one of our models."""

    name = "hf"

    def __init__(self, model: GPT2):
        from transformers import GPT2Config as HFConfig
        from transformers import GPT2LMHeadModel

        c = model.config
        self.config = HFConfig(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, n_positions=c.n_positions,
                               vocab_size=c.vocab_size, layer_norm_epsilon=c.layer_norm_epsilon,
                               bos_token_id=c.vocab_size - 1, eos_token_id=c.vocab_size - 1)
        hf = GPT2LMHeadModel(self.config)
        state = {k: (v.t() if k.endswith(_CONV1D) else v) for k, v in model.state_dict().items()}
        missing, unexpected = hf.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
        if missing or unexpected:
            raise RuntimeError(f"weights did not map onto HF GPT-2: missing {missing}, unexpected {unexpected}")
        self.model = hf.to(device=model_device(model), dtype=model_dtype(model)).eval()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False).logits

    def new_cache(self, layout: str, max_len: int, batch: int = 1, dtype=None):
        from transformers import DynamicCache, StaticCache

        if layout == "concat":
            return DynamicCache(config=self.config)
        if layout == "prealloc":
            return StaticCache(config=self.config, max_cache_len=max_len)
        raise ValueError(f"unknown cache layout {layout!r}: use concat or prealloc")

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        return self._step(ids, cache)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor, cache) -> torch.Tensor:
        return self._step(token, cache)

    def _step(self, ids: torch.Tensor, cache) -> torch.Tensor:
        past = cache.get_seq_length()
        pos = torch.arange(past, past + ids.shape[1], device=ids.device)
        return self.model(ids, cache=cache, use_cache=True, position_ids=pos.unsqueeze(0)).logits

    def rewind(self, cache, n: int = 1) -> None:
        cache.crop(-n)

    def nbytes(self, cache) -> int:
        total = 0
        for layer in cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total


ENGINES = {"kvlab": KvlabEngine, "hf": HFEngine}

"""GPT-2, written out by hand: attention, MLP, block, config, model (bottom-up, nanoGPT's order).

Parameter names follow Hugging Face's GPT-2 (``transformer.wte``, ``transformer.h.N.attn.c_attn``, ...), so a
checkpoint is HF's state dict with the four Conv1D weights transposed: ``models.hf_checkpoint`` holds that format
(reading, writing, the transposes), and ``GPT2.from_pretrained`` / ``load_hf_state_dict`` use it. One forward path
serves every use: without a cache it is the full causal recompute (the oracle); with one, positions start at
``cache.pos`` and each layer stores its K and V through ``cache.update``. The cache is passed in, never attached to
the model.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import hf_checkpoint as hf
from models.hf_checkpoint import CheckpointError  # public here too: models.gpt2.CheckpointError
from models.kv_cache import KVCache


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (T, n_keys) bool, True = may attend: given when the visibility is not plain causal over the
        whole history (a window, or a cache that returns only some positions); None: plain causal."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        past = 0
        if cache is not None:
            if cache.fused and T == 1 and (mask is None or cache.fuses_ragged):  # a decode step read where the
                y = cache.attend_decode(layer, q, k, v, mask)  # kind stores K/V
                return self.c_proj(y.transpose(1, 2).reshape(B, T, C))
            past = cache.pos
            k, v = cache.update(layer, k, v)  # (B, nh, n_keys, hs) in the storage dtype
            k, v = k.to(q.dtype), v.to(q.dtype)  # no-op when storage and compute dtypes agree
            if cache.evicts:  # the kind chooses what it keeps after attending (with the probabilities, if it asks)
                y, probs = scored_attention(q, k, v, mask) if cache.wants_scores else (
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None)
                cache.after_attention(layer, probs)
                return self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        if mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif T == 1:  # one decode step: the new token sees the whole history, no mask
            y = F.scaled_dot_product_attention(q, k, v)
        elif past == 0:  # a full forward, or prefill into an empty cache: plain causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # a chunk after history: all of the history, causally within the chunk
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.c_proj(y)


def scored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its probabilities as a tensor: (output (B, nh, T, hs), probabilities (B, nh, T, n_keys)),
    what a cache kind that scores keys is handed; ``mask`` True = may attend (None: every key)."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, T, n_keys)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    probs = att.softmax(dim=-1)
    return probs @ v, probs


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, mask)
        return x + self.mlp(self.ln_2(x))


PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
    # kvlab's trained reference model (harness.train, model=mini); with weights=random, its untrained control
    "mini": dict(n_layer=6, n_head=2, n_embd=128, n_positions=1024),
    # for tests: tiny but with the full vocabulary, so real text prompts work
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, n_positions=128),
}


@dataclass
class GPT2Config:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_positions: int = 1024
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_positions > MAX_POSITIONS:
            raise ValueError(f"n_positions {self.n_positions:,} is beyond what kvlab builds: at most "
                             f"{MAX_POSITIONS:,}")
        for name in ("layer_norm_epsilon", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
                raise ValueError(f"{name} must be a number between 0 and 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def param_shapes(self):
        """(name, shape) of every parameter ``GPT2(self)`` builds, in its order, without building it (a generator:
        a caller that stops early never spells out every layer). The tied lm_head is transformer.wte.weight."""
        C, V, P = self.n_embd, self.vocab_size, self.n_positions
        yield "transformer.wte.weight", (V, C)
        yield "transformer.wpe.weight", (P, C)
        for i in range(self.n_layer):
            h = f"transformer.h.{i}."
            yield from ((h + "ln_1.weight", (C,)), (h + "ln_1.bias", (C,)),
                        (h + "attn.c_attn.weight", (3 * C, C)), (h + "attn.c_attn.bias", (3 * C,)),
                        (h + "attn.c_proj.weight", (C, C)), (h + "attn.c_proj.bias", (C,)),
                        (h + "ln_2.weight", (C,)), (h + "ln_2.bias", (C,)),
                        (h + "mlp.c_fc.weight", (4 * C, C)), (h + "mlp.c_fc.bias", (4 * C,)),
                        (h + "mlp.c_proj.weight", (C, 4 * C)), (h + "mlp.c_proj.bias", (C,)))
        yield "transformer.ln_f.weight", (C,)
        yield "transformer.ln_f.bias", (C,)

    def num_params(self) -> int:
        """Parameters ``GPT2(self)`` holds (the tied lm_head once), from the config alone: V*C + P*C for the
        embeddings, 12*C^2 + 13*C per block, 2*C for ln_f. Equals ``GPT2(self).num_params()``."""
        C = self.n_embd
        return (self.vocab_size + self.n_positions) * C + self.n_layer * (12 * C * C + 13 * C) + 2 * C

    def param_nbytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the parameters in ``dtype``, from the config alone (nothing is allocated)."""
        return self.num_params() * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def preset(cls, name: str) -> GPT2Config:
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown GPT-2 preset {name!r}: use one of {', '.join(PRESETS)}") from None

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> GPT2Config:
        """Our config from an HF GPT-2 ``config.json`` dict; refuses what is not GPT-2, naming the file."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: holds a JSON {type(d).__name__}, not an object of GPT-2 settings")
        if d.get("model_type") != "gpt2":
            raise CheckpointError(f"{source}: model_type is {d.get('model_type')!r}, kvlab loads only 'gpt2'")
        act = d.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{source}: activation_function {act!r} is not GPT-2's tanh GELU (gelu_new)")
        missing = [k for k in ARCHITECTURE if k not in d]
        if missing:
            raise CheckpointError(f"{source}: missing {', '.join(repr(k) for k in missing)}; a GPT-2 config.json "
                                  f"gives {', '.join(ARCHITECTURE)}")
        if d.get("n_inner") not in (None, 4 * d["n_embd"]):
            raise CheckpointError(f"{source}: n_inner {d['n_inner']} is not 4 * n_embd; kvlab's MLP is 4x wide")
        if not d.get("scale_attn_weights", True) or d.get("scale_attn_by_inverse_layer_idx", False):
            raise CheckpointError(f"{source}: attention scaling differs from GPT-2's 1/sqrt(head_dim) "
                                  "(scale_attn_weights / scale_attn_by_inverse_layer_idx); kvlab computes GPT-2's")
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from None


ARCHITECTURE = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")  # what a config.json must give
MAX_POSITIONS = 1 << 20

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


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer): two residual adds per block
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=cfg.initializer_range / math.sqrt(2 * cfg.n_layer))
        self._store_weights_input_major()
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def _store_weights_input_major(self) -> None:
        """Keep each projection weight's (out, in) shape but lay its memory out as (in, out), HF Conv1D's order.

        A decode step multiplies one row vector by every weight matrix, and on CPU (MKL) that product streams an
        (in, out)-major matrix about 30% faster than an (out, in)-major one. Values, shapes and names are unchanged;
        ``.to()`` keeps the layout. The tied embedding / lm_head matrix gets it too: the lm_head product is the
        biggest of a step, and an embedding lookup of a few rows does not mind the strides.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module is not self.lm_head:
                module.weight = nn.Parameter(module.weight.detach().t().contiguous().t())

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    @staticmethod
    def _check_args(idx, cache, window, sinks, pad, keep):
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
        if keep is not None:
            given = check_padding(pad, B, T, idx.device)
            if given is not None and (keep.pad is None or not torch.equal(given.cpu(), keep.pad.cpu())):
                raise ValueError("pad differs from the keep record's: the reference runs on the batch the record "
                                 "was noted on")
            pad = keep.pad
        return pad

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, last_only: bool = False,
                window: int | None = None, sinks: int = 0, pad=None, keep=None) -> torch.Tensor:
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
        slots up to t (the record's padding is the batch's)."""
        pad = self._check_args(idx, cache, window, sinks, pad, keep)
        B, T = idx.shape
        if cache is None:
            past, pad = 0, check_padding(pad, B, T, idx.device)
            pad_min = 0 if pad is None else int(pad.min())
        else:
            past, pad, pad_min = cache.pos, cache.pad, cache.pad_min
        if past + T - pad_min > self.config.n_positions:
            raise ValueError(f"sequence too long: {past - pad_min} cached + {T} new tokens > n_positions "
                             f"{self.config.n_positions}")
        rule = cache.reference(cache.opts) if cache is not None else (
            {} if window is None else {"window": window, "sinks": sinks})
        mask = None if keep is not None or (cache is not None and cache.evicts) else attention_mask(
            past, T, None if cache is None else cache.key_positions(T), idx.device, pad=pad, **rule)
        pos = torch.arange(past, past + T, device=idx.device)  # (T,)
        if pad is not None:
            pos = (pos - pad.unsqueeze(1)).clamp(min=0)  # (B, T): each sequence's own positions; padding gets 0
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        per_layer = None  # key sets that differ by layer and head: a mask per layer
        if cache is not None and cache.evicts:
            def per_layer(layer):
                return attention_mask(past, T, cache.layer_key_positions(layer, T), idx.device, pad=pad)
        elif keep is not None:
            def per_layer(layer):
                return keep.mask(layer, T, idx.device)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, cache, layer, mask if per_layer is None else per_layer(layer))
        if cache is not None:
            cache.advance(T)
        if last_only:
            x = x[:, -1:]  # (B, 1, C)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied lm_head counts once

    # ---- checkpoints ------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike) -> GPT2:
        """Load an HF GPT-2 checkpoint: a local folder (config.json + model.safetensors, or pytorch_model.bin read
        with ``weights_only=True``), or a hub id resolved through huggingface_hub when the machine is online. Every
        tensor's shape is checked against config.json (from the safetensors header) before the model is built, so a
        config.json that asks for a bigger model than its weights allocates nothing."""
        folder = hf.resolve(path_or_id)
        cfg = read_hf_config(folder)
        weights_file, state = hf.read_weights(folder, expect=cfg, fmt=hf.GPT2_FORMAT)
        model = cls(cfg)
        model.load_hf_state_dict(state, source=str(weights_file))
        return model

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
        """Copy an HF GPT-2 state dict in (``hf_checkpoint.load_state``: the four Conv1D weights transposed, the
        mask buffers ignored, the tied lm_head checked against wte when given); every tensor is checked."""
        hf.load_state(self, state, source, hf.GPT2_FORMAT)

    def hf_config_dict(self) -> dict:
        """The HF ``config.json`` fields that describe this model."""
        d = asdict(self.config)
        d.update(model_type="gpt2", activation_function="gelu_new", architectures=["GPT2LMHeadModel"])
        return d


def read_hf_config(folder: str | os.PathLike) -> GPT2Config:
    """The GPT2Config of an HF checkpoint folder's config.json; every fault names the file."""
    return GPT2Config.from_hf_dict(hf.read_config(folder), source=str(Path(folder) / hf.CONFIG))

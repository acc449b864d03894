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
from models.attention import attend, attention_mask, check_padding, scored_attention  # noqa: F401 (public here too)
from models.decoder import Decoder
from models.cpu_kernels import Linear
from models.hf_checkpoint import CheckpointError  # public here too: models.gpt2.CheckpointError
from models.kv_cache import KVCache


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (T, n_keys) bool, True = may attend: given when the visibility is not plain causal over the
        whole history (a window, or a cache that returns only some positions); None: plain causal."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = attend(q, k, v, cache, layer, mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd)

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
                mask: torch.Tensor | None = None, rope=None) -> torch.Tensor:
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

    @property
    def n_kv_head(self) -> int:
        """K/V heads, what a cache stores: GPT-2 has one per query head."""
        return self.n_head

    family = "gpt2"  # config.json's model_type (not a field: a class fact)
    rotary = False  # learned absolute positions, added at the input

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

    def buffer_shapes(self):
        """(name, shape) of the tensors an HF GPT-2 checkpoint may carry that are not weights (each block's causal
        mask and its masked_bias): what a checkpoint file may hold besides ``param_shapes``, and at most how big."""
        for i in range(self.n_layer):
            yield f"transformer.h.{i}.attn.bias", (1, 1, self.n_positions, self.n_positions)
            yield f"transformer.h.{i}.attn.masked_bias", ()

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

class GPT2(Decoder):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
        ))
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer): two residual adds per block
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=cfg.initializer_range / math.sqrt(2 * cfg.n_layer))
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(idx) + self.transformer.wpe(pos)  # learned absolute positions, at the input

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(x))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    @property
    def final_norm(self) -> nn.Module:
        return self.transformer.ln_f

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

    @property
    def hf_format(self) -> hf.Format:
        return hf.GPT2_FORMAT

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

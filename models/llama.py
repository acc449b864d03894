"""The Llama family, written out by hand: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP, tied or
untied embeddings; Qwen2 (q/k/v biases) and Mistral are the same decoder with other settings.

Parameter names are Hugging Face's (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, ``model.norm``, ``lm_head``) and so are the layouts, so an HF checkpoint's state dict loads as it
is. The forward is ``models.decoder.Decoder``'s, shared with GPT-2: positions start at ``cache.pos``, the cache is
passed in, and ``model(idx, window=W, sinks=S)``, ``pad`` and ``keep`` are the cache kinds' references as for GPT-2.

Rotary positions: q and k of a token at absolute position p are rotated by p times each channel pair's frequency
(``rope_theta``; Llama 3's long-context rescaling of the frequencies, ``rope_scaling`` of type ``llama3``, is
supported), HF's half-split pairing (channel i with channel i + head_dim / 2). The cache stores keys already rotated,
as HF does. Grouped-query attention: ``n_kv_head`` K/V heads (a divisor of ``n_head``; 1 is multi-query), never
expanded in the cache (``models.attention``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from models import hf_checkpoint as hf
from models.attention import attend
from models.decoder import Decoder
from models.cpu_kernels import Linear
from models.hf_checkpoint import CheckpointError
from models.kv_cache import KVCache

MAX_POSITIONS = 1 << 20
ROPE_TYPES = ("default", "llama3")
MODEL_TYPES = ("llama", "qwen2", "mistral")  # config.json model_types this decoder computes


@dataclass
class LlamaConfig:
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # K/V heads: divides n_head; n_head is multi-head attention, 1 multi-query
    n_embd: int = 64
    intermediate_size: int = 128  # the SwiGLU MLP's hidden width
    n_positions: int = 128  # max_position_embeddings: the positions the model was trained for
    vocab_size: int = 50257
    head_dim: int = 0  # 0: n_embd // n_head
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or Llama 3's {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # biases on q, k, v (Qwen2: on)
    o_bias: bool = False  # a bias on the output projection (Llama's attention_bias sets both)
    mlp_bias: bool = False
    model_type: str = "llama"  # llama, qwen2 or mistral: what config.json says, and what an HF peer builds
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Mistral's attention window: sequences longer than it would need the window's own mask, so they are refused
    sliding_window: int | None = None

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "n_positions", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise ValueError(f"head_dim must be an integer >= 0 (0: n_embd // n_head), got {self.head_dim!r}")
        if not self.head_dim:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}: give head_dim")
            self.head_dim = self.n_embd // self.n_head
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: rotary positions rotate channel pairs")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head {self.n_kv_head} does not divide n_head {self.n_head}: each K/V head serves "
                             "a whole group of query heads")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or not isinstance(
                self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.n_positions > MAX_POSITIONS:
            raise ValueError(f"n_positions {self.n_positions:,} is beyond what kvlab builds: at most {MAX_POSITIONS:,}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r}: this decoder computes {', '.join(MODEL_TYPES)}")
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.rms_norm_eps >= 1 or self.initializer_range >= 1:
            raise ValueError("rms_norm_eps and initializer_range must be below 1")
        self.rope_scaling = _rope_scaling(self.rope_scaling)

    @property
    def family(self) -> str:
        return self.model_type

    rotary = True  # positions are rotations of q and k (a class fact, not a field)

    def param_shapes(self):
        """(name, shape) of every parameter ``Llama(self)`` builds, in its order, without building it; a tied
        lm_head is model.embed_tokens.weight."""
        C, V, hd, I = self.n_embd, self.vocab_size, self.head_dim, self.intermediate_size
        q, kv = self.n_head * hd, self.n_kv_head * hd
        yield "model.embed_tokens.weight", (V, C)
        for i in range(self.n_layer):
            h = f"model.layers.{i}."
            yield h + "self_attn.q_proj.weight", (q, C)
            if self.qkv_bias:
                yield h + "self_attn.q_proj.bias", (q,)
            yield h + "self_attn.k_proj.weight", (kv, C)
            if self.qkv_bias:
                yield h + "self_attn.k_proj.bias", (kv,)
            yield h + "self_attn.v_proj.weight", (kv, C)
            if self.qkv_bias:
                yield h + "self_attn.v_proj.bias", (kv,)
            yield h + "self_attn.o_proj.weight", (C, q)
            if self.o_bias:
                yield h + "self_attn.o_proj.bias", (C,)
            for name, shape in (("gate_proj", (I, C)), ("up_proj", (I, C)), ("down_proj", (C, I))):
                yield h + f"mlp.{name}.weight", shape
                if self.mlp_bias:
                    yield h + f"mlp.{name}.bias", shape[:1]
            yield h + "input_layernorm.weight", (C,)
            yield h + "post_attention_layernorm.weight", (C,)
        yield "model.norm.weight", (C,)
        if not self.tie_word_embeddings:
            yield "lm_head.weight", (V, C)

    def buffer_shapes(self):
        """(name, shape) of the tensors an HF checkpoint may carry that are not weights (older ones store the rotary
        frequencies, per layer or once): what a checkpoint file may hold besides ``param_shapes``."""
        yield "model.rotary_emb.inv_freq", (self.head_dim // 2,)
        for i in range(self.n_layer):
            yield f"model.layers.{i}.self_attn.rotary_emb.inv_freq", (self.head_dim // 2,)

    def num_params(self) -> int:
        """Parameters ``Llama(self)`` holds (a tied lm_head once), from the config alone."""
        return sum(math.prod(shape) for _, shape in self.param_shapes())

    def param_nbytes(self, dtype: torch.dtype = torch.float32) -> int:
        return self.num_params() * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def preset(cls, name: str) -> LlamaConfig:
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown Llama-family preset {name!r}: use one of {', '.join(PRESETS)}") from None

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> LlamaConfig:
        """Our config from an HF Llama, Qwen2 or Mistral ``config.json`` dict; what this decoder does not compute is
        refused in one line naming the file."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: holds a JSON {type(d).__name__}, not an object of model settings")
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise CheckpointError(f"{source}: model_type is {mt!r}; the Llama family here is {', '.join(MODEL_TYPES)}")
        need = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size")
        missing = [k for k in need if k not in d]
        if missing:
            raise CheckpointError(f"{source}: missing {', '.join(repr(k) for k in missing)}; a {mt} config.json gives "
                                  f"{', '.join(need)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{source}: hidden_act {act!r} is not SwiGLU's silu; kvlab's Llama MLP computes silu")
        params = d.get("rope_parameters") or {}
        for name, value in (("rope_parameters", params), ("rope_scaling", d.get("rope_scaling") or {})):
            if not isinstance(value, dict):
                raise CheckpointError(f"{source}: {name} must be an object (or null), got {value!r:.60}")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
            if name in d and not isinstance(d[name], bool):
                raise CheckpointError(f"{source}: {name} must be true or false, got {d[name]!r:.60}")
        if "num_key_value_heads" in d and d["num_key_value_heads"] is not None and (
                isinstance(d["num_key_value_heads"], bool) or not isinstance(d["num_key_value_heads"], int)
                or d["num_key_value_heads"] < 1):
            raise CheckpointError(f"{source}: num_key_value_heads must be a positive integer (or absent: one per "
                                  f"attention head), got {d['num_key_value_heads']!r:.60}")
        scaling = d.get("rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"}
                                            if params.get("rope_type", "default") != "default" else None)
        theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
        n_positions = d.get("max_position_embeddings", 2048)
        window = d.get("sliding_window")
        if mt == "mistral" or d.get("use_sliding_window"):  # a window the model attends through: checked first
            if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise CheckpointError(f"{source}: sliding_window must be a positive integer (the attention window, "
                                      f"in tokens) or null (none), got {window!r:.60}")
        else:
            window = None
        if isinstance(window, int) and not isinstance(window, bool) and isinstance(n_positions, int):
            n_positions = min(n_positions, window)  # past the window attention would need its own mask
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"{source}: partial_rotary_factor {d['partial_rotary_factor']}: kvlab rotates every "
                                  "channel of a head")
        bias = bool(d.get("attention_bias", False))
        try:
            return cls(n_layer=d["num_hidden_layers"], n_head=d["num_attention_heads"],
                       n_kv_head=d.get("num_key_value_heads") or d["num_attention_heads"], n_embd=d["hidden_size"],
                       intermediate_size=d["intermediate_size"], n_positions=n_positions, vocab_size=d["vocab_size"],
                       head_dim=d.get("head_dim") or 0, rope_theta=float(theta), rope_scaling=scaling,
                       rms_norm_eps=d.get("rms_norm_eps", 1e-6), tie_word_embeddings=d.get("tie_word_embeddings",
                                                                                            mt == "qwen2"),
                       qkv_bias=True if mt == "qwen2" else bias, o_bias=False if mt == "qwen2" else bias,
                       mlp_bias=bool(d.get("mlp_bias", False)), model_type=mt,
                       initializer_range=d.get("initializer_range", 0.02), bos_token_id=_one_id(d.get("bos_token_id")),
                       eos_token_id=_one_id(d.get("eos_token_id")), sliding_window=window)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from None

    def hf_dict(self) -> dict:
        """The HF ``config.json`` fields that describe this model (what transformers builds the same model from)."""
        d = dict(model_type=self.model_type, num_hidden_layers=self.n_layer, num_attention_heads=self.n_head,
                 num_key_value_heads=self.n_kv_head, hidden_size=self.n_embd, intermediate_size=self.intermediate_size,
                 max_position_embeddings=self.n_positions, vocab_size=self.vocab_size, head_dim=self.head_dim,
                 rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps, hidden_act="silu",
                 tie_word_embeddings=self.tie_word_embeddings, initializer_range=self.initializer_range,
                 architectures=[ARCHITECTURES[self.model_type]])
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type == "llama":
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        if self.model_type in ("qwen2", "mistral"):
            d.update(sliding_window=self.sliding_window, use_sliding_window=self.sliding_window is not None)
        for name in ("bos_token_id", "eos_token_id"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def _one_id(value):
    """A token id from config.json (Llama 3 lists several eos ids: the first)."""
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rope_scaling(scaling: dict | None) -> dict | None:
    """None for plain rotary positions; Llama 3's rescaling checked; any other kind refused in one line."""
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a mapping or None, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling of type {kind!r} is not computed here: kvlab computes {', '.join(ROPE_TYPES)}")
    need = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in need if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type llama3 needs {', '.join(missing)}")
    for k in need:
        v = scaling[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"rope_scaling's {k} must be a positive finite number, got {v!r:.60}")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0 or not scaling["factor"] > 0:
        raise ValueError("rope_scaling llama3 needs factor > 0 and high_freq_factor > low_freq_factor > 0")
    return {"rope_type": "llama3", **{k: scaling[k] for k in need}}


PRESETS = {
    # real shapes (random init when no weights are at hand); each is its checkpoint's config.json, read above
    "smollm2-135m": dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, intermediate_size=1536, n_positions=8192,
                         vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0),
    "qwen2.5-0.5b": dict(n_layer=24, n_head=14, n_kv_head=2, n_embd=896, intermediate_size=4864, n_positions=32768,
                         vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         qkv_bias=True, model_type="qwen2", bos_token_id=151643, eos_token_id=151643),
    "llama-3.2-1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                         n_positions=131072, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # experiment=gqa's model: 8 query heads of 64, as many K/V heads (MHA) until model.n_kv_head says fewer
    "gqa-base": dict(n_layer=4, n_head=8, n_kv_head=8, n_embd=512, intermediate_size=1376, n_positions=2048),
    # kvlab's trained Llama-family reference model (harness.train --family llama, model=mini-llama): 4 query heads of
    # 64 channels (the GPT-2 mini's head size) over 2 K/V heads, the GPT-2 vocabulary, trained at 1,024 positions
    "mini-llama": dict(n_layer=6, n_head=4, n_kv_head=2, n_embd=128, head_dim=64, intermediate_size=352,
                       n_positions=1024, bos_token_id=50256, eos_token_id=50256),
    # for tests: tiny, grouped-query (4 query heads over 2 K/V heads), the GPT-2 vocabulary so text prompts work
    "tiny-gqa": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128, n_positions=128),
}


def inverse_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """(head_dim / 2,) float32: the rotation per position of each channel pair, theta^(-2i / head_dim); with Llama
    3's scaling, long wavelengths (beyond original_max_position_embeddings / low_freq_factor) are slowed by
    ``factor``, short ones (below .../ high_freq_factor) kept, and those between blended linearly in
    original_max_position_embeddings / wavelength."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg.rope_scaling
    if not s:
        return inv
    factor, lo, hi, old = (s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                           s["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv
    slowed = torch.where(wavelength > old / lo, inv / factor, inv)
    blend = (old / wavelength - lo) / (hi - lo)
    between = (wavelength >= old / hi) & (wavelength <= old / lo)
    return torch.where(between, (1 - blend) * slowed / factor + blend * slowed, slowed)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd) rotated by its positions' angles: channel i pairs with channel i + hd/2."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Rope:
    """A forward's rotary positions: cos and sin of its queries' angles (``cos``, ``sin``: (T, hd), or (B, 1, T, hd)
    for a ragged batch), and, where keys are rotated inside attention (a cache that stores them before the rotation,
    or the re-positioned window's reference: ``keys_at``), the positions of the keys attention reads and the rule
    that places them."""

    def __init__(self, inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.pos, self.dtype = inv_freq.to(pos.device), pos, dtype
        self.cos, self.sin = self.at(pos)
        if pos.dim() == 2:
            self.cos, self.sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        self.key_pos, self.rule = None, None

    def at(self, positions: torch.Tensor, precise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (..., hd) of any positions' angles, computed in fp32 (as HF does; ``precise``: in fp64, so
        that a rotation by a distance is the same whatever the two absolute positions), in the model's dtype."""
        if precise:
            angles = positions.double().unsqueeze(-1) * self.inv_freq.double()
        else:
            angles = positions.float().unsqueeze(-1) * self.inv_freq  # (..., hd/2)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def keys_at(self, key_pos: torch.Tensor, rule: tuple[int, int] | None) -> None:
        """Keys are rotated inside attention: the absolute position of each key it reads (n_keys,), and None (at
        those positions) or (sinks, window) (at their places in the window: StreamingLLM's)."""
        self.key_pos, self.rule = key_pos, rule


def rotated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Attention over keys handed un-rotated: q (B, nh, T, hd) un-rotated at ``rope.pos``, k, v (B, nkv, n, hd) at
    ``rope.key_pos``; each score rotated by the two positions' distance. Plain (``rope.rule`` None): the absolute
    distance. Re-positioned (sinks S, window W): a key's place in the window it is seen in, sinks first, then the
    window's keys in order, the query last; a window key's distance from its query is the absolute one, a sink's is
    S + W - 1 - j once the window is full (StreamingLLM's positions within the cache). A decode step's positions are
    shifted so that its angles stay within the window's span, and every angle is computed in fp64, so a rotation by
    a distance is the same at any absolute position (the uncached reference's long forward included).
    ``mask`` True = may attend (None: every key up to each query's own position)."""
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    qp, kp = rope.pos, rope.key_pos
    if rope.rule is None:
        base = int(kp.min())  # the oldest key sits at 0
        qr, kr = rotate(q, *rope.at(qp - base, True)), rotate(k, *rope.at(kp - base, True))
        att = qr @ kr.transpose(-2, -1)
    else:
        S, W = rope.rule
        base = max(0, int(qp[0]) - (S + W - 1))
        sink = kp < S  # (n,)
        kr = rotate(k, *rope.at(torch.where(sink, kp, kp - base), True))
        q_window = rotate(q, *rope.at(qp - base, True))
        q_sinks = rotate(q, *rope.at(qp.clamp(max=S + W - 1), True))  # the query's place in the window it sees
        att = torch.where(sink, q_sinks @ kr.transpose(-2, -1), q_window @ kr.transpose(-2, -1))
    att = att * (1.0 / math.sqrt(q.size(-1)))
    if mask is None:
        mask = kp.view(1, -1) <= qp.view(-1, 1)  # (T, n): causal over the keys' positions
    return att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # the mean square in fp32, as HF computes it
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        self.q_proj = Linear(cfg.n_embd, q, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.n_embd, kv, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.n_embd, kv, bias=cfg.qkv_bias)
        self.o_proj = Linear(q, cfg.n_embd, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer: int, mask: torch.Tensor | None,
                rope: Rope) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        if rope.key_pos is not None:  # keys rotated inside attention: stored before the rotation, or re-positioned
            if cache is not None:
                k, v = cache.update(layer, k, v)  # what it holds, un-rotated, in its storage dtype
                k, v = k.to(q.dtype), v.to(q.dtype)
            y = rotated_attention(q, k, v, rope, mask)
        else:
            q, k = rotate(q, rope.cos, rope.sin), rotate(k, rope.cos, rope.sin)  # at their absolute positions
            y = attend(q, k, v, cache, layer, mask)  # (B, nh, T, hd); the cache keeps k rotated, as HF's
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * hd))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.n_embd, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.n_embd, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.n_embd, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                mask: torch.Tensor | None = None, rope=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache, layer, mask, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(Decoder):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            layers=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            norm=RMSNorm(cfg.n_embd, cfg.rms_norm_eps),
        ))
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # fp32 whatever the model's dtype (a plain attribute, not a buffer: .to(dtype) must not round it)
        self.inv_freq = inverse_frequencies(cfg)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(idx)  # positions enter in attention, as rotations of q and k

    def rotary(self, pos: torch.Tensor) -> Rope:
        """This forward's rotary positions (``Rope``): its queries' angles at ``pos``, in the model's dtype."""
        return Rope(self.inv_freq, pos, self.model.embed_tokens.weight.dtype)

    def check_length(self, past: int, T: int) -> None:
        """Rotary positions are computed for any position (as HF's): only a sliding window (Mistral's) bounds what
        is computed exactly here, since attention past it would need the window's own mask."""
        w = self.config.sliding_window
        if w is not None and past + T > w:
            raise ValueError(f"sequence too long: {past} cached + {T} new tokens > sliding_window {w}, the "
                             "attention window this model was trained with (kvlab computes it up to the window)")

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.model.norm

    # ---- checkpoints ------------------------------------------------------------------------------------------

    @property
    def hf_format(self) -> hf.Format:
        return llama_format(self.config)

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike) -> Llama:
        """An HF Llama, Qwen2 or Mistral checkpoint folder (config.json + safetensors, sharded too), every tensor's
        shape checked against config.json before the model is built."""
        folder = hf.resolve(path_or_id)
        cfg = LlamaConfig.from_hf_dict(hf.read_config(folder), source=str(Path(folder) / hf.CONFIG))
        fmt = llama_format(cfg)
        weights_file, state = hf.read_weights(folder, expect=cfg, fmt=fmt)
        model = cls(cfg)
        hf.load_state(model, state, str(weights_file), fmt)
        return model

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
        hf.load_state(self, state, source, self.hf_format)

    def hf_config_dict(self) -> dict:
        return self.config.hf_dict()


def llama_format(cfg: LlamaConfig) -> hf.Format:
    """The checkpoint facts of a Llama-family model: HF's names and layouts are ours; a tied lm_head is not written."""
    return hf.Format(
        model_type=cfg.model_type, name={"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[cfg.model_type],
        ignored=("rotary_emb.inv_freq",),
        tied={"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_word_embeddings else {},
        roots=("model.", "lm_head."), base="model.", layer=r"model\.layers\.(\d+)\.",
        embedding="model.embed_tokens.weight",
        sizes=(("layers", "n_layer"), ("wide", "n_embd"), ("tokens", "vocab_size")))


def config_fields() -> set[str]:
    return {f.name for f in fields(LlamaConfig)}


__all__ = ["Llama", "LlamaConfig", "PRESETS", "inverse_frequencies", "llama_format", "rotate"]

"""The size arithmetic every measurement's memory phases are made of, from plain values (a model's config, the
kind and its options, the dtypes, the run's lengths): nothing is built. A measurement declares the phases it
allocates from a ``Shape`` (``harness.measurements.base.Measurement.memory``); the run layer
(``harness.experiment.memory.run_bytes``) adds the weights and takes the largest.

    s = Shape(preset_config("gpt2"), "prealloc", {}, torch.float32, torch.float32, max_len=1024)
    s.cache_at(8, 512)          # bytes of a cache of the run's kind: 8 sequences, 512 tokens written
    s.forward(8, 512, 1)        # transients of one forward of (8, 512) tokens keeping one position's logits
    cache_bytes(cfg, "paged", {"blocks": 64})   # a kind's bytes for a model (a pooled kind: its whole pool)

The terms (V vocab, d n_embd, nh heads): a forward of (B, T) tokens keeping r positions' logits holds activations
B x T x ``ACT_WIDTH`` d in the compute dtype, attention scores B x nh x T x T in fp32 (what SDPA's math fallback
holds; the fused kernels hold none: the conservative part), masks 3 x B x T x T bools and logits B x r x V; a
decode step adds one layer's K and V in fp32, twice (``layer_kv``: a cast, a dequantised copy, a concatenation).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from harness.core.engines import ENGINES
from models.kv_cache import CACHE_KINDS, KVCache, as_dtype, cache_kind, kv_bytes
from models.kv_cache.base import itemsize

F32, F64, I64 = 4, 8, 8
ACT_WIDTH = 12  # activations of a forward held at once per token, in units of n_embd: the residual, a layer norm,
# q/k/v (3) and their contiguous copies (3), or the MLP's 4x-wide input and its GELU (8), plus the output


def param_count(cfg) -> int:
    """A model's parameters from its config alone (its family's ``num_params``: a tied lm_head once)."""
    return cfg.num_params()


def decode_weight_bytes(cfg, dtype) -> int:
    """What ``harness.core.measure.weight_bytes`` reports for a model of ``cfg`` in ``dtype``: every parameter once, but
    only one row of a learned position embedding (a family whose positions are not rotary has one: GPT-2; a rotary
    family has none). The bandwidth probe sizes its buffers by it."""
    table = 0 if cfg.rotary else (cfg.n_positions - 1) * cfg.n_embd
    return (param_count(cfg) - table) * itemsize(dtype)


def dtype_name(dtype) -> str:
    """fp32 / fp16 / bf16."""
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[str(as_dtype(dtype)).removeprefix("torch.")]


def _storage(engine: str, kind: str, cls: type[KVCache], opts, prefilled: int):
    """What knows the bytes ``engine``'s cache of ``kind`` holds: the kind's class, unless the engine stores the kind
    its own way (``HFEngine.storage``: transformers' QuantizedCache). That method reads only the spec, so it is asked
    without building an engine."""
    own = getattr(ENGINES[engine], "storage", None)
    if own is None:
        return cls
    try:
        return own(None, SimpleNamespace(kind=kind, cls=cls, opts=opts), prefilled)
    except (AttributeError, TypeError):  # it needs a built engine after all: the kind's own formula
        return cls


def full_attention_kind() -> type[KVCache]:
    """The kind the fp32 drift reference runs with (``harness.core.measure.full_attention_kind``)."""
    return next(c for c in CACHE_KINDS.values() if c.full_attention(c.Options()))


def cache_bytes(model, kind: str, options: dict | None = None, storage="fp32",
                max_len: int | None = None, batch: int = 1, n_tokens: int | None = None, engine: str = "kvlab",
                prefilled: int = 0) -> int:
    """Bytes a cache of ``kind`` (with ``options``) for ``model`` holds: ``batch`` sequences, capacity ``max_len``
    (default n_positions), ``n_tokens`` written (default max_len), K/V in ``storage``. The kind's
    ``nbytes_formula``, or the engine's own layout where it stores the kind its own way (``prefilled``: the prompt's
    length, which that layout depends on); a pooled kind counts its whole pool, allocated up front."""
    cls = cache_kind(kind)
    opts = cls.parse_options(**(options or {}))
    max_len = model.n_positions if max_len is None else max_len
    n_tokens = max_len if n_tokens is None else n_tokens
    L, nh, hs = model.n_layer, model.n_kv_head, model.head_dim
    if cls.pooled:
        return _pool_bytes(cls, opts, L, nh, hs, max_len, batch, storage)
    own = _storage(engine, kind, cls, opts, prefilled)
    return own.nbytes_formula(L, nh, hs, max_len, batch, as_dtype(storage), n_tokens, opts)


def _pool_bytes(cls: type[KVCache], opts, n_layer: int, n_head: int, head_dim: int, max_len: int, batch: int,
                dtype) -> int:
    """A pooled kind allocates its whole pool up front: ``blocks`` blocks when the options give a count, else per
    sequence the blocks of max_len plus one (copy-on-write headroom) — the kind's formula at one token past the
    slots max_len holds."""
    blocks = getattr(opts, "blocks", 0)
    if blocks:  # one block of one sequence: the formula for a single token
        return blocks * cls.nbytes_formula(n_layer, n_head, head_dim, max_len, 1, dtype, 1, opts)
    held = cls.held_tokens(max_len, max_len, opts)
    return cls.nbytes_formula(n_layer, n_head, head_dim, held + 1, batch, dtype, held + 1, opts)


@dataclass(frozen=True)
class Shape:
    """A run's sizes, plain values: the model's config (any family), the kind and its options, the K/V (storage) and
    model (compute) dtypes, the engine, the cache's capacity and the run's own lengths; and the pieces every
    measurement's memory phases are made of."""

    model: Any  # the model's config (models.families)
    kind: str
    options: dict
    storage: object
    compute: object
    engine: str = "kvlab"
    max_len: int = 1024
    prompt_len: int = 32
    new_tokens: int = 32
    n_prompts: int = 4
    batch: int = 1
    compile: bool = False
    device: Any = "cpu"  # where the run's tensors live ("cpu", "cuda", or a torch.device)
    prompt_lengths: str = "uniform"  # the served batch's prompts: uniform | ragged

    @property
    def P(self) -> int:
        return param_count(self.model)

    @property
    def spec(self):
        """The run's cache as the measurements build it (``harness.core.measure.CacheSpec``: its class, options)."""
        from harness.core.measure import CacheSpec

        return CacheSpec(self.kind, dict(self.options))

    @property
    def cls(self):
        return self.spec.cls

    @property
    def opts(self):
        return self.spec.opts

    @property
    def reduced(self) -> bool:
        return as_dtype(self.compute) != as_dtype("fp32")

    @property
    def plain_fp32(self) -> bool:
        """The run is its own drift reference: fp32 storage and compute, a kind that is full attention, an engine
        whose fp32 is kvlab's."""
        return (not self.reduced and as_dtype(self.storage) == as_dtype("fp32")
                and self.cls.full_attention(self.opts) and not ENGINES[self.engine].drifts_at_fp32)

    def cache_at(self, B: int, n: int, cap: int | None = None, prefilled: int | None = None) -> int:
        """Bytes of a cache of the run's kind: B sequences, capacity cap, n tokens written."""
        cap = self.max_len if cap is None else cap
        prefilled = self.prompt_len if prefilled is None else prefilled
        return cache_bytes(self.model, self.kind, self.options, self.storage, cap, B, max(0, min(n, cap)),
                           self.engine, min(prefilled, cap))

    def snap(self, B: int, n: int) -> int:
        """A snapshot the kind's checkpoint copies (0 for a kind that crops back)."""
        return self.cache_at(B, n) if self.cls.checkpoint is not KVCache.checkpoint else 0

    def forward(self, B: int, T: int, rows: int, isz: int | None = None) -> int:
        """Transients of one forward of (B, T) tokens keeping ``rows`` positions' logits."""
        m, isz = self.model, itemsize(self.compute) if isz is None else isz
        return (B * T * m.n_embd * ACT_WIDTH * isz + B * m.n_head * T * T * F32 + 3 * B * T * T
                + B * rows * m.vocab_size * isz + 2 * B * T * I64)

    def layer_kv(self, B: int, n: int) -> int:
        return 2 * kv_bytes(1, self.model.n_kv_head, self.model.head_dim, max(n, 1), B, "fp32")

    def ref_cache(self, n: int) -> int:
        """The fp32 full-attention reference's cache holding n tokens."""
        ref = full_attention_kind()
        m = self.model
        return ref.nbytes_formula(m.n_layer, m.n_kv_head, m.head_dim, n, 1, "fp32", n, ref.Options())

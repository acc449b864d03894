"""Ours and HF transformers behind one engine protocol (``Engine``), so both run through the same measurements, and
validation and the measurements ask an engine what it can do instead of branching on its name.

What an engine does (``Engine``):
    forward(ids, **ref) -> (B, T, vocab)     uncached full causal forward (the oracle); ``ref`` is a cache kind's
                                             reference (``window``/``sinks``), {} for full attention
    forward_last(ids, **ref) -> (B, 1, vocab) the same, last position's logits only (one uncached decode step)
    new_cache(kind, max_len, batch, dtype, **options)  an empty cache of a kind of ``models.kv_cache.CACHE_KINDS``
                                             (HF: its counterparts, ``HF_COUNTERPARTS``)
    prefill(ids, cache, last_only=False, pad=None)  logits (B, T, vocab) or (B, 1, vocab); the cache holds T more
                                             slots (``pad``: a left-padded ragged batch's padding, kvlab only)
    decode(token, cache) -> (B, 1, vocab)    exactly one new token per sequence
    checkpoint(cache) -> fn                  fn() puts the cache back to its state now (a timed step is undone)
    rewind(cache, n) / reset(cache)          forget the last n tokens / all of them
    nbytes(cache)                            bytes of K and V storage the cache holds
    greedy(prompt, n, layout, cache_dtype, **options)   greedy generation; layout None = uncached (options: ref)
    storage(spec, prefilled)                 what knows the bytes its cache of ``spec`` holds (``nbytes_formula``,
                                             ``bytes_per_token``, ``held_tokens``): the kind's class, or its own
    keys_read(kind, ctx, max_len)            keys a decode step at context ``ctx`` attends over (None: the kind's)
    rotation(spec)                           which of K and V the engine itself rotates before storing (llama.cpp's
                                             Hadamard: kv, k, v or none); None where it does nothing of its own

What it can do, asked from the class before anything is built (validation, the memory estimate):
    refuses(kind, opts, head_dim=None, rotary=None) / refuses_ragged() / refuses_compile(kind) /
    refuses_storage(storage, compute) / refuses_options(options, storage, config, kind)
                                             why not (one line), or None (head_dim, rotary: the model's, once known;
                                             ``options``: the engine's typed Options; config: the model's, or None;
                                             kind: the run's cache kind, or None)
    build(model, options, storage, compile)  the engine for a run: its options and the run's storage dtype
    stores(kind, opts, options, storage)     what its cache of ``kind`` stores where the kind's own storage does not
                                             say (llama.cpp's K/V types), as (K type, V type) or None, and whether
                                             it is the storage dtype's, so an exact kind stays exact
    drifts_at_fp32                           its kernels are not kvlab's: even an exact fp32 run of it measures
                                             drift against kvlab's fp32
    logit_tol                                the least equivalence tolerance its own kernels need (0: the run's)
    holds_weight_copy                        it keeps its own copy of the weights beside kvlab's model
    runs_references                          its forward takes a kind's reference (``window``/``sinks``, ``keep``),
                                             so it can be a run's fp32 reference; else kvlab's fp32 model is
    Options                                  its typed options (the ``engine`` config node's fields besides name)
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from models.generate import (FusedDecoder, GreedyOutput, StaticDecoder, decode_step, greedy, greedy_loop,
                             greedy_uncached, model_device, model_dtype, new_cache, prefill)
from models.decoder import Decoder
from models.hf_checkpoint import to_hf
from models.kv_cache import CACHE_KINDS, PreallocKVCache, cache_kind
from models.kv_cache.base import itemsize

from harness.core.llamacpp import LlamaCppEngine


def _dynamic_cache(config, max_len: int, opts):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def _static_cache(config, max_len: int, opts):
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=max_len)


def _quantized_cache(config, max_len: int, opts):
    """transformers' QuantizedCache, quanto backend, with our ``quant`` options as its declaration (``HF_COUNTERPARTS``)
    lets them through: one bit width for K and V (``nbits``), K and V grouped per token (axis 0) in groups of our
    ``group_size``, our ``residual`` as its ``residual_length``."""
    from transformers import QuantizedCache

    return QuantizedCache(backend="quanto", config=config, nbits=opts.k_bits, axis_key=0, axis_value=0,
                          q_group_size=opts.group_size, residual_length=opts.residual)


@dataclass(frozen=True)
class Honours:
    """How an HF counterpart takes one option of our kind: the values it runs as our kind means them (``values``),
    or a ``rule(opts, head_dim) -> bool`` they meet (``head_dim`` None before the model is known: the rule lets
    through what it cannot tell yet). ``runs``: what HF does, said in a refusal (``{head_dim}`` is filled in);
    ``fix(opts, head_dim)``: the value to pass instead (default: the first of ``values``)."""

    runs: str
    values: tuple = ()
    rule: Callable[[Any, int | None], bool] | None = None
    fix: Callable[[Any, int | None], Any] | None = None

    def honours(self, opts, name: str, head_dim: int | None) -> bool:
        if self.rule is not None:
            return bool(self.rule(opts, head_dim))
        return getattr(opts, name) in self.values

    def instead(self, opts, head_dim: int | None):
        return self.fix(opts, head_dim) if self.fix is not None else self.values[0]


@dataclass(frozen=True)
class Counterpart:
    """One of our cache kinds as transformers runs it: its class's name, how to build one (from its config, max_len
    and our kind's parsed options), and what it does with every option of our kind (``options``: one ``Honours``
    per option; an option it does not declare is refused, so an option added to the kind is refused on HF until it
    is declared here)."""

    name: str
    build: Callable[[Any, int, Any], Any]
    options: dict[str, Honours] = field(default_factory=dict)


QUANTO_BITS = (4, 2)


def _divisor_below(n: int, most: int) -> int:
    """The largest divisor of ``n`` that is at most ``most`` (at least 1)."""
    return max(d for d in range(1, min(n, max(most, 1)) + 1) if n % d == 0)


QUANTO = {
    "k_bits": Honours("quanto quantises K and V to one width, its nbits: 4 or 2", values=QUANTO_BITS),
    "v_bits": Honours("quanto quantises K and V to one width, its nbits: v_bits must equal k_bits",
                      rule=lambda o, hd: o.v_bits == o.k_bits, fix=lambda o, hd: o.k_bits),
    "group_size": Honours("quanto's q_group_size must divide the head size {head_dim}",
                          rule=lambda o, hd: hd is None or hd % o.group_size == 0,
                          fix=lambda o, hd: _divisor_below(hd, o.group_size)),
    # its residual_length: a full-precision tail flushed into the quantised history every R steps (ours slides);
    # at 1 it flushes every step, as at 0
    "residual": Honours("quanto flushes its full-precision tail every residual_length steps, and at 1 every step "
                        "as at 0", rule=lambda o, hd: o.residual != 1, fix=lambda o, hd: 0),
    "k_axis": Honours("quanto groups K per token, axis_key=0: its per-channel axis fails on a growing cache",
                      values=("token",)),
    "v_axis": Honours("quanto groups V per token, axis_value=0", values=("token",)),
    "rotate": Honours("quanto rotates nothing", values=("none",)),
    "quantize": Honours("QuantizedCache quantises K and V both", values=("kv",)),
    "scheme": Honours("quanto keeps a scale and a zero point per group (MaxOptimizer): asymmetric",
                      values=("asymmetric",)),
    "tail": Honours("quanto groups per token, whose tail is the residual alone: kvlab's tail option changes "
                    "nothing there", values=("group",)),
    "k_pre_rope": Honours("transformers' caches store keys after the rotation", values=(False,)),
}

# our cache kinds that transformers has a counterpart of, each declared once: what runs, and what it honours
HF_COUNTERPARTS: dict[str, Counterpart] = {
    "concat": Counterpart("DynamicCache", _dynamic_cache),
    "prealloc": Counterpart("StaticCache", _static_cache),
    "quant": Counterpart("QuantizedCache", _quantized_cache, QUANTO),
}


def hf_refuses(kind: str, opts, head_dim: int | None = None) -> str | None:
    """Why the HF engine cannot run cache ``kind`` with these (parsed) options, in one line; None if it can. Every
    option of the kind is looked up in its counterpart's declaration: one the declaration does not name is refused
    (fail closed), one whose value HF does not honour is refused with the value to pass. ``head_dim``: the model's
    head size, once known (the rules that need it pass until then)."""
    if kind not in HF_COUNTERPARTS:
        return (f"HF transformers has no counterpart of cache kind {kind!r} here: it runs "
                + ", ".join(f"{k} ({c.name})" for k, c in HF_COUNTERPARTS.items()))
    cp = HF_COUNTERPARTS[kind]
    names = [f.name for f in dataclasses.fields(opts)]
    undeclared = [n for n in names if n not in cp.options]
    if undeclared:
        return (f"HF's {cp.name} has no declared counterpart of cache option {', '.join(undeclared)} (kvlab runs on "
                "HF only what harness/core/engines.py HF_COUNTERPARTS says HF honours): use engine=kvlab")
    wrong, fixed = [], opts
    for name in names:
        how = cp.options[name]
        if not how.honours(fixed, name, head_dim):
            value = how.instead(fixed, head_dim)
            wrong.append(f"{name}={getattr(opts, name)} ({how.runs.format(head_dim=head_dim)})")
            fixed = dataclasses.replace(fixed, **{name: value})
    if not wrong:
        return None
    shown = {True: "true", False: "false"}  # as the command line gives a bool

    def value(v):
        return shown[v] if isinstance(v, bool) else v

    instead = " ".join(f"cache.{n}={value(getattr(fixed, n))}" for n in names
                       if getattr(fixed, n) != getattr(opts, n))
    return f"HF's {cp.name} does not run {'; '.join(wrong)}: pass {instead}, or use engine=kvlab"


def counterpart_options(kind: str, head_dim: int | None = None) -> dict:
    """The options of ``kind`` its HF counterpart runs closest to the kind's defaults: those defaults HF does not
    honour, replaced by what it does ({"k_axis": "token"} for quant; with ``head_dim``, a group size that divides
    it). Passed to both engines, they run one layout."""
    cls = cache_kind(kind)
    opts = cls.Options()
    out = {}
    for name, how in HF_COUNTERPARTS[kind].options.items():
        if not how.honours(opts, name, head_dim):
            out[name] = how.instead(opts, head_dim)
            opts = dataclasses.replace(opts, **{name: out[name]})
    return out


def prepare_quanto() -> None:
    """Build (once per environment) the C++ extension optimum-quanto compiles on its first use on a CPU, so that
    no measurement or test pays for it. ``make setup`` calls this."""
    t0 = time.perf_counter()
    from optimum.quanto.library.extensions import get_extension

    get_extension("quanto_cpp").lib
    print(f"optimum-quanto's CPU extension is ready ({time.perf_counter() - t0:.0f} s)")


def tensor_bytes(t) -> int:
    """Bytes a tensor holds. A quantised tensor subclass (quanto's) counts what it stores (packed values, scales,
    shifts), not its logical shape."""
    if hasattr(t, "__tensor_flatten__"):
        return sum(tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class QuantoStorage:
    """The bytes transformers' QuantizedCache (quanto backend) holds, worked out from its layout rather than read
    from it: every ``residual`` decode steps (every step for 0 or 1) it quantises all tokens so far, the prefill
    included; the tokens since stay in full precision. A quantised tensor is ``rows`` groups of ``group_size``
    values (rows = batch x heads x tokens x head_dim / group_size), packed 8 / bits rows to a byte along the rows,
    plus a scale and a shift per row in the storage dtype. ``prefilled``: the prompt's length."""

    prefilled: int

    def held_tokens(self, max_len: int, n_tokens: int, opts) -> int:
        return n_tokens

    def nbytes_formula(self, n_layer, n_kv_head, head_dim, max_len, batch, dtype, n_tokens, opts) -> int:
        R, G, isz = opts.residual, opts.group_size, itemsize(dtype)
        tail = (n_tokens - self.prefilled) % R if R and n_tokens > self.prefilled else 0
        rows = batch * n_kv_head * (n_tokens - tail) * head_dim // G
        quantised = math.ceil(rows / (8 // opts.k_bits)) * G + rows * 2 * isz
        return n_layer * 2 * (quantised + batch * n_kv_head * tail * head_dim * isz)

    def bytes_per_token(self, n_layer, n_kv_head, head_dim, dtype, opts) -> float:
        per_head = head_dim * opts.k_bits / 8 + head_dim / opts.group_size * 2 * itemsize(dtype)
        return n_layer * 2 * n_kv_head * per_head


@runtime_checkable
class Engine(Protocol):
    """The engine protocol (see the module docstring): what every engine in ``ENGINES`` offers."""

    name: str
    holds_weight_copy: bool
    runs_references: bool
    drifts_at_fp32: bool
    Options: type
    model: Any

    @classmethod
    def refuses(cls, kind: str, opts, head_dim: int | None = None, rotary: bool | None = None) -> str | None: ...

    @classmethod
    def refuses_ragged(cls) -> str | None: ...

    @classmethod
    def refuses_compile(cls, kind: str) -> str | None: ...

    @classmethod
    def refuses_storage(cls, storage: str, compute: str) -> str | None: ...

    @classmethod
    def refuses_options(cls, options, storage: str, config=None, kind: str | None = None) -> str | None: ...

    @classmethod
    def build(cls, model, options, storage: str, compile: bool = False) -> "Engine": ...

    @classmethod
    def stores(cls, kind: str, opts, options, storage: str) -> tuple[tuple[str, str] | None, bool]: ...

    def forward(self, ids: torch.Tensor, **ref) -> torch.Tensor: ...

    def forward_last(self, ids: torch.Tensor, **ref) -> torch.Tensor: ...

    def new_cache(self, kind: str, max_len: int, batch: int = 1, dtype=None, **options) -> Any: ...

    def prefill(self, ids: torch.Tensor, cache, last_only: bool = False, pad=None) -> torch.Tensor: ...

    def decode(self, token: torch.Tensor, cache) -> torch.Tensor: ...

    def checkpoint(self, cache) -> Callable[[], None]: ...

    def rewind(self, cache, n: int = 1) -> None: ...

    def reset(self, cache) -> None: ...

    def nbytes(self, cache) -> int: ...

    def greedy(self, prompt: torch.Tensor, n: int, layout: str | None = None, cache_dtype=None,
               **options) -> GreedyOutput: ...

    def storage(self, spec, prefilled: int = 0) -> Any: ...

    def keys_read(self, kind: str, ctx: int, max_len: int) -> int | None: ...

    def rotation(self, spec) -> str | None: ...


@dataclass(frozen=True)
class KvlabOptions:
    pass


@dataclass(frozen=True)
class HFOptions:
    pass


WARMUP_CALLS = 2  # calls after the compiling one that count as its warm-up (reduce-overhead records CUDA graphs)


class KvlabEngine:
    """Our GPT-2. With ``compile``, decode steps on a prealloc cache run ``models.generate.StaticDecoder`` through
    ``torch.compile`` (fullgraph, static shapes; CUDA graphs via mode reduce-overhead on a GPU). The time of each
    first call per geometry (compilation + the first run) and every recompile are counted in ``compile_stats``,
    apart from anything timed as a step: a step is timed after its warm-up."""

    name = "kvlab"
    holds_weight_copy = False
    runs_references = True
    drifts_at_fp32 = False  # it is the fp32 reference
    logit_tol = 0.0  # its cached and uncached logits are held to the run's equivalence_tol alone

    Options = KvlabOptions

    @classmethod
    def stores(cls, kind: str, opts, options, storage: str) -> tuple[tuple[str, str] | None, bool]:
        return None, True  # the kind's own storage

    @classmethod
    def refuses(cls, kind: str, opts, head_dim: int | None = None, rotary: bool | None = None) -> str | None:
        return None  # every registered kind, every option (the kind's own checks refuse what it cannot do)

    @classmethod
    def refuses_ragged(cls) -> str | None:
        return None

    @classmethod
    def refuses_compile(cls, kind: str) -> str | None:
        if kind != "prealloc" and not cache_kind(kind).fuses_decode:
            fused = [k for k, c in CACHE_KINDS.items() if c.fuses_decode]
            return (f"compile=true compiles the pre-allocated kind's decode step (static shapes) and the decode "
                    f"attention of the kinds that read K/V where they lie ({', '.join(fused)}): use cache=prealloc"
                    f"{''.join(f' or cache={k}' for k in fused)}, not cache={kind}")
        return None

    @classmethod
    def refuses_storage(cls, storage: str, compute: str) -> str | None:
        return None  # any storage dtype beside any compute dtype

    @classmethod
    def refuses_options(cls, options, storage: str, config=None, kind: str | None = None) -> str | None:
        return None

    @classmethod
    def build(cls, model, options, storage: str, compile: bool = False) -> "KvlabEngine":
        return cls(model, compile=compile)

    def storage(self, spec, prefilled: int = 0):
        return spec.cls

    def keys_read(self, kind: str, ctx: int, max_len: int) -> int | None:
        return None  # what the kind's class says

    def rotation(self, spec) -> str | None:
        return None  # a rotation of ours is the kind's own option (cache.rotate)

    def compiles(self, kind: str) -> bool:
        """Whether this engine's decode steps on ``kind`` run compiled (compile=true and a kind it compiles)."""
        return self.compile and self.refuses_compile(kind) is None

    def __init__(self, model: Decoder, compile: bool = False):
        self.model = model.eval()
        self.compile = compile
        self.compile_stats = dict(compile_s=0.0, compile_warmup_s=0.0, compile_graphs=0, compile_recompiles=0,
                                  compiled_steps=0, compile_cudagraph_skips=0)
        self._decoder, self._step, self._seen = None, None, {}
        self._fused_decoder, self._fused_step = None, None

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, **ref) -> torch.Tensor:
        return self.model(ids, **ref)

    @torch.inference_mode()
    def forward_last(self, ids: torch.Tensor, **ref) -> torch.Tensor:
        return self.model(ids, last_only=True, **ref)

    def new_cache(self, kind: str, max_len: int, batch: int = 1, dtype=None, **options):
        return new_cache(self.model, kind, max_len, batch, dtype, **options)

    def prefill(self, ids: torch.Tensor, cache, last_only: bool = False, pad=None) -> torch.Tensor:
        return prefill(self.model, ids, cache, last_only=last_only, pad=pad)[0]

    def decode(self, token: torch.Tensor, cache) -> torch.Tensor:
        if self.compile and isinstance(cache, PreallocKVCache) and cache.pad is None:
            return self._decode_compiled(token, cache)
        if self.compile and cache.attends_opaquely and cache.pad is None and cache.device.type == "cpu":
            return self._decode_fused_compiled(token, cache)
        if self.compile and cache.fuses_decode:
            return self._decode_fused(token, cache)
        return decode_step(self.model, token, cache)[0]

    def _decode_fused(self, token: torch.Tensor, cache) -> torch.Tensor:
        """A decode step whose attention reads K/V where the kind stores them (``attend_decode``, compiled; the
        rest of the step eager). Its first call per cache geometry compiles: timed into compile_s, apart."""
        geometry = (type(cache).__name__, str(cache.opts), cache.batch, cache.max_len, str(cache.device),
                    next(self.model.parameters()).dtype)
        with self._timed_call(geometry, cache.device):
            cache.fused = True
            try:
                logits = decode_step(self.model, token, cache)[0]
            finally:
                cache.fused = False
        return logits

    @torch.inference_mode()
    def _decode_fused_compiled(self, token: torch.Tensor, cache) -> torch.Tensor:
        """A fused kind's decode step compiled whole (``models.generate.FusedDecoder``): the kind's attention one
        opaque op reading K/V where they lie, the rest of the step compiled as prealloc's is. On the CPU, where the
        attention is the C++ kernel (elsewhere the eager rest around ``attend_decode``: ``_decode_fused``)."""
        self._check_step(token, cache)
        if self._fused_step is None:
            self._fused_decoder = FusedDecoder(self.model)
            self._fused_step = torch.compile(self._fused_decoder, mode="default", fullgraph=True, dynamic=False)
        geometry = ("fused", type(cache).__name__, str(cache.opts), cache.batch, cache.max_len, str(cache.device),
                    next(self.model.parameters()).dtype)
        with self._timed_call(geometry, cache.device):
            with self._fused_decoder.using(cache):
                logits = self._fused_step(token.clone(memory_format=torch.contiguous_format),
                                          torch.tensor([cache.pos], device=cache.device))
        cache.advance(1)
        return logits

    def _check_step(self, token: torch.Tensor, cache) -> None:
        if token.dim() != 2 or token.shape != (cache.batch, 1):
            raise ValueError(f"decode takes exactly one token per sequence, shape ({cache.batch}, 1); got "
                             f"{tuple(token.shape)}")
        if cache.pos + 1 > cache.max_len:
            raise ValueError(f"KV cache overflow: pos {cache.pos} + 1 new tokens > max_len {cache.max_len}")
        if cache.pos + 1 > self.model.config.n_positions:
            raise ValueError(f"sequence too long: {cache.pos} cached + 1 new tokens > n_positions "
                             f"{self.model.config.n_positions}")

    @contextmanager
    def _timed_call(self, geometry: tuple, device: torch.device):
        """Around one compiled call: its first per geometry (compilation + the first run) goes to compile_s, apart
        from the steps; a new graph after it is a recompile."""
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt, new = time.perf_counter() - t0, counters["stats"]["unique_graphs"] - graphs
        st, calls = self.compile_stats, self._seen.get(geometry, 0)
        self._seen[geometry] = calls + 1
        if calls == 0:
            st["compile_s"] += dt
            st["compile_graphs"] += new
        else:
            st["compile_recompiles"] += new
            st["compiled_steps"] += 1

    @torch.inference_mode()
    def _decode_compiled(self, token: torch.Tensor, cache: PreallocKVCache) -> torch.Tensor:
        from torch._dynamo.utils import counters

        self._check_step(token, cache)
        if self._decoder is None:
            self._decoder = StaticDecoder(self.model, cache)
            mode = "reduce-overhead" if cache.device.type == "cuda" else "default"
            self._step = torch.compile(self._decoder, mode=mode, fullgraph=True, dynamic=False)
        else:
            self._decoder.use(cache)
        geometry = (tuple(cache.k.shape), cache.k.dtype, str(cache.device))
        graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
        t0 = time.perf_counter()
        idx = token.clone(memory_format=torch.contiguous_format)  # one layout (and an inference tensor) each call
        logits = self._step(idx, torch.tensor([cache.pos], device=cache.device))
        if cache.device.type == "cuda":
            logits = logits.clone()  # a CUDA graph's output is overwritten by its next replay
        new = counters["stats"]["unique_graphs"] - graphs
        st = self.compile_stats
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)
        dt = time.perf_counter() - t0
        calls = self._seen.get(geometry, 0)
        self._seen[geometry] = calls + 1
        if calls == 0:  # the first call for this geometry: compilation, measured on its own
            st["compile_s"] += dt
            st["compile_graphs"] += new
        else:
            if calls <= WARMUP_CALLS:  # CUDA graphs are recorded over the first calls after compiling
                st["compile_warmup_s"] += dt
            st["compile_recompiles"] += new
            st["compiled_steps"] += 1
        st["compile_cudagraph_skips"] += counters["inductor"]["cudagraph_skips"] - skips
        cache.advance(1)
        return logits

    def checkpoint(self, cache):
        return cache.checkpoint()

    def rewind(self, cache, n: int = 1) -> None:
        cache.crop(cache.pos - n)

    def reset(self, cache) -> None:
        cache.reset()

    def nbytes(self, cache) -> int:
        return cache.nbytes

    def greedy(self, prompt: torch.Tensor, n: int, layout: str | None = None, cache_dtype=None,
               **options) -> GreedyOutput:
        return greedy(self.model, prompt, n, layout=layout, cache_dtype=cache_dtype, **options)


class HFEngine:
    """transformers' own model of the same family (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
    ``MistralForCausalLM``) holding the same weights as one of our models. HF caches store K and V in the model's
    dtype: a ``dtype`` that differs is refused rather than silently ignored."""

    name = "hf"
    holds_weight_copy = True  # the HF model holds its own copy of the weights
    runs_references = False  # its forward is full attention alone
    drifts_at_fp32 = False  # its fp32 is ours within the equivalence tolerance (tests/core/test_engines.py)
    logit_tol = 0.0

    Options = HFOptions

    @classmethod
    def stores(cls, kind: str, opts, options, storage: str) -> tuple[tuple[str, str] | None, bool]:
        return None, True  # the kind's counterpart, in the storage dtype

    @classmethod
    def refuses(cls, kind: str, opts, head_dim: int | None = None, rotary: bool | None = None) -> str | None:
        return hf_refuses(kind, opts, head_dim)

    @classmethod
    def refuses_ragged(cls) -> str | None:
        return "runs batches of one prompt length here; use engine=kvlab"

    @classmethod
    def refuses_compile(cls, kind: str) -> str | None:
        return "compile=true compiles kvlab's decode step: use engine=kvlab, not engine=hf"

    @classmethod
    def refuses_options(cls, options, storage: str, config=None, kind: str | None = None) -> str | None:
        return None

    @classmethod
    def build(cls, model, options, storage: str, compile: bool = False) -> "HFEngine":
        return cls(model)

    @classmethod
    def refuses_storage(cls, storage: str, compute: str) -> str | None:
        if storage != compute:
            return (f"HF caches store K/V in the model's dtype: dtype.storage={storage} with compute {compute}; set "
                    f"dtype.compute={storage} (or use engine=kvlab, which stores any dtype)")
        return None

    def __init__(self, model: Decoder):
        import transformers

        d = dict(model.hf_config_dict())
        if d["model_type"] == "gpt2":  # kvlab's GPT-2 generates past <|endoftext|>: HF's stop token at the vocab's end
            d.update(bos_token_id=model.config.vocab_size - 1, eos_token_id=model.config.vocab_size - 1)
        self.config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        hf = transformers.AutoModelForCausalLM.from_config(self.config)  # GPT2LMHeadModel, LlamaForCausalLM, ...
        fmt = model.hf_format
        # the checkpoint format's mapping (views: load_state_dict copies them, no second copy of the model is held)
        state = to_hf(model.state_dict(), fmt=fmt, clone=False)
        missing, unexpected = hf.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in fmt.tied and not fmt.is_ignored(k)]
        untied = [k for k, tie in fmt.tied.items() if hf.get_parameter(k) is not hf.get_parameter(tie)]
        if missing or unexpected or untied:
            raise RuntimeError(f"weights did not map onto HF {fmt.name}: missing {missing}, unexpected {unexpected}, "
                               f"not tied {untied}")
        self.head_dim = model.config.head_dim
        self.model = hf.to(device=model_device(model), dtype=model_dtype(model)).eval()

    @staticmethod
    def _full_attention(ref: dict) -> None:
        if ref:
            raise ValueError(f"HF's model has no uncached reference with {ref}: it runs full attention only")

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, **ref) -> torch.Tensor:
        self._full_attention(ref)
        return self.model(ids, use_cache=False).logits

    @torch.inference_mode()
    def forward_last(self, ids: torch.Tensor, **ref) -> torch.Tensor:
        self._full_attention(ref)
        return self.model(ids, use_cache=False, logits_to_keep=1).logits

    def keys_read(self, kind: str, ctx: int, max_len: int) -> int | None:
        """StaticCache hands attention all ``max_len`` slots every step (the unwritten ones masked)."""
        return max_len if kind == "prealloc" else None

    def rotation(self, spec) -> str | None:
        return None

    def storage(self, spec, prefilled: int = 0):
        """What knows this engine's bytes for ``spec`` (``held_tokens``, ``nbytes_formula``, ``bytes_per_token``):
        our kind's class where transformers' counterpart stores what ours does, else its own layout."""
        return QuantoStorage(prefilled) if spec.kind == "quant" else spec.cls

    def new_cache(self, kind: str, max_len: int, batch: int = 1, dtype=None, **options):
        opts = cache_kind(kind).parse_options(**options)
        why = hf_refuses(kind, opts, self.head_dim)
        if why:
            raise ValueError(why)
        if dtype is not None and dtype != model_dtype(self.model):
            raise ValueError(f"HF caches store K/V in the model dtype {model_dtype(self.model)}, not {dtype}")
        return HF_COUNTERPARTS[kind].build(self.config, max_len, opts)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, cache, last_only: bool = False, pad=None) -> torch.Tensor:
        if pad is not None:
            raise ValueError("the HF engine runs batches of one prompt length here: ragged batches run on kvlab")
        return self._step(ids, cache, 1 if last_only else 0)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor, cache) -> torch.Tensor:
        return self._step(token, cache, 0)

    def _step(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        past = int(cache.get_seq_length())
        pos = torch.arange(past, past + ids.shape[1], device=ids.device).unsqueeze(0)
        return self.model(ids, cache=cache, use_cache=True, position_ids=pos, logits_to_keep=keep).logits

    @staticmethod
    def _croppable(cache) -> bool:
        return all(getattr(layer, "is_croppable", True) for layer in cache.layers)

    def checkpoint(self, cache):
        if not self._croppable(cache):
            # QuantizedCache cannot crop, but its update never writes into a tensor it holds (it re-binds new
            # ones), so keeping each layer's attributes keeps its state
            saved = [dict(vars(layer)) for layer in cache.layers]

            def restore():
                for layer, state in zip(cache.layers, saved):
                    vars(layer).clear()
                    vars(layer).update(state)

            return restore
        pos = int(cache.get_seq_length())

        @torch.inference_mode()
        def back():
            extra = int(cache.get_seq_length()) - pos
            if extra:
                cache.crop(-extra)  # transformers crops by a negative count of tokens to drop

        return back

    @torch.inference_mode()
    def rewind(self, cache, n: int = 1) -> None:
        if not self._croppable(cache):
            raise ValueError(f"HF's {type(cache).__name__} cannot drop tokens (transformers cannot crop it): take "
                             "a checkpoint() before the steps to undo")
        cache.crop(-n)

    @torch.inference_mode()  # its tensors were made in inference mode; zeroing them must be too
    def reset(self, cache) -> None:
        cache.reset()

    def nbytes(self, cache) -> int:
        """Bytes of K and V every layer holds: full-precision tensors and, in a QuantizedCache, the quantised
        ones (packed values, scales and shifts)."""
        total = 0
        for layer in cache.layers:
            for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += tensor_bytes(t)
        return total

    @torch.inference_mode()
    def greedy(self, prompt: torch.Tensor, n: int, layout: str | None = None, cache_dtype=None,
               **options) -> GreedyOutput:
        if layout is None:
            return greedy_uncached(lambda ctx: self.forward_last(ctx, **options), prompt, n)
        cache = self.new_cache(layout, prompt.shape[1] + n, prompt.shape[0], cache_dtype, **options)
        return greedy_loop(lambda: self.prefill(prompt, cache, last_only=True)[:, -1],
                           lambda nxt: self.decode(nxt, cache)[:, -1], n)


# name -> a class of the Engine protocol
ENGINES: dict[str, type] = {"kvlab": KvlabEngine, "hf": HFEngine, "llamacpp": LlamaCppEngine}

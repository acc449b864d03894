"""llama.cpp as a peer engine (``engine=llamacpp``): the run's model converted to GGUF by kvlab (``models.gguf``, f32
for fp32 compute, f16 for fp16, bf16 for a bf16 model: ``LlamaCppEngine(model, storage="bf16")``, the bench's peer)
and run through llama.cpp's own CPU kernels (llama-cpp-python, built from source by ``make llamacpp``), behind the
same engine protocol as ours and HF's, so the same measurements run on it.

Its cache is llama.cpp's: one preallocated K/V buffer per context (``cache=prealloc``; llama.cpp has no growing
layout, so ``concat`` is refused rather than recorded as run), K and V stored as ``engine.type_k`` /
``engine.type_v``: ``auto`` (the run's ``dtype.storage``: f32 or f16; bf16 beside a bf16 model, which a run does not
build: ``refuses_storage``), bf16, or one of llama.cpp's quantised types (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl:
blocks of 32 values with an f16 scale, and an f16 minimum for the _1 types). A quantised V needs llama.cpp's flash
attention, which this engine then turns on (it is off otherwise, as llama.cpp's exact path). Batches run as that
many llama.cpp sequences of one length in one context. What llama.cpp cannot do is refused in one line.

Rotation: llama.cpp (since its pull request 21038) multiplies each head's K, V and query by a Hadamard matrix
before a quantised K or V is stored, by default, wherever the head size is a multiple of 64; the environment
variable ``LLAMA_ATTN_ROT_DISABLE`` turns it off for a context created while it is set. kvlab sets it per context,
so a run is what it says: under ``cache=quant``, ``cache.rotate`` decides (``none``: off; ``hadamard``: llama.cpp's
rotation, which on a GPT-2 model of head size 64 stores K and V code for code as kvlab's ``rotate=hadamard``);
otherwise ``engine.rotate`` does (``auto``: llama.cpp's default, ``none``: off). ``engine_rotation`` in results.json
says which of K and V llama.cpp rotated."""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.decoder import Decoder
from models.generate import GreedyOutput, greedy_loop, greedy_uncached, model_dtype
from models.gguf import gguf_refuses, model_digest, write_gguf
from models.kv_cache import cache_kind

# llama.cpp's K/V types: ggml type id, (values, bytes) per block
CACHE_TYPES: dict[str, tuple[int, int, int]] = {
    "f32": (0, 1, 4), "f16": (1, 1, 2), "bf16": (30, 1, 2), "q8_0": (8, 32, 34), "q4_0": (2, 32, 18),
    "q4_1": (3, 32, 20), "q5_0": (6, 32, 22), "q5_1": (7, 32, 24), "iq4_nl": (20, 32, 18),
}
LAYOUTS = ("prealloc",)  # llama.cpp's one layout: every cell allocated up front
# cache=quant where llama.cpp stores the same thing: blocks of 32 values along a token's channels, a scale per block
# (symmetric: q8_0, q4_0) or a scale and a minimum (asymmetric: q4_1), at the widths cache=quant has (its 2 bits:
# no llama.cpp type; llama.cpp's 5-bit types: engine.type_k / type_v)
QUANT_TYPES = {("symmetric", 8): "q8_0", ("symmetric", 4): "q4_0", ("asymmetric", 4): "q4_1"}


def quant_types(opts) -> tuple[str | None, str | None] | str:
    """cache=quant's options as llama.cpp's (K type, V type), None for the one left in the storage dtype
    (``quantize=k`` or ``v``); or why llama.cpp stores no such thing (one line)."""
    fixed = {"group_size": 32, "residual": 0, "k_axis": "token", "v_axis": "token", "k_pre_rope": False}
    for name, want in fixed.items():
        if getattr(opts, name) != want:
            return (f"llama.cpp's K/V types are blocks of 32 values per token, nothing kept in full precision, "
                    f"keys stored after their rotary rotation: cache.{name}={getattr(opts, name)} (give {want}), or "
                    "use engine=kvlab")
    types = []
    for which in ("k", "v"):
        if opts.quantize not in ("kv", which):
            types.append(None)
            continue
        bits = getattr(opts, f"{which}_bits")
        name = QUANT_TYPES.get((opts.scheme, bits))
        if name is None:
            have = ", ".join(f"{sc} {b} bits" for sc, b in QUANT_TYPES)
            return f"llama.cpp has no {opts.scheme} {bits}-bit K/V type (it has {have}): use engine=kvlab"
        types.append(name)
    return types[0], types[1]


ROTATE_ENV = "LLAMA_ATTN_ROT_DISABLE"  # llama.cpp reads it when a context's K/V cache is made: set, no rotation
ROTATE_BLOCK = 64  # llama.cpp rotates a quantised K or V where the head size is a multiple of this
ROTATIONS = ("auto", "none")  # engine.rotate: llama.cpp's default, or off
MAX_THREADS = 256  # engine.threads' cap, or the machine's cores if more (as harness.train's --threads)
GGML_MAX_THREADS = 512  # ggml.h's GGML_MAX_N_THREADS, the most its CPU threadpool is built for (100,000: a segfault)
GGUF_CACHE_ENV = "KVLAB_GGUF_CACHE"  # where converted models are kept (default: the system's temp folder)
CTX_PAD = 256  # llama.cpp rounds a context's cells up to a multiple of this (per sequence, here)
# the most tokens llama.cpp computes at once (its n_ubatch): a longer batch (a prefill, a batch of prompts) runs in
# micro-batches of this many, each over the cells before it, so its compute buffer is bounded by this, not by the
# whole context (llama.cpp's own default; the logits agree with one micro-batch's, tests/core/test_llamacpp.py)
UBATCH = 512
BUILD = "make llamacpp (builds llama-cpp-python from source with this machine's compiler; docs/testing.md)"
GGML_ERROR, GGML_CONT = 4, 5  # ggml.h's ggml_log_level: an error, and the rest of the message before
_LOG: dict = {"level": 0, "callback": None}


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise RuntimeError(f"engine=llamacpp needs llama-cpp-python: {BUILD}") from e
    if _LOG["callback"] is None:  # llama.cpp's own log: its errors only (a run's log is kvlab's)
        _LOG["callback"] = llama_cpp.llama_log_callback(_log_errors)  # kept: llama.cpp holds only the pointer
        llama_cpp.llama_log_set(_LOG["callback"], ctypes.c_void_p(0))
    return llama_cpp


def _log_errors(level: int, text: bytes, user_data) -> None:
    """llama.cpp's log callback: errors to stderr, nothing else (llama-cpp-python's own reads ggml's levels one
    off, so llama.cpp's warnings would print as errors)."""
    if level != GGML_CONT:
        _LOG["level"] = level
    if _LOG["level"] == GGML_ERROR:
        sys.stderr.write(text.decode("utf-8", "replace"))


def available() -> bool:
    try:
        _llama_cpp()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class LlamaCppOptions:
    type_k: str = "auto"  # llama.cpp's K type: auto (the run's dtype.storage: f32 or f16), q8_0, q4_0, q4_1, q5_0, ...
    type_v: str = "auto"  # its V type, the same choices (a quantised V turns on llama.cpp's flash attention)
    threads: int = 0  # llama.cpp's threads, 1 .. max_threads(); 0: as many as torch uses (kvlab's own count)
    rotate: str = "auto"  # llama.cpp's Hadamard rotation of a quantised K/V: auto (its default), none (off)


def max_threads() -> int:
    """The most threads ``engine.threads`` may ask for here: ``MAX_THREADS``, or the cores if more, at most ggml's."""
    return min(max(MAX_THREADS, os.cpu_count() or 1), GGML_MAX_THREADS)


def cache_type(name: str, storage: str) -> str:
    """A type option resolved against the run's storage dtype (auto: f32 for fp32, f16 for fp16, bf16 for bf16)."""
    return {"fp32": "f32", "fp16": "f16"}.get(storage, storage) if name == "auto" else name


def refuses_types(opts: LlamaCppOptions, storage: str, head_dim: int | None) -> str | None:
    """Why llama.cpp cannot store K/V as asked (one line), or None."""
    for which in ("type_k", "type_v"):
        name = cache_type(getattr(opts, which), storage)
        if name not in CACHE_TYPES:
            return (f"engine.{which}={getattr(opts, which)}: llama.cpp stores K/V as auto (the dtype.storage) or one "
                    f"of {', '.join(CACHE_TYPES)}" + (f" (dtype.storage={storage} has no llama.cpp type)"
                                                      if getattr(opts, which) == "auto" else ""))
        block = CACHE_TYPES[name][1]
        if head_dim is not None and head_dim % block:
            return (f"engine.{which}={name} quantises blocks of {block} values: the head size {head_dim} is not a "
                    "multiple")
    most = max_threads()
    if isinstance(opts.threads, bool) or not isinstance(opts.threads, int) or not 0 <= opts.threads <= most:
        return (f"engine.threads={opts.threads!r}: give 0 (as many as torch uses) or 1 .. {most} (llama.cpp's CPU "
                f"threads; this machine has {os.cpu_count() or 1} cores)")
    if opts.rotate not in ROTATIONS:
        return (f"engine.rotate={opts.rotate!r}: give auto (llama.cpp's Hadamard rotation of a quantised K/V, its "
                "default) or none (off)")
    return None


def quantised(name: str) -> bool:
    """One of llama.cpp's quantised types (blocks of values with a scale), not f32 or f16."""
    return CACHE_TYPES[name][1] > 1


def rotated(type_k: str, type_v: str, head_dim: int, allowed: bool) -> str:
    """Which of K and V llama.cpp rotates before storing (its rule: a quantised type, the head size a multiple of
    ``ROTATE_BLOCK``, not turned off): kv, k, v or none."""
    on = [allowed and quantised(t) and head_dim % ROTATE_BLOCK == 0 for t in (type_k, type_v)]
    return {(True, True): "kv", (True, False): "k", (False, True): "v"}.get(tuple(on), "none")


def refuses_rotation(opts, head_dim: int | None, rotary: bool | None) -> str | None:
    """Why cache=quant's rotate=hadamard is not kvlab's own rotation on llama.cpp (one line), or None: llama.cpp
    rotates blocks of 64 channels in its own channel order, which is kvlab's only on a model without rotary
    positions (a rotary model's GGUF interleaves each head's K channels) and of head size 64."""
    if opts.rotate != "hadamard":
        return None
    if rotary:
        return ("cache.rotate=hadamard: llama.cpp rotates K in its own channel order, which on a rotary model "
                "interleaves each head's channels (models/gguf.py), so it is not kvlab's rotation: use "
                "engine=kvlab, or cache.rotate=none")
    if head_dim is not None and head_dim != ROTATE_BLOCK:
        return (f"cache.rotate=hadamard: llama.cpp's rotation equals kvlab's at head size {ROTATE_BLOCK}, and this "
                f"model's is {head_dim}: use engine=kvlab, or cache.rotate=none")
    return None


@contextmanager
def rotation_set(allowed: bool):
    """``ROTATE_ENV`` as ``allowed`` says while a context is made (llama.cpp reads it then), then as it was."""
    before = os.environ.get(ROTATE_ENV)
    if allowed:
        os.environ.pop(ROTATE_ENV, None)
    else:
        os.environ[ROTATE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ROTATE_ENV, None)
        else:
            os.environ[ROTATE_ENV] = before


def cells(max_len: int) -> int:
    """The K/V cells llama.cpp allocates for a sequence of up to ``max_len`` tokens."""
    return -(-max_len // CTX_PAD) * CTX_PAD


@dataclass(frozen=True)
class LlamaCppStorage:
    """The bytes llama.cpp's K/V buffer holds: every cell of the context (``cells(max_len)`` per sequence, all
    allocated up front), K and V each n_layer x n_kv_head x head_dim values per cell, in blocks of its type."""

    type_k: str
    type_v: str

    def held_tokens(self, max_len: int, n_tokens: int, opts) -> int:
        return cells(max_len)

    def _per_cell(self, n_layer, n_kv_head, head_dim) -> float:
        n = n_layer * n_kv_head * head_dim
        return sum(n / CACHE_TYPES[t][1] * CACHE_TYPES[t][2] for t in (self.type_k, self.type_v))

    def nbytes_formula(self, n_layer, n_kv_head, head_dim, max_len, batch, dtype, n_tokens, opts) -> int:
        return int(batch * cells(max_len) * self._per_cell(n_layer, n_kv_head, head_dim))

    def bytes_per_token(self, n_layer, n_kv_head, head_dim, dtype, opts) -> float:
        return self._per_cell(n_layer, n_kv_head, head_dim)


_CONVERT = threading.Lock()


def gguf_for(model: Decoder) -> Path:
    """The model as a GGUF file (f32, f16 or bf16 as its dtype), converted once per weights and kept by their digest
    in ``$KVLAB_GGUF_CACHE`` (default: a kvlab-gguf folder in the system's temp folder)."""
    dtype = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[model_dtype(model)]
    folder = Path(os.environ.get(GGUF_CACHE_ENV) or Path(tempfile.gettempdir()) / "kvlab-gguf")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"kvlab-{model_digest(model)}-{dtype}.gguf"
    with _CONVERT:
        if not path.is_file():
            write_gguf(model, path, dtype)
    return path


class LlamaCppCache:
    """A llama.cpp context: its K/V buffer of ``max_len`` cells per sequence and how many each holds (``n``)."""

    def __init__(self, engine: "LlamaCppEngine", max_len: int, batch: int, type_k: str | None = None,
                 type_v: str | None = None, rotate: bool = True):
        lc = engine.lc
        self.type_k, self.type_v = type_k or engine.type_k, type_v or engine.type_v
        self.rotated = rotated(self.type_k, self.type_v, engine.head_dim, rotate)  # what llama.cpp does with it
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max = cells(max_len) * batch, batch
        params.n_batch = max(max_len * batch, 1)  # a whole prefill is one llama_decode call
        params.n_ubatch = min(params.n_batch, UBATCH)
        params.n_threads = params.n_threads_batch = engine.threads
        params.type_k, params.type_v = CACHE_TYPES[self.type_k][0], CACHE_TYPES[self.type_v][0]
        params.flash_attn_type = 1 if quantised(self.type_v) else 0  # a quantised V needs it
        params.no_perf = False
        from llama_cpp._internals import LlamaBatch, LlamaContext

        with rotation_set(rotate):
            self.ctx = LlamaContext(model=engine.llm, params=params, verbose=False)
        self.batch = LlamaBatch(n_tokens=max_len * batch, embd=0, n_seq_max=batch, verbose=False)
        self.max_len, self.B, self.n, self.vocab = max_len, batch, 0, engine.vocab
        self.lc = lc

    def run(self, ids: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """Feed ``ids`` (B, T) after what the cache holds; logits (B, T or 1, vocab) in float32."""
        B, T = ids.shape
        if B != self.B:
            raise ValueError(f"this llama.cpp cache holds {self.B} sequences, not {B}")
        if self.n + T > self.max_len:
            raise ValueError(f"the llama.cpp cache holds {self.max_len} tokens per sequence: {self.n} + {T} is more")
        b, rows = self.batch.batch, ids.to("cpu", torch.int64).tolist()
        b.n_tokens = B * T
        for s, row in enumerate(rows):
            for t, tok in enumerate(row):
                i = s * T + t
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, self.n + t, 1
                b.seq_id[i][0] = s
                b.logits[i] = all_logits or t == T - 1
        self.ctx.decode(self.batch)
        self.n += T
        kept = T if all_logits else 1
        out = np.ctypeslib.as_array(self.ctx.get_logits(), shape=(B * kept, self.vocab))
        return torch.from_numpy(out.copy()).view(B, kept, self.vocab)

    def forget_from(self, n: int) -> None:
        for s in range(self.B):
            self.lc.llama_memory_seq_rm(self.ctx.memory, s, n, -1)
        self.n = n

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


class LlamaCppEngine:
    """llama.cpp running the same weights as one of our models (``gguf_for``), through its own CPU kernels."""

    name = "llamacpp"
    holds_weight_copy = True  # llama.cpp holds the converted weights beside kvlab's model
    runs_references = False  # its forward is full attention alone
    drifts_at_fp32 = True  # llama.cpp's kernels, not ours: its fp32 drifts from kvlab's (GPT-2's GELU is a table)
    # its cached steps against its own one-batch forward: llama.cpp computes GELU from an f16 table and picks other
    # matmul kernels for a batch than for one token (1.0e-3 on the mini's 4 prompts x 32 tokens; docs/engine.md)
    logit_tol = 5e-3
    Options = LlamaCppOptions

    @classmethod
    def refuses(cls, kind: str, opts, head_dim: int | None = None, rotary: bool | None = None) -> str | None:
        if kind == "quant":
            types = quant_types(opts)
            return types if isinstance(types, str) else refuses_rotation(opts, head_dim, rotary)
        if kind not in LAYOUTS:
            return (f"llama.cpp has no {kind} cache: its one layout is a K/V buffer allocated up front "
                    "(cache=prealloc), stored as engine.type_k / engine.type_v, or cache=quant in llama.cpp's blocks")
        return None

    @staticmethod
    def stored_types(kind: str, opts, options: LlamaCppOptions, storage: str) -> tuple[str, str]:
        """The (K, V) types a cache of ``kind`` stores: cache=quant's as llama.cpp's (the other one in the
        engine's own type), else the engine's (``auto``: the storage dtype's)."""
        own = cache_type(options.type_k, storage), cache_type(options.type_v, storage)
        if kind != "quant":
            return own
        if (options.type_k, options.type_v) != ("auto", "auto"):
            raise ValueError("give llama.cpp's K/V types once: cache=quant's options or engine.type_k / type_v, "
                             "not both")
        if options.rotate != "auto":
            raise ValueError(f"give llama.cpp's rotation once: under cache=quant it is cache.rotate (none or "
                             f"hadamard), not engine.rotate={options.rotate}")
        types = quant_types(opts)
        if isinstance(types, str):
            raise ValueError(types)
        return types[0] or own[0], types[1] or own[1]

    @classmethod
    def stores(cls, kind: str, opts, options: LlamaCppOptions, storage: str) -> tuple[tuple[str, str] | None, bool]:
        """llama.cpp's K and V types for this cache, and whether both are the storage dtype's (a quantised type,
        or f16 under fp32 storage, makes the run lossy: its label says the types and it is not held exact)."""
        types = cls.stored_types(kind, opts, options, storage)
        return types, all(t == cache_type("auto", storage) for t in types)

    def types_for(self, kind: str, opts) -> tuple[str, str]:
        return self.stored_types(kind, opts, self.options, self.storage_dtype)

    @staticmethod
    def quantises(types: tuple[str, str]) -> bool:
        """Some of the (K, V) types is one of llama.cpp's quantised ones (what its rotation can apply to)."""
        return any(quantised(t) for t in types)

    def rotates(self, kind: str, opts) -> bool:
        """Whether llama.cpp may rotate this cache's quantised K/V: cache=quant's rotate=hadamard, else
        engine.rotate=auto (llama.cpp's default)."""
        return opts.rotate == "hadamard" if kind == "quant" else self.options.rotate == "auto"

    def rotation(self, spec) -> str | None:
        """Which of K and V llama.cpp rotates in a cache of ``spec`` (kv, k, v or none)."""
        return rotated(*self.types_for(spec.kind, spec.opts), self.head_dim, self.rotates(spec.kind, spec.opts))

    @classmethod
    def refuses_ragged(cls) -> str | None:
        return "runs batches of one prompt length here; use engine=kvlab"

    @classmethod
    def refuses_compile(cls, kind: str) -> str | None:
        return "compile=true compiles kvlab's decode step: use engine=kvlab, not engine=llamacpp"

    @classmethod
    def refuses_storage(cls, storage: str, compute: str) -> str | None:
        if compute not in ("fp32", "fp16"):
            return (f"llama.cpp runs the weights converted to f32 or f16: dtype.compute={compute} has no GGUF here; "
                    "use dtype.compute=fp32 or fp16")
        if storage == "bf16":  # bf16 K/V runs beside a bf16 GGUF only (LlamaCppEngine(storage="bf16"), the bench's)
            return (f"dtype.storage=bf16 has no llama.cpp type beside the f32 or f16 weights a run converts "
                    f"(dtype.compute={compute}); llama.cpp's bf16 K/V runs beside a bf16 model in python -m "
                    "harness.bench --peers --dtype bf16: use dtype.storage=fp32 or fp16, or engine.type_k / "
                    "engine.type_v")
        return None

    @classmethod
    def refuses_options(cls, options, storage: str, config=None, kind: str | None = None) -> str | None:
        """The K/V types against the storage dtype and head size, engine.rotate against what it would turn off (for
        a cache of ``kind``, once known), the model's conversion, and llama.cpp itself."""
        why = refuses_types(options, storage, None if config is None else config.head_dim)
        why = why or cls.refuses_rotate(options, storage, config, kind)
        why = why or (gguf_refuses(config) if config is not None else None)
        if why is None and not available():
            why = f"llama-cpp-python is not installed: {BUILD}"
        return why

    @staticmethod
    def refuses_rotate(options, storage: str, config=None, kind: str | None = None) -> str | None:
        """Why engine.rotate=none would turn nothing off (one line), or None: on a layout (cache=quant gives its own
        rotation, ``stored_types``), where neither K nor V type is quantised, or the head size is not a multiple of
        ``ROTATE_BLOCK``, llama.cpp rotates nothing with rotate=auto either."""
        if options.rotate != "none" or kind not in LAYOUTS:
            return None
        types = [cache_type(getattr(options, w), storage) for w in ("type_k", "type_v")]
        if not any(t in CACHE_TYPES and quantised(t) for t in types):
            return (f"engine.rotate=none turns off llama.cpp's rotation of a quantised K/V, and this run stores K "
                    f"{types[0]} V {types[1]} (nothing quantised, nothing rotated either way): leave "
                    "engine.rotate=auto, or give engine.type_k / engine.type_v a quantised type (q8_0, q4_0, ...)")
        if config is not None and rotated(*types, config.head_dim, True) == "none":
            return (f"engine.rotate=none turns off llama.cpp's rotation of a quantised K/V, which it does only where "
                    f"the head size is a multiple of {ROTATE_BLOCK}, and this model's is {config.head_dim} (nothing "
                    "rotated either way): leave engine.rotate=auto")
        return None

    @classmethod
    def build(cls, model, options, storage: str, compile: bool = False) -> "LlamaCppEngine":
        return cls(model, options.type_k, options.type_v, options.threads, storage=storage, rotate=options.rotate)

    def __init__(self, model: Decoder, type_k: str = "auto", type_v: str = "auto", threads: int = 0,
                 storage: str | None = None, rotate: str = "auto"):
        self.lc = _llama_cpp()
        own = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(model_dtype(model), "fp32")
        storage = storage or own
        if (storage == "bf16") != (own == "bf16"):
            raise ValueError(f"engine=llamacpp: bf16 K/V (storage={storage}) runs beside a bf16 model only, and this "
                             f"model is {own}")
        self.options = LlamaCppOptions(type_k, type_v, threads, rotate)
        why = self.refuses_options(self.options, storage, model.config)
        if why:
            raise ValueError(f"engine=llamacpp: {why}")
        self.type_k, self.type_v = cache_type(type_k, storage), cache_type(type_v, storage)
        self.storage_dtype = storage
        self.threads = threads or torch.get_num_threads()
        self.model, self.vocab = model, model.config.vocab_size
        self.head_dim = model.config.head_dim
        self.path = gguf_for(model)
        self._scratch: dict[tuple[int, int], LlamaCppCache] = {}
        from llama_cpp._internals import LlamaModel

        params = self.lc.llama_model_default_params()
        self.llm = LlamaModel(path_model=str(self.path), params=params, verbose=False)
        if self.llm.n_vocab() != self.vocab:
            raise RuntimeError(f"llama.cpp read {self.llm.n_vocab()} vocabulary rows from {self.path}, not "
                               f"{self.vocab}")

    def storage(self, spec, prefilled: int = 0):
        return LlamaCppStorage(*self.types_for(spec.kind, spec.opts))

    def keys_read(self, kind: str, ctx: int, max_len: int) -> int | None:
        return None

    def forward(self, ids: torch.Tensor, **ref) -> torch.Tensor:
        """An uncached forward: the whole of ``ids`` fed in one batch to an emptied context (one kept per shape, so
        a forward times llama.cpp's compute, not its allocations)."""
        return self._uncached(ids, True, ref)

    def forward_last(self, ids: torch.Tensor, **ref) -> torch.Tensor:
        return self._uncached(ids, False, ref)

    def _uncached(self, ids: torch.Tensor, every: bool, ref: dict) -> torch.Tensor:
        if ref:
            raise ValueError(f"llama.cpp has no uncached reference with {ref}: it runs full attention only")
        shape = (cells(ids.shape[1]), ids.shape[0])
        if shape not in self._scratch:
            self._scratch[shape] = LlamaCppCache(self, shape[0], shape[1], rotate=self.options.rotate == "auto")
        cache = self._scratch[shape]
        cache.forget_from(0)
        return cache.run(ids, every).to(ids.device)

    def new_cache(self, kind: str, max_len: int, batch: int = 1, dtype=None, **options):
        opts = cache_kind(kind).parse_options(**options)
        why = self.refuses(kind, opts, self.head_dim, self.model.config.rotary)
        if why:
            raise ValueError(why)
        return LlamaCppCache(self, max_len, batch, *self.types_for(kind, opts), rotate=self.rotates(kind, opts))

    def prefill(self, ids: torch.Tensor, cache: LlamaCppCache, last_only: bool = False, pad=None) -> torch.Tensor:
        if pad is not None:
            raise ValueError("the llama.cpp engine runs batches of one prompt length here: ragged ones run on kvlab")
        return cache.run(ids, not last_only).to(ids.device)

    def decode(self, token: torch.Tensor, cache: LlamaCppCache) -> torch.Tensor:
        if token.shape[1] != 1:
            raise ValueError(f"a decode step feeds one token per sequence, not {token.shape[1]}")
        return cache.run(token, False).to(token.device)

    def checkpoint(self, cache: LlamaCppCache):
        n = cache.n
        return lambda: cache.forget_from(n)

    def rewind(self, cache: LlamaCppCache, n: int = 1) -> None:
        cache.forget_from(max(cache.n - n, 0))

    def reset(self, cache: LlamaCppCache) -> None:
        cache.forget_from(0)

    def nbytes(self, cache: LlamaCppCache) -> int:
        """Bytes of llama.cpp's K/V buffer: its allocated cells (llama.cpp's own count) times the bytes per cell."""
        cells = self.lc.llama_n_ctx(cache.ctx.ctx)
        cfg = self.model.config
        per = LlamaCppStorage(cache.type_k, cache.type_v).bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim,
                                                                          None, None)
        return int(cells * per)

    def greedy(self, prompt: torch.Tensor, n: int, layout: str | None = None, cache_dtype=None,
               **options) -> GreedyOutput:
        if layout is None:
            return greedy_uncached(lambda ctx: self.forward_last(ctx, **options), prompt, n)
        cache = self.new_cache(layout, prompt.shape[1] + n, prompt.shape[0], cache_dtype, **options)
        try:
            return greedy_loop(lambda: self.prefill(prompt, cache, last_only=True)[:, -1],
                               lambda nxt: self.decode(nxt, cache)[:, -1], n)
        finally:
            cache.close()

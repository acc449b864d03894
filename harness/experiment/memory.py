"""Memory before allocation: the bytes a run will need at its peak, from its config alone, against what the machine
(or the device) has free. Pure functions: no printing, no files, nothing built.

    need = run_bytes(preset_config("gpt2"), storage="fp32", compute="fp32", kind="prealloc", options={},
                     max_len=1024, batch=64, batch_sizes=[1, 8, 32], ...)
    check(need, available_bytes(device))      # raises ConfigError in one line when it does not fit
    need.describe()                           # one line for people
    cache_fills(kind="paged", ..., max_len=1024)  # every cache the run builds: (what, sequences, tokens written)

A run holds its weights throughout and goes through its measurements one after another (harness/core/measure.py), each
building its own caches and freeing them before the next: its peak is the weights plus the largest phase. Each
phase counts the caches alive in it (exactly, from the kind's ``nbytes_formula``) and its largest transient
tensors (logits, attention scores, activations, copies), a little conservatively: see ``run_bytes``.

The terms ``run_bytes`` counts (V vocab, d n_embd, nh heads, hs head_dim; "cache(B, n)" is the kind's
``nbytes_formula`` for B sequences, n tokens written, capacity max_len, in the storage dtype; a pooled kind counts
its whole pool):

- weights: ``param_count`` x element size, per copy: the fp32 model (model32); a copy in the compute dtype
  when compute is not fp32; and for engine=hf transformers' own model in the compute dtype (it holds its own
  weights). The phase ``setup`` counts the fp32 copy a reduced-precision copy is made from (a deepcopy of
  model32, then converted), and on a CPU the fp32 HF model before its conversion.
- generation (batch 1, T = prompt_len + new_tokens, n = new_tokens): the generation's cache and the fp32
  reference's; the teacher-forced forward's full logits (T, V) in fp32 and the logit statistics over n steps
  (6 (n, V) fp32 tensors, 5 float64 ones for the KL).
- text_drift (every run but plain fp32 on an exact full-attention kind, on an engine whose fp32 is kvlab's:
  llama.cpp's fp32 run measures it), L = min(max_len, max(drift_text_len, prompt_len + 1)), its texts passed
  B = ``text_rows`` at a time (B x (L - 1) x V fp32 logits within 1 GiB, at most drift_texts, or n_prompts):
  both text passes' caches of B rows, the K/V recorded per layer (fp32), the reference's forward over (B, L - 1),
  both passes' logits (B, L - 1, V) in fp32 and the reference's prefill copied into its own (3 of them), and 7
  float64 tensors of min(STAT_ROWS, L - 1) rows over the vocabulary.
- cache_memory / step_times (batch 1): cache(1, ctx + 1) (twice if the kind's ``checkpoint`` snapshots), the
  uncached forward over the longest timed context.
- bandwidth_probe: its copy buffers 2 x max(min(w, 1 GiB), 256 MiB) and its matrix min(w, 1 GiB), w the decode
  weight bytes.
- batch_throughput: the previous batch's cache (and snapshot) is still held while the next is built and
  prefilled: the worst of cache(B_prev) + cache(B) + prefill and cache(B) + its snapshot + a decode step.
- serve_batch (batch B, prompts of prompt_len, n = new_tokens): the worst of a new cache built while the last
  repeat's is held, the prefill, the decode (with the B x n x V fp32 logits it keeps), and the check (those
  logits stacked: twice, plus a (prompt_len + n, V) reference forward).
- compiled_equivalence (compile=true): two caches of batch 1.
- retrieval (``retrieval_n``: tokens per sequence, None: not measured), L = 2 min(retrieval_n, max_len // 2),
  its sequences passed B = ``text_rows`` at a time (at most ``retrieval_k``): a cache of B x L tokens, its pass's
  logits (B, L - 1, V) in one buffer, and the fp32 reference's forward over (B, L) keeping every position's
  logits.
- a forward of (B, T) tokens keeping r positions' logits: activations B x T x 12d in the compute dtype,
  attention scores B x nh x T x T in fp32 (what SDPA's math fallback holds; the fused kernels torch picks for
  kvlab's shapes, CPU and CUDA, hold none: this is the conservative part), masks 3 x B x T x T bools, logits
  B x r x V. A decode step adds one layer's K and V in fp32, twice
  (a dtype cast, a dequantised copy, a concatenation). On CUDA the logits the served batch keeps live on the
  host and are counted here too (conservative).
- every phase's measurement adds ``SLACK`` (5%) of its cache + measurement: allocators round and fragment.
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness.common.errors import ConfigError
from harness.core.engines import ENGINES
from harness.core.measure import STAT_ROWS, text_rows
from models.kv_cache import CACHE_KINDS, KVCache, as_dtype, cache_kind, kv_bytes
from models.kv_cache.base import itemsize

F32, F64, I64 = 4, 8, 8
ACT_WIDTH = 12  # activations of a forward held at once per token, in units of n_embd: the residual, a layer norm,
# q/k/v (3) and their contiguous copies (3), or the MLP's 4x-wide input and its GELU (8), plus the output
SLACK = 0.05  # added to each phase's cache + transients for the allocators' rounding and fragmentation (a served
# batch on a CPU peaked about 1% above its tensors' bytes)
MARGIN = 0.10  # of what is free, kept free
MIN_MARGIN = 256 << 20  # and at least this much
GB = 1e9


# ---- weights ---------------------------------------------------------------------------------------------------

def param_count(cfg) -> int:
    """A model's parameters from its config alone (its family's ``num_params``: a tied lm_head once)."""
    return cfg.num_params()


def decode_weight_bytes(cfg, dtype) -> int:
    """What ``harness.core.measure.weight_bytes`` reports for a model of ``cfg`` in ``dtype``: every parameter once, but
    only one row of a learned position embedding (GPT-2's; a rotary family has none). The bandwidth probe sizes its
    buffers by it."""
    table = (cfg.n_positions - 1) * cfg.n_embd if cfg.family == "gpt2" else 0
    return (param_count(cfg) - table) * itemsize(dtype)


# ---- the estimate ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunBytes:
    """The bytes a run needs at its peak. ``total`` = ``weights`` + ``cache`` + ``measurement``, where the last two
    are those of ``peak``, the phase that needs the most; ``phases`` gives every phase's (name, cache,
    measurement). ``inputs``: the arguments of ``run_bytes`` that made it (``check`` searches over them)."""

    params: int
    weights: int  # every copy of the weights the run holds, together
    weights_copies: tuple[tuple[str, int], ...]  # (which copy, bytes)
    cache: int  # caches alive at the peak
    measurement: int  # other tensors alive at the peak: logits, attention scores, activations, copies
    total: int
    peak: str  # the phase of the peak
    phases: tuple[tuple[str, int, int], ...] = ()
    inputs: dict = field(default_factory=dict, repr=False, compare=False)

    def describe(self) -> str:
        copies = " + ".join(f"{name} {size(b)}" for name, b in self.weights_copies)
        return (f"about {size(self.total)} at its peak ({self.peak}): weights {size(self.weights)} ({copies}), "
                f"cache {size(self.cache)}, measurement {size(self.measurement)}")


def size(n: int | float) -> str:
    """Bytes for people, decimal units, 3 significant digits: 52.4 GB, 0.302 GB, 12.5 MB, 12.5 kB."""
    if n >= 1e12:
        return f"{n / GB:,.0f} GB"
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n >= 0.1 * scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _name(dtype) -> str:
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


def _full_attention_kind() -> type[KVCache]:
    """The kind the fp32 drift reference runs with (``harness.core.measure.full_attention_kind``)."""
    return next(c for c in CACHE_KINDS.values() if c.full_attention(c.Options()))


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: give a positive integer")
    return value


def run_bytes(model, *, storage="fp32", compute="fp32", kind: str = "prealloc",
              options: dict | None = None, max_len: int | None = None, batch: int = 1,
              batch_sizes: list[int] | None = None, batch_context: int = 512,
              context_lengths: list[int] | None = None, n_prompts: int = 4, new_tokens: int = 32,
              prompt_len: int = 32, drift_text_len: int = 128, engine: str = "kvlab", device: str = "cpu",
              compile: bool = False, keep_fp32: bool | None = None, retrieval_n: int | None = None,
              measurements: list[str] | None = None, serve: dict | None = None, drift_texts: int | None = None,
              retrieval_k: int | None = None) -> RunBytes:
    """The bytes a run of ``model`` needs at its peak on ``device`` ("cpu" or "cuda"), from plain values only.

    ``storage`` / ``compute``: the K/V and model dtypes (names or torch dtypes; compute "auto" resolves as the run
    does: fp32 on a CPU, the storage dtype on CUDA). ``kind`` and ``options``: the cache kind and its options.
    ``max_len``: cache capacity (default n_positions). ``batch``: the served batch (serve_batch); ``batch_sizes``:
    the throughput batches (batch_throughput, None: not measured) at context min(batch_context, max_len - 1);
    ``context_lengths``: the timed contexts (None: assume up to max_len). ``keep_fp32``: whether the fp32 model is
    kept beside a reduced-precision copy (default: yes, as every run does: it is the drift reference).
    ``measurements``: the measurements the run makes (None: all; each measurement's ``memory_phases`` say which phase is whose).

    The terms each phase counts are in the module docstring ("The terms").
    """
    args = dict(storage=storage, compute=compute, kind=kind, options=dict(options or {}), max_len=max_len,
                batch=batch, batch_sizes=None if batch_sizes is None else list(batch_sizes),
                batch_context=batch_context, context_lengths=None if context_lengths is None
                else list(context_lengths), n_prompts=n_prompts, new_tokens=new_tokens, prompt_len=prompt_len,
                drift_text_len=drift_text_len, engine=engine, device=device, compile=compile, keep_fp32=keep_fp32,
                retrieval_n=retrieval_n, measurements=None if measurements is None else list(measurements),
                serve=None if serve is None else dict(serve), drift_texts=drift_texts, retrieval_k=retrieval_k)
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r}: use one of {', '.join(ENGINES)}")
    device = str(device).split(":")[0]
    if compute == "auto":
        compute = "fp32" if device == "cpu" else storage
    s = _Sizes(model, kind, dict(options or {}), as_dtype(storage), as_dtype(compute), engine,
               model.n_positions if max_len is None else _positive("max_len", max_len), prompt_len)
    for name, value in (("batch", batch), ("batch_context", batch_context), ("n_prompts", n_prompts),
                        ("new_tokens", new_tokens), ("prompt_len", prompt_len), ("drift_text_len", drift_text_len)):
        _positive(name, value)
    for b in batch_sizes or []:
        _positive("batch_sizes entry", b)
    weights, copies, setup = _weights(s, engine, device, keep_fp32)
    phases = [("setup", 0, setup), *_generation_phases(s, n_prompts, new_tokens, drift_text_len, drift_texts),
              *_timing_phases(s, new_tokens, context_lengths), *_batch_phases(s, batch_sizes, batch_context),
              _serve_phase(s, batch, new_tokens)]
    if compile:
        Tg = prompt_len + new_tokens
        phases.append(("compiled_equivalence", 2 * s.cache_at(1, Tg),
                       s.forward(1, prompt_len, 1) + s.layer_kv(1, Tg)))
    if retrieval_n:
        phases.append(_retrieval_phase(s, retrieval_n, retrieval_k))
    if serve is not None:
        phases += _server_phase(s, serve)
    if measurements is not None:  # only the phases of the measurements the run makes
        whose = phase_of()
        phases = [p for p in phases if p[0] == "setup" or whose.get(p[0].split("(")[0], set()) & set(measurements)]
    phases = [(name, c, m + math.ceil(SLACK * (c + m))) for name, c, m in phases]
    peak, cache, measurement = max(phases, key=lambda p: p[1] + p[2])
    return RunBytes(params=s.P, weights=weights, weights_copies=tuple(copies), cache=cache, measurement=measurement,
                    total=weights + cache + measurement, peak=peak, phases=tuple(phases),
                    inputs=dict(model=model, **args))


def phase_of() -> dict[str, set[str]]:
    """Each phase of ``run_bytes`` -> the measurements that make it (their ``memory_phases``)."""
    from harness.measurements import MEASUREMENTS

    out: dict[str, set[str]] = {}
    for name, cls in MEASUREMENTS.items():
        for phase in cls.memory_phases:
            out.setdefault(phase, set()).add(name)
    return out


@dataclass(frozen=True)
class _Sizes:
    """The pieces every phase of ``run_bytes`` is made of, for one model, kind, dtype pair and capacity."""

    model: Any  # the model's config, of any family (models.families)
    kind: str
    options: dict
    storage: object
    compute: object
    engine: str
    max_len: int
    prompt_len: int

    @property
    def P(self) -> int:
        return param_count(self.model)

    @property
    def cls(self):
        return cache_kind(self.kind)

    @property
    def reduced(self) -> bool:
        return self.compute != as_dtype("fp32")

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
        ref = _full_attention_kind()
        m = self.model
        return ref.nbytes_formula(m.n_layer, m.n_kv_head, m.head_dim, n, 1, "fp32", n, ref.Options())


def _weights(s: _Sizes, engine: str, device: str, keep_fp32: bool | None) -> tuple[int, list, int]:
    """(bytes of every weight copy a run holds, the copies, what building them needs beyond that)."""
    P, isz_c = s.P, itemsize(s.compute)
    copies = []
    if keep_fp32 is not False or not s.reduced:
        copies.append(("fp32 model", P * F32))
    if s.reduced:
        copies.append((f"{_name(s.compute)} copy", P * isz_c))
    if ENGINES[engine].holds_weight_copy:
        copies.append((f"{engine} {_name(s.compute)} copy", P * isz_c))
    weights = sum(b for _, b in copies)
    # setup: deepcopy(model32) is fp32 until converted; on a CPU an engine with its own copy builds it in fp32
    # beside the others
    deep = 2 * P * F32 if s.reduced else 0
    own = ENGINES[engine].holds_weight_copy and device == "cpu" and s.reduced
    build = 2 * P * F32 + P * isz_c if own else 0
    return weights, copies, max(0, deep - weights, build - weights)


def _generation_phases(s: _Sizes, n_prompts: int, new_tokens: int, drift_text_len: int,
                       drift_texts: int | None = None) -> list:
    """The generation checks (batch 1) and, for a run that is not its own fp32 reference, drift on text (its texts
    passed ``text_rows`` at a time)."""
    V, n, Tg = s.model.vocab_size, new_tokens, s.prompt_len + new_tokens
    phases = [("generation", s.cache_at(1, Tg, cap=Tg) + s.ref_cache(Tg),
               s.forward(1, Tg, Tg, F32) + n * V * (6 * F32 + 5 * F64))]
    plain_fp32 = (not s.reduced and s.storage == as_dtype("fp32")
                  and s.cls.full_attention(s.cls.parse_options(**s.options)) and not ENGINES[s.engine].drifts_at_fp32)
    if not plain_fp32:
        Lt = min(s.max_len, max(drift_text_len, s.prompt_len + 1))
        texts = drift_texts or n_prompts
        B = text_rows(Lt, V, texts)
        R = min(STAT_ROWS, Lt - 1)
        m = s.model
        seen = 2 * kv_bytes(m.n_layer, m.n_kv_head, m.head_dim, Lt, B, "fp32")
        meas = s.forward(B, Lt - 1, 0, F32) + 3 * B * (Lt - 1) * V * F32 + 7 * R * V * F64 + seen + texts * Lt * I64
        phases.append(("text_drift", s.cache_at(B, Lt, cap=Lt) + B * s.ref_cache(Lt), meas))
    return phases


def _retrieval_phase(s: _Sizes, retrieval_n: int, retrieval_k: int | None) -> tuple:
    """Retrieval's sequences of twice retrieval_n tokens, ``text_rows`` at a time (at most retrieval_k)."""
    Lr = 2 * min(_positive("retrieval_n", retrieval_n), s.max_len // 2)
    B = text_rows(Lr, s.model.vocab_size, retrieval_k)
    return ("retrieval", s.cache_at(B, Lr, cap=Lr), s.forward(B, Lr, Lr, F32) + 3 * B * Lr * s.model.vocab_size * F32)


def _timing_phases(s: _Sizes, new_tokens: int, context_lengths: list[int] | None) -> list:
    """cache_memory and step_times (batch 1 at max_len), and the bandwidth probe."""
    Tg = s.prompt_len + new_tokens
    Tc = min(s.max_len, (max(context_lengths) + 1) if context_lengths else s.max_len)
    w = min(decode_weight_bytes(s.model, s.compute), 1 << 30)
    held = s.cls.held_tokens(s.max_len, s.max_len, s.cls.parse_options(**s.options))  # a window: its slots alone
    return [("cache_memory", s.cache_at(1, Tg), s.forward(1, s.prompt_len, 1) + s.layer_kv(1, held)),
            ("step_times", s.cache_at(1, Tc) + s.snap(1, Tc), s.forward(1, Tc, 1) + s.layer_kv(1, Tc)),
            ("bandwidth_probe", 0, 2 * max(w, 256 << 20) + max(1, w // 4 // 1024) * 1024 * F32
             + 3 * 1024 * 1024 * F32)]


def _batch_phases(s: _Sizes, batch_sizes: list[int] | None, batch_context: int) -> list:
    """Throughput vs batch: the previous batch's cache (and snapshot) is still held while the next is built."""
    phases, prev = [], 0
    ctx_b = min(batch_context, s.max_len - 1) if s.max_len > 1 else 1
    for B in batch_sizes or []:
        c = s.cache_at(B, ctx_b + 1, prefilled=ctx_b)
        moments = [(prev + c, s.forward(B, ctx_b, 1) + 2 * B * (ctx_b + 1) * I64),
                   (c + s.snap(B, ctx_b + 1), s.layer_kv(B, ctx_b + 1) + B * s.model.vocab_size * itemsize(s.compute))]
        cache_b, meas_b = max(moments, key=sum)
        phases.append((f"batch_throughput(batch={B})", cache_b, meas_b))
        prev = c + s.snap(B, ctx_b + 1)
    return phases


def _serve_phase(s: _Sizes, B: int, n: int) -> tuple[str, int, int]:
    """The served batch: the worst of a new cache beside the last, the prefill, the decode, the check."""
    V, Ts, pl = s.model.vocab_size, s.prompt_len + n, s.prompt_len
    full, empty = s.cache_at(B, Ts), s.cache_at(B, 0)
    kept = B * n * V * F32
    moments = [(full + empty, 0), (s.cache_at(B, pl), s.forward(B, pl, 1) + 2 * B * pl * I64),
               (full, s.layer_kv(B, Ts) + kept + B * V * itemsize(s.compute)),
               (full, 2 * kept + s.forward(1, Ts, Ts, F32))]
    cache_s, meas_s = max(moments, key=sum)
    return (f"serve_batch(batch={B})", cache_s, meas_s)


def _server_phase(s: _Sizes, serve: dict) -> list:
    """The continuous-batching server: its K/V budget held whole, beside a prefill of the longest request, a step
    of the largest running batch (each layer's K/V of the batch gathered in the compute dtype) and the check of a
    request alone."""
    from harness.measurements.server import budget_bytes, peer_runs, serve_options, serving

    o = serve_options(serve)
    if not serving(o):
        return []
    # the longest request: the drawn workload's, or under a trace (rows checked against max_len) the longest a run
    # can hold
    P = s.max_len if o.trace else o.system_prompt + o.prompt_most + o.max_tokens + 1
    budget, B = budget_bytes(o.kv_budget), o.max_batch
    gathered = 2 * budget * itemsize(s.compute) // (itemsize(s.storage) * max(s.model.n_layer, 1))
    transient = (max(s.forward(1, P, 1), s.forward(B, 1, 1) + gathered)
                 + s.cache_at(1, P, cap=P) + s.layer_kv(1, P))
    held = budget * (2 if peer_runs(o, s.cls) else 1)  # the peer's pool beside kvlab's, each the budget
    return [("serve_continuous", held, transient)]


def cache_fills(*, kind: str, options: dict | None = None, max_len: int, contexts: list[int] | None = None,
                prompt_len: int = 32, new_tokens: int = 32, batch: int = 1, batch_sizes: list[int] | None = None,
                batch_context: int = 512, drift_text_len: int = 128, retrieval_n: int | None = None,
                storage="fp32", compute="auto", compile: bool = False,
                measurements: list[str] | None = None) -> list[tuple[str, int, int]]:
    """Every cache the run's measurements build, from the config alone: (what builds it, sequences, the most tokens
    it has written), for the phases of ``run_bytes`` that the ``measurements`` (None: all) make. Each is a cache of
    its own (a paged one draws its own pool). P = prompt_len, N = new_tokens:

    - generation: each prompt's cached greedy generation, P + N - 1 tokens (the last token is not fed back);
    - text_drift (a run that is not its own fp32 reference): L - 1 tokens, L = min(max_len, max(drift_text_len,
      P + 1)); retrieval: 2n - 1 tokens, n = min(retrieval_n, max_len // 2); one sequence each where the options
      fix a pool of blocks (``CacheSpec.rows_at_once``: several texts share a cache only where it grows with them);
    - cache_memory: P + N - 1; step_times: the longest timed context + 1 (and the prefill of P, for TTFT);
    - batch_throughput: B sequences of min(batch_context, max_len - 1) + 1 per batch size B; serve_batch: ``batch``
      sequences of at most P + N - 1 (a ragged batch's padding takes no slot of a pooled kind);
    - compiled_equivalence (compile=true): P + N.
    """
    cls = cache_kind(kind)
    opts = cls.parse_options(**(options or {}))
    P, N = prompt_len, new_tokens
    plain_fp32 = (_name(storage) == "fp32" and (compute == "auto" or _name(compute) == "fp32")
                  and cls.full_attention(opts))
    fills = [("generation", "the cached generation", 1, P + N - 1)]
    if not plain_fp32:
        L = min(max_len, max(drift_text_len, P + 1))
        fills.append(("text_drift", "text drift", 1, L - 1))
    if retrieval_n:
        fills.append(("retrieval", "retrieval", 1, 2 * min(retrieval_n, max_len // 2) - 1))
    fills.append(("cache_memory", "the cache-bytes check", 1, P + N - 1))
    top = max(contexts) if contexts else max_len - 1
    fills += [("step_times", f"the decode step at context {top}", 1, top + 1),
              ("step_times", "the time to first token", 1, P)]
    ctx = min(batch_context, max_len - 1) if max_len > 1 else 1
    fills += [("batch_throughput", f"the throughput batch of {B} at context {ctx}", B, ctx + 1)
              for B in batch_sizes or []]
    fills.append(("serve_batch", f"the served batch of {batch}", batch, P + N - 1))
    if compile:
        fills.append(("compiled_equivalence", "the compiled step's check", 1, P + N))
    if measurements is not None:
        whose = phase_of()
        fills = [f for f in fills if whose.get(f[0], set()) & set(measurements)]
    return [(what, b, n) for _, what, b, n in fills]


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


# ---- what is free ----------------------------------------------------------------------------------------------

def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _meminfo_available() -> int | None:
    text = _read(Path("/proc/meminfo"))
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _total_ram() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _inactive_file(stat: str | None) -> int:
    """Page cache a cgroup's usage counts that the kernel reclaims before refusing memory."""
    for line in (stat or "").splitlines():
        key, _, value = line.partition(" ")
        if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_dirs(root: Path, rel: str) -> list[Path]:
    """The process's own cgroup under ``root`` and its ancestors (every one's limit applies)."""
    here = root / rel.lstrip("/")
    out = []
    while True:
        out.append(here)
        if here == root or root not in here.parents:
            return out
        here = here.parent


def cgroup_free(base: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> list[int]:
    """Free memory under each cgroup limit that applies to this process: v2 memory.max - memory.current, v1
    memory.limit_in_bytes - memory.usage_in_bytes, the reclaimable page cache (inactive_file) not counted as used;
    unlimited ones give nothing. ``base``: where cgroups are mounted; ``proc``: the process's cgroup file."""
    own = {}
    for line in (_read(proc) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") or [""]:
                own[controller] = parts[2]
    out = []
    v2 = [(base, own.get("", "/")), (base / "unified", own.get("", "/"))]
    for root, rel in v2:
        for d in _cgroup_dirs(root, rel):
            limit, used = _read(d / "memory.max"), _read(d / "memory.current")
            if limit and used and limit.strip().isdigit() and used.strip().isdigit():
                out.append(int(limit) - int(used) + _inactive_file(_read(d / "memory.stat")))
    root = base / "memory"
    for d in _cgroup_dirs(root, own.get("memory", "/")):
        limit, used = _read(d / "memory.limit_in_bytes"), _read(d / "memory.usage_in_bytes")
        if limit and used and limit.strip().isdigit() and used.strip().isdigit() and int(limit) < 1 << 60:
            out.append(int(limit) - int(used) + _inactive_file(_read(d / "memory.stat")))
    return out


def _rlimit_free() -> list[int]:
    """Room under the process's address-space and data limits (``ulimit -v`` / ``-d``) beyond what it maps now."""
    status = _read(Path("/proc/self/status")) or ""
    mapped = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmSize", "VmData") and value.split():
            mapped[key] = int(value.split()[0]) * 1024
    out = []
    for limit, key in ((getattr(resource, "RLIMIT_AS", None), "VmSize"),
                       (getattr(resource, "RLIMIT_DATA", None), "VmData")):
        if limit is None:
            continue
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY and soft > 0:
            out.append(soft - mapped.get(key, 0))
    return out


def available_bytes(device="cpu") -> int:
    """Bytes that ``device`` can give the run now. CPU: the least of MemAvailable (/proc/meminfo; elsewhere the free
    pages), every cgroup memory limit that applies minus its usage (page cache excluded), and the room left under
    ``ulimit -v`` / ``-d``. CUDA: ``torch.cuda.mem_get_info``'s free bytes plus what this process's allocator holds
    unused. Never negative."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return max(0, int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)))
    candidates = [c for c in [_meminfo_available(), *cgroup_free(), *_rlimit_free()] if c is not None]
    if not candidates:
        candidates = [_total_ram() or 0]
    return max(0, int(min(candidates)))


# ---- the verdict -----------------------------------------------------------------------------------------------

def usable(available: int, margin: float = MARGIN, min_margin: int = MIN_MARGIN) -> int:
    """What a run may plan to use out of ``available``: less a margin of ``margin`` of it, at least ``min_margin``."""
    return available - max(int(available * margin), min_margin)


def _largest(fits, lo: int, hi: int) -> int | None:
    """The largest x in [lo, hi] with fits(x), fits being monotone (true up to some x); None if not even lo."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _capped(sizes: list[int], cap: int) -> list[int]:
    out = []
    for b in sizes:
        b = min(b, cap)
        if b not in out:
            out.append(b)
    return out


def has_smaller_model(cfg) -> bool:
    """Whether a preset of ``cfg``'s family (its config class) has fewer parameters: only then can a refusal say
    "use a smaller model" (never for ``tiny`` or ``tiny-gqa``, the smallest)."""
    from models.families import PRESETS, preset_config

    try:
        n = param_count(cfg)
    except (AttributeError, TypeError, ValueError):  # not a family's config: as it said before
        return True
    return any(cls is type(cfg) and param_count(preset_config(name)) < n for name, cls in PRESETS.items())


def what_fits(need: RunBytes, budget: int) -> str:
    """What would fit in ``budget`` bytes, searched over the formula: the largest served batch and throughput batch,
    else the largest max_len, else the largest value of the cache option that sizes it (a paged pool's
    ``cache.blocks``: the kind's ``sized_by``), else a smaller model where its family has one (or dropping the
    weight copies that are optional)."""
    inputs = dict(need.inputs)
    model = inputs.pop("model")
    smaller = ", or use a smaller model" if has_smaller_model(model) else ""

    def total(**change) -> int:
        return run_bytes(model, **{**inputs, **change}).total

    sizes = inputs["batch_sizes"]
    small = dict(batch=1, batch_sizes=[1] if sizes else None)
    if total(**small) <= budget:
        parts = []
        if inputs["batch"] > 1 and total(batch_sizes=small["batch_sizes"]) > budget:
            b = _largest(lambda x: total(batch=x, batch_sizes=small["batch_sizes"]) <= budget, 1, inputs["batch"])
            parts.append(f"batch <= {b}")
        if sizes and total(batch=1) > budget:
            m = _largest(lambda x: total(batch=1, batch_sizes=_capped(sizes, x)) <= budget, 1, max(sizes))
            parts.append(f"batch_sizes=[{','.join(map(str, _capped(sizes, m)))}]")
        if parts:
            return " and ".join(parts) + " would fit" + smaller
    max_len = inputs["max_len"] or model.n_positions
    lo = min(max_len, inputs["prompt_len"] + inputs["new_tokens"])

    def at(m: int, **change) -> int:
        contexts = inputs["context_lengths"]
        contexts = None if contexts is None else ([c for c in contexts if c < m] or None)
        return total(max_len=m, context_lengths=contexts, **change)

    for change, extra in (({}, ""), (small, " with batch=1" + (" and batch_sizes=[1]" if sizes else ""))):
        m = _largest(lambda x: at(x, **change) <= budget, lo, max_len)
        if m is not None and m < max_len:
            return f"max_len <= {m}{extra} would fit{smaller}"
    lower = _kind_option_that_fits(model, inputs, budget)
    if lower:
        return lower
    others = []
    if ENGINES[inputs["engine"]].holds_weight_copy and total(**small, engine="kvlab") <= budget:
        others.append(f"engine=kvlab (the {inputs['engine']} engine holds its own copy of the weights)")
    if total(**small, compute="fp32", storage="fp32") < total(**small) and total(**small, compute="fp32",
                                                                              storage="fp32") <= budget:
        others.append("dtype=fp32 (a reduced-precision run also keeps the fp32 model)")
    if smaller:
        return "use a smaller model" + "".join(f", or {o}" for o in others)
    if others:
        return "use " + ", or ".join(others)
    return ("no smaller batch or max_len of this run fits, and its family has no smaller model: free memory, or run it "
            "where more is free")


def _kind_option_that_fits(model, inputs: dict, budget: int) -> str | None:
    """``cache.<option> <= N would fit``, for the first of the kind's ``sized_by`` options (those whose larger values
    hold more bytes: a paged pool's blocks and block_size, a budget) whose lower values fit ``budget``, among the
    values the kind accepts at the run's max_len and for the caches it builds; None if none does."""
    cls = cache_kind(inputs["kind"])
    options = dict(inputs["options"])
    max_len = inputs["max_len"] or model.n_positions
    fills = cache_fills(kind=inputs["kind"], options=options, max_len=max_len, contexts=inputs["context_lengths"],
                        prompt_len=inputs["prompt_len"], new_tokens=inputs["new_tokens"], batch=inputs["batch"],
                        batch_sizes=inputs["batch_sizes"], batch_context=inputs["batch_context"],
                        drift_text_len=inputs["drift_text_len"], retrieval_n=inputs["retrieval_n"],
                        storage=inputs["storage"], compute=inputs["compute"], compile=inputs["compile"],
                        measurements=inputs["measurements"])
    current = cls.parse_options(**options)
    for name in cls.sized_by:
        now = getattr(current, name)
        if not now:  # 0: not set (a pool sized from max_len, a window given as window=)
            continue

        def valid(x: int) -> bool:
            try:
                opts = cls.parse_options(**{**options, name: x})
                cls.check_max_len(opts, max_len)
                cls.check_fills(opts, fills)
            except ValueError:
                return False
            return True

        def fits(x: int) -> bool:
            try:
                return run_bytes(model, **{**inputs, "options": {**options, name: x}}).total <= budget
            except ValueError:
                return False

        lo, hi = 1, now  # the least value the kind accepts (what it accepts only grows with the option)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if valid(mid) else (mid + 1, hi)
        best = _largest(lambda x: valid(x) and fits(x), lo, now)
        if best is not None and best < now:
            return f"cache.{name} <= {best} would fit"
    return None


def check(need: RunBytes, available: int, margin: float = MARGIN, min_margin: int = MIN_MARGIN,
          where: str = "this machine") -> None:
    """Refuse a run that would not fit: ``ConfigError`` in one line when ``need.total`` exceeds ``available`` less
    the margin (``usable``), naming the sizes and what would fit. ``where`` names what ``available`` is of."""
    budget = usable(available, margin, min_margin)
    if need.total <= budget:
        return
    raise ConfigError(
        f"the run needs about {size(need.total)} (weights {size(need.weights)}, cache {size(need.cache)}, "
        f"measurement {size(need.measurement)}, at its peak in {need.peak}) but {where} has {size(available)} free "
        f"({size(max(budget, 0))} after a {size(available - budget)} margin): {what_fits(need, budget)}")

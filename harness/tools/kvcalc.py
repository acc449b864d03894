"""KV-cache size calculator: exact bytes of K and V for our presets or any HF ``config.json``, GQA/MQA and
sliding-window aware, in plain or quantised (our ``quant`` kind) storage.

    python -m harness.kvcalc gpt2
    python -m harness.kvcalc path/to/config.json --tokens 8192 --dtype fp16 --memory 80GB
    python -m harness.kvcalc gpt2 --kv-bits 4,4 --group-size 32 --json
    python -m harness.kvcalc gpt2 --kv-bits 8,4 --scheme symmetric      # llama.cpp's q8_0 / q4_0: a scale only
    python -m harness.kvcalc mini --evict snapkv --budget 64 --allocation pyramid   # an evicting kind's slots

    from harness.tools.kvcalc import kv_geometry, kv_cache_bytes, bytes_per_token, sequences_that_fit
    g = kv_geometry("gpt2")                       # or a path to a config.json (or a folder holding one)
    kv_cache_bytes(g, tokens=1024, batch=1, dtype="fp32")   # -> 75,497,472

What a config.json is read for (plain ``json``; transformers is not needed):

- layers: ``num_hidden_layers`` / ``n_layer`` / ``num_layers``; attention heads: ``num_attention_heads`` /
  ``n_head``; width: ``hidden_size`` / ``n_embd`` / ``d_model``. A multimodal config without these at the top
  level is read from its ``text_config``.
- KV heads: ``num_key_value_heads`` (GQA) when given; else Falcon's rule: ``multi_query: true`` without
  ``new_decoder_architecture`` means 1 (MQA; also GPT-BigCode/StarCoder), otherwise ``num_kv_heads`` /
  ``n_head_kv`` when given; else as many as attention heads (MHA).
- ``head_dim`` when given (Gemma's 256 is not hidden / heads), else hidden / heads, which must divide.
- max positions (the default ``--tokens``): ``max_position_embeddings`` / ``n_positions`` / ``n_ctx`` /
  ``max_sequence_length`` / ``seq_length``.
- sliding windows. A windowed layer holds min(tokens, window) tokens (the window includes the newest token, as in
  HF's masks and our ``window`` kind without sinks). Which layers are windowed, first rule that applies:
    1. ``layer_types`` (HF's newer style, Gemma-2/3, Qwen2/3, ...): "sliding_attention" layers hold the
       ``sliding_window``, "full_attention" layers everything; other layer types are refused.
    2. ``use_sliding_window`` present (Qwen2 style): false means no window at all (Qwen2 configs carry a
       ``sliding_window`` they do not use); true means layers with index >= ``max_window_layers`` are windowed and
       the bottom ``max_window_layers`` layers use full attention. This is HF's Qwen2 rule (its attention windows a
       layer when ``layer_idx >= config.max_window_layers``; Qwen2Config's docstring: "the first max_window_layers
       layers use full attention"), despite the name suggesting the opposite.
    3. ``sliding_window_pattern`` P (Gemma-3, Cohere2): layer i is full when (i + 1) % P == 0, else windowed.
       ``model_type`` "gemma2" without ``layer_types``: alternating, layer 0 windowed (HF's Gemma2 default).
    4. ``sliding_window`` alone (Mistral-7B-v0.1, Phi-3 style): every layer windowed.
  A null / absent ``sliding_window`` means no window.

Quantised storage (``kv_bits``): counted by our ``quant`` kind itself (``QuantKVCache``): the bytes at N tokens are
its exact ``nbytes_formula`` for a cache of N slots (packed values, an fp16 scale + minimum per group, or with
``scheme="symmetric"`` an fp16 scale alone; K per channel in groups of G tokens, V per token in groups of G channels,
and the newest 1..G tokens of K still in the storage dtype); bytes per token is its steady-state ``bytes_per_token``
(amortised, no tail). Windowed layers are counted as a quant cache of min(tokens, window) slots.

Bounds, checked before any arithmetic and before any per-layer list is built (generous: the largest published models
have a few hundred layers, 128 heads, head_dim 256 and 10M positions): layers, heads, KV heads, sliding-window pattern
and ``max_window_layers`` 1 .. 10,000; head_dim 1 .. 65,536; width 1 .. 1,048,576; tokens, positions and windows
up to 10^12; batch 1 .. 10^9; group size 1 .. 10^6; ``--memory`` up to 10^18 bytes (1 EB). A config.json is read
when it is a UTF-8 JSON object of at most 16 MiB nested at most 64 levels deep (HF's nest 2 or 3). Anything else is
one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from decimal import Decimal, InvalidOperation
from pathlib import Path

from harness.common.signals import reader_gone

ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float8": "fp8"}
QUANT_TAIL_DTYPES = ("fp32", "fp16", "bf16")  # the quant kind keeps its not-yet-quantised tokens in one of these
UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
HEAD_KEYS = ("num_attention_heads", "n_head")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")

# what kvcalc computes (see the module docstring): every number is checked against these before it is used
MAX_LAYERS = 10_000
MAX_HEADS = 10_000
MAX_HEAD_DIM = 65_536
MAX_HIDDEN = 2 ** 20
MAX_TOKENS = 10 ** 12  # tokens, max positions and sliding windows
MAX_BATCH = 10 ** 9
MAX_GROUP_SIZE = 10 ** 6
MAX_MEMORY = 10 ** 18  # bytes: 1 EB
MAX_CONFIG_BYTES = 16 * 2 ** 20
MAX_JSON_DEPTH = 64


class KVCalcError(ValueError):
    """Bad input: the message says what was wrong and what would be right (the CLI prints it, exit code 2)."""


# ---- geometry ---------------------------------------------------------------------------------------------------


def _first(d: dict, keys: tuple[str, ...]):
    for k in keys:
        if d.get(k) is not None:
            return k, d[k]
    return None, None


def _show(value) -> str:
    """A value for a one-line message: integers with separators (or in e-notation when huge), anything else as a
    short repr."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > 1000:
            return f"an integer of {value.bit_length():,} bits"
        return f"{value:,}" if abs(value) < 10 ** 15 else f"{float(value):g}"
    if isinstance(value, float):
        return f"{value:g}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(source: str, key: str, value, minimum: int = 1, maximum: int = MAX_LAYERS) -> int:
    """``value`` when it is an integer in minimum .. maximum; else a KVCalcError that names the key and the range."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > maximum:  # 1e30, 2e9, inf
        raise KVCalcError(f"{key}={_show(value)} in {source} is beyond what kvcalc computes: give "
                          f"{minimum:,} .. {maximum:,}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise KVCalcError(f"{source}: {key} must be {want} (at most {maximum:,}), got {_show(value)}")
    return value


def _preset_geometry(name: str) -> dict:
    from models.families import preset_config

    cfg = preset_config(name)  # any family's preset: its K/V heads are what its cache stores
    return {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head, "head_dim": cfg.head_dim,
            "windows": [None] * cfg.n_layer, "max_positions": cfg.n_positions, "source": f"preset {name}",
            "window_rule": "none"}


def _windows(d: dict, n_layer: int, source: str) -> tuple[list[int | None], str]:
    """Each layer's window (None: full attention) and the rule that decided it."""
    window = d.get("sliding_window")
    if window is not None and window is not False:
        window = _int(source, "sliding_window", window, maximum=MAX_TOKENS)
    else:
        window = None

    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layer:
            raise KVCalcError(f"{source}: layer_types must be a list of {n_layer} entries (one per layer), got "
                              f"{_show(types)}")
        out = []
        for i, t in enumerate(types):
            if t == "full_attention":
                out.append(None)
            elif t == "sliding_attention":
                if window is None:
                    raise KVCalcError(f"{source}: layer {i} is 'sliding_attention' but sliding_window is not set; "
                                      "give sliding_window (tokens)")
                out.append(window)
            else:
                raise KVCalcError(f"{source}: layer_types[{i}] is {_show(t)}; kvcalc counts only 'full_attention' and "
                                  "'sliding_attention' layers")
        return out, "layer_types"
    if "use_sliding_window" in d:
        if not d["use_sliding_window"] or window is None:
            return [None] * n_layer, "use_sliding_window false (Qwen2 style): no window"
        mwl = d.get("max_window_layers")
        mwl = 0 if mwl is None else _int(source, "max_window_layers", mwl, minimum=0, maximum=MAX_LAYERS)
        return ([None if i < mwl else window for i in range(n_layer)],
                f"Qwen2 style: layers < max_window_layers={mwl} full, the rest windowed")
    if window is None:
        return [None] * n_layer, "none"
    pattern = d.get("sliding_window_pattern")
    if pattern is None and d.get("model_type") == "gemma2":
        pattern = 2
    if pattern is not None:
        pattern = _int(source, "sliding_window_pattern", pattern, maximum=MAX_LAYERS)
        return ([None if (i + 1) % pattern == 0 else window for i in range(n_layer)],
                f"every {pattern}th layer full (sliding_window_pattern), the rest windowed")
    return [window] * n_layer, "sliding_window on every layer (Mistral style)"


def _json_depth(obj) -> int:
    """How deep a parsed JSON value's arrays and objects nest (a scalar: 0), walked without recursion."""
    depth, stack = 0, [(obj, 1)]
    while stack:
        v, level = stack.pop()
        if isinstance(v, (dict, list)):
            depth = max(depth, level)
            stack.extend((c, level + 1) for c in (v.values() if isinstance(v, dict) else v))
    return depth


def _read_config(path: Path) -> dict:
    """The JSON value in ``path``: a UTF-8 file of at most MAX_CONFIG_BYTES (so reading it cannot exhaust memory)
    nested at most MAX_JSON_DEPTH levels (deeper than Python's recursion limit is caught while parsing)."""
    source = str(path)
    try:
        chunks, n = [], 0
        with open(path, "rb") as f:  # in pieces: never more than the bound, whatever the file's size says
            while n <= MAX_CONFIG_BYTES and (chunk := f.read(2 ** 16)):
                chunks.append(chunk)
                n += len(chunk)
        raw = b"".join(chunks)
        if len(raw) > MAX_CONFIG_BYTES:
            raise KVCalcError(f"{source}: more than {MAX_CONFIG_BYTES:,} bytes, larger than kvcalc reads; an HF "
                              "config.json is a few kB")
        text = raw.decode("utf-8")
    except OSError as e:
        raise KVCalcError(f"{source}: cannot read it ({e.__class__.__name__}: {e.strerror or e}); pass a readable HF "
                          "config.json") from None
    except UnicodeDecodeError as e:
        raise KVCalcError(f"{source}: not UTF-8 text (byte {e.start:,}: {e.reason}); pass an HF config.json") from None
    if not text.strip():
        raise KVCalcError(f"{source}: is empty; pass an HF config.json")
    too_deep = (f"{source}: JSON nested {{}} levels deep is beyond what kvcalc reads: give at most {MAX_JSON_DEPTH} "
                "(an HF config.json nests 2 or 3)")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise KVCalcError(f"{source}: not JSON ({e.msg} at line {e.lineno}); pass an HF config.json") from None
    except RecursionError:  # deeper than Python's recursion limit: the parser stops there, before using memory
        raise KVCalcError(too_deep.format(f"more than {MAX_JSON_DEPTH}")) from None
    except ValueError as e:  # e.g. an integer literal of more than 4,300 digits
        raise KVCalcError(f"{source}: cannot read its JSON ({_show(str(e))}); pass an HF config.json") from None
    depth = _json_depth(d)
    if depth > MAX_JSON_DEPTH:
        raise KVCalcError(too_deep.format(f"{depth:,}"))
    return d


def _config_geometry(path: Path) -> dict:
    source = str(path)
    d = _read_config(path)
    if not isinstance(d, dict):
        raise KVCalcError(f"{source}: holds a JSON {type(d).__name__}, not an object; pass an HF config.json")
    if _first(d, LAYER_KEYS)[0] is None and isinstance(d.get("text_config"), dict):
        d = d["text_config"]  # a multimodal wrapper: the language model's settings
        source += " (text_config)"

    lk, n_layer = _first(d, LAYER_KEYS)
    hk, n_head = _first(d, HEAD_KEYS)
    missing = [what for what, k in (("layer count (num_hidden_layers / n_layer)", lk),
                                    ("attention head count (num_attention_heads / n_head)", hk)) if k is None]
    if missing:
        raise KVCalcError(f"{source}: no {' and no '.join(missing)}; an HF config.json for a decoder gives both")
    n_layer, n_head = _int(source, lk, n_layer, maximum=MAX_LAYERS), _int(source, hk, n_head, maximum=MAX_HEADS)

    if d.get("num_key_value_heads") is not None:
        n_kv = _int(source, "num_key_value_heads", d["num_key_value_heads"], maximum=MAX_HEADS)
    elif d.get("multi_query") and not d.get("new_decoder_architecture"):
        n_kv = 1
    else:
        kk, n_kv = _first(d, ("num_kv_heads", "n_head_kv"))
        n_kv = n_head if kk is None else _int(source, kk, n_kv, maximum=MAX_HEADS)
    if n_kv > n_head or n_head % n_kv:
        raise KVCalcError(f"{source}: {n_kv} KV heads do not divide {n_head} attention heads; GQA needs "
                          "num_attention_heads to be a multiple of num_key_value_heads")

    if d.get("head_dim") is not None:
        head_dim = _int(source, "head_dim", d["head_dim"], maximum=MAX_HEAD_DIM)
    else:
        wk, hidden = _first(d, HIDDEN_KEYS)
        if wk is None:
            raise KVCalcError(f"{source}: no head_dim and no hidden_size / n_embd / d_model to derive it from")
        hidden = _int(source, wk, hidden, maximum=MAX_HIDDEN)
        if hidden % n_head:
            raise KVCalcError(f"{source}: {wk} {hidden} is not divisible by {hk} {n_head}; fix the counts or give "
                              "head_dim explicitly")
        head_dim = _int(source, f"head_dim ({wk} / {hk})", hidden // n_head, maximum=MAX_HEAD_DIM)

    pk, max_pos = _first(d, POSITION_KEYS)
    max_pos = None if pk is None else _int(source, pk, max_pos, maximum=MAX_TOKENS)
    windows, rule = _windows(d, n_layer, source)
    return {"n_layer": n_layer, "n_head": n_head, "n_kv_head": n_kv, "head_dim": head_dim, "windows": windows,
            "max_positions": max_pos, "source": source, "window_rule": rule}


def kv_geometry(name_or_path: str | Path) -> dict:
    """What the KV cache's size depends on, for a preset name of any family (``models.families.PRESETS``) or an HF
    config.json (or a folder holding one): n_layer, n_head, n_kv_head, head_dim, windows (one per layer: tokens, or
    None for full attention), window_rule, max_positions (None if the config gives none) and source."""
    from models.families import PRESETS

    name = str(name_or_path)
    if name in PRESETS:
        return _preset_geometry(name)
    path = Path(name)
    try:
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise KVCalcError(f"{_show(name)}: a folder without a config.json; pass a preset name, an HF "
                                  "config.json or a folder holding one")
            path = path / "config.json"
        if path.exists() and not path.is_file():
            raise KVCalcError(f"{_show(name)}: not a regular file; pass a preset name or a path to an HF config.json")
        found = path.is_file()
    except KVCalcError:
        raise
    except (OSError, ValueError) as e:  # a name too long for the filesystem, a NUL byte, ...
        raise KVCalcError(f"unknown model {_show(name)}: not a preset ({', '.join(PRESETS)}) and not a path this "
                          f"system can open ({getattr(e, 'strerror', None) or e}); pass a preset name or a path to "
                          "an HF config.json") from None
    if not found:
        raise KVCalcError(f"unknown model {_show(name)}: not a preset ({', '.join(PRESETS)}) and no such file; pass a "
                          "preset name or a path to an HF config.json")
    return _config_geometry(path)


# ---- arithmetic -------------------------------------------------------------------------------------------------


def _geom(geom: dict | str | Path) -> dict:
    return geom if isinstance(geom, dict) else kv_geometry(geom)


def _dtype(dtype: str) -> str:
    d = str(dtype).lower()
    d = DTYPE_ALIASES.get(d, d)
    if d not in ITEMSIZE:
        raise KVCalcError(f"unknown dtype {dtype!r}: use one of {', '.join(ITEMSIZE)}")
    return d


def _quant_opts(kv_bits, group_size: int, dtype: str, scheme: str = "asymmetric"):
    from models.kv_cache.quant import QuantOptions

    if isinstance(kv_bits, int):
        kv_bits = (kv_bits, kv_bits)
    try:
        k_bits, v_bits = kv_bits
    except (TypeError, ValueError):
        raise KVCalcError(f"kv_bits must be a pair (K bits, V bits), got {kv_bits!r}") from None
    if isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > MAX_GROUP_SIZE:
        raise KVCalcError(f"group_size={_show(group_size)} is beyond what kvcalc computes: give 1 .. "
                          f"{MAX_GROUP_SIZE:,}")
    if dtype not in QUANT_TAIL_DTYPES:
        raise KVCalcError(f"dtype {dtype} with kv_bits: the quant kind keeps its newest tokens in the storage dtype, "
                          f"one of {', '.join(QUANT_TAIL_DTYPES)}")
    try:
        return QuantOptions(k_bits=k_bits, v_bits=v_bits, group_size=group_size, scheme=scheme)
    except ValueError as e:
        raise KVCalcError(str(e)) from None


def _held_groups(geom: dict, tokens: int) -> list[tuple[int, int]]:
    """(tokens held, layers holding that many), most tokens first."""
    held = Counter(tokens if w is None else min(tokens, w) for w in geom["windows"])
    return sorted(held.items(), reverse=True)


def _check_counts(tokens: int, batch: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise KVCalcError(f"tokens must be an integer >= 0 (at most {MAX_TOKENS:,}), got {_show(tokens)}")
    if tokens > MAX_TOKENS:
        raise KVCalcError(f"tokens={_show(tokens)} is beyond what kvcalc computes: give 0 .. {MAX_TOKENS:,}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise KVCalcError(f"batch must be a positive integer (at most {MAX_BATCH:,}), got {_show(batch)}")
    if batch > MAX_BATCH:
        raise KVCalcError(f"batch={_show(batch)} is beyond what kvcalc computes: give 1 .. {MAX_BATCH:,}")


def bytes_per_token(geom: dict | str, dtype: str = "fp32", kv_bits=None, group_size: int = 32,
                    scheme: str = "asymmetric") -> int | float:
    """Bytes one token costs across all layers, K and V, batch 1, while every layer still holds it (windows not yet
    full). Plain: 2 x layers x kv heads x head_dim x itemsize. Quantised: ``QuantKVCache.bytes_per_token`` (steady
    state: packed values + amortised fp16 scale and minimum, or scale alone (``scheme="symmetric"``); a float when G
    does not divide 4 x head_dim)."""
    g, dtype = _geom(geom), _dtype(dtype)
    if kv_bits is None:
        return 2 * g["n_layer"] * g["n_kv_head"] * g["head_dim"] * ITEMSIZE[dtype]
    from models.kv_cache.quant import QuantKVCache

    b = QuantKVCache.bytes_per_token(g["n_layer"], g["n_kv_head"], g["head_dim"], dtype,
                                     _quant_opts(kv_bits, group_size, dtype, scheme))
    return int(b) if float(b).is_integer() else b


def kv_cache_bytes(geom: dict | str, tokens: int, batch: int = 1, dtype: str = "fp32", kv_bits=None,
                   group_size: int = 32, scheme: str = "asymmetric") -> int:
    """Exact bytes of K and V for ``tokens`` positions of ``batch`` sequences; a windowed layer holds
    min(tokens, window). Quantised (``kv_bits=(K, V)``, ``scheme`` asymmetric or symmetric): our quant kind's own
    ``nbytes_formula`` per layer group."""
    g, dtype = _geom(geom), _dtype(dtype)
    _check_counts(tokens, batch)
    groups = _held_groups(g, tokens)
    if kv_bits is None:
        per = 2 * g["n_kv_head"] * g["head_dim"] * ITEMSIZE[dtype]
        return sum(per * layers * held for held, layers in groups) * batch
    from models.kv_cache.quant import QuantKVCache

    opts = _quant_opts(kv_bits, group_size, dtype, scheme)
    return sum(QuantKVCache.nbytes_formula(layers, g["n_kv_head"], g["head_dim"], held, batch, dtype, held, opts)
               for held, layers in groups)


def sequences_that_fit(geom: dict | str, tokens: int, memory_bytes: int, dtype: str = "fp32", kv_bits=None,
                       group_size: int = 32, scheme: str = "asymmetric") -> int:
    """How many sequences of ``tokens`` positions have their KV cache fit in ``memory_bytes`` (floor)."""
    per_seq = kv_cache_bytes(geom, tokens, 1, dtype, kv_bits, group_size, scheme)
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise KVCalcError(f"memory must be a number of bytes >= 0, got {memory_bytes!r}")
    if per_seq == 0:
        raise KVCalcError("a sequence of 0 tokens holds no KV cache, so any number fits; pass tokens >= 1")
    return memory_bytes // per_seq


def evicting_slots(geom: dict | str, kind: str, tokens: int, **options) -> tuple[list[int], object]:
    """An evicting kind's slots per K/V head, per layer (bottom first), for a sequence of ``tokens`` positions, with
    its options parsed (``budget``, ``allocation`` uniform | pyramid | ada, ``beta``, ``floor``, the kind's own):
    (slots, options). Ada moves slots between a layer's heads and keeps its total: its layers hold what uniform's
    do."""
    from models.kv_cache import CACHE_KINDS

    g = _geom(geom)
    cls = CACHE_KINDS.get(kind)
    if cls is None or not cls.evicts:
        names = ", ".join(k for k, c in CACHE_KINDS.items() if c.evicts)
        raise KVCalcError(f"--evict {kind}: not an evicting kind; give one of {names}")
    try:
        opts = cls.parse_options(**options)
        cls.check_layers(opts, g["n_layer"], max(tokens, 1))
    except ValueError as e:
        raise KVCalcError(f"--evict {kind}: {e}") from None
    return cls.layer_budgets(g["n_layer"], max(tokens, 1), opts), opts


def evicting_bytes(geom: dict | str, kind: str, tokens: int, batch: int = 1, dtype: str = "fp32",
                   **options) -> int:
    """Exact bytes an evicting kind holds for ``batch`` sequences of ``tokens`` positions: its own
    ``nbytes_formula`` (K and V of every slot in the storage dtype, plus 8 bytes of position and, for a kind that
    carries a score, 4 of score per slot)."""
    from models.kv_cache import CACHE_KINDS

    g, dtype = _geom(geom), _dtype(dtype)
    if ITEMSIZE[dtype] == 1:
        raise KVCalcError(f"--evict with --dtype {dtype}: kvlab's evicting kinds store fp32, fp16 or bf16")
    _check_counts(tokens, batch)
    _, opts = evicting_slots(g, kind, tokens, **options)
    return CACHE_KINDS[kind].nbytes_formula(g["n_layer"], g["n_kv_head"], g["head_dim"], max(tokens, 1), batch,
                                            dtype, tokens, opts)


def parse_memory(text: str) -> int:
    """Bytes from '80GB' (10^9), '80GiB' (2^30), '24e9', '512MB', '1.5TB', '4096' (bytes); floored to whole bytes.
    At least 1 byte and at most MAX_MEMORY (checked before multiplying, so no size can overflow)."""
    text = str(text)
    m = re.fullmatch(r"\s*([0-9.eE+_-]{1,100})\s*([a-zA-Z]*)\s*", text)
    unit = m and UNITS.get(m.group(2).lower())
    number = None
    if m and unit:
        try:
            number = Decimal(m.group(1).replace("_", ""))
        except InvalidOperation:
            pass
    if number is None or not number.is_finite() or number <= 0:
        raise KVCalcError(f"cannot read memory {_show(text)}: give a positive size such as 80GB, 80GiB, 24e9 or "
                          "512MB (KB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB powers of 2, no unit: bytes)")
    # compare before multiplying: Decimal('1e999999') * 10**9 overflows the decimal context
    if number > Decimal(MAX_MEMORY) / unit:
        raise KVCalcError(f"memory {_show(text)} is beyond what kvcalc computes: give at most {MAX_MEMORY:,} bytes "
                          "(1 EB), such as 80GB or 1.5TiB")
    if number * unit < 1:
        raise KVCalcError(f"memory {_show(text)} is less than 1 byte: give a size such as 80GB, 80GiB or 512MB")
    return int(number * unit)


# ---- the formulas, written out ----------------------------------------------------------------------------------


def _n(x) -> str:
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.3f}".rstrip("0")
    return f"{int(x):,}"


def _formulas(g: dict, tokens: int, batch: int, dtype: str, opts) -> tuple[str, str, str]:
    """(method, per-token formula, total formula), each with the numbers filled in."""
    L, H, hs, isz = g["n_layer"], g["n_kv_head"], g["head_dim"], ITEMSIZE[dtype]
    groups = _held_groups(g, tokens)
    if opts is None:
        method = "plain: 2 (K,V) x layers x kv_heads x head_dim x bytes/element x tokens held x batch"
        bpt = 2 * L * H * hs * isz
        per_token = f"2 (K,V) x {L} layers x {H} kv_heads x {hs} head_dim x {isz} bytes = {_n(bpt)} B/token"
        held = " + ".join(f"{layers} layers x {_n(n)} tokens" for n, layers in groups)
        if len(groups) == 1:
            total = f"2 (K,V) x {L} layers x {H} kv_heads x {hs} head_dim x {isz} bytes x {_n(tokens)} tokens"
        else:
            total = f"2 (K,V) x {H} kv_heads x {hs} head_dim x {isz} bytes x ({held})"
        total += f" x {batch} batch = {_n(kv_cache_bytes(g, tokens, batch, dtype))} B"
        return method, per_token, total

    from models.kv_cache.quant import QuantKVCache

    G, kb, vb, M = opts.group_size, opts.k_bits, opts.v_bits, opts.group_bytes
    kept = "fp16 scale per group (symmetric)" if opts.symmetric else "fp16 scale + minimum per group (asymmetric)"
    method = (f"quantised K{kb}/V{vb} bits, group {G}: our quant kind's own QuantKVCache.nbytes_formula (exact, "
              f"packed values + {kept} + the K tail in {dtype}) and QuantKVCache.bytes_per_token "
              "(steady state, per token)")
    kq, vq = math.ceil(hs * kb / 8), math.ceil(hs * vb / 8)
    kmeta, vmeta = M * hs / G, M * math.ceil(hs / G)
    bpt = bytes_per_token(g, dtype, (kb, vb), G, opts.scheme)
    per_token = (f"{L} layers x {H} kv_heads x (K: ceil({hs}x{kb}/8)={kq} + {M}x{hs}/{G}={_n(kmeta)}"
                 f" + V: ceil({hs}x{vb}/8)={vq} + {M}xceil({hs}/{G})={vmeta}) = {_n(bpt)} B/token (steady state)")
    parts = []
    for held, layers in groups:
        qk, tk, qv, tv = QuantKVCache._capacity(held, opts)
        k = qk * kq + (qk // G) * hs * M + tk * hs * isz
        v = qv * vq + qv * math.ceil(hs / G) * M + tv * hs * isz
        parts.append(f"{layers} layers x {batch} batch x {H} kv_heads x (K: {_n(qk)}x{kq} + {_n(qk // G)}x{hs}x{M} + "
                     f"{tk}x{hs}x{isz} = {_n(k)}; V: {_n(qv)}x{vq} + {_n(qv)}x{math.ceil(hs / G)}x{M} + "
                     f"{tv}x{hs}x{isz} = {_n(v)}) [{_n(held)} slots]")
    total = " + ".join(parts) + f" = {_n(kv_cache_bytes(g, tokens, batch, dtype, (kb, vb), G, opts.scheme))} B"
    return method, per_token, total


# ---- the command line -------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: main prints it and returns 2
        raise KVCalcError(f"{message} (see python -m harness.kvcalc --help)")


def _kv_bits(text: str) -> tuple[int, int]:
    parts = text.split(",")
    try:
        bits = tuple(int(p) for p in parts)
    except ValueError:
        bits = ()
    if len(bits) == 1:
        bits = bits * 2
    if len(bits) != 2:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: give K,V bits such as 4,4 or 4,2 (each 8, 4 or 2)")
    return bits


def presets_text() -> str:
    """Every preset kvcalc accepts (``models.families.PRESETS``), by family: "GPT-2: gpt2, ...; Llama family: ..."."""
    from models.families import PRESETS

    families: dict[str, list[str]] = {}
    for name, cls in PRESETS.items():
        families.setdefault(FAMILY_NAMES.get(cls.__name__, cls.__name__.removesuffix("Config")), []).append(name)
    return "; ".join(f"{family}: {', '.join(names)}" for family, names in families.items())


FAMILY_NAMES = {"GPT2Config": "GPT-2", "LlamaConfig": "Llama family"}  # the family a preset's config class is


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m harness.kvcalc", description="KV-cache bytes for a preset or an HF config.json.")
    p.add_argument("model", help=f"a preset ({presets_text()}) or a config.json path (or a folder holding one)")
    p.add_argument("--tokens", type=int, help="sequence length (default: the model's max positions)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="fp32", help=f"one of {', '.join(ITEMSIZE)} (default fp32)")
    p.add_argument("--memory", help="memory to fill, e.g. 80GB, 80GiB, 24e9, 512MB: how many sequences fit")
    p.add_argument("--kv-bits", type=_kv_bits, help="quantised K,V bits (8, 4 or 2), e.g. 4,4: our quant kind")
    p.add_argument("--group-size", type=int, default=32, help="quantisation group size (default 32)")
    p.add_argument("--scheme", choices=("asymmetric", "symmetric"),
                   help="with --kv-bits: asymmetric (default: a scale and a minimum per group) or symmetric (a scale "
                        "only: llama.cpp's q8_0 / q4_0)")
    p.add_argument("--evict", metavar="KIND", help="an evicting kind (h2o, tova, snapkv, knorm, random): the bytes of "
                   "its slots instead of every token's")
    p.add_argument("--budget", type=int, help="with --evict: slots per layer and K/V head (their mean; default 32)")
    p.add_argument("--allocation", choices=("uniform", "pyramid", "ada"),
                   help="with --evict: how the slots are spent over layers and heads (default uniform)")
    p.add_argument("--beta", type=float, help="with --evict and --allocation pyramid: PyramidKV's beta (default 20)")
    p.add_argument("--floor", type=float, help="with --evict and --allocation ada: each head's guaranteed share "
                   "(default 0.2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def compute(args: argparse.Namespace) -> dict:
    g = kv_geometry(args.model)
    dtype = _dtype(args.dtype)
    tokens = args.tokens if args.tokens is not None else g["max_positions"]
    if tokens is None:
        raise KVCalcError(f"{g['source']}: gives no max positions (max_position_embeddings / n_positions); pass "
                          "--tokens N")
    _check_counts(tokens, args.batch)
    kv_bits = args.kv_bits
    if args.scheme is not None and kv_bits is None:
        raise KVCalcError(f"--scheme {args.scheme} says how quantised K/V are stored: pass --kv-bits K,V with it")
    scheme = args.scheme or "asymmetric"
    opts = _quant_opts(kv_bits, args.group_size, dtype, scheme) if kv_bits is not None else None
    memory = parse_memory(args.memory) if args.memory is not None else None
    if args.evict is not None or any(getattr(args, a) is not None for a in EVICT_ARGS):
        return _compute_evicting(args, g, dtype, tokens, memory)
    method, f_token, f_total = _formulas(g, tokens, args.batch, dtype, opts)
    out = {"model": args.model, "source": g["source"], "n_layer": g["n_layer"], "n_head": g["n_head"],
           "n_kv_head": g["n_kv_head"], "head_dim": g["head_dim"], "windows": g["windows"],
           "window_rule": g["window_rule"],
           "max_positions": g["max_positions"], "dtype": dtype, "kv_bits": list(kv_bits) if kv_bits else None,
           "group_size": args.group_size if kv_bits else None, "scheme": scheme if kv_bits else None,
           "tokens": tokens, "batch": args.batch,
           "bytes_per_token": bytes_per_token(g, dtype, kv_bits, args.group_size, scheme),
           "bytes": kv_cache_bytes(g, tokens, args.batch, dtype, kv_bits, args.group_size, scheme),
           "method": method, "formula_per_token": f_token, "formula": f_total}
    if memory is not None:
        out["memory_bytes"] = memory
        out["bytes_per_sequence"] = kv_cache_bytes(g, tokens, 1, dtype, kv_bits, args.group_size, scheme)
        out["sequences_that_fit"] = sequences_that_fit(g, tokens, memory, dtype, kv_bits, args.group_size, scheme)
    return out


EVICT_ARGS = ("budget", "allocation", "beta", "floor")


def _compute_evicting(args: argparse.Namespace, g: dict, dtype: str, tokens: int, memory: int | None) -> dict:
    """--evict KIND: the kind's slots per layer and its exact bytes."""
    if args.evict is None:
        given = [f"--{a}" for a in EVICT_ARGS if getattr(args, a) is not None]
        raise KVCalcError(f"{', '.join(given)}: how an evicting kind spends its slots; pass --evict KIND with it")
    if args.kv_bits is not None:
        raise KVCalcError("--evict and --kv-bits: kvlab's evicting kinds store K/V unquantised; give one of them")
    options = {a: getattr(args, a) for a in EVICT_ARGS if getattr(args, a) is not None}
    slots, opts = evicting_slots(g, args.evict, tokens, **options)
    total = evicting_bytes(g, args.evict, tokens, args.batch, dtype, **options)
    from models.kv_cache import CACHE_KINDS

    extra = CACHE_KINDS[args.evict].bookkeeping_bytes()
    per_slot = 2 * g["n_kv_head"] * g["head_dim"] * ITEMSIZE[dtype] + g["n_kv_head"] * extra
    out = {"model": args.model, "source": g["source"], "n_layer": g["n_layer"], "n_head": g["n_head"],
           "n_kv_head": g["n_kv_head"], "head_dim": g["head_dim"], "windows": g["windows"],
           "window_rule": g["window_rule"], "max_positions": g["max_positions"],
           "dtype": dtype, "tokens": tokens, "batch": args.batch, "evict": args.evict,
           "cache_label": CACHE_KINDS[args.evict].label(opts), "layer_slots": slots, "bytes": total,
           "method": (f"{args.evict}, allocation {opts.allocation}: per layer, its slots per K/V head x kv_heads x "
                      f"(2 (K,V) x head_dim x bytes/element + {extra} bytes of position"
                      + (" and score" if extra > 8 else "") + ") x batch; ada moves slots between a layer's heads, "
                      "its total unchanged"),
           "formula": (f"({' + '.join(map(str, slots))} slots) x {g['n_kv_head']} kv_heads x (2 x {g['head_dim']} x "
                       f"{ITEMSIZE[dtype]} + {extra}) x {args.batch} batch = {_n(total)} B"),
           "bytes_per_slot": per_slot}
    if memory is not None:
        out["memory_bytes"] = memory
        out["bytes_per_sequence"] = evicting_bytes(g, args.evict, tokens, 1, dtype, **options)
        out["sequences_that_fit"] = memory // out["bytes_per_sequence"]
    return out


def _text(r: dict) -> str:
    wins = sorted({w for w in r["windows"] if w is not None})
    lines = [(f"model            {r['source']}: {r['n_layer']} layers, {r['n_head']} heads, "
              f"{r['n_kv_head']} kv_heads, head_dim {r['head_dim']}")]
    if wins:
        n_win = sum(w is not None for w in r["windows"])
        lines.append(f"windows          {n_win} of {r['n_layer']} layers hold at most "
                     f"{', '.join(_n(w) for w in wins)} tokens ({r['window_rule']})")
    if "evict" in r:
        lines += [f"cache            {r['cache_label']}: slots per K/V head, bottom layer first: "
                  f"{' '.join(map(str, r['layer_slots']))}",
                  f"method           {r['method']}"]
    else:
        lines += [f"method           {r['method']}",
                  f"bytes/token      {_n(r['bytes_per_token'])}",
                  f"                 {r['formula_per_token']}"]
    lines += [f"bytes            {_n(r['bytes'])}  ({_n(r['tokens'])} tokens x {r['batch']} batch, {r['dtype']})",
              f"                 {r['formula']}"]
    if r["max_positions"] is not None and r["tokens"] > r["max_positions"]:
        lines.append(f"note             {_n(r['tokens'])} tokens is beyond the model's {_n(r['max_positions'])} "
                     "max positions")
    if "memory_bytes" in r:
        lines.append(f"fit              {_n(r['sequences_that_fit'])} sequences of {_n(r['tokens'])} tokens in "
                     f"{_n(r['memory_bytes'])} B  (floor({_n(r['memory_bytes'])} / {_n(r['bytes_per_sequence'])}))")
    return "\n".join(lines)




def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        result = compute(args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except ValueError as e:  # KVCalcError, and the engine's own refusals (e.g. GPT2Config)
        print(f"kvcalc: error: {e}", file=sys.stderr)
        return 2
    except (ArithmeticError, RecursionError, MemoryError) as e:  # the bounds should make these impossible
        print(f"kvcalc: error: cannot compute this ({type(e).__name__}: {_show(str(e))}); a limit kvcalc does not "
              "check yet: please report it with the command", file=sys.stderr)
        return 1
    try:
        print(json.dumps(result, indent=2) if args.json else _text(result), flush=True)
    except BrokenPipeError:
        return reader_gone()
    return 0

"""What every cache kind shares: the contract with attention, ``pos``, the overflow check, options, byte accounting
and the registry of kinds.

Attention calls ``update(layer, k_new, v_new) -> (K, V)``: the kind stores the new positions of one layer and returns
the keys and values those positions attend over. ``key_positions(t)`` says which absolute position each returned key
holds (``None``: the whole history, 0 .. pos + t - 1, in order), and the model masks with the kind's ``reference``
rule, so a kind that keeps only some positions (a window) is still attended exactly. ``pos`` counts the tokens
written so far; the model's forward advances it once, after its last layer, so every layer of one forward writes at
the same offset.

A kind is one class registered with ``@register``. It declares, as class attributes and classmethods, everything the
harness asks about it: ``Options`` (a frozen dataclass: names, types, defaults, checks), ``exact`` (must equal its
reference) or lossy (measured as drift), ``reference(opts)`` (the uncached model it must equal, as keyword arguments
of ``GPT2.forward``), ``held_tokens`` (token slots it holds) and ``nbytes_formula`` (its bytes, exactly).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import types
import typing
import weakref
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

DTYPE_NAMES = ("fp32", "fp16", "bf16")  # the storage / compute dtypes kvlab measures, by their short names
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a torch dtype or one of the names fp32/fp16/bf16 (float32/float16/bfloat16). Only these
    three floating dtypes are K/V storage dtypes; anything else is refused."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not a K/V storage dtype: use one of {', '.join(DTYPE_NAMES)}")
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_NAMES)}") from None


def itemsize(dtype: torch.dtype | str) -> int:
    return torch.empty((), dtype=as_dtype(dtype)).element_size()


def _count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def kv_bytes(n_layer: int, n_kv_head: int, head_dim: int, n_tokens: int, batch: int = 1,
             dtype: torch.dtype | str = torch.float32) -> int:
    """Bytes of K and V for ``n_tokens`` positions: 2 (K and V) x layers x kv heads x head_dim x tokens x batch x
    bytes per element. GPT-2 small in FP32: 2 x 12 x 12 x 64 x 4 = 73,728 B per token."""
    for name, value in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim),
                        ("batch", batch)):
        _count(name, value)
    _count("n_tokens", n_tokens, minimum=0)
    return 2 * n_layer * n_kv_head * head_dim * n_tokens * batch * itemsize(dtype)


def storage_nbytes(tensors, arrays=()) -> int:
    """Bytes of the distinct storages behind ``tensors``: a view counts the whole tensor it keeps alive, once. numpy
    ``arrays`` count as the arrays that own their memory (``held_buffers`` gives those), once each."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    owners = {id(a): a.nbytes for a in arrays}
    return sum(seen.values()) + sum(owners.values())


# What the walk never descends into: values that hold no buffer, and what belongs to the program rather than to the
# object that refers to it (modules, classes, code, frames). A function's globals are never followed either.
_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, range, slice, torch.dtype, torch.device,
           torch.Size, types.ModuleType, type, types.CodeType, types.FrameType, weakref.ref)


def _slot_values(obj):
    """The values held in the ``__slots__`` an object's classes declare (slots never set are skipped)."""
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"  # a private slot's mangled name
            try:
                yield object.__getattribute__(obj, name)
            except AttributeError:
                pass


def _children(v):
    """The values ``v`` holds: a container's items (dict keys too), what a function's closure captured and its
    defaults (never its globals), a bound method's object, a partial's function and arguments, and any object's
    ``__dict__`` and ``__slots__``."""
    if isinstance(v, dict):
        yield from v.keys()
        yield from v.values()
        if isinstance(v, collections.defaultdict):
            yield v.default_factory
    elif isinstance(v, (list, tuple, set, frozenset, collections.deque)):
        yield from v
    elif isinstance(v, functools.partial):
        yield v.func
        yield from v.args
        yield from (v.keywords or {}).values()
    elif isinstance(v, types.FunctionType):
        for cell in v.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # a cell not filled yet
                pass
        yield from v.__defaults__ or ()
        yield from (v.__kwdefaults__ or {}).values()
    elif isinstance(v, (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)):
        yield v.__self__  # a builtin function's __self__ is its module: a leaf
        if isinstance(v, types.MethodType):
            yield v.__func__
    elif isinstance(v, (staticmethod, classmethod)):
        yield v.__func__
    d = getattr(v, "__dict__", None)
    if isinstance(d, dict):
        yield from d.values()
    yield from _slot_values(v)


def held_buffers(obj) -> tuple[list[torch.Tensor], list]:
    """Every tensor, and every numpy array, ``obj`` holds, however it holds it: through lists, tuples, dicts (keys
    too), sets, deques, partials, closures, bound methods and any object's ``__dict__`` and ``__slots__``, each
    object visited once (cycles end). The walk stops at a tensor (a module's parameters count when the object
    holds the module) and never enters modules, classes, code or a function's globals. numpy arrays come back as
    the array that owns their memory (or, for an array made from a tensor, that tensor)."""
    np = sys.modules.get("numpy")  # no numpy imported: no array can be held
    tensors, arrays, owners = [], [], set()
    seen = {id(obj)}
    stack = list(_children(obj))
    while stack:
        v = stack.pop()
        if id(v) in seen or isinstance(v, _LEAVES):
            continue
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            tensors.append(v)
        elif np is not None and isinstance(v, np.ndarray):
            if v.dtype == object:
                stack.extend(v.ravel().tolist())
                continue
            while isinstance(v.base, np.ndarray):
                v = v.base
            if isinstance(v.base, torch.Tensor):
                stack.append(v.base)
            elif id(v) not in owners:
                owners.add(id(v))
                arrays.append(v)
        else:
            stack.extend(_children(v))
    return tensors, arrays


def held_tensors(obj) -> list[torch.Tensor]:
    """Every tensor ``obj`` holds, through any container (see ``held_buffers``)."""
    return held_buffers(obj)[0]


@dataclass(frozen=True)
class NoOptions:
    """A kind without options."""


class KVCache:
    """The base of every cache kind. Subclasses set ``kind`` (the registry name), ``Options``, ``exact`` and
    implement ``update``, ``_crop``, ``_reset``, ``snapshot``/``restore`` and the classmethods that describe them."""

    kind: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    exact: ClassVar[bool] = True  # must equal its reference (tokens identical); False: lossy, measured as drift
    description: ClassVar[str] = ""
    # option sets the conformance tests (tests/models/test_cache_kinds.py) run this kind with on tiny models, chosen so
    # that the kind's own mechanics (eviction, groups, ...) happen within a short generation
    examples: ClassVar[tuple[dict, ...]] = ({},)
    # whether the kind runs left-padded ragged batches exactly; if not, why (the one-line refusal)
    why_no_padding: ClassVar[str] = ""
    # True: K/V live in a pool the cache draws blocks from (and may share); nbytes counts the blocks it uses
    pooled: ClassVar[bool] = False
    # True: the kind chooses which positions it keeps, per layer and head, after attention (``after_attention``);
    # exact against its own keep-mask (models.kv_cache.evict.KeepRecord), not against a fixed rule
    evicts: ClassVar[bool] = False
    # True: attention computes its probabilities explicitly and hands them to ``after_attention`` (only such kinds
    # pay for them; every other kind keeps the fused SDPA path)
    wants_scores: ClassVar[bool] = False
    # True: the kind has a decode attention that reads K/V where they lie (``attend_decode``); a compiling engine
    # turns it on (``fused``), and it must equal the update path within float32 rounding
    fuses_decode: ClassVar[bool] = False
    # True (with fuses_decode): attend_decode also takes a ragged batch's decode step (padding, ended sequences),
    # handed the step's mask over the keys ``update`` would return; False: such steps take update + attention
    fuses_ragged: ClassVar[bool] = False
    # True: the kind's storage grows with the tokens written (nothing is allocated ahead of them); False: a
    # one-sequence cache holds, from when it is built, what it will hold at max_len (a pooled kind draws on its pool)
    grows: ClassVar[bool] = False
    # the options whose larger values hold more bytes: what a memory refusal names to lower (0 for one of them
    # means "not set", and is never suggested)
    sized_by: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def refuses_fused(cls, opts) -> str | None:
        """Why a kind that ``fuses_decode`` cannot read K/V where they lie with these options (None: it can); a run
        with compile=true is refused with it, so that what ran is what the record says."""
        return None

    @classmethod
    def input_files(cls, opts) -> tuple[str, ...]:
        """The files these options make the kind read (a heads file), as given: hashed into a run's
        ``inputs_cache``, so a resumed sweep measures again a run whose file changed."""
        return ()

    @classmethod
    def refuses_padding(cls, opts) -> str | None:
        """Why the kind with these options runs no ragged batch (``why_no_padding``, or an option's reason)."""
        return cls.why_no_padding or None

    @classmethod
    def needs_rotary(cls, opts) -> str | None:
        """Why these options need a model with rotary positions (the kind stores keys before the rotation), in a
        few words; None: any model."""
        return None

    @classmethod
    def streams(cls, opts) -> bool:
        """Whether a sequence may run past the positions the model was trained for (the kind re-positions keys)."""
        return False

    @property
    def prerope(self) -> bool:
        """The kind stores keys before the rotary rotation: a rotary model hands ``update`` its keys un-rotated and
        rotates the keys ``update`` returns itself, by ``rotary_rule``."""
        return False

    @property
    def rotary_rule(self) -> tuple[int, int] | None:
        """With ``prerope``: None, keys rotated at their absolute positions; (sinks, window): at their positions
        within the cache (StreamingLLM's: the sinks first, then the window's keys in order, the query last)."""
        return None

    @property
    def attends_opaquely(self) -> bool:
        """With fuses_decode: whether ``attend_decode`` may run as one opaque op inside a compiled decode step (it
        compiles nothing of its own), so an engine can compile the rest of the step around it."""
        return self.fuses_decode

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, max_len: int, batch: int = 1,
                 dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu", **options):
        for name, value in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim),
                            ("max_len", max_len), ("batch", batch)):
            _count(name, value)
        self.n_layer, self.n_kv_head, self.head_dim = n_layer, n_kv_head, head_dim
        self.max_len, self.batch = max_len, batch
        self.dtype = as_dtype(dtype)
        self.device = torch.device(device)
        self.opts = self.parse_options(**options)
        self.pos = 0  # slots written so far; advanced by the model's forward, after its last layer
        self.pad: torch.Tensor | None = None  # (B,) left padding of a ragged batch (set_padding); None: none
        self.pad_min = 0  # the least of pad, as a Python int (the forward checks positions without a device sync)
        self.fused = False  # decode steps attend through attend_decode (a kind that fuses_decode; the engine sets it)

    # ---- what a kind declares -------------------------------------------------------------------------------

    @classmethod
    def option_fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls.Options)}

    @classmethod
    def parse_options(cls, **options):
        """The kind's typed options from keyword arguments; unknown names and wrong types are refused in one line."""
        types = cls.option_types()
        for name, value in options.items():
            if name not in types:
                have = ", ".join(types) or "none"
                raise ValueError(f"cache kind {cls.kind!r} has no option {name!r}: its options are {have}")
            want = types[name]
            if isinstance(value, bool) != (want is bool) or not isinstance(value, (float, int) if want is float
                                                                                else want):
                raise ValueError(f"cache option {name} must be {want.__name__}, got {value!r}")
        return cls.Options(**options)

    @classmethod
    def option_types(cls) -> dict[str, type]:
        """Each option's type (int, float, bool or str: what a config file can hold)."""
        hints = typing.get_type_hints(cls.Options)
        return {name: hints[name] for name in cls.option_fields()}

    @classmethod
    def option_defaults(cls) -> dict:
        return dataclasses.asdict(cls.Options())

    @classmethod
    def reference(cls, opts) -> dict:
        """The uncached model this kind must equal, as keyword arguments of ``GPT2.forward`` ({}: full attention)."""
        return {}

    @classmethod
    def full_attention(cls, opts) -> bool:
        """Whether this kind with these options is exactly full attention (an exact kind with no visibility rule,
        that evicts nothing): a run of it in fp32 is its own fp32 reference."""
        return cls.exact and not cls.evicts and not cls.reference(opts)

    @classmethod
    def check_max_len(cls, opts, max_len: int) -> None:
        """Refuse, in one line (ValueError), options that do not fit a cache of ``max_len`` slots, or that have no
        effect at that max_len (a budget above it, a window that never slides, nothing ever quantised): a run's
        validation calls it before anything is built. (A cache built directly, for a few tokens, is not refused:
        a measurement's short cache simply never evicts.)"""

    @classmethod
    def check_head_dim(cls, opts, head_dim: int) -> None:
        """Refuse, in one line (ValueError), options that a model of this head size cannot honour or on which they
        have no effect (a rotation of one channel); validation calls it once the model's geometry is known."""

    @classmethod
    def check_layers(cls, opts, n_layer: int, max_len: int) -> None:
        """Refuse, in one line (ValueError), options a model of ``n_layer`` layers cannot honour at ``max_len`` (a
        per-layer schedule whose widest layer would not fit); validation calls it once the model is known."""

    @classmethod
    def check_fills(cls, opts, fills: list[tuple[str, int, int]]) -> None:
        """Refuse, in one line (ValueError), options too small for the caches a run builds: ``fills`` is one
        (what builds it, sequences, tokens written) per cache (``harness.experiment.memory.cache_fills``). A paged pool of
        ``blocks`` blocks is checked here."""

    @classmethod
    def fixed_pool(cls, opts) -> bool:
        """Whether these options fix the storage a cache holds whatever its batch (a paged pool of ``blocks``
        blocks): then a cache sized for one sequence does not hold several."""
        return False

    @classmethod
    def min_prompt(cls, opts) -> int:
        """The fewest prompt tokens the kind takes (a SnapKV window needs as many); a shorter prompt is refused."""
        return 1

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        """Token slots the cache holds after ``n_tokens`` tokens were written."""
        raise NotImplementedError

    @classmethod
    def nbytes_formula(cls, n_layer: int, n_kv_head: int, head_dim: int, max_len: int, batch: int, dtype,
                       n_tokens: int, opts) -> int:
        """Bytes the cache holds after ``n_tokens`` tokens were written, from the geometry alone. Default: the
        storage dtype's K and V for every slot held."""
        return kv_bytes(n_layer, n_kv_head, head_dim, cls.held_tokens(max_len, n_tokens, opts), batch, dtype)

    @classmethod
    def bytes_per_token(cls, n_layer: int, n_kv_head: int, head_dim: int, dtype, opts) -> float:
        """What one more cached token costs in the kind's main storage (fixed overheads such as a full-precision
        tail excluded; scales included)."""
        return float(kv_bytes(n_layer, n_kv_head, head_dim, 1, 1, dtype))

    @classmethod
    def label(cls, opts) -> str:
        """How runs of this kind with these options are labelled in tables and plots."""
        diff = [f"{f.name}={getattr(opts, f.name)}" for f in dataclasses.fields(opts)]
        return cls.kind + (f"({','.join(diff)})" if diff else "")

    # ---- the contract with attention ------------------------------------------------------------------------

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend_decode(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """For a kind that ``fuses_decode``, while ``fused``: one decode step of ``layer``, q, k_new, v_new (B, nh, 1,
        hs), written and attended where the kind stores K and V (no full-precision copy of the history): the
        attention's output (B, nh, 1, hs) in q's dtype. The model calls it instead of ``update`` + attention;
        ``mask`` (True = may attend, over the keys update would return) comes only to a kind that
        ``fuses_ragged``, for a ragged batch's step; otherwise it is None."""
        raise NotImplementedError(f"cache kind {self.kind!r} has no fused decode attention")

    def stored_history(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a kind that ``fuses_decode``: the K and V its last ``attend_decode`` of ``layer`` read, as ``update``
        would have returned them (for measurements that compare what attention saw; a copy, made only when asked)."""
        raise NotImplementedError(f"cache kind {self.kind!r} has no fused decode attention")

    def key_positions(self, t: int) -> torch.Tensor | None:
        """Absolute position of each key ``update`` returns while ``t`` new tokens are written at ``pos`` (call
        before the forward advances ``pos``). None: the whole history 0 .. pos + t - 1, in order."""
        return None

    def layer_key_positions(self, layer: int, t: int) -> torch.Tensor | None:
        """An evicting kind's keys differ by layer and head: (B, nh, n_keys), the position of each key
        ``update(layer, ...)`` returns while t new tokens are written, -1 for a key that holds nothing. None: the
        kind's keys are ``key_positions(t)``, the same in every layer."""
        return None

    def after_attention(self, layer: int, probs: torch.Tensor | None) -> None:
        """Called by attention after it attended in ``layer``, for a kind that ``evicts``: ``probs`` (B, nh, t,
        n_keys), this forward's attention probabilities, for a kind that ``wants_scores`` (None otherwise)."""

    def error_bound(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a lossy kind: per element, how far the K and V the last ``update`` of ``layer`` returned may be from
        what was written (shaped like them). None: exact, equal to what was written in the storage dtype."""
        return None

    def _check_room(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> int:
        if not 0 <= layer < self.n_layer:
            raise IndexError(f"layer {layer} out of range for a cache of {self.n_layer} layers")
        want = (self.batch, self.n_kv_head, k_new.shape[2] if k_new.dim() == 4 else -1, self.head_dim)
        for name, x in (("k", k_new), ("v", v_new)):
            if x.dim() != 4 or tuple(x.shape) != want:
                raise ValueError(f"{name}_new has shape {tuple(x.shape)} but this cache holds (batch, heads, t, "
                                 f"head_dim) = ({self.batch}, {self.n_kv_head}, t, {self.head_dim}): build the cache "
                                 "for the model's geometry and the prompt batch")
        t = k_new.shape[2]  # k_new: (B, nh, t, hs)
        if self.pos + t > self.max_len:
            raise ValueError(f"KV cache overflow: pos {self.pos} + {t} new tokens > max_len {self.max_len}")
        return t

    def advance(self, t: int) -> None:
        """Move ``pos`` past the ``t`` tokens the last forward stored in every layer."""
        self.pos += t

    # ---- bookkeeping ----------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of storage the cache keeps alive: every tensor it holds (but the padding vector of a ragged batch),
        a view counting the tensor behind it. Every container is walked (``held_buffers``), so a buffer cannot hide."""
        tensors, arrays = held_buffers(self)
        return storage_nbytes([t for t in tensors if t is not self.pad], arrays)

    def formula_nbytes(self, n_tokens: int | None = None) -> int:
        """The kind's byte formula for this cache after ``n_tokens`` (default: ``pos``) tokens."""
        return self.nbytes_formula(self.n_layer, self.n_kv_head, self.head_dim, self.max_len, self.batch, self.dtype,
                                   self.pos if n_tokens is None else n_tokens, self.opts)

    @property
    def held(self) -> int:
        """Token slots held now."""
        return self.held_tokens(self.max_len, self.pos, self.opts)

    @property
    def filled_nbytes(self) -> int:
        """Bytes of the tokens written so far at the storage dtype (padding slots of a ragged batch excluded)."""
        return sum(kv_bytes(self.n_layer, self.n_kv_head, self.head_dim, n, 1, self.dtype) for n in self.lengths())

    @property
    def held_slots(self) -> int:
        """Token slots held now, all sequences together."""
        return self.held * self.batch

    @property
    def occupied_slots(self) -> int:
        """Held slots that hold a token (padding and slots not yet written do not)."""
        return sum(min(n, self.held) for n in self.lengths())

    @property
    def waste(self) -> float:
        """The fraction of held slots that hold no token: vLLM's measure of what a layout reserves in vain."""
        held = self.held_slots
        return 1.0 - self.occupied_slots / held if held else 0.0

    # ---- ragged batches ---------------------------------------------------------------------------------------

    def set_padding(self, pad) -> None:
        """Declare a left-padded ragged batch before its prefill: sequence b's first ``pad[b]`` slots hold padding,
        not tokens, and its token at slot s has position s - pad[b]. The model then gives each sequence its own
        positions and masks the padding out of attention; a kind that stores per token skips the padding."""
        if self.why_no_padding:
            raise ValueError(f"cache kind {self.kind!r} does not run ragged batches: {self.why_no_padding}")
        if self.pos:
            raise ValueError(f"set_padding comes before the prefill: this cache already holds {self.pos} slots")
        pad = torch.as_tensor(pad)
        if pad.is_floating_point() or pad.dtype == torch.bool or tuple(pad.shape) != (self.batch,):
            raise ValueError(f"pad must be {self.batch} integers (one per sequence), got {pad.dtype} of shape "
                             f"{tuple(pad.shape)}")
        if int(pad.min()) < 0 or int(pad.max()) >= self.max_len:
            raise ValueError(f"pad must lie in [0, max_len {self.max_len}), got {pad.tolist()}")
        self.pad = None if not pad.any() else pad.to(device=self.device, dtype=torch.long)
        self.pad_min = int(pad.min())

    def lengths(self, n_slots: int | None = None) -> list[int]:
        """Tokens each sequence holds after ``n_slots`` (default: ``pos``) slots: the slots less its padding."""
        n = self.pos if n_slots is None else n_slots
        return [n] * self.batch if self.pad is None else [max(0, n - p) for p in self.pad.tolist()]

    # ---- rewinding and reuse --------------------------------------------------------------------------------

    def can_crop(self, n_tokens: int) -> bool:
        """Whether ``crop(n_tokens)`` can give exactly the cache that wrote only the first ``n_tokens``."""
        return 0 <= n_tokens <= self.pos

    def _why_no_crop(self, n_tokens: int) -> str:
        return f"cannot crop to {n_tokens} tokens: the cache holds {self.pos}"

    def crop(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` positions and forget the rest (roll back a speculative or timed step)."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int):
            raise ValueError(f"crop takes an integer number of tokens, got {n_tokens!r}")
        if not 0 <= n_tokens <= self.pos:
            raise ValueError(f"cannot crop to {n_tokens} tokens: the cache holds {self.pos}")
        if not self.can_crop(n_tokens):
            raise ValueError(self._why_no_crop(n_tokens))
        self._crop(n_tokens)
        self.pos = n_tokens

    def _crop(self, n: int) -> None:
        raise NotImplementedError

    def checkpoint(self) -> Callable[[], None]:
        """A function that puts the cache back to its state now, the cheapest exact way the kind has: a crop where
        the kind can crop back over what comes next, a snapshot where it cannot."""
        pos = self.pos
        return lambda: self.crop(pos)

    def reset(self) -> None:
        """Empty again (padding forgotten); the storage a kind allocated up front is kept."""
        self._reset()
        self.pos, self.pad, self.pad_min = 0, None, 0

    def _reset(self) -> None:
        raise NotImplementedError

    def empty_like(self, batch: int | None = None) -> KVCache:
        """An empty cache of the same kind, geometry and options (``batch`` sequences if given): one that this
        cache's snapshots restore into. A pooled kind's draws from the same pool."""
        return type(self)(self.n_layer, self.n_kv_head, self.head_dim, self.max_len, batch or self.batch,
                          dtype=self.dtype, device=self.device, **dataclasses.asdict(self.opts))

    def snapshot(self) -> dict:
        raise NotImplementedError

    def restore(self, snap: dict) -> None:
        raise NotImplementedError

    def _snapshot_header(self) -> dict:
        return dict(kind=self.kind, geometry=self._geometry(), pos=self.pos,
                    pad=None if self.pad is None else self.pad.clone())

    def _geometry(self) -> tuple:
        return (self.n_layer, self.batch, self.n_kv_head, self.head_dim, self.max_len, str(self.dtype), self.opts)

    def _check_snapshot(self, snap: dict, expect: Callable[[int], dict] | None = None,
                        check: Callable[[dict], None] | None = None) -> int:
        """Check a snapshot before anything is restored from it and return its ``pos``: that it is this kind's, of
        this geometry, with an integer ``pos`` within ``max_len`` and a padding vector of this batch, and that each
        tensor ``expect(pos)`` names (key -> (shape, dtype[, device]), a None in a shape: any size; a list: a list of
        those, a None in it: an entry that must be None) is there with that shape, dtype and device; then the kind's
        own ``check(snap)``. A tampered snapshot is refused in one line and the cache is left as it was; only then
        is the padding taken."""
        if not isinstance(snap, dict) or snap.get("kind") != self.kind:
            raise ValueError(f"not a snapshot of a {self.kind!r} cache: restore takes what this kind's snapshot() "
                             "returned")
        if snap.get("geometry") != self._geometry():
            raise ValueError(f"snapshot of a cache with (layers, batch, heads, head_dim, max_len, dtype, options) "
                             f"= {snap.get('geometry')} cannot restore into one with {self._geometry()}")
        pos = self._snapshot_pos(snap)
        specs = {} if expect is None else expect(pos)
        for key in ("pad", *specs):
            if key not in snap:
                raise ValueError(f"snapshot has no {key!r}: restore takes what this kind's snapshot() returned, "
                                 "unchanged")
        pad = snap["pad"]
        if pad is not None:
            self._check_snapshot_tensor("pad", pad, ((self.batch,), torch.long), pos)
            if int(pad.min()) < 0 or int(pad.max()) >= self.max_len:
                raise ValueError(f"snapshot's 'pad' {pad.tolist()} does not lie in [0, max_len {self.max_len}): "
                                 "restore takes what snapshot() returned, unchanged")
        for key, spec in specs.items():
            value = snap[key]
            if isinstance(spec, list):
                if not isinstance(value, (list, tuple)) or len(value) != len(spec):
                    got = f"{len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
                    raise ValueError(f"snapshot's {key!r} must be a list of {len(spec)} (one per layer), got {got}: "
                                     "restore takes what snapshot() returned, unchanged")
                for i, (v, sp) in enumerate(zip(value, spec)):
                    self._check_snapshot_tensor(f"{key}[{i}]", v, sp, pos)
            else:
                self._check_snapshot_tensor(key, value, spec, pos)
        if check is not None:
            check(snap)
        self.pad = None if pad is None else pad.clone()
        self.pad_min = 0 if pad is None else int(pad.min())
        return pos

    def _snapshot_pos(self, snap: dict) -> int:
        pos = snap.get("pos")
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= self.max_len:
            raise ValueError(f"snapshot's pos {pos!r} is not a number of tokens in [0, max_len {self.max_len}]: "
                             "restore takes what snapshot() returned, unchanged")
        return pos

    def _check_snapshot_tensor(self, key: str, value, spec, pos: int) -> None:
        if spec is None:
            if value is not None:
                raise ValueError(f"snapshot's {key!r} must be None for a cache of {pos} tokens, got "
                                 f"{type(value).__name__}: restore takes what snapshot() returned, unchanged")
            return
        shape, dtype, device = (*spec, None) if len(spec) == 2 else spec
        device = self.device if device is None else torch.device(device)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"snapshot's {key!r} is {type(value).__name__}, not a tensor: restore takes what "
                             "snapshot() returned, unchanged")
        if value.dim() != len(shape) or any(w is not None and n != w for n, w in zip(value.shape, shape)):
            want = "(" + ", ".join("n" if w is None else str(w) for w in shape) + ("," * (len(shape) == 1)) + ")"
            raise ValueError(f"snapshot's {key!r} has shape {tuple(value.shape)} but a {self.kind} snapshot of {pos} "
                             f"tokens holds {want}: restore takes what snapshot() returned, unchanged")
        if value.dtype != dtype:
            raise ValueError(f"snapshot's {key!r} is {value.dtype} but this cache keeps it as {dtype}: restore takes "
                             "what snapshot() returned, unchanged")
        if value.device.type != device.type or (device.index is not None and value.device.index != device.index):
            raise ValueError(f"snapshot's {key!r} is on {value.device} but this cache keeps it on {device}: restore "
                             "takes what snapshot() returned, unchanged")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(n_layer={self.n_layer}, n_kv_head={self.n_kv_head}, head_dim={self.head_dim}, "
                f"max_len={self.max_len}, batch={self.batch}, dtype={self.dtype}, pos={self.pos}, {self.opts})")


CACHE_KINDS: dict[str, type[KVCache]] = {}


def register(cls: type[KVCache]) -> type[KVCache]:
    """Class decorator: add a kind to ``CACHE_KINDS`` under its ``kind`` name."""
    if not cls.kind or cls.kind in CACHE_KINDS:
        raise ValueError(f"cache kind {cls.kind!r} of {cls.__name__} is empty or already registered")
    CACHE_KINDS[cls.kind] = cls
    return cls


def cache_kind(kind: str) -> type[KVCache]:
    """The class registered under ``kind``; an unknown name is refused with the list of kinds."""
    try:
        return CACHE_KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown cache kind {kind!r}: use one of {', '.join(CACHE_KINDS)}") from None


def make_cache(kind: str, n_layer: int, n_kv_head: int, head_dim: int, max_len: int, batch: int = 1,
               dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu", **options) -> KVCache:
    """A cache of the named kind; ``options`` are the kind's own (see its ``Options``)."""
    return cache_kind(kind)(n_layer, n_kv_head, head_dim, max_len, batch, dtype=dtype, device=device, **options)

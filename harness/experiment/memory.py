"""Memory before allocation: the bytes a run will need at its peak, from its config alone, against what the machine
(or the device) has free. Pure functions: no printing, no files, nothing built.

    need = run_bytes(preset_config("gpt2"), storage="fp32", compute="fp32", kind="prealloc", options={},
                     max_len=1024, batch=64, batch_sizes=[1, 8, 32], ...)
    check(need, available_bytes(device))      # raises ConfigError in one line when it does not fit
    need.describe()                           # one line for people
    cache_fills(kind="paged", ..., max_len=1024)  # every cache the run builds: (what, sequences, tokens written)

A run holds its weights throughout and goes through its measurements one after another, each building its own
caches and freeing them before the next: its peak is the weights plus the largest phase. The phases are the
measurements' own (``Measurement.memory``: the caches alive in a phase, exactly, from the kind's ``nbytes_formula``,
and its largest transient tensors, a little conservatively), made of ``harness.core.sizes``' pieces; this module
names no measurement: it sums the weights and takes the largest phase of those the run makes.

The weights: ``param_count`` x element size, per copy: the fp32 model (model32); a copy in the compute dtype when
compute is not fp32; and for engine=hf transformers' own model in the compute dtype (it holds its own weights). The
phase ``setup`` counts the fp32 copy a reduced-precision copy is made from (a deepcopy of model32, then converted),
and on a CPU the fp32 HF model before its conversion. Every phase adds ``SLACK`` (5%) of its cache + measurement:
allocators round and fragment.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

from harness.common.errors import ConfigError
from harness.core.engines import ENGINES
from harness.core.sizes import F32, Shape, dtype_name, param_count
from models.kv_cache import as_dtype, cache_kind
from models.kv_cache.base import itemsize

SLACK = 0.05  # added to each phase's cache + transients for the allocators' rounding and fragmentation (a served
# batch on a CPU peaked about 1% above its tensors' bytes)
MARGIN = 0.10  # of what is free, kept free
MIN_MARGIN = 256 << 20  # and at least this much
GB = 1e9


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


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: give a positive integer")
    return value


def _chosen(names: list[str] | None) -> list:
    """The measurements' classes a run makes (``names``; None: every one but those that run only when named), in
    the registry's order."""
    from harness.measurements import MEASUREMENTS, chosen

    return [MEASUREMENTS[name] for name in chosen(names)]


def _option_values(values: dict) -> dict:
    """The measurements' option values by name, each name some measurement's option (anything else: TypeError, as a
    misspelt keyword is)."""
    from harness.measurements import MEASUREMENTS

    known = {f.name for cls in MEASUREMENTS.values() for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"run_bytes() got options no measurement has: {', '.join(unknown)}")
    return values


def run_bytes(model, *, storage="fp32", compute="fp32", kind: str = "prealloc", options: dict | None = None,
              max_len: int | None = None, batch: int = 1, n_prompts: int = 4, new_tokens: int = 32,
              prompt_len: int = 32, engine: str = "kvlab", device: str = "cpu", compile: bool = False,
              keep_fp32: bool | None = None, measurements: list[str] | None = None, **option_values) -> RunBytes:
    """The bytes a run of ``model`` needs at its peak on ``device`` ("cpu" or "cuda"), from plain values only: its
    weights (every copy it holds) and the largest phase the ``measurements`` it makes (None: all) declare
    (``Measurement.memory``, from the run's ``harness.core.sizes.Shape`` and their options: ``option_values`` by
    name, each one's default where not given).

    ``storage`` / ``compute``: the K/V and model dtypes (names or torch dtypes; compute "auto" resolves as the run
    does: fp32 on a CPU, the storage dtype on CUDA). ``kind`` and ``options``: the cache kind and its options.
    ``max_len``: cache capacity (default n_positions). ``batch``: the served batch; ``keep_fp32``: whether the
    fp32 model is kept beside a reduced-precision copy (default: yes, as every run does: it is the drift
    reference). The terms each phase counts are in its measurement's ``memory``; weights in the module docstring.
    """
    from harness.measurements import options_of

    option_values = _option_values(dict(option_values))
    args = dict(storage=storage, compute=compute, kind=kind, options=dict(options or {}), max_len=max_len,
                batch=batch, n_prompts=n_prompts, new_tokens=new_tokens, prompt_len=prompt_len, engine=engine,
                device=device, compile=compile, keep_fp32=keep_fp32,
                measurements=None if measurements is None else list(measurements), **option_values)
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r}: use one of {', '.join(ENGINES)}")
    device = str(device).split(":")[0]
    if compute == "auto":
        compute = "fp32" if device == "cpu" else storage
    for name, value in (("batch", batch), ("n_prompts", n_prompts), ("new_tokens", new_tokens),
                        ("prompt_len", prompt_len)):
        _positive(name, value)
    s = Shape(model, kind, dict(options or {}), as_dtype(storage), as_dtype(compute), engine,
              model.n_positions if max_len is None else _positive("max_len", max_len), prompt_len, new_tokens,
              n_prompts, batch, compile, device)
    weights, copies, setup = _weights(s, engine, device, keep_fp32)
    phases = {"setup": ("setup", 0, setup)}
    for cls in _chosen(measurements):
        for phase in cls.memory(s, options_of(cls, option_values)):
            phases.setdefault(phase[0], phase)  # a phase two measurements share counts once
    phases = [(name, c, m + math.ceil(SLACK * (c + m))) for name, c, m in phases.values()]
    peak, cache, measurement = max(phases, key=lambda p: p[1] + p[2])
    return RunBytes(params=s.P, weights=weights, weights_copies=tuple(copies), cache=cache, measurement=measurement,
                    total=weights + cache + measurement, peak=peak, phases=tuple(phases),
                    inputs=dict(model=model, **args))


def _weights(s: Shape, engine: str, device: str, keep_fp32: bool | None) -> tuple[int, list, int]:
    """(bytes of every weight copy a run holds, the copies, what building them needs beyond that)."""
    P, isz_c = s.P, itemsize(s.compute)
    copies = []
    if keep_fp32 is not False or not s.reduced:
        copies.append(("fp32 model", P * F32))
    if s.reduced:
        copies.append((f"{dtype_name(s.compute)} copy", P * isz_c))
    if ENGINES[engine].holds_weight_copy:
        copies.append((f"{engine} {dtype_name(s.compute)} copy", P * isz_c))
    weights = sum(b for _, b in copies)
    # setup: deepcopy(model32) is fp32 until converted; on a CPU an engine with its own copy builds it in fp32
    # beside the others
    deep = 2 * P * F32 if s.reduced else 0
    own = ENGINES[engine].holds_weight_copy and device == "cpu" and s.reduced
    build = 2 * P * F32 + P * isz_c if own else 0
    return weights, copies, max(0, deep - weights, build - weights)


def cache_fills(*, kind: str, options: dict | None = None, max_len: int, prompt_len: int = 32, new_tokens: int = 32,
                batch: int = 1, storage="fp32", compute="auto", compile: bool = False, engine: str = "kvlab",
                measurements: list[str] | None = None, **option_values) -> list[tuple[str, int, int]]:
    """Every cache the run's ``measurements`` (None: all) build, from the config alone: (what builds it, sequences,
    the most tokens it has written), as each declares them (``Measurement.fills``). Each is a cache of its own (a
    paged one draws its own pool). ``compute`` "auto" counts as fp32 (the run's own drift reference decides whether
    text drift runs)."""
    from harness.measurements import options_of

    option_values = _option_values(dict(option_values))
    s = Shape(None, kind, dict(options or {}), as_dtype(storage), as_dtype("fp32" if compute == "auto" else compute),
              engine, max_len, prompt_len, new_tokens, 1, batch, compile)
    return [fill for cls in _chosen(measurements) for fill in cls.fills(s, options_of(cls, option_values))]


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

    sizes = inputs.get("batch_sizes")
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
        contexts = inputs.get("context_lengths")
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
    run = {k: v for k, v in inputs.items() if k not in ("model", "options", "max_len", "n_prompts", "device",
                                                         "keep_fp32")}
    fills = cache_fills(options=options, max_len=max_len, **run)
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

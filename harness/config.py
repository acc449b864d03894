"""Typed configs: one dataclass per config node, registered in Hydra's ConfigStore so every YAML in conf/ is checked
against it when composed. ``validate`` refuses impossible combinations before any work, with one-line errors.

The cache node has one schema per cache kind, made from the kind's own ``Options`` (``schema/cache/<kind>``, which
``conf/cache/<kind>.yaml`` extends): a kind registered in ``models.kv_cache`` is typed here with no line of this file
naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from harness.engines import ENGINES, hf_refuses
from models.kv_cache import CACHE_KINDS, DTYPE_NAMES, KVCache, cache_kind


@dataclass
class ModelConfig:
    name: str = "gpt2"  # how runs are labelled
    preset: str = "gpt2"  # GPT2Config.preset name (random weights; auto's hub checkpoint)
    weights: str = "auto"  # auto (the preset's real checkpoint if reachable, else random) | random | folder | hub id
    seed: int = 0  # seed of the random init
    build: Optional[str] = None  # the command that makes the checkpoint folder, shown when it is missing


def cache_schema(cls: type[KVCache]) -> type:
    """The config node of one cache kind: ``kind`` plus the kind's options, typed and defaulted as the class says."""
    fields = [("kind", str, field(default=cls.kind))]
    fields += [(name, typ, field(default=cls.option_defaults()[name])) for name, typ in cls.option_types().items()]
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields)


def cache_options(node) -> dict:
    """The kind's options from a composed cache node (everything but ``kind``)."""
    return {k: v for k, v in node.items() if k != "kind"}


@dataclass
class DtypeConfig:
    name: str = "fp32"
    storage: str = "fp32"  # dtype of K and V in the cache
    compute: str = "auto"  # model dtype; auto: fp32 on CPU, the storage dtype on CUDA


@dataclass
class DeviceConfig:
    name: str = "cpu"  # cpu | cuda | auto (cuda when available)


@dataclass
class TrackingConfig:
    mode: str = "offline"  # offline (no network) | online (needs a W&B key) | disabled
    project: str = "kvlab"
    entity: Optional[str] = None
    group: Optional[str] = None  # default: the sweep folder's name (or the run's, for a single run)


@dataclass
class EngineConfig:
    name: str = "kvlab"  # kvlab (our GPT-2 and caches) | hf (transformers' GPT2LMHeadModel and caches, same weights)


@dataclass
class KvlabConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache: Any = MISSING  # one of the cache group's nodes, typed by its kind's schema
    dtype: DtypeConfig = field(default_factory=DtypeConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    experiment: str = "quick"  # the preset's name, set by conf/experiment/*.yaml
    n_prompts: int = 4
    new_tokens: int = 32
    prompt_len: int = 32
    drift_text_len: int = 128  # tokens of real text per prompt scored for drift (prompt + its continuation)
    batch: int = 1  # sequences served together in the run's throughput / waste measurement
    prompt_lengths: str = "uniform"  # uniform (every prompt prompt_len tokens) | ragged (seeded, 1 .. prompt_len)
    batch_sizes: Optional[list[int]] = None  # decode throughput vs batch (batches.csv); None: not measured
    batch_context: int = 512  # context each sequence holds while batches are timed (capped below max_len)
    max_len: Optional[int] = None  # cache capacity; default: the model's n_positions
    context_lengths: Optional[list[int]] = None  # timed contexts; default: those of 32, 128, 512 below max_len
    repeats: int = 10
    warmup: int = 3
    seed: int = 0  # prompts and timing inputs
    prompts: str = "file"  # file (real English text, tokenized) | random (seeded random ids)
    prompts_file: str = "harness/prompts.txt"  # relative to the repository root
    full_prompts: Optional[int] = None  # prompts (at most n_prompts) also checked with the true uncached loop;
    # default 1 on CPU, all on GPU
    compile: bool = False  # torch.compile the prealloc kind's decode step (static shapes; CUDA graphs on a GPU)
    resume: bool = True  # skip a run whose folder holds a complete, ok record of the same config and inputs
    equivalence_tol: float = 1e-4  # an exact kind in fp32 whose max |dlogit| exceeds this is not_equivalent


def dtype_label(storage: str, compute: str) -> str:
    """How runs are labelled: the storage dtype ("fp16"), or "storage/compute" when compute is set explicitly to
    something else than auto ("fp16/fp16"); fp32 with fp32 compute is "fp32"."""
    if compute == "auto" or compute == storage == "fp32":
        return storage
    return f"{storage}/{compute}"


NOT_MEASURED = ("tracking", "resume", "hydra")  # config keys that do not change what a run measures


def config_id(cfg) -> str:
    """12 hex digits that name what a run measures: a hash of its resolved config without tracking and resume."""
    keys = [k for k in cfg.keys() if k not in NOT_MEASURED]
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
             for k in keys}
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]


def slug(text) -> str:
    """A config value made safe as one path component: no separators, no leading dots, nothing but [A-Za-z0-9._+-]."""
    out = re.sub(r"[^A-Za-z0-9._+-]+", "-", str(text)).strip("-.")
    return out[:80] or "x"


def _id_resolver(*, _root_) -> str:
    return config_id(_root_)


def register() -> None:
    """The schemas, and the resolvers conf/config.yaml names paths with: ``kvlab_slug`` and ``kvlab_id``."""
    for name, fn in (("kvlab_slug", slug), ("kvlab_id", _id_resolver)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
    cs = ConfigStore.instance()
    cs.store(name="kvlab_schema", node=KvlabConfig)
    for name, cls in CACHE_KINDS.items():
        cs.store(group="schema/cache", name=name, node=cache_schema(cls))


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line that says what would be right."""


AUTO_CONTEXTS = (32, 128, 512)
PROMPT_LENGTHS = ("uniform", "ragged")
ENGINE_NAMES = tuple(ENGINES)


def validate(cfg, n_positions: int) -> tuple[int, list[int]]:
    """Check the knobs against each other and the model; returns the effective max_len and context lengths."""

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    need(cfg.cache.kind in CACHE_KINDS, f"cache.kind={cfg.cache.kind!r}: use one of {', '.join(CACHE_KINDS)}")
    try:
        cache_kind(cfg.cache.kind).parse_options(**cache_options(cfg.cache))
    except ValueError as e:
        raise ConfigError(f"cache={cfg.cache.kind}: {e}") from None
    need(cfg.dtype.storage in DTYPE_NAMES, f"dtype.storage={cfg.dtype.storage!r}: use one of {DTYPE_NAMES}")
    need(cfg.dtype.compute in DTYPE_NAMES + ("auto",),
         f"dtype.compute={cfg.dtype.compute!r}: use auto or one of {DTYPE_NAMES}")
    need(cfg.device.name in ("cpu", "cuda", "auto"), f"device={cfg.device.name!r}: use cpu, cuda or auto")
    engine = cfg.get("engine", {}).get("name", "kvlab")
    need(engine in ENGINE_NAMES, f"engine={engine!r}: use one of {', '.join(ENGINE_NAMES)}")
    if engine == "hf":
        why = hf_refuses(cfg.cache.kind, cache_kind(cfg.cache.kind).parse_options(**cache_options(cfg.cache)))
        need(not why, f"engine=hf cache={cfg.cache.kind}: {why}")
    need(cfg.tracking.mode in ("offline", "online", "disabled"),
         f"tracking.mode={cfg.tracking.mode!r}: use offline, online or disabled")
    need(cfg.prompts in ("file", "random"), f"prompts={cfg.prompts!r}: use file or random")
    for name, value in (("seed", cfg.seed), ("model.seed", cfg.model.seed)):
        need(0 <= value < 2 ** 63, f"{name}={value}: use an integer 0 <= seed < 2**63")
    need(str(cfg.model.name).strip() != "", "model.name is empty: give the runs a label, e.g. model.name=my-ckpt")
    for name in ("project", "entity", "group"):
        value = cfg.tracking.get(name)
        need(value is None or (0 < len(str(value)) <= 128 and not set(str(value)) & set("/\\#?%:")),
             f"tracking.{name}={value!r}: W&B names are 1-128 characters without / \\ # ? % :")
    for name in ("n_prompts", "new_tokens", "prompt_len", "repeats"):
        need(getattr(cfg, name) >= 1, f"{name}={getattr(cfg, name)} must be at least 1")
    need(cfg.warmup >= 0, f"warmup={cfg.warmup} must be 0 or more")
    need(isinstance(cfg.get("batch", 1), int) and cfg.get("batch", 1) >= 1,
         f"batch={cfg.get('batch')!r} must be an integer >= 1 (sequences served together)")
    lengths = cfg.get("prompt_lengths", "uniform")
    need(lengths in PROMPT_LENGTHS, f"prompt_lengths={lengths!r}: use one of {', '.join(PROMPT_LENGTHS)}")
    if lengths == "ragged" and cfg.cache.kind in CACHE_KINDS:
        why = CACHE_KINDS[cfg.cache.kind].why_no_padding
        need(not why, f"prompt_lengths=ragged: cache kind {cfg.cache.kind!r} does not run ragged batches ({why})")
        need(engine == "kvlab", f"prompt_lengths=ragged: engine={engine} runs batches of one prompt length here; "
             "use engine=kvlab")
    if cfg.get("compile", False):
        need(cfg.cache.kind == "prealloc", f"compile=true compiles the pre-allocated kind's decode step (static "
             f"shapes): use cache=prealloc, not cache={cfg.cache.kind}")
        need(engine == "kvlab", f"compile=true compiles kvlab's decode step: use engine=kvlab, not engine={engine}")
    for b in cfg.get("batch_sizes") or []:
        need(isinstance(b, int) and b >= 1, f"batch_sizes has {b!r}: give batch sizes >= 1, e.g. [1,8,32]")
    need(cfg.get("batch_context", 1) >= 1, f"batch_context={cfg.get('batch_context')} must be at least 1")
    need(cfg.get("drift_text_len", 2) >= 2, f"drift_text_len={cfg.get('drift_text_len')} must be at least 2 (a "
         "token and the one it predicts)")
    max_len = n_positions if cfg.max_len is None else cfg.max_len
    need(max_len <= n_positions, f"max_len={max_len} > n_positions={n_positions} of model {cfg.model.name}: "
         f"use max_len <= {n_positions}")
    need(cfg.prompt_len + cfg.new_tokens <= max_len,
         f"prompt_len + new_tokens = {cfg.prompt_len} + {cfg.new_tokens} > max_len={max_len}: "
         f"shorten them or raise max_len (at most {n_positions})")
    contexts = (list(cfg.context_lengths) if cfg.context_lengths is not None
                else [c for c in AUTO_CONTEXTS if c < max_len] or [max_len // 2])
    need(len(contexts) > 0, "context_lengths is empty: give at least one, e.g. [32,128]")
    need(len(set(contexts)) == len(contexts), f"context_lengths {contexts} repeats a length: give each once")
    for ctx in contexts:
        need(1 <= ctx < max_len, f"context_lengths has {ctx}: a timed step at context c needs 1 <= c < max_len="
             f"{max_len}")
    tol = cfg.get("equivalence_tol", 1e-4)
    need(isinstance(tol, (int, float)) and not isinstance(tol, bool) and 0 < tol < float("inf"),
         f"equivalence_tol={tol!r} must be a positive number (max |dlogit| an exact kind in fp32 may show), e.g. 1e-4")
    if cfg.full_prompts is not None:
        need(cfg.full_prompts >= 0, f"full_prompts={cfg.full_prompts} must be 0 or more (n_prompts caps it)")
    return max_len, contexts

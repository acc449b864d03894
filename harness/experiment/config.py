"""Typed configs: one dataclass per config node, registered in Hydra's ConfigStore so every YAML in conf/ is checked
against it when composed. ``read`` turns a composed config into the run's plain ``RunConfig``
(``harness.experiment.plan``), the only form the run's modules see; ``validate`` refuses impossible combinations of
one before any work, with one-line errors.

The cache node has one schema per cache kind, made from the kind's own ``Options`` (``schema/cache/<kind>``, which
``conf/cache/<kind>.yaml`` extends): a kind registered in ``models.kv_cache`` is typed here with no line of this file
naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from harness.common.errors import ConfigError
from harness.experiment.plan import (CacheChoice, DtypeChoice, EngineChoice, ModelChoice, OutliersChoice, RunConfig,
                                     TrackingChoice)
from harness.measurements.base import MAX_LIST, MAX_PROMPTS, MAX_REPEATS, MAX_WARMUP
from harness.core import kinds
from harness.core.engines import ENGINES
from harness.experiment import external
from models import outliers
from models.kv_cache import CACHE_KINDS, DTYPE_NAMES, KVCache, cache_kind


@dataclass
class OutliersConfig:
    """``model.outliers``: one K and one V channel per head made ``scale`` times larger, the model's function kept
    (``models.outliers``)."""

    scale: float = 1.0  # S: 1 leaves the model as loaded
    k_channels: Any = None  # null: seeded choice | an int: every head | one per head | one list per layer
    v_channels: Any = None  # the same, for V
    seed: int = 0  # seed of the choice where the channels are not given


@dataclass
class ModelConfig:
    name: str = "gpt2"  # how runs are labelled
    preset: str = "gpt2"  # a model preset of any family (models.families.PRESETS: random weights; auto's hub checkpoint)
    weights: str = "auto"  # auto (the preset's real checkpoint if reachable, else random) | random | folder | hub id
    seed: int = 0  # seed of the random init
    build: Optional[str] = None  # the command that makes the checkpoint folder, shown when it is missing
    outliers: OutliersConfig = field(default_factory=OutliersConfig)
    # the preset with this many K/V heads (a divisor of its query heads; random weights only): MHA vs GQA vs MQA at
    # one width (experiment=gqa); null: the preset's own
    n_kv_head: Optional[int] = None


def cache_schema(cls: type[KVCache]) -> type:
    """The config node of one cache kind: ``kind`` plus the kind's options, typed and defaulted as the class says,
    and ``target``, which only ``cache=external`` runs: a command line's ``cache.target`` reaches every run of its
    sweep (``experiment=leaderboard`` sets each run's kind), and a kind of its own does nothing with it."""
    fields = [("kind", str, field(default=cls.kind)), ("target", Optional[str], field(default=None))]
    fields += [(name, typ, field(default=cls.option_defaults()[name])) for name, typ in cls.option_types().items()]
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields)


def cache_options(node) -> dict:
    """The kind's options from a composed cache node (everything but ``kind`` and ``target``)."""
    return {k: v for k, v in node.items() if k not in kinds.NODE_KEYS}


MODEL_FIELD = "{model}"  # in a cache option's text, the run's model name (cache.heads=models/heads/{model}.csv)


def cache_choice(node, model: str | None = None) -> CacheChoice:
    """A composed cache node as the plan's ``CacheChoice``: its kind and its options, plain; ``{model}`` in an
    option's text is the run's ``model`` name (so one sweep over several models gives each its own file: Hydra
    resolves a sweep's ``${model.name}`` once, for the first model)."""
    def plain(v):
        v = _plain(v)
        return v.replace(MODEL_FIELD, model) if model is not None and isinstance(v, str) else v
    if node.kind == external.EXTERNAL:  # the class cache.target names: its own kind and options
        return external.choice(node, plain)
    why = None if kinds.known(node.kind) else kinds.why_not_loaded(node.kind)
    if why:  # an installed package's kind that did not load: why, not "unknown kind"
        raise ConfigError(f"cache={node.kind}: {why}")
    return CacheChoice(kind=node.kind, options={k: plain(v) for k, v in cache_options(node).items()},
                       target=kinds.target_of(node.kind))


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
    name: str = "kvlab"  # kvlab (our models and caches) | hf (transformers, same weights) | llamacpp (llama.cpp, GGUF)


def engine_schema(name: str, cls) -> type:
    """The config node of one engine: ``name`` plus the engine's typed ``Options`` (``schema/engine/<name>``, which
    ``conf/engine/<name>.yaml`` extends)."""
    fields = [("name", str, field(default=name))]
    fields += [(f.name, f.type, field(default=f.default)) for f in dataclasses.fields(cls.Options)]
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields)


@dataclass
class LeaderboardConfig:
    """``leaderboard``: what ``experiment=leaderboard``'s sweeper (``harness.experiment.leaderboard``) expands into
    runs; a run itself never reads it (it is not part of a run's identity)."""

    methods: Optional[list[str]] = None  # null: every method (harness.experiment.leaderboard.METHODS)
    ratios: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 0.875])  # K/V bytes removed at `context`
    context: int = 1024  # the context length the ratios are taken at (every task's sequences are this long)


@dataclass
class BaseConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: Any = MISSING  # one of the engine group's nodes, typed by its engine's schema
    cache: Any = MISSING  # one of the cache group's nodes, typed by its kind's schema
    dtype: DtypeConfig = field(default_factory=DtypeConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    experiment: str = "quick"  # the preset's name, set by conf/experiment/*.yaml
    n_prompts: int = 4
    new_tokens: int = 32
    prompt_len: int = 32
    batch: int = 1  # sequences served together in the run's throughput / waste measurement
    prompt_lengths: str = "uniform"  # uniform (every prompt prompt_len tokens) | ragged (seeded, 1 .. prompt_len)
    max_len: Optional[int] = None  # cache capacity; default: the model's n_positions
    repeats: int = 10
    warmup: int = 3
    seed: int = 0  # prompts and timing inputs
    prompts: str = "file"  # file (real English text, tokenized) | random (seeded random ids)
    prompts_file: str = "harness/prompts.txt"  # relative to the repository root
    compile: bool = False  # torch.compile the prealloc kind's decode step (static shapes; CUDA graphs on a GPU)
    resume: bool = True  # skip a run whose folder holds a complete, ok record of the same config and inputs
    measurements: Optional[list[str]] = None  # the measurements to make (harness.measurements); None: all that apply
    leaderboard: LeaderboardConfig = field(default_factory=LeaderboardConfig)  # experiment=leaderboard's grid


def _with_options(base: type) -> type:
    """The whole config's schema: ``base`` plus every registered measurement's options, as top-level keys
    (``python run.py drift_text_len=256``), typed and defaulted as each measurement declares them."""
    import typing

    from harness.measurements import MEASUREMENTS, options

    def typed(name, f):  # the field's type itself (a node of options, such as serve, is a dataclass)
        return typing.get_type_hints(MEASUREMENTS[name].Options)[f.name]

    fields = [(f.name, typed(name, f), dataclasses.field(default=f.default, default_factory=f.default_factory))
              for name, f in options()]
    return dataclasses.make_dataclass("KvlabConfig", fields, bases=(base,))


KvlabConfig = _with_options(BaseConfig)


def dtype_label(storage: str, compute: str) -> str:
    """How runs are labelled: the storage dtype ("fp16"), or "storage/compute" when compute is set explicitly to
    something else than auto ("fp16/fp16"); fp32 with fp32 compute is "fp32"."""
    if compute == "auto" or compute == storage == "fp32":
        return storage
    return f"{storage}/{compute}"


NOT_MEASURED = ("tracking", "resume", "hydra", "leaderboard")  # config keys that do not change what a run measures
UNORDERED = ("measurements", "context_lengths")  # lists whose order does not change what a run measures


def _in_order(key: str, value):
    """A list whose order a run does not depend on, in the one order it is measured in: the measurements in the
    registry's order (names it does not know after them, sorted), each once; the timed contexts ascending."""
    if not isinstance(value, list):
        return value
    if key == "measurements":
        from harness.measurements import MEASUREMENTS

        rank = {name: i for i, name in enumerate(MEASUREMENTS)}
        return sorted(set(map(str, value)), key=lambda n: (rank.get(n, len(rank)), n))
    try:
        return sorted(value)
    except TypeError:  # values of mixed types: the run refuses them; any fixed order will do
        return sorted(value, key=str)


# keys added after runs were recorded, with the value that measures what runs without them measured: a run at that
# value keeps the id it had before the key existed (a resumed sweep confirms it instead of measuring it again)
LATER_KEYS = {("model", "n_kv_head"): None, ("cache", "group_score"): "mean", ("cache", "positions"): "absolute",
              ("cache", "k_pre_rope"): False, ("engine", "rotate"): "auto", ("cache", "allocation"): "uniform",
              ("cache", "beta"): 20.0, ("cache", "floor"): 0.2}


def later_nodes() -> dict:
    """Top-level options added after runs were recorded, at their defaults (what runs without them measured): each
    measurement's ``later`` (the server's ``serve``, off while serve.requests is 0)."""
    from harness import measurements

    out = {}
    for cls in measurements.MEASUREMENTS.values():
        defaults = measurements.options_of(cls, {})
        for name in cls.later:
            value = getattr(defaults, name)
            out[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def config_id(cfg) -> str:
    """12 hex digits that name what a run measures: a hash of its resolved config without tracking and resume (and
    without ``measurements`` when it is null, all of them, without ``model.outliers`` at scale 1, the model as
    loaded, and without the ``LATER_KEYS`` at their old meaning, so runs made before these keys existed keep their
    id; the cache node as ``harness.experiment.external.identity`` gives it: what ran). The lists in ``UNORDERED``
    are hashed in the order they are measured in, so their order on the command line does not change a run's id (a
    list already in that order keeps the id it had)."""
    keys = [k for k in cfg.keys() if k not in NOT_MEASURED and not (k == "measurements" and cfg[k] is None)]
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
             for k in keys}
    plain = {k: _in_order(k, v) if k in UNORDERED else v for k, v in plain.items()}
    if isinstance(plain.get("cache"), dict):  # what ran: cache=external's class, or a kind of its own
        plain["cache"] = external.identity(plain["cache"])
    model = plain.get("model")
    if isinstance(model, dict) and isinstance(model.get("outliers"), dict) and model["outliers"].get("scale") == 1:
        plain["model"] = {k: v for k, v in model.items() if k != "outliers"}
    for name, default in later_nodes().items():  # a node of options added later, all at its defaults
        if plain.get(name) == default:
            del plain[name]
    for (group, key), default in LATER_KEYS.items():  # at the value that means "as before": left out of the hash
        node = plain.get(group)
        if isinstance(node, dict) and key in node and node[key] == default and type(node[key]) is type(default):
            plain[group] = {k: v for k, v in node.items() if k != key}
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _plain(v):
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def read(cfg) -> RunConfig:
    """The run's config, read from Hydra once into plain values (``harness.experiment.plan.RunConfig``): the one
    door between the composed DictConfig and the run. Nothing is checked here (``validate`` checks what this
    returns), so a refused config's record still says what it asked for; ``config_id`` is hashed from ``cfg``
    itself, as composed."""
    from harness.measurements import options

    m, engine, tracking, dtype = cfg.model, cfg.get("engine", {}), cfg.tracking, cfg.dtype
    given, cache = cfg.get("measurements"), cache_choice(cfg.cache, m.name)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if cfg.cache.kind == external.EXTERNAL:  # W&B's config says what ran: the class's kind, target and options
        resolved["cache"] = external.as_node(cache)
    return RunConfig(
        model=ModelChoice(name=m.name, preset=m.preset, weights=m.weights, seed=m.seed, build=m.get("build"),
                          outliers=outliers_choice(m.get("outliers")), n_kv_head=m.get("n_kv_head")),
        engine=EngineChoice(name=str(engine.get("name", "kvlab")),
                            options={k: _plain(v) for k, v in engine.items() if k != "name"}),
        cache=cache,
        dtype=DtypeChoice(name=dtype.get("name"), storage=dtype.storage, compute=dtype.compute),
        device=cfg.device.name,
        tracking=TrackingChoice(mode=tracking.mode, project=tracking.get("project"), entity=tracking.get("entity"),
                                group=tracking.get("group")),
        experiment=cfg.experiment, n_prompts=cfg.n_prompts, new_tokens=cfg.new_tokens, prompt_len=cfg.prompt_len,
        batch=cfg.get("batch", 1), prompt_lengths=cfg.get("prompt_lengths", "uniform"), max_len=cfg.max_len,
        repeats=cfg.repeats, warmup=cfg.warmup, seed=cfg.seed, prompts=cfg.prompts, prompts_file=cfg.prompts_file,
        compile=bool(cfg.get("compile", False)), resume=bool(cfg.get("resume", True)),
        measurements=None if given is None else tuple(_plain(given)),
        options={f.name: _plain(cfg[f.name]) for _, f in options() if f.name in cfg},
        config_id=config_id(cfg), resolved=resolved)


def _frozen(v):
    """A plain value with its lists as tuples (a frozen choice holds no list)."""
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def outliers_choice(node) -> OutliersChoice:
    """A composed ``model.outliers`` node as the plan's ``OutliersChoice`` (absent: scale 1, the model as loaded)."""
    if node is None:
        return OutliersChoice()
    return OutliersChoice(scale=node.get("scale", 1.0), k_channels=_frozen(_plain(node.get("k_channels"))),
                          v_channels=_frozen(_plain(node.get("v_channels"))), seed=node.get("seed", 0))


def check_outliers(choice: OutliersChoice, mcfg) -> dict:
    """``model.outliers`` against the model (``mcfg``, its family's config): the channels it would inject
    (``models.outliers.choose``), or ``ConfigError`` in one line naming the key."""
    try:
        return outliers.choose(mcfg, choice.scale, choice.k_channels, choice.v_channels, choice.seed)
    except ValueError as e:
        raise ConfigError(f"model.outliers.{e}") from None


def slug(text) -> str:
    """A config value made safe as one path component: no separators, no leading dots, nothing but [A-Za-z0-9._+-]."""
    out = re.sub(r"[^A-Za-z0-9._+-]+", "-", str(text)).strip("-.")
    return out[:80] or "x"


def _id_resolver(*, _root_) -> str:
    return config_id(_root_)


def register(argv: list[str] | None = None) -> None:
    """The schemas, and the resolvers conf/config.yaml names paths with: ``kvlab_slug`` and ``kvlab_id``. The kinds
    installed packages declare are loaded first, and the classes the command line's ``cache.target=`` values name
    (``argv``, default ``sys.argv[1:]``) type ``cache=external`` (``harness.experiment.external``); a target that
    does not load is a ``ConfigError``, one line."""
    for name, fn in (("kvlab_slug", slug), ("kvlab_id", _id_resolver)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
    kinds.load_entry_points()
    targets = external.scan(sys.argv[1:] if argv is None else list(argv))
    cs = ConfigStore.instance()
    cs.store(group="schema/cache", name=external.EXTERNAL, node=external.schema(targets))
    cs.store(name="kvlab_schema", node=KvlabConfig)
    for name, cls in CACHE_KINDS.items():
        cs.store(group="schema/cache", name=name, node=cache_schema(cls))
        if not (CONF / "cache" / f"{name}.yaml").is_file():  # a kind without its own file: cache=<kind> still
            cs.store(group="cache", name=name, node=cache_schema(cls))  # composes, at the kind's defaults
    for name, cls in ENGINES.items():
        cs.store(group="schema/engine", name=name, node=engine_schema(name, cls))
    from harness.experiment.leaderboard import register_sweeper

    register_sweeper()  # experiment=leaderboard's sweeper


CONF = Path(__file__).resolve().parents[2] / "conf"  # run.py's config folder
AUTO_CONTEXTS = (32, 128, 512)
PROMPT_LENGTHS = ("uniform", "ragged")
ENGINE_NAMES = tuple(ENGINES)
# caps on counts (MAX_PROMPTS, MAX_REPEATS, MAX_WARMUP, MAX_LIST) live beside the measurements that read them
# (harness.measurements.base); the sizes that scale memory (batch, batch_sizes, a paged pool) are bounded by the memory check


def need(ok: bool, msg: str) -> None:
    """Refuse a config: ``ConfigError`` with ``msg``, one line, unless ``ok``."""
    if not ok:
        raise ConfigError(msg)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_options(rc: RunConfig):
    """The run's engine options, as its engine's typed ``Options``; None for an engine kvlab does not know (refused
    by the checks, and recorded as given)."""
    if rc.engine.name not in ENGINES:
        return None
    cls = ENGINES[rc.engine.name].Options
    return cls(**{f.name: rc.engine.options[f.name] for f in dataclasses.fields(cls) if f.name in rc.engine.options})


def check_model(rc: RunConfig, mcfg) -> None:
    """What the cache kind's options need of the model's family, once its config is known (``needs_rotary``: keys
    stored before a rotation the model must have; compile=true's fused decode attention off the CPU: a K/V head per
    query head; what the engine needs of the model), refused in one line naming the option."""
    opts = _kind_and_engine(rc)
    why = ENGINES[rc.engine.name].refuses_options(engine_options(rc), rc.dtype.storage, mcfg, rc.cache.kind)
    need(not why, f"engine={rc.engine.name} on model {rc.model.name}: {why}")
    cls = cache_kind(rc.cache.kind)
    why = ENGINES[rc.engine.name].refuses(rc.cache.kind, opts, mcfg.head_dim, mcfg.rotary)
    need(not why, f"engine={rc.engine.name} cache={rc.cache.kind}: {why}")  # as validate says it, the model known
    try:  # what the engine stores for the kind, given once (llama.cpp: its K/V types and rotation)
        ENGINES[rc.engine.name].stores(rc.cache.kind, opts, engine_options(rc), rc.dtype.storage)
    except ValueError as e:
        need(False, f"engine={rc.engine.name} cache={rc.cache.kind}: {e}")
    why = cls.needs_rotary(opts)
    need(why is None or mcfg.rotary, f"cache={rc.cache.kind} on model {rc.model.name} ({mcfg.family}): {why}")
    try:  # what the options need of the model's depth (a pyramid's bottom layer within max_len)
        cls.check_layers(opts, mcfg.n_layer, _lengths(rc, mcfg.n_positions)[0])
    except ValueError as e:
        need(False, f"cache={rc.cache.kind} on model {rc.model.name} ({mcfg.n_layer} layers): {e}")
    off_cpu = rc.device == "cuda" or (rc.device == "auto" and _cuda_available())
    need(getattr(opts, "group_score", "mean") == "mean" or mcfg.n_kv_head != mcfg.n_head,
         f"cache.group_score={getattr(opts, 'group_score', None)} has no effect on model {rc.model.name}, whose every "
         "query head has its own K/V head: leave it at mean (it combines the query heads that share one)")
    need(not (rc.compile and cls.fuses_decode and mcfg.n_kv_head != mcfg.n_head and off_cpu),
         f"compile=true's decode attention for cache={rc.cache.kind} off the CPU reads one K/V head per query head, "
         f"and model {rc.model.name} shares each of its {mcfg.n_kv_head} K/V heads among "
         f"{mcfg.n_head // mcfg.n_kv_head} query heads: use device=cpu (its kernels read a group's K/V head for each "
         "of its query heads), compile=false, or cache=prealloc")


def validate(config, n_positions: int, head_dim: int | None = None) -> tuple[int, list[int]]:
    """Check the knobs against each other and the model (``n_positions``; ``head_dim``, the model's head size, for
    the options that depend on it: None skips those); returns the effective max_len and the context lengths, in the
    order they are timed (ascending). ``config``: the run's ``RunConfig`` (a composed config is ``read`` first)."""
    rc = config if isinstance(config, RunConfig) else read(config)
    _check_choices(rc, head_dim)
    _check_sizes(rc)
    max_len, contexts = _lengths(rc, n_positions)
    _check_kind_fits(rc, max_len, head_dim)
    check_measurements(rc, max_len)
    _check_fills(rc, max_len, contexts)
    return max_len, contexts


def _kind_and_engine(rc: RunConfig):
    """The cache kind and engine named, and the kind's options, parsed (what every other check reads), refused in
    one line: the checks of the model (``check_model``, run first) and of the knobs (``validate``) alike."""
    kind = rc.cache.kind
    need(kind in CACHE_KINDS, f"cache.kind={kind!r}: use one of {', '.join(CACHE_KINDS)}")
    try:
        opts = cache_kind(kind).parse_options(**rc.cache.options)
    except ValueError as e:
        raise ConfigError(f"cache={kind}: {e}") from None
    need(rc.engine.name in ENGINE_NAMES, f"engine={rc.engine.name!r}: use one of {', '.join(ENGINE_NAMES)}")
    return opts


def _check_choices(rc: RunConfig, head_dim: int | None = None) -> None:
    """The group choices and names: cache kind and options, engine, dtypes, device, tracking, prompts, seeds."""
    kind, engine = rc.cache.kind, rc.engine.name
    opts = _kind_and_engine(rc)
    need(rc.dtype.storage in DTYPE_NAMES, f"dtype.storage={rc.dtype.storage!r}: use one of {DTYPE_NAMES}")
    need(rc.dtype.compute in DTYPE_NAMES + ("auto",),
         f"dtype.compute={rc.dtype.compute!r}: use auto or one of {DTYPE_NAMES}")
    need(rc.device in ("cpu", "cuda", "auto"), f"device={rc.device!r}: use cpu, cuda or auto")
    engine_cls = ENGINES[engine]
    why = engine_cls.refuses(kind, opts, head_dim)
    need(not why, f"engine={engine} cache={kind}: {why}")
    why = engine_cls.refuses_options(engine_options(rc), rc.dtype.storage, kind=kind)
    need(not why, f"engine={engine}: {why}")
    need(rc.tracking.mode in ("offline", "online", "disabled"),
         f"tracking.mode={rc.tracking.mode!r}: use offline, online or disabled")
    need(rc.prompts in ("file", "random"), f"prompts={rc.prompts!r}: use file or random")
    for name, value in (("seed", rc.seed), ("model.seed", rc.model.seed)):
        need(0 <= value < 2 ** 63, f"{name}={value}: use an integer 0 <= seed < 2**63")
    asked = rc.model.outliers
    for check, value in ((outliers.check_scale, asked.scale), (outliers.check_seed, asked.seed)):
        try:  # the channels need the model: plan_run checks them (check_outliers)
            check(value)
        except ValueError as e:
            raise ConfigError(f"model.outliers.{e}") from None
    need(str(rc.model.name).strip() != "", "model.name is empty: give the runs a label, e.g. model.name=my-ckpt")
    for name in ("project", "entity", "group"):
        value = getattr(rc.tracking, name)
        need(value is None or (0 < len(str(value)) <= 128 and not set(str(value)) & set("/\\#?%:")),
             f"tracking.{name}={value!r}: W&B names are 1-128 characters without / \\ # ? % :")


def _check_sizes(rc: RunConfig) -> None:
    """Counts and what the engine and kind must support for them: ragged prompts, a compiled step."""
    engine = rc.engine.name
    engine_cls = ENGINES[engine]
    for name in ("n_prompts", "new_tokens", "prompt_len", "repeats"):
        need(getattr(rc, name) >= 1, f"{name}={getattr(rc, name)} must be at least 1")
    need(rc.warmup >= 0, f"warmup={rc.warmup} must be 0 or more")
    for name, cap, low, what in (("n_prompts", MAX_PROMPTS, 1, "prompts per run"),
                                 ("repeats", MAX_REPEATS, 1, "timed repeats per step"),
                                 ("warmup", MAX_WARMUP, 0, "warm-up steps")):
        value = getattr(rc, name)
        need(value <= cap, f"{name}={value} is over kvlab's cap of {cap:,} {what}: give {low} .. {cap:,}")
    need(isinstance(rc.batch, int) and rc.batch >= 1,
         f"batch={rc.batch!r} must be an integer >= 1 (sequences served together)")
    lengths = rc.prompt_lengths
    need(lengths in PROMPT_LENGTHS, f"prompt_lengths={lengths!r}: use one of {', '.join(PROMPT_LENGTHS)}")
    if lengths == "ragged" and rc.cache.kind in CACHE_KINDS:
        cls = CACHE_KINDS[rc.cache.kind]
        try:
            why = cls.refuses_padding(cls.parse_options(**rc.cache.options))
        except ValueError:  # bad options: refused where they are checked
            why = cls.why_no_padding
        need(not why, f"prompt_lengths=ragged: cache kind {rc.cache.kind!r} does not run ragged batches ({why})")
        why = engine_cls.refuses_ragged()
        need(not why, f"prompt_lengths=ragged: engine={engine} {why}")
    if rc.compile:
        why = engine_cls.refuses_compile(rc.cache.kind)
        need(not why, str(why))
        if rc.cache.kind in CACHE_KINDS:
            cls = CACHE_KINDS[rc.cache.kind]
            try:
                why = cls.refuses_fused(cls.parse_options(**rc.cache.options))
            except (TypeError, ValueError):
                why = None  # options the kind refuses are refused, in their own words, by the options' check
            need(not why, str(why))
    compute = rc.dtype.compute
    if compute == "auto" and rc.device in ("cpu", "cuda"):  # auto: fp32 on a CPU, the storage dtype on CUDA
        compute = "fp32" if rc.device == "cpu" else rc.dtype.storage
    if compute != "auto":
        why = engine_cls.refuses_storage(rc.dtype.storage, compute)
        need(not why, f"engine={engine}: {why}")


def _lengths(rc: RunConfig, n_positions: int) -> tuple[int, list[int]]:
    """The effective max_len and timed context lengths, checked against the model and each other."""
    max_len = n_positions if rc.max_len is None else rc.max_len
    streams = cache_kind(rc.cache.kind).streams(cache_kind(rc.cache.kind).parse_options(**rc.cache.options))
    need(max_len <= n_positions or streams, f"max_len={max_len} > n_positions={n_positions} of model "
         f"{rc.model.name}: use max_len <= {n_positions} (only a cache that re-positions its keys, cache=window "
         "cache.positions=cache on a rotary model, runs past the positions a model was trained for)")
    need(rc.prompt_len + rc.new_tokens <= max_len,
         f"prompt_len + new_tokens = {rc.prompt_len} + {rc.new_tokens} > max_len={max_len}: "
         f"shorten them or raise max_len (at most {n_positions})")
    contexts = (list(rc.context_lengths) if rc.context_lengths is not None
                else [c for c in AUTO_CONTEXTS if c < max_len] or [max_len // 2])
    need(len(contexts) > 0, "context_lengths is empty: give at least one, e.g. [32,128]")
    need(len(contexts) <= MAX_LIST, f"context_lengths has {len(contexts):,} lengths, over kvlab's cap of {MAX_LIST} "
         f"per run: give at most {MAX_LIST}")
    need(len(set(contexts)) == len(contexts), f"context_lengths {contexts} repeats a length: give each once")
    for ctx in contexts:
        need(1 <= ctx < max_len, f"context_lengths has {ctx}: a timed step at context c needs 1 <= c < max_len="
             f"{max_len}")
    return max_len, sorted(contexts)  # timed in one order, whatever order they were given in (config_id too)


def _check_kind_fits(rc: RunConfig, max_len: int, head_dim: int | None = None) -> None:
    """What the kind's options need of the lengths and the model: options that fit max_len and have an effect at it
    (a budget below it, a window that slides, something quantised), that the head size can honour, and prompts as
    long as a SnapKV window."""
    kind = rc.cache.kind
    cls = cache_kind(kind)
    opts = cls.parse_options(**rc.cache.options)
    try:
        cls.check_max_len(opts, max_len)
        if head_dim is not None:
            cls.check_head_dim(opts, head_dim)
    except ValueError as e:
        raise ConfigError(f"cache={kind}: {e}") from None
    shortest = cls.min_prompt(opts)
    need(rc.prompt_len >= shortest, f"cache={kind}: prompt_len={rc.prompt_len} is shorter than the "
         f"{shortest} prompt tokens this kind needs (its window); raise prompt_len or lower cache.window")
    need(shortest == 1 or rc.prompt_lengths != "ragged",
         f"cache={kind}: prompt_lengths=ragged draws prompts of 1 .. prompt_len tokens, shorter than the "
         f"{shortest} this kind needs (its window); use prompt_lengths=uniform or cache.window=1")


def check_measurements(rc: RunConfig, max_len: int) -> None:
    """The ``measurements`` key names registered measurements, and each chosen one accepts its options."""
    from harness import measurements

    try:
        names = measurements.chosen(rc.measurements)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name in names:
        cls = measurements.MEASUREMENTS[name]
        cls.check(measurements.options_of(cls, rc.options), max_len)


def _check_fills(rc: RunConfig, max_len: int, contexts: list[int]) -> None:
    """The caches the run's measurements build (``harness.experiment.memory.cache_fills``) against what the kind's options can
    hold: a paged pool of ``cache.blocks`` blocks must hold the largest, before any of them is built."""
    from harness import measurements
    from harness.experiment import memory

    kind = rc.cache.kind
    cls = cache_kind(kind)
    opts = cls.parse_options(**rc.cache.options)
    fills = memory.cache_fills(
        kind=kind, options=dict(rc.cache.options), max_len=max_len, prompt_len=rc.prompt_len,
        new_tokens=rc.new_tokens, batch=rc.batch, storage=rc.dtype.storage, compute=rc.dtype.compute,
        compile=rc.compile, engine=rc.engine.name, measurements=measurements.chosen(rc.measurements),
        **{**dict(rc.options), "context_lengths": contexts})
    try:
        cls.check_fills(opts, fills)
    except ValueError as e:
        raise ConfigError(f"cache={kind}: {e}") from None

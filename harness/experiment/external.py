"""``cache=external cache.target=package.module:ClassName``: a cache kind from outside kvlab, typed and run as a
built-in kind is.

Hydra types every config node before the run starts, so the classes are loaded first: ``config.register()`` hands
the command line to ``scan``, which loads each ``cache.target=`` value (a comma sweep or ``choice(...)`` may name
several: ``harness.core.kinds.load``) and types ``schema/cache/external`` (conf/cache/external.yaml) with ``kind``,
``target`` and the union of their options, each optional: null is "the class's own default". So ``cache.budget=64``
is checked as the class types it, and ``-m cache.budget=64,128`` sweeps it. ``choice`` then turns the composed node
into the class's own kind and options (the class's defaults filled in, an option it does not have refused), so the
record, its label, its ``cache_<option>`` keys and the run's identity describe what ran, and ``cache_target``
names the class. A process that did not scan the command line (a launcher's worker) loads the target there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from omegaconf import MISSING, OmegaConf

from harness.common.errors import ConfigError
from harness.core import kinds
from harness.experiment.plan import CacheChoice

EXTERNAL = kinds.EXTERNAL
NO_TARGET = (f"cache={EXTERNAL} needs cache.target={kinds.SHAPE.split(' ')[0]}: the class of your kind "
             "(a models.kv_cache.KVCache subclass in a module on PYTHONPATH)")


def _values(arg: str) -> tuple[str, list]:
    """An override's key and its value(s), as Hydra parses them (a sweep: each value); ("", []) for anything that
    does not parse (Hydra then says why)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        o = OverridesParser.create().parse_overrides([arg])[0]
    except Exception:  # not an override Hydra takes: its own error names it
        return "", []
    values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
    return o.get_key_element().lstrip("+~"), values


def scan(argv: list[str]) -> list[type]:
    """The classes the command line's ``cache.target=`` values name, loaded and registered; ``ConfigError`` (one
    line) for a target that does not load, ``cache=external`` with no target, a target where nothing runs
    ``cache=external`` (the command line picks its kinds, or leaves both kind and experiment at their defaults),
    or ``cache=<kind>`` of an installed package whose kind did not load."""
    given: dict[str, list[str]] = {"cache": [], "cache.target": [], "experiment": []}
    for arg in argv:
        if arg.lstrip("+~").split("=", 1)[0] in given:
            key, values = _values(arg)
            given.get(key, []).extend(str(v) for v in values)
    caches, targets = given["cache"], given["cache.target"]
    for name in caches:
        why = kinds.why_not_loaded(name)
        if why:
            raise ConfigError(f"cache={name}: {why}")
    if EXTERNAL in caches and not targets:
        raise ConfigError(NO_TARGET)
    if targets and EXTERNAL not in caches and (caches or not given["experiment"]):
        runs = f"cache={','.join(caches)}" if caches else "the default kind"
        raise ConfigError(f"cache.target={targets[0]} names the class cache={EXTERNAL} runs, and this command runs "
                          f"{runs}: add cache={EXTERNAL} (in a sweep: cache={EXTERNAL},...)")
    return [load(t) for t in dict.fromkeys(targets)]


def load(target: str) -> type:
    """``harness.core.kinds.load``, its refusal naming the key: ``cache.target=...: why``."""
    try:
        return kinds.load(target)
    except ConfigError as e:
        raise ConfigError(f"cache.target={e}") from None


def schema(classes: list[type]) -> type:
    """``schema/cache/external``: ``kind``, ``target`` and every option of ``classes``, typed as its class types
    it, null by default (the class's own default); an option two classes type differently is refused in one
    line."""
    typed: dict[str, tuple[type, type]] = {}
    for cls in classes:
        for name, typ in cls.option_types().items():
            if name in typed and typed[name][0] is not typ:
                other = typed[name][1]
                raise ConfigError(f"cache.{name} is {typed[name][0].__name__} in {kinds.target_of(other.kind)} but "
                                  f"{typ.__name__} in {kinds.target_of(cls.kind)}: sweep targets that type a shared "
                                  "option alike, or run them one at a time")
            typed.setdefault(name, (typ, cls))
    fields = [("kind", str, field(default=EXTERNAL)), ("target", str, field(default=MISSING))]
    fields += [(name, Optional[typ], field(default=None)) for name, (typ, _) in typed.items()]
    return dataclasses.make_dataclass("ExternalKVCacheConfig", fields)


def choice(node, plain) -> CacheChoice:
    """The composed ``cache`` node of ``cache=external`` as the class's own kind and options (``plain`` turns a
    node's value into a plain one): the class's defaults where the node holds null, an option it lacks refused."""
    if OmegaConf.is_missing(node, "target") or not node.get("target"):
        raise ConfigError(NO_TARGET)
    target = str(node.target)
    cls = load(target)
    given = {k: plain(v) for k, v in node.items() if k not in kinds.NODE_KEYS and v is not None}
    types = cls.option_types()
    extra = [k for k in given if k not in types]
    if extra:
        raise ConfigError(f"cache.{extra[0]}={given[extra[0]]} is not an option of {target} (kind {cls.kind}): its "
                          f"options are {', '.join(types) or 'none'}")
    return CacheChoice(kind=cls.kind, options={**cls.option_defaults(), **given}, target=target)


def identity(node: dict) -> dict:
    """What a run's id hashes of its cache node (plain): for ``cache=external``, the class's kind, the target and
    its options as ``choice`` resolves them, so the id is one target's whatever others its sweep named (the node as
    given when it does not resolve: the run is then refused in its own words); for a kind of its own, the node less
    ``target``, which does nothing to it (so its id is the one it had before the key existed)."""
    if node.get("kind") != EXTERNAL:
        return {k: v for k, v in node.items() if k != "target"}
    try:
        return as_node(choice(OmegaConf.create(node), lambda v: v))
    except Exception:  # the run's read refuses it, in one line
        return node


def as_node(c: CacheChoice) -> dict:
    """What ran, as a cache node: the class's kind, the target and its options."""
    return {"kind": c.kind, "target": c.target, **c.options}

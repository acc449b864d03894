"""Cache kinds from outside kvlab, run like its own.

A kind is a class written against ``models.kv_cache`` (a subclass of ``KVCache``, as each module of
``models/kv_cache/`` is: ``kind``, ``Options``, ``exact``, ``update``, ``held_tokens``, ...). From outside the
repository it comes one of two ways:

- a target, ``package.module:ClassName``, the module importable from ``PYTHONPATH``: ``python run.py cache=external
  cache.target=mykinds.recent:RecentKVCache`` and ``python -m harness.conformance mykinds.recent:RecentKVCache``;
- an installed package's entry point in the group ``kvlab.cache_kinds`` (``recent = "mykinds.recent:RecentKVCache"``,
  the name its kind): ``load_entry_points`` loads them all before the config's schemas are registered, so
  ``cache=recent`` works with typed options as a built-in kind does. One that does not load is one warning line on
  stderr, and ``why_not_loaded(name)`` says why to a run that asks for it; it breaks nothing else.

``load`` checks what can be checked before anything runs (the target's form, the module, the class, that it is a
``KVCache`` with a kind of its own) and registers the class in ``models.kv_cache.CACHE_KINDS`` under its ``kind``;
every refusal is one ``ConfigError`` line saying what would be right. ``python -m harness.conformance`` checks the
rest of the contract.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

from harness.common.errors import ConfigError, one_line
from models.kv_cache import CACHE_KINDS, KVCache, register

GROUP = "kvlab.cache_kinds"  # the entry point group an installed package declares its kinds in
EXTERNAL = "external"  # cache=external: the kind named by cache.target (reserved: no class may take the name)
NODE_KEYS = ("kind", "target")  # a cache config node's own keys: no option may take their names
TARGETS: dict[str, str] = {}  # kind -> the target its class was loaded from (kinds from outside kvlab only)
BROKEN: dict[str, str] = {}  # entry point name -> why it did not load
_SCANNED: list[bool] = []  # the entry points were read (once a process)
TARGET_FORM = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
KIND_NAME = re.compile(r"[a-z][a-z0-9_]*")
SHAPE = "package.module:ClassName (the module importable from PYTHONPATH, a colon, the class's name)"


def resolve(target: str) -> type[KVCache]:
    """The class ``target`` names, checked (a ``KVCache`` subclass with a kind no other class has), not yet
    registered; ``ConfigError`` in one line, starting with the target, otherwise."""
    if not isinstance(target, str) or not TARGET_FORM.fullmatch(target):
        raise ConfigError(f"{target!r} is not {SHAPE}")
    module_name, name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"{target}: no module {e.name!r} on the path: put the folder that holds it on "
                              "PYTHONPATH (PYTHONPATH=/path/to/that/folder)") from None
        raise ConfigError(f"{target}: importing {module_name} failed: {one_line(e)}") from None
    except Exception as e:  # the module's own code raised: its line says why
        raise ConfigError(f"{target}: importing {module_name} failed: {one_line(e)}") from None
    cls = getattr(module, name, None)
    if cls is None:
        raise ConfigError(f"{target}: module {module_name} ({getattr(module, '__file__', '?')}) has no {name!r}: "
                          "name a class it defines")
    if not (isinstance(cls, type) and issubclass(cls, KVCache)):
        raise ConfigError(f"{target}: {name} is not a subclass of models.kv_cache.KVCache: a cache kind subclasses "
                          "it (or one of its kinds, e.g. models.kv_cache.evict.EvictingKVCache)")
    _check_kind(target, cls)
    return cls


def _check_kind(target: str, cls: type[KVCache]) -> None:
    kind = cls.kind
    if not isinstance(kind, str) or not KIND_NAME.fullmatch(kind) or kind == EXTERNAL:
        raise ConfigError(f"{target}: its kind {kind!r} is not a name a run can take: set kind = 'mykind' (lowercase "
                          f"letters, digits and _, not {EXTERNAL!r})")
    try:  # what typing the config needs of its options (the conformance checks go further)
        types, defaults = cls.option_types(), cls.option_defaults()
    except Exception as e:  # the class's own code: its line says why
        raise ConfigError(f"{target}: its Options cannot be read as a dataclass of typed fields with defaults: "
                          f"{one_line(e)}") from None
    bad = [name for name, typ in types.items() if typ not in (int, float, bool, str) or name not in defaults]
    if bad:
        raise ConfigError(f"{target}: its option {bad[0]!r} is not typed int, float, bool or str with a default "
                          "(what a config file can hold)")
    taken = [name for name in types if name in NODE_KEYS]
    if taken:
        raise ConfigError(f"{target}: its option {taken[0]!r} has the name of a cache config node's own key "
                          f"({', '.join(NODE_KEYS)}): rename the option")
    have = CACHE_KINDS.get(kind)
    if have is not None and have is not cls:
        whose = (f"kvlab's built-in kind ({have.__module__}.{have.__name__})" if builtin(have)
                 else f"the kind of {TARGETS.get(kind) or have.__module__ + ':' + have.__name__}")
        raise ConfigError(f"{target}: its kind {kind!r} is already {whose}: give the class a kind of its own")


def builtin(cls: type) -> bool:
    """Whether ``cls`` is one of kvlab's own kinds (a module of models/kv_cache/)."""
    return cls.__module__.startswith("models.kv_cache.")


def load(target: str) -> type[KVCache]:
    """The class ``target`` names, checked (``resolve``) and registered under its kind (once: loading it again
    gives the same class)."""
    cls = resolve(target)
    if CACHE_KINDS.get(cls.kind) is not cls:
        register(cls)
    if not builtin(cls):
        TARGETS[cls.kind] = target
    return cls


def target_of(kind: str) -> str | None:
    """The target the kind was loaded from; None for kvlab's own kinds (and kinds registered in process)."""
    return TARGETS.get(kind)


def source_file(kind: str) -> Path | None:
    """The file of a kind loaded from outside kvlab (a run's inputs hash it: an edited kind is measured again)."""
    if kind not in TARGETS or kind not in CACHE_KINDS:
        return None
    path = getattr(sys.modules.get(CACHE_KINDS[kind].__module__), "__file__", None)
    return Path(path) if path and Path(path).is_file() else None


def load_entry_points() -> dict[str, str]:
    """Load every kind installed packages declare in the ``kvlab.cache_kinds`` entry point group (once a process;
    each ``name = "package.module:ClassName"``, the name the class's kind). One that does not load is one warning
    line on stderr naming it, and kept in ``BROKEN`` (name -> why). Returns ``BROKEN``."""
    if _SCANNED:
        return BROKEN
    _SCANNED.append(True)
    for ep in importlib.metadata.entry_points(group=GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
        try:
            cls = resolve(ep.value)
            if cls.kind != ep.name:
                raise ConfigError(f"{ep.value}: its kind is {cls.kind!r}, not its entry point's name {ep.name!r}: "
                                  f"declare it as {cls.kind} = \"{ep.value}\"")
            load(ep.value)
        except ConfigError as e:
            BROKEN[ep.name] = f"{dist}'s {GROUP} entry point {ep.name} = \"{ep.value}\" did not load: {e}"
            print(f"kvlab: warning: {BROKEN[ep.name]} (cache={ep.name} is refused; every other kind runs)",
                  file=sys.stderr, flush=True)
    return BROKEN


def why_not_loaded(kind: str) -> str | None:
    """Why ``cache=<kind>`` cannot run where an installed package declared it but it did not load (None: it did, or
    no package declares it)."""
    return BROKEN.get(kind)


def known(kind: str) -> bool:
    """Whether ``kind`` is registered, the installed packages' kinds loaded first if it is not yet."""
    if kind not in CACHE_KINDS:
        load_entry_points()
    return kind in CACHE_KINDS

"""``experiment=leaderboard``: every compression method at every compression ratio, as one sweep of ordinary runs.

A ratio is the fraction of the context's K/V bytes a method removes at ``leaderboard.context`` tokens (the convention
of kvpress's leaderboard: 0.25 keeps three quarters, 0.875 an eighth). What that means for each method, at a context
of L tokens (``cells`` prints it):

- a kind that keeps ``budget`` slots per sequence, layer and head (h2o, tova, snapkv, knorm, random, window, an
  external kind with a ``budget`` option): budget = round((1 - ratio) * L); H2O's half of it recent (its paper's
  split); snapkv also with its budget spent per layer (``snapkv-pyramid``, PyramidKV) and per head (``snapkv-ada``,
  Ada-KV) at the same total;
- duo: sinks 16 + recent 64 in a streaming head, and the share of K/V heads kept whole (ranked by the model's own
  heads file, ``models/heads/{model}.csv``) that holds (1 - ratio) of the bytes: s = (1 - ratio - a) / (1 - a),
  a = 80 / L, rounded to whole heads by the kind;
- quant at 8, 4 and 2 bits (KIVI's axes, group 32): its bits fix its ratio (about 0.71, 0.83 and 0.89 of fp32's
  bytes removed, scales counted); it runs once, in the column of the asked ratio nearest its own, and only when one
  lies within ``QUANT_REACH`` of it.

Each cell is a run like any other (its kind and options recorded as given); the sweeper only writes the list of runs.
``leaderboard.methods`` and ``leaderboard.ratios`` narrow the grid; every other override on the command line (a
model, a measurement's knob, ``cache.target`` for an external kind) reaches every run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from harness.common.errors import ConfigError

CONTEXT = 1024  # leaderboard.context's default: the reference models' n_positions
MIN_CONTEXT = 16
RATIOS = (0.25, 0.5, 0.75, 0.875)
BUDGET_KINDS = ("h2o", "tova", "snapkv", "knorm", "random")  # evicting kinds spending `budget` slots per head
ALLOCATIONS = ("pyramid", "ada")  # budget spent per layer (PyramidKV) or per head (Ada-KV): methods <kind>-<allocation>
QUANT_BITS = (8, 4, 2)
QUANT_REACH = 0.1  # a quant method runs only where an asked ratio lies this close to its own
WINDOW_SINKS = 4  # StreamingLLM's four attention sinks
DUO_SINKS, DUO_RECENT = 16, 64  # DuoAttention's streaming heads ("16 sink tokens and 64 recent tokens")
DUO_HEADS = "models/heads/{model}.csv"
METHODS = ("h2o", "tova", "snapkv", "snapkv-pyramid", "snapkv-ada", "knorm", "random", "window", "duo", "quant8",
           "quant4", "quant2")  # leaderboard.methods=null: all of these; "external" and "<kind>-<allocation>" on ask


@dataclass(frozen=True)
class Cell:
    """One run of the leaderboard: a method at a ratio, as the overrides that make it."""

    method: str
    ratio: float  # the asked ratio it stands in (a quant method's own lies near it)
    overrides: tuple[str, ...]


def quant_ratio(bits: int, context: int = CONTEXT) -> float:
    """The fraction of fp32's K/V bytes quant at ``bits`` (kvlab's defaults otherwise) removes at ``context`` tokens,
    from the kind's own byte formula on a head of 64 channels (scales, minimums and the filling group counted; the
    model's head size moves it by under 0.01)."""
    from models.kv_cache import CACHE_KINDS, kv_bytes

    cls = CACHE_KINDS["quant"]
    held = cls.nbytes_formula(1, 1, 64, context, 1, "fp32", context, cls.parse_options(k_bits=bits, v_bits=bits))
    return 1 - held / kv_bytes(1, 1, 64, context, 1, "fp32")


def duo_share(ratio: float, context: int) -> float:
    """The share of K/V heads duo keeps whole so that it holds (1 - ratio) of full attention's bytes at
    ``context`` tokens: each other head holds DUO_SINKS + DUO_RECENT slots."""
    a = min(1.0, (DUO_SINKS + DUO_RECENT) / context)
    return max(0.0, min(0.99, (1 - ratio - a) / (1 - a)))


def budget(ratio: float, context: int) -> int:
    """Slots per head that keep (1 - ratio) of ``context`` tokens (at least 1)."""
    return max(1, round((1 - ratio) * context))


def method_overrides(method: str, ratio: float, context: int) -> tuple[str, ...]:
    """The overrides of one method at one ratio (a quant method's ignore the ratio)."""
    if method.startswith("quant"):
        bits = int(method[len("quant"):])
        return ("cache=quant", f"cache.k_bits={bits}", f"cache.v_bits={bits}")
    b = budget(ratio, context)
    if method == "window":
        return ("cache=window", f"cache.sinks={WINDOW_SINKS}", f"cache.budget={b}")
    if method == "duo":
        return ("cache=duo", f"cache.heads='{DUO_HEADS}'", f"cache.retrieval={duo_share(ratio, context):.4f}",
                f"cache.sinks={DUO_SINKS}", f"cache.recent={DUO_RECENT}")
    if method == "external":
        return ("cache=external", f"cache.budget={b}")
    kind, _, allocation = method.partition("-")
    out = (f"cache={kind}", f"cache.budget={b}") + ((f"cache.allocation={allocation}",) if allocation else ())
    return out + ((f"cache.recent={b // 2}",) if kind == "h2o" else ())


def check_method(method: str) -> None:
    """Refuse, in one line, a method name the leaderboard cannot run."""
    kind, _, allocation = method.partition("-")
    ok = (method in METHODS or method == "external" or method in {f"quant{b}" for b in QUANT_BITS}
          or (kind in BUDGET_KINDS and allocation in ALLOCATIONS + ("",)))
    if not ok:
        raise ConfigError(f"leaderboard.methods names {method!r}: use some of {', '.join(METHODS)}, external (with "
                          f"cache.target=package.module:ClassName), or <kind>-<allocation> for a kind of "
                          f"{', '.join(BUDGET_KINDS)} and an allocation of {', '.join(ALLOCATIONS)}")


def check_ratios(ratios) -> list[float]:
    """The asked ratios, each a number in (0, 1), each once, ascending; refused in one line otherwise."""
    out = []
    for r in ratios:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1:
            raise ConfigError(f"leaderboard.ratios holds {r!r}: each ratio is the fraction of the context's K/V bytes "
                              "removed, a number in (0, 1), e.g. leaderboard.ratios=[0.5,0.875]")
        out.append(float(r))
    if not out:
        raise ConfigError("leaderboard.ratios is empty: give at least one, e.g. leaderboard.ratios=[0.5]")
    return sorted(set(out))


def cells(methods, ratios, context: int = CONTEXT) -> list[Cell]:
    """Every run of the grid: each method at each ratio (a quant method once, at the asked ratio nearest its own,
    if one lies within QUANT_REACH), methods in the order given."""
    if isinstance(context, bool) or not isinstance(context, int) or context < MIN_CONTEXT:
        raise ConfigError(f"leaderboard.context={context!r}: give the context length the ratios are taken at, an "
                          f"integer >= {MIN_CONTEXT} (the reference models': {CONTEXT})")
    ratios = check_ratios(ratios)
    methods = list(dict.fromkeys(METHODS if methods is None else methods))
    if not methods:
        raise ConfigError(f"leaderboard.methods is empty: give some of {', '.join(METHODS)} (null: all)")
    if "duo" in methods and context < 2 * (DUO_SINKS + DUO_RECENT):
        raise ConfigError(f"leaderboard.context={context}: duo's streaming heads hold {DUO_SINKS + DUO_RECENT} slots, "
                          f"which leaves no ratio to ask below a context of {2 * (DUO_SINKS + DUO_RECENT)}: raise "
                          "max_len, or leave duo out of leaderboard.methods")
    out = []
    for m in methods:
        check_method(m)
        if m.startswith("quant"):
            own = quant_ratio(int(m[len("quant"):]), context)
            near = min(ratios, key=lambda r: abs(r - own))
            if abs(near - own) <= QUANT_REACH:
                out.append(Cell(m, near, method_overrides(m, near, context)))
            continue
        out += [Cell(m, r, method_overrides(m, r, context)) for r in ratios]
    if not out:
        own = ", ".join(f"{m} {quant_ratio(int(m[len('quant'):]), context):.2f}" for m in methods)
        raise ConfigError(f"leaderboard: no run to make: the quant methods' own ratios ({own}) lie more than "
                          f"{QUANT_REACH} from every asked ratio ({', '.join(f'{r:g}' for r in ratios)}); ask for a "
                          "ratio near them, or another method")
    return out


def table(grid: list[Cell], context: int) -> str:
    """What each cell means, one line each: printed before the sweep starts."""
    lines = [f"leaderboard: {len(grid)} runs a model; ratio = the K/V bytes removed at {context} tokens"]
    lines += [f"  {c.method:<16} ratio {c.ratio:<6g} {' '.join(o for o in c.overrides if o != 'cache=' + c.method)}"
              for c in grid]
    return "\n".join(lines)


def _sweeper_class(base: type) -> type:
    """The leaderboard's sweeper on Hydra's basic sweeper ``base``: made after Hydra has scanned its plugins (the
    scan loads its core plugins' modules again, so a class made earlier would derive from a stale ``base``)."""

    class LeaderboardSweeper(base):
        """Hydra's basic sweeper (the product of the sweep's own params and the command line's), each of its jobs
        run once per cell of the leaderboard (``cells``), the cell's cache overrides last: conf/experiment/
        leaderboard.yaml's ``hydra.sweeper._target_``."""

        grid: list[Cell] = []

        def sweep(self, arguments: list[str]):
            try:
                rest, asked = _own_arguments(arguments, self.hydra_context.config_loader)
                lb = self.config.leaderboard
                methods = asked.get("methods", None if lb.methods is None else list(lb.methods))
                context = asked.get("context", lb.context)
                self.grid = cells(methods, asked.get("ratios", list(lb.ratios)), context)
            except ConfigError as e:  # one line, exit 2, before any folder is made (Hydra would print a traceback)
                print(f"kvlab: {e}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            print(table(self.grid, context), flush=True)
            return super().sweep(rest)

        def split_arguments(self, overrides, max_batch_size):
            jobs = [combo + list(c.overrides) for combo in base.split_arguments(overrides, None)[0]
                    for c in self.grid]
            n = max_batch_size or len(jobs)
            return [jobs[i:i + n] for i in range(0, len(jobs), n)]

    LeaderboardSweeper.__module__ = PLUGIN_MODULE
    LeaderboardSweeper.__qualname__ = "LeaderboardSweeper"
    return LeaderboardSweeper


# Hydra instantiates a sweeper only from its plugins' namespace (``hydra_plugins``), by name, and only one registered:
# ``register_sweeper`` (run by harness.experiment.config.register(), before any sweep composes) makes the class
# ``hydra_plugins.kvlab.LeaderboardSweeper``, without a package of its own outside the repository's layout
PLUGIN_MODULE = "hydra_plugins.kvlab"


def register_sweeper() -> None:
    """Make the leaderboard's sweeper importable as ``hydra_plugins.kvlab.LeaderboardSweeper`` and register it with
    Hydra's plugins (``Plugins.register``: Hydra's way for a plugin that is not an installed package)."""
    import importlib
    import sys
    import types

    from hydra.core.plugins import Plugins

    plugins = Plugins.instance()  # scans Hydra's plugins first
    if PLUGIN_MODULE not in sys.modules:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        try:
            parent = importlib.import_module("hydra_plugins")  # a namespace package, where a plugin is installed
        except ImportError:
            parent = sys.modules.setdefault("hydra_plugins", types.ModuleType("hydra_plugins"))
        module = types.ModuleType(PLUGIN_MODULE, "kvlab's Hydra plugins (harness.experiment.leaderboard)")
        module.LeaderboardSweeper = _sweeper_class(BasicSweeper)
        sys.modules[PLUGIN_MODULE] = module
        parent.kvlab = module
    plugins.register(sys.modules[PLUGIN_MODULE].LeaderboardSweeper)


def composed_refusal(config) -> str | None:
    """Why a composed multirun config of experiment=leaderboard cannot sweep (a cache setting on the command line, a
    method or ratio it cannot run), in one line; None otherwise. The sweep report's start checks it, before the
    sweep's folder is made (a comma-separated ``leaderboard.<key>=`` is checked by the sweeper itself)."""
    if config.get("experiment") != "leaderboard":
        return None
    for text in config.hydra.overrides.task:
        key = str(text).split("=", 1)[0].lstrip("+~")
        if key == "cache" or (key.startswith("cache.") and key != "cache.target"):
            return f"kvlab: {text}: {_NO_CACHE}"
    lb = config.leaderboard
    try:
        cells(None if lb.methods is None else list(lb.methods), list(lb.ratios), lb.context)
    except ConfigError as e:
        return f"kvlab: {e}"
    return None


_NO_CACHE = ("experiment=leaderboard sets each run's cache from leaderboard.methods and leaderboard.ratios; leave cache "
             "settings off the command line (your own kind: leaderboard.methods=[external,...] "
             "cache.target=package.module:ClassName)")


def _own_arguments(arguments: list[str], loader) -> tuple[list[str], dict]:
    """The command line's overrides less the leaderboard's own (``leaderboard.<key>=``, a list or a comma sweep
    alike), and those as values; ``cache=`` or a cache option other than ``cache.target`` refused in one line (the
    grid sets each run's cache)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create(config_loader=loader)
    rest, own = [], {}
    for text, o in zip(arguments, parser.parse_overrides(arguments)):
        key = o.get_key_element().lstrip("+~")
        if key.startswith("leaderboard."):
            name = key[len("leaderboard."):]
            value = list(o.sweep_iterator()) if o.is_discrete_sweep() else o.value()
            if name in ("methods", "ratios") and value is not None and not isinstance(value, (list, tuple)):
                value = [value]  # leaderboard.ratios=0.5: one
            own[name] = list(value) if isinstance(value, (list, tuple)) else value
        elif key == "cache" or (key.startswith("cache.") and key != "cache.target"):
            raise ConfigError(f"{text}: {_NO_CACHE}")
        else:
            rest.append(text)
    return rest, own


"""Every measurement a run can make, one module each, and the registry the rest of kvlab derives from.

    from harness.measurements import MEASUREMENTS            # name -> Measurement class, in the order they run
    python run.py measurements=[equivalence,memory]         # only those (no steps.csv, no step_ms_* keys)
    python -m harness.measurements --keys                   # every results.json key: key, measurement, type, meaning

What a measurement declares, and how one is added, is in ``harness.measurements.base``. This module runs the chosen
ones over a ``Context`` (the engine, the cache under test, the prompts, the shared knobs) and derives from the
registry what other modules would otherwise list by hand: the run's tables and their columns, the summary lines,
the W&B history keys and panels (the report's figures are declared in ``harness.analysis.figures``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from harness.measurements.base import (MEASUREMENTS, Measurement, NoOptions, Panel, Table, conforms, hints,
                                       key, option, register, type_name)
from harness.measurements import (equivalence, generation_drift, text_drift, retrieval, recall_tasks,  # noqa: E402,F401
                                  memory, step_time, peak_memory, bandwidth, batches, compile, serving, server)

__all__ = ["MEASUREMENTS", "Context", "Measurement", "NoOptions", "Panel", "Table", "key", "option",
           "register", "measure", "chosen", "run_on", "tables", "table", "history_keys", "panels",
           "shown_keys", "labels", "summary_lines", "options", "options_of", "all_keys", "keys_text", "results_doc",
           "KEYS", "declared_names"]


@dataclass
class Context:
    """What a run's measurements share: the engine and the cache under test, its inputs and knobs, and what the
    measurements before have recorded (``record``) and written (``tables``)."""

    engine: Any
    spec: Any  # harness.core.measure.CacheSpec
    prompts: list  # (1, prompt_len) each
    new_tokens: int
    max_len: int
    device: Any  # torch.device
    option_values: dict | None = None  # the measurements' options by name, plain values (None: their defaults)
    ref32: Any = None  # the fp32 full-attention reference engine; None for a run that is its own
    texts: list | None = None  # real text, one (1, L) per prompt, for text drift
    served: list | None = None  # the served batch's prompts, 1-D each
    contexts: list = field(default_factory=lambda: [32])
    repeats: int = 10
    warmup: int = 3
    seed: int = 0
    compiled: bool = False
    progress: bool = False
    record: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)
    decode: Any = None  # token ids -> text, for the record's sample (None: GPT-2's tokenizer)
    first_token: int | None = None  # the token every sequence starts with (a model trained with it first), or None
    text_paragraphs: str | None = None  # the prompts file's paragraphs each text spans ("3-4;7"), or None
    stream: list | None = None  # token ids of running text (the server's workload draws its prompts from it)
    inputs: dict = field(default_factory=dict)  # what measurements built for themselves (``Measurement.inputs``)
    #                                             beyond the fields above, by the names they gave

    @classmethod
    def with_inputs(cls, built: dict, **values) -> "Context":
        """A Context of ``values`` and what the measurements built (``built``): a field where one has its name, the
        rest in ``inputs``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**values, **{k: v for k, v in built.items() if k in fields},
                   inputs={k: v for k, v in built.items() if k not in fields})

    def options(self, cls: type[Measurement]):
        """``cls.Options`` from the run's option values (``option_values``), defaults where unset."""
        return options_of(cls, self.option_values)


def options_of(cls: type[Measurement], values: dict | None):
    """``cls.Options`` from plain option values by name (a run's: the top-level config keys of the same names),
    each one's declared default where ``values`` has none."""
    values = values or {}
    return cls.Options(**{f.name: copy.deepcopy(values[f.name]) if f.name in values else _default(f)
                          for f in dataclasses.fields(cls.Options)})  # each its own copy, as the config gave it


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def options() -> list[tuple[str, dataclasses.Field]]:
    """(measurement, field) for every option of every registered measurement: the config keys they add."""
    return [(name, f) for name, cls in MEASUREMENTS.items() for f in dataclasses.fields(cls.Options)]


def chosen(names) -> list[str]:
    """The measurements a run makes: ``names`` (the ``measurements`` config key) in registry order, or, when it is
    null, every one but the ``optional`` (which run only when named). An unknown name: ValueError, one line listing
    the names."""
    if names is None:
        return [n for n, cls in MEASUREMENTS.items() if not cls.optional]
    names = [str(n) for n in names]
    unknown = [n for n in names if n not in MEASUREMENTS]
    if unknown or not names:
        what = f"unknown measurement {unknown[0]!r}" if unknown else "measurements is empty"
        raise ValueError(f"{what}: choose from {', '.join(MEASUREMENTS)} (e.g. measurements=[equivalence,memory])")
    return [n for n in MEASUREMENTS if n in names]


def measure(ctx: Context, names: list[str]) -> dict[str, pd.DataFrame]:
    """Run the measurements ``names`` (registry order) on ``ctx``: each one's Result goes into ``ctx.record`` as
    it ends (a run that fails late keeps what it measured; ``failed_stage`` names the one it was in), its tables
    into ``ctx.tables``. One that does not apply records why as ``<name>_skipped``. Returns the tables, each with
    every column its measurements declare. Raises on any failure."""
    rec = ctx.record
    active: list[Measurement] = []
    for cls in (MEASUREMENTS[n] for n in names):
        m = cls(ctx)
        missing = [n for n in cls.needs if n not in {a.name for a in active}]
        why = m.skip() or (f"needs {', '.join(missing)}, which did not run" if missing else None)
        if why:
            rec[f"{cls.name}_skipped"] = why
        else:
            active.append(m)
    readers = [m for m in active if m.reads_generations]
    if readers:
        generate(ctx, readers)
    for m in active:
        rec["failed_stage"] = m.stage or m.name
        out = m.run()
        result, made = out if isinstance(out, tuple) else (out, {})
        rec.update(dataclasses.asdict(result))
        for name, df in made.items():
            ctx.tables[name] = _join(ctx.tables.get(name), df, table(name)["on"])
    rec["failed_stage"] = None
    return {name: _complete(name, df) for name, df in ctx.tables.items()}


GENERATION = ("equivalence", "generation_drift", "text_drift")  # what a run learns from its generations and texts


def run_on(engine, spec, prompts: list, new_tokens: int, names=GENERATION, max_len: int | None = None,
           **kw) -> tuple[dict, dict]:
    """The measurements ``names`` on an engine and cache spec directly, outside a run (a notebook, a test):
    (record, tables). ``kw``: the rest of ``Context`` (``ref32``, ``texts``, ``contexts``, ...) and options by
    name (``full_prompts=0``)."""
    import torch

    fields = {f.name for f in dataclasses.fields(Context)}
    opts = {k: v for k, v in kw.items() if k not in fields}
    ctx = Context(engine=engine, spec=spec, prompts=prompts, new_tokens=new_tokens,
                  max_len=max_len or max(p.shape[1] for p in prompts) + new_tokens,
                  device=kw.pop("device", prompts[0].device if prompts else torch.device("cpu")), option_values=opts,
                  **{k: v for k, v in kw.items() if k in fields})
    tables_ = measure(ctx, chosen(list(names)))
    return ctx.record, tables_


def generate(ctx: Context, readers: list[Measurement]) -> None:
    """One cached greedy generation per prompt, handed to every measurement that reads them, then let go."""
    from harness.core.measure import check_finite, locate_in_generation

    bar = tqdm(ctx.prompts, desc=f"generate+check ({ctx.spec.label})", disable=not ctx.progress)
    for i, prompt in enumerate(bar):
        ctx.record["failed_stage"] = readers[0].stage or readers[0].name
        out = ctx.spec.greedy(ctx.engine, prompt, ctx.new_tokens)
        check_finite(out.logits[0], f"the cached generation of prompt {i}",
                     lambda: locate_in_generation(ctx.engine, prompt, out.tokens, ctx.spec))
        for m in readers:
            ctx.record["failed_stage"] = m.stage or m.name
            m.on_generation(i, prompt, out)


def _join(have: pd.DataFrame | None, new: pd.DataFrame, on: tuple[str, ...]) -> pd.DataFrame:
    if have is None:
        return new.reset_index(drop=True)
    return have.merge(new, on=list(on), how="left")


# ---- what the registry says about tables, W&B, keys --------------------------------------------------------------

def tables() -> dict[str, dict]:
    """name -> {"file", "on", "columns" (every contributor's, in registry order), "by" (the measurements)}."""
    out: dict[str, dict] = {}
    for cls in MEASUREMENTS.values():
        for t in cls.tables:
            d = out.setdefault(t.name, dict(file=t.file, on=t.on, columns=[], by=[], meaning=[]))
            d["columns"] += [c for c in t.columns if c not in d["columns"]]
            d["by"].append(cls.name)
            d["meaning"].append(t.meaning)
    return out


def table(name: str) -> dict:
    return tables()[name]


def _complete(name: str, df: pd.DataFrame) -> pd.DataFrame:
    """A table with every column its measurements declare (NaN for those of measurements that did not run), in
    their order; columns nobody declares keep their place after them."""
    cols = table(name)["columns"]
    df = df.copy()
    for c in cols:
        if c not in df:
            df[c] = float("nan")
    return df[cols + [c for c in df.columns if c not in cols]]


def shown_keys(where: str = "report") -> list[str]:
    """The headline keys (``key(..., shown=...)``) of every measurement, in registry order: the report's runs
    table (``where="report"``), or the W&B Report's (``"wandb"``: those shown everywhere)."""
    return [f.name for cls in MEASUREMENTS.values() for f in cls.fields()
            if f.metadata.get("shown") is True or (where == "report" and f.metadata.get("shown") == "report")]


def labels(name: str) -> dict[str, str]:
    """key -> its label for people, for the keys of measurement ``name`` that have one."""
    return {f.name: f.metadata["label"] for f in MEASUREMENTS[name].fields() if f.metadata.get("label")}


def history_keys() -> dict[str, str]:
    """Every W&B history key a run can log -> its step metric."""
    return {k: v for cls in MEASUREMENTS.values() for k, v in cls.history.items()}


def panels() -> list[tuple[str, Panel]]:
    return [(name, p) for name, cls in MEASUREMENTS.items() for p in cls.panels]


def summary_lines(record: dict, tables_: dict) -> list[str]:
    """The summary lines of every measurement the run made (its keys are in the record), in registry order."""
    lines = []
    for cls in MEASUREMENTS.values():
        if cls.keys() and all(k in record for k in cls.keys()):
            lines += cls.summary(record, tables_)
    return lines


def results_of(record: dict) -> dict[str, bool]:
    """measurement -> whether ``record`` holds its Result (it ran)."""
    return {name: bool(cls.keys()) and all(k in record for k in cls.keys()) for name, cls in MEASUREMENTS.items()}


def check_result_types(record: dict) -> list[str]:
    """Keys of ``record`` (as read back from results.json) whose value does not have its declared type."""
    bad = []
    for cls in MEASUREMENTS.values():
        types = hints(cls.Result)
        for k in cls.keys():
            if k in record and not conforms(record[k], types[k]):
                bad.append(f"{k}={record[k]!r} is not {type_name(types[k])} ({cls.name})")
    return bad


# ---- every key a run can write -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyInfo:
    key: str
    measurement: str  # "run" for identity, config, weights and fingerprint
    type: str
    meaning: str
    unit: str = ""


def all_keys(cache_options: bool = True) -> list[KeyInfo]:
    """Every results.json key: the run's own parts (``harness.measurements.record``), each cache kind's options
    (read from the engine's registry: ``cache_options=False`` leaves them out, and torch unloaded), each
    measurement's Result and its ``<name>_skipped``."""
    from harness.measurements import record

    out = []
    for part in record.PARTS:
        types = hints(part)
        out += [KeyInfo(f.name, record.PART, type_name(types[f.name]), f.metadata["meaning"], f.metadata["unit"])
                for f in dataclasses.fields(part)]
    if cache_options:
        out += [KeyInfo(k, record.PART, "per kind", f"the cache option {k.removeprefix('cache_')} (kinds: {kinds})")
                for k, kinds in sorted(record.cache_option_keys().items())]
    for name, cls in MEASUREMENTS.items():
        types = hints(cls.Result)
        out += [KeyInfo(f.name, name, type_name(types[f.name]), f.metadata["meaning"], f.metadata["unit"])
                for f in cls.fields()]
        out.append(KeyInfo(f"{name}_skipped", name, "str", f"why {name} did not apply to the run (absent when it "
                                                           "ran or was not asked for)"))
    return out


def undeclared(rec: dict) -> list[str]:
    """Keys of ``rec`` that no part of the record, cache option or measurement declares. A record of a kind from
    outside kvlab (``cache_target`` set) that this process has not loaded keeps its ``cache_<option>`` keys: they are
    accepted as that kind's options, as the report's tables and figures read them (``option_columns``), without
    importing its class."""
    from models.kv_cache import CACHE_KINDS

    known = {k.key for k in all_keys()}
    foreign = rec.get("cache_target") is not None and rec.get("cache") not in CACHE_KINDS
    return sorted(k for k in rec if k not in known and not (foreign and str(k).startswith("cache_")))


def keys_text() -> str:
    """What ``python -m harness.measurements --keys`` prints: key, measurement, type, meaning (unit), tab-separated."""
    return "\n".join(f"{k.key}\t{k.measurement}\t{k.type}\t{k.meaning}" + (f" ({k.unit})" if k.unit else "")
                     for k in all_keys())


DOC_MARKER = "Generated by `python -m harness.measurements --doc`"  # its line in every file --doc writes: the only
# kind it replaces (harness/measurements/__main__.py)


def results_doc() -> str:
    """docs/results.md: every results.json key and every run table, from the registry (``make docs``)."""
    lines = ["# What a run records", "",
             f"{DOC_MARKER} (`make docs`) from `harness.measurements.record` and the",
             "measurements' declarations; `tests/measurements/test_measurements.py` fails when this file is stale.", "",
             "## results.json", "", "| key | measurement | type | meaning | unit |", "|---|---|---|---|---|"]
    lines += [f"| `{k.key}` | {k.measurement} | {k.type.replace(' | ', ' or ')} | {k.meaning.replace('|', '/')} | "
              f"{k.unit} |"
              for k in all_keys(cache_options=False)]
    lines.append("| `cache_<option>` | run | per kind | each option of the run's cache kind, as the kind resolved it "
                 "(`cache_window`, `cache_k_bits`, ...: docs/cache-kinds.md; `python -m harness.measurements --keys` "
                 "lists them) |  |")
    lines += ["", "## Tables (one CSV per run, in its folder)", "", "| file | written by | columns | meaning |",
              "|---|---|---|---|"]
    for name, t in tables().items():
        lines.append(f"| `{t['file']}` | {', '.join(t['by'])} | {', '.join(t['columns'])} | "
                     f"{'; '.join(m for m in t['meaning'] if m)} |")
    lines += ["", "Every table also starts with the columns that say which run a row belongs to: "
              f"{', '.join(IDENTITY_COLUMNS)}.", "", "## Measurements", "", "| name | what it measures | options |",
              "|---|---|---|"]
    for name, cls in MEASUREMENTS.items():
        opts = ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls.Options)) or "—"
        lines.append(f"| `{name}` | {cls.about} | {opts} |")
    return "\n".join(lines) + "\n"


# the columns that say which run a row belongs to, first in every table a run writes and a loader reads
IDENTITY_COLUMNS = ("run_name", "group", "status", "model", "cache", "cache_label", "dtype", "device", "engine",
                    "serve_batch", "prompt_lengths", "seed", "server_rate", "server_kv_budget", "cache_full_attention")


def declared_names(cache_options: bool = True) -> frozenset[str]:
    """Every name a reader may look up: the results.json keys, the tables' columns and the identity columns
    (worked out once per state of the registry: every ``KEYS.<name>`` asks); ``cache_options=False`` leaves out the
    cache kinds' ``cache_<option>`` keys (read from the engine's registry: torch)."""
    declared = _declared(tuple(MEASUREMENTS.items()))
    return declared | _cache_option_names() if cache_options else declared


def _known(name: str) -> bool:
    """``name`` is declared; the cache kinds' ``cache_<option>`` keys (the engine's registry: torch) are read only
    for a name that could be one."""
    return name in _declared(tuple(MEASUREMENTS.items())) or (name.startswith("cache_")
                                                               and name in _cache_option_names())


@functools.lru_cache(maxsize=4)
def _declared(registry: tuple) -> frozenset[str]:
    return frozenset({k.key for k in all_keys(cache_options=False)}
                     | {c for t in tables().values() for c in t["columns"]} | set(IDENTITY_COLUMNS))


def _cache_option_names() -> frozenset[str]:
    """Every registered kind's ``cache_<option>`` keys, worked out once per state of the registry: a kind
    registered later (``cache=external``, an entry point, a test's) adds its options at once. A reader never loads a
    kind from a record (no recorded ``cache_target`` is imported: reading results runs no one's code); what it does
    with the ``cache_<option>`` keys of a kind this process does not have is ``undeclared``'s."""
    from models.kv_cache import CACHE_KINDS

    return _option_names(tuple(CACHE_KINDS.items()))


@functools.lru_cache(maxsize=4)
def _option_names(registry: tuple) -> frozenset[str]:
    from harness.measurements import record

    return frozenset(record.cache_option_keys())


# ---- KEYS: the names readers (report, plots, W&B report, loaders) look results up by ---------------------------
# ``KEYS.<name>`` is the string ``name`` when a results.json key, a run table's column or an identity column of that
# name is declared (``declared_names``), and an AttributeError naming the fix when not: a reader of a key no
# measurement declares, or no longer declares, fails where it names it instead of drawing an empty figure.

class _Keys:
    def __getattr__(self, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        if not _known(name):
            raise AttributeError(f"{name!r} is not a results.json key or table column any measurement declares: "
                                 "python -m harness.measurements --keys lists them")
        return name


KEYS = _Keys()

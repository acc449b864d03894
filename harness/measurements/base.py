"""What a measurement is: one class that declares everything kvlab needs to know about it, as a cache kind does.

    class Memory(Measurement):
        name = "memory"
        about = "cache bytes against the kind's formula"

        @dataclass(frozen=True)
        class Result:
            cache_nbytes: int = key("bytes of K/V storage the cache holds after one generation", "B")
            ...

        tables = (Table("memory", "memory.csv", on=("tokens",), columns=("tokens", "nbytes_formula", ...)),)

        def run(self):
            ...
            return self.Result(cache_nbytes=..., ...), {"memory": curve}

        @classmethod
        def summary(cls, r, tables):
            return [f"  cache bytes       {r['cache_nbytes']:,} ..."]

``Result``'s fields are exactly the results.json keys the measurement adds (each with a meaning and a unit);
``tables`` the run files it writes (several measurements may fill one table: its rows are joined on ``on``);
``panels`` its charts in the W&B Report;
``history`` the per-step series it logs to W&B; ``skip`` says why it does not apply to a run (recorded as
``<name>_skipped``, never a failure); ``check`` refuses bad options before anything runs (from the options and
max_len alone: a measurement never sees the config), ``check_plan`` what cannot run once the model is known, and
``idle`` options that would do nothing while it is left out; ``memory`` and ``fills`` declare the bytes and caches
it allocates (from a ``harness.core.sizes.Shape``: the run layer sums them and names no measurement). A measurement that reads
the run's cached generations (one per prompt, made once for all of them) says so with ``reads_generations`` and
gets each in ``on_generation``. Registering a class (``register``) is all it takes: the run, the summary, the
tables, the report, the W&B logging and ``python -m harness.measurements --keys`` find it in ``MEASUREMENTS``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

# caps on the counts a run reads or allocates by (config.validate and the measurements' checks refuse more,
# naming the cap)
MAX_PROMPTS = 10_000  # n_prompts, full_prompts
MAX_REPEATS = 10_000  # timed repeats per step
MAX_WARMUP = 1_000  # warm-up steps before them
MAX_LIST = 100  # entries of context_lengths and batch_sizes


def key(meaning: str, unit: str = "", shown: bool | str = False, label: str | None = None) -> Any:
    """A ``Result`` field: one results.json key, what it means and its unit ("" for none). ``shown``: a column of
    the report's runs table and the W&B Report's (the headline figures; ``"report"``: the report's only, for a key
    that is often null, which W&B leaves out of a run's summary); ``label``: its header where a table names it for
    people."""
    return field(metadata=dict(meaning=meaning, unit=unit, shown=shown, label=label))


def option(default: Any, meaning: str) -> Any:
    """An ``Options`` field: a top-level config key (``python run.py <name>=...``) with its default and meaning."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=dict(meaning=meaning))
    if dataclasses.is_dataclass(default):  # a node of options (``serve.rate``): each config its own copy
        return field(default_factory=lambda: dataclasses.replace(default), metadata=dict(meaning=meaning))
    return field(default=default, metadata=dict(meaning=meaning))


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass(frozen=True)
class Table:
    """A run file: ``name`` (the key in a run's tables and the report's), ``file`` (in the run's folder), the columns
    one row is identified by (``on``: how the parts several measurements write are joined) and the columns this
    measurement writes (``on`` first)."""

    name: str
    file: str
    on: tuple[str, ...]
    columns: tuple[str, ...]
    meaning: str = ""


@dataclass(frozen=True)
class Panel:
    """A chart of the W&B Report: ``kind`` line (``y`` are history keys, drawn against their step metric) or bar
    (``y`` are results.json keys); ``groupby``: names of ``harness.analysis.wandb_report.GROUP_BY``."""

    title: str
    kind: str
    y: tuple[str, ...]
    groupby: tuple[str, ...]
    caption: str
    x: str | None = None
    log_x: bool | None = None
    log_y: bool | None = None


class Measurement:
    """One measurement: subclass, declare, ``register``. An instance lives for one run (``self.ctx``, its options
    in ``self.opts``)."""

    name: ClassVar[str]
    about: ClassVar[str]  # one line: what it measures
    Options: ClassVar[type] = NoOptions
    Result: ClassVar[type]
    tables: ClassVar[tuple[Table, ...]] = ()
    panels: ClassVar[tuple[Panel, ...]] = ()
    history: ClassVar[dict[str, str]] = {}  # W&B history key -> the step metric it is logged against
    needs: ClassVar[tuple[str, ...]] = ()  # measurements whose results or tables it reads (they run first)
    reads_generations: ClassVar[bool] = False
    optional: ClassVar[bool] = False  # True: runs only when named (measurements=[...]), not in a run that names none
    stage: ClassVar[str | None] = None  # how failed_stage names it (default: its name)
    later: ClassVar[tuple[str, ...]] = ()  # its options added after runs were recorded: at their defaults they are
    #                                       left out of a run's id (runs made before them keep theirs)

    def __init__(self, ctx):
        self.ctx = ctx
        self.opts = ctx.options(type(self))

    @classmethod
    def check(cls, opts, max_len: int) -> None:
        """Refuse bad options ``opts`` (its ``Options``, from the run's config) before anything runs: raise
        ``harness.common.errors.ConfigError``, one line. ``max_len``: the run's effective cache capacity."""

    @classmethod
    def check_plan(cls, opts, s) -> None:
        """Refuse what cannot run once the model is known (``s``: the run's ``harness.core.sizes.Shape``: its
        model's config, kind, dtypes, capacity and lengths), before anything is built: raise ``ConfigError``, one
        line."""

    @classmethod
    def idle(cls, opts, asked: str) -> str | None:
        """Why ``opts`` would do nothing in a run that leaves this measurement out (a setting that asks for work
        only it does), one line naming the fix; None when they ask for none. ``asked``: the run's choice as given
        ("measurements=[equivalence,memory]")."""
        return None

    @classmethod
    def inputs(cls, opts, src, s) -> dict:
        """The inputs only it reads, built once the model is loaded, from the run's ``harness.core.inputs.Source``
        (the prompts file or random ids, the tokenizer, the first token) and ``Shape``: {``Context`` field: value}
        (drift's texts, the served batch, the server's stream); {} for none."""
        return {}

    @classmethod
    def files(cls, opts) -> list[str]:
        """Files it reads beyond the prompts file and the checkpoint (a serving trace): part of what a resumed run
        must find unchanged."""
        return []

    @classmethod
    def memory(cls, s, opts) -> list[tuple[str, int, int]]:
        """The phases of the run's peak bytes this measurement makes, from the run's ``Shape`` ``s`` and its
        options (``harness.experiment.memory.run_bytes`` adds the weights and takes the largest): (phase, bytes of
        the caches alive in it, bytes of its other tensors), each phase freed before the next measurement. Two
        measurements that share a phase give it the same name (it counts once): every one that reads the run's
        generations has theirs (``generation_phase``) unless it says otherwise."""
        return [generation_phase(s)] if cls.reads_generations else []

    @classmethod
    def fills(cls, s, opts) -> list[tuple[str, int, int]]:
        """Every cache it builds, from the run's ``Shape`` and its options: (what builds it, sequences, the most
        tokens written), for the kind's ``check_fills`` (a pool that cannot hold one is refused before a run); the
        run's generations' cache for one that reads them."""
        return [("the cached generation", 1, s.prompt_len + s.new_tokens - 1)] if cls.reads_generations else []

    def skip(self) -> str | None:
        """Why this measurement does not apply to the run (None: it does)."""
        return None

    @classmethod
    def not_equivalent(cls, r: dict, tol: float) -> list[str]:
        """Why a run of an exact kind in fp32 whose record is ``r`` is not equivalent to its reference, by this
        measurement's results (one phrase each; [] when it is, or when this measurement did not check); ``tol``:
        the largest max |dlogit| allowed."""
        return []

    def on_generation(self, i: int, prompt, out) -> None:
        """The run's cached greedy generation of prompt ``i`` (``reads_generations``)."""

    def run(self):
        """-> ``Result`` or (``Result``, {table name: DataFrame})."""
        raise NotImplementedError

    @classmethod
    def summary(cls, r: dict, tables: dict) -> list[str]:
        """Lines of the run's printed summary, from its record ``r`` and tables."""
        return []

    @classmethod
    def history_rows(cls, tables: dict) -> list[tuple[str, int, dict]]:
        """(step metric, its value, {history key: value}) for W&B, from the run's tables."""
        return []

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls.Result))

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in cls.fields()]


def generation_phase(s) -> tuple[str, int, int]:
    """The generation checks (batch 1, T = prompt_len + new_tokens, n = new_tokens), the phase of every measurement
    that reads the run's generations (made once for all): the generation's cache and the fp32 reference's; the
    teacher-forced forward's full logits (T, V) in fp32 and the logit statistics over n steps (6 (n, V) fp32
    tensors, 5 float64 ones for the KL)."""
    from harness.core.sizes import F32, F64

    T, n, V = s.prompt_len + s.new_tokens, s.new_tokens, s.model.vocab_size
    return ("generation", s.cache_at(1, T, cap=T) + s.ref_cache(T),
            s.forward(1, T, T, F32) + n * V * (6 * F32 + 5 * F64))


MEASUREMENTS: dict[str, type[Measurement]] = {}


def register(cls: type[Measurement]) -> type[Measurement]:
    """Add a measurement to ``MEASUREMENTS`` (the order of registration is the order they run in)."""
    if not getattr(cls, "name", None) or not dataclasses.is_dataclass(getattr(cls, "Result", None)):
        raise TypeError(f"{cls.__name__}: a measurement needs a name and a Result dataclass")
    clash = {f.name for f in cls.fields()} & {k for m in MEASUREMENTS.values() if m is not cls for k in m.keys()}
    if clash:
        raise TypeError(f"measurement {cls.name}: results.json keys {sorted(clash)} belong to another measurement")
    MEASUREMENTS[cls.name] = cls
    return cls


def shown(x, spec: str) -> str:
    """A value of a summary line: formatted, or "—" where the record holds null."""
    return "—" if x is None else format(x, spec)


def type_name(tp) -> str:
    """A field's type as --keys prints it: int, float, bool, str, each with "| None" where it may be null."""
    args = typing.get_args(tp)
    if args:
        return " | ".join(type_name(a) for a in args)
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def conforms(value, tp) -> bool:
    """Whether a JSON value (as read back from results.json) has the declared type."""
    args = typing.get_args(tp)
    if args:
        return any(conforms(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)

"""A run's plan: the Hydra config read once, at the door, into plain typed values, and what it resolves to.

    rc = harness.experiment.config.read(cfg)       # RunConfig: the config as given, plain values (never refused)
    plan = harness.experiment.prepare.plan_run(rc)  # Plan: rc checked and resolved (weights, model, lengths, device)

Only ``harness.experiment.config`` (composition, validation, ``read``) and the outermost function of
``harness.experiment.runner`` (Hydra's folders, ``.hydra/``, the overrides) touch the DictConfig; everything below them
gets a ``RunConfig``, a ``Plan`` or the part of one it needs: ``weights.resolve`` a ``ModelChoice``, the memory check
and the cache's record a ``CacheChoice``'s kind and options, the measurements their options by name
(``RunConfig.options``), W&B the ``TrackingChoice`` and the resolved config as a plain dict.

A refused config still has its ``RunConfig``: its record says what was asked (``config_record``), as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from harness.experiment.weights import Weights


@dataclass(frozen=True)
class OutliersChoice:
    """``model.outliers``: outlier channels put into K and V after the weights load, the model's function kept
    (``models.outliers.inject``); scale 1 leaves the model as loaded."""

    scale: float = 1.0
    k_channels: Any = None  # None: a seeded choice | an int | one per head | one tuple per layer (tuples, not lists)
    v_channels: Any = None
    seed: int = 0  # seed of the choice where the channels are not given


@dataclass(frozen=True)
class ModelChoice:
    """``model``: which model and weights (``harness.experiment.weights.resolve``), and what is done to them once
    loaded (``outliers``)."""

    name: str  # how runs are labelled
    preset: str  # a model preset of any family (models.families.PRESETS: random weights; auto's hub checkpoint)
    weights: str  # auto | random | a checkpoint folder | a hub id
    seed: int  # seed of the random init
    build: str | None = None  # the command that makes the checkpoint folder, shown when it is missing
    outliers: OutliersChoice = OutliersChoice()
    n_kv_head: int | None = None  # the preset with this many K/V heads (random weights); None: its own


@dataclass(frozen=True)
class EngineChoice:
    """``engine``: whose model and caches run (``harness.core.engines.ENGINES``) and its options."""

    name: str
    options: dict  # the engine's options, plain (everything but name)


@dataclass(frozen=True)
class CacheChoice:
    """``cache``: the kind under test and its options as given (everything but ``kind``), plain; ``target``: the
    class's ``package.module:ClassName`` for a kind from outside kvlab (``cache=external``, an entry point)."""

    kind: str
    options: dict
    target: str | None = None


@dataclass(frozen=True)
class DtypeChoice:
    """``dtype``: the cache's storage dtype and the model's compute dtype, by name (``auto``: resolved per device)."""

    name: str
    storage: str
    compute: str


@dataclass(frozen=True)
class TrackingChoice:
    """``tracking``: where the run is logged in W&B."""

    mode: str  # offline | online | disabled
    project: str
    entity: str | None
    group: str | None  # None: the sweep folder's name (or the run's)


@dataclass(frozen=True)
class RunConfig:
    """The run's config as plain values, read from Hydra once (``harness.experiment.config.read``), unchecked: what
    was asked. ``options`` holds the registered measurements' options the config gives, by name (the top-level keys
    they add; ``harness.measurements.options_of`` fills in a declared default for one it lacks), plain;
    ``config_id`` the run's identity (hashed from the config as composed); ``resolved`` the whole config, resolved,
    as a plain dict (what W&B records as the run's config)."""

    model: ModelChoice
    engine: EngineChoice
    cache: CacheChoice
    dtype: DtypeChoice
    device: str  # cpu | cuda | auto: as asked (the Plan's device is what it resolved to)
    tracking: TrackingChoice
    experiment: str
    n_prompts: int
    new_tokens: int
    prompt_len: int
    batch: int
    prompt_lengths: str  # uniform | ragged
    max_len: int | None  # None: the model's n_positions
    repeats: int
    warmup: int
    seed: int
    prompts: str  # file | random
    prompts_file: str  # relative to the repository root, or absolute
    compile: bool
    resume: bool
    measurements: tuple[str, ...] | None  # as given; None: all that apply
    options: dict[str, Any]  # measurement option -> its value, plain (drift_text_len, batch_sizes, ...)
    config_id: str
    resolved: dict

    @property
    def context_lengths(self) -> tuple[int, ...] | None:
        """The timed contexts as given (the step_time measurement's option); None: automatic."""
        given = self.options.get("context_lengths")
        return None if given is None else tuple(given)

    def option(self, name: str, default: Any = None) -> Any:
        """A measurement option's value by name (``default`` when the config does not give it)."""
        return self.options.get(name, default)


@dataclass(frozen=True)
class Plan:
    """What a valid ``RunConfig`` resolves to, checked before anything is built, written or opened
    (``harness.experiment.prepare.plan_run``)."""

    config: RunConfig
    weights: Weights
    model_cfg: Any  # the model family's config (models.families); None: a hub checkpoint, known once loaded
    max_len: int | None
    contexts: list[int] | None
    device: torch.device
    storage: torch.dtype
    compute: torch.dtype
    prompts_path: Path | None  # prompts=file: the file
    inputs: dict  # input_ids: what the results depend on beyond the config

"""A run before it is recorded: its plan checked from the config alone (``plan_run``: the knobs, the checkpoint, the
device, the prompts file, each measurement's own checks and the peak memory), then everything it reads loaded
(``load``: the model, the engine, the prompts and what each measurement builds for itself), then its measurements run
over one ``Context`` (``measure_run``). Each measurement is reached through the registry's hooks: none is named
here."""

from __future__ import annotations

import dataclasses
import copy
import json
import sys
from pathlib import Path

import torch

from harness import measurements
from harness.experiment.describe import asked_measurements, weights_record
from harness.experiment.folder import input_ids
from harness.common.errors import ConfigError
from harness.core import inputs, kinds, measure
from harness.core.inputs import check_prompts_file
from harness.measurements import record
from harness.experiment import weights
from harness.experiment.weights import Weights, first_token_of, first_token_share_of
from harness.experiment.config import check_model, check_outliers, engine_options, validate
from harness.experiment.plan import ModelChoice, OutliersChoice, Plan, RunConfig
from harness.core.engines import ENGINES, KvlabEngine
from harness.experiment.invocation import concurrent_runs
from models import outliers
from models.decoder import Decoder
from models.families import build, load_model, model_class, preset_config, read_config
from models.kv_cache import as_dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device=cuda but torch {torch.__version__} sees no CUDA GPU here: use device=cpu or "
                          "device=auto")
    return torch.device(name)


def resolve_dtypes(storage: str, compute: str, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    if compute == "auto":
        compute = "fp32" if device.type == "cpu" else storage
    return as_dtype(storage), as_dtype(compute)


def model_config(w: Weights, m: ModelChoice):
    """The model's config (of its family: ``models.families``), read cheaply before any weights (None for a hub
    id: known once loaded)."""
    if m.n_kv_head is not None:
        return kv_heads(w, m)
    if w.random:
        return preset_config(m.preset)
    folder = Path(w.load_from)
    if folder.is_dir():
        cfg = read_config(folder)
        preset = preset_config(m.preset)
        if model_class(cfg) is not model_class(preset):  # the runs would be labelled as the other family's
            raise ConfigError(f"model.weights={m.weights} holds a {cfg.family} checkpoint, and model={m.name} is a "
                              f"{preset.family} preset: give model= a preset of its family (docs/models.md)")
        return cfg
    if getattr(m, "build", None):
        raise ConfigError(f"model={m.name} needs its checkpoint folder {m.weights}, which is missing: build it with "
                          f"`{m.build}`")
    return None


def kv_heads(w: Weights, m: ModelChoice):
    """``model.n_kv_head``: the preset with that many K/V heads, its width and query heads unchanged (random
    weights); refused in one line where the heads are not the run's to choose."""
    if not w.random:
        raise ConfigError(f"model.n_kv_head={m.n_kv_head} builds {m.preset} with that many K/V heads from random "
                          f"weights, and model.weights={m.weights} loads a checkpoint whose heads are its own: give "
                          "model.weights=random")
    cfg = preset_config(m.preset)
    if not dataclasses.is_dataclass(cfg) or "n_kv_head" not in {f.name for f in dataclasses.fields(cfg)}:
        raise ConfigError(f"model.n_kv_head={m.n_kv_head}: {m.preset} ({cfg.family}) has one K/V head per query "
                          "head; give a Llama-family preset (docs/models.md)")
    try:
        return dataclasses.replace(cfg, n_kv_head=m.n_kv_head)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.n_kv_head={m.n_kv_head}: {e}") from None


def build_model(w: Weights, m: ModelChoice, cfg) -> Decoder:
    if w.random:
        torch.manual_seed(m.seed)
        return build(cfg).eval()
    return load_model(w.load_from).eval()


def inject_outliers(model: Decoder, choice: OutliersChoice) -> dict:
    """``model.outliers`` done to the loaded fp32 model, in place, before anything is measured on it or copied from
    it (the compute-dtype copy, the references, HF's engine): ``models.outliers.inject``, whose rescaling keeps the
    model's function; refused in one line (``ConfigError``) when the channels do not fit the model. -> what was
    injected (scale 1: nothing, the channels None)."""
    check_outliers(choice, model.config)
    return outliers.inject(model, choice.scale, choice.k_channels, choice.v_channels, choice.seed)


def prompts_path(rc: RunConfig) -> Path | None:
    """The prompts file (``prompts=file``: ``prompts_file``, relative to the repository unless absolute), or None."""
    if rc.prompts != "file":
        return None
    path = Path(rc.prompts_file)
    return path if path.is_absolute() else measure.REPO / path


def cache_files(rc: RunConfig) -> tuple[str, ...]:
    """The files the run's cache kind reads with its options (duo's heads file); none for options the checks will
    refuse (nothing is read then)."""
    from models.kv_cache import CACHE_KINDS

    cls = CACHE_KINDS.get(rc.cache.kind)
    try:
        return () if cls is None else tuple(cls.input_files(cls.parse_options(**rc.cache.options)))
    except (ValueError, TypeError):
        return ()


def plan_run(rc: RunConfig, w: Weights | None = None) -> Plan:
    """Check the whole config from the config alone, purely (files are only read): the knobs, the checkpoint's
    config and its tensors' shapes, the device, the prompts file, and the run's peak memory against what the machine
    has free -> the run's ``Plan``. Raises (``ConfigError``, ``CheckpointError``: one line) on anything that cannot
    run. A hub checkpoint's config is known only once it is loaded: ``with_model`` adds it to the plan then."""
    w = w or weights.resolve(rc.model)
    device = resolve_device(rc.device)
    storage, compute = resolve_dtypes(rc.dtype.storage, rc.dtype.compute, device)
    path = prompts_path(rc)
    if path is not None:
        check_prompts_file(path)
    plan = Plan(rc, w, None, None, None, device, storage, compute, path,
                input_ids(path, rc.model.seed, w, measurement_files(rc), kinds.source_file(rc.cache.kind),
                          cache_files(rc)))
    mcfg = model_config(w, rc.model)
    if mcfg is None:
        if path is not None:
            prompt_tokenizer(w, None, rc.model.name)
        return plan
    return with_model(plan, mcfg)


def with_model(plan: Plan, mcfg) -> Plan:
    """``plan`` with its model's config (``mcfg``) and everything checked against it, once: the model's knobs, the
    capacity and timed contexts it resolves, the prompts' tokenizer, the outliers, each measurement's own checks
    and the peak memory."""
    rc = plan.config
    check_model(rc, mcfg)
    max_len, contexts = validate(rc, mcfg.n_positions, mcfg.head_dim)
    if plan.prompts_path is not None:
        prompt_tokenizer(plan.weights, mcfg, rc.model.name)
    check_outliers(rc.model.outliers, mcfg)
    check_with_model(rc, mcfg, max_len, plan.storage, plan.compute)
    check_memory(rc, mcfg, max_len, contexts, plan.storage, plan.compute, plan.device)
    return dataclasses.replace(plan, model_cfg=mcfg, max_len=max_len, contexts=contexts)


def prompt_tokenizer(w: Weights, mcfg, model_name: str):
    """The tokenizer that makes a run's text prompts: a checkpoint folder's own (its tokenizer.json), else GPT-2's;
    refused in one line (``ConfigError``) when its ids do not all fit the model's vocabulary."""
    from models.tokenizer import FileTokenizer, for_checkpoint

    folder = Path(w.load_from) if w.load_from and Path(w.load_from).is_dir() else None
    try:
        tok = for_checkpoint(folder)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mcfg is not None and tok.vocab_size > mcfg.vocab_size:
        which = (f"the checkpoint's tokenizer ({tok.source}) with {tok.vocab_size:,} tokens"
                 if isinstance(tok, FileTokenizer) else f"GPT-2's {tok.vocab_size:,}-token vocabulary")
        raise ConfigError(f"prompts=file uses {which}, but model {model_name} has vocab_size {mcfg.vocab_size:,}: "
                          "use prompts=random")
    return tok


def shape(rc: RunConfig, mcfg, max_len: int, storage, compute, device=None):
    """The run's sizes as the measurements read them (``harness.core.sizes.Shape``): plain values."""
    from harness.core.sizes import Shape

    return Shape(mcfg, rc.cache.kind, dict(rc.cache.options), storage, compute, rc.engine.name, max_len, rc.prompt_len,
                 rc.new_tokens, rc.n_prompts, rc.batch, rc.compile, "cpu" if device is None else device,
                 rc.prompt_lengths)


def check_with_model(rc: RunConfig, mcfg, max_len: int, storage, compute) -> None:
    """Each chosen measurement's checks once the model is known (``Measurement.check_plan``), and each one left out
    whose options would do nothing without it (``Measurement.idle``): one line, before anything is built."""
    chosen = measurements.chosen(rc.measurements)
    s = shape(rc, mcfg, max_len, storage, compute)
    for name, cls in measurements.MEASUREMENTS.items():
        opts = measurements.options_of(cls, rc.options)
        if name in chosen:
            cls.check_plan(opts, s)
        else:
            why = cls.idle(opts, f"measurements=[{asked_measurements(rc.measurements)}]")
            if why:
                raise ConfigError(why)


def check_memory(rc: RunConfig, mcfg, max_len: int, contexts: list[int], storage, compute,
                 device) -> None:
    """The run's peak bytes (weights, caches, the measurements' largest tensors) against what is free: refused in
    one line, with what would fit, before anything is allocated (``harness.experiment.memory``: plain values)."""
    from harness.experiment import memory

    need = memory.run_bytes(mcfg, storage=storage, compute=compute, kind=rc.cache.kind,
                            options=dict(rc.cache.options), max_len=max_len, batch=rc.batch, n_prompts=rc.n_prompts,
                            new_tokens=rc.new_tokens, prompt_len=rc.prompt_len, engine=rc.engine.name,
                            device=device.type, compile=rc.compile, measurements=measurements.chosen(rc.measurements),
                            **{**dict(rc.options), "context_lengths": contexts})
    memory.check(need, memory.available_bytes(device),
                 where="this machine" if device.type == "cpu" else f"GPU {device}")


def load(plan: Plan) -> dict:
    """What a run reads before it measures, loaded before anything in its folder is cleared: the model from its
    checkpoint (every tensor checked), the engine, the prompts from their file. Raises, in one line, on a fault."""
    rc = plan.config
    model32 = build_model(plan.weights, rc.model, plan.model_cfg)
    if plan.model_cfg is None:  # a hub checkpoint: its config joins the plan now that it is known
        plan = with_model(plan, model32.config)
    w, mcfg, max_len, contexts = plan.weights, plan.model_cfg, plan.max_len, plan.contexts
    device, storage, compute = plan.device, plan.storage, plan.compute
    injected = inject_outliers(model32, rc.model.outliers)  # before the model is moved, copied or measured
    model32 = model32.to(device)
    model = model32 if compute == torch.float32 else copy.deepcopy(model32).to(compute)
    compiled = rc.compile  # validation has refused it on an engine that cannot compile
    engine = ENGINES[rc.engine.name].build(model, engine_options(rc), rc.dtype.storage, compile=compiled)
    spec = measure.CacheSpec(rc.cache.kind, dict(rc.cache.options), storage)
    # drift (against FP32 full attention) is measured for every run that is not that reference itself
    plain_fp32 = (storage == compute == torch.float32 and spec.cls.full_attention(spec.opts)
                  and not engine.drifts_at_fp32)
    ref32 = None if plain_fp32 else (engine if compute == torch.float32 and engine.runs_references
                                     else KvlabEngine(model32))  # the reference is always kvlab's fp32
    tok = None
    if plan.prompts_path is not None:
        tok = prompt_tokenizer(w, mcfg, rc.model.name)  # a hub checkpoint's vocabulary is known only now
    bos = first_token_of(w, rc.model.preset)  # trained with it at position 0: every sequence starts with it
    src = inputs.Source(plan.prompts_path, tok, mcfg.vocab_size, rc.seed, bos)
    prompts = [p.to(device) for p in src.prompts(rc.n_prompts, rc.prompt_len)]
    built = measurement_inputs(rc, src, shape(rc, mcfg, max_len, storage, compute, device))
    return dict(mcfg=mcfg, max_len=max_len, contexts=contexts, model32=model32, model=model, engine=engine,
                spec=spec, ref32=ref32, prompts=prompts, compiled=compiled, outliers=injected, tokenizer=tok,
                first_token=bos, first_token_share=first_token_share_of(w, bos), built=built)


def measurement_inputs(rc: RunConfig, src, s) -> dict:
    """What the chosen measurements build for themselves (``Measurement.inputs``): {``Context`` field: value}."""
    chosen = measurements.chosen(rc.measurements)
    built = {}
    for name, cls in measurements.MEASUREMENTS.items():
        if name in chosen:
            built.update(cls.inputs(measurements.options_of(cls, rc.options), src, s))
    return built


def measurement_files(rc: RunConfig) -> list[str]:
    """The files the chosen measurements read beyond the prompts and the checkpoint (``Measurement.files``)."""
    chosen = measurements.chosen(rc.measurements)
    return [f for name, cls in measurements.MEASUREMENTS.items() if name in chosen
            for f in cls.files(measurements.options_of(cls, rc.options))]


def resolved_record(plan: Plan, loaded: dict) -> dict:
    """What the config resolved to on this machine and model (``harness.measurements.record.Resolved``), with the effective
    max_len and context lengths."""
    mcfg, model, injected = loaded["mcfg"], loaded["model"], loaded["outliers"]
    dtype = {t: str(t).removeprefix("torch.") for t in (plan.storage, plan.compute)}
    channels = {part: None if injected[part] is None else json.dumps(injected[part], separators=(",", ":"))
                for part in ("k_channels", "v_channels")}  # as model.outliers.k_channels takes them back
    return dict(record.typed(record.Resolved, dict(
        device=plan.device.type, storage_dtype=dtype[plan.storage], compute_dtype=dtype[plan.compute],
        n_layer=mcfg.n_layer, n_head=mcfg.n_head, n_kv_head=mcfg.n_kv_head, model_family=mcfg.family,
        n_embd=mcfg.n_embd, n_params=model.num_params(),
        outlier_k_channels=channels["k_channels"], outlier_v_channels=channels["v_channels"],
        prompt_tokenizer=None if loaded["tokenizer"] is None else getattr(loaded["tokenizer"], "source", "gpt2"),
        engine_rotation=loaded["engine"].rotation(loaded["spec"]), first_token=loaded["first_token"],
        first_token_share=loaded.get("first_token_share"))),
        max_len=loaded["max_len"], context_lengths=",".join(map(str, loaded["contexts"])))


def context(plan: Plan, loaded: dict, rec: dict, progress: bool) -> measurements.Context:
    """What the run's measurements share (``harness.measurements.Context``): plain values, their options by name."""
    rc = plan.config
    return measurements.Context.with_inputs(
        loaded.get("built", {}), engine=loaded["engine"], spec=loaded["spec"], prompts=loaded["prompts"],
        new_tokens=rc.new_tokens, max_len=loaded["max_len"], device=plan.device, option_values=dict(rc.options),
        ref32=loaded["ref32"], contexts=loaded["contexts"], repeats=rc.repeats, warmup=rc.warmup, seed=rc.seed,
        compiled=loaded["compiled"], progress=progress, record=rec, first_token=loaded["first_token"],
        decode=None if loaded["tokenizer"] is None else loaded["tokenizer"].decode)


def measure_run(plan: Plan, loaded: dict, rec: dict, progress: bool = True) -> dict:
    """The measurements the config asks for (``measurements``; default: all), each one's Result written into ``rec``
    as it ends (a run that fails late keeps what it measured; ``rec["failed_stage"]`` names the measurement it was
    in) -> the run's tables. Raises on any failure."""
    rec.update(resolved_record(plan, loaded), **record.typed(record.Fingerprint, measure.fingerprint(plan.device)),
               **weights_record(plan.weights, plan.config.model))
    others = concurrent_runs()
    tables = measurements.measure(context(plan, loaded, rec, progress),
                                  measurements.chosen(plan.config.measurements))
    rec["concurrent_runs_while_timing"] = max(others, concurrent_runs())
    if rec["concurrent_runs_while_timing"]:
        print(f"kvlab: {rec['concurrent_runs_while_timing']} other kvlab run(s) measured on this machine while this "
              "one timed its steps: its step times share their cores (docs/sweeps.md: Scaling out)", file=sys.stderr)
    return tables

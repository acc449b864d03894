"""One run, one straight path: read Hydra's config once into plain values (``run``, the door:
``harness.experiment.config.read`` -> a ``RunConfig``) -> validate it and resolve the weights (``plan_run``: pure,
once -> a ``Plan``) -> take the folder -> load the model, engine and prompts (``load``) -> run the measurements
(``measure_run``, from the registry ``harness.measurements``) -> write the record and tables -> log to W&B. Only
``run`` holds the DictConfig; everything after it gets the ``RunConfig``, the ``Plan`` or the part of one it needs
(``harness.experiment.plan``).

A run never raises: whatever goes wrong (an impossible config, CUDA asked on a machine without it, out of memory,
non-finite logits) is recorded as ``status: failed`` with its error, so a sweep goes on and keeps the runs around it.

A run's identity is ``config_id``: a hash of the measurement-relevant config (everything but ``tracking`` and
``resume``). A run whose folder already holds a complete, ok results.json of the same identity is skipped
(``resume=true``, the default); anything else in the folder (a failed or interrupted attempt, W&B files included)
is cleared and measured again. Every run stamps the id of the ``run.py`` invocation that made or confirmed it, so
the sweep report and ``run.py``'s exit code read exactly this invocation's runs from their files
(``invocation_failures``).
"""

from __future__ import annotations

import dataclasses
import copy
import datetime as dt
import hashlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from harness import measurements
from harness.common import signals
from harness.common.errors import ConfigError, one_line
from harness.common.signals import interruption
from harness.core import inputs, measure
from harness.core.inputs import batch_lengths, check_prompts_file, disjoint_texts, led, random_prompts, text_prompts
from harness.common import ownership
from harness.measurements import record
from harness.experiment import tracking
from harness.experiment.tracking import default_group, wandb_id
from harness.experiment import weights
from harness.experiment.weights import Weights, first_token_of, first_token_share_of
from harness.experiment.config import check_model, check_outliers, dtype_label, engine_options, read, validate
from harness.experiment.plan import CacheChoice, ModelChoice, OutliersChoice, Plan, RunConfig
from harness.core.engines import ENGINES, KvlabEngine
from harness.experiment.invocation import (concurrent_runs, forget_invocation, invocation, invocation_failures,
                                invocation_folders, mark_active, new_invocation, note_failure, note_started)
from models import outliers
from models.decoder import Decoder
from models.families import build, load_model, model_class, preset_config, read_config
from models.hf_checkpoint import files_read
from models.kv_cache import as_dtype, cache_kind

# the invocation's bookkeeping lives in harness.experiment.invocation; these names stay importable from here
__all__ = ["concurrent_runs", "forget_invocation", "invocation", "invocation_failures", "invocation_folders",
           "new_invocation", "note_failure", "note_started", "run", "Plan", "RunConfig"]


# ---- the run folder, resume -------------------------------------------------------------------------------------

def partial_files() -> tuple[str, ...]:
    """What a run writes in its folder: what an earlier attempt may have left."""
    return (*tracking.run_files(), "wandb", ".hydra")


def _same_folder(recorded, folder: Path) -> bool:
    """Whether the run folder a record names (absolute, or relative to where kvlab ran) is ``folder``."""
    if not isinstance(recorded, str) or not recorded:
        return False
    here, p = ownership.resolved(folder), Path(recorded)
    if p.is_absolute():
        return ownership.resolved(p) == here
    parts = Path(os.path.normpath(p)).parts
    return ".." not in parts and here.parts[-len(parts):] == parts


def _first_row(path: Path) -> dict | None:
    """The header and first row of a CSV table kvlab wrote (read from its first 64 KiB), or None."""
    import csv
    import io

    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            head = f.read(2 ** 16)
        rows = csv.DictReader(io.StringIO(head))
        return next(rows, None)
    except (OSError, csv.Error):
        return None


def _not_its_files(folder: Path, run_name: str, record: dict | None) -> str | None:
    """Which of the run's tables and summary in ``folder`` are not this run's: a table whose rows do not say it
    (its identity columns), a run.log that does not start with its summary's head."""
    for name in tracking.table_files().values():
        if (folder / name).exists():
            row = _first_row(folder / name)
            if row is None or row.get("run_name") != run_name or (
                    record is not None and row.get("status") != record.get("status")):
                return f"its {name} is not this run's table"
    if (folder / tracking.LOG).exists():
        try:
            with open(folder / tracking.LOG, encoding="utf-8", errors="replace") as f:
                first = f.read(4096)
        except OSError:
            first = ""
        if not first.startswith(f"kvlab run {run_name}:"):
            return f"its {tracking.LOG} is not this run's summary"
    return None


def adoption_problem(folder: Path) -> str | None:
    """Why a folder without a manifest is not a run an earlier kvlab wrote *here* (None: it is). Proof: its
    results.json is a kvlab record whose run folder is this folder, and every table and summary beside it is that
    record's; or, for a run killed before its record, its .hydra/config.yaml is a kvlab config and its tables are
    the folder's run's."""
    from harness.experiment.records import RESULTS, read_record

    folder = Path(folder)
    if (folder / RESULTS).exists():
        record, _ = read_record(folder / RESULTS)
        if record is None or not (record.get("config_id") and record.get("run_name")):
            return f"its {RESULTS} is not a kvlab record"
        if not _same_folder(record.get("run_dir"), folder):
            return f"its {RESULTS} was written for another folder ({record.get('run_dir')})"
        return _not_its_files(folder, record["run_name"], record)

    try:
        job = (None if ownership.file_problem(folder / ".hydra" / "config.yaml", 2 ** 20)
               else OmegaConf.load(folder / ".hydra" / "config.yaml"))
        ours = job is not None and OmegaConf.select(job, "cache.kind") is not None and OmegaConf.select(
            job, "model.preset") is not None
    except Exception:
        ours = False
    if not ours:
        return "it holds no kvlab record"
    return _not_its_files(folder, folder.name, None)


def _is_kvlab_run(folder: Path) -> bool:
    """Whether a folder without a manifest is a run an earlier kvlab wrote here (``adoption_problem``)."""
    return adoption_problem(folder) is None


def take_folder(run_dir: Path) -> None:
    """Make sure ``run_dir`` is kvlab's to write in: new, empty, or holding only what kvlab's manifest lists (a run
    folder an earlier kvlab wrote before manifests is adopted when all it holds is a run's files and its record is a
    kvlab record). Anything else: ``NotOurs``, in one line, and nothing is touched."""
    adopted = ownership.adopt(run_dir, set(partial_files()), _is_kvlab_run)
    why = None if adopted or (Path(run_dir) / ownership.MANIFEST).exists() else adoption_problem(Path(run_dir))
    ownership.refuse_foreign(run_dir, "run folder", (f"{why}, so it is not adopted; " if why else "")
                             + "point hydra.run.dir (or hydra.sweep.dir) at a new or empty folder, or at a kvlab run "
                             "folder")
    for sub, made in INSIDE.items():  # the folders kvlab made are cleared whole: only while they hold only its own
        names = [n for n in ownership.entries(Path(run_dir) / sub) if not re.fullmatch(made, n)]
        if sub in ownership.owned(run_dir) and names:
            raise ownership.NotOurs(f"run folder {run_dir}: its {sub}/ holds files kvlab did not write "
                                    f"({', '.join(names[:4])}); kvlab never clears it: move them away")


INSIDE = {".hydra": r"(config|hydra|overrides)\.yaml",  # what kvlab and W&B write in the folders kvlab makes
          "wandb": r"(offline-)?run-\d{8}_\d{6}-\w+|latest-run|debug(-internal|-cli\.\w+)?\.log|data|cache"}


def _fresh_or_failed_attempt(run_dir: Path, ident: str) -> bool:
    """Whether a refused config may record its failure in ``run_dir``: it holds nothing of kvlab's yet, or only a
    failed or interrupted attempt of this same config (never a finished run, never another config's record)."""
    from harness.experiment.records import RESULTS, read_record

    if not ownership.owned(run_dir) & set(ownership.entries(run_dir)):
        return True
    record, _ = read_record(Path(run_dir) / RESULTS)
    return record is not None and record.get("config_id") == ident and record.get("status") != "ok"


def completed(run_dir: Path, ident: str) -> dict | None:
    """The run folder's record when it is complete (every file kvlab listed is there), ok and of this identity."""
    from harness.experiment.records import RESULTS, read_record

    record, _ = read_record(Path(run_dir) / RESULTS)
    ok = record is not None and record.get("status") == "ok" and record.get("config_id") == ident
    whole = all((Path(run_dir) / n).exists() for n in ownership.owned(run_dir))
    return record if ok and whole else None


def _finished_other(run_dir: Path, ident: str) -> str | None:
    """Why ``run_dir`` may not take this run: it holds a sweep report, or a finished run of another config (kvlab
    wrote them, but replacing one silently would lose it)."""
    from harness.experiment.records import RESULTS, read_record

    if "report.html" in ownership.owned(run_dir):
        return (f"{run_dir} is a sweep report folder: kvlab never measures a run into it; point hydra.run.dir at a new "
                "or empty folder")
    record, _ = read_record(Path(run_dir) / RESULTS)
    if record is not None and record.get("config_id") != ident and record.get("status") in ("ok", "not_equivalent"):
        return (f"{run_dir} holds a finished run of another config ({record.get('config_id')}, this one is {ident}): "
                "kvlab never replaces it; give this run a folder of its own (hydra.run.dir, hydra.sweep.subdir)")
    return None


INPUTS = {"inputs_prompts": "the prompts file", "inputs_checkpoint": "the checkpoint",
          "inputs_trace": "the serving trace", "inputs_code": "kvlab's code"}


def changed_inputs(prior: dict, inputs: dict) -> list[str]:
    """What changed since ``prior`` was measured, among the inputs its config does not name (one phrase each)."""
    return [f"{what} changed ({prior.get(k) or 'not recorded'} -> {inputs[k]})" for k, what in INPUTS.items()
            if prior.get(k) != inputs[k]]


def _sha(chunks) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()[:16]


WHOLE_FILE = 256 * 2 ** 20  # checkpoints up to this size are hashed whole; larger ones by size and 64 samples


def file_id(path: Path) -> str:
    """A content id of a file: the sha256 of all of it, or of its size and 64 evenly spaced 64 KiB samples when it
    is large (a checkpoint of several GB costs milliseconds; a retrained one differs in every sample)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= WHOLE_FILE:
            return _sha(iter(lambda: f.read(2 ** 20), b""))

        def samples():
            yield str(size).encode()
            for i in range(64):
                f.seek(i * (size - 2 ** 16) // 63)
                yield f.read(2 ** 16)
        return _sha(samples())


def input_ids(prompts_path: Path | None, seed: int, w: Weights | None, trace: str | None = None) -> dict:
    """What a run's results depend on beyond its config: the prompts file's contents (``prompts_path``; None: random
    prompts), the checkpoint's contents (every file of it a load reads: ``models.hf_checkpoint.files_read``; the
    model's ``seed`` for random weights), the serving trace's (``serve.trace``) and kvlab's own code (its sources and
    configs)."""
    prompts = "random prompts"
    if prompts_path is not None:
        path = Path(prompts_path)
        prompts = file_id(path) if path.is_file() and path.stat().st_size <= inputs.PROMPTS_FILE_MAX else "not read"
    if w is None or w.random:
        ckpt = f"random init (seed {seed})"
    elif Path(w.load_from).is_dir():
        ckpt = _sha(f"{f.name}:{file_id(f)}".encode() for f in files_read(w.load_from))
    else:
        ckpt = f"hub {w.load_from}"
    traced = None
    if trace:
        traced = file_id(Path(trace)) if Path(trace).is_file() else "not read"
    code = _sha(p.read_bytes() for p in tracking.sources())
    return dict(inputs_prompts=prompts, inputs_checkpoint=ckpt, inputs_trace=traced, inputs_code=code)


# ---- inputs ----------------------------------------------------------------------------------------------------

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


def weights_record(w: Weights | None, m: ModelChoice) -> dict:
    """What results.json says of the weights: ``weights`` (random | pretrained), ``weights_source`` (random, the hub
    id or the folder), ``weights_detail`` (one line for people) and what was asked (``weights_requested``)."""
    if w is None:  # the request itself was refused; the run fails on it with its own message
        return dict(weights=None, weights_source=str(m.weights), weights_detail=f"checkpoint {m.weights}",
                    weights_requested=str(m.weights))
    return dict(weights=w.kind, weights_source=w.source, weights_detail=w.detail, weights_requested=str(m.weights))


def serve_stream(rc: RunConfig, path: Path | None, tokenizer, vocab_size: int) -> list[int] | None:
    """The running text the server's workload draws its prompts from (None when the run serves no requests):
    ``harness.core.inputs.served_stream``."""
    from harness.measurements.server import serve_options, serving

    if "server" not in measurements.chosen(rc.measurements):
        return None
    s = serve_options(rc.option("serve"))
    if not serving(s):
        return None
    return inputs.served_stream(path, s.system_prompt + s.prompt_most + 1, tokenizer, vocab_size, rc.seed)


# ---- the run ---------------------------------------------------------------------------------------------------

def _hydra_dirs() -> tuple[Path, str, str]:
    """(run folder, the sweep's folder name (the run's, for a single run), run name) from Hydra's runtime; a plain
    call (no Hydra) uses outputs/adhoc/<time>."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        run_dir = Path(hc.runtime.output_dir)
        group = Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else run_dir.name
        return run_dir, group, run_dir.name
    name = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return measure.REPO / "outputs" / "adhoc" / name, "adhoc", name


def model_label(m: ModelChoice) -> str:
    """How runs are labelled: the model's name; on a checkpoint folder whose name was left at the preset's, the
    folder's name is added (unless it is the model's name), so runs on two checkpoints never share a label; with
    ``model.n_kv_head`` N, `` kvN``; with
    outlier channels injected (``model.outliers.scale`` S != 1), `` · outliers xS``, so they never share one with the
    model as loaded."""
    if m.weights in ("random", "auto") or m.name != m.preset or Path(str(m.weights)).name == m.name:
        label = m.name
    else:
        label = f"{m.name}@{Path(str(m.weights)).name}"
    if getattr(m, "n_kv_head", None) is not None:
        label = f"{label} kv{m.n_kv_head}"
    scale = getattr(getattr(m, "outliers", None), "scale", 1)  # a model choice without outliers: the model as loaded
    return label if scale == 1 else f"{label} · outliers x{scale:g}"


def config_record(rc: RunConfig) -> dict:
    """What results.json says of the config, as given (a refused config's record says what it asked for)."""
    return dict(
        model=model_label(rc.model), preset=rc.model.preset if rc.model.weights in ("random", "auto") else None,
        model_seed=rc.model.seed, outlier_scale=rc.model.outliers.scale, engine=rc.engine.name, cache=rc.cache.kind,
        **cache_record(rc.cache, rc.engine.name, engine_options(rc), rc.dtype.storage),
        engine_threads=engine_threads(rc), dtype=dtype_label(rc.dtype.storage, rc.dtype.compute),
        device_requested=rc.device, experiment=rc.experiment, n_prompts=rc.n_prompts,
        new_tokens=rc.new_tokens, prompt_len=rc.prompt_len, max_len=rc.max_len, batch=rc.batch,
        compile=rc.compile,
        prompt_lengths=rc.prompt_lengths,
        context_lengths=None if rc.context_lengths is None else ",".join(str(c) for c in rc.context_lengths),
        repeats=rc.repeats, warmup=rc.warmup,
        seed=rc.seed, prompts=rc.prompts)


def asked_measurements(names) -> str:
    """The measurements asked for (``RunConfig.measurements``), comma-separated (as given, when they are not all
    known)."""
    try:
        return ",".join(measurements.chosen(names))
    except ValueError:
        return ",".join(map(str, names or []))


def engine_threads(rc: RunConfig) -> int | None:
    """The threads an engine with its own thread count computes with (llama.cpp's ``engine.threads``; 0 is torch's
    count), or None for the engines that compute in torch (its count is the fingerprint's ``threads``)."""
    try:
        threads = getattr(engine_options(rc), "threads", None)
    except (TypeError, KeyError):  # an engine the config does not know: the run fails on it with its own message
        return None
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:  # refused: the run says why
        return None
    return threads or torch.get_num_threads()


def cache_record(cache: CacheChoice, engine: str = "kvlab", engine_opts=None, storage: str = "fp32") -> dict:
    """The cache's label, whether it is exact, and its options as ``cache_<option>`` columns. On another engine
    than kvlab's the label says which (``prealloc · hf``), so its runs are their own series in every table and
    plot, and what that engine stores where the kind does not say (``prealloc · llamacpp K f32 V q4_0``, and
    ``engine_type_k`` / ``engine_type_v``): a kind is exact there only in the storage dtype's types. The options
    are the resolved ones (a window's ``budget`` sets its ``window``)."""
    options = dict(cache.options)
    cls_engine = ENGINES.get(engine)
    try:
        cls = cache_kind(cache.kind)
        opts = cls.parse_options(**options)
        types, lossless = (None, True) if cls_engine is None else cls_engine.stores(
            cache.kind, opts, engine_opts or cls_engine.Options(), storage)
        suffix = "" if engine == "kvlab" else f" · {engine}" + ("" if lossless else " K {} V {}".format(*types))
        if getattr(engine_opts, "rotate", "auto") == "none" and cache.kind != "quant" and cls_engine.quantises(types):
            suffix += " unrotated"  # llama.cpp's default rotation of a quantised K/V turned off (engine.rotate=none)
        head = dict(cache_label=cls.label(opts) + suffix, cache_exact=cls.exact and lossless,
                    cache_full_attention=bool(cls.full_attention(opts)))
        if types is not None:
            head.update(engine_type_k=types[0], engine_type_v=types[1])
        options = {k: getattr(opts, k, v) for k, v in options.items()}
        head["cache_implied"] = ",".join(implied_options(cls, options))
    except ValueError:  # recorded as given; the run fails on it with its own message
        head = dict(cache_label=str(cache.kind), cache_exact=None, cache_full_attention=None, cache_implied=None)
    return {**head, **{f"cache_{k}": v for k, v in options.items()}}


def implied_options(cls, resolved: dict) -> list[str]:
    """The options of ``resolved`` (a run's, as the kind resolved them) whose value its others imply: the kind sets
    it from them (a window's window, budget - sinks) or it is the default. Figures read it from the record: an
    option the others imply in every run of a sweep is no setting of its own."""
    out = []
    for name in resolved:
        try:
            if getattr(cls.parse_options(**{k: v for k, v in resolved.items() if k != name}), name) == resolved[name]:
                out.append(name)
        except (TypeError, ValueError, AttributeError):
            pass
    return out


def prompts_path(rc: RunConfig) -> Path | None:
    """The prompts file (``prompts=file``: ``prompts_file``, relative to the repository unless absolute), or None."""
    if rc.prompts != "file":
        return None
    path = Path(rc.prompts_file)
    return path if path.is_absolute() else measure.REPO / path


def plan_run(rc: RunConfig, w: Weights | None = None) -> Plan:
    """Check the whole config from the config alone, purely (files are only read): the knobs, the checkpoint's
    config and its tensors' shapes, the device, the prompts file, and the run's peak memory against what the machine
    has free -> the run's ``Plan``. Raises (``ConfigError``, ``CheckpointError``: one line) on anything that cannot
    run."""
    w = w or weights.resolve(rc.model)
    mcfg = model_config(w, rc.model)
    if mcfg is not None:
        check_model(rc, mcfg)
    max_len, contexts = validate(rc, mcfg.n_positions, mcfg.head_dim) if mcfg is not None else (None, None)
    device = resolve_device(rc.device)
    storage, compute = resolve_dtypes(rc.dtype.storage, rc.dtype.compute, device)
    path = prompts_path(rc)
    if path is not None:
        check_prompts_file(path)
        prompt_tokenizer(w, mcfg, rc.model.name)
    if mcfg is not None:
        check_outliers(rc.model.outliers, mcfg)
        check_with_model(rc, mcfg, max_len, storage, compute)
        check_memory(rc, mcfg, max_len, contexts, storage, compute, device)
    return Plan(rc, w, mcfg, max_len, contexts, device, storage, compute, path,
                input_ids(path, rc.model.seed, w, serve_trace(rc)))


def serve_trace(rc: RunConfig) -> str | None:
    """The serving trace a run reads (``serve.trace`` of a run that measures the server), or None."""
    from harness.measurements.server import serve_options

    if "server" not in measurements.chosen(rc.measurements):
        return None
    return serve_options(rc.option("serve")).trace or None


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
                 rc.new_tokens, rc.n_prompts, rc.batch, rc.compile, "cpu" if device is None else device.type)


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
    w, mcfg, max_len, contexts = plan.weights, plan.model_cfg, plan.max_len, plan.contexts
    device, storage, compute = plan.device, plan.storage, plan.compute
    model32 = build_model(w, rc.model, mcfg)
    if mcfg is None:  # a hub checkpoint: validate now that its config is known
        mcfg = model32.config
        check_model(rc, mcfg)
        max_len, contexts = validate(rc, mcfg.n_positions, mcfg.head_dim)
        check_memory(rc, mcfg, max_len, contexts, storage, compute, device)
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
    # drift on text: drift_texts (default n_prompts) disjoint spans of the prompts file, each at least a prompt and
    # one token long
    text_len = min(max_len, max(rc.option("drift_text_len"), rc.prompt_len + 1))
    n_texts = rc.option("drift_texts") or rc.n_prompts
    tok = None
    if plan.prompts_path is not None:
        tok = prompt_tokenizer(w, mcfg, rc.model.name)  # a hub checkpoint's vocabulary is known only now
        path = plan.prompts_path
        prompts = text_prompts(path, rc.n_prompts, rc.prompt_len, tok)
        drawn = disjoint_texts(path, n_texts, text_len, tok, first_token_of(w, rc.model.preset)) \
            if ref32 is not None else None
        texts, text_paragraphs = (drawn.texts, drawn.record()) if drawn else (None, None)
        served = text_prompts(path, rc.batch, rc.prompt_len, tok)
    else:
        prompts = random_prompts(rc.n_prompts, rc.prompt_len, mcfg.vocab_size, rc.seed)
        texts = random_prompts(n_texts, text_len, mcfg.vocab_size, rc.seed) if ref32 is not None else None
        served, text_paragraphs = random_prompts(rc.batch, rc.prompt_len, mcfg.vocab_size, rc.seed), None
    stream = serve_stream(rc, plan.prompts_path, tok, mcfg.vocab_size)
    bos = first_token_of(w, rc.model.preset)
    if bos is not None:  # trained with it at position 0: every sequence starts with it, at the length asked
        prompts, served = [led(p, bos) for p in prompts], [led(p, bos) for p in served]
        texts = texts and [led(t, bos) for t in texts]
    lengths = batch_lengths(rc.batch, rc.prompt_len, rc.prompt_lengths, rc.seed)
    served = [p[0, :n] for p, n in zip(served, lengths)]  # (n,) each
    prompts = [p.to(device) for p in prompts]
    texts = texts and [t.to(device) for t in texts]
    return dict(mcfg=mcfg, max_len=max_len, contexts=contexts, model32=model32, model=model, engine=engine,
                spec=spec, ref32=ref32, prompts=prompts, texts=texts, served=served, compiled=compiled,
                outliers=injected, tokenizer=tok, first_token=bos, stream=stream, text_paragraphs=text_paragraphs,
                first_token_share=first_token_share_of(w, bos))


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
    return measurements.Context(
        engine=loaded["engine"], spec=loaded["spec"], prompts=loaded["prompts"], new_tokens=rc.new_tokens,
        max_len=loaded["max_len"], device=plan.device, option_values=dict(rc.options), ref32=loaded["ref32"],
        texts=loaded["texts"], served=loaded["served"], contexts=loaded["contexts"], repeats=rc.repeats,
        warmup=rc.warmup, seed=rc.seed, compiled=loaded["compiled"], progress=progress,
        peak_reset=measure.reset_peak_memory(plan.device), record=rec,
        decode=None if loaded["tokenizer"] is None else loaded["tokenizer"].decode, first_token=loaded["first_token"],
        stream=loaded.get("stream"), text_paragraphs=loaded.get("text_paragraphs"))


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


def verdict(options: dict, rec: dict) -> tuple[str, str | None]:
    """``("ok", None)``, or ``("not_equivalent", why)`` for an exact kind whose storage and compute are fp32 and
    whose cached tokens differ from its reference's, or whose max |dlogit| exceeds ``equivalence_tol`` (of
    ``options``: the measurements' options by name, ``RunConfig.options``; at least the engine's ``logit_tol``): a
    failure, never "ok". Each measurement
    says what of its own results fails it (``not_equivalent``). Reduced precision and lossy kinds are findings, not
    verdicts."""
    exact32 = rec.get("cache_exact") and rec.get("storage_dtype") == rec.get("compute_dtype") == "float32"
    if not exact32:
        return "ok", None
    tol = float(options.get("equivalence_tol", 1e-4))
    engine = ENGINES.get(rec.get("engine"))
    tol = max(tol, getattr(engine, "logit_tol", 0.0))  # a peer's own kernels: its batched and one-token logits
    why = [w for m in measurements.MEASUREMENTS.values() for w in m.not_equivalent(rec, tol)]
    if not why:
        return "ok", None
    return "not_equivalent", (f"cache {rec.get('cache_label') or rec.get('cache')} is an exact kind in fp32 but not "
                              f"equivalent: {'; '.join(why)}")


class OutOfTime(RuntimeError):
    """The Slurm job reached its time limit and will not be requeued again: the run failed, and says why."""


def _submitits(handler) -> bool:
    """The handler is one submitit installed in a Slurm job (its SignalHandler's methods)."""
    return type(getattr(handler, "__self__", None)).__module__.startswith("submitit")


def _after_submitit(inner):
    """submitit's handler of SIGUSR2 (Slurm's warning before the time limit), kept: it requeues the job (then
    raises SystemExit) or says why it will not (raises an error). Requeued: the run is interrupted, and the requeued
    job measures it again. Not requeued: the run failed, out of time, and its record says so."""
    def handler(signum, frame):
        try:
            inner(signum, frame)
        except SystemExit:
            raise signals.Interrupted(signum) from None
        except Exception as e:
            job = slurm_record()["slurm_job_id"]
            raise OutOfTime(f"Slurm job {job} reached its time limit (hydra.launcher.timeout_min) after being "
                            f"requeued {os.environ.get('SLURM_RESTART_COUNT', '0')} time(s) "
                            f"(hydra.launcher.max_num_timeout): {' '.join(str(e).split())}") from None

    return handler


def _submitit_kept(s, current):
    """In a Slurm job, submitit's handlers: its SIGTERM handler ignores the signal (so scancel and scontrol requeue
    would kill the run unrecorded a few seconds later): kvlab takes SIGTERM over; its SIGUSR2 handler (the time
    limit) is kept, and what it does is recorded (``_after_submitit``)."""
    if not _submitits(current):
        return None
    return _after_submitit(current) if s == signal.SIGUSR2 else signals.raise_interrupted


def catch_signals() -> None:
    """SIGTERM, SIGHUP and SIGUSR2 raise ``Interrupted`` in this process (``harness.common.signals``), submitit's
    handlers in a Slurm job taken over or kept (``_submitit_kept``)."""
    signals.catch_signals(_submitit_kept)


def slurm_record() -> dict:
    """The Slurm job this process runs in (None outside Slurm): an array task as ``<array job>_<task>``, as sacct
    and scancel name it."""
    env = os.environ
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else env.get("SLURM_JOB_ID")
    return dict(slurm_job_id=job, slurm_array_task_id=int(task) if task and task.isdigit() else None)


@dataclass(frozen=True)
class HydraJob:
    """What a run keeps of Hydra's side, read at the door: the job's ``.hydra/`` files (file name -> text: its
    config, Hydra's, the overrides) and the command line's overrides (the W&B run's notes)."""

    files: dict
    notes: str


def hydra_job(cfg: DictConfig) -> HydraJob:
    """The job's ``.hydra/`` files and overrides, as text (written by kvlab once the config is valid and the folder is
    its own: Hydra's own writing of them is off, conf/config.yaml)."""
    from hydra.core.hydra_config import HydraConfig

    files = {"config.yaml": OmegaConf.to_yaml(cfg)}
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        files["hydra.yaml"] = OmegaConf.to_yaml(OmegaConf.create({"hydra": OmegaConf.to_container(hc)}))
        files["overrides.yaml"] = OmegaConf.to_yaml(OmegaConf.create(list(hc.overrides.task)))
    return HydraJob(files, hydra_overrides())


def run(cfg: DictConfig, progress: bool = True) -> dict:
    """One run from a composed config: the door. Hydra is read here once (the config into a ``RunConfig``, the job's
    .hydra/ files and overrides); below, only plain values travel. The config is checked first, purely; then the
    run folder must be kvlab's (new, empty, or holding only what kvlab wrote) and is locked; then the run is
    measured, its files and W&B run written. Never raises for a failed run; Ctrl-C, SIGTERM, SIGHUP or SIGUSR2
    record it as interrupted and stop the process with exit code 128 + the signal's number."""
    run_dir, folder, name = _hydra_dirs()
    catch_signals()
    try:
        try:
            rc, job = read(cfg), hydra_job(cfg)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a config that cannot even be read (a value that does not resolve): nothing written
            return _refuse(run_dir, name, one_line(e))
        return _run(rc, job, run_dir, folder, name, progress)
    except KeyboardInterrupt as e:  # outside the measurement: nothing of this attempt was written
        what, code = interruption(e)
        print(f"kvlab: run {name} interrupted ({what}) before its measurement started; the same command runs it",
              file=sys.stderr)
        raise SystemExit(code) from None


def _misplaced(run_dir: Path) -> str | None:
    """Why a run may not go into ``run_dir`` at all (None: it may): a sweep's run outside its sweep folder (its report
    and exit code would look in the wrong place), or a folder inside another run's folder (that run could no longer
    be resumed or cleared)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from harness.experiment.records import within_report_folder, within_run_folder

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        sweep = ownership.resolved(HydraConfig.get().sweep.dir)
        here = ownership.resolved(run_dir)
        subdir = HydraConfig.get().sweep.subdir
        if here == sweep or sweep not in here.parents:
            return (f"hydra.sweep.subdir={subdir} puts this run in {run_dir}, not inside the sweep folder "
                    f"{HydraConfig.get().sweep.dir}: give a subdir inside it (the default names each run by its "
                    "config)")
        if here == sweep / "report" or sweep / "report" in here.parents:
            return (f"hydra.sweep.subdir={subdir} puts this run in the sweep's report folder ({run_dir}), where no "
                    "report would see it: give another subdir (the default names each run by its config)")
    report_folder = within_report_folder(Path(run_dir).parent)
    if report_folder:
        return (f"run folder {run_dir} lies inside the report folder {report_folder}, where no report would see it: "
                "point hydra.run.dir (or hydra.sweep.dir) at a folder of its own")
    inside = within_run_folder(Path(run_dir).parent)
    if inside:
        return (f"run folder {run_dir} lies inside the run folder {inside[0]} ({inside[1]}), which kvlab would then "
                "no longer resume or clear: point hydra.run.dir (or hydra.sweep.dir) at a folder outside every run's "
                "folder")
    return None


def _refuse(run_dir: Path, name: str, why: str) -> dict:
    """A run that writes nothing at all: one line, counted as not ok for the exit code."""
    print(f"kvlab: run {name} refused: {why}", file=sys.stderr)
    note_started(run_dir, refused=why)
    return dict(status="failed", error=why, run_name=name, run_dir=str(run_dir))


def _run(rc: RunConfig, job: HydraJob, run_dir: Path, folder: str, name: str, progress: bool) -> dict:
    group = rc.tracking.group or default_group(rc.experiment, folder)
    ident, inv = rc.config_id, invocation()
    note_started(run_dir)
    misplaced = _misplaced(run_dir)
    if misplaced:
        return _refuse(run_dir, name, misplaced)
    try:
        plan, refused = plan_run(rc), None
    except KeyboardInterrupt:
        raise
    except Exception as e:  # recorded below, in a folder that holds nothing of an earlier run
        plan, refused = None, one_line(e)
    try:
        take_folder(run_dir)
    except ownership.NotOurs as e:
        return _refuse(run_dir, name, str(e))
    if refused is not None and not _fresh_or_failed_attempt(run_dir, ident):
        return _refuse(run_dir, name, f"{refused} (the earlier run in {run_dir} is left as it was)")
    try:
        with ownership.locked(run_dir, "run folder", inv):
            return _locked_run(rc, job, plan, refused, run_dir, name, group, ident, inv, progress)
    except OSError as e:  # the folder cannot be written: nothing was measured
        why = f"cannot write in {run_dir}: {e.strerror or e}"
        print(f"kvlab: run {name} failed: {why}", file=sys.stderr)
        note_started(run_dir, refused=why)
        return dict(status="failed", error=why, run_name=name, run_dir=str(run_dir))


def _locked_run(rc: RunConfig, job: HydraJob, plan: Plan | None, refused: str | None, run_dir: Path, name: str,
                group: str, ident: str, inv: str, progress: bool) -> dict:
    """A run in its locked folder: a finished run of the same config and inputs is confirmed; otherwise what it
    reads is loaded, the folder cleared of kvlab's earlier attempt, and it is measured and written."""
    prior = _resumable(rc, plan, run_dir, name, ident)
    if prior is not None:
        return _confirm(run_dir, prior, inv, name)
    other = _finished_other(run_dir, ident)
    if other:
        return _refuse(run_dir, name, other)
    loaded = None
    if refused is None:
        try:  # the checkpoint's tensors and the prompts file are read before anything here is cleared
            loaded = load(plan)
        except KeyboardInterrupt:
            raise
        except Exception as e:
            refused = one_line(e)
            if not _fresh_or_failed_attempt(run_dir, ident):
                return _refuse(run_dir, name, f"{refused} (the earlier run in {run_dir} is left as it was)")
    ownership.remove(run_dir, partial_files())  # what an earlier attempt of kvlab's left here, and nothing else
    _write_hydra(run_dir, job.files)
    record = dict(status="failed", error=refused, failed_stage=None if refused is None else "check the config",
                  run_name=name, group=group, run_dir=str(run_dir), config_id=ident, invocation=inv, invocations=inv,
                  device=rc.device, **weights_record(plan.weights if plan else None, rc.model),
                  started_at=dt.datetime.now().isoformat(timespec="seconds"), **config_record(rc),
                  measurements=asked_measurements(rc.measurements), **(plan.inputs if plan else {}),
                  **slurm_record())
    if record["slurm_job_id"]:  # the job's log says which run it measures (a user's scancel needs the id)
        print(f"kvlab: run {name} in Slurm job {record['slurm_job_id']} ({run_dir})", flush=True)
    t0 = time.perf_counter()
    wb, tables = None, {}
    if refused is not None:
        print(f"kvlab: run {name} failed: {refused}", file=sys.stderr)
    else:
        wb, tables = _measured(plan, job.notes, loaded, record, run_dir, name, group, ident, progress, t0)
    return _finish(run_dir, record, tables, wb, name, t0)


def _resumable(rc: RunConfig, plan: Plan | None, run_dir: Path, name: str, ident: str) -> dict | None:
    """The finished record in ``run_dir`` to keep (resume): same config, same inputs, same weights; None (and,
    where one exists, a line saying why it is measured again) otherwise."""
    if plan is None or not rc.resume:
        return None
    prior = completed(run_dir, ident)
    if prior is None:
        return None
    why = changed_inputs(prior, plan.inputs)
    if prior.get("weights_source") not in (None, plan.weights.source):
        why.insert(0, f"it was measured on {prior['weights_source']} but model.weights={rc.model.weights} "
                      f"now gives {plan.weights.source}")
    if not why:
        return prior
    print(f"kvlab: run {name} is measured again: {'; '.join(why)}", file=sys.stderr)
    return None


def _measured(plan: Plan, notes: str, loaded: dict, record: dict, run_dir: Path, name: str, group: str, ident: str,
              progress: bool, t0: float):
    """Open the W&B run and measure; the verdict into ``record``. A failure is recorded, never raised (the sweep
    goes on); a signal writes an interrupted record and stops the process. -> (W&B run, tables)."""
    active = mark_active()
    wb, tables = None, {}
    try:
        wb = _open_wandb(plan.config, record, group, name, run_dir, ident, notes)
        tables = measure_run(plan, loaded, record, progress)
        record["status"], record["error"] = verdict(plan.config.options, record)
    except KeyboardInterrupt as e:
        what, code = interruption(e)
        signals.ignore_signals()
        record.update(status="interrupted", signal=what, duration_s=round(time.perf_counter() - t0, 2),
                      error=f"interrupted ({what}); run the same command again to resume")
        _write(run_dir, record)
        _close_wandb(wb, record, {}, run_dir, exit_code=code)
        print(f"kvlab: run {name} interrupted ({what}); its record says so ({run_dir}). The same command "
              "resumes.", file=sys.stderr)
        raise SystemExit(code) from None
    except Exception as e:  # recorded, never raised: the sweep goes on
        record["error"] = one_line(e)
        stage = record.get("failed_stage")
        print(f"kvlab: run {name} failed{f' in {stage}' if stage else ''}: {record['error']}", file=sys.stderr)
    finally:
        active.unlink(missing_ok=True)
    return wb, tables


def _finish(run_dir: Path, record: dict, tables: dict, wb, name: str, t0: float) -> dict:
    """The record's end, the run's files and its W&B run, written whole (signals held meanwhile); the summary."""
    if record["status"] == "not_equivalent":
        print(f"kvlab: run {name} NOT EQUIVALENT: {record['error']}", file=sys.stderr)
    record["duration_s"] = round(time.perf_counter() - t0, 2)
    record["finished_at"] = dt.datetime.now().isoformat(timespec="seconds")
    tables = tracking.with_identity(tables, record)
    text = summary_text(record, tables)
    with signals.held_signals() as pending:  # the measurement is done: its files and W&B run are finished whole
        written = _write(run_dir, record, tables, text)
        _close_wandb(wb, record, tables, run_dir, exit_code=0 if written and record["status"] == "ok" else 1)
    if written:
        print(text)
    if pending:
        what, code = interruption(signals.Interrupted(pending[0]))
        print(f"kvlab: {what} arrived as run {name} wrote its results: they are complete ({run_dir}); stopping",
              file=sys.stderr)
        raise SystemExit(code)
    return record


def _write_hydra(run_dir: Path, files: dict) -> None:
    """The job's ``.hydra/`` (``HydraJob.files``: its config, Hydra's, the overrides), written by kvlab once the
    config is valid and the folder is its own (Hydra's own writing of it is off: conf/config.yaml)."""
    ownership.claim(run_dir, ".hydra")
    for fname, text in files.items():
        tracking.atomic_write(Path(run_dir) / ".hydra" / fname, text.encode())


def run_tags(rc: RunConfig, record: dict) -> list[str]:
    """W&B tags: experiment, model, cache kind, dtype, device, and whether the weights are random."""
    weights_tag = {"random": "random-weights", "pretrained": "pretrained"}.get(record.get("weights"), "weights-unknown")
    return [str(t)[:64] for t in (rc.experiment, record.get("model"), f"engine-{rc.engine.name}", rc.cache.kind,
                                  record.get("dtype"), rc.device, weights_tag)]


def hydra_overrides() -> str:
    """The command line's overrides of this job (W&B notes), or "defaults"."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "defaults"
    return " ".join(HydraConfig.get().overrides.task) or "defaults"


def _open_wandb(rc: RunConfig, record: dict, group: str, name: str, run_dir: Path, ident: str, notes: str):
    """The run's W&B run, opened as the measurement starts; trouble with W&B never costs the measurement. W&B gets
    the tracking choice and the resolved config as a plain dict (``RunConfig.resolved``)."""
    try:
        t = rc.tracking
        wb = tracking.WandbRun(t.mode, t.project, t.entity, group, name, run_dir, copy.deepcopy(rc.resolved),
                               run_id=wandb_id(run_dir, ident), tags=run_tags(rc, record), notes=notes)
        record.update(wandb=wb.where, wandb_id=wb.id)
        return wb
    except Exception as e:
        record.update(wandb=f"failed: {one_line(e)}", wandb_id=None)
        print(f"kvlab: W&B could not start ({record['wandb']}); the run goes on, results in {run_dir}",
              file=sys.stderr)
        return None


def _close_wandb(wb, record: dict, tables: dict, run_dir: Path, exit_code: int) -> None:
    if wb is None:
        return
    files = [run_dir / n for n in (*tracking.run_files(), ".hydra")]
    try:
        wb.finish(record, tables, files, exit_code)
    except Exception as e:  # the measurements are on disk already
        record["wandb"] = f"failed: {one_line(e)}"
        print(f"kvlab: W&B logging failed ({record['wandb']}); results are in {run_dir}", file=sys.stderr)
        _write(run_dir, record)


def _confirm(run_dir: Path, record: dict, inv: str, name: str) -> dict:
    """A complete run of the same config: keep its measurements, add this invocation to those that made or confirmed
    it (``invocations``), so every sweep that counts it, one running beside this one included, still finds it."""
    record = dict(record, invocation=inv, invocations=" ".join(dict.fromkeys(
        [*str(record.get("invocations") or record.get("invocation") or "").split(), inv])))
    _write(run_dir, record)
    print(f"kvlab: run {name} is complete (config {record['config_id']}, measured {record.get('finished_at')}): "
          "skipped; resume=false measures it again")
    return record


def _write(run_dir: Path, record: dict, tables: dict | None = None, log: str | None = None) -> bool:
    """Write the run's files; a write error is one line on stderr (the run then has no complete record)."""
    try:
        tracking.write_run_files(run_dir, record, tables, log)
        return True
    except OSError as e:
        note_failure(f"{run_dir} (cannot write: {e.strerror or e})")
        print(f"kvlab: cannot write the results of run {record['run_name']} to {run_dir}: {e.strerror or e}",
              file=sys.stderr)
        return False


def summary_text(r: dict, tables: dict) -> str:
    """The short table printed at the end of a run: a head, then each measurement's lines (``summary``)."""
    head = (f"kvlab run {r['run_name']}: model {r['model']} · engine {r.get('engine', 'kvlab')} · cache "
            f"{r.get('cache_label') or r['cache']} · dtype {r['dtype']}")
    if r["status"] != "ok":
        return f"{head}\n  FAILED: {r['error']}\n  record: {r['run_dir']}/results.json"
    files = [tracking.RESULTS, *(measurements.table(n)["file"] for n in tables if tables[n] is not None),
             tracking.LOG]
    skipped = [k.removesuffix("_skipped") for k in r if k.endswith("_skipped")]
    return "\n".join([
        head + f" · device {r['device']} ({r['device_name']})",
        f"  weights           {r['weights_detail']}" + (
            "" if r.get("outlier_scale") in (None, 1) else f"; one K and one V channel per head x{r['outlier_scale']:g}"
            " (model.outliers, function kept)"),
        *measurements.summary_lines(r, tables),
        *([f"  not measured      {', '.join(skipped)} (why: <name>_skipped in results.json)"] if skipped else []),
        f"  files             {r['run_dir']}  ({', '.join(files)})",
    ])

"""One run: build the model and cache from the config, call the measurements, hand the results to tracking.

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

import copy
import datetime as dt
import hashlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from harness import measure, tracking, weights
from harness.weights import Weights
from harness.config import ConfigError, cache_options, config_id, dtype_label, validate
from harness.engines import ENGINES, KvlabEngine
from models.gpt2 import GPT2, GPT2Config, read_hf_config
from models.kv_cache import as_dtype, cache_kind

# ---- identity, invocations, resume ------------------------------------------------------------------------------

def invocation() -> str:
    """The id of this ``run.py`` invocation (made by ``new_invocation`` in run.py; made here for plain Python use),
    shared with the jobs a launcher starts through the environment."""
    if not os.environ.get("KVLAB_INVOCATION"):
        new_invocation()
    return os.environ["KVLAB_INVOCATION"]


def new_invocation() -> str:
    """A fresh invocation id for this process and the jobs it starts: never one inherited from a parent process."""
    os.environ["KVLAB_INVOCATION"] = uuid.uuid4().hex[:12]
    return os.environ["KVLAB_INVOCATION"]


WHERE: dict = {}  # what this process ran: {"run": run folder} or {"sweep": folder, "since": time}, for the exit code


def note_sweep(folder: Path) -> None:
    WHERE.update(sweep=Path(folder), since=time.time() - 2)


def invocation_failures() -> list[str]:
    """Runs of this invocation that did not end ok, read from their files: failed or interrupted records, and job
    folders started by this invocation that have no results.json. Empty: every run is ok."""
    from harness.results import RESULTS, read_record

    inv, bad = invocation(), list(WHERE.get("failures", []))
    if "sweep" in WHERE:
        folders = job_folders(Path(WHERE["sweep"]))
    elif "run" in WHERE:
        folders = [Path(WHERE["run"])]
    else:
        return bad  # nothing was run (--cfg, --info, --help)
    for folder in folders:
        record, _ = read_record(folder / RESULTS)
        if record is None:
            if "run" in WHERE or started_at(folder) >= WHERE.get("since", 0):
                bad.append(f"{folder} (no complete results.json)")
        elif record.get("invocation") == inv and record.get("status") != "ok":
            bad.append(f"{folder} ({record.get('status')}: {record.get('error')})")
    return bad


ACTIVE = Path(tempfile.gettempdir()) / "kvlab-active"  # one file per kvlab run measuring on this machine


def _mark_active() -> Path:
    ACTIVE.mkdir(parents=True, exist_ok=True)
    me = ACTIVE / str(os.getpid())
    me.touch()
    return me


def concurrent_runs() -> int:
    """Other kvlab runs measuring on this machine now (their step times and ours share the cores)."""
    others = 0
    for f in ACTIVE.glob("*") if ACTIVE.is_dir() else []:
        if not f.name.isdigit() or int(f.name) == os.getpid():
            continue
        try:
            os.kill(int(f.name), 0)
            others += 1
        except ProcessLookupError:
            f.unlink(missing_ok=True)  # a run that died without cleaning up
        except PermissionError:
            others += 1  # alive, another user's
    return others


def job_folders(sweep: Path) -> list[Path]:
    """Every Hydra job folder under a sweep folder, at any depth (a subdir pattern may nest them)."""
    skip = {"wandb", "report", ".submitit"}
    return [h.parent for h in sorted(Path(sweep).rglob(".hydra"))
            if not skip & set(h.parent.relative_to(sweep).parts)]


def started_at(folder: Path) -> float:
    """When Hydra last started a job in ``folder``: it rewrites .hydra/config.yaml each time (the folder's own
    mtime does not change when a job is re-entered)."""
    f = Path(folder) / ".hydra" / "config.yaml"
    return f.stat().st_mtime if f.exists() else 0.0


PARTIAL = (*tracking.TABLES.values(), "results.json", "wandb")


def clear_partial(run_dir: Path) -> None:
    """Remove what an earlier, unfinished or failed attempt left in a run folder (Hydra's .hydra and log stay)."""
    for name in PARTIAL:
        p = Path(run_dir) / name
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.unlink()
    for tmp in Path(run_dir).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def completed(run_dir: Path, ident: str) -> dict | None:
    """The run folder's record when it is complete, ok and of this identity."""
    from harness.results import RESULTS, read_record

    record, _ = read_record(Path(run_dir) / RESULTS)
    ok = record is not None and record.get("status") == "ok" and record.get("config_id") == ident
    return record if ok else None


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


def model_config(w: Weights, m) -> GPT2Config | None:
    """The model's config, read cheaply before any weights (None for a hub id: known once loaded)."""
    if w.random:
        return GPT2Config.preset(m.preset)
    folder = Path(w.load_from)
    if folder.is_dir():
        return read_hf_config(folder)
    if getattr(m, "build", None):
        raise ConfigError(f"model={m.name} needs its checkpoint folder {m.weights}, which is missing: build it with "
                          f"`{m.build}`")
    return None


def build_model(w: Weights, m, cfg: GPT2Config | None) -> GPT2:
    if w.random:
        torch.manual_seed(m.seed)
        return GPT2(cfg).eval()
    return GPT2.from_pretrained(w.load_from).eval()


def weights_record(w: Weights | None, m) -> dict:
    """What results.json says of the weights: ``weights`` (random | pretrained), ``weights_source`` (random, the hub
    id or the folder), ``weights_detail`` (one line for people) and what was asked (``weights_requested``)."""
    if w is None:  # the request itself was refused; the run fails on it with its own message
        return dict(weights=None, weights_source=str(m.weights), weights_detail=f"checkpoint {m.weights}",
                    weights_requested=str(m.weights))
    return dict(weights=w.kind, weights_source=w.source, weights_detail=w.detail, weights_requested=str(m.weights))


def text_prompts(path: Path, n: int, length: int, tokenizer) -> list[torch.Tensor]:
    """``n`` prompts of exactly ``length`` tokens of real text: prompt i starts at paragraph i of the file and, when
    that paragraph is shorter, runs on into the paragraphs after it (wrapping around); past the last paragraph the
    starts shift by a few tokens so every prompt differs. Only as many paragraphs are tokenized as the prompts
    need, so a file of many lines costs what the prompts read."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"prompts_file {path} is a folder: point it at a text file with one paragraph per line")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"prompts_file {path} is not UTF-8 text: give a text file with one paragraph per "
                          "line, or use prompts=random") from None
    paragraphs = [p.strip() for p in text.splitlines() if p.strip()]
    if not paragraphs:
        raise ConfigError(f"prompts_file {path} has no text: give a file with one paragraph per line")
    ids: list[list[int]] = []
    starts: list[int] = []
    total = 0
    for p in paragraphs:  # until the last prompt's start (and a prompt's length after it) is tokenized
        if len(ids) >= min(n, len(paragraphs)) and total >= starts[min(n, len(paragraphs)) - 1] + length + 7 * n:
            break
        starts.append(total)
        ids.append(tokenizer.encode(p + "\n\n"))
        total += len(ids[-1])
    stream = [t for p in ids for t in p]
    prompts = []
    for i in range(n):
        start = starts[i % len(ids)] + 7 * (i // len(ids))
        window = [stream[(start + j) % len(stream)] for j in range(length)]
        prompts.append(torch.tensor([window]))
    return prompts


def batch_lengths(batch: int, prompt_len: int, kind: str, seed: int) -> list[int]:
    """The served batch's prompt lengths: all ``prompt_len`` (uniform), or drawn uniformly from 1 .. prompt_len with
    the first one ``prompt_len`` (ragged: the batch is as wide as a uniform one; seeded)."""
    if kind == "uniform" or batch == 1:
        return [prompt_len] * batch
    g = torch.Generator().manual_seed(seed)
    return [prompt_len] + torch.randint(1, prompt_len + 1, (batch - 1,), generator=g).tolist()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, length), generator=g) for _ in range(n)]


# ---- the run ---------------------------------------------------------------------------------------------------

def default_group(experiment_name: str, folder: str) -> str:
    """The W&B group of a sweep's runs (or of a single run): ``<experiment>-<sweep folder>``, the folder being named
    by the time it started."""
    return f"{experiment_name}-{folder}"[:128]


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


def model_label(m) -> str:
    """How runs are labelled: the model's name; on a checkpoint folder whose name was left at the preset's, the
    folder's name is added (unless it is the model's name), so runs on two checkpoints never share a label."""
    if m.weights in ("random", "auto") or m.name != m.preset or Path(str(m.weights)).name == m.name:
        return m.name
    return f"{m.name}@{Path(str(m.weights)).name}"


def config_record(cfg) -> dict:
    return dict(
        model=model_label(cfg.model), preset=cfg.model.preset if cfg.model.weights in ("random", "auto") else None,
        model_seed=cfg.model.seed, engine=engine_name(cfg), cache=cfg.cache.kind,
        **cache_record(cfg.cache, engine_name(cfg)),
        dtype=dtype_label(cfg.dtype.storage, cfg.dtype.compute),
        device_requested=cfg.device.name, experiment=cfg.experiment, n_prompts=cfg.n_prompts,
        new_tokens=cfg.new_tokens, prompt_len=cfg.prompt_len, max_len=cfg.max_len, batch=cfg.get("batch", 1),
        compile=bool(cfg.get("compile", False)),
        prompt_lengths=cfg.get("prompt_lengths", "uniform"),
        context_lengths=None if cfg.context_lengths is None else ",".join(str(c) for c in cfg.context_lengths),
        repeats=cfg.repeats, warmup=cfg.warmup,
        seed=cfg.seed, prompts=cfg.prompts)


def engine_name(cfg) -> str:
    return str(cfg.get("engine", {}).get("name", "kvlab"))


def cache_record(node, engine: str = "kvlab") -> dict:
    """The cache's label, whether it is exact, and its options as ``cache_<option>`` columns. On another engine
    than kvlab's the label says which (``prealloc · hf``), so its runs are their own series in every table and
    plot."""
    options = cache_options(node)
    try:
        cls = cache_kind(node.kind)
        opts = cls.parse_options(**options)
        head = dict(cache_label=cls.label(opts) + ("" if engine == "kvlab" else f" · {engine}"),
                    cache_exact=cls.exact)
    except ValueError:  # recorded as given; the run fails on it with its own message
        head = dict(cache_label=str(node.kind), cache_exact=None)
    return {**head, **{f"cache_{k}": v for k, v in options.items()}}


def measure_run(cfg, w: Weights | None = None, progress: bool = True):
    """Everything a run measures -> (record fields, steps table, drift table, memory table). Raises on any
    failure."""
    from models.tokenizer import Tokenizer

    w = w or weights.resolve(cfg.model)
    mcfg = model_config(w, cfg.model)
    max_len, contexts = validate(cfg, mcfg.n_positions) if mcfg is not None else (None, None)
    device = resolve_device(cfg.device.name)
    storage, compute = resolve_dtypes(cfg.dtype.storage, cfg.dtype.compute, device)

    model32 = build_model(w, cfg.model, mcfg)
    if mcfg is None:  # a hub checkpoint: validate now that its config is known
        mcfg = model32.config
        max_len, contexts = validate(cfg, mcfg.n_positions)
    model32 = model32.to(device)
    model = model32 if compute == torch.float32 else copy.deepcopy(model32).to(compute)
    compiled = bool(cfg.get("compile", False))
    engine = KvlabEngine(model, compile=True) if compiled else ENGINES[engine_name(cfg)](model)
    spec = measure.CacheSpec(cfg.cache.kind, cache_options(cfg.cache), storage)
    # drift (against FP32 full attention) is measured for every run that is not that reference itself
    plain_fp32 = storage == compute == torch.float32 and spec.cls.exact and not spec.reference
    ref32 = None if plain_fp32 else (engine if compute == torch.float32 and engine.name == "kvlab"
                                     else KvlabEngine(model32))  # the reference is always kvlab's fp32
    text_len = min(max_len, max(cfg.drift_text_len, cfg.prompt_len + 1))  # drift on text: prompt + continuation
    if cfg.prompts == "file":
        path = Path(cfg.prompts_file)
        path = path if path.is_absolute() else measure.REPO / path
        if not path.is_file():
            raise ConfigError(f"prompts_file {path} does not exist: point prompts_file at a text file or use "
                              "prompts=random")
        prompts = text_prompts(path, cfg.n_prompts, cfg.prompt_len, Tokenizer())
        if mcfg.vocab_size < Tokenizer.VOCAB_SIZE:
            raise ConfigError(f"prompts=file uses GPT-2's {Tokenizer.VOCAB_SIZE:,}-token vocabulary, but model "
                              f"{cfg.model.name} has vocab_size {mcfg.vocab_size:,}: use prompts=random")
        texts = text_prompts(path, cfg.n_prompts, text_len, Tokenizer()) if ref32 is not None else None
        served = text_prompts(path, cfg.batch, cfg.prompt_len, Tokenizer())
    else:
        prompts = random_prompts(cfg.n_prompts, cfg.prompt_len, mcfg.vocab_size, cfg.seed)
        texts = random_prompts(cfg.n_prompts, text_len, mcfg.vocab_size, cfg.seed) if ref32 is not None else None
        served = random_prompts(cfg.batch, cfg.prompt_len, mcfg.vocab_size, cfg.seed)
    lengths = batch_lengths(cfg.batch, cfg.prompt_len, cfg.prompt_lengths, cfg.seed)
    served = [p[0, :n] for p, n in zip(served, lengths)]  # (n,) each
    prompts = [p.to(device) for p in prompts]
    texts = texts and [t.to(device) for t in texts]
    full = cfg.full_prompts if cfg.full_prompts is not None else (1 if device.type == "cpu" else cfg.n_prompts)
    full = min(full, cfg.n_prompts)
    reset_ok = measure.reset_peak_memory(device)

    rec = dict(device=device.type, storage_dtype=str(storage).removeprefix("torch."),
               compute_dtype=str(compute).removeprefix("torch."), max_len=max_len, n_layer=mcfg.n_layer,
               n_head=mcfg.n_head, n_embd=mcfg.n_embd, n_params=model.num_params(), full_prompts=full,
               context_lengths=",".join(map(str, contexts)),
               drift_reference=None if ref32 is None else "fp32 full attention (uncached)")
    checks, drift = measure.generation_checks(engine, prompts, cfg.new_tokens, spec, full, ref32, progress, texts)
    layers = checks.pop("layers")
    layers = pd.DataFrame(columns=["layer", "k_rel_err", "v_rel_err"]) if layers is None else layers
    tok, sample = Tokenizer(), checks.pop("sample_tokens")
    rec.update(checks, sample_prompt=tok.decode(prompts[0][0].tolist()), sample_text=tok.decode(sample))
    mem, memory = measure.cache_memory(engine, spec, prompts[0], cfg.new_tokens, max_len)
    rec.update(mem)
    others = concurrent_runs()
    steps = measure.step_times(engine, spec, contexts, max_len, cfg.repeats, cfg.warmup, device, cfg.seed,
                               progress)
    rec.update(measure.time_to_first_token(engine, spec, prompts[0], max_len, cfg.repeats, cfg.warmup, device))
    rec.update(measure.peak_memory(device, reset_ok))  # the run's own peak: before the probes' buffers and batches
    steps = measure.with_bandwidth(steps, engine, spec, max_len)
    rec.update(measure.bandwidth_probe(device, measure.weight_bytes(model)))
    rec.update(measure.cost_model(steps))
    # the context from which a step reads more K/V than weights (batch 1); never, for a kind that caps its reads
    capped = measure.keys_read(engine, spec, max_len, max_len - 1) < max_len
    rec["kv_overtakes_weights_at_context"] = None if capped else measure.weight_bytes(model) / rec["bytes_per_token"]
    batches = None
    if cfg.get("batch_sizes"):
        batches = measure.batch_throughput(engine, spec, list(cfg.batch_sizes), min(cfg.batch_context, max_len - 1),
                                           max_len, cfg.repeats, cfg.warmup, device, cfg.seed, progress)
    rec.update(measure.batch_summary(batches))
    if compiled:  # its own time, and whether the compiled step equals the eager one
        rec.update(engine.compile_stats, compile_mode="reduce-overhead" if device.type == "cuda" else "default",
                   **measure.compiled_equivalence(engine, KvlabEngine(model), spec, prompts[0], cfg.new_tokens,
                                                  max_len))
    rec.update(measure.serve_batch(engine, spec, served, cfg.new_tokens, max_len, min(cfg.repeats, 3), 1, device,
                                   check=spec.cls.exact))  # always one warm-up: a compiled step compiles in it
    rec["concurrent_runs_while_timing"] = max(others, concurrent_runs())
    if rec["concurrent_runs_while_timing"]:
        print(f"kvlab: {rec['concurrent_runs_while_timing']} other kvlab run(s) measured on this machine while this "
              "one timed its steps: its step times share their cores (README: Scaling out)", file=sys.stderr)
    top = steps[steps.context_len == steps.context_len.max()].set_index("mode")
    rec.update(max_context_len=int(steps.context_len.max()),
               step_ms_cached_at_max_context=float(top.loc["cached", "ms_median"]),
               step_ms_uncached_at_max_context=float(top.loc["uncached", "ms_median"]),
               speedup_at_max_context=float(top.loc["cached", "speedup"]),
               weight_bytes=int(top.loc["cached", "weight_bytes"]),
               kv_bytes_at_max_context=int(top.loc["cached", "kv_bytes"]),
               gb_per_s_at_max_context=float(top.loc["cached", "gb_per_s"]),
               bw_fraction_at_max_context=float(top.loc["cached", "gb_per_s"]) / rec["probe_gbps"],
               flop_per_byte_at_max_context=float(top.loc["cached", "flop_per_byte"]))
    rec.update(measure.fingerprint(device), **weights_record(w, cfg.model))
    return rec, dict(steps=steps, drift=drift, memory=memory, layers=layers, batches=batches)


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or "(no message)"
    return msg if isinstance(e, ConfigError) else f"{type(e).__name__}: {msg}"


def run(cfg: DictConfig, progress: bool = True) -> dict:
    """One run from a composed config. Writes the run's files and its W&B run; never raises for a failed run (a
    Ctrl-C records the run as interrupted and stops the process with exit code 130)."""
    run_dir, folder, name = _hydra_dirs()
    group = cfg.tracking.group or default_group(cfg.experiment, folder)
    ident, inv = config_id(cfg), invocation()
    WHERE.setdefault("run", run_dir)
    try:  # decided once per process (weights=auto may ask the hub, a bounded wait)
        w = weights.resolve(cfg.model)
    except KeyboardInterrupt:
        print(f"kvlab: run {name} interrupted before it started; the same command runs it", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception:  # measure_run asks again and fails the run with its own message
        w = None
    prior = completed(run_dir, ident) if cfg.get("resume", True) else None
    if prior is not None and w is not None and prior.get("weights_source") not in (None, w.source):
        print(f"kvlab: run {name} was measured on {prior['weights_source']} but model.weights={cfg.model.weights} now "
              f"gives {w.source}: measuring it again", file=sys.stderr)
        prior = None
    if prior is not None:
        return _confirm(run_dir, prior, inv, name)
    clear_partial(run_dir)
    record = dict(status="failed", error=None, run_name=name, group=group, run_dir=str(run_dir), config_id=ident,
                  invocation=inv, device=cfg.device.name, **weights_record(w, cfg.model),
                  started_at=dt.datetime.now().isoformat(timespec="seconds"), **config_record(cfg))
    tables: dict = {}
    wb = None
    t0 = time.perf_counter()
    active = _mark_active()
    try:
        wb = _open_wandb(cfg, record, group, name, run_dir, ident)
        fields, tables = measure_run(cfg, w, progress)
        record.update(fields, status="ok")
    except KeyboardInterrupt:
        record.update(status="interrupted", error="interrupted (Ctrl-C); run the same command again to resume",
                      duration_s=round(time.perf_counter() - t0, 2))
        _write(run_dir, record)
        _close_wandb(wb, record, {}, run_dir, exit_code=130)
        print(f"kvlab: run {name} interrupted; its record says so ({run_dir}). The same command resumes.",
              file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:  # recorded, never raised: the sweep goes on
        record["error"] = one_line(e)
        print(f"kvlab: run {name} failed: {record['error']}", file=sys.stderr)
    finally:
        active.unlink(missing_ok=True)
    record["duration_s"] = round(time.perf_counter() - t0, 2)
    record["finished_at"] = dt.datetime.now().isoformat(timespec="seconds")
    for df in tables.values():
        if df is not None:
            for i, k in enumerate(("model", "engine", "cache", "cache_label", "dtype", "device")):
                df.insert(i, k, record.get(k))
    if not _write(run_dir, record, tables):
        _close_wandb(wb, record, tables, run_dir, exit_code=1)
        return record
    _close_wandb(wb, record, tables, run_dir, exit_code=0 if record["status"] == "ok" else 1)
    print(summary_text(record, tables.get("steps")))
    return record


def run_tags(cfg, record: dict) -> list[str]:
    """W&B tags: experiment, model, cache kind, dtype, device, and whether the weights are random."""
    weights_tag = {"random": "random-weights", "pretrained": "pretrained"}.get(record.get("weights"), "weights-unknown")
    return [str(t)[:64] for t in (cfg.experiment, record.get("model"), f"engine-{engine_name(cfg)}", cfg.cache.kind,
                                  record.get("dtype"), cfg.device.name, weights_tag)]


def hydra_overrides() -> str:
    """The command line's overrides of this job (W&B notes), or "defaults"."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "defaults"
    return " ".join(HydraConfig.get().overrides.task) or "defaults"


def _open_wandb(cfg, record: dict, group: str, name: str, run_dir: Path, ident: str):
    """The run's W&B run, opened as the measurement starts; trouble with W&B never costs the measurement."""
    try:
        wb = tracking.WandbRun(cfg.tracking.mode, cfg.tracking.project, cfg.tracking.entity, group, name, run_dir,
                               OmegaConf.to_container(cfg, resolve=True), run_id=wandb_id(run_dir, ident),
                               tags=run_tags(cfg, record), notes=hydra_overrides())
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
    files = [run_dir / n for n in (tracking.RESULTS, *tracking.TABLES.values(), ".hydra", "run.log")]
    try:
        wb.finish(record, tables, files, exit_code)
    except Exception as e:  # the measurements are on disk already
        record["wandb"] = f"failed: {one_line(e)}"
        print(f"kvlab: W&B logging failed ({record['wandb']}); results are in {run_dir}", file=sys.stderr)
        _write(run_dir, record)


def wandb_id(folder: Path, ident: str) -> str:
    """The W&B run id of a config measured in ``folder``: the same when the run is resumed there, so W&B continues
    it instead of adding one; a different folder (another sweep, a single run) is another W&B run."""
    return hashlib.sha256(f"{Path(folder).resolve()}/{ident}".encode()).hexdigest()[:16]


def _confirm(run_dir: Path, record: dict, inv: str, name: str) -> dict:
    """A complete run of the same config: keep its measurements, stamp this invocation on it."""
    record = dict(record, invocation=inv)
    _write(run_dir, record)
    print(f"kvlab: run {name} is complete (config {record['config_id']}, measured {record.get('finished_at')}): "
          "skipped; resume=false measures it again")
    return record


def _write(run_dir: Path, record: dict, tables: dict | None = None) -> bool:
    """Write the run's files; a write error is one line on stderr (the run then has no complete record)."""
    try:
        tracking.write_run_files(run_dir, record, tables)
        return True
    except OSError as e:
        WHERE.setdefault("failures", []).append(f"{run_dir} (cannot write: {e.strerror or e})")
        print(f"kvlab: cannot write the results of run {record['run_name']} to {run_dir}: {e.strerror or e}",
              file=sys.stderr)
        return False


def summary_text(r: dict, steps) -> str:
    """The short table printed at the end of a run."""
    head = (f"kvlab run {r['run_name']}: model {r['model']} · engine {r.get('engine', 'kvlab')} · cache "
            f"{r.get('cache_label') or r['cache']} · dtype {r['dtype']}")
    if r["status"] != "ok":
        return f"{head}\n  FAILED: {r['error']}\n  record: {r['run_dir']}/results.json"

    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    lines = [
        head + f" · device {r['device']} ({r['device_name']})",
        f"  weights           {r['weights_detail']}",
        f"  tokens identical  {r['tokens_identical']}  ({r['equivalence_method']}, {r['n_prompts']} prompts x "
        f"{r['new_tokens']} tokens)" + ("  lossy kind: this is its error" if r.get("cache_exact") is False else ""),
        f"  max |dlogit|      {r['max_abs_logit_diff']:.3g}  (cached vs the kind's uncached reference, same compute "
        "dtype)",
        f"  sample            {r['sample_prompt'][-40:]!r} -> {r['sample_text'][:40]!r}",
        f"  cache bytes       {r['cache_nbytes']:,} measured = {r['predicted_nbytes']:,} formula: "
        f"{r['nbytes_match']}  ({r['bytes_per_token']:,.0f} B/token, {r['cache_tokens']} tokens held)",
        f"  drift vs fp32     text: KL mean {f(r.get('drift_kl'), '.3g')} "
        f"(decode {f(r.get('drift_kl_decode'), '.3g')}) · p99 {f(r.get('drift_kl_p99'), '.3g')} · "
        f"max {f(r.get('drift_kl_max'), '.3g')} · dNLL {f(r.get('drift_delta_nll'), '+.3g')} nats/token · RMS dp "
        f"{f(r.get('drift_rms_dp'), '.3g')} · same top-1 {f(r.get('drift_same_top1'), '.1%')}",
        f"                    generation: max |d| {f(r['drift_max_abs'], '.3g')} · top-1 "
        f"{f(r['drift_top1_agreement'], '.1%')} · token match {f(r['drift_token_match_rate'], '.1%')}"
        + (f" · {r['drift_divergence_diagnosis']}" if r.get("drift_divergence_diagnosis") else ""),
        *([f"  K/V vs fp32       K max {f(r.get('drift_k_rel_err_max'), '.3g')} · V max "
           f"{f(r.get('drift_v_rel_err_max'), '.3g')} (relative, vs fp32) · first layer over "
           f"{r['drift_layer_tol']:g}: {f(r.get('drift_first_layer_over_tol'), 'd')}"]
          if r.get("drift_layer_tol") is not None else []),
        *([f"  text NLL          {r['text_nll_fp32']:.3f} nats/token in fp32 (the model on the prompts' text)"]
          if r.get("text_nll_fp32") is not None else []),
        f"  TTFT              {r['ttft_ms']:.1f} ms ({r['prompt_len']}-token prompt)",
        *([f"  compiled step     compile {r['compile_s']:.1f} s + warm-up {r['compile_warmup_s']:.2g} s (not in step "
           f"times; mode {r['compile_mode']}), {r['compile_graphs']} graph, {r['compile_recompiles']} recompiles over "
           f"{r['compiled_steps']} steps, {r['compile_cudagraph_skips']} CUDA-graph skips; = eager: "
           f"{r['compile_tokens_identical']} (max |dlogit| {r['compile_max_abs_logit']:.2g})"]
          if r.get("compile_s") is not None else []),
        *([f"  served batch      {r['serve_batch']} x {r.get('prompt_lengths', 'uniform')} prompts "
           f"({r['serve_shortest_prompt']}..{r['serve_longest_prompt']} tokens) + {r['new_tokens']} new: "
           f"{r['tokens_per_s']:,.0f} tokens/s · KV waste {r['kv_waste']:.1%} ({r['kv_token_slots']:,} of "
           f"{r['kv_held_slots']:,} held slots hold a token)"
           + ("" if r.get("serve_tokens_identical") is None else
              f" · each sequence = its own reference: {r['serve_tokens_identical']} "
              f"(max |dlogit| {r['serve_max_abs_logit']:.2g})")]
          if r.get("tokens_per_s") is not None and r.get("kv_waste") is not None else []),
        *(f"  decode step       ctx {c:>4}: {g.loc['cached', 'ms_median']:8.2f} ms cached   "
          f"{g.loc['uncached', 'ms_median']:8.2f} ms uncached   {g.loc['cached', 'speedup']:5.1f}x"
          for c, g in ((c, g.set_index("mode")) for c, g in steps.groupby("context_len"))),
        f"  files             {r['run_dir']}  (results.json, steps.csv, drift.csv, memory.csv, layers.csv"
        f"{', batches.csv' if r.get('batch_max') else ''})",
    ]
    return "\n".join(lines)

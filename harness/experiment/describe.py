"""What a run records of itself in words and plain values: its model's label, its config's and cache's record
(the kind's facts included), the measurements asked, its verdict (ok, or not equivalent and why) and the summary it
prints."""

from __future__ import annotations

from pathlib import Path

import torch

from harness import measurements
from harness.experiment import tracking
from harness.experiment.weights import Weights
from harness.experiment.config import dtype_label, engine_options
from harness.experiment.plan import CacheChoice, ModelChoice, RunConfig
from harness.core.engines import ENGINES
from models.kv_cache import cache_kind


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
        cache_target=rc.cache.target,
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


def run_tags(rc: RunConfig, record: dict) -> list[str]:
    """W&B tags: experiment, model, cache kind, dtype, device, and whether the weights are random."""
    weights_tag = {"random": "random-weights", "pretrained": "pretrained"}.get(record.get("weights"), "weights-unknown")
    return [str(t)[:64] for t in (rc.experiment, record.get("model"), f"engine-{rc.engine.name}", rc.cache.kind,
                                  record.get("dtype"), rc.device, weights_tag)]


def weights_record(w: Weights | None, m: ModelChoice) -> dict:
    """What results.json says of the weights: ``weights`` (random | pretrained), ``weights_source`` (random, the hub
    id or the folder), ``weights_detail`` (one line for people) and what was asked (``weights_requested``)."""
    if w is None:  # the request itself was refused; the run fails on it with its own message
        return dict(weights=None, weights_source=str(m.weights), weights_detail=f"checkpoint {m.weights}",
                    weights_requested=str(m.weights))
    return dict(weights=w.kind, weights_source=w.source, weights_detail=w.detail, weights_requested=str(m.weights))

"""Synthetic sweeps of the paper presets for the findings and scorecard tests: results rows as runs record them, per-
position rows whose means are the runs' own figures, and the presets' grids with made-up numbers whose verdicts are
worked out from them."""

import zlib

import numpy as np
import pandas as pd

from harness.analysis import papers
from harness.analysis.papers import claim_rows


def run(name, cache="quant", status="ok", dtype="fp32", exact=None, **values):
    """One results row as a run records it; ``cache_<option>`` columns for the kind's options, and what the run
    records of its kind with them (``kind_facts``)."""
    exact = values.pop("cache_exact", cache in ("prealloc", "concat", "window", "h2o") if exact is None else exact)
    label = values.pop("label", values.pop("cache_label", None)) or cache + "".join(
        f" {k[6:]}{v}" for k, v in values.items() if k.startswith("cache_") and k != "cache_nbytes")
    return {**dict(run_name=name, status=status, model="mini", engine="kvlab", cache=cache, cache_label=label,
                   cache_exact=exact, dtype=dtype, storage_dtype="float32" if dtype == "fp32" else "float16",
                   compute_dtype="float32", device="cpu", batch=1), **kind_facts(cache, values), **values}


def kind_facts(cache: str, values: dict) -> dict:
    """What a run records of its kind with the options among ``values`` (``cache_<option>``), as the run layer
    works it out: whether it is full attention, and which options the others imply."""
    from harness.experiment.plan import CacheChoice
    from harness.experiment.describe import cache_record
    from models.kv_cache import CACHE_KINDS

    if cache not in CACHE_KINDS:
        return {}
    names = CACHE_KINDS[cache].option_types()
    options = {k[6:]: v for k, v in values.items() if k.startswith("cache_") and k[6:] in names}
    rec = cache_record(CacheChoice(cache, options))
    return {k: rec[k] for k in ("cache_full_attention", "cache_implied") if k in rec}


def frame(*rows) -> pd.DataFrame:
    return pd.DataFrame(list(rows))


def paper_run(preset, name, **values):
    """One ok run of ``preset``'s setting as a run records it: the kind, dtype, engine and cache options its YAML
    states, trained weights, the prompts file, and texts and copies of the lengths it asks for; ``values`` on top."""
    p = papers.preset(preset)
    n = p.fixed.get("drift_texts", p.fixed["n_prompts"])
    cols = dict(experiment=preset, engine=p.fixed["engine"], prompts=p.fixed["prompts"], weights="pretrained",
                n_prompts=p.fixed["n_prompts"], drift_texts=n, drift_text_positions=n * (p.fixed["drift_text_len"] - 1),
                retrieval_n=p.fixed.get("retrieval_n", 200), retrieval_first_copy_acc=0.0, outlier_scale=1.0)
    cols.update({f"cache_{k[len('cache.'):]}": v for k, v in p.fixed.items() if k.startswith("cache.")})
    cols.update(values)
    return run(name, cols.pop("cache", p.fixed["cache"]), dtype=cols.pop("dtype", p.fixed["dtype"]), **cols)


N_TEXTS, PER_TEXT, N_SEQ, PER_SEQ = 24, 4, 16, 20


def positions_of(runs: pd.DataFrame, noise: float = 0.02, n_texts: int = N_TEXTS,
                 n_seq: int = N_SEQ) -> dict[str, pd.DataFrame]:
    """Per-position rows for each run, as text_drift and retrieval write them, whose means are the run's own
    figures: text t's KL (and ΔNLL) is the run's times an effect of that text shared by every run (texts differ,
    and runs pair on them), times ``noise`` of the run's own; copy accuracy per sequence drawn around the run's.
    ``n_texts`` texts and ``n_seq`` sequences a run."""
    effects = np.random.default_rng(0).lognormal(0.0, 0.5, n_texts)
    effects /= effects.mean()
    text, copy = [], []
    for _, r in runs.iterrows():
        name = r["run_name"]
        rng = np.random.default_rng(zlib.crc32(str(name).encode()))

        def got(key):
            return None if key not in r or pd.isna(r[key]) else float(r[key])

        dnll = got("drift_delta_nll")
        if dnll is None and got("text_nll") is not None:
            dnll = got("text_nll") - got("text_nll_fp32")
        kl = got("drift_kl") if got("drift_kl") is not None else dnll
        if kl is not None:
            for t in range(n_texts):
                e = effects[t] * (1 + noise * rng.standard_normal(PER_TEXT))
                for p in range(PER_TEXT):
                    text.append(dict(run_name=name, text=t, position=p, text_id=f"t{t:03d}", decoded=1,
                                     kl=kl * e[p], nll=3.0 + (kl if dnll is None else dnll) * e[p], nll_fp32=3.0,
                                     same_top1=1))
        acc, ref = got("retrieval_acc"), got("retrieval_acc_ref")
        if acc is not None:
            for q in range(n_seq):
                hits = rng.random(PER_SEQ) < acc
                for p in range(PER_SEQ):
                    copy.append(dict(run_name=name, sequence=q, position=p, seq_id=f"s{q:03d}",
                                     correct=int(hits[p]), correct_ref=int(p < round((ref or 0) * PER_SEQ))))
    return {"text_positions": pd.DataFrame(text), "retrieval_positions": pd.DataFrame(copy)}


def judged(runs: pd.DataFrame, **kw) -> list:
    """The claims of ``runs`` with per-position rows made from their own figures."""
    return claim_rows(runs, positions_of(runs, **kw))


def streaming_sweep(dnll, **values):
    budget = papers.preset("paper_streamingllm").fixed["cache.budget"]
    values = {"retrieval_acc": 0.01, "retrieval_acc_ref": 0.2, **values}
    return frame(*[paper_run("paper_streamingllm", f"s{s}", cache_sinks=s, cache_window=budget - s, drift_delta_nll=d,
                             **values) for s, d in zip(papers.SINKS, dnll)])


def kivi_sweep(flip=False, v_flip=False, outlier_flip=False, **values):
    """The KIVI runs (2 bits; K and V each per channel or per token; residual 0 and 32; outlier scale 1 and 20):
    KL lowest with K per channel (``flip``: per token) and V per token (``v_flip``: per channel);
    ``outlier_flip``: K per token wins at scale 1, per channel at 20 (the cause present)."""
    def kl(k, v, s):
        k_wins = (k == "channel") != (flip or (outlier_flip and s == 1))
        return (0.1 if k_wins else 0.3) * (1 if (v == "token") != v_flip else 2)
    return frame(*[paper_run("paper_kivi", f"{k[0]}{v[0]}r{r}s{s}", cache_k_axis=k, cache_v_axis=v, cache_residual=r,
                             outlier_scale=float(s), drift_kl=kl(k, v, s) * (0.5 if r else 1), drift_kl_p99=0.1,
                             **values)
                   for s in papers.OUTLIERS for r in papers.KIVI_RESIDUALS for k in ("channel", "token")
                   for v in ("token", "channel")])

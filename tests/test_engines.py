"""Both engines behind one interface: HF transformers' GPT-2 on our weights generates our tokens with its
counterpart caches, and rewinding, checkpoints and byte counts work on DynamicCache and StaticCache."""

import pytest
import torch

from harness.engines import HF_COUNTERPARTS, HFEngine, KvlabEngine
from models.kv_cache import kv_bytes


@pytest.fixture(scope="module")
def engines(tiny_model):
    return KvlabEngine(tiny_model), HFEngine(tiny_model)


@pytest.mark.parametrize("kind", list(HF_COUNTERPARTS))
def test_hf_greedy_equals_ours_on_the_same_weights(engines, kind):
    ours, hf = engines
    g = torch.Generator().manual_seed(0)
    for T in (1, 9, 24):
        prompt = torch.randint(0, 50257, (2, T), generator=g)
        a = ours.greedy(prompt, 20, layout=kind)
        b = hf.greedy(prompt, 20, layout=kind)
        assert torch.equal(a.tokens, b.tokens)
        assert (a.logits - b.logits).abs().max().item() <= 1e-4
    assert torch.equal(hf.greedy(prompt, 5).tokens, ours.greedy(prompt, 5).tokens)  # uncached too


@pytest.mark.parametrize("kind", list(HF_COUNTERPARTS))
def test_hf_rewind_checkpoint_and_nbytes(engines, kind):
    _, hf = engines
    c = hf.model.config
    prompt = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = hf.new_cache(kind, max_len=32)
    assert type(cache).__name__ == HF_COUNTERPARTS[kind][0]
    hf.prefill(prompt, cache)
    held = 12 if kind == "concat" else 32
    assert hf.nbytes(cache) == kv_bytes(c.n_layer, c.n_head, c.n_embd // c.n_head, held)
    token = torch.tensor([[42]])
    first = hf.decode(token, cache)
    hf.rewind(cache, 1)
    assert int(cache.get_seq_length()) == 12
    assert torch.equal(hf.decode(token, cache), first)  # the same step again, at the same position
    back = hf.checkpoint(cache)
    hf.decode(token, cache)
    back()
    assert int(cache.get_seq_length()) == 13
    if kind == "concat":
        assert hf.nbytes(cache) == kv_bytes(c.n_layer, c.n_head, c.n_embd // c.n_head, 13)
    hf.reset(cache)
    assert int(cache.get_seq_length()) == 0


def test_hf_refuses_what_it_has_no_counterpart_of(engines):
    _, hf = engines
    with pytest.raises(ValueError, match="no counterpart of cache kind 'window' here: it runs concat"):
        hf.new_cache("window", max_len=16)
    with pytest.raises(ValueError, match="full attention only"):
        hf.forward(torch.tensor([[1, 2, 3]]), window=2, sinks=0)
    with pytest.raises(ValueError, match="in the model dtype"):
        hf.new_cache("prealloc", max_len=16, dtype=torch.float16)


@pytest.mark.slow
def test_hf_is_a_peer_in_the_grid(tmp_path):
    """`-m engine=kvlab,hf cache=concat,prealloc`: four comparable runs, measured the same way, told apart by their
    engine in every table."""
    import json

    from tests.conftest import TINY, run_py

    sweep = tmp_path / "sweep"
    proc = run_py(["-m", "engine=kvlab,hf", "cache=concat,prealloc", *TINY, "batch_sizes=[1,2]", "batch_context=8",
                   "tracking=disabled", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [json.loads(p.read_text()) for p in sweep.glob("*/results.json")]
    got = {(r["engine"], r["cache"]): r for r in runs}
    assert set(got) == {(e, c) for e in ("kvlab", "hf") for c in ("concat", "prealloc")}
    for (engine, cache), r in got.items():
        assert r["status"] == "ok" and r["tokens_identical"] and r["nbytes_match"], r
        assert r["cache_label"] == (cache if engine == "kvlab" else f"{cache} · hf")
    for e in ("kvlab", "hf"):  # same weights, same bytes: HF's caches hold what ours hold
        assert got[(e, "concat")]["cache_nbytes"] == got[("kvlab", "concat")]["cache_nbytes"]
        assert got[(e, "prealloc")]["cache_nbytes"] == got[("kvlab", "prealloc")]["cache_nbytes"]
    import pandas as pd

    steps = pd.read_csv(sweep / "report" / "steps.csv")
    assert set(steps.engine) == {"kvlab", "hf"} and steps.cache_label.nunique() == 4
    # ours / HF from this one sweep: every (cache, context) at batch 1 from steps.csv, and batch 2 from batches.csv
    ratios = pd.read_csv(sweep / "report" / "engine_ratios.csv")
    assert set(zip(ratios.cache, ratios.context_len, ratios.batch)) == {
        (c, t, 1) for c in ("concat", "prealloc") for t in (8, 32)} | {(c, 8, 2) for c in ("concat", "prealloc")}
    cached = steps[steps["mode"] == "cached"].set_index(["engine", "cache", "context_len"]).ms_median
    for _, r in ratios[ratios.batch == 1].iterrows():
        assert r.ours_over_hf == pytest.approx(cached["kvlab", r.cache, r.context_len]
                                               / cached["hf", r.cache, r.context_len])
    assert "ours / HF cached decode-step time" in proc.stdout
    batches = pd.read_csv(sweep / "report" / "batches.csv")
    for _, g in batches.groupby("run_name"):
        g = g.set_index("batch")
        assert g.loc[2, "kv_bytes"] == 2 * g.loc[1, "kv_bytes"] and g.loc[2, "weight_bytes"] == g.loc[1, "weight_bytes"]
        assert g.loc[2, "tokens_per_s"] == pytest.approx(2 / (g.loc[2, "ms_median"] * 1e-3))


def test_bytes_read_count_what_each_engines_cache_hands_attention(engines):
    """HF's StaticCache returns all max_len slots to attention every step (masked): a step reads them all; its
    DynamicCache and our kinds read the ctx + 1 tokens held."""
    from harness.measure import CacheSpec, kv_read_bytes

    ours, hf = engines
    c = ours.model.config
    per_token = 2 * c.n_layer * c.n_embd * 4
    for e in (ours, hf):
        assert kv_read_bytes(e, CacheSpec("concat"), 64, 10) == per_token * 11
    assert kv_read_bytes(ours, CacheSpec("prealloc"), 64, 10) == per_token * 11
    assert kv_read_bytes(hf, CacheSpec("prealloc"), 64, 10) == per_token * 64

"""Retrieval by depth: the depth view's sequences (a span from each depth bucket of a random context, asked after
it), its options' refusals, its table (one row per copied token, adding up to the run's keys), what a window loses
on the shipped mini (every source further back than it holds, nothing nearer), and the heatmap's numbers."""

import math

import pandas as pd
import pytest
import torch

from harness import measurements
from harness.common.errors import ConfigError
from harness.core.copying import DEPTH_SPAN, depth_sequences, depth_span
from harness.measurements import MEASUREMENTS, IDENTITY_COLUMNS
from harness.measurements.retrieval import DEPTH_COLUMNS, depth_lines
from tests.helpers import REPO

Retrieval = MEASUREMENTS["retrieval"]


# ---- the sequences -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("L,buckets", [(200, 5), (64, 5), (37, 4), (12, 6), (300, 10)])
def test_each_bucket_gets_one_span_whose_tokens_copy_their_sources_newest_first(L, buckets):
    ids = torch.arange(1000, 3000)
    passes = depth_sequences(ids, L, buckets, k=3, seed=7)
    m = depth_span(L, buckets)
    assert m == min(DEPTH_SPAN, L // buckets) >= 2
    for p in passes:
        seq = p.seq[0]
        assert seq.shape == (L + buckets * m,) and len(set(seq[:L].tolist())) == L  # distinct ids: one source each
        assert len(p.positions) == len(p.sources) == buckets * (m - 1)
        for t, s in zip(p.positions, p.sources):
            assert L < t and 0 < s < L and seq[t] == seq[s] and seq[t - 1] == seq[s - 1]  # the cue, then the copy
        asked = [s * buckets // L for s in p.sources]
        assert sorted(set(asked)) == list(range(buckets))
        assert all(asked.count(b) == m - 1 for b in range(buckets))
        assert asked == sorted(asked, reverse=True)  # the newest bucket first
        first = [t - 1 for t in p.positions[::m - 1]]  # each span's unscored first token, right after the context
        assert first == [L + i * m for i in range(buckets)]
    again = depth_sequences(ids, L, buckets, k=3, seed=7)
    assert all(torch.equal(a.seq, b.seq) and a.sources == b.sources for a, b in zip(passes, again))  # seeded
    assert not torch.equal(passes[0].seq, passes[1].seq)
    assert not torch.equal(depth_sequences(ids, L, buckets, k=1, seed=8)[0].seq, passes[0].seq)


def test_a_context_too_short_for_its_buckets_is_refused():
    with pytest.raises(ValueError, match="too short for 5 depth buckets: give at least 10 tokens"):
        depth_sequences(torch.arange(100), 9, 5, k=1, seed=0)


# ---- the options -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values,max_len,why", [
    (dict(retrieval_depth_buckets=-1), 1024, "retrieval_depth_buckets=-1 must be an integer 0 .. 20"),
    (dict(retrieval_depth_buckets=21), 1024, "retrieval_depth_buckets=21 must be an integer 0 .. 20"),
    (dict(retrieval_depth_lengths=[]), 1024, "retrieval_depth_lengths has 0 entries"),
    (dict(retrieval_depth_lengths=[64], retrieval_depth_buckets=0), 1024, "needs retrieval_depth_buckets >= 1"),
    (dict(retrieval_depth_lengths=[9]), 1024, "entry 9 is too short for 5 depth buckets: give at least 10"),
    (dict(retrieval_depth_lengths=[64, 64]), 1024, "names a length twice"),
    (dict(retrieval_depth_lengths=[361]), 1024, "entry 361 takes a pass of 401 tokens, over the 400 of the "
                                                "retrieval pass (2 x retrieval_n 200, as run): give at most 360"),
    (dict(retrieval_depth_lengths=[100]), 128, "over the 128 of the retrieval pass (2 x retrieval_n 64, as run): "
                                               "give at most 88"),
])
def test_bad_depth_options_are_refused_in_one_line(values, max_len, why):
    with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace(")", r"\)")) as e:
        Retrieval.check(measurements.options_of(Retrieval, values), max_len)
    assert "\n" not in str(e.value)


def test_the_longest_length_offered_is_accepted():
    Retrieval.check(measurements.options_of(Retrieval, dict(retrieval_depth_lengths=[10, 360])), 1024)
    Retrieval.check(measurements.options_of(Retrieval, dict(retrieval_depth_lengths=[88])), 128)


# ---- a run's table -----------------------------------------------------------------------------------------------

def _run(engine, kind, opts, **options):
    from harness.core.measure import CacheSpec

    return measurements.run_on(engine, CacheSpec(kind, opts, torch.float32), [torch.tensor([[464, 3290]])], 2,
                               names=["retrieval"], **options)


def _rows_agree_with_their_sequences(rec: dict, depth: pd.DataFrame, k: int, buckets: int) -> None:
    assert list(depth.columns) == list(DEPTH_COLUMNS)
    lengths = [int(x) for x in rec["retrieval_depth_lengths"].split(",")]
    assert sorted(depth.context_len.unique()) == lengths
    for L, g in depth.groupby("context_len"):
        assert len(g) == k * buckets * (depth_span(L, buckets) - 1)  # a row per copied token
        assert g.seq_id.nunique() == k
    assert (depth.distance == depth.position - 1 - depth.source).all()
    assert (depth.depth == depth.source / depth.context_len).all()
    assert (depth.depth_bucket == (depth.depth * depth.buckets + 1e-9).apply(math.floor)).all()
    assert (depth.buckets == buckets).all()
    assert depth.correct.mean() == pytest.approx(rec["retrieval_depth_acc"])
    assert depth.correct_ref.mean() == pytest.approx(rec["retrieval_depth_acc_ref"])


def test_the_depth_table_adds_up_to_the_runs_keys_on_the_tiny_model(tiny_model):
    from harness.core.engines import KvlabEngine

    e = KvlabEngine(tiny_model)
    rec, tables = _run(e, "window", {"window": 8, "sinks": 2}, max_len=128, retrieval_n=40, retrieval_k=2,
                       retrieval_depth_lengths=[10, 33, 40], retrieval_depth_buckets=4)
    _rows_agree_with_their_sequences(rec, tables["retrieval_depth"], k=2, buckets=4)
    assert rec["retrieval_depth_buckets"] == 4 and rec["retrieval_depth_lengths"] == "10,33,40"
    default, t = _run(e, "prealloc", {}, max_len=128, retrieval_n=40, retrieval_k=1)
    assert default["retrieval_depth_lengths"] == "40"  # retrieval_n as run
    _rows_agree_with_their_sequences(default, t["retrieval_depth"], k=1, buckets=5)
    lines = Retrieval.summary(default, t)
    by = t["retrieval_depth"].groupby("depth_bucket").correct.mean()
    assert lines[1].startswith("  retrieval depth ") and " ".join(f"{v:.2f}" for v in by) in lines[1]
    off, t = _run(e, "prealloc", {}, max_len=128, retrieval_n=40, retrieval_k=1, retrieval_depth_buckets=0)
    assert off["retrieval_depth_acc"] is None and off["retrieval_depth_lengths"] is None
    assert t["retrieval_depth"].empty and list(t["retrieval_depth"].columns) == list(DEPTH_COLUMNS)
    assert len(Retrieval.summary(off, t)) == 1  # the copy line alone: no depth line
    short, t = _run(e, "prealloc", {}, max_len=128, retrieval_n=9, retrieval_k=1)  # 9 tokens: under 2 a bucket
    assert short["retrieval_depth_lengths"] is None and t["retrieval_depth"].empty
    assert "not measured: the 9-token sequences are too short for 5 depth buckets" in depth_lines(short, None)[0]


def test_the_depth_passes_fit_the_caches_a_run_is_sized_for(tiny_model):
    """A paged pool sized for the retrieval pass (what the run's memory check and its pool's validation count: 2n - 1
    tokens) holds the longest depth pass allowed: at n = 40 with 5 buckets, the default length n, whose pass of 40 +
    5 x 8 tokens writes 2n - 1 of them."""
    from harness.core.engines import KvlabEngine
    from harness.experiment import memory
    from models.kv_cache import cache_kind

    n, paged = 40, cache_kind("paged")
    fills = memory.cache_fills(kind="paged", options={"block_size": 4}, max_len=128, retrieval_n=n,
                               measurements=["retrieval"])
    need = max(paged.blocks_needed(paged.parse_options(block_size=4), b, t) for _, b, t in fills)
    rec, tables = _run(KvlabEngine(tiny_model), "paged", {"block_size": 4, "blocks": need}, max_len=128,
                       retrieval_n=n, retrieval_k=1)
    depth = tables["retrieval_depth"]
    assert rec["retrieval_depth_lengths"] == str(n) and depth.position.max() == 2 * n - 1  # the pass's last token


@pytest.mark.slow
def test_a_window_loses_every_source_further_back_than_it_holds_and_nothing_nearer_on_the_shipped_mini():
    """On the reference model (which copies), a window of W slots and S sinks copies a token exactly when its source
    is fewer than W tokens back or among the first S: beyond, what it gets is what the model gets with nothing to
    copy (the first copy's accuracy), while fp32 full attention copies the same tokens; an exact kind scores each
    token as fp32 full attention does."""
    from harness.core.engines import KvlabEngine
    from models.gpt2 import GPT2

    e = KvlabEngine(GPT2.from_pretrained(REPO / "models" / "weights" / "mini").eval())
    W, S = 24, 4
    got = {kind: _run(e, kind, opts, max_len=200, retrieval_n=80, retrieval_k=2, retrieval_depth_lengths=[40, 120])
           for kind, opts in (("prealloc", {}), ("window", {"window": W, "sinks": S}))}
    for rec, tables in got.values():
        _rows_agree_with_their_sequences(rec, tables["retrieval_depth"], k=2, buckets=5)
    full, window = got["prealloc"][1]["retrieval_depth"], got["window"][1]["retrieval_depth"]
    assert (full.correct == full.correct_ref).all() and full.correct.mean() > 0.9
    assert full.seq_id.tolist() == window.seq_id.tolist() and (full.correct_ref == window.correct_ref).all()
    held = (window.distance < W) | (window.source < S)
    assert 0 < held.sum() < len(window) and window.depth_bucket[~held].nunique() >= 3  # both sides, several depths
    nothing_to_copy = got["window"][0]["retrieval_first_copy_acc"]
    assert window.correct[~held].mean() <= nothing_to_copy + 1 / (~held).sum(), "copied what the window dropped"
    assert window.correct_ref[~held].mean() > 0.9  # ... which full attention copies
    assert window.correct[held].mean() >= window.correct_ref[held].mean() - 0.1


# ---- the heatmap's numbers ---------------------------------------------------------------------------------------

def _fake_depth(rng) -> pd.DataFrame:
    """Two runs' depth tables on the same sequences (as a sweep's are), with identity columns, and a failed run's."""
    base = pd.DataFrame([dict(context_len=L, sequence=s, position=L + 1 + j, source=j, seq_id=f"{L}-{s}")
                         for L in (40, 80) for s in range(2) for j in range(0, L, 3)])
    base = base.assign(buckets=4, depth=base.source / base.context_len,
                       depth_bucket=base.source * 4 // base.context_len, distance=base.position - 1 - base.source,
                       correct_ref=rng.integers(0, 2, len(base)))
    frames = []
    for run, (cache, status) in enumerate((("prealloc", "ok"), ("window S4+W12", "ok"), ("window S4+W60", "failed"))):
        ident = dict(zip(IDENTITY_COLUMNS, [f"r{run}", "g", status, "mini", cache.split()[0], cache, "fp32", "cpu",
                                            "kvlab", 1, "uniform"]))
        frames.append(base.assign(correct=rng.integers(0, 2, len(base)), **ident))
    return pd.concat(frames, ignore_index=True)


def test_the_heatmap_cells_are_each_settings_accuracy_and_fp32s_once_per_token():
    import numpy as np
    import matplotlib.pyplot as plt

    from harness.analysis import depth

    df = _fake_depth(np.random.default_rng(0))
    cells = depth.depth_cells(df)
    assert list(cells.panel.unique()) == [depth.REFERENCE, "prealloc", "window S4+W12"]  # no failed run's panel
    ok = df[df.status == "ok"]
    for panel, g in cells.groupby("panel"):
        rows = ok[ok.run_name == "r0"] if panel == depth.REFERENCE else ok[ok.cache_label == panel]  # runs share
        col = "correct_ref" if panel == depth.REFERENCE else "correct"  # the reference's tokens: counted once
        want = rows.groupby(["context_len", "depth_bucket"])[col].agg(["size", "mean"])
        got = g.set_index(["context_len", "depth_bucket"]).sort_index()
        assert got.tokens.tolist() == want["size"].tolist() and got.accuracy.tolist() == want["mean"].tolist()
    fig = depth.depth_plot(df)
    heat = [ax for ax in fig.axes if ax.images]
    assert len(heat) == 3  # a panel each
    assert [ax.get_title().split("\n")[0] for ax in heat[:3]] == list(cells.panel.unique())
    assert heat[0].images[0].get_clim() == (0, 1)
    assert "not asked" not in fig._suptitle.get_text() and "—" not in {t.get_text() for t in heat[2].texts}
    plt.close(fig)
    gap = depth.depth_plot(df[~((df.cache_label == "window S4+W12") & (df.context_len == 80))])  # one length fewer
    heat = [ax for ax in gap.axes if ax.images]
    assert "—: not asked at that length" in gap._suptitle.get_text()
    assert [t.get_text() for t in heat[2].texts].count("—") == 4 and "—" not in {t.get_text() for t in heat[1].texts}
    plt.close(gap)
    empty = depth.depth_plot(df[df.status != "ok"])
    assert "no ok run measured retrieval by depth" in empty.axes[0].texts[0].get_text()
    plt.close(empty)

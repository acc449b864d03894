"""The evicting kinds' policies, each worked out here from its definition and compared with what the kind keeps;
then the contract around them: only kinds that score get scores, the keep-mask reference, bad options.

The conformance suite (tests/models/test_cache_kinds.py) already checks every evicting kind's mechanics: attention
gets what was held plus the new positions, the budget, the bytes, snapshots, and exactness against its own
keep-mask."""

import pytest
import torch

from models.generate import greedy, new_cache, prefill
from models.kv_cache import CACHE_KINDS, make_cache
from models.kv_cache.random import hashed
from tests.helpers.caches import Writer

CHUNKS = [7, 1, 1, 3, 1, 1, 1, 2, 1]
GEOM = dict(n_layer=2, n_head=3, head_dim=8)


def run(kind, chunks=CHUNKS, batch=2, **opts):
    """Write ``chunks`` through a cache as the model does; yield after each forward: (cache, writer, per-layer key
    positions handed to attention, t)."""
    cache = make_cache(kind, GEOM["n_layer"], GEOM["n_head"], GEOM["head_dim"], 40, batch, **opts)
    w = Writer(cache)
    for t in chunks:
        _, per_layer, _ = w.write(t)
        yield cache, w, per_layer, t


def kept(cache, layer: int, b: int, h: int) -> set[int]:
    p = cache.kept_positions(layer)[b, h]
    return set(p[p >= 0].tolist())


def top(scores: dict[int, float], n: int) -> set[int]:
    """The n positions of highest score, ties to the newer position."""
    return set(sorted(scores, key=lambda p: (scores[p], p), reverse=True)[:n])


def test_h2o_keeps_the_recent_and_the_heaviest_by_accumulated_attention():
    budget, recent = 6, 2
    acc = {}  # (layer, b, h) -> {position: attention accumulated since it was written}
    for cache, w, per_layer, t in run("h2o", budget=budget, recent=recent):
        newest = cache.pos - 1
        for layer, pos in enumerate(per_layer):
            p = w.handed[layer].sum(2)  # (B, nh, keys): this forward's attention to each key
            for b in range(cache.batch):
                for h in range(cache.n_kv_head):
                    a = acc.setdefault((layer, b, h), {})
                    for col, j in enumerate(pos[b, h].tolist()):
                        if j >= 0:
                            a[j] = a.get(j, 0.0) + float(p[b, h, col])
                    new_recent = {j for j in a if j > newest - recent}
                    want = new_recent | top({j: s for j, s in a.items() if j not in new_recent}, budget - recent)
                    assert kept(cache, layer, b, h) == want
                    for j in set(a) - want:
                        del a[j]  # evicted: its score goes with it


def test_h2o_with_every_slot_recent_is_a_window_of_the_newest_tokens():
    """recent = budget is H2O's "local" ablation: each head holds exactly the newest ``budget`` positions."""
    for cache, _, _, _ in run("h2o", budget=5, recent=5):
        newest = cache.pos - 1
        for layer in range(cache.n_layer):
            for b in range(cache.batch):
                for h in range(cache.n_kv_head):
                    assert kept(cache, layer, b, h) == set(range(max(0, newest - 4), newest + 1))


def test_tova_keeps_what_the_current_query_attends_to_most():
    budget = 4
    for cache, w, per_layer, t in run("tova", budget=budget):
        for layer, pos in enumerate(per_layer):
            last = w.handed[layer][:, :, -1]  # (B, nh, keys)
            for b in range(cache.batch):
                for h in range(cache.n_kv_head):
                    cand = {j: float(last[b, h, col]) for col, j in enumerate(pos[b, h].tolist()) if j >= 0}
                    assert kept(cache, layer, b, h) == top(cand, budget)


def test_knorm_keeps_the_keys_of_smallest_norm():
    budget = 5
    for cache, w, per_layer, t in run("knorm", budget=budget):
        for layer, pos in enumerate(per_layer):
            for b in range(cache.batch):
                for h in range(cache.n_kv_head):
                    norms = {j: -float(w.k[layer][b, h, j].norm()) for j in pos[b, h].tolist() if j >= 0}
                    assert kept(cache, layer, b, h) == top(norms, budget)


def test_snapkv_chooses_from_the_prompt_by_pooled_window_attention_then_slides():
    budget, window, kernel = 6, 2, 3
    chosen = {}
    for cache, w, per_layer, t in run("snapkv", budget=budget, window=window, kernel=kernel):
        for layer in range(cache.n_layer):
            for b in range(cache.batch):
                for h in range(cache.n_kv_head):
                    if cache.pos == t:  # the prompt: its last `window` queries' attention, max-pooled, chooses
                        obs = w.handed[layer][b, h, -window:, budget:].sum(0)  # (t,) over the prompt's positions
                        pooled = {j: float(obs[max(0, j - kernel // 2):j + kernel // 2 + 1].max()) for j in range(t)}
                        last = set(range(t - window, t))
                        pick = top({j: s for j, s in pooled.items() if j not in last}, budget - window)
                        assert kept(cache, layer, b, h) == last | pick
                        chosen[layer, b, h] = pick
                    else:  # then the chosen stay and the rest of the budget holds the newest
                        slide = set(range(cache.pos - (budget - len(chosen[layer, b, h])), cache.pos))
                        assert kept(cache, layer, b, h) == chosen[layer, b, h] | slide


def test_random_keeps_a_seeded_uniform_share_of_the_positions():
    def final(seed):
        *_, (cache, _, _, _) = run("random", chunks=[40], seed=seed, budget=8)
        return [kept(cache, layer, b, h) for layer in range(2) for b in range(2) for h in range(3)]

    a = final(0)
    assert a == final(0)  # the same seed keeps the same positions
    c = final(1)
    assert c != a
    seen = [j for s in a + c for j in s]
    assert abs(sum(seen) / len(seen) - 19.5) < 4  # uniform over 0..39, not the newest (35.5) nor the oldest (3.5)
    assert all(len(s) == 8 for s in a)
    assert int(hashed(torch.tensor(12345))) == int(hashed(torch.tensor(12345 + (1 << 32))))  # 32-bit, exactly


@pytest.mark.parametrize("kind", [k for k, c in CACHE_KINDS.items() if c.evicts])
def test_only_kinds_that_score_get_scores(tiny_model, kind):
    """Attention hands probabilities (rows summing to 1) to a kind that asks for them, None to one that does not."""
    cls = CACHE_KINDS[kind]
    cache = new_cache(tiny_model, kind, max_len=20, **cls.examples[0])
    handed = []
    inner = cache.after_attention
    cache.after_attention = lambda layer, probs: (handed.append(probs), inner(layer, probs))
    prefill(tiny_model, torch.arange(5, 15).unsqueeze(0), cache)
    assert len(handed) == tiny_model.config.n_layer
    for probs in handed:
        if cls.wants_scores:
            assert probs.shape == (1, tiny_model.config.n_head, 10, cache.opts.budget + 10)
            assert torch.allclose(probs.sum(-1), torch.ones(1, tiny_model.config.n_head, 10))
        else:
            assert probs is None


def test_a_fixed_kind_never_sees_after_attention(tiny_model):
    cache = new_cache(tiny_model, "prealloc", max_len=20)
    cache.after_attention = lambda layer, probs: pytest.fail("a kind that does not evict was handed scores")
    prefill(tiny_model, torch.arange(5, 15).unsqueeze(0), cache)
    assert cache.pos == 10


def test_the_keep_mask_reference_is_not_full_attention(tiny_model):
    """Eviction changes the logits (the reference is the kind's own keep-mask, not full attention), and a budget
    as large as the sequence changes nothing."""
    ids = torch.randint(0, 50257, (1, 30), generator=torch.Generator().manual_seed(4))
    full = greedy(tiny_model, ids, 10)
    small = greedy(tiny_model, ids, 10, layout="h2o", budget=8, recent=2)
    assert (small.logits - full.logits).abs().max() > 1e-3
    ref = greedy(tiny_model, ids, 10, keep=small.keeps)
    assert torch.equal(ref.tokens, small.tokens) and (ref.logits - small.logits).abs().max() <= 1e-4
    whole = greedy(tiny_model, ids, 10, layout="h2o", budget=40, recent=2)
    assert (whole.logits - full.logits).abs().max() <= 1e-4


@pytest.mark.parametrize("kind,opts,why", [
    ("h2o", {"budget": 0}, "budget must be an integer >= 1"),
    ("h2o", {"budget": 4, "recent": 5}, "recent 5 must be at most budget 4"),
    ("snapkv", {"budget": 8, "kernel": 4}, "kernel must be an odd integer >= 1"),
    ("snapkv", {"budget": 8, "kernel": 0}, "kernel must be an odd integer >= 1"),
    ("snapkv", {"budget": 4, "window": 4}, "window 4 must be below budget 4"),
])
def test_bad_options_are_one_line(kind, opts, why):
    with pytest.raises(ValueError, match=why):
        make_cache(kind, 2, 3, 8, 40, **opts)


def test_a_cache_shorter_than_the_budget_keeps_every_token(tiny_model):
    """A run refuses a budget above its max_len (tests/experiment/test_faults.py); a measurement's cache for a few
    tokens holds them all, and equals full attention."""
    with pytest.raises(ValueError, match="budget 50 is more than max_len 40"):
        CACHE_KINDS["tova"].check_max_len(CACHE_KINDS["tova"].parse_options(budget=50), 40)
    cache = make_cache("tova", 2, 3, 8, 40, budget=50)
    assert cache.kept_positions(0).shape == (1, 3, 40) and cache.nbytes == cache.formula_nbytes()
    ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(5))
    out, full = greedy(tiny_model, ids, 8, layout="tova", budget=50), greedy(tiny_model, ids, 8)
    assert torch.equal(out.tokens, full.tokens) and (out.logits - full.logits).abs().max() <= 1e-4


def test_a_snapkv_window_longer_than_the_prompt_is_refused_before_anything_is_written(tiny_model):
    cache = new_cache(tiny_model, "snapkv", max_len=20, budget=8, window=6)
    with pytest.raises(ValueError, match="snapkv's window 6 is longer than the prompt \\(4 tokens\\)"):
        prefill(tiny_model, torch.arange(4).unsqueeze(0), cache)
    assert cache.pos == 0 and (cache.kept_positions(0) == -1).all()

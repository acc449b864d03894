"""Batches of prompts of different lengths: left padding, each sequence with its own positions, and a mask that
keeps padding out of attention. Every exact cache kind must give each sequence exactly what it gets alone (HF's
batched GPT-2 has had these bugs: positions counted from the padding, padding attended, padding cached).

The paged kind's own mechanics are here too: blocks per sequence, blocks returned, blocks shared copy-on-write."""

import math

import pytest
import torch

from models.generate import decode_step, greedy, left_pad, new_cache, prefill
from models.gpt2 import GPT2, GPT2Config
from models.kv_cache import CACHE_KINDS, KeepRecord, PagedKVCache, kv_bytes
from tests.helpers.caches import CASES

EXACT = [c for c in CASES if CACHE_KINDS[c.values[0]].exact]
LENGTHS = (5, 1, 19, 12, 2)  # one token, and one 18 tokens longer than it
NEW = 24


def too_short(kind, opts) -> bool:
    """Whether the shortest prompt is below what the kind takes (a SnapKV window); if so, that it is refused."""
    if kind is None or min(LENGTHS) >= CACHE_KINDS[kind].min_prompt(CACHE_KINDS[kind].parse_options(**opts)):
        return False
    g = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="longer than the prompt"):
        greedy(GPT2(GPT2Config.preset("tiny")), [torch.randint(0, 50257, (n,), generator=g).tolist() for n in LENGTHS],
               2, layout=kind, **opts)
    return True


@pytest.fixture(scope="module")
def ragged_prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 50257, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.slow
@pytest.mark.parametrize("kind,opts", [pytest.param(None, {}, id="uncached")] + EXACT)
def test_each_sequence_of_a_ragged_batch_equals_running_it_alone(tiny_model, ragged_prompts, kind, opts):
    reference = {} if kind is None else CACHE_KINDS[kind].reference(CACHE_KINDS[kind].parse_options(**opts))
    if too_short(kind, opts):
        return
    out = greedy(tiny_model, ragged_prompts, NEW, layout=kind, **opts)
    assert out.tokens.shape == (len(LENGTHS), NEW)
    for i, p in enumerate(ragged_prompts):
        # the kind's uncached reference, one sequence (an evicting kind's: the keep-mask its run noted for it)
        noted = {} if out.keeps is None else {"keep": out.keeps.sequence(i)}
        alone = greedy(tiny_model, [p], NEW, **reference, **noted)
        assert torch.equal(out.tokens[i], alone.tokens[0]), f"sequence {i} ({len(p)} tokens) diverged"
        assert (out.logits[i] - alone.logits[0]).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind,opts", [pytest.param(None, {}, id="uncached")] + EXACT)
def test_more_padding_and_other_padding_ids_change_nothing(tiny_model, ragged_prompts, kind, opts):
    if too_short(kind, opts):
        return
    idx, pad = left_pad(ragged_prompts)
    base = greedy(tiny_model, idx, NEW, layout=kind, pad=pad, **opts)
    other_ids = idx.clone()
    for i, p in enumerate(pad.tolist()):  # the same padding slots, different ids in them
        other_ids[i, :p] = torch.arange(p) * 997 + 13
    same_shape = greedy(tiny_model, other_ids, NEW, layout=kind, pad=pad, **opts)
    assert torch.equal(same_shape.tokens, base.tokens) and torch.equal(same_shape.logits, base.logits)
    wide, wide_pad = left_pad(ragged_prompts, pad_id=50256, length=idx.shape[1] + 9)
    more = greedy(tiny_model, wide, NEW, layout=kind, pad=wide_pad, **opts)
    assert torch.equal(wide_pad, pad + 9)
    assert torch.equal(more.tokens, base.tokens) and (more.logits - base.logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind,opts", EXACT)
def test_chunked_prefill_of_a_ragged_batch_equals_the_reference(tiny_model, ragged_prompts, kind, opts):
    reference = CACHE_KINDS[kind].reference(CACHE_KINDS[kind].parse_options(**opts))
    idx, pad = left_pad(ragged_prompts)
    cache = new_cache(tiny_model, kind, max_len=idx.shape[1] + 4, batch=len(LENGTHS), **opts)
    cache.set_padding(pad)
    cuts = [0, 3, 4, 11, idx.shape[1]]
    noted, pieces = KeepRecord(pad), []
    for a, b in zip(cuts, cuts[1:]):
        noted.note(cache, b - a)
        pieces.append(prefill(tiny_model, idx[:, a:b], cache)[0])
    pieces = torch.cat(pieces, dim=1)
    with torch.no_grad():  # an evicting kind's reference: the keep-mask its run noted
        full = tiny_model(idx, pad=pad, **reference, **({"keep": noted} if cache.evicts else {}))
    real = torch.arange(idx.shape[1]).unsqueeze(0) >= pad.unsqueeze(1)  # (B, T) slots that hold tokens
    assert (pieces - full)[real].abs().max().item() <= 1e-5
    assert torch.isfinite(pieces).all()  # padding queries see keys too: no NaN anywhere


def test_padding_is_given_once_and_checked(tiny_model, ragged_prompts):
    cache = new_cache(tiny_model, "prealloc", max_len=40, batch=2)
    with pytest.raises(ValueError, match=r"pad must be 2 integers \(one per sequence\)"):
        cache.set_padding([1, 2, 3])
    with pytest.raises(ValueError, match=r"pad must lie in \[0, max_len 40\)"):
        cache.set_padding([0, 40])
    prefill(tiny_model, ragged_prompts[:2], cache)
    assert cache.pad.tolist() == [0, 4] and cache.lengths() == [5, 1]
    with pytest.raises(ValueError, match="set_padding comes before the prefill: this cache already holds 5 slots"):
        cache.set_padding([0, 4])
    with pytest.raises(ValueError, match=r"pad must lie in \[0, 3\) so that every sequence"):
        tiny_model(torch.zeros(2, 3, dtype=torch.long), pad=[0, 3])
    with pytest.raises(ValueError, match="a cache applies its own kind's rule and holds its own padding"):
        tiny_model(torch.zeros(2, 1, dtype=torch.long), cache=cache, pad=[0, 0])
    quant = new_cache(tiny_model, "quant", max_len=40, batch=2)
    with pytest.raises(ValueError, match="cache kind 'quant' does not run ragged batches: its K groups span tokens"):
        greedy(tiny_model, ragged_prompts[:2], 3, layout="quant")
    with pytest.raises(ValueError, match="does not run ragged batches"):
        quant.set_padding([0, 4])
    cache.reset()
    assert cache.pad is None and cache.pos == 0


def test_positions_count_from_each_sequences_first_token(tiny_model):
    """tiny has 128 positions: a 100-token prompt beside a 10-token one may generate 29 tokens (28 fed back), not
    30, and the short one's positions do not count the 90 padding slots."""
    long, short = list(range(100, 200)), list(range(300, 310))
    out = greedy(tiny_model, [long, short], 29, layout="prealloc")
    assert torch.equal(out.tokens[1], greedy(tiny_model, [short], 29, layout="prealloc").tokens[0])
    with pytest.raises(ValueError, match=r"sequence too long: 128 cached \+ 1 new tokens > n_positions 128"):
        greedy(tiny_model, [long, short], 30, layout="prealloc", max_len=130)


# ---- the paged kind ------------------------------------------------------------------------------------------

def block_bytes(model, bs: int, dtype=torch.float32) -> int:
    c = model.config
    return kv_bytes(c.n_layer, c.n_head, c.head_dim, bs, dtype=dtype)


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_paged_holds_ceil_tokens_over_block_size_blocks_per_sequence(tiny_model, ragged_prompts, bs):
    cache = new_cache(tiny_model, "paged", max_len=19 + NEW + 1, batch=len(LENGTHS), block_size=bs)
    pool = cache.pool
    nxt = prefill(tiny_model, ragged_prompts, cache, last_only=True)[0].argmax(-1)
    for step in range(NEW):
        lengths = [n + step for n in LENGTHS]
        blocks = sum(math.ceil(n / bs) for n in lengths)  # padding takes no block
        assert cache.nbytes == blocks * block_bytes(tiny_model, bs) == cache.formula_nbytes()
        assert pool.n_blocks - len(pool.free) == blocks
        nxt = decode_step(tiny_model, nxt, cache)[0].argmax(-1)
    held = pool.n_blocks - len(pool.free)
    cache.end(2)  # the longest sequence ends: its blocks go back to the pool
    assert pool.n_blocks - len(pool.free) == held - math.ceil((19 + NEW) / bs)
    decode_step(tiny_model, nxt, cache)  # the others go on; the ended one stores nothing
    lengths = [n + NEW + 1 for n in LENGTHS]
    assert cache.nbytes == sum(math.ceil(n / bs) for i, n in enumerate(lengths) if i != 2) * block_bytes(
        tiny_model, bs)
    cache.reset()
    assert len(pool.free) == pool.n_blocks and cache.nbytes == 0


def test_paged_equals_prealloc_on_a_ragged_batch(tiny_model, ragged_prompts):
    pre = greedy(tiny_model, ragged_prompts, NEW, layout="prealloc")
    for bs in (1, 3, 16):
        out = greedy(tiny_model, ragged_prompts, NEW, layout="paged", block_size=bs)
        assert torch.equal(out.tokens, pre.tokens) and (out.logits - pre.logits).abs().max().item() <= 1e-5


def test_an_empty_pool_refuses_in_one_line_and_writes_nothing(tiny_model):
    cache = new_cache(tiny_model, "paged", max_len=40, batch=2, block_size=4, blocks=5)
    prefill(tiny_model, torch.arange(16).view(2, 8), cache)  # 2 blocks each
    before = [cache.read(layer) for layer in range(2)]
    with pytest.raises(ValueError, match="paged pool out of blocks: 2 more needed, 1 of 5 free"):
        prefill(tiny_model, torch.arange(2).view(2, 1), cache)
    assert cache.pos == 8 and len(cache.pool.free) == 1
    for (k0, v0), layer in zip(before, range(2)):
        k1, v1 = cache.read(layer)
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_fork_shares_the_prompts_blocks_and_copies_only_the_first_divergent_one(tiny_model):
    bs, P, n = 4, 10, 3  # 10 tokens: blocks [0,4) [4,8) full, [8,12) partly filled
    prompt = torch.randint(0, 50257, (1, P), generator=torch.Generator().manual_seed(5))
    one = new_cache(tiny_model, "paged", max_len=32, batch=1, block_size=bs, blocks=16)
    last = prefill(tiny_model, prompt, one)[0][:, -1]
    before = [one.read(layer) for layer in range(tiny_model.config.n_layer)]
    forks = one.fork(n)
    assert forks.pool is one.pool and one.pool.used == 3 and forks.blocks_in_use == 3  # shared, nothing copied
    firsts = torch.tensor([[int(last.argmax())], [7], [4242]])  # three different continuations
    logits = [decode_step(tiny_model, firsts, forks)[0]]
    # each fork copied the partial block before writing into it; the two full ones stay shared
    assert one.pool.used == 3 + n and forks.blocks_in_use == 2 + n
    assert forks.nbytes == (2 + n) * block_bytes(tiny_model, bs) < forks.formula_nbytes()
    tok = logits[-1].argmax(-1)
    for _ in range(5):  # past the block boundary: each takes its own new block
        logits.append(decode_step(tiny_model, tok, forks)[0])
        tok = logits[-1].argmax(-1)
    for layer, (k0, v0) in enumerate(before):  # the writes never reached the prompt's cache
        k1, v1 = one.read(layer)
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    seen = torch.cat(logits, dim=1)  # (n, 6, vocab)
    for i in range(n):  # each continuation equals prealloc on its own whole sequence
        ctx = torch.cat([prompt[0], firsts[i], seen[i, :-1].argmax(-1)]).unsqueeze(0)
        pre = new_cache(tiny_model, "prealloc", max_len=32)
        want = prefill(tiny_model, ctx, pre)[0][0, P:]
        assert (seen[i] - want).abs().max().item() <= 1e-5
    del forks  # a cache that is dropped hands its blocks back
    assert one.pool.used == 3


def test_snapshot_shares_blocks_and_restore_is_copy_on_write(tiny_model):
    cache = new_cache(tiny_model, "paged", max_len=40, batch=1, block_size=4)
    prefill(tiny_model, torch.arange(6).view(1, 6), cache)
    used = cache.pool.used
    snap = cache.snapshot()
    assert cache.pool.used == used  # no block copied to take it
    kept = [cache.read(layer) for layer in range(2)]
    prefill(tiny_model, torch.arange(5).view(1, 5), cache)
    cache.restore(snap)
    prefill(tiny_model, torch.arange(3).view(1, 3) + 100, cache)
    twin = PagedKVCache(2, 2, 32, 40, 1, pool=cache.pool, block_size=4)
    twin.restore(snap)
    for layer, (k0, v0) in enumerate(kept):
        k1, v1 = twin.read(layer)
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    twin.reset()
    cache.reset()
    del snap  # dropping the snapshot hands its share back
    assert cache.pool.used == 0


@pytest.mark.parametrize("kind", ["concat", "prealloc", "window"])
def test_a_ragged_batch_holds_the_bytes_of_its_slots_padding_included(tiny_model, ragged_prompts, kind):
    """Layouts that keep slots per batch row hold the padding slots too (that is their waste); the padding vector
    itself is bookkeeping, not K/V."""
    cache = new_cache(tiny_model, kind, max_len=30, batch=len(LENGTHS))
    prefill(tiny_model, ragged_prompts, cache)
    assert cache.pad is not None and cache.nbytes == cache.formula_nbytes()
    assert cache.filled_nbytes == kv_bytes(2, 2, 32, sum(LENGTHS))  # the tokens alone


def test_a_list_of_equal_length_prompts_is_a_plain_batch(tiny_model):
    rows = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10])]
    listed = greedy(tiny_model, rows, 4, layout="prealloc")
    stacked = greedy(tiny_model, torch.stack(rows), 4, layout="prealloc")
    assert torch.equal(listed.tokens, stacked.tokens) and torch.equal(listed.logits, stacked.logits)
    cache = new_cache(tiny_model, "prealloc", max_len=8, batch=2)
    prefill(tiny_model, [[1, 2], [3, 4]], cache)
    assert cache.pad is None


def test_paged_edges_fork_keeps_padding_crop_after_end_sharing_and_stale_snapshots(tiny_model):
    # a padded prompt's fork keeps its padding: each continuation equals its own reference
    prompt = [11, 12, 13, 14]
    one = new_cache(tiny_model, "paged", max_len=16, batch=1, block_size=4, blocks=16)
    prefill(tiny_model, torch.tensor([[0, 0, 0] + prompt]), one, pad=[3])
    forks = one.fork(2)
    assert forks.pad.tolist() == [3, 3] and forks.lengths() == [4, 4]
    out = decode_step(tiny_model, torch.tensor([[20], [30]]), forks)[0]
    for i, t in enumerate((20, 30)):
        with torch.no_grad():
            want = tiny_model(torch.tensor([prompt + [t]]))[0, -1]
        assert (out[i, -1] - want).abs().max().item() <= 1e-5
    # shared blocks count once: a fork of a 4-token prompt in one block wastes nothing, never less
    assert one.held_slots == 4 and one.waste == 0
    twins = new_cache(tiny_model, "paged", max_len=16, batch=1, block_size=4, blocks=16)
    prefill(tiny_model, torch.tensor([prompt]), twins)
    four = twins.fork(4)
    assert four.held_slots == 4 and four.occupied_slots == 4 and four.waste == 0
    # a sequence that ended cannot be cropped back to life
    cache = new_cache(tiny_model, "paged", max_len=16, batch=2, block_size=4)
    prefill(tiny_model, torch.tensor([[1, 2, 3], [4, 5, 6]]), cache)
    decode_step(tiny_model, torch.tensor([[7], [8]]), cache)
    cache.end(1)
    assert not cache.can_crop(3) and cache.can_crop(4)
    with pytest.raises(ValueError, match=r"sequence\(s\) \[1\] ended and gave their blocks back"):
        cache.crop(3)
    # a copy of a snapshot that was dropped holds no blocks: restoring it is refused
    import copy
    snap = twins.snapshot()
    kept = copy.copy(snap)
    del snap
    with pytest.raises(ValueError, match="no longer holds its blocks"):
        twins.restore(kept)


def test_a_padded_prefill_keeps_a_token_of_every_prompt(tiny_model):
    cache = new_cache(tiny_model, "prealloc", max_len=8, batch=2)
    with pytest.raises(ValueError, match=r"pad must lie in \[0, 3\) so that every sequence"):
        prefill(tiny_model, torch.tensor([[0, 0, 0], [1, 2, 3]]), cache, pad=[3, 0])
    assert cache.pos == 0 and cache.pad is None

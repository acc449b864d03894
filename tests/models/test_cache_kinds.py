"""The conformance suite: every kind in ``CACHE_KINDS`` (the next one someone registers included) runs these tests
with each option set its class lists in ``examples``. Storage-level tests drive ``update`` directly with random K/V;
model-level tests compare generation against the kind's uncached reference (``model(idx, **reference)``)."""

import copy

import pytest
import torch

from models.generate import decode_step, greedy, new_cache, prefill
from models.kv_cache import CACHE_KINDS, KeepRecord, KVCache, kv_bytes, make_cache
from tests.helpers.caches import CASES, Writer, own_bytes, seed_prompts

KINDS = list(CACHE_KINDS)
FIXED = [c for c in CASES if not CACHE_KINDS[c.values[0]].evicts]  # kinds whose keys follow a rule
EVICTING = [c for c in CASES if CACHE_KINDS[c.values[0]].evicts]  # kinds that choose what they keep
GEOM = dict(n_layer=2, n_head=3, head_dim=8)  # small, and head_dim 8 is not a multiple of every group size
CHUNKS = [5, 1, 1, 7, 1, 1, 3, 1, 9, 1, 1, 1, 2, 1]  # prefill, decode steps, chunks: 35 tokens


def make(kind, opts, max_len=40, batch=2, dtype=torch.float32) -> KVCache:
    return make_cache(kind, GEOM["n_layer"], GEOM["n_head"], GEOM["head_dim"], max_len, batch, dtype=dtype, **opts)


def state(cache) -> dict:
    """What a cache holds, as values: its snapshot, or for a pooled kind (whose snapshot names shared blocks) the
    K/V it reads through its block tables."""
    if not cache.pooled:
        return cache.snapshot()
    reads = [cache.read(layer) for layer in range(cache.n_layer)]
    return {"pos": cache.pos, "k": [k for k, _ in reads], "v": [v for _, v in reads]}


def snapshot_state(cache, snap) -> dict:
    """What a snapshot holds, as values (a pooled kind's: restored into a twin on the same pool)."""
    if not cache.pooled:
        return snap
    twin = cache.empty_like()
    twin.restore(snap)
    return state(twin)


def visible(q: int, n: int, reference: dict) -> set[int]:
    """Positions the reference lets a query at q see among 0..n-1, worked out here from the rule itself."""
    W, S = reference.get("window"), reference.get("sinks", 0)
    return {j for j in range(min(n, q + 1)) if W is None or j < S or j > q - W}


def same_positions(a, b) -> bool:
    """Two writes declared the same key positions (None, one tensor, or one per layer)."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return not isinstance(b, list) and torch.equal(a, b)


def same_state(a: dict, b: dict) -> bool:
    """Two snapshots hold the same values."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list):
            if len(x) != len(y) or not all((p is None and q is None) or (p is not None and q is not None and
                                                                      torch.equal(p, q)) for p, q in zip(x, y)):
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def snapshot_tensors(snap: dict) -> list[torch.Tensor]:
    out = []
    for v in snap.values():
        out += [t for t in v if t is not None] if isinstance(v, list) else [v] if isinstance(v, torch.Tensor) else []
    return out


# ---- the registry --------------------------------------------------------------------------------------------

def test_registry_holds_the_kinds_and_make_cache_builds_them():
    assert {"concat", "prealloc", "quant", "window"} <= set(CACHE_KINDS)
    for kind, cls in CACHE_KINDS.items():
        assert cls.kind == kind and issubclass(cls, KVCache) and isinstance(cls.exact, bool)
        assert isinstance(make(kind, {}), cls)
        cls.parse_options(**cls.option_defaults())  # the defaults are valid options
    with pytest.raises(ValueError, match="unknown cache kind 'lru': use one of concat, prealloc, quant, window, paged, "
                                         "h2o, tova, snapkv, knorm, random"):
        make_cache("lru", 2, 2, 4, 8)


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_or_mistyped_options_are_refused_in_one_line(kind):
    with pytest.raises(ValueError, match=f"cache kind '{kind}' has no option 'bogus': its options are"):
        make(kind, {"bogus": 1})
    for name, typ in CACHE_KINDS[kind].option_types().items():
        with pytest.raises(ValueError, match=name):
            make(kind, {name: "seven" if typ is not str else 7})


@pytest.mark.parametrize("kind,opts", CASES)
def test_every_example_is_a_setting_a_run_accepts_and_the_run_checks_say_one_line(kind, opts):
    """The option sets this suite runs are ones a run would accept at its max_len (40) and head size: each has an
    effect there (a window that slides, something quantised, a budget below max_len). At shorter max_lens a kind
    may refuse them, in one line naming the max_len."""
    cls = CACHE_KINDS[kind]
    o = cls.parse_options(**opts)
    cls.check_max_len(o, 40)
    cls.check_head_dim(o, GEOM["head_dim"])
    cls.check_fills(o, [("a test's prefill", 2, 35)])
    for max_len in (1, 2, 5, 8):
        try:
            cls.check_max_len(o, max_len)
        except ValueError as e:
            assert "\n" not in str(e) and str(max_len) in str(e), str(e)


@pytest.mark.parametrize("kind", KINDS)
def test_each_example_has_a_label_of_its_own(kind):
    """A run's cache_label is the kind's label of its options: option sets that store or compute differently (the
    examples: axes, bits, a scheme, ...) must not share one, or a sweep's table would merge them."""
    cls = CACHE_KINDS[kind]
    labels = [cls.label(cls.parse_options(**opts)) for opts in cls.examples]
    assert len(set(labels)) == len(labels), labels


@pytest.mark.parametrize("kind", KINDS)
def test_geometry_and_dtype_are_checked(kind):
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        make_cache(kind, 2, 2, 4, 0)
    with pytest.raises(ValueError, match="head_dim must be an integer"):
        make_cache(kind, 2, 2, 4.0, 8)
    with pytest.raises(ValueError, match="not a K/V storage dtype"):
        make_cache(kind, 2, 2, 4, 8, dtype=torch.int8)
    cache = make(kind, {})
    with pytest.raises(ValueError, match=r"k_new has shape \(2, 4, 3, 8\) but this cache holds"):
        cache.update(0, torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8))
    with pytest.raises(IndexError, match="layer 2 out of range"):
        cache.update(2, torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 1, 8))
    assert cache.pos == 0


# ---- the update / pos contract -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind,opts", FIXED)
def test_update_returns_what_the_reference_sees_and_never_moves_pos(kind, opts, dtype):
    """K/V written in ``dtype`` into a cache storing ``dtype`` (as on a GPU computing in fp16/bf16)."""
    cache = make(kind, opts, dtype=dtype)
    reference = cache.reference(cache.opts)
    w = Writer(cache, dtype=dtype)
    for t in CHUNKS:
        before = cache.pos
        returned, key_pos, _ = w.write(t)
        assert cache.pos == before + t  # advance moves pos, once per forward
        n = before + t
        key_pos = torch.arange(n) if key_pos is None else key_pos
        rows = key_pos.expand(cache.batch, -1) if key_pos.dim() == 1 else key_pos  # (B, keys): per sequence
        for b in range(cache.batch):
            valid = rows[b] >= 0  # a kind may hand over slots that hold nothing yet (-1), masked by the model
            kp = rows[b][valid]
            assert len(set(kp.tolist())) == len(kp) and int(kp.max()) < n
            for q in range(before, n):  # every key the reference shows any new query is among those returned
                assert visible(q, n, reference) <= set(kp.tolist())
            for layer, (k, v) in enumerate(returned):
                assert k.shape == v.shape == (cache.batch, cache.n_kv_head, rows.shape[1], cache.head_dim)
                k, v = k[b][:, valid], v[b][:, valid]
                want_k = w.k[layer][b][:, kp].to(cache.dtype)
                want_v = w.v[layer][b][:, kp].to(cache.dtype)
                bound = cache.error_bound(layer)
                assert k.dtype == v.dtype == dtype  # attention gets them in its own dtype
                if cache.exact:
                    assert bound is None
                    assert torch.equal(k.to(cache.dtype), want_k) and torch.equal(v.to(cache.dtype), want_v)
                else:
                    kb, vb = bound[0][b][:, valid], bound[1][b][:, valid]
                    assert ((k.float() - want_k.float()).abs() <= kb * (1 + 1e-5) + 1e-6).all()
                    assert ((v.float() - want_v.float()).abs() <= vb * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind,opts", EVICTING)
def test_an_evicting_kind_attends_over_what_it_held_plus_the_new_and_keeps_its_budget(kind, opts, dtype):
    """Each layer's update returns, per sequence and head, exactly the positions held before plus the new ones,
    with the K/V written there; afterwards each head holds min(its slots, tokens) of those, each once (its slots:
    the budget, the layer's under a pyramid, the head's own under ada)."""
    cache = make(kind, opts, dtype=dtype)
    w = Writer(cache, dtype=dtype)
    B, nh = cache.batch, cache.n_kv_head
    held = [torch.full((B, nh, 0), -1) for _ in range(cache.n_layer)]
    for t in CHUNKS:
        before = cache.pos
        returned, per_layer, _ = w.write(t)
        assert cache.pos == before + t
        for layer, ((k, v), kp) in enumerate(zip(returned, per_layer)):
            assert kp.shape == (B, nh, k.shape[2]) and k.dtype == v.dtype == dtype
            after, slots = cache.kept_positions(layer), cache.slots_of(layer)
            assert after.shape == (B, nh, max(map(max, slots))) and after.dtype == torch.long
            for b in range(B):
                for h in range(nh):
                    valid = kp[b, h] >= 0
                    got = kp[b, h][valid]
                    was = held[layer][b, h][held[layer][b, h] >= 0].tolist()
                    assert sorted(got.tolist()) == sorted(was + list(range(before, before + t)))
                    assert torch.equal(k[b, h][valid], w.k[layer][b, h][got].to(dtype))
                    assert torch.equal(v[b, h][valid], w.v[layer][b, h][got].to(dtype))
                    kept = after[b, h][after[b, h] >= 0].tolist()
                    assert len(set(kept)) == len(kept) == min(slots[b][h], before + t)
                    assert set(kept) <= set(got.tolist())
            held[layer] = after
        assert cache.nbytes == own_bytes(cache) == cache.formula_nbytes() == cache.formula_nbytes(0)


@pytest.mark.parametrize("kind,opts", CASES)
def test_update_never_moves_pos_by_itself(kind, opts):
    cache = make(kind, opts)
    for layer, (k, v) in enumerate(Writer(cache).chunk(4)):
        cache.update(layer, k, v)
        assert cache.pos == 0


@pytest.mark.parametrize("kind,opts", CASES)
def test_overflow_names_the_numbers_and_writes_nothing(kind, opts):
    cache = make(kind, opts, max_len=12)
    w = Writer(cache)
    w.write(7)
    w.write(3)
    before = state(cache)
    k, v = w.chunk(3)[0]
    with pytest.raises(ValueError, match=r"pos 10 \+ 3 new tokens > max_len 12"):
        cache.update(0, k, v)
    assert cache.pos == 10 and same_state(before, state(cache))
    w.write(2)  # exactly full is fine
    assert cache.pos == 12


# ---- bytes ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind,opts", CASES)
def test_nbytes_is_every_tensor_held_and_equals_the_formula(kind, opts, dtype):
    cache = make(kind, opts, dtype=dtype)
    cls = type(cache)
    w = Writer(cache)
    for t in [0] + CHUNKS:
        if t:
            w.write(t)
        n = cache.pos
        want = cls.nbytes_formula(GEOM["n_layer"], GEOM["n_head"], GEOM["head_dim"], 40, 2, dtype, n, cache.opts)
        assert cache.nbytes == own_bytes(cache) == want == cache.formula_nbytes()
        assert cache.held == cls.held_tokens(40, n, cache.opts)


def test_plain_formulas():
    # GPT-2 small in FP32: 2 x 12 layers x 768 x 4 B per token
    assert kv_bytes(12, 12, 64, 1) == 73_728
    for kind, held in (("concat", 7), ("prealloc", 50)):
        cache = make_cache(kind, 12, 12, 64, 50, 2)
        k = torch.randn(2, 12, 7, 64)
        for layer in range(12):
            cache.update(layer, k, k)
        cache.advance(7)
        assert cache.nbytes == kv_bytes(12, 12, 64, held, batch=2)
    window = make_cache("window", 12, 12, 64, 1024, window=256, sinks=4)
    assert window.nbytes == kv_bytes(12, 12, 64, 260)
    with pytest.raises(ValueError, match="n_tokens must be an integer >= 0"):
        kv_bytes(12, 12, 64, -5)


# ---- reset, crop, snapshot / restore, checkpoint ----------------------------------------------------------------

@pytest.mark.parametrize("kind,opts", CASES)
def test_reset_empties_the_cache(kind, opts):
    cache, fresh = make(kind, opts), make(kind, opts)
    Writer(cache, seed=1).write(9)
    cache.reset()
    assert cache.pos == 0
    data = Writer(cache, seed=2).chunk(6)
    a, _, _ = Writer(cache).write(6, data)
    b, _, _ = Writer(fresh).write(6, data)
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def replay(kind, opts, chunks, seed=0):
    cache = make(kind, opts)
    w = Writer(cache, seed)
    data = [w.write(t)[2] for t in chunks]
    return cache, data


@pytest.mark.parametrize("kind,opts", CASES)
def test_crop_gives_the_shorter_cache_or_says_why_not(kind, opts):
    chunks = [6, 1, 1, 5, 1, 1, 1, 1]
    total = sum(chunks)
    cropped_somewhere = 0
    for m in range(total + 1):
        cache, data = replay(kind, opts, chunks)
        if not cache.can_crop(m):
            with pytest.raises(ValueError, match=f"cannot crop .*{m} tokens"):
                cache.crop(m)
            continue
        cropped_somewhere += 1
        cache.crop(m)
        assert cache.pos == m
        assert cache.nbytes == own_bytes(cache) == cache.formula_nbytes()  # nothing longer kept alive
        # the cache that only ever wrote the first m tokens (an evicting kind, whose state is its history: the same
        # forwards, which is all it crops to)
        if cache.evicts:
            assert m == total
            short, _ = replay(kind, opts, chunks)
        else:
            short = make(kind, opts)
            flat = [torch.cat([d[layer][i] for d in data], dim=2)[:, :, :m] for layer in range(2) for i in range(2)]
            if m:
                Writer(short).write(m, [(flat[0], flat[1]), (flat[2], flat[3])])
        nxt = Writer(short, seed=9).chunk(2)
        a, pa, _ = Writer(cache).write(2, nxt)
        b, pb, _ = Writer(short).write(2, nxt)
        assert same_positions(pa, pb)
        for (ka, va), (kb, vb) in zip(a, b):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert cropped_somewhere >= 1  # cropping to pos (nothing) always works
    cache, _ = replay(kind, opts, chunks)
    with pytest.raises(ValueError, match=f"cannot crop to {total + 1} tokens: the cache holds {total}"):
        cache.crop(total + 1)


# kind-specific crops that really cut something (crop to pos, which every kind allows, cuts nothing)
REAL_CROPS = [("concat", {}, [6, 1, 1, 4], 3), ("prealloc", {}, [6, 1, 1, 4], 0),
              ("quant", {"group_size": 8}, [6, 1, 1, 4], 9),  # 12 tokens: K groups [0, 8) stay, the tail is cut
              ("window", {"window": 8, "sinks": 2}, [6, 1, 2], 5),  # 9 tokens: nothing evicted yet
              ("window", {"window": 4, "sinks": 2}, [6, 1, 1, 4], 2)]  # evicted, but 2 tokens are only sinks
NO_CROPS = [("quant", {"group_size": 8}, [6, 1, 1, 4], 8),  # would un-quantise the group [0, 8)
            ("quant", {"group_size": 8, "residual": 2}, [6, 1, 1, 4], 11),  # V token 9 is quantised already
            ("window", {"window": 4, "sinks": 2}, [6, 1, 1, 4], 11)]  # position 7 was evicted


@pytest.mark.parametrize("kind,opts,chunks,m", REAL_CROPS)
def test_real_crops_give_the_shorter_cache(kind, opts, chunks, m):
    cache, data = replay(kind, opts, chunks)
    assert cache.can_crop(m)
    cache.crop(m)
    short = make(kind, opts)
    flat = [torch.cat([d[layer][i] for d in data], dim=2)[:, :, :m] for layer in range(2) for i in range(2)]
    if m:
        Writer(short).write(m, [(flat[0], flat[1]), (flat[2], flat[3])])
    for t in (1, 3, 1):  # then both go on alike
        nxt = Writer(short, seed=10 + t).chunk(t)
        a, pa, _ = Writer(cache).write(t, nxt)
        b, pb, _ = Writer(short).write(t, nxt)
        assert same_positions(pa, pb)
        for (ka, va), (kb, vb) in zip(a, b):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("kind,opts,chunks,m", NO_CROPS)
def test_crops_that_would_need_lost_data_are_refused(kind, opts, chunks, m):
    cache, _ = replay(kind, opts, chunks)
    before = state(cache)
    assert not cache.can_crop(m)
    with pytest.raises(ValueError, match="snapshot\\(\\) before and restore\\(\\) instead"):
        cache.crop(m)
    assert same_state(before, state(cache))


@pytest.mark.parametrize("kind,opts", CASES)
def test_snapshot_restore_is_exact_and_shares_no_storage(kind, opts):
    cache, _ = replay(kind, opts, [6, 1, 1, 4, 1])
    snap = cache.snapshot()
    kept = copy.deepcopy(snapshot_state(cache, snap))
    def storages(tensors):  # empty tensors own no storage
        return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}

    held = [v for v in vars(cache).values() if isinstance(v, torch.Tensor)]
    held += [t for v in vars(cache).values() if isinstance(v, list) for t in v if isinstance(t, torch.Tensor)]
    assert not storages(held) & storages(snapshot_tensors(snap))
    w = Writer(cache, seed=5)
    w.write(3)
    w.write(1)
    cache.restore(snap)
    assert cache.pos == 13 and same_state(state(cache), kept)
    after = Writer(cache, seed=6).write(2)[0]  # writes after a restore never reach the snapshot
    assert same_state(snapshot_state(cache, snap), kept)
    twin, _ = replay(kind, opts, [6, 1, 1, 4, 1])
    again = Writer(twin, seed=6).write(2)[0]
    for (ka, va), (kb, vb) in zip(after, again):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    other = make(kind, opts, max_len=41) if not cache.pooled else type(cache)(
        2, 3, 8, 41, 2, pool=cache.pool, **opts)
    with pytest.raises(ValueError, match="cannot restore into one with"):
        other.restore(snap)
    with pytest.raises(ValueError, match="not a snapshot of a"):
        make(kind, opts).restore({"pos": 3})


@pytest.mark.parametrize("kind,opts", CASES)
def test_checkpoint_puts_a_timed_step_back(kind, opts):
    cache, _ = replay(kind, opts, [20, 1, 1])
    before = state(cache)
    back = cache.checkpoint()
    for _ in range(3):
        Writer(cache, seed=4).write(1)
        back()
        assert cache.pos == 22 and same_state(state(cache), before)


# ---- the model on every kind ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts(tiny_model):
    return seed_prompts(tiny_model.config.n_positions)  # 20 prompts of 1 .. 28 tokens, then 100 new tokens


@pytest.mark.slow
@pytest.mark.parametrize("kind,opts", [c for c in CASES if CACHE_KINDS[c.values[0]].exact and (
    not CACHE_KINDS[c.values[0]].evicts or c.values[1] == CACHE_KINDS[c.values[0]].examples[0])])
def test_exact_kinds_equal_their_reference_20_prompts_x_100_tokens(tiny_model, prompts, kind, opts):
    """Teacher-forced against the reference: when every cached token is the reference's argmax on the same context
    and the logits agree, the uncached greedy loop would have produced exactly these tokens. (An evicting kind runs
    it with its first example; its other examples, whose mechanics are the same code, with the shorter tests.)"""
    cls = CACHE_KINDS[kind]
    reference = cls.reference(cls.parse_options(**opts))
    worst = 0.0
    for p in prompts:
        if p.shape[1] < cls.min_prompt(cls.parse_options(**opts)):
            with pytest.raises(ValueError, match="longer than the prompt"):
                greedy(tiny_model, p, 100, layout=kind, **opts)
            continue
        out = greedy(tiny_model, p, 100, layout=kind, **opts)
        with torch.no_grad():  # an evicting kind's reference: the keep-mask its run noted
            ref = tiny_model(torch.cat([p, out.tokens], dim=1), **reference, **keeps(out))[0, p.shape[1] - 1:-1]
        assert torch.equal(ref.argmax(-1), out.tokens[0]), f"prompt of {p.shape[1]} tokens diverged"
        worst = max(worst, (out.logits[0] - ref).abs().max().item())
    assert worst <= 1e-4


@pytest.mark.parametrize("kind,opts", [c for c in CASES if CACHE_KINDS[c.values[0]].exact])
def test_exact_kinds_chunked_prefill_and_batches_equal_the_reference(tiny_model, kind, opts):
    reference = CACHE_KINDS[kind].reference(CACHE_KINDS[kind].parse_options(**opts))
    ids = torch.randint(0, 50257, (2, 23), generator=torch.Generator().manual_seed(7))
    cache = new_cache(tiny_model, kind, max_len=30, batch=2, **opts)
    noted = KeepRecord()
    pieces = []
    for a, b in [(0, 5), (5, 6), (6, 17), (17, 23)]:
        noted.note(cache, b - a)
        pieces.append(prefill(tiny_model, ids[:, a:b], cache)[0])
    with torch.no_grad():
        full = tiny_model(ids, **reference, **({"keep": noted} if cache.evicts else {}))
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() <= 1e-5
    out = greedy(tiny_model, ids, 30, layout=kind, **opts)
    ref = greedy(tiny_model, ids, 30, **reference, **keeps(out))
    assert torch.equal(out.tokens, ref.tokens) and (out.logits - ref.logits).abs().max().item() <= 1e-4


def keeps(out) -> dict:
    """The keep-mask an evicting kind's generation noted, as the reference's keyword; {} for every other kind."""
    return {} if out.keeps is None else {"keep": out.keeps}


class Checked:
    """Wraps a lossy cache's update to check its documented bound on the K and V the real model writes."""

    def __init__(self, cache):
        self.cache, self.checked = cache, 0
        self.written = [([], []) for _ in range(cache.n_layer)]
        inner = cache.update

        def update(layer, k, v):
            self.written[layer][0].append(k.to(cache.dtype))
            self.written[layer][1].append(v.to(cache.dtype))
            kr, vr = inner(layer, k, v)
            kb, vb = cache.error_bound(layer)
            kw, vw = (torch.cat(x, dim=2) for x in self.written[layer])
            assert ((kr.float() - kw.float()).abs() <= kb * (1 + 1e-5) + 1e-6).all()
            assert ((vr.float() - vw.float()).abs() <= vb * (1 + 1e-5) + 1e-6).all()
            self.checked += 1
            return kr, vr

        cache.update = update


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind,opts", [c for c in CASES if not CACHE_KINDS[c.values[0]].exact])
def test_lossy_kinds_stay_within_their_documented_bound_in_the_model(tiny_model, prompts, kind, opts, dtype):
    model = tiny_model if dtype == torch.float32 else copy.deepcopy(tiny_model).to(dtype)
    for p in prompts[::4]:
        cache = new_cache(model, kind, max_len=p.shape[1] + 40, **opts)
        check = Checked(cache)
        nxt = prefill(model, p, cache, last_only=True)[0].argmax(-1)
        for _ in range(39):
            nxt = decode_step(model, nxt, cache)[0].argmax(-1)
        assert check.checked == 40 * model.config.n_layer

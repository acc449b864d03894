"""Property tests over random small models, prompt lengths, chunkings, batch sizes and every kind in CACHE_KINDS
(with each option set its class lists in ``examples``), so a kind registered later is covered with no new test.
Bounded (a few dozen examples each, derandomized so a CI run is repeatable) to keep the suite within its budget."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.generate import decode_step, new_cache, prefill
from models.gpt2 import GPT2, GPT2Config
from models.kv_cache import CACHE_KINDS, KeepRecord, make_cache
from models.kv_cache.quant import BITS, offset, quantize_symmetric, symmetric_bound
from tests.helpers.caches import attend, own_bytes

BOUNDED = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOCAB, POSITIONS = 97, 48


@st.composite
def setups(draw, kinds):
    kind = draw(st.sampled_from(kinds))
    cls = CACHE_KINDS[kind]
    opts = draw(st.sampled_from(cls.examples))
    chunks = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    chunks[0] = max(chunks[0], cls.min_prompt(cls.parse_options(**opts)))  # a kind's shortest prompt (a SnapKV window)
    return dict(
        kind=kind, opts=opts, n_layer=draw(st.integers(1, 3)), n_head=draw(st.integers(1, 4)),
        head_dim=draw(st.sampled_from([2, 4, 6, 8, 12])), batch=draw(st.integers(1, 3)),
        chunks=chunks, new=draw(st.integers(1, 10)), seed=draw(st.integers(0, 2 ** 16)))


def room(kind: str, opts: dict, tokens: int) -> int:
    """max_len for ``tokens``: at least an evicting kind's budget (a budget above max_len is refused)."""
    return max(tokens, opts.get("budget", 1) if CACHE_KINDS[kind].evicts else 1)


def keep_of(cache, record) -> dict:
    """The reference's keyword for an evicting kind: the keep-mask its run noted; {} for every other kind."""
    return {"keep": record} if cache.evicts else {}


def build(s) -> GPT2:
    torch.manual_seed(s["seed"])
    cfg = GPT2Config(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_head"] * s["head_dim"],
                     n_positions=POSITIONS, vocab_size=VOCAB)
    return GPT2(cfg).eval()


def cached_run(model, s, ids, kind=None, opts=None):
    """Prefill ``ids`` (B, T) in the drawn chunks, then ``new`` greedy decode steps: (tokens, logits at every
    position that was fed), as the cache computed them."""
    kind, opts = kind or s["kind"], s["opts"] if opts is None else opts
    cache = new_cache(model, kind, max_len=room(kind, opts, ids.shape[1] + s["new"]), batch=ids.shape[0], **opts)
    noted = KeepRecord()
    logits, start = [], 0
    for t in s["chunks"]:
        noted.note(cache, t)
        logits.append(prefill(model, ids[:, start:start + t], cache)[0])
        start += t
    tokens = []
    for _ in range(s["new"]):
        nxt = logits[-1][:, -1:].argmax(-1)
        tokens.append(nxt)
        noted.note(cache, 1)
        logits.append(decode_step(model, nxt, cache)[0])
    noted.note(cache, 1)  # the forward the last token would get
    return torch.cat(tokens, 1), torch.cat(logits, 1), cache, noted


EXACT = [k for k, c in CACHE_KINDS.items() if c.exact]
LOSSY = [k for k, c in CACHE_KINDS.items() if not c.exact]
FULL = [k for k in EXACT if CACHE_KINDS[k].full_attention(CACHE_KINDS[k].Options())]  # as configured


@BOUNDED
@given(setups(EXACT))
def test_exact_kinds_equal_their_reference(s):
    model = build(s)
    ids = torch.randint(0, VOCAB, (s["batch"], sum(s["chunks"])), generator=torch.Generator().manual_seed(s["seed"]))
    tokens, logits, cache, noted = cached_run(model, s, ids)
    with torch.no_grad():  # every fed position
        ref = model(torch.cat([ids, tokens], 1), **cache.reference(cache.opts), **keep_of(cache, noted))
    assert torch.equal(ref[:, ids.shape[1] - 1:-1].argmax(-1), tokens)  # tokens identical to the reference's choice
    assert (logits - ref).abs().max().item() <= 1e-4


RAGGED = [k for k in EXACT if not CACHE_KINDS[k].why_no_padding]


@BOUNDED
@given(setups(RAGGED), st.lists(st.integers(1, 12), min_size=2, max_size=4), st.integers(0, 5))
def test_ragged_batches_give_each_sequence_what_it_gets_alone(s, lengths, extra):
    """Prompts of the drawn lengths, left-padded (``extra`` more padding slots than needed), prefilled in the drawn
    chunks, then decoded: each sequence's logits equal its own reference run, alone and unpadded."""
    model = build(s)
    g = torch.Generator().manual_seed(s["seed"])
    shortest = CACHE_KINDS[s["kind"]].min_prompt(CACHE_KINDS[s["kind"]].parse_options(**s["opts"]))
    if shortest > 1:  # a kind that chooses from the whole prompt (SnapKV) gets every prompt whole, in one forward
        lengths = [max(n, shortest) for n in lengths]
        s = {**s, "chunks": [max(lengths) + extra]}
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    T = max(lengths) + extra
    ids = torch.stack([torch.cat([torch.randint(0, VOCAB, (T - len(p),), generator=g), p]) for p in prompts])
    pad = torch.tensor([T - len(p) for p in prompts])
    cache = new_cache(model, s["kind"], max_len=room(s["kind"], s["opts"], T + s["new"]), batch=len(prompts),
                      **s["opts"])
    cache.set_padding(pad)
    noted = KeepRecord(pad)
    cuts = sorted({0, T} | {c for c in torch.cumsum(torch.tensor(s["chunks"]), 0).tolist() if c < T})
    logits = []
    for a, b in zip(cuts, cuts[1:]):
        noted.note(cache, b - a)
        logits.append(prefill(model, ids[:, a:b], cache)[0])
    tokens = []
    for _ in range(s["new"]):
        tokens.append(logits[-1][:, -1:].argmax(-1))
        noted.note(cache, 1)
        logits.append(decode_step(model, tokens[-1], cache)[0])
    noted.note(cache, 1)
    fed = torch.cat(logits, 1)  # (B, T + new, vocab)
    tokens = torch.cat(tokens, 1)
    for i, p in enumerate(prompts):
        with torch.no_grad():  # an evicting kind: the keep-mask its run noted, of this sequence alone
            ref = model(torch.cat([p, tokens[i]]).unsqueeze(0), **cache.reference(cache.opts),
                        **keep_of(cache, noted.sequence(i)))[0]
        assert (fed[i, int(pad[i]):] - ref).abs().max().item() <= 1e-4


@BOUNDED
@given(setups(FULL))
def test_full_attention_kinds_equal_each_other(s):
    model = build(s)
    ids = torch.randint(0, VOCAB, (s["batch"], sum(s["chunks"])), generator=torch.Generator().manual_seed(s["seed"]))
    first_tokens, first_logits, _, _ = cached_run(model, s, ids, FULL[0], {})
    for kind in FULL[1:]:
        tokens, logits, _, _ = cached_run(model, s, ids, kind, {})
        assert torch.equal(tokens, first_tokens) and (logits - first_logits).abs().max().item() <= 1e-5
    if "window" in CACHE_KINDS:  # a window wider than the sequence is full attention too
        tokens, _, _, _ = cached_run(model, s, ids, "window", {"window": POSITIONS, "sinks": 0})
        assert torch.equal(tokens, first_tokens)


@BOUNDED
@given(setups(list(CACHE_KINDS)), st.sampled_from(DTYPES))
def test_nbytes_is_the_formula_and_the_storage_kept_alive(s, dtype):
    cache = make_cache(s["kind"], s["n_layer"], s["n_head"], s["head_dim"],
                       room(s["kind"], s["opts"], sum(s["chunks"]) + s["new"]), s["batch"], dtype=dtype, **s["opts"])
    g = torch.Generator().manual_seed(s["seed"])
    for t in s["chunks"] + [1] * s["new"]:
        for layer in range(s["n_layer"]):
            k = torch.randn(s["batch"], s["n_head"], t, s["head_dim"], generator=g).to(dtype)
            attend(cache, layer, t, k, -k, g)
        cache.advance(t)
        assert cache.nbytes == own_bytes(cache) == cache.formula_nbytes()


@pytest.mark.skipif(not LOSSY, reason="no lossy kind is registered")
@BOUNDED
@given(setups(LOSSY or ["concat"]), st.sampled_from(DTYPES))
def test_lossy_kinds_stay_within_their_bound(s, dtype):
    cache = make_cache(s["kind"], s["n_layer"], s["n_head"], s["head_dim"], sum(s["chunks"]) + s["new"],
                       s["batch"], dtype=dtype, **s["opts"])
    g = torch.Generator().manual_seed(s["seed"])
    written = [[] for _ in range(s["n_layer"])]
    for t in s["chunks"] + [1] * s["new"]:
        for layer in range(s["n_layer"]):
            k = (torch.randn(s["batch"], s["n_head"], t, s["head_dim"], generator=g) * 3 + 1).to(dtype)
            written[layer].append(k)
            got_k, got_v = cache.update(layer, k, -k)
            want = torch.cat(written[layer], 2).float()
            kb, vb = cache.error_bound(layer)
            assert ((got_k.float() - want).abs() <= kb * (1 + 1e-5) + 1e-6).all()
            assert ((got_v.float() + want).abs() <= vb * (1 + 1e-5) + 1e-6).all()
        cache.advance(t)


@BOUNDED
@given(st.sampled_from(BITS), st.integers(1, 40), st.integers(1, 6), st.integers(-30, 13), st.integers(0, 2 ** 16),
       st.booleans())
def test_the_symmetric_quantiser_stays_within_its_stated_bound(bits, G, groups, exponent, seed, tie):
    """Any tensor, any group size, magnitudes from 2^-30 to 2^13 (fp16 subnormal scales included; above, a 2-bit
    scale m / -2 may pass fp16's 65504 and the group turns non-finite, as documented): every value
    dequantised from llama.cpp's symmetric codes is within the bound quantize_symmetric states (symmetric_bound:
    from the codes and scales alone), the codes lie in [-N, N - 1] (8 bits: [-127, 127]), and the value a group's
    scale is made from is the end of the range: +-127 at 8 bits, -N at 4 and 2 (the clamp acts only on the other
    sign). ``tie``: a group's largest magnitude comes twice, with both signs (the first one is m)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, groups, G, generator=g) * 2.0 ** exponent
    if tie and G > 1:  # the first value of largest magnitude (m) at 0, its negation last
        x[..., 0] = torch.copysign(x.abs().amax(2) * 1.5, x[..., 0])
        x[..., -1] = -x[..., 0]
    q, scale = quantize_symmetric(x, bits, dim=2)
    N = offset(bits)
    code = q.float() - N
    assert bool((code >= (-127 if bits == 8 else -N)).all()) and bool((code <= (127 if bits == 8 else N - 1)).all())
    deq = code * scale.float()
    err = (deq - x).abs()
    bound = symmetric_bound(q, scale.float().expand_as(x), bits)
    assert bool((err <= bound).all())
    first = x.abs().argmax(2, keepdim=True)  # m: the end of the range the scale is made from
    want = torch.where(x.gather(2, first) > 0, 127.0, -127.0) if bits == 8 else torch.full_like(first, -N).float()
    assert torch.equal(code.gather(2, first), want)

"""Both engines behind one interface: HF transformers' GPT-2 on our weights generates our tokens with its
counterpart caches, and rewinding, checkpoints and byte counts work on DynamicCache and StaticCache; its
QuantizedCache (quanto) runs beside our quant kind, its bytes counted from what it stores."""

import copy
import math

import pytest
import torch

from harness.core.engines import HF_COUNTERPARTS, HFEngine, KvlabEngine, QuantoStorage
from models.kv_cache import KeepRecord, cache_kind, kv_bytes

EXACT = [k for k in HF_COUNTERPARTS if cache_kind(k).exact]


@pytest.fixture(scope="module")
def engines(tiny_model):
    return KvlabEngine(tiny_model), HFEngine(tiny_model)


@pytest.mark.parametrize("kind", EXACT)
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


@pytest.mark.parametrize("kind", EXACT)
def test_hf_rewind_checkpoint_and_nbytes(engines, kind):
    _, hf = engines
    c = hf.model.config
    prompt = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = hf.new_cache(kind, max_len=32)
    assert type(cache).__name__ == HF_COUNTERPARTS[kind].name
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


def quanto_bytes(B, H, D, n_layer, bits, G, quantised, tail, isz=4):
    """What quanto stores for K and V: per layer and tensor, B*H*tokens*D/G groups of G values, 8/bits groups
    packed to a byte each, and an fp32 scale and shift per group; plus the full-precision tail."""
    groups = B * H * quantised * D // G
    return n_layer * 2 * (math.ceil(groups * bits / 8) * G + groups * 2 * isz + B * H * tail * D * isz)


TOKEN = {"k_axis": "token"}  # the layout quanto runs: K grouped per token, as V (engine=hf refuses K per channel)


@pytest.mark.parametrize("opts,dtype", [({}, torch.float32), ({"residual": 3}, torch.float32),
                                        ({"k_bits": 2, "v_bits": 2, "group_size": 16, "residual": 2}, torch.float32),
                                        ({"k_bits": 2, "v_bits": 2}, torch.float32),  # 6 x tokens groups: rounded up
                                        ({"residual": 2}, torch.bfloat16)])  # scales and shifts in bf16
def test_hf_quantized_cache_holds_what_its_layout_says_and_checkpoints(tiny_model, opts, dtype):
    """Every ``residual`` steps (every step for 0) it quantises all tokens so far; the rest wait in full
    precision. The bytes read from its quanto tensors equal that layout at every step, at batch 1 and 3."""
    opts = {**TOKEN, **opts}
    hf = HFEngine(copy.deepcopy(tiny_model).to(dtype))
    c = hf.model.config
    H, D, o = c.n_head, c.n_embd // c.n_head, cache_kind("quant").parse_options(**opts)
    R, isz = o.residual, torch.empty((), dtype=dtype).element_size()
    for B in (1, 3):
        prompt = torch.randint(0, 50257, (B, 7), generator=torch.Generator().manual_seed(B))
        cache = hf.new_cache("quant", max_len=64, batch=B, **opts)
        assert type(cache).__name__ == "QuantizedCache"
        logits = hf.prefill(prompt, cache, last_only=True)
        for step in range(12):
            tail = step % R if R else 0
            want = quanto_bytes(B, H, D, c.n_layer, o.k_bits, o.group_size, 7 + step - tail, tail, isz)
            assert hf.nbytes(cache) == want
            assert QuantoStorage(7).nbytes_formula(c.n_layer, H, D, 64, B, dtype, 7 + step, o) == want
            logits = hf.decode(logits[:, -1:].argmax(-1), cache)
        back = hf.checkpoint(cache)  # it cannot crop: the checkpoint keeps each layer's state instead
        token = torch.full((B, 1), 42)
        first = hf.decode(token, cache)
        back()
        assert int(cache.get_seq_length()) == 19 and torch.equal(hf.decode(token, cache), first)
        with pytest.raises(ValueError, match="cannot drop tokens"):
            hf.rewind(cache, 1)
        hf.reset(cache)
        assert int(cache.get_seq_length()) == 0 and hf.nbytes(cache) == 0
        assert torch.equal(hf.prefill(prompt, cache, last_only=True), hf.prefill(prompt, hf.new_cache(
            "quant", 64, B, **opts), last_only=True))


def test_hf_quantized_cache_is_lossy_and_fewer_bits_lose_more(engines):
    """Both quantised caches move the logits off the exact cache's, 2 bits further than 4, each engine's by an
    amount of the same order (the same layout, K and V per token; quanto re-quantises its history every step)."""
    ours, hf = engines
    prompt = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(3))
    exact = ours.greedy(prompt, 16, layout="prealloc")
    drift = {}
    for e in (ours, hf):
        for bits in (4, 2):
            # teacher-forced on the exact cache's tokens, so both engines score the same contexts
            cache = e.new_cache("quant", 36, 2, k_bits=bits, v_bits=bits, **TOKEN)
            seq = torch.cat([prompt, exact.tokens], dim=1)
            logits = [e.prefill(seq[:, :20], cache, last_only=True)]
            logits += [e.decode(seq[:, i:i + 1], cache) for i in range(20, 35)]
            drift[e.name, bits] = (torch.cat(logits, dim=1) - exact.logits).abs().max().item()
    for name in ("kvlab", "hf"):
        assert 0 < drift[name, 4] < drift[name, 2]
    assert 0.2 < drift["hf", 4] / drift["kvlab", 4] < 5


def test_hf_quantized_runs_bytes_and_decode_drift_measured_as_ours(engines, tiny_model):
    """Through the harness's own measurements: with a residual, the bytes after a prompt and every step match
    quanto's layout from that prompt on; and HF's prefill attends to the prompt unquantised, so the text drift
    of its prefill positions is ~0 and all of it sits in the decode positions, which ``drift_kl_decode`` isolates."""
    from harness.core import measure

    _, hf = engines
    spec = measure.CacheSpec("quant", {"residual": 3, **TOKEN})
    prompt = torch.randint(0, 50257, (1, 9), generator=torch.Generator().manual_seed(5))
    rec, curve, _ = measure.cache_memory(hf, spec, prompt, 8, 64)
    assert rec["nbytes_match"] and rec["nbytes_curve_match"] and curve.nbytes_measured.notna().sum() == 8
    texts = [torch.randint(0, 50257, (1, 30), generator=torch.Generator().manual_seed(s)) for s in (6, 7)]
    got, _ = measure.text_drift(hf, KvlabEngine(tiny_model), spec, texts, T=10)
    decode_share = 2 * 19 / got["drift_text_positions"]  # 29 scored positions per text, 10 of them by the prefill
    assert got["drift_kl_decode"] > 0
    assert got["drift_kl"] == pytest.approx(got["drift_kl_decode"] * decode_share, rel=1e-3)


def test_hf_refuses_what_it_has_no_counterpart_of(engines):
    _, hf = engines
    with pytest.raises(ValueError, match="no counterpart of cache kind 'window' here: it runs concat"):
        hf.new_cache("window", max_len=16)
    with pytest.raises(ValueError, match="full attention only"):
        hf.forward(torch.tensor([[1, 2, 3]]), window=2, sinks=0)
    with pytest.raises(ValueError, match="in the model dtype"):
        hf.new_cache("prealloc", max_len=16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"does not run k_bits=8 \(quanto quantises K and V to one width, its "
                                         r"nbits: 4 or 2\): pass cache.k_bits=4, or use engine=kvlab"):
        hf.new_cache("quant", max_len=16, k_bits=8, **TOKEN)
    with pytest.raises(ValueError, match=r"does not run group_size=5 \(quanto's q_group_size must divide the head "
                                         r"size 32\): pass cache.group_size=4"):
        hf.new_cache("quant", max_len=16, group_size=5, **TOKEN)
    with pytest.raises(ValueError, match="does not run k_axis=channel .*: pass cache.k_axis=token"):
        hf.new_cache("quant", max_len=16)  # quant's default groups K per channel: quanto cannot
    with pytest.raises(ValueError, match="has no option 'window'"):
        hf.new_cache("quant", max_len=16, window=4)


def test_bytes_read_count_what_each_engines_cache_hands_attention(engines):
    """HF's StaticCache returns all max_len slots to attention every step (masked): a step reads them all; its
    DynamicCache and our kinds read the ctx + 1 tokens held."""
    from harness.core.measure import CacheSpec, kv_read_bytes

    ours, hf = engines
    c = ours.model.config
    per_token = 2 * c.n_layer * c.n_embd * 4
    for e in (ours, hf):
        assert kv_read_bytes(e, CacheSpec("concat"), 64, 10) == per_token * 11
    assert kv_read_bytes(ours, CacheSpec("prealloc"), 64, 10) == per_token * 11
    assert kv_read_bytes(hf, CacheSpec("prealloc"), 64, 10) == per_token * 64


def test_engine_ratios_pair_runs_of_the_same_options_only():
    """A sweep over quant's bits on both engines: each bit width gets its own ours / HF row, never a median of
    both."""
    import pandas as pd

    from harness.analysis.report import engine_ratios

    rows = []
    for label, ms in (("quant k4/v4 g32", 10.0), ("quant k2/v2 g32", 30.0)):
        for engine, factor in (("kvlab", 1.0), ("hf", 2.0)):
            rows.append(dict(model="tiny", cache="quant", cache_label=label + ("" if engine == "kvlab" else " · hf"),
                             dtype="fp32", device="cpu", context_len=8, engine=engine, mode="cached", status="ok",
                             ms_median=ms * factor + (0 if engine == "kvlab" else ms)))
    got = engine_ratios(pd.DataFrame(rows)).set_index("cache")
    assert set(got.index) == {"quant k4/v4 g32", "quant k2/v2 g32"}
    assert got.loc["quant k4/v4 g32", "ours_over_hf"] == pytest.approx(10 / 30)
    assert got.loc["quant k2/v2 g32", "ours_over_hf"] == pytest.approx(30 / 90)


# ---- the engine protocol: a conformance suite over ENGINES -------------------------------------------------------

from harness.core.engines import ENGINES, Engine  # noqa: E402
from models.kv_cache import CACHE_KINDS  # noqa: E402


def _kinds_run_by(cls):
    return [k for k, c in CACHE_KINDS.items() if cls.refuses(k, c.parse_options(**c.examples[0])) is None]


@pytest.fixture(scope="module")
def every_engine(tiny_model):
    return {name: cls(tiny_model) for name, cls in ENGINES.items()}


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_follows_the_protocol(every_engine, name):
    e, cls = every_engine[name], ENGINES[name]
    assert isinstance(e, Engine) and e.name == name and isinstance(cls.holds_weight_copy, bool)
    assert _kinds_run_by(cls), f"{name} runs no cache kind"
    for kind, c in CACHE_KINDS.items():  # what it refuses, it refuses in one line, before building anything
        why = cls.refuses(kind, c.parse_options(**c.examples[0]))
        assert why is None or (isinstance(why, str) and why and "\n" not in why)
        if why is not None:
            with pytest.raises(ValueError):
                e.new_cache(kind, 16, 1, None, **c.examples[0])
    for why in (cls.refuses_ragged(), cls.refuses_compile("prealloc"), cls.refuses_compile("concat")):
        assert why is None or (isinstance(why, str) and "\n" not in why)
    assert cls.refuses_compile("concat") is not None  # a compiled step needs static shapes
    assert isinstance(cls.runs_references, bool)
    if cls.runs_references:  # its forward applies a kind's reference: a window moves the late logits
        seq = torch.randint(0, 50257, (1, 10), generator=torch.Generator().manual_seed(3))
        assert (e.forward(seq, window=3, sinks=1)[:, -1] - e.forward(seq)[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_prefill_decode_checkpoint_and_bytes_agree_with_its_forward(every_engine, name):
    e = every_engine[name]
    seq = torch.randint(0, 50257, (1, 10), generator=torch.Generator().manual_seed(3))
    full = e.forward(seq)  # (1, 10, vocab): the oracle
    assert torch.allclose(e.forward_last(seq)[:, -1], full[:, -1], atol=1e-4)
    for kind in _kinds_run_by(ENGINES[name]):
        c = CACHE_KINDS[kind]
        if not c.exact:
            continue
        opts = c.examples[0]
        ref = c.reference(c.parse_options(**opts))
        if ref and not ENGINES[name].runs_references:
            continue
        cache = e.new_cache(kind, 16, 1, None, **opts)
        noted = KeepRecord()  # an evicting kind's reference: what it held before each forward
        noted.note(cache, 6)
        got = [e.prefill(seq[:, :6], cache)]
        back = e.checkpoint(cache)
        for i in range(6, 10):
            noted.note(cache, 1)
            got.append(e.decode(seq[:, i:i + 1], cache))
        want = e.forward(seq, **ref, **({"keep": noted} if c.evicts else {}))
        assert (torch.cat(got, dim=1) - want).abs().max().item() <= 1e-4, kind
        held = e.nbytes(cache)
        store = e.storage(measure_spec(kind, opts), 6)
        assert held > 0 and store.bytes_per_token(2, 2, 32, torch.float32, c.parse_options(**opts)) > 0
        back()  # undone: the next step at position 6 gives the same logits again
        assert (e.decode(seq[:, 6:7], cache) - want[:, 6:7]).abs().max().item() <= 1e-4, kind
        n = e.keys_read(kind, 8, 16)
        assert n is None or 8 < n <= 16
        a = e.greedy(seq[:, :4], 6, layout=kind, **opts)
        b = e.greedy(seq[:, :4], 6, layout=None, **ref, **({} if a.keeps is None else {"keep": a.keeps}))
        assert torch.equal(a.tokens, b.tokens), kind


def measure_spec(kind, opts):
    from harness.core.measure import CacheSpec

    return CacheSpec(kind, opts)


@pytest.mark.parametrize("kind,options", [("concat", {}), ("prealloc", {}), ("quant", TOKEN)])
def test_hf_texts_passed_together_each_get_what_they_get_alone(engines, kind, options):
    """text_drift passes texts of one length as the rows of one cache: HF's caches (its QuantizedCache too) keep the
    rows apart."""
    from harness.core import measure

    _, hf = engines
    texts = torch.randint(0, 50257, (3, 21), generator=torch.Generator().manual_seed(2))
    spec = measure.CacheSpec(kind, options, torch.float32)
    rows, _ = measure.text_pass_rows(hf, spec, texts, 7)
    for b in range(3):
        alone, _ = measure.text_pass(hf, spec, texts[b:b + 1], 7)
        assert (rows[b] - alone).abs().max().item() <= 1e-4, b

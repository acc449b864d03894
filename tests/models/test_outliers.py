"""``models.outliers``: one K and one V channel per head made S times larger without changing what the model computes
(its logits at every position, uncached and through a cache, to rounding), so the caches carry outlier channels; S = 1
is the identity bit for bit; bad input is one line."""

import copy
import math

import pytest
import torch

from models.generate import decode_step, new_cache, prefill
from models.gpt2 import GPT2, GPT2Config
from models.outliers import choose, inject

CFG = dict(n_layer=3, n_head=4, n_embd=64, n_positions=64, vocab_size=200)  # head_dim 16


@pytest.fixture(scope="module")
def model() -> GPT2:
    """A small GPT-2, random weights, with random biases and layer norms too (GPT-2's init zeroes the biases, which
    would leave the transform's bias half untested)."""
    torch.manual_seed(0)
    m = GPT2(GPT2Config(**CFG)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


def transformed(model: GPT2, scale: float, **kw) -> tuple[GPT2, dict]:
    m = copy.deepcopy(model)
    return m, inject(m, scale, **kw)


def ids(seed: int = 1, batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def cached_logits(model: GPT2, x: torch.Tensor, prompt: int = 8) -> torch.Tensor:
    """Logits of every position of ``x`` through a prealloc cache: the first ``prompt`` in one prefill, the rest one
    decode step each (B, T, vocab)."""
    cache = new_cache(model, "prealloc", max_len=x.shape[1], batch=x.shape[0])
    out = [prefill(model, x[:, :prompt], cache)[0]]
    for t in range(prompt, x.shape[1]):
        out.append(decode_step(model, x[:, t:t + 1], cache)[0])
    return torch.cat(out, dim=1)


def kv(model: GPT2, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a prealloc cache holds after a prefill of ``x``: K and V, (L, B, nh, T, hs) each."""
    cache = new_cache(model, "prealloc", max_len=x.shape[1], batch=x.shape[0])
    prefill(model, x, cache)
    return cache.k, cache.v


def channel_ratio(x: torch.Tensor) -> torch.Tensor:
    """scripts/probes/kv_stats.py's channel ratio, per layer: the largest channel's max |x| over tokens over the median
    channel's, per head, averaged over heads. x: (L, B, nh, T, hs) -> (L,)."""
    amax = x.abs().amax(dim=(1, 3))  # (L, nh, hs)
    return (amax.amax(-1) / amax.median(-1).values).mean(-1)


@pytest.mark.parametrize("scale", [20.0, 1000.0, 0.05])
def test_the_transformed_model_computes_the_same_logits_at_every_position(model, scale):
    m, chosen = transformed(model, scale)
    assert chosen["scale"] == scale and len(chosen["k_channels"]) == CFG["n_layer"]
    c_attn = m.transformer.h[0].attn.c_attn.weight
    assert not torch.equal(c_attn, model.transformer.h[0].attn.c_attn.weight)  # the weights did change
    x = ids()
    with torch.no_grad():
        ref, got = model(x), m(x)
    assert (got - ref).abs().max().item() < 1e-5
    ref_cached, got_cached = cached_logits(model, x), cached_logits(m, x)
    assert (got_cached - ref_cached).abs().max().item() < 1e-5  # the cached decode path too
    assert (got_cached - ref).abs().max().item() < 1e-5


def test_the_caches_carry_the_outlier_channels(model):
    S = 20.0
    m, chosen = transformed(model, S)
    x = ids(length=48)
    k0, v0 = kv(model, x)
    k1, v1 = kv(m, x)
    for before, after, channels in ((k0, k1, chosen["k_channels"]), (v0, v1, chosen["v_channels"])):
        assert (channel_ratio(before) < S / 4).all()  # the model's own: no outliers
        assert (channel_ratio(after) > S / 2).all()  # every layer now has them
        # where they were put: the chosen channel of each layer and head S times what it was, every other as it was
        factor = torch.ones(after.shape[0], after.shape[2], after.shape[-1])  # (L, nh, hs)
        factor.scatter_(-1, torch.tensor(channels).unsqueeze(-1), S)
        expect = before * factor[:, None, :, None, :]
        assert torch.allclose(after, expect, rtol=1e-4, atol=1e-5 * S)
        assert not torch.allclose(after, before, rtol=1e-2)


def quant_error(model: GPT2, x: torch.Tensor, **opts) -> float:
    """max |dlogit| of every position of ``x`` through a quant cache (prefill 16, then a decode step each) against
    the same model's uncached fp32 logits."""
    cache = new_cache(model, "quant", max_len=x.shape[1], batch=x.shape[0], **opts)
    out = [prefill(model, x[:, :16], cache)[0]]
    for t in range(16, x.shape[1]):
        out.append(decode_step(model, x[:, t:t + 1], cache)[0])
    with torch.no_grad():
        return (torch.cat(out, dim=1) - model(x)).abs().max().item()


@pytest.mark.parametrize("tensor", ["k", "v"])
def test_outliers_cost_a_scale_per_token_and_not_a_scale_per_channel(model, tensor):
    """The mechanism KIVI's K recipe rests on, caused here: the same model's function with outlier channels moves a
    cache quantised per token (a token's range is now its outlier's), and leaves one quantised per channel as it was
    (a channel's scale absorbs its factor)."""
    m, _ = transformed(model, 20.0)
    x = ids(length=48)
    err = {(axis, name): quant_error(mod, x, k_bits=4, v_bits=4, group_size=16, quantize=tensor, k_axis=axis,
                                     v_axis=axis)
           for axis in ("token", "channel") for name, mod in (("own", model), ("outliers", m))}
    assert err["token", "outliers"] > 3 * err["token", "own"]
    assert err["channel", "outliers"] < 1.1 * err["channel", "own"]


def test_scale_one_is_the_identity_bit_for_bit(model):
    for kw in ({}, dict(k_channels=3, v_channels=[1, 2, 3, 4]), dict(seed=7)):
        m, chosen = transformed(model, 1.0, **kw)
        assert chosen == dict(scale=1.0, k_channels=None, v_channels=None)
        before, after = model.state_dict(), m.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        assert all(a.stride() == b.stride() for a, b in zip(model.parameters(), m.parameters()))


def test_channels_are_given_for_all_heads_per_head_or_per_layer_and_a_recorded_choice_replays(model):
    L, H = CFG["n_layer"], CFG["n_head"]
    assert choose(model.config, 20, k_channels=5)["k_channels"] == [[5] * H] * L
    assert choose(model.config, 20, v_channels=[1, 2, 3, 4])["v_channels"] == [[1, 2, 3, 4]] * L
    per_layer = [[(layer + h) % 16 for h in range(H)] for layer in range(L)]
    assert choose(model.config, 20, k_channels=per_layer)["k_channels"] == per_layer
    seeded = choose(model.config, 20, seed=3)
    assert seeded != choose(model.config, 20, seed=4) and seeded == choose(model.config, 20, seed=3)
    # the choice a run records, given back, makes the same model
    a, chosen = transformed(model, 20.0, seed=3)
    b, _ = transformed(model, 20.0, k_channels=chosen["k_channels"], v_channels=chosen["v_channels"], seed=99)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # a choice of K alone leaves V's seeded choice as it was
    assert choose(model.config, 20, k_channels=0, seed=3)["v_channels"] == seeded["v_channels"]


@pytest.mark.parametrize("kw,message", [
    (dict(scale=0), "scale=0: use a positive finite number"),
    (dict(scale=-2.0), "scale=-2.0: use a positive finite number"),
    (dict(scale=math.inf), "scale=inf: use a positive finite number"),
    (dict(scale=math.nan), "scale=nan: use a positive finite number"),
    (dict(scale=True), "scale=True: use a positive finite number"),
    (dict(scale="20"), "scale='20': use a positive finite number"),
    (dict(scale=20, k_channels=16), "k_channels=16: channel 16 is not one of a head's 16 channels: use 0 .. 15"),
    (dict(scale=20, v_channels=-1), "v_channels=-1: channel -1 is not one of a head's 16 channels"),
    (dict(scale=20, k_channels=[1, 2, 3]), "k_channels=[1, 2, 3]: give one channel for every head (an int), 4 (one "
                                            "per head) or 3 lists of 4 (one per layer and head)"),
    (dict(scale=20, k_channels=[[1, 2, 3, 4]] * 2), "k_channels=[[1, 2, 3, 4], [1, 2, 3, 4]]: give one channel"),
    (dict(scale=20, v_channels=2.5), "v_channels=2.5: give one channel for every head"),
    (dict(scale=20, v_channels=True), "v_channels=True: give one channel for every head"),
    (dict(scale=1, k_channels=99), "k_channels=99: channel 99 is not one of"),  # checked whatever the scale
    (dict(scale=20, seed=-1), "seed=-1: use an integer 0 <= seed < 2**63"),
])
def test_bad_input_is_one_line_and_changes_nothing(model, kw, message):
    m = copy.deepcopy(model)
    with pytest.raises(ValueError) as e:
        inject(m, **kw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m.parameters()))

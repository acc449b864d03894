"""The quant kind: half-step error per bit width against a step worked out here, KIVI's grouping (K per channel, V
per token) and either axis for either tensor, the Hadamard rotation (orthonormal, a no-op in fp32 alone, and what it
buys a per-token K with an outlier channel), packed storage, the full-precision tails, the byte formula at GPT-2 size,
and drift that grows as bits shrink. The symmetric scheme: llama.cpp's q8_0 / q4_0 codes and scales value for value
(against a transcription of its loops), its error bound (the clamp at the top code included) against a bound worked
out here, and its bytes (llama.cpp's 34 and 18 B blocks)."""

import math

import numpy as np
import pytest
import torch

from models.generate import greedy
from models.kv_cache import kv_bytes, make_cache
from models.kv_cache.quant import hadamard, offset, pack, quantize_symmetric, symmetric_bound, unpack

BITS = [8, 4, 2]


def outlier_kv(B=1, nh=2, T=64, hs=16, seed=0):
    """K with outlier channels (large offsets and ranges, as trained K has), V without."""
    g = torch.Generator().manual_seed(seed)
    offset = torch.zeros(hs)
    offset[3], offset[11] = 40.0, -25.0
    spread = torch.ones(hs)
    spread[3], spread[11] = 8.0, 0.01  # a wide outlier, and a narrow one far from zero (fp16 rounding matters)
    k = torch.randn(B, nh, T, hs, generator=g) * spread + offset
    v = torch.randn(B, nh, T, hs, generator=g)
    return k, v


def half_step(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Half a quantisation step of each group (groups run along ``dim``), from the values alone; widened by fp16's
    rounding of the stored minimum and scale (2^-10 relative each), never by more."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    step = (hi - lo + lo.abs() * 2 ** -10) / (2 ** bits - 1) * (1 + 2 ** -10)
    return (step / 2).expand_as(x)


@pytest.mark.parametrize("k_bits", BITS)
@pytest.mark.parametrize("v_bits", BITS)
def test_every_dequantised_value_is_within_half_a_step(k_bits, v_bits):
    G, T, hs = 16, 64, 16
    k, v = outlier_kv(T=T, hs=hs)
    cache = make_cache("quant", 1, 2, hs, 80, k_bits=k_bits, v_bits=v_bits, group_size=G)
    kr, vr = cache.update(0, k, v)
    qk = (T - 1) // G * G  # K groups quantised once a token after them arrives: 48 of 64 here
    # K: per channel over groups of G tokens
    kg = k[:, :, :qk].reshape(1, 2, qk // G, G, hs)
    k_half = half_step(kg, k_bits, dim=3).reshape(1, 2, qk, hs)
    k_err = (kr[:, :, :qk] - k[:, :, :qk]).abs()
    assert (k_err <= k_half + 1e-6).all()
    assert (k_err > 0.25 * k_half).any()  # really quantised, and to the step worked out here
    assert torch.equal(kr[:, :, qk:], k[:, :, qk:])  # the newest tokens of K: full precision
    # V: per token over groups of G channels
    vg = v.reshape(1, 2, T, hs // G, G)
    v_half = half_step(vg, v_bits, dim=4).reshape(1, 2, T, hs)
    v_err = (vr - v).abs()
    assert (v_err <= v_half + 1e-6).all() and (v_err > 0.25 * v_half).any()


def test_k_is_grouped_per_channel_and_v_per_token():
    """An outlier channel of K must not widen the other channels' steps; an outlier token of V must not widen the
    other tokens' steps."""
    k, v = outlier_kv(T=33, hs=16)
    v[:, :, 5] *= 100.0  # one loud token
    cache = make_cache("quant", 1, 2, 16, 40, k_bits=4, v_bits=4, group_size=16)
    kr, vr = cache.update(0, k, v)
    quiet = [c for c in range(16) if c not in (3, 11)]
    k_err = (kr - k)[:, :, :32, quiet].abs().max()
    assert k_err < (k[:, :, :32, quiet].amax() - k[:, :, :32, quiet].amin()) / 15  # a quiet channel's own scale
    v_err = (vr - v).abs()
    assert v_err[:, :, 6:].max() < 0.5  # the other tokens keep steps of order 1 / 15 of their own range
    assert v_err[:, :, 5].max() > 1.0  # the loud token pays for itself


@pytest.mark.parametrize("k_axis,v_axis", [("token", "channel"), ("token", "token"), ("channel", "channel")])
def test_either_tensor_is_grouped_along_the_axis_it_is_given(k_axis, v_axis):
    """Per channel: a loud channel pays for itself and the others keep their own steps. Per token: a loud token
    pays for itself. Checked on K and V alike, whichever axis each is given."""
    T, hs, G = 33, 16, 16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, T, hs, generator=g)
    cache = make_cache("quant", 1, 2, hs, 40, k_bits=4, v_bits=4, group_size=G, k_axis=k_axis, v_axis=v_axis)
    for which, axis in (("k", k_axis), ("v", v_axis)):
        loud = x.clone()
        if axis == "channel":
            loud[..., 3] *= 100.0
        else:
            loud[:, :, 5] *= 100.0
        cache.reset()
        kr, vr = cache.update(0, loud, loud) if which == "k" else cache.update(0, x, loud)
        err = ((kr if which == "k" else vr) - loud)[:, :, :32].abs()  # 32 tokens quantised on either axis
        if axis == "channel":
            assert err[..., 3].max() > 1.0 and err[..., [c for c in range(hs) if c != 3]].max() < 0.5
        else:
            assert err[:, :, 5].max() > 1.0 and err[:, :, 6:].max() < 0.5


@pytest.mark.parametrize("n", [64, 32, 12, 7])
def test_the_hadamard_rotation_alone_changes_nothing_in_fp32(n):
    """Orthonormal, symmetric and its own inverse (on blocks of the largest power of two dividing n), so rotating
    and rotating back returns what was written within float32 rounding."""
    h = hadamard(n)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(n), atol=1e-6)
    block = n & -n
    assert (h.abs().max() - block ** -0.5).abs() < 1e-7 and ((h != 0).sum(1) == block).all()
    x = torch.randn(3, 2, 40, n, generator=torch.Generator().manual_seed(n)) * 30
    assert ((x @ h @ h - x).abs() <= 1e-6 * x.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("bits", [4, 2])
def test_rotation_shrinks_the_error_of_per_token_k_with_outlier_channels(bits):
    """QuaRot's and llama.cpp's case: K grouped per token, one block of channels for the whole head, two outlier
    channels widening every token's step. The rotation spreads them over all channels: K's error falls, V (no
    outliers) is unchanged, and the tails are still exact."""
    k, v = outlier_kv(T=64, hs=16)
    err = {}
    for rotate in ("none", "hadamard"):
        cache = make_cache("quant", 1, 2, 16, 80, k_bits=bits, v_bits=bits, group_size=16, k_axis="token",
                           rotate=rotate, residual=4)
        kr, vr = cache.update(0, k, v)
        assert torch.equal(kr[:, :, -4:], k[:, :, -4:]) and torch.equal(vr[:, :, -4:], v[:, :, -4:])
        err[rotate] = ((kr - k) ** 2).mean().item(), ((vr - v) ** 2).mean().item()
    assert err["hadamard"][0] < 0.5 * err["none"][0]
    assert 0.8 < err["hadamard"][1] / err["none"][1] < 1.25


def test_residual_tokens_stay_in_full_precision():
    k, v = outlier_kv(T=50, hs=16)
    cache = make_cache("quant", 1, 2, 16, 64, k_bits=2, v_bits=2, group_size=8, residual=12)
    kr, vr = cache.update(0, k, v)
    qk, qv = (50 - 12 - 1) // 8 * 8, 50 - 12  # 32 of K quantised, 38 of V
    assert torch.equal(kr[:, :, qk:], k[:, :, qk:]) and not torch.equal(kr[:, :, :qk], k[:, :, :qk])
    assert torch.equal(vr[:, :, qv:], v[:, :, qv:]) and not torch.equal(vr[:, :, :qv], v[:, :, :qv])


@pytest.mark.parametrize("residual", [0, 12])
def test_tail_residual_gives_either_axis_the_same_full_precision_tail(residual):
    """tail=residual: K per channel keeps exactly the newest ``residual`` tokens, as V per token does; the group still
    filling is read quantised, as that group zero-padded to group_size tokens and quantised on its own would be (KIVI's
    Table 1); a decode step with the cache fused reads the same history."""
    from models.kv_cache.quant import quantize

    k, v = outlier_kv(T=50, hs=16)
    cache = make_cache("quant", 1, 2, 16, 64, k_bits=2, v_bits=2, group_size=8, residual=residual, tail="residual")
    kr, vr = cache.update(0, k, v)
    full = 50 - residual  # tokens before the residual: all read quantised, on either axis
    for got, want in ((kr, k), (vr, v)):
        assert torch.equal(got[:, :, full:], want[:, :, full:])
        assert (got[:, :, :full] != want[:, :, :full]).any(dim=-1).all()  # every such token moved
    qk = (50 - residual - 1) // 8 * 8  # K's quantised groups; the filling group is the tokens qk .. full
    group = torch.cat([k[:, :, qk:full], k.new_zeros(1, 2, 8 - (full - qk), 16)], dim=2)
    q, scale, lo = quantize(group, 2, dim=2)
    assert torch.allclose(kr[:, :, qk:full], (lo.float() + q.float() * scale.float())[:, :, :full - qk], atol=1e-6)
    grouped = make_cache("quant", 1, 2, 16, 64, k_bits=2, v_bits=2, group_size=8, residual=residual)
    kg, _ = grouped.update(0, k, v)
    assert torch.equal(kg[:, :, qk:], k[:, :, qk:])  # tail=group: the filling group stays in full precision
    bk, bv = cache.error_bound(0)
    assert ((kr - k).abs() <= bk).all() and ((vr - v).abs() <= bv).all()
    assert (bk[:, :, qk:full] > 0).all() and (bk[:, :, full:] <= 1e-6 * k.abs().max()).all()
    fused = make_cache("quant", 1, 2, 16, 64, k_bits=2, v_bits=2, group_size=8, residual=residual, tail="residual")
    fused.update(0, k[:, :, :49], v[:, :, :49])
    fused.advance(49)
    fused.fused = True
    q = torch.randn(1, 2, 1, 16)
    y = fused.attend_decode(0, q, k[:, :, 49:], v[:, :, 49:])
    assert torch.allclose(y, torch.nn.functional.scaled_dot_product_attention(q, kr, vr), atol=1e-5)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [1, 7, 16, 33])
def test_pack_unpack_round_trip(bits, n):
    q = torch.randint(0, 2 ** bits, (3, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, math.ceil(n * bits / 8))
    assert torch.equal(unpack(packed, bits, n), q)


def test_storage_is_really_packed():
    sizes = {}
    for bits in BITS:
        c = make_cache("quant", 12, 12, 64, 1024, k_bits=bits, v_bits=bits)
        assert c.k_q.dtype == c.v_q.dtype == torch.uint8
        sizes[bits] = c.k_q.numel()
    assert sizes[8] == 2 * sizes[4] == 4 * sizes[2]


def test_bytes_at_gpt2_size():
    """The module's formula, worked out by hand for GPT-2 small (hs 64, group 32, max_len 1024, fp32 tails): the
    quantised K holds 992 tokens, the K tail 32, V 1024 quantised; per layer and head at 8/8 bits:
    K 992*64 + 31*64*4 + 32*64*4 = 79,616 B, V 1024*64 + 1024*2*4 = 73,728 B."""
    fp32 = kv_bytes(12, 12, 64, 1024)
    c8 = make_cache("quant", 12, 12, 64, 1024, k_bits=8, v_bits=8)
    assert c8.nbytes == 144 * (79_616 + 73_728)
    c4 = make_cache("quant", 12, 12, 64, 1024, k_bits=4, v_bits=4)
    assert c4.nbytes == 144 * ((992 * 32 + 31 * 64 * 4 + 32 * 64 * 4) + (1024 * 32 + 1024 * 2 * 4))
    assert c8.nbytes <= 0.30 * fp32 and c4.nbytes <= 0.17 * fp32  # the targets, scales included
    assert type(c8).bytes_per_token(12, 12, 64, torch.float32, c8.opts) == 144 * (64 + 8 + 64 + 8)
    assert type(c4).bytes_per_token(12, 12, 64, torch.float32, c4.opts) == 144 * (32 + 8 + 32 + 8)


def test_bytes_of_each_axis_at_gpt2_size():
    """K per token and V per channel (the axes swapped), 4/4 bits, groups of 16, fp16 tails, worked out by hand:
    K quantises all 1024 tokens with 4 scale groups each, V 1008 (floor(1023 / 16) * 16) with a scale per channel per
    16 tokens and a 16-token tail. Per layer and head: K 1024*32 + 1024*4*4, V 1008*32 + 63*64*4 + 16*64*2."""
    c = make_cache("quant", 12, 12, 64, 1024, dtype=torch.float16, k_bits=4, v_bits=4, group_size=16,
                   k_axis="token", v_axis="channel")
    assert c.nbytes == c.formula_nbytes() == 144 * ((1024 * 32 + 1024 * 4 * 4) + (1008 * 32 + 63 * 64 * 4
                                                                                   + 16 * 64 * 2))
    assert type(c).bytes_per_token(12, 12, 64, torch.float16, c.opts) == 144 * ((32 + 16) + (32 + 16))
    rotated = make_cache("quant", 12, 12, 64, 1024, dtype=torch.float16, k_bits=4, v_bits=4, group_size=16,
                         k_axis="token", v_axis="channel", rotate="hadamard")
    assert rotated.nbytes == c.nbytes  # the rotation is a constant of the head size, not cache storage


def test_quantize_leaves_the_other_tensor_in_the_storage_dtype():
    """K alone (llama.cpp's -ctk with an f16 V): V comes back exactly as written and costs its dtype's bytes in every
    slot; K is quantised as before. Per layer and head, GPT-2 small at 8 bits, K per token: K 1024 * (64 + 8),
    V 1024 * 64 * 4 (fp32)."""
    k, v = outlier_kv(T=40, hs=16)
    for which in ("k", "v"):
        cache = make_cache("quant", 1, 2, 16, 48, k_bits=4, v_bits=4, group_size=8, quantize=which)
        kr, vr = cache.update(0, k, v)
        kept, lossy = ((v, vr), (k, kr)) if which == "k" else ((k, kr), (v, vr))
        assert torch.equal(kept[1], kept[0]) and not torch.equal(lossy[1], lossy[0])
    c = make_cache("quant", 12, 12, 64, 1024, k_bits=8, group_size=32, k_axis="token", quantize="k")
    assert c.nbytes == c.formula_nbytes() == 144 * (1024 * (64 + 8) + 1024 * 64 * 4)
    assert type(c).bytes_per_token(12, 12, 64, torch.float32, c.opts) == 144 * ((64 + 8) + 64 * 4)
    assert type(c).label(c.opts) == "quant k8 g32 K/token (V full)"


def test_lower_bits_drift_further(tiny_model):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 50257, (1, 24), generator=g) for _ in range(3)]
    drift = {}
    for bits in BITS:
        worst = 0.0
        for p in prompts:
            out = greedy(tiny_model, p, 30, "quant", k_bits=bits, v_bits=bits)
            with torch.no_grad():
                ref = tiny_model(torch.cat([p, out.tokens], 1))[0, p.shape[1] - 1:-1]  # full precision
            worst = max(worst, (out.logits[0] - ref).abs().max().item())
        drift[bits] = worst
    assert 0 < drift[8] < drift[4] < drift[2]


def test_bad_options_say_what_would_be_right():
    with pytest.raises(ValueError, match="k_bits=3: use 8, 4 or 2"):
        make_cache("quant", 2, 2, 8, 16, k_bits=3)
    with pytest.raises(ValueError, match="group_size must be an integer >= 1"):
        make_cache("quant", 2, 2, 8, 16, group_size=0)
    with pytest.raises(ValueError, match="residual must be an integer >= 0"):
        make_cache("quant", 2, 2, 8, 16, residual=-1)
    with pytest.raises(ValueError, match="k_axis='row': use channel or token"):
        make_cache("quant", 2, 2, 8, 16, k_axis="row")
    with pytest.raises(ValueError, match="quantize='q': use kv or k or v"):
        make_cache("quant", 2, 2, 8, 16, quantize="q")
    with pytest.raises(ValueError, match="rotate='random': use none or hadamard"):
        make_cache("quant", 2, 2, 8, 16, rotate="random")
    with pytest.raises(ValueError, match="scheme='q8_0': use asymmetric or symmetric"):
        make_cache("quant", 2, 2, 8, 16, scheme="q8_0")


# ---- the symmetric scheme: llama.cpp's q8_0 and q4_0 -----------------------------------------------------------

def llama_cpp_block(block: list[float], bits: int) -> tuple[list[int], np.float16]:
    """One group as ggml-quants.c's quantize_row_q8_0_ref (8 bits) and quantize_row_q4_0_ref (4 bits; 2 bits by its
    rule with 2 in place of 8) compute it, transcribed loop for loop in numpy float32 scalars: (signed codes, the
    fp16 scale stored)."""
    x = [np.float32(v) for v in block]
    N = 2 ** (bits - 1)
    amax, mx = np.float32(0), np.float32(0)
    for v in x:
        if bits == 8:
            amax = max(amax, abs(v))
        elif amax < abs(v):
            amax, mx = abs(v), v
    d = amax / np.float32(127) if bits == 8 else mx / np.float32(-N)
    inv = np.float32(1) / d if d else np.float32(0)
    codes = []
    for v in x:
        x0 = np.float32(v * inv)
        if bits == 8:  # roundf: halves away from zero
            codes.append(int(math.copysign(math.floor(abs(float(x0)) + 0.5), float(x0))))
        else:  # MIN(2N - 1, (int8_t)(x0 + N + 0.5f)) - N
            codes.append(min(2 * N - 1, int(np.float32(x0 + np.float32(N + 0.5)))) - N)
    return codes, np.float16(d)


def symmetric_groups(n_groups=64, G=32, seed=0) -> torch.Tensor:
    """Groups of G values over six decades, with ties of magnitude (a value and its negation first), zeros, a group
    of zeros, and groups whose largest value is negative or positive."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_groups, G, generator=g) * 10.0 ** torch.randint(-3, 3, (n_groups, 1), generator=g).float()
    x[1, :2] = torch.tensor([2.5, -2.5])
    big = float(x[2].abs().max()) * 2
    x[2, 3], x[2, 5] = -big, big  # the first of two tied magnitudes (m) is negative; -m comes after it
    x[3] = 0.0
    x[4, ::3] = 0.0
    return x


@pytest.mark.parametrize("bits", BITS)
def test_symmetric_codes_and_scales_are_llama_cpps(bits):
    x = symmetric_groups()
    q, scale = quantize_symmetric(x, bits, dim=1)
    N = offset(bits)
    for row, codes, s in zip(x.tolist(), q.tolist(), scale[:, 0]):
        want, want_scale = llama_cpp_block(row, bits)
        assert [c - N for c in codes] == want
        assert float(s) == float(want_scale) and int(s.view(torch.int16)) == int(want_scale.view(np.int16))
    assert q.dtype == torch.uint8 and scale.dtype == torch.float16 and scale.shape == (64, 1)
    if bits == 8:
        assert int(q.min()) >= N - 127 and int(q.max()) <= N + 127
    assert bool((q.float() - N == 0)[3].all())  # a group of zeros: every code 0


def own_symmetric_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What quantising a group (along the last dim) may move each value, worked out here in float64 from the values
    alone: the step |d| (d = amax / 127, or m / -N for m the value of largest magnitude), half of it, or at 4 and 2
    bits where x / d >= N - 1/2 (clamped to N - 1) x / d - (N - 1) of it; widened by fp16's rounding of d (2^-11
    relative, or 2^-25 for a subnormal) times the code, and by float32's rounding of x / d (2^-21 of the group's
    range)."""
    x = x.double()
    N = offset(bits)
    if bits == 8:
        d = x.abs().amax(-1, keepdim=True) / 127
    else:
        d = x.gather(-1, x.abs().argmax(-1, keepdim=True)) / -N
    y = torch.where(d != 0, x / d, 0.0)
    c = torch.full_like(y, 0.5) if bits == 8 else torch.clamp(y - (N - 1), min=0.5)
    fp16 = (y.abs() + 1) * (d.abs() * 2 ** -11 + 2 ** -25)
    return (c * d.abs() + fp16 + 2 ** -21 * (N + 2) * d.abs()).float()


@pytest.mark.parametrize("bits", BITS)
def test_symmetric_error_is_within_its_bound_and_the_clamp_costs_a_step(bits):
    """Every dequantised value is within the bound worked out here; the bound is reached (half a step), and at 4
    and 2 bits a value as large as the group's m but of the other sign is clamped to N - 1: a whole step off. The
    kind's own bound (symmetric_bound, from codes and scales alone) holds and is no looser than this one's clamp
    term allows."""
    x = symmetric_groups(seed=bits)
    N = offset(bits)
    q, scale = quantize_symmetric(x, bits, dim=1)
    deq = (q.float() - N) * scale.float()
    err = (deq - x).abs()
    bound = own_symmetric_bound(x, bits)
    assert bool((err <= bound).all())
    step = x.abs().amax(1, keepdim=True) / (127 if bits == 8 else N)  # |d|
    assert bool((err > 0.45 * step).any())  # really quantised, to the step worked out here
    assert bool((deq[3] == 0).all()) and bool((deq[4, ::3] == 0).all())  # zero is exact: no zero point
    stated = symmetric_bound(q, scale.float().expand_as(x), bits)
    assert bool((err <= stated).all())
    assert bool((stated <= 2.01 * step + 2 ** -22).all())  # about a step at most (and the roundings) anywhere
    # the clamp: m = x[2, 3] is q = -N exactly, -m = x[2, 5] is x / d = N, stored as N - 1
    clamped = float((deq[2, 5] - x[2, 5]).abs())
    if bits == 8:
        assert clamped <= 0.5 * float(step[2]) * 1.01  # q8_0 reaches +-127: -m is +127, as m is -127
        assert int(q[2, 3]) == N - 127 and int(q[2, 5]) == N + 127
    else:
        assert int(q[2, 3]) == 0 and int(q[2, 5]) == 2 * N - 1
        assert clamped > 0.99 * float(step[2]) and clamped <= float(stated[2, 5])


@pytest.mark.parametrize("k_axis,v_axis", [("token", "token"), ("channel", "channel"), ("channel", "token")])
def test_symmetric_caches_stay_within_their_bound_on_either_axis(k_axis, v_axis):
    """The symmetric scheme in a cache, grouped along either axis, with a residual and rotated or not: what update
    returns is within the kind's error_bound; zero is stored exactly, and no minimum is kept."""
    T, hs, G = 40, 16, 8
    k, v = outlier_kv(T=T, hs=hs)
    for rotate in ("none", "hadamard"):
        for bits in (8, 4):
            cache = make_cache("quant", 1, 2, hs, 48, k_bits=bits, v_bits=bits, group_size=G, k_axis=k_axis,
                               v_axis=v_axis, residual=2, rotate=rotate, scheme="symmetric")
            assert cache.k_min is None and cache.v_min is None
            kr, vr = cache.update(0, k, v)
            kb, vb = cache.error_bound(0)
            for got, want, b in ((kr, k, kb), (vr, v, vb)):
                err = (got - want).abs()
                assert bool((err <= b).all()) and bool((err > 0).any())
                assert bool((err[:, :, -2:] == 0).all())  # the residual's tokens, in full precision
    zero = make_cache("quant", 1, 2, hs, 48, group_size=G, k_axis=k_axis, v_axis=v_axis, scheme="symmetric")
    kz = k.clone()
    kz[:, :, :, 5] = 0.0
    kr, _ = zero.update(0, kz, v)
    assert bool((kr[:, :, :, 5] == 0).all())


def test_symmetric_bytes_are_llama_cpps_blocks_at_gpt2_size():
    """q8_0 K and q4_0 V, both per token in blocks of 32 (llama.cpp's -ctk q8_0 -ctv q4_0): 34 B per 32 values of K,
    18 B per 32 of V, so per layer and head 1024 tokens x (2 x 34 + 2 x 18) B; K per channel at 8 bits keeps
    992 tokens of 64 B, 31 groups x 64 channels of 2 B scales and a 32-token fp32 tail. The asymmetric scheme's bytes
    are those plus 2 B of minimum per group."""
    sym = make_cache("quant", 12, 12, 64, 1024, k_bits=8, v_bits=4, k_axis="token", scheme="symmetric")
    assert sym.nbytes == sym.formula_nbytes() == 144 * 1024 * (2 * 34 + 2 * 18)
    assert type(sym).bytes_per_token(12, 12, 64, torch.float32, sym.opts) == 144 * (2 * 34 + 2 * 18)
    asym = make_cache("quant", 12, 12, 64, 1024, k_bits=8, v_bits=4, k_axis="token")
    assert asym.nbytes - sym.nbytes == 144 * 1024 * (2 + 2) * 2  # a minimum per group of K and of V
    chan = make_cache("quant", 12, 12, 64, 1024, k_bits=8, v_bits=8, scheme="symmetric")
    assert chan.nbytes == chan.formula_nbytes() == 144 * ((992 * 64 + 31 * 64 * 2 + 32 * 64 * 4)
                                                          + (1024 * 64 + 1024 * 2 * 2))
    assert type(chan).bytes_per_token(12, 12, 64, torch.float32, chan.opts) == 144 * (64 + 4 + 64 + 4)
    assert type(sym).label(sym.opts) == "quant k8/v4 g32 K/token symmetric"
    assert type(asym).label(asym.opts) == "quant k8/v4 g32 K/token"

"""K and V stored as low-bit integers: KIVI's recipe by default, asymmetric or symmetric round-to-nearest, real packed
storage; each of K and V grouped along either axis, optionally rotated first.

- ``k_axis`` / ``v_axis`` say how each of K and V is grouped. ``channel`` (K's default): a scale per channel over
  groups of ``group_size`` tokens (K has outlier channels: a scale per channel keeps one channel's range from
  swamping the others). A group is quantised once a token after it arrives, so the newest 1 .. ``group_size``
  tokens (plus ``residual``) are held in full precision (the storage dtype). ``token`` (V's default): a scale per
  token over groups of ``group_size`` channels, quantised as soon as the token is older than the newest
  ``residual``. KIVI's finding is that K wants ``channel`` and V ``token``; llama.cpp's q8_0/q4_0 caches group both
  per token (blocks of 32 channels).
- ``tail=residual``: a per-channel axis keeps only the newest ``residual`` tokens in full precision, as the token
  axis does, so the axes can be compared with the same tail: the group still filling is read quantised, zero-padded
  to ``group_size`` tokens (KIVI's Table 1 study: "we add zero-padding ... all tokens in KV cache are quantized"),
  afresh from its full-precision values at every read (so its bytes are counted as ``tail=group``'s are;
  ``compile=true`` is refused with it, ``refuses_fused``; a cache built directly and fused takes the update path).
  ``tail=group`` (the default) is KIVI's streaming algorithm: the filling group waits in full precision beside the
  residual.
- ``rotate=hadamard``: before quantising, each token's head vector is multiplied by an orthonormal Hadamard matrix
  (Sylvester's, on blocks of the largest power of two that divides head_dim: all of it for GPT-2's 64), which
  spreads an outlier channel over all channels of its block; dequantised values are rotated back (the matrix is
  symmetric and its own inverse), so attention sees K and V in their own basis. In fp32 the rotation alone changes
  nothing beyond rounding; its cost is one (tokens x hs) @ (hs x hs) product per layer and step, in the step time.
  The matrix is a constant of the head size, shared by every cache (like a weight), not cache storage.
- ``quantize=k`` or ``v`` quantises that tensor alone and keeps the other in the storage dtype, every slot (the
  llama.cpp comparison of a quantised K cache against a quantised V cache); ``kv`` (the default) quantises both.
- ``scheme`` says what a group stores. ``asymmetric`` (the default; llama.cpp's q4_1 is of this family): a scale and
  a minimum (the zero point), each fp16. The minimum is rounded down and the scale up to fp16, so every value of the
  group lies in [min, min + (2^bits - 1) * scale] and round-to-nearest puts every dequantised value within half a
  step (scale / 2) of what was written. ``symmetric`` (llama.cpp's q8_0 at 8 bits, q4_0 at 4, and q4_0's rule at 2):
  a scale only, fp16, the values signed around zero; ``quantize_symmetric`` states the rule and its bound (half a
  step, plus fp16's rounding of the scale; a whole step at 4 and 2 bits where a value is clamped at the top code).
  Either way values are ``k_bits`` / ``v_bits`` (8, 4 or 2) wide, packed two (4-bit) or four (2-bit) to a byte along
  the channels, and a rotated tensor's bound is of the rotated value (rotating back sums the bounds of a block,
  weighted by 1 / sqrt(block)). ``group_size`` is free under both schemes: llama.cpp's blocks are
  ``group_size=32`` on the token axis (``k_axis=token``, ``v_axis=token``); other sizes and the channel axis apply
  the same rule to other groups.
- Attention reads K and V dequantised into the compute dtype: quantised storage, full-precision math. (In an
  fp16/bf16 compute dtype that last rounding adds half an ulp; ``error_bound`` includes it.) That eager path
  dequantises the whole history every step; it is the reference. With ``compile=true`` a decode step instead
  attends over the packed bytes and scales where they lie (``attend_decode``): on the CPU through a C++ kernel
  (``csrc/decode_attention.cpp``, ``kernel_attention``), elsewhere through torch.compile (``stored_attention``),
  float32 math, equal to the eager path within float32 rounding (tests/models/test_compile.py).
  The whole allocation is made up front, like ``prealloc``: the cache holds ``max_len`` token slots.
- Scales and minimums are fp16, so values beyond fp16's range (|x| > 65504; symmetric: a scale beyond it, |x| beyond
  about 65504 * 2^(bits - 1)) cannot be quantised: their group turns non-finite, which a run reports as such.

Bytes, per layer, batch row and head, for each of K and V (hs = head_dim, G = group_size, R = residual, isz =
storage bytes/element, b = its bits, M = the bytes each group keeps besides its values: 4 asymmetric (an fp16 scale
and an fp16 minimum), 2 symmetric (an fp16 scale)):
    channel: Q * ceil(hs * b / 8) + (Q / G) * hs * M + T * hs * isz,   Q = floor((max_len - R - 1) / G) * G,
                                                                      T = min(max_len, R + G)
    token:   Q * ceil(hs * b / 8) + Q * ceil(hs / G) * M + T * hs * isz,   Q = max_len - R,  T = min(R, max_len)
    not quantised (``quantize`` leaves it out): max_len * hs * isz
A cached token costs ceil(hs*b/8) + M*hs/G (channel) or ceil(hs*b/8) + M*ceil(hs/G) (token) bytes per layer and
head for each of K and V: GPT-2 small (hs 64, G 32) at 8/8 bits: 64 + 8 + 64 + 8 = 144 B against fp32's 512, at 4/4
bits 80, at 2/2 bits 48 (either axis: with hs = 2G both give 8 B of scales); symmetric, 64 + 4 + 64 + 4 = 136, 72
and 40. A symmetric group of 32 values is llama.cpp's block: 32 + 2 = 34 B at 8 bits (q8_0), 16 + 2 = 18 B at 4
(q4_0).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from models.attention import sdpa
from models.kv_cache import kernels
from models.kv_cache.base import KVCache, itemsize, register

BITS = (8, 4, 2)
AXES = ("channel", "token")
ROTATIONS = ("none", "hadamard")
QUANTIZED = ("kv", "k", "v")
SCHEMES = ("asymmetric", "symmetric")
TAILS = ("group", "residual")
SCALE_DTYPE = torch.float16  # scales and minimums: 2 bytes each
FORCE_INDUCTOR = False  # True: the fused decode attention goes through torch.compile on the CPU too (tests)


@dataclass(frozen=True)
class QuantOptions:
    k_bits: int = 4
    v_bits: int = 4
    group_size: int = 32
    residual: int = 0  # newest tokens kept in full precision (KIVI uses 32 or 128); 0 measures the quantiser alone
    k_axis: str = "channel"  # K grouped per channel over tokens (KIVI) or per token over channels (llama.cpp)
    v_axis: str = "token"
    rotate: str = "none"  # "hadamard": rotate each head vector before quantising, back after dequantising
    quantize: str = "kv"  # which of K and V are quantised; the other (for "k" or "v") stays in the storage dtype
    scheme: str = "asymmetric"  # a scale and a minimum per group (q4_1's family); "symmetric": a scale only (q8_0)
    tail: str = "group"  # what a per-channel axis keeps in full precision: "group", the newest residual tokens and the
    # group still filling (1 .. group_size tokens); "residual", the newest residual tokens alone (the filling group
    # is read quantised, zero-padded to group_size tokens, as KIVI's Table 1 study), so every axis keeps the same tail
    # a rotary model's keys quantised before the rotation and rotated after dequantising (KVQuant's pre-RoPE keys:
    # the rotation mixes channel pairs, smearing a channel's outliers over its pair before a per-channel scale sees it)
    k_pre_rope: bool = False

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in BITS or isinstance(getattr(self, name), bool):
                raise ValueError(f"cache option {name}={getattr(self, name)!r}: use 8, 4 or 2")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"cache option group_size must be an integer >= 1, got {self.group_size!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"cache option residual must be an integer >= 0, got {self.residual!r}")
        for name, allowed in (("k_axis", AXES), ("v_axis", AXES), ("rotate", ROTATIONS), ("quantize", QUANTIZED),
                              ("scheme", SCHEMES), ("tail", TAILS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"cache option {name}={getattr(self, name)!r}: use {' or '.join(allowed)}")
        if self.k_pre_rope and "k" not in self.quantize:
            raise ValueError(f"cache option k_pre_rope=true quantises keys before the rotary rotation, and "
                             f"quantize={self.quantize} leaves K unquantised (in the storage dtype), so it changes "
                             "nothing: use quantize=kv or k, or k_pre_rope=false")

    def axis(self, which: str) -> str:
        """How K or V is grouped: "channel", "token", or "none" where it is not quantised."""
        if which not in self.quantize:
            return "none"
        return self.k_axis if which == "k" else self.v_axis

    def bits(self, which: str) -> int:
        return self.k_bits if which == "k" else self.v_bits

    @property
    def symmetric(self) -> bool:
        return self.scheme == "symmetric"

    @property
    def group_bytes(self) -> int:
        """Bytes a group keeps besides its values: an fp16 scale and an fp16 minimum (asymmetric), or the scale."""
        return 2 if self.symmetric else 4


def _round_fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (float32) as fp16, rounded toward +inf (``up``) or -inf instead of to nearest."""
    h = x.to(SCALE_DTYPE)
    off = h.float() < x if up else h.float() > x
    return torch.where(off, torch.nextafter(h, torch.full_like(h, math.inf if up else -math.inf)), h)


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest over groups that run along ``dim`` of ``x`` (float32) -> (q uint8 like x,
    scale, minimum: fp16 with ``dim`` kept as size 1). dequantize(q, scale, minimum) is within scale / 2 of x."""
    levels = 2 ** bits - 1
    lo = _round_fp16(x.amin(dim, keepdim=True), up=False)
    scale = _round_fp16((x.amax(dim, keepdim=True) - lo.float()) / levels, up=True)
    s = scale.float()
    q = torch.where(s > 0, (x - lo.float()) / s, 0.0).round_().clamp_(0, levels).to(torch.uint8)
    return q, scale, lo


def offset(bits: int) -> int:
    """N = 2^(bits - 1): a symmetric code q in [-N, N - 1] is stored as q + N (unsigned), so its value is
    (stored - N) * scale, a minimum of -N * scale that is never stored."""
    return 2 ** (bits - 1)


def _round_half_away(y: torch.Tensor) -> torch.Tensor:
    """C's roundf: to the nearest integer, halves away from zero, exactly (floor(|y| + 0.5) would round the sum)."""
    a = y.abs()
    f = a.floor()
    return torch.copysign(f + (a - f >= 0.5).float(), y)


def quantize_symmetric(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's symmetric round-to-nearest (its q8_0 and q4_0 blocks, ``quantize_row_q8_0_ref`` and
    ``quantize_row_q4_0_ref`` in ggml-quants.c) over groups that run along ``dim`` of ``x`` (float32) -> (stored
    codes, uint8 like x; scale, fp16 with ``dim`` kept as size 1). A scale only, no minimum: with N = 2^(bits - 1), a
    code q is stored as q + N and its value is q * scale.

    - 8 bits (q8_0): d = amax / 127 (amax = max |x|), q = round(x * (1/d)), halves away from zero (C's roundf), so q
      lies in [-127, 127].
    - 4 bits (q4_0) and 2 bits (q4_0's rule with N = 2): m = the value of largest |x| (the first such, as llama.cpp
      keeps it), d = m / -N, q = min(2N - 1, trunc(x * (1/d) + N + 1/2)) - N: rounded half up, in [-N, N - 1]. m
      itself is q = -N exactly; a value of the other sign with x * (1/d) >= N - 1/2 (at most N: as large as m) is
      clamped to N - 1.

    Computed as llama.cpp computes them, in float32: d from the group, its reciprocal (0 where d is 0), x times it
    (rounded on its own, never fused with the addition after it), and the stored scale is d rounded to the nearest
    fp16, so codes and scales are llama.cpp's own, value for value (tested against a transcription of its loops). A
    group holding a NaN gets a NaN scale and codes q = 0; an infinite value or a scale beyond fp16's range makes its
    group non-finite too. (kvlab packs adjacent channels into a byte; llama.cpp's q4_0 puts channels j and j + 16
    into one byte's two nibbles: the same bytes, in another order.)

    Error bound, per value, against the stored scale s (what ``QuantKVCache.error_bound`` uses, from the codes and
    scales alone): |x - q * s| <= c * |s| + (|q| + c) * delta + rho, where
      c = 1/2, except c = 1 at the top code q = N - 1 at 4 and 2 bits (the clamp: x * (1/d) may reach N there);
      delta = 2^-11 * |s| + 2^-25 bounds |d - s|, fp16's rounding to nearest (2^-25: its subnormals' half step);
      rho = 2^-22 * (|q| + N + 2) * (|s| + delta) covers float32's rounding of 1/d, x * (1/d) and the + N + 1/2.
    At 8 bits no value is clamped (|x * (1/d)| <= 127 up to rounding), so c = 1/2 throughout."""
    N = offset(bits)
    ax = x.abs()
    if bits == 8:  # q8_0
        d = ax.amax(dim, keepdim=True) / 127
    else:  # q4_0's rule: the signed value of largest magnitude (the first, if tied), +0 for a group of zeros
        amax, first = ax.max(dim, keepdim=True)
        m = torch.where(amax > 0, x.gather(dim, first), 0.0)
        d = m / -N
    inv = torch.where(d != 0, 1.0 / d, 0.0)
    y = x * inv
    y = torch.where(y.isnan(), 0.0, y)  # inf * 0 (an infinite group) or 0 * inf (1/d past float32): q = 0
    if bits == 8:
        q = _round_half_away(y).clamp_(-127, 127) + N
    else:
        q = (y + (N + 0.5)).trunc_().clamp_(0, 2 * N - 1)
    nan = x.isnan().any(dim, keepdim=True)
    scale = torch.where(nan, math.nan, d).to(SCALE_DTYPE)
    return torch.where(nan, float(N), q).to(torch.uint8), scale


def symmetric_bound(q: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The bound ``quantize_symmetric`` states, per value, from the stored codes ``q`` (q + N, uint8) and their
    scales (float32, broadcast to q's shape): how far the value written may be from (q - N) * scale."""
    N = offset(bits)
    code = q.float() - N
    s = scale.abs()
    c = torch.full_like(code, 0.5) if bits == 8 else torch.where(code == N - 1, 1.0, 0.5)
    delta = s * 2.0 ** -11 + 2.0 ** -25
    return c * s + (code.abs() + c) * delta + 2.0 ** -22 * (code.abs() + N + 2) * (s + delta)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values of ``bits`` bits (..., n) -> (..., ceil(n * bits / 8)) bytes, 8 // bits values to a byte."""
    per = 8 // bits
    if per == 1:
        return q
    pad = -q.shape[-1] % per
    if pad:
        q = torch.cat([q, q.new_zeros(*q.shape[:-1], pad)], dim=-1)
    q = q.view(*q.shape[:-1], -1, per)  # (..., bytes, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of ``pack``: (..., bytes) -> (..., n) uint8 values."""
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # (per,)
    q = (packed.unsqueeze(-1) >> shifts) & (2 ** bits - 1)  # (..., bytes, per)
    return q.flatten(-2)[..., :n]


def hadamard_block(n: int) -> int:
    """The block the rotation of ``n`` channels works in: the largest power of two that divides n."""
    return n & -n


@functools.lru_cache(maxsize=None)
def hadamard(n: int, device: str = "cpu") -> torch.Tensor:
    """An orthonormal, symmetric (n, n) float32 rotation, its own inverse: Sylvester's Hadamard matrix / sqrt(b) on
    each diagonal block of b = ``hadamard_block(n)`` channels."""
    h = torch.ones(1, 1)
    while h.shape[0] < hadamard_block(n):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / math.sqrt(h.shape[0])] * (n // h.shape[0])).to(device)


def _capacity(max_len: int, axis: str, G: int, R: int) -> tuple[int, int]:
    """Slots (quantised, full-precision) one of K and V needs in a cache of ``max_len``, grouped along ``axis``
    ("none": not quantised, every slot in full precision)."""
    if axis == "none":
        return 0, max_len
    if axis == "channel":
        return (max(0, max_len - R - 1) // G) * G, max_len if max_len <= R + G else R + G
    return max(0, max_len - R), min(R, max_len)


def _split(n: int, axis: str, G: int, R: int) -> int:
    """After n tokens: how many of one of K and V are quantised (the rest is in its full-precision tail)."""
    if axis == "none":
        return 0
    return (max(0, n - R - 1) // G) * G if axis == "channel" else max(0, n - R)


def _scale_slots(q: int, axis: str, hs: int, G: int) -> tuple[int, int]:
    """The (slots, per slot) shape of the scales (and minimums) of ``q`` quantised tokens."""
    return (q // G, hs) if axis == "channel" else (q, math.ceil(hs / G))


def minimum(scale: torch.Tensor, lo: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Each group's minimum as float32: the stored one (asymmetric), or -N * scale (symmetric, ``lo`` None: codes are
    stored as q + N, so (stored - N) * scale = stored * scale - N * scale, exactly in float32)."""
    return lo.float() if lo is not None else scale.float() * -offset(bits)


def dequantize_slots(packed: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None, bits: int, axis: str, G: int,
                     hs: int) -> torch.Tensor:
    """(B, nh, S, hs) float32: every one of the S stored slots dequantised (still rotated), written as one pointwise
    expression of the packed bytes and their scales (and minimums; ``lo`` None: the symmetric scheme's, from the
    scales), so that a compiled reduction over it reads the bytes where they lie instead of a dequantised copy."""
    B, nh, S = packed.shape[:3]
    x, per = packed.to(torch.int32), 8 // bits  # int32 shifts: inductor vectorises them (uint8 ones it does not)
    q = torch.stack([(x >> (bits * i)) & (2 ** bits - 1) for i in range(per)], -1).flatten(-2)
    q = (q if q.shape[-1] == hs else q[..., :hs]).float()
    lo = minimum(scale, lo, bits)
    if axis == "channel":  # a scale per channel per group of G tokens
        return (q.view(B, nh, S // G, G, hs) * scale.float().unsqueeze(3) + lo.unsqueeze(3)).view(B, nh, S, hs)
    if hs % G == 0:  # a scale per token per group of G channels
        ng = hs // G
        return (q.view(B, nh, S, ng, G) * scale.float().unsqueeze(4) + lo.unsqueeze(4)).view(B, nh, S, hs)
    idx = torch.arange(hs, device=packed.device) // G  # a last, partial group of channels
    return q * scale.float()[..., idx] + lo[..., idx]


def stored_attention(q: torch.Tensor, k: tuple, v: tuple, n_k: torch.Tensor, n_v: torch.Tensor, n: torch.Tensor,
                     rot: torch.Tensor | None, layout: tuple) -> torch.Tensor:
    """One decode step's attention over a quant cache's own storage, static shapes (every slot is read, those not
    holding a token are masked), for ``torch.compile``: q (B, nh, 1, hs); ``k`` and ``v``: (packed, scale, min,
    tail) of one layer (packed None: not quantised; min None: the symmetric scheme, whose minimum is -N * scale);
    n_k, n_v: how many of K's and V's tokens are quantised, n: the tokens held (0-d tensors: no recompile as they
    grow); ``layout``: ((bits, axis) of K, of V, G, hs). Token j is in the quantised slots if j < n_k (n_v), else in
    tail slot j - n_k; the scores are made in token order, so K and V may split the history differently. Returns
    (B, nh, 1, hs) float32."""
    (kb, ka), (vb, va), G, hs = layout
    kq, ks, kl, kt = k
    vq, vs, vl, vt = v
    qf = q.float() * (1.0 / math.sqrt(hs))
    L = kt.shape[2] + (kq.shape[2] if kq is not None else 0)  # the cache's token slots
    j = torch.arange(L, device=q.device)
    if kt.shape[2]:  # every token's score as if it were in the tail (token j in tail slot j - n_k)
        scores = (qf * kt.float()).sum(-1)[..., (j - n_k).clamp(0, kt.shape[2] - 1)]  # (B, nh, L)
    else:  # no tail (token axis, no residual): every token is quantised as it arrives
        scores = qf.new_zeros(*qf.shape[:2], L)
    if kq is not None:
        qr = qf if rot is None else qf @ rot  # K was rotated before quantising: rotate the query instead
        sq = (qr * dequantize_slots(kq, ks, kl, kb, ka, G, hs)).sum(-1)  # (B, nh, Q_k)
        sq = torch.cat([sq, sq.new_zeros(*sq.shape[:2], L - sq.shape[2])], -1)
        scores = torch.where(j < n_k, sq, scores)
    p = scores.masked_fill(j >= n, float("-inf")).softmax(-1)  # (B, nh, L)
    out = qf.new_zeros(*qf.shape[:2], hs)  # (B, nh, hs)
    if vt.shape[2]:
        t_v = j[: vt.shape[2]] + n_v  # tail slot i holds token n_v + i
        pt = p[..., t_v.clamp(max=L - 1)].masked_fill(t_v >= n, 0.0)
        out = (pt.unsqueeze(-1) * vt.float()).sum(-2)
    if vq is not None:
        pq = p[..., : vq.shape[2]].masked_fill(j[: vq.shape[2]] >= n_v, 0.0)
        oq = (pq.unsqueeze(-1) * dequantize_slots(vq, vs, vl, vb, va, G, hs)).sum(-2)
        out = out + (oq if rot is None else oq @ rot)  # V rotated back once, after the sum
    return out.unsqueeze(2)


_NO_PACKED = (torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=SCALE_DTYPE), torch.empty(0, dtype=SCALE_DTYPE))
_NO_ROTATION = torch.empty(0)


def kernel_attention(kernel, cache: "QuantKVCache", layer: int, q: torch.Tensor, n_k: int, n_v: int,
                     n: int) -> torch.Tensor:
    """stored_attention on the CPU through ``kernel`` (models/kv_cache/csrc/decode_attention.cpp, ``attention``):
    per sequence and head, the q . K^T and p . V reductions over layer ``layer``'s quantised tokens read the packed
    bytes and fp16 scales row by row where the cache holds them, the tails' tokens are read as they are, and the
    softmax runs between them, all in one call with no torch op around it; only the tokens held are read (n_k, n_v,
    n: Python ints). Returns (B, nh, 1, hs) in q's dtype."""
    o = cache.opts

    def side(which, n_q):  # a side with nothing packed: empty stand-ins the kernel does not read
        packed, tail = getattr(cache, f"{which}_q"), getattr(cache, f"{which}_tail")
        if o.axis(which) == "none" or not packed.shape[3] or not n_q:
            return (*_NO_PACKED, 0, tail)
        lo = getattr(cache, f"{which}_min")  # None (symmetric): an empty minimum, which the kernel takes as -N * scale
        return packed, getattr(cache, f"{which}_scale"), _NO_PACKED[2] if lo is None else lo, n_q, tail

    rot = cache._rotation()
    return kernel.attention(layer, q, _NO_ROTATION if rot is None else rot, *side("k", n_k), o.bits("k"),
                            o.axis("k") == "channel", *side("v", n_v), o.bits("v"), o.axis("v") == "channel", n,
                            o.group_size, 1.0 / math.sqrt(cache.head_dim))


@functools.lru_cache(maxsize=None)
def compiled_stored_attention():
    """stored_attention through torch.compile (inductor fuses each unpack-dequantise-multiply into its reduction);
    one compiled function for every layer and cache, static shapes. Each layout, dtype and geometry is a graph of
    its own, all of one function: a process that runs many (a test of every option set, a sweep in one process)
    needs more than dynamo's default of 8 per function, so the limit is raised to 64."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(stored_attention, fullgraph=True, dynamic=False)


@register
class QuantKVCache(KVCache):
    kind = "quant"
    why_no_padding = ("its K groups span tokens, so padding slots would change how real tokens are quantised; run "
                      "ragged batches on an exact kind")
    Options = QuantOptions
    exact = False
    fuses_decode = True
    sized_by = ("residual",)
    description = ("K and V as 8/4/2-bit integers with fp16 scales (and minimums: asymmetric; symmetric: a scale "
                   "only, llama.cpp's q8_0/q4_0), each grouped per channel or per token (KIVI: K per channel, V per "
                   "token), optionally Hadamard-rotated first")
    examples = ({"k_bits": 8, "v_bits": 8, "group_size": 8},
                {"k_bits": 4, "v_bits": 2, "group_size": 8, "residual": 4},
                {"k_bits": 2, "v_bits": 4, "group_size": 8, "k_axis": "token", "v_axis": "channel"},
                {"k_bits": 4, "v_bits": 8, "group_size": 8, "residual": 3, "v_axis": "channel",
                 "rotate": "hadamard"},
                {"k_bits": 2, "group_size": 8, "k_axis": "token", "quantize": "k"},
                # the symmetric scheme (a scale only): llama.cpp's q8_0 K and q4_0 V, both per token; the channel
                # axes, 2 bits, a residual and the rotation; V alone
                {"k_bits": 8, "v_bits": 4, "group_size": 8, "k_axis": "token", "scheme": "symmetric"},
                {"k_bits": 2, "v_bits": 8, "group_size": 8, "residual": 3, "v_axis": "channel", "rotate": "hadamard",
                 "scheme": "symmetric"},
                {"v_bits": 2, "group_size": 4, "quantize": "v", "scheme": "symmetric"},
                # tail=residual: the filling per-channel group read quantised (zero-padded), with a residual and
                # the rotation, and with none (every token quantised), symmetric
                {"k_bits": 2, "v_bits": 4, "group_size": 8, "residual": 3, "v_axis": "channel", "rotate": "hadamard",
                 "tail": "residual"},
                {"k_bits": 4, "v_bits": 2, "group_size": 8, "tail": "residual", "scheme": "symmetric"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        o, hs = self.opts, self.head_dim
        lead = (self.n_layer, self.batch, self.n_kv_head)

        def zeros(*shape, dtype=torch.uint8):
            return torch.zeros(*lead, *shape, dtype=dtype, device=self.device)

        for which in ("k", "v"):  # each (L, B, nh, slots, ...)
            q, tail = _capacity(self.max_len, o.axis(which), o.group_size, o.residual)
            setattr(self, f"{which}_q", zeros(q, math.ceil(hs * o.bits(which) / 8)))  # packed along channels
            setattr(self, f"{which}_scale", zeros(*_scale_slots(q, o.axis(which), hs, o.group_size),
                                                   dtype=SCALE_DTYPE))
            setattr(self, f"{which}_min", None if o.symmetric else  # symmetric: no minimum is stored
                    zeros(*_scale_slots(q, o.axis(which), hs, o.group_size), dtype=SCALE_DTYPE))
            setattr(self, f"{which}_tail", zeros(tail, hs, dtype=self.dtype))  # not yet quantised
        self._returned = (0, torch.float32)  # tokens in the history the last update returned, and its dtype

    # ---- what the kind declares -----------------------------------------------------------------------------

    @classmethod
    def _capacity(cls, max_len: int, opts: QuantOptions) -> tuple[int, int, int, int]:
        """Slots (quantised K, full-precision K, quantised V, full-precision V) a cache of ``max_len`` needs."""
        k = _capacity(max_len, opts.axis("k"), opts.group_size, opts.residual)
        return (*k, *_capacity(max_len, opts.axis("v"), opts.group_size, opts.residual))

    def _split(self, n: int) -> tuple[int, int]:
        """After n tokens: how many of K and of V are quantised (the rest is in the full-precision tails)."""
        o = self.opts
        return tuple(_split(n, o.axis(w), o.group_size, o.residual) for w in ("k", "v"))

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        return max_len

    @classmethod
    def check_max_len(cls, opts, max_len: int) -> None:
        """Something must be quantised at ``max_len``: per token, the tokens older than the newest ``residual``;
        per channel, a whole group of ``group_size`` tokens beyond them (and the newest token)."""
        G, R = opts.group_size, opts.residual
        if R >= max_len:
            raise ValueError(f"cache option residual={R} keeps every one of max_len={max_len} tokens in full "
                             f"precision, so nothing is ever quantised: use residual < {max_len}")
        for which, name in (("k", "K"), ("v", "V")):
            if opts.axis(which) == "channel" and _capacity(max_len, "channel", G, R)[0] == 0:
                raise ValueError(f"{name} is grouped per channel over group_size={G} tokens beyond the newest "
                                 f"residual={R}: at max_len={max_len} no group ever fills (that needs residual + "
                                 f"group_size < max_len), so {name} is never quantised; lower cache.residual or "
                                 f"cache.group_size, or raise max_len")

    @classmethod
    def check_head_dim(cls, opts, head_dim: int) -> None:
        """A rotation needs blocks of 2 channels or more; per-token groups span at most the head's channels (so a
        larger group_size, which the label and record would name, is refused, not run as the head size)."""
        if opts.rotate == "hadamard" and hadamard_block(head_dim) == 1:
            raise ValueError(f"cache option rotate=hadamard rotates blocks of the largest power of two that divides "
                             f"the head size, and {head_dim} is odd: blocks of 1 channel, nothing rotated; use "
                             "rotate=none")
        axes = {opts.axis(w) for w in ("k", "v")} - {"none"}
        G = opts.group_size
        if axes == {"token"} and G > head_dim:
            raise ValueError(f"cache option group_size={G} is more than the head size {head_dim}: a "
                             f"per-token group spans at most the head's {head_dim} channels, so it runs as "
                             f"group_size={head_dim} would; use group_size <= {head_dim}")
        if axes == {"token", "channel"} and G > head_dim:  # one label, g{G}, for groups of two sizes
            tok, chan = ("K", "V") if opts.axis("k") == "token" else ("V", "K")
            raise ValueError(f"cache option group_size={G} is more than the head size {head_dim}: {tok}, grouped per "
                             f"token, spans at most the head's {head_dim} channels, so it would run in groups of "
                             f"{head_dim} while {chan}'s per-channel groups span {G} tokens; use group_size <= "
                             f"{head_dim}, or cache.{tok.lower()}_axis=channel")

    @classmethod
    def nbytes_formula(cls, n_layer, n_kv_head, head_dim, max_len, batch, dtype, n_tokens, opts) -> int:
        hs, G, isz, M = head_dim, opts.group_size, itemsize(dtype), opts.group_bytes
        total = 0
        for which in ("k", "v"):
            q, tail = _capacity(max_len, opts.axis(which), G, opts.residual)
            slots, per = _scale_slots(q, opts.axis(which), hs, G)
            total += q * math.ceil(hs * opts.bits(which) / 8) + slots * per * M + tail * hs * isz
        return n_layer * batch * n_kv_head * total

    @classmethod
    def bytes_per_token(cls, n_layer, n_kv_head, head_dim, dtype, opts) -> float:
        hs, G, M = head_dim, opts.group_size, opts.group_bytes
        cost = {"channel": lambda bits: math.ceil(hs * bits / 8) + M * hs / G,
                "token": lambda bits: math.ceil(hs * bits / 8) + M * math.ceil(hs / G),
                "none": lambda bits: hs * itemsize(dtype)}
        return n_layer * n_kv_head * sum(cost[opts.axis(w)](opts.bits(w)) for w in ("k", "v"))

    @classmethod
    def label(cls, opts) -> str:
        axes = ("" if opts.axis("k") in ("channel", "none") else " K/token") + ("" if opts.axis("v") in ("token", "none")
                                                                               else " V/channel")
        bits = {"kv": f"k{opts.k_bits}/v{opts.v_bits}", "k": f"k{opts.k_bits}", "v": f"v{opts.v_bits}"}[opts.quantize]
        alone = {"kv": "", "k": " (V full)", "v": " (K full)"}[opts.quantize]
        return (f"quant {bits} g{opts.group_size}" + (f" r{opts.residual}" if opts.residual else "") + axes
                + (" hadamard" if opts.rotate == "hadamard" else "") + (" symmetric" if opts.symmetric else "")
                + (" tail=residual" if opts.tail == "residual" else "") + (" pre-RoPE K" if opts.k_pre_rope else "")
                + alone)

    @classmethod
    def needs_rotary(cls, opts) -> str | None:
        if opts.k_pre_rope:
            return ("k_pre_rope=true quantises keys before the rotary rotation, which needs rotary positions (GPT-2 "
                    "has none: its keys are the same with k_pre_rope=false)")
        return None

    @property
    def prerope(self) -> bool:
        return self.opts.k_pre_rope

    # ---- the contract ---------------------------------------------------------------------------------------

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._check_room(layer, k_new, v_new)
        n0, n1 = self.pos, self.pos + t
        q1 = {w: self._store(layer, w, new, n0, n1) for w, new in (("k", k_new), ("v", v_new))}
        self._returned = (n1, k_new.dtype)
        return self._history(layer, q1["k"], n1, "k", k_new.dtype), self._history(layer, q1["v"], n1, "v",
                                                                                   v_new.dtype)

    def attend_decode(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's K and V as ``update`` does, then attend over the packed bytes, scales and tails
        themselves, with no dequantised copy of the history: the C++ kernel on the CPU (``kernel_attention``),
        ``stored_attention`` through torch.compile elsewhere."""
        if self._reads_partial_groups:  # the stored bytes are not what attention reads: update's history is
            k, v = self.update(layer, k_new, v_new)
            return sdpa(q, k, v)
        kernel = self._kernel()
        if kernel is None and q.size(1) != self.n_kv_head:  # before anything is written
            raise ValueError(f"cache=quant's decode attention over its storage reads one K/V head per query head off "
                             f"the CPU kernel, and this model shares each of its {self.n_kv_head} K/V heads among "
                             f"{q.size(1) // self.n_kv_head} query heads: use compile=false")
        t = self._check_room(layer, k_new, v_new)
        n0, n1 = self.pos, self.pos + t
        n_k, n_v = (self._store(layer, w, new, n0, n1) for w, new in (("k", k_new), ("v", v_new)))
        self._returned = (n1, k_new.dtype)
        o = self.opts

        def parts(which):  # (packed, scale, min, tail) of this layer; None where not stored (min: symmetric)
            packed = getattr(self, f"{which}_q")[layer]
            quantised = o.axis(which) != "none" and packed.shape[2] > 0
            stored = (getattr(self, f"{which}_{part}") for part in ("q", "scale", "min"))
            return (*(t[layer] if quantised and t is not None else None for t in stored),
                    getattr(self, f"{which}_tail")[layer])

        if kernel is not None:  # a query head reads its group's K/V head there (grouped-query attention)
            return kernel_attention(kernel, self, layer, q, n_k, n_v, n1)
        layout = ((o.bits("k"), o.axis("k")), (o.bits("v"), o.axis("v")), o.group_size, self.head_dim)
        counts = torch.tensor([n_k, n_v, n1], device=self.device)
        y = compiled_stored_attention()(q, parts("k"), parts("v"), counts[0], counts[1], counts[2],
                                        self._rotation(), layout)
        return y.to(q.dtype)

    def _kernel(self):
        """The C++ kernel module where this cache's fused attention runs in it (the CPU), else None (inductor)."""
        cpu = self.device.type == "cpu" and not FORCE_INDUCTOR and self.head_dim <= kernels.MAX_HEAD_DIM
        return kernels.load() if cpu else None

    @property
    def attends_opaquely(self) -> bool:
        return self._kernel() is not None  # inductor's path is a compiled graph of its own

    def stored_history(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, dtype = self._returned
        n_k, n_v = self._split(n)
        return self._history(layer, n_k, n, "k", dtype), self._history(layer, n_v, n, "v", dtype)

    def _rotation(self) -> torch.Tensor | None:
        return hadamard(self.head_dim, str(self.device)) if self.opts.rotate == "hadamard" else None

    def _store(self, layer: int, which: str, new: torch.Tensor, n0: int, n1: int) -> int:
        """Write ``new`` (B, nh, t, hs) of K or V after n0 tokens: the tail + the new tokens, of which those the
        axis's rule now quantises are rotated (if asked), quantised and packed; the rest stays the tail. Returns
        how many tokens are quantised after n1."""
        o, hs, G = self.opts, self.head_dim, self.opts.group_size
        axis, bits = o.axis(which), o.bits(which)
        B, nh = self.batch, self.n_kv_head
        q0, q1 = _split(n0, axis, G, o.residual), _split(n1, axis, G, o.residual)
        tail = getattr(self, f"{which}_tail")
        m = q1 - q0
        if not m:  # nothing to quantise (most decode steps of a channel-grouped K): the new tokens join the tail
            tail[layer, :, :, n0 - q0:n1 - q1] = new
            return q1
        held = n0 - q0  # the tail's tokens, then the new ones: tokens from q0 on
        pending = torch.cat([tail[layer, :, :, :held], new.to(self.dtype)], dim=2) if held else new.to(self.dtype)
        x = pending[:, :, :m].float()  # (B, nh, m, hs)
        rot = self._rotation()
        if rot is not None:
            x = x @ rot
        lows = getattr(self, f"{which}_min")  # None: the symmetric scheme stores no minimum

        def quantized(groups, dim):  # (codes, scale, minimum or None) of groups along dim
            if o.symmetric:
                return (*quantize_symmetric(groups, bits, dim), None)
            return quantize(groups, bits, dim)

        if axis == "channel":  # a scale per channel per group of G tokens
            q, scale, lo = quantized(x.view(B, nh, m // G, G, hs), dim=3)
            q, s0, s1 = q.view(B, nh, m, hs), q0 // G, q1 // G
        elif self.fused and self.device.type == "cpu" and kernels.load() is not None:
            # the compiled decode step on the CPU: the same values, quantised, packed and written into the slots by
            # the kernel (value for value what quantize or quantize_symmetric, and pack, give: test_compile.py)
            kernels.load().quantize_into(x, layer, getattr(self, f"{which}_q"), getattr(self, f"{which}_scale"),
                                         _NO_PACKED[2] if lows is None else lows, q0, bits, G, o.symmetric)
            q = None
        else:  # a scale per token per group of G channels
            ng = math.ceil(hs / G)
            if ng * G > hs:  # a last, partial group of channels: pad with its own last channel (range unchanged)
                x = torch.cat([x, x[..., -1:].expand(B, nh, m, ng * G - hs)], dim=-1)
            q, scale, lo = quantized(x.view(B, nh, m, ng, G), dim=4)
            q, s0, s1 = q.view(B, nh, m, ng * G)[..., :hs], q0, q1
        if q is not None:
            dim = 3 if axis == "channel" else 4
            getattr(self, f"{which}_q")[layer, :, :, q0:q1] = pack(q, bits)
            getattr(self, f"{which}_scale")[layer, :, :, s0:s1] = scale.squeeze(dim)
            if lows is not None:
                lows[layer, :, :, s0:s1] = lo.squeeze(dim)
        if n1 - q1:
            tail[layer, :, :, :n1 - q1] = pending[:, :, m:]
        return q1

    def _dequantized(self, layer: int, which: str, n_quant: int) -> torch.Tensor:
        """The first ``n_quant`` tokens of K or V as stored, dequantised to float32 and still rotated:
        (B, nh, n_quant, hs)."""
        B, nh, hs, G, bits = self.batch, self.n_kv_head, self.head_dim, self.opts.group_size, self.opts.bits(which)
        packed, scale, lo = (getattr(self, f"{which}_{part}") for part in ("q", "scale", "min"))
        packed, scale = packed[layer], scale[layer]
        slots = n_quant // G if self.opts.axis(which) == "channel" else n_quant
        scale = scale[:, :, :slots]
        lo = minimum(scale, None if lo is None else lo[layer, :, :, :slots], bits)  # symmetric: -N * scale
        q = unpack(packed[:, :, :n_quant], bits, hs).float()  # (B, nh, n_quant, hs)
        if self.opts.axis(which) == "channel":  # a scale per channel per group of G tokens
            shape = (B, nh, n_quant // G, G, hs)
            scale, lo = scale.unsqueeze(3), lo.unsqueeze(3)
        elif hs % G == 0:  # a scale per token per group of G channels
            shape = (B, nh, n_quant, hs // G, G)
            scale, lo = scale.unsqueeze(4), lo.unsqueeze(4)
        else:  # a last, partial group of channels: spell the scales out per channel
            shape = (B, nh, n_quant, hs)
            scale = scale.repeat_interleave(G, dim=-1)[..., :hs]
            lo = lo.repeat_interleave(G, dim=-1)[..., :hs]
        return torch.addcmul(lo, q.view(shape), scale.float()).view(B, nh, n_quant, hs)

    def _history(self, layer: int, n_quant: int, n: int, which: str, dtype: torch.dtype) -> torch.Tensor:
        """K or V of all n tokens, (B, nh, n, hs): the first ``n_quant`` dequantised (and rotated back), the rest
        from the tail (``tail=residual``: its filling per-channel group read quantised), in one float32 tensor, then
        cast to the compute ``dtype``."""
        out = torch.empty(self.batch, self.n_kv_head, n, self.head_dim, dtype=torch.float32, device=self.device)
        if n_quant:
            deq, rot = self._dequantized(layer, which, n_quant), self._rotation()
            out[:, :, :n_quant] = deq if rot is None else deq @ rot
        out[:, :, n_quant:] = getattr(self, f"{which}_tail")[layer, :, :, :n - n_quant]
        p = self._partial(which, n_quant, n)
        if p:
            out[:, :, n_quant:n_quant + p] = self._partial_group(layer, which, p)[0]
        return out.to(dtype)

    @staticmethod
    def _partial_groups(opts) -> bool:
        """``tail=residual`` with a per-channel axis: attention reads the group still filling quantised."""
        return opts.tail == "residual" and "channel" in (opts.axis("k"), opts.axis("v"))

    @classmethod
    def refuses_fused(cls, opts) -> str | None:
        if opts.k_pre_rope:
            return ("compile=true attends over the stored bytes, and cache.k_pre_rope=true stores keys before the "
                    "rotation, which attention must apply to them first: use compile=false")
        if cls._partial_groups(opts):
            return ("compile=true attends over the stored bytes, and cache.tail=residual reads a per-channel group "
                    "still filling quantised, which is not what is stored: use cache.tail=group, or compile=false")
        return None

    @property
    def _reads_partial_groups(self) -> bool:
        """What ``refuses_fused`` refuses a compiled run for: the filling group read quantised."""
        return self._partial_groups(self.opts)

    def _partial(self, which: str, n_quant: int, n: int) -> int:
        """Tokens of the per-channel group still filling that ``tail=residual`` reads quantised (0: none)."""
        if self.opts.tail != "residual" or self.opts.axis(which) != "channel":
            return 0
        return max(0, n - n_quant - self.opts.residual)

    def _partial_group(self, layer: int, which: str, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The oldest ``p`` tail tokens of K or V as a per-channel group of ``group_size`` tokens, zero-padded,
        quantised and dequantised (rotated first and back, if asked): (values, their error bound), each
        (B, nh, p, hs) float32. Quantised afresh from the full-precision tail at every read, as the group fills."""
        o, G, bits = self.opts, self.opts.group_size, self.opts.bits(which)
        x = getattr(self, f"{which}_tail")[layer, :, :, :p].float()
        rot = self._rotation()
        if rot is not None:
            x = x @ rot
        padded = torch.cat([x, x.new_zeros(*x.shape[:2], G - p, x.shape[3])], dim=2)  # (B, nh, G, hs)
        if o.symmetric:
            codes, scale = quantize_symmetric(padded, bits, dim=2)
            lo = minimum(scale, None, bits)
            half = symmetric_bound(codes[:, :, :p], scale.float().expand(-1, -1, p, -1), bits)
        else:
            codes, scale, lo = quantize(padded, bits, dim=2)
            half = (scale.float() / 2).expand(-1, -1, p, -1)
        deq = torch.addcmul(lo.float(), codes[:, :, :p].float(), scale.float())
        if rot is None:
            return deq, half
        return deq @ rot, self._rotated_bound(half, deq.abs())

    def _half_steps(self, layer: int, which: str, n_quant: int) -> torch.Tensor:
        """How far each of the first ``n_quant`` tokens of K or V may be from what was written, in float32:
        (B, nh, n_quant, hs). Half a step per stored value (symmetric: ``symmetric_bound``, from the codes and
        scales); rotated, the back-rotation sums a block's bounds (weighted by |H| = 1 / sqrt(block)), plus the
        float32 rounding of both rotations."""
        hs, G, bits = self.head_dim, self.opts.group_size, self.opts.bits(which)
        scale = getattr(self, f"{which}_scale")[layer].float()
        if self.opts.axis(which) == "channel":
            scale = scale[:, :, :n_quant // G].repeat_interleave(G, dim=2)
        else:
            scale = scale[:, :, :n_quant].repeat_interleave(G, dim=-1)[..., :hs]
        if self.opts.symmetric:
            codes = unpack(getattr(self, f"{which}_q")[layer][:, :, :n_quant], bits, hs)
            half = symmetric_bound(codes, scale, bits)
        else:
            half = scale / 2
        if self._rotation() is None:
            return half
        return self._rotated_bound(half, self._dequantized(layer, which, n_quant).abs())

    def _rotated_bound(self, half: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The bound ``half`` on values quantised in the rotated basis (``y``: |their dequantised values|, still
        rotated), rotated back: the back-rotation sums a block's bounds (weighted by |H| = 1 / sqrt(block)), plus the
        float32 rounding of both rotations."""
        mag = self._rotation().abs()  # |H|: 1 / sqrt(b) within each block, 0 elsewhere
        b = hadamard_block(self.head_dim)
        gamma = (b + 2) * 2.0 ** -24 / (1 - (b + 2) * 2.0 ** -24)  # a length-b float32 dot product's rounding
        x_bound = (y + half) @ mag  # |what was written|, to first order
        rotated_in = gamma * 1.01 * (x_bound @ mag)  # rounding of the rotation before quantising
        return (half + rotated_in) @ mag + gamma * (y @ mag)

    def error_bound(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per element of the history the last update returned: what quantisation may have moved it (0 in the
        full-precision tails), plus half a unit in the last place of the compute dtype it was returned in (the
        float32 dequantised values, and the tails, are rounded into it)."""
        B, nh, hs = self.batch, self.n_kv_head, self.head_dim
        n, dtype = self._returned
        half_ulp = torch.finfo(dtype).eps / 2
        bounds = []
        for which, q in zip(("k", "v"), self._split(n)):
            rounding = self._history(layer, q, n, which, torch.float32).abs() * half_ulp
            p = self._partial(which, q, n)  # tail=residual: the filling group, read quantised
            partial = [self._partial_group(layer, which, p)[1]] if p else []
            zeros = torch.zeros(B, nh, n - q - p, hs, device=self.device)
            bounds.append(torch.cat([self._half_steps(layer, which, q), *partial, zeros], dim=2) + rounding)
        return bounds[0], bounds[1]

    # ---- rewinding and reuse --------------------------------------------------------------------------------

    def can_crop(self, n_tokens: int) -> bool:
        if not 0 <= n_tokens <= self.pos:
            return False
        now, then = self._split(self.pos), self._split(n_tokens)
        # no token may need un-quantising: a channel-grouped tensor may not lose a quantised group, and a
        # token-grouped one may only drop quantised tokens (residual 0), never re-widen them
        return all(q == q_now or (self.opts.axis(w) == "token" and self.opts.residual == 0)
                   for w, q, q_now in zip(("k", "v"), then, now))

    def _why_no_crop(self, n_tokens: int) -> str:
        return (f"cannot crop a quant cache from {self.pos} to {n_tokens} tokens: tokens it would hold in full "
                "precision are already quantised; take snapshot() before and restore() instead")

    def _crop(self, n: int) -> None:
        pass  # the tails keep their prefix; quantised slots past the new split are never read before rewritten

    def checkpoint(self):
        snap = self.snapshot()
        return lambda: self.restore(snap)

    def _reset(self) -> None:
        self._returned = (0, torch.float32)

    def _parts(self, n: int) -> dict[str, tuple[torch.Tensor, int]]:
        """Each storage tensor and how many of its slots (dim 3) hold data after n tokens."""
        parts = {}
        for which, q in zip(("k", "v"), self._split(n)):
            slots = _scale_slots(q, self.opts.axis(which), self.head_dim, self.opts.group_size)[0]
            parts.update({f"{which}_q": (getattr(self, f"{which}_q"), q),
                          f"{which}_scale": (getattr(self, f"{which}_scale"), slots),
                          f"{which}_tail": (getattr(self, f"{which}_tail"), n - q)})
            if getattr(self, f"{which}_min") is not None:  # asymmetric: the minimums too
                parts[f"{which}_min"] = (getattr(self, f"{which}_min"), slots)
        return parts

    def snapshot(self) -> dict:
        return {**self._snapshot_header(),
                **{name: t[:, :, :, :used].clone() for name, (t, used) in self._parts(self.pos).items()}}

    def restore(self, snap: dict) -> None:
        def expect(pos):  # each part's slots in use, its other dimensions and dtype as the cache's own
            return {name: ((*t.shape[:3], used, t.shape[4]), t.dtype) for name, (t, used) in self._parts(pos).items()}

        pos = self._check_snapshot(snap, expect)
        for name, (t, used) in self._parts(pos).items():
            t[:, :, :, :used] = snap[name]
        self.pos, self._returned = pos, (0, torch.float32)

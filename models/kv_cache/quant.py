"""K and V stored as low-bit integers: KIVI's recipe, asymmetric round-to-nearest, real packed storage.

- K is quantised per channel, in groups of ``group_size`` tokens (K has outlier channels: a scale per channel keeps
  one channel's range from swamping the others). A group is quantised once a token after it arrives, so the newest
  1 .. ``group_size`` tokens of K (plus ``residual``) are held in full precision (the storage dtype).
- V is quantised per token, in groups of ``group_size`` channels, as soon as it is older than the newest
  ``residual`` tokens.
- Each group stores a scale and a minimum (the zero point) in fp16; values are ``k_bits`` / ``v_bits`` (8, 4 or 2)
  wide, packed two (4-bit) or four (2-bit) to a byte along the channels. The minimum is rounded down and the scale
  up to fp16, so every value of the group lies in [min, min + (2^bits - 1) * scale] and round-to-nearest puts every
  dequantised value within half a step (scale / 2) of what was written.
- Attention reads K and V dequantised into the compute dtype: quantised storage, full-precision math, no kernels.
  (In an fp16/bf16 compute dtype that last rounding adds half an ulp; ``error_bound`` includes it.)
  The whole allocation is made up front, like ``prealloc``: the cache holds ``max_len`` token slots.
- Scales and minimums are fp16, so values beyond fp16's range (|x| > 65504) cannot be quantised: their group turns
  non-finite, which a run reports as such.

Bytes, per layer, batch row and head (hs = head_dim, G = group_size, R = residual, isz = storage bytes/element):
    K: Qk * ceil(hs * k_bits / 8) + (Qk / G) * hs * 4 + Tk * hs * isz,   Qk = floor((max_len - R - 1) / G) * G,
                                                                         Tk = min(max_len, R + G)
    V: Qv * ceil(hs * v_bits / 8) + Qv * ceil(hs / G) * 4 + Tv * hs * isz,   Qv = max_len - R,  Tv = min(R, max_len)
A cached token costs ceil(hs*k_bits/8) + 4*hs/G + ceil(hs*v_bits/8) + 4*ceil(hs/G) bytes per layer and head: GPT-2
small (hs 64, G 32) at 8/8 bits: 64 + 8 + 64 + 8 = 144 B against fp32's 512, at 4/4 bits 80, at 2/2 bits 48.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from models.kv_cache.base import KVCache, itemsize, register

BITS = (8, 4, 2)
SCALE_DTYPE = torch.float16  # scales and minimums: 2 bytes each


@dataclass(frozen=True)
class QuantOptions:
    k_bits: int = 4
    v_bits: int = 4
    group_size: int = 32
    residual: int = 0  # newest tokens kept in full precision (KIVI uses 32 or 128); 0 measures the quantiser alone

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in BITS or isinstance(getattr(self, name), bool):
                raise ValueError(f"cache option {name}={getattr(self, name)!r}: use 8, 4 or 2")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"cache option group_size must be an integer >= 1, got {self.group_size!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"cache option residual must be an integer >= 0, got {self.residual!r}")


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


@register
class QuantKVCache(KVCache):
    kind = "quant"
    why_no_padding = ("its K groups span tokens, so padding slots would change how real tokens are quantised; run "
                      "ragged batches on an exact kind")
    Options = QuantOptions
    exact = False
    description = "K per channel, V per token, as 8/4/2-bit integers with fp16 scales (KIVI)"
    examples = ({"k_bits": 8, "v_bits": 8, "group_size": 8},
                {"k_bits": 4, "v_bits": 2, "group_size": 8, "residual": 4},
                {"k_bits": 2, "v_bits": 4, "group_size": 16})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        o, hs = self.opts, self.head_dim
        qk, tk, qv, tv = self._capacity(self.max_len, o)
        lead = (self.n_layer, self.batch, self.n_head)

        def zeros(*shape, dtype=torch.uint8):
            return torch.zeros(*lead, *shape, dtype=dtype, device=self.device)

        self.k_q = zeros(qk, math.ceil(hs * o.k_bits / 8))  # (L, B, nh, Qk, packed hs)
        self.k_scale = zeros(qk // o.group_size, hs, dtype=SCALE_DTYPE)  # (L, B, nh, Qk / G, hs)
        self.k_min = zeros(qk // o.group_size, hs, dtype=SCALE_DTYPE)
        self.k_tail = zeros(tk, hs, dtype=self.dtype)  # (L, B, nh, Tk, hs): not yet in a whole group
        self.v_q = zeros(qv, math.ceil(hs * o.v_bits / 8))  # (L, B, nh, Qv, packed hs)
        self.v_scale = zeros(qv, math.ceil(hs / o.group_size), dtype=SCALE_DTYPE)  # (L, B, nh, Qv, groups)
        self.v_min = zeros(qv, math.ceil(hs / o.group_size), dtype=SCALE_DTYPE)
        self.v_tail = zeros(tv, hs, dtype=self.dtype)  # (L, B, nh, Tv, hs): the newest `residual` tokens
        self._returned = (0, torch.float32)  # tokens in the history the last update returned, and its dtype

    # ---- what the kind declares -----------------------------------------------------------------------------

    @staticmethod
    def _capacity(max_len: int, o: QuantOptions) -> tuple[int, int, int, int]:
        """Slots (quantised K, full-precision K, quantised V, full-precision V) a cache of ``max_len`` needs."""
        G, R = o.group_size, o.residual
        return ((max(0, max_len - R - 1) // G) * G, max_len if max_len <= R + G else R + G,
                max(0, max_len - R), min(R, max_len))

    def _split(self, n: int) -> tuple[int, int]:
        """After n tokens: how many of K and of V are quantised (the rest is in the full-precision tails)."""
        G, R = self.opts.group_size, self.opts.residual
        return (max(0, n - R - 1) // G) * G, max(0, n - R)

    @classmethod
    def held_tokens(cls, max_len: int, n_tokens: int, opts) -> int:
        return max_len

    @classmethod
    def nbytes_formula(cls, n_layer, n_head, head_dim, max_len, batch, dtype, n_tokens, opts) -> int:
        qk, tk, qv, tv = cls._capacity(max_len, opts)
        hs, G, isz, ssz = head_dim, opts.group_size, itemsize(dtype), 2
        k = qk * math.ceil(hs * opts.k_bits / 8) + (qk // G) * hs * 2 * ssz + tk * hs * isz
        v = qv * math.ceil(hs * opts.v_bits / 8) + qv * math.ceil(hs / G) * 2 * ssz + tv * hs * isz
        return n_layer * batch * n_head * (k + v)

    @classmethod
    def bytes_per_token(cls, n_layer, n_head, head_dim, dtype, opts) -> float:
        hs, G = head_dim, opts.group_size
        k = math.ceil(hs * opts.k_bits / 8) + 4 * hs / G
        v = math.ceil(hs * opts.v_bits / 8) + 4 * math.ceil(hs / G)
        return n_layer * n_head * (k + v)

    @classmethod
    def label(cls, opts) -> str:
        return f"quant k{opts.k_bits}/v{opts.v_bits} g{opts.group_size}" + (f" r{opts.residual}"
                                                                            if opts.residual else "")

    # ---- the contract ---------------------------------------------------------------------------------------

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._check_room(layer, k_new, v_new)
        o, hs, G = self.opts, self.head_dim, self.opts.group_size
        B, nh = self.batch, self.n_head
        n0, n1 = self.pos, self.pos + t
        (qk0, qv0), (qk1, qv1) = self._split(n0), self._split(n1)

        # K: the tail + the new tokens; whole groups that now have a token after them are quantised per channel
        pending = torch.cat([self.k_tail[layer, :, :, :n0 - qk0], k_new.to(self.dtype)], dim=2)  # from qk0
        m = qk1 - qk0
        if m:
            q, scale, lo = quantize(pending[:, :, :m].float().view(B, nh, m // G, G, hs), o.k_bits, dim=3)
            self.k_q[layer, :, :, qk0:qk1] = pack(q.view(B, nh, m, hs), o.k_bits)
            self.k_scale[layer, :, :, qk0 // G:qk1 // G] = scale.squeeze(3)
            self.k_min[layer, :, :, qk0 // G:qk1 // G] = lo.squeeze(3)
        self.k_tail[layer, :, :, :n1 - qk1] = pending[:, :, m:]

        # V: the tail + the new tokens; tokens older than the newest `residual` are quantised per token
        pending = torch.cat([self.v_tail[layer, :, :, :n0 - qv0], v_new.to(self.dtype)], dim=2)  # from qv0
        m = qv1 - qv0
        if m:
            x = pending[:, :, :m].float()  # (B, nh, m, hs)
            ng = math.ceil(hs / G)
            if ng * G > hs:  # a last, partial group of channels: pad with its own last channel (min/max unchanged)
                x = torch.cat([x, x[..., -1:].expand(B, nh, m, ng * G - hs)], dim=-1)
            q, scale, lo = quantize(x.view(B, nh, m, ng, G), o.v_bits, dim=4)
            self.v_q[layer, :, :, qv0:qv1] = pack(q.view(B, nh, m, ng * G)[..., :hs], o.v_bits)
            self.v_scale[layer, :, :, qv0:qv1] = scale.squeeze(4)
            self.v_min[layer, :, :, qv0:qv1] = lo.squeeze(4)
        self.v_tail[layer, :, :, :n1 - qv1] = pending[:, :, m:]

        self._returned = (n1, k_new.dtype)
        return self._history(layer, qk1, n1, "k", k_new.dtype), self._history(layer, qv1, n1, "v", v_new.dtype)

    def _history(self, layer: int, n_quant: int, n: int, which: str, dtype: torch.dtype) -> torch.Tensor:
        """K or V of all n tokens, (B, nh, n, hs): the first ``n_quant`` dequantised, the rest from the tail,
        written straight into one float32 tensor, then cast to the compute ``dtype``."""
        B, nh, hs, G = self.batch, self.n_head, self.head_dim, self.opts.group_size
        out = torch.empty(B, nh, n, hs, dtype=torch.float32, device=self.device)
        if n_quant:
            bits = self.opts.k_bits if which == "k" else self.opts.v_bits
            packed, scale, lo = (getattr(self, f"{which}_{part}")[layer] for part in ("q", "scale", "min"))
            q = unpack(packed[:, :, :n_quant], bits, hs).float()  # (B, nh, n_quant, hs)
            if which == "k":  # a scale per channel per group of G tokens
                shape = (B, nh, n_quant // G, G, hs)
                scale, lo = scale[:, :, :n_quant // G].unsqueeze(3), lo[:, :, :n_quant // G].unsqueeze(3)
            elif hs % G == 0:  # V: a scale per token per group of G channels
                shape = (B, nh, n_quant, hs // G, G)
                scale, lo = scale[:, :, :n_quant].unsqueeze(4), lo[:, :, :n_quant].unsqueeze(4)
            else:  # a last, partial group of channels: spell the scales out per channel
                shape = (B, nh, n_quant, hs)
                scale = scale[:, :, :n_quant].repeat_interleave(G, dim=-1)[..., :hs]
                lo = lo[:, :, :n_quant].repeat_interleave(G, dim=-1)[..., :hs]
            torch.addcmul(lo.float(), q.view(shape), scale.float(), out=out[:, :, :n_quant].view(shape))
        out[:, :, n_quant:] = getattr(self, f"{which}_tail")[layer, :, :, :n - n_quant]
        return out.to(dtype)

    def error_bound(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per element of the history the last update returned: half a quantisation step where quantised (0 in the
        full-precision tails), plus half a unit in the last place of the compute dtype it was returned in (the
        float32 dequantised values, and the tails, are rounded into it)."""
        B, nh, hs, G = self.batch, self.n_head, self.head_dim, self.opts.group_size
        n, dtype = self._returned
        qk, qv = self._split(n)
        k_half = self.k_scale[layer, :, :, :qk // G].float().repeat_interleave(G, dim=2) / 2  # (B, nh, qk, hs)
        v_half = self.v_scale[layer, :, :, :qv].float().repeat_interleave(G, dim=-1)[..., :hs] / 2
        zeros = torch.zeros(B, nh, n, hs, device=self.device)
        half_ulp = torch.finfo(dtype).eps / 2
        k = self._history(layer, qk, n, "k", torch.float32).abs() * half_ulp
        v = self._history(layer, qv, n, "v", torch.float32).abs() * half_ulp
        return torch.cat([k_half, zeros[:, :, qk:]], dim=2) + k, torch.cat([v_half, zeros[:, :, qv:]], dim=2) + v

    # ---- rewinding and reuse --------------------------------------------------------------------------------

    def can_crop(self, n_tokens: int) -> bool:
        if not 0 <= n_tokens <= self.pos:
            return False
        (qk_now, qv_now), (qk, qv) = self._split(self.pos), self._split(n_tokens)
        # no K group may need un-quantising, and V may only drop quantised tokens (residual 0), never re-widen them
        return qk == qk_now and (qv == qv_now or self.opts.residual == 0)

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
        qk, qv = self._split(n)
        G = self.opts.group_size
        return {"k_q": (self.k_q, qk), "k_scale": (self.k_scale, qk // G), "k_min": (self.k_min, qk // G),
                "k_tail": (self.k_tail, n - qk), "v_q": (self.v_q, qv), "v_scale": (self.v_scale, qv),
                "v_min": (self.v_min, qv), "v_tail": (self.v_tail, n - qv)}

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

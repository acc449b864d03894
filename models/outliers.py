"""Outlier channels in K and V, put into a loaded GPT-2 (or a rotary, grouped-query model: ``_inject_rotary``)
without changing what it computes.

Large models' keys (and, less, values) carry a few channels far larger than the rest, the premise of KIVI's scale per
channel for K and of the rotations (``rotate=hadamard``); a small model such as kvlab's mini has none to speak of.
``inject`` gives it such channels by rescaling its attention weights, so a cache kind's error on them can be
measured on a model whose function is the one it had:

- K: in layer l, head h, channel c of the key projection (c_attn's K rows, weight and bias) is multiplied by S and
  the same channel of the query projection (c_attn's Q rows) by 1/S: every q·k, so every attention probability, is
  unchanged (to rounding).
- V: channel c of the value projection (c_attn's V rows, weight and bias) is multiplied by S and the matching input
  of the output projection (c_proj's column h * head_dim + c) by 1/S: attention's output is a mix of the V rows
  whose weights sum to 1, so c_proj's output is unchanged.

Layout: kvlab's GPT-2 holds c_attn as an ``nn.Linear`` of weight (3C, C), (out, in), rows [0, C) Q, [C, 2C) K,
[2C, 3C) V, head h's channel c at row part * C + h * head_dim + c; c_proj's weight is (C, C), its input j column j.
(An HF checkpoint's Conv1D holds the transposes; ``models.hf_checkpoint`` transposes them on load.)

Which channels (``k_channels``, ``v_channels``, each): None, a seeded choice of one per head in every layer; an int,
that channel in every head of every layer; a list of n_head ints, head h's channel in every layer; or n_layer lists of
n_head ints, one per layer and head (what ``inject`` returns, so a choice can be given back as it was made).

    chosen = inject(model, 20.0)             # {"scale": 20.0, "k_channels": [[..] * n_head] * n_layer, ...}
"""

from __future__ import annotations

import math

import torch

from models.decoder import Decoder


def check_scale(scale) -> float:
    """``scale`` as a float: a positive finite number (1: the model as it is), else ValueError in one line."""
    ok = not isinstance(scale, bool) and isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0
    if not ok:
        raise ValueError(f"scale={scale!r}: use a positive finite number (1: the model as it is; 20: one K and one V "
                         "channel per head 20 times their size)")
    return float(scale)


def check_seed(seed) -> int:
    """``seed`` (of the channels' choice): an integer 0 <= seed < 2**63, else ValueError in one line."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed={seed!r}: use an integer 0 <= seed < 2**63")
    return seed


def _is_index(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, int)


def _shown(x) -> str:
    """A value as the command line gives it: lists (tuples too) as [a, b]."""
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in x) + "]"
    return repr(x)


def _channels(name: str, given, cfg, g: torch.Generator) -> list[list[int]]:
    """``given`` (None, an int, one per K/V head, or n_layer lists of those) as n_layer lists of n_kv_head channels
    (GPT-2's K/V heads are its heads)."""
    L, H, hs = cfg.n_layer, cfg.n_kv_head, cfg.head_dim
    drawn = torch.randint(0, hs, (L, H), generator=g).tolist()  # drawn always, so K's draw never moves V's
    if given is None:
        return drawn
    shapes = (f"give one channel for every head (an int), {H} (one per head) or {L} lists of {H} (one per layer and "
              "head)")
    if _is_index(given):
        out = [[given] * H for _ in range(L)]
    elif isinstance(given, (list, tuple)) and len(given) == H and all(_is_index(c) for c in given):
        out = [list(given) for _ in range(L)]
    elif isinstance(given, (list, tuple)) and len(given) == L and all(
            isinstance(row, (list, tuple)) and len(row) == H and all(_is_index(c) for c in row) for row in given):
        out = [list(row) for row in given]
    else:
        raise ValueError(f"{name}={_shown(given)}: {shapes}, channel indices as integers")
    bad = sorted({c for row in out for c in row if not 0 <= c < hs})
    if bad:
        raise ValueError(f"{name}={_shown(given)}: channel {bad[0]} is not one of a head's {hs} channels: use "
                         f"0 .. {hs - 1}")
    return out


def choose(cfg, scale=1.0, k_channels=None, v_channels=None, seed: int = 0) -> dict:
    """What ``inject`` would do to a model of ``cfg``, checked (ValueError in one line, naming the argument) and
    resolved, nothing built: {"scale": S, "k_channels": n_layer lists of n_head, "v_channels": the same}; at S = 1
    the channels are None (nothing is injected)."""
    scale, seed = check_scale(scale), check_seed(seed)
    g = torch.Generator().manual_seed(seed)
    k = _channels("k_channels", k_channels, cfg, g)
    v = _channels("v_channels", v_channels, cfg, g)
    if scale == 1.0:
        return dict(scale=scale, k_channels=None, v_channels=None)
    return dict(scale=scale, k_channels=k, v_channels=v)


@torch.no_grad()
def inject(model: Decoder, scale=1.0, k_channels=None, v_channels=None, seed: int = 0) -> dict:
    """Give ``model`` one K and one V outlier channel per head in every layer, ``scale`` times their size, in place,
    without changing its function (the module's doc); returns what was done (``choose``). S = 1 leaves every
    parameter as it was, bit for bit."""
    chosen = choose(model.config, scale, k_channels, v_channels, seed)
    if chosen["k_channels"] is None:
        return chosen
    if model.config.rotary:
        _inject_rotary(model, chosen)
        return chosen
    C, hs, S = model.config.n_embd, model.config.head_dim, chosen["scale"]
    for block, ks, vs in zip(model.transformer.h, chosen["k_channels"], chosen["v_channels"]):
        w, b = block.attn.c_attn.weight, block.attn.c_attn.bias  # (3C, C), (3C,)
        proj = block.attn.c_proj.weight  # (C, C): column j reads attention's output channel j
        for h, (kc, vc) in enumerate(zip(ks, vs)):
            q, k, v = h * hs + kc, C + h * hs + kc, 2 * C + h * hs + vc
            for row in (k, v):  # K's and V's channel S times larger
                w[row].mul_(S)
                b[row].mul_(S)
            w[q].div_(S)  # q·k as it was
            b[q].div_(S)
            proj[:, h * hs + vc].div_(S)  # c_proj's output as it was
    return chosen


def _inject_rotary(model, chosen: dict) -> None:
    """The same on a rotary, grouped-query model (``models.llama``): in K/V head g of each layer, K's channel c and
    the channel it is rotated with (c + head_dim/2, mod head_dim) are made S times larger in k_proj, and the same two
    channels of every query head of g's group 1/S times in q_proj (a rotation turns a pair as a whole, so scaling
    both of its channels alike commutes with it: every score is unchanged); V's channel c S times larger in v_proj
    and the matching input column of o_proj, for every query head of the group, 1/S times."""
    cfg, S = model.config, chosen["scale"]
    hd, groups = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    for block, ks, vs in zip(model.blocks, chosen["k_channels"], chosen["v_channels"]):
        a = block.self_attn
        for g, (kc, vc) in enumerate(zip(ks, vs)):
            heads = range(g * groups, (g + 1) * groups)
            for c in (kc, (kc + hd // 2) % hd):
                _scale_row(a.k_proj, g * hd + c, S)
                for h in heads:
                    _scale_row(a.q_proj, h * hd + c, 1 / S)
            _scale_row(a.v_proj, g * hd + vc, S)
            for h in heads:
                a.o_proj.weight[:, h * hd + vc].div_(S)


def _scale_row(linear, row: int, factor: float) -> None:
    """Output channel ``row`` of a linear layer (its weight row and bias) times ``factor``."""
    linear.weight[row].mul_(factor)
    if linear.bias is not None:
        linear.bias[row].mul_(factor)

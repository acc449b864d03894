"""The model as training sees it, of either family (GPT-2 or Llama): the compact-vocabulary model
(``compact_model``), its optimiser and schedule (``make_optimizer``, ``lr_at``), the last block's output at given
positions without the vocabulary projection (``hidden``; ``row_positions``: rows that read their positions from a
random start, the fixed first token kept at 0), the training-time gate ``mlps_left_out`` (attention only, invisible in
the exported model), and what keeps the compact vocabulary exportable (``pin_embedding``). ``sinusoids``: a position
initialisation the recipe tried and keeps out (the probes' ``--pe sin`` / ``--pos sin``).

How the unused ids are exported depends on the final norm (``has_norm_bias``): a LayerNorm with a bias (GPT-2) gives
them one constant logit through a free embedding dimension (``export.export_full``); an RMSNorm (Llama) has no bias,
so their rows are zero (logit exactly 0), and the compact model's slot for every other id holds a zero row whose
logit is raised by ln(unused ids) (``other_logit``): the compact softmax is then the full one, restricted."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict

import torch

from harness.train.recipe import FREE_DIM, INIT_STD, MIN_LR_FRAC, PEAK_LR, WARMUP_FRAC, WEIGHT_DECAY
from models.decoder import Decoder
from models.families import build


def compact_model(cfg, n_vocab: int, init_std: float = INIT_STD, n_full: int | None = None) -> Decoder:
    """The training model: the same decoder with a compact vocabulary (the training split's ids + one slot for
    others), initialised with weights of std ``init_std`` (each family's initialisation at another scale; the residual
    projections at ``init_std`` / sqrt(2 n_layer), as GPT-2's). ``n_full``: the full vocabulary's size, for a family
    without a norm bias (its ``other_logit``)."""
    model = build(type(cfg)(**{**asdict(cfg), "vocab_size": n_vocab, "initializer_range": init_std}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):  # GPT-2's own init scales its c_proj already
                p.mul_(1 / math.sqrt(2 * cfg.n_layer))
    if not has_norm_bias(model):
        other = n_vocab - 1
        offset = torch.zeros(n_vocab)
        offset[other] = math.log(max((n_full or n_vocab) - other, 1))  # the unused ids' mass, each at logit 0
        model.lm_head.register_forward_hook(lambda mod, args, out: out + offset.to(out))
    pin_embedding(model)
    return model


def has_norm_bias(model: Decoder) -> bool:
    """Whether the final norm has a bias (GPT-2's LayerNorm): what the export's constant logit is made from."""
    return getattr(model.final_norm, "bias", None) is not None


@torch.no_grad()
def pin_embedding(model: Decoder) -> None:
    """Hold what the export relies on (after every step): with a norm bias, embedding dimension FREE_DIM at 0 for
    every row; without one, the last (other ids') row at 0."""
    wte = model.get_input_embeddings().weight
    if has_norm_bias(model):
        wte[:, FREE_DIM] = 0.0
    else:
        wte[-1] = 0.0


def lr_at(frac: float, peak: float = PEAK_LR) -> float:
    """Linear warmup to ``peak`` over WARMUP_FRAC of the budget, then cosine down to MIN_LR_FRAC * ``peak``."""
    frac = min(max(frac, 0.0), 1.0)
    if frac < WARMUP_FRAC:
        return peak * (frac + 1e-3) / WARMUP_FRAC
    p = (frac - WARMUP_FRAC) / (1 - WARMUP_FRAC)
    return peak * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model: Decoder, lr: float = PEAK_LR, weight_decay: float = WEIGHT_DECAY) -> torch.optim.AdamW:
    """AdamW (0.9, 0.95), ``weight_decay`` on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def hidden(model: Decoder, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """The last block's output (before the final norm) of an uncached causal forward of ``idx`` (B, T) at positions
    ``pos`` ((T,) or (B, T); default 0..T-1): the model's forward without the vocabulary projection. The head is
    ``model.head``."""
    pos = torch.arange(idx.size(1)) if pos is None else pos
    x = model.embed(idx, pos)
    rope = model.rotary(pos)
    for layer, block in enumerate(model.blocks):
        x = block(x, None, layer, None, rope)
    return x


def row_positions(rows: int, length: int, starts: torch.Tensor | None, bos: bool) -> torch.Tensor:
    """Positions of ``rows`` rows of ``length`` tokens: (length,) from 0, or with ``starts`` (rows, 1) each row's
    from its start (rows that read every position of the model); with ``bos`` the first token stays at 0 and the
    rest follow its start, so the fixed first token is at position 0 in every row."""
    pos = torch.arange(length)
    if starts is None:
        return pos
    shifted = pos + starts  # (rows, length)
    if bos:
        shifted[:, 0] = 0
    return shifted


@contextmanager
def position_offsets(model, starts: torch.Tensor | None):
    """Inside: a GPT-2's (uncached) forward reads position embeddings from ``starts`` (rows, 1) on instead of 0,
    each row its own (the research probes' tool; training gives ``hidden`` its positions). None: no change."""
    if starts is None:
        yield
        return

    def shift(mod, args):
        return (args[0] + starts.to(args[0].device),)  # (T,) + (rows, 1) -> (rows, T)

    hook = model.transformer.wpe.register_forward_pre_hook(shift)
    try:
        yield
    finally:
        hook.remove()


def attention_only_at(settings: dict, step: int, elapsed: float) -> bool:
    """Whether a run with these settings trains attention only at this point of its budget (``--mlp-off``)."""
    frac = step / settings["steps"] if settings["steps"] is not None else elapsed / (settings["minutes"] * 60.0)
    return frac < settings.get("mlp_off", 0.0)


class _NoMLP(torch.nn.Module):
    """Stands in for a block's MLP while it is left out: adds nothing to the residual stream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(())


def mlp_output(block) -> torch.nn.Linear:
    """A block's MLP output projection (GPT-2's c_proj, Llama's down_proj): zeroed, the MLP adds nothing."""
    return getattr(block.mlp, "c_proj", None) or block.mlp.down_proj


@contextmanager
def mlps_left_out(model: Decoder, out: bool = True):
    """Inside (when ``out``): every block of ``model`` is attention only, its MLP swapped for one that adds nothing;
    the MLPs' weights are untouched and get no gradient (AdamW then skips them: no step, no decay). Outside: the
    model as it was, MLPs and all (state_dict and checkpoint unchanged)."""
    if not out:
        yield
        return
    blocks = list(model.blocks)
    kept = [b.mlp for b in blocks]
    for b in blocks:
        b.mlp = _NoMLP()
    try:
        yield
    finally:
        for b, mlp in zip(blocks, kept):
            b.mlp = mlp


def sinusoids(length: int, width: int) -> torch.Tensor:
    """(length, width): Vaswani et al.'s position signals, sin/cos pairs at frequencies 1 .. 1e-4 rad a position
    (entries of rms 1 / sqrt(2)); a rotation maps each row to the next, so one query/key map can point every position
    at its predecessor. Scale to the initialisation's std where used."""
    freq = 10000.0 ** (-torch.arange(0, width, 2).float() / width)
    angle = torch.arange(length).float()[:, None] * freq
    return torch.stack([angle.sin(), angle.cos()], -1).flatten(1)

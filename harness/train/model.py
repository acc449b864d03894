"""The model as training sees it: the compact-vocabulary GPT2 (``compact_model``), its optimiser and schedule
(``make_optimizer``, ``lr_at``), the last block's output without the vocabulary projection (``hidden``), and the two
training-time gates, both invisible in the exported model: ``mlps_left_out`` (attention only) and
``position_offsets`` (rows read the position embeddings from a random start). ``sinusoids``: a position
initialisation the recipe tried and keeps out (the probes' ``--pe sin`` / ``--pos sin``)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict

import torch

from harness.train.recipe import INIT_STD, MIN_LR_FRAC, PEAK_LR, WARMUP_FRAC, WEIGHT_DECAY
from models.gpt2 import GPT2, GPT2Config


def compact_model(cfg: GPT2Config, n_vocab: int, init_std: float = INIT_STD) -> GPT2:
    """The training model: the same GPT2 with a compact vocabulary (the training split's ids + one slot for others),
    initialised with weights of std ``init_std`` (GPT-2's initialisation at another scale)."""
    return GPT2(GPT2Config(**{**asdict(cfg), "vocab_size": n_vocab, "initializer_range": init_std}))


def lr_at(frac: float, peak: float = PEAK_LR) -> float:
    """Linear warmup to ``peak`` over WARMUP_FRAC of the budget, then cosine down to MIN_LR_FRAC * ``peak``."""
    frac = min(max(frac, 0.0), 1.0)
    if frac < WARMUP_FRAC:
        return peak * (frac + 1e-3) / WARMUP_FRAC
    p = (frac - WARMUP_FRAC) / (1 - WARMUP_FRAC)
    return peak * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model: GPT2, lr: float = PEAK_LR) -> torch.optim.AdamW:
    """AdamW (0.9, 0.95), weight decay WEIGHT_DECAY on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def hidden(model: GPT2, idx: torch.Tensor) -> torch.Tensor:
    """The last block's output (before ln_f): GPT2.forward without the vocabulary projection."""
    pos = torch.arange(idx.size(1))
    x = model.transformer.wte(idx) + model.transformer.wpe(pos)
    for layer, block in enumerate(model.transformer.h):
        x = block(x, None, layer)
    return x


@contextmanager
def position_offsets(model: GPT2, starts: torch.Tensor | None):
    """Inside: the model's (uncached) forward reads position embeddings from ``starts`` (rows, 1) on instead of 0,
    each row its own, so rows shorter than n_positions train every position's embedding. None: no change."""
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


@contextmanager
def mlps_left_out(model: GPT2, out: bool = True):
    """Inside (when ``out``): every block of ``model`` is attention only, its MLP swapped for one that adds nothing;
    the MLPs' weights are untouched and get no gradient (AdamW then skips them: no step, no decay). Outside: the
    model as it was, MLPs and all (state_dict and checkpoint unchanged)."""
    if not out:
        yield
        return
    blocks = list(model.transformer.h)
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

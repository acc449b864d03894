"""What the trained model is measured by. All reported NLLs (nats/token) are of the FINAL SAVED model with the full
50,257-way softmax: held-out on non-overlapping seq_len-token windows of the held-out chapters, prompts on each line
of harness/prompts.txt.

The targets (``TARGETS`` in recipe.py; ``evaluate``, printed by ``targets_table`` after training and by
``python -m harness.train --evaluate DIR``), on the saved model, all positions of whole 1,024-token held-out windows:
the held-out NLL; NLL at positions 512-1023 against 0-127 (it uses its context); the NLL rise at positions >= 512
when attention is limited to the last 64 tokens (``model(idx, window=64, sinks=0)``, the uncached reference of the
window kind) and, reported, with 1 and 4 sinks; top-1 copy accuracy on the second showing of a random sequence of 50
and of 500 tokens (first showing: chance; ``harness.core.copying.model_copy_accuracy``); and, reported, the share of
attention each layer's queries (positions >= 64) put on position 0 (recomputed from each layer's input and checked
against the layer's output).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.core.copying import distinct_rows, model_copy_accuracy
from harness.train.corpus import TrainingData, windows
from harness.train.export import finished
from harness.train.recipe import (COPY_FROM, COPY_K, COPY_LENGTHS, EVAL_LEN, EVAL_TOKENS, LATE, PROMPTS,
                                  SINK_WINDOWS, TARGETS, TrainError)
from models.gpt2 import GPT2, CheckpointError
from models.tokenizer import Tokenizer


@torch.no_grad()
def nll(model: GPT2, wins: torch.Tensor, batch: int = 8, ignore_index: int = -100) -> float:
    """Mean next-token NLL (nats) of ``model`` over (N, T + 1) windows, with the model's own full softmax."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(wins), batch):
        w = wins[i:i + batch]
        logits = model(w[:, :-1])
        tgt = w[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1),
                               ignore_index=ignore_index, reduction="sum")
        total += float(loss)
        count += int((tgt != ignore_index).sum())
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def prompts_nll(model: GPT2, tok: Tokenizer) -> float:
    """Mean NLL (nats/token) of every line of harness/prompts.txt, each line its own sequence."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for line in PROMPTS.read_text(encoding="utf-8").splitlines():
        ids = tok.encode(line.strip())[: model.config.n_positions]
        if len(ids) < 2:
            continue
        x = torch.tensor([ids])
        logits = model(x[:, :-1])
        total += float(F.cross_entropy(logits[0].float(), x[0, 1:], reduction="sum"))
        count += len(ids) - 1
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def position_nll(model: GPT2, wins: torch.Tensor, batch: int = 2, start: int = 0, **attention) -> torch.Tensor:
    """(T - start,) mean NLL at each position from ``start`` on over (N, T + 1) windows, full softmax;
    ``attention``: window=, sinks=. Positions before ``start`` still run through every layer (they are the later
    ones' context); only their vocabulary projection, the costly part, is skipped. The projection is made once per
    distinct row of the output embedding (``harness.core.copying.distinct_rows``): the same softmax, at a fifth of
    the cost for a checkpoint whose unused ids share one row."""
    total = torch.zeros(wins.size(1) - 1 - start, dtype=torch.float64)
    rows, log_count, index = distinct_rows(model.lm_head.weight)
    hidden = {}

    def keep(mod, args):  # the final hidden states; the full projection itself is not needed
        hidden["h"] = args[0][:, start:]
        return (args[0][:, :0],)

    skip = model.lm_head.register_forward_pre_hook(keep)
    try:
        for i in range(0, len(wins), batch):
            w = wins[i:i + batch]
            model(w[:, :-1], **attention)
            h = hidden.pop("h").float()  # (b, T - start, C)
            tgt = w[:, 1 + start:]
            lse = torch.logsumexp(h @ rows.t() + log_count, dim=-1)  # the full softmax's normaliser
            own = (h * rows[index[tgt]]).sum(-1)  # each target's logit
            total += (lse - own).sum(0).double()
    finally:
        skip.remove()
    return total / len(wins)


@torch.no_grad()
def attention_io(model: GPT2, idx: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (the attention's input, its output) in a full forward of ``idx`` (B, T)."""
    seen: dict[int, tuple] = {}
    hooks = [block.attn.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out)))
             for i, block in enumerate(model.transformer.h)]
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def attention_on_first(model: GPT2, idx: torch.Tensor, from_pos: int = 64) -> list[float]:
    """Per layer: the share of attention that queries at positions >= from_pos put on position 0 (mean over heads,
    queries and sequences), from ``attention_probs``."""
    return [float(att[:, :, from_pos:, 0].mean()) for att in attention_probs(model, idx)]


@torch.no_grad()
def attention_probs(model: GPT2, idx: torch.Tensor) -> list[torch.Tensor]:
    """Per layer: the causal attention probabilities (B, nh, T, T) of a full forward of ``idx``, recomputed from
    each layer's own input and c_attn, and checked against the layer's output, so they are the ones the model
    used."""
    seen = attention_io(model, idx)
    probs = []
    for i, block in enumerate(model.transformer.h):
        x, out = seen[i]
        B, T, C = x.shape
        nh = block.attn.n_head
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in block.attn.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(C // nh)  # (B, nh, T, T)
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        y = block.attn.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))
        torch.testing.assert_close(y, out, atol=1e-3, rtol=1e-3)  # the same attention the model computed
        probs.append(att)
    return probs


def evaluate(model: GPT2, held: torch.Tensor, ids: torch.Tensor, seed: int = 0) -> dict:
    """Every target (see TARGETS) of a full-vocabulary model, plus ``attention_on_position_0`` (per layer): on whole
    EVAL_LEN-token windows of the held-out stream ``held``; copies of random sequences of tokens from ``ids``."""
    if model.config.n_positions < EVAL_LEN:
        raise TrainError(f"the targets need {EVAL_LEN:,} positions; this model has {model.config.n_positions:,}")
    model.eval()
    wins = windows(held, T=EVAL_LEN)  # (N, EVAL_LEN + 1)
    full = position_nll(model, wins)

    r = dict(heldout_nll=float(full.mean()), nll_0_127=float(full[:128].mean()),
             nll_512_1023=float(full[LATE:].mean()))
    r["context_gain"] = r["nll_0_127"] - r["nll_512_1023"]
    # the same tokens with and without the LATE tokens before them: what context buys, apart from the text's own
    # difficulty at each position (context_gain compares different tokens)
    alone = position_nll(model, wins[:, LATE:])
    r["context_gain_same_tokens"] = float(alone[:128].mean() - full[LATE:LATE + 128].mean())
    r["context_gain_same_tokens_512"] = float(alone.mean() - full[LATE:].mean())
    for sinks, key in ((0, "window64_cost"), (1, "window64_sink1_cost"), (4, "window64_sink4_cost")):
        late = position_nll(model, wins, start=LATE, window=64, sinks=sinks)
        r[key] = float(late.mean()) - r["nll_512_1023"]
    for n in COPY_LENGTHS:
        copy = model_copy_accuracy(model, ids, n, k=COPY_K, seed=seed + n)
        r[f"copy{n}_first"], r[f"copy{n}_acc"] = copy.first, copy.second
    n, afters = COPY_FROM  # can it copy from anywhere, or only from near the start?
    for o in afters:
        r[f"copy{n}_after{o}"] = model_copy_accuracy(model, ids, n, k=COPY_K, seed=seed + n + o, after=o).second
    r["attention_on_position_0"] = attention_on_first(model, wins[:SINK_WINDOWS, :-1])
    r = {k: (round(v, 4) if isinstance(v, float) else [round(s, 4) for s in v]) for k, v in r.items()}
    r["heldout_windows"] = len(wins)
    r["met"] = {key: meets(r[key], bound) for key, _, bound in TARGETS if bound is not None}
    return r


def meets(value: float, bound: tuple) -> bool:
    """Whether ``value`` meets a target's bound ("<=" or ">=", number)."""
    op, limit = bound
    return value <= limit if op == "<=" else value >= limit


def targets_table(r: dict) -> str:
    """The targets as one plain-text table: what, value, bound, met."""
    rows = [("target", "value", "bound", "met")]
    for key, what, bound in TARGETS:
        rows.append((what, f"{r[key]:+.3f}" if "cost" in key or "gain" in key else f"{r[key]:.3f}",
                     f"{bound[0]} {bound[1]}" if bound else "reported",
                     ("yes" if r["met"][key] else "NO") if bound else ""))
    for layer, share in enumerate(r["attention_on_position_0"]):
        rows.append((f"layer {layer}: share of attention on position 0 (queries >= 64)", f"{share:.3f}",
                     "reported", ""))
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    failed = [key for key, ok in r["met"].items() if not ok]
    lines.append(f"{len(r['met']) - len(failed)} of {len(r['met'])} targets met"
                 + (f"; missed: {', '.join(failed)}" if failed else "") +
                 f" ({r['heldout_windows']} held-out sequences of {EVAL_LEN:,} tokens; copies: {COPY_K} random "
                 f"sequences per length)")
    return "\n".join(lines)


def evaluate_folder(folder: str | os.PathLike) -> tuple[dict, str]:
    """``--evaluate DIR``: every target of the checkpoint in DIR, measured now: (figures, the table)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise TrainError(f"--evaluate {folder}: no config.json there; give a checkpoint folder")
    try:
        model = GPT2.from_pretrained(folder).eval()
    except CheckpointError as e:
        raise TrainError(f"--evaluate {folder}: {e}") from None
    data = TrainingData(EVAL_LEN, EVAL_TOKENS)
    seed = (finished(folder) or {}).get("seed", 0)
    r = evaluate(model, data.held_stream, data.copy_ids(full=True), seed=seed)
    return r, targets_table(r)

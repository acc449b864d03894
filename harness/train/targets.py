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

import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.common.ownership import atomic_write
from harness.common.stats import mean_interval
from harness.core import recall
from harness.core.copying import model_copy_accuracy, output_rows
from harness.core.inputs import behind
from harness.train.corpus import TrainingData, windows
from harness.train.export import finished
from harness.train.folder import check_recordable_folder
from harness.train.recipe import (COPY_FROM, COPY_K, COPY_LENGTHS, EOT, EVAL_LEN, EVAL_TOKENS, FAR_COPY, FAR_K, LATE,
                                  NEAR, NEEDLE_DEPTHS, NEEDLE_K, PROMPTS, RECALL_EVAL, RECALL_K, SINK_FROM,
                                  SINK_WINDOWS, TARGETS, TrainError)
from models import attention
from models.decoder import Decoder
from models.families import MODEL_CLASSES, load_model
from models.hf_checkpoint import CheckpointError, first_token
from models.hf_checkpoint import read_config as hf_read_config
from models.tokenizer import Tokenizer

# sequences a forward of the evaluation (held-out windows, copies): 8 of 1,024 tokens cost a third less than 2
# at a time on a 2-core CPU, the same figures to float rounding
EVAL_BATCH = 8


@torch.no_grad()
def nll(model: Decoder, wins: torch.Tensor, batch: int = 8, ignore_index: int = -100, skip: int = 0) -> float:
    """Mean next-token NLL (nats) of ``model`` over (N, T + 1) windows, with the model's own full softmax; the first
    ``skip`` targets of each window are not scored (1 behind a fixed first token: ``corpus.windows``)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(wins), batch):
        w = wins[i:i + batch]
        logits = model(w[:, :-1])
        tgt = w[:, 1:].clone()
        tgt[:, :skip] = ignore_index
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1),
                               ignore_index=ignore_index, reduction="sum")
        total += float(loss)
        count += int((tgt != ignore_index).sum())
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def prompts_nll(model: Decoder, tok: Tokenizer, bos: int | None = None) -> float:
    """Mean NLL (nats/token) of every line of harness/prompts.txt, each line its own sequence (behind ``bos``, the
    fixed first token, if given: the line's first token, which nothing before it announces, is not scored either
    way)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    lead = [] if bos is None else [bos]
    for line in PROMPTS.read_text(encoding="utf-8").splitlines():
        ids = tok.encode(line.strip())[: model.config.n_positions - len(lead)]
        if len(ids) < 2:
            continue
        x = torch.tensor([lead + ids])
        logits = model(x[:, :-1])[0, len(lead):]  # the predictions of the line's tokens 1 ..
        total += float(F.cross_entropy(logits.float(), x[0, 1 + len(lead):], reduction="sum"))
        count += len(ids) - 1
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def position_nll(model: Decoder, wins: torch.Tensor, batch: int = EVAL_BATCH, start: int = 0,
                 **attention) -> torch.Tensor:
    """(T - start,) mean NLL at each position from ``start`` on over (N, T + 1) windows, full softmax;
    ``attention``: window=, sinks=. Positions before ``start`` still run through every layer (they are the later
    ones' context); only their vocabulary projection, the costly part, is skipped. The projection is made once per
    distinct row of the output embedding (``harness.core.copying.distinct_rows``): the same softmax, at a fifth of
    the cost for a checkpoint whose unused ids share one row."""
    total = torch.zeros(wins.size(1) - 1 - start, dtype=torch.float64)
    rows, log_count, index, _ = output_rows(model)
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
def attention_io(model, idx: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of a GPT-2: (the attention's input, its output) in a full forward of ``idx`` (B, T) (the probes')."""
    seen: dict[int, tuple] = {}
    hooks = [block.attn.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out)))
             for i, block in enumerate(model.transformer.h)]
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
    return seen


@contextmanager
def attention_replaced(make):
    """Inside: every model family's ``attend`` is ``make(real)`` (``real``: the attention it replaces), then put back."""
    real = attention.attend
    modules = {sys.modules[cls.__module__] for cls in MODEL_CLASSES.values()}
    for m in modules:
        m.attend = make(real)
    try:
        yield
    finally:
        for m in modules:
            m.attend = real


def _recorded_attention(store: list, keep=None):
    """Inside: every uncached attention of a model of any family also appends its probabilities (B, nh, T, T) to
    ``store`` (or ``keep(probabilities)``, so a long sequence's T x T matrices are not all held at once), computed
    from the q and k the layer handed to attention (rotated already, for a rotary family) and checked against the
    layer's attention output, so they are the ones the model used."""
    def make(real):
        def recording(q, k, v, cache=None, layer=0, mask=None):
            y = real(q, k, v, cache, layer, mask)
            if cache is None and mask is None:
                groups = q.size(1) // k.size(1)
                kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
                T = q.size(2)
                att = (q @ kk.transpose(-1, -2)) / math.sqrt(q.size(-1))
                att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
                torch.testing.assert_close(att @ vv, y, atol=1e-3, rtol=1e-3)  # the attention the model computed
                store.append(att if keep is None else keep(att))
            return y
        return recording
    return attention_replaced(make)


@torch.no_grad()
def attention_probs(model: Decoder, idx: torch.Tensor, keep=None) -> list[torch.Tensor]:
    """Per layer: the causal attention probabilities (B, nh, T, T) of a full forward of ``idx``, as the model used
    them (``_recorded_attention``), or ``keep`` of them."""
    store: list[torch.Tensor] = []
    with _recorded_attention(store, keep):
        model(idx)
    if len(store) != model.config.n_layer:
        raise RuntimeError(f"recorded {len(store)} layers' attention of {model.config.n_layer}")
    return store


@torch.no_grad()
def attention_on_first(model: Decoder, idx: torch.Tensor, from_pos: int = SINK_FROM) -> list[list[float]]:
    """Per layer and head: the share of attention that queries at positions >= from_pos put on position 0 (mean
    over queries and sequences)."""
    shares = attention_probs(model, idx, keep=lambda att: att[:, :, from_pos:, 0].mean(dim=(0, 2)))
    return [s.tolist() for s in shares]


def chapters(held: torch.Tensor, least: int, most: int, bos: int | None) -> list[torch.Tensor]:
    """The held-out stream's chapters (split at <|endoftext|>) of at least ``least`` tokens, each cut to its first
    ``most`` and put behind ``bos`` if given: (1, n) each."""
    out, start = [], 0
    for end in (held == EOT).nonzero().flatten().tolist():
        doc, start = held[start:end], end + 1
        if len(doc) >= least:
            doc = doc[:most]
            out.append(behind(doc, bos).unsqueeze(0))
    return out


def context_used(model: Decoder, held: torch.Tensor, bos: int | None) -> tuple[float, int]:
    """What a model's own-document context buys on the same tokens: over the held-out chapters of at least LATE +
    NEAR tokens, the NLL of each token at chapter positions LATE .. EVAL_LEN - 1 predicted from the last NEAR tokens
    (the one before it included) and the sequence's first token (``window=NEAR, sinks=1``: the fixed first token,
    or the chapter's first) minus predicted from the whole chapter before it; the same tokens at the same positions.
    (gain, tokens)."""
    lead = bos is not None
    near_total, all_total, n = 0.0, 0.0, 0
    start = LATE - 1 + lead  # the input position whose target is the chapter's token LATE
    by_length: dict[int, list[torch.Tensor]] = {}
    for doc in chapters(held, LATE + NEAR, EVAL_LEN, bos):  # (1, L) each: inputs doc[:-1], targets doc[1:]
        by_length.setdefault(doc.shape[1], []).append(doc)
    for docs in by_length.values():  # the chapters of one length (most are cut to EVAL_LEN) in batches
        w = torch.cat(docs)
        full = position_nll(model, w, start=start) * len(w)  # sums over the chapters, per position
        near = position_nll(model, w, start=start, window=NEAR, sinks=1) * len(w)
        all_total, near_total = all_total + float(full.sum()), near_total + float(near.sum())
        n += full.numel() * len(w)
    return (near_total - all_total) / max(n, 1), n


def evaluate(model: Decoder, held: torch.Tensor, ids: torch.Tensor, seed: int = 0, bos: int | None = None) -> dict:
    """Every target (see TARGETS) of a full-vocabulary model, plus ``attention_on_position_0`` (per layer, per head):
    on whole EVAL_LEN-token windows of the held-out stream ``held``; copies of random sequences of tokens from
    ``ids``, of the ids the held-out text uses, and of passages of the held-out text. ``bos``: the fixed first token
    the model was trained with, put in front of every sequence (never scored)."""
    if model.config.n_positions < EVAL_LEN:
        raise TrainError(f"the targets need {EVAL_LEN:,} positions; this model has {model.config.n_positions:,}")
    model.eval()
    lead = bos is not None
    wins = windows(held, T=EVAL_LEN, bos=lead)  # (N, EVAL_LEN + 1)
    full = position_nll(model, wins)  # behind the first token: its own prediction (position 0) is not scored

    r = dict(heldout_nll=float(full[lead:].mean()), nll_0_127=float(full[lead:128].mean()),
             nll_512_1023=float(full[LATE:].mean()))
    r["heldout_tokens"] = int(len(wins) * (len(full) - lead))
    r["context_gain"] = r["nll_0_127"] - r["nll_512_1023"]
    r["context_used"], r["context_used_tokens"] = context_used(model, held, bos)
    # the same tokens with and without the LATE tokens before them: what context buys, apart from the text's own
    # difficulty at each position (context_gain compares different tokens)
    tail = wins[:, LATE:] if not lead else torch.cat([wins[:, :1], wins[:, LATE:]], 1)
    alone = position_nll(model, tail)[lead:]
    r["context_gain_same_tokens"] = float(alone[:128].mean() - full[LATE:LATE + 128].mean())
    r["context_gain_same_tokens_512"] = float(alone.mean() - full[LATE:].mean())
    for sinks, key in ((0, "window64_cost"), (1, "window64_sink1_cost"), (4, "window64_sink4_cost")):
        late = position_nll(model, wins, start=LATE, window=64, sinks=sinks)
        r[key] = float(late.mean()) - r["nll_512_1023"]
    r["window64_sink_ratio"] = r["window64_cost"] / max(r["window64_sink1_cost"], 1e-3)
    # the ids the held-out text uses that training also uses, each as likely: an id no training row holds is, in the
    # export, one shared row and cannot be copied (docs/reference-model.md, "Try 5")
    text_ids = torch.unique(held[held != EOT])
    text_ids = text_ids[torch.isin(text_ids, ids)]
    for suffix, pool in (("", ids), ("_text", text_ids)):
        for n in COPY_LENGTHS:
            copy = model_copy_accuracy(model, pool, n, k=COPY_K, seed=seed + n, bos=bos, batch=EVAL_BATCH)
            r[f"copy{n}{suffix}"] = copy.second
            if not suffix:
                r[f"copy{n}_first"], r[f"copy{n}_acc"] = copy.first, copy.second
                del r[f"copy{n}"]
        n, afters = COPY_FROM  # can it copy from anywhere, or only from near the start?
        for o in afters if not suffix else afters[-1:]:
            r[f"copy{n}_after{o}{suffix}"] = model_copy_accuracy(model, pool, n, k=COPY_K, seed=seed + n + o,
                                                                 after=o, bos=bos, batch=EVAL_BATCH).second
    text = held[held != EOT]  # passages of the held-out text itself: its own prior competes with the copy
    r["copy500_passage"] = model_copy_accuracy(model, text, 500, k=COPY_K, seed=seed, bos=bos, contiguous=True,
                                             batch=EVAL_BATCH).second
    r.update(far_retrieval(model, held, ids, seed, bos))
    shares = attention_on_first(model, wins[:SINK_WINDOWS, :-1])
    r["attention_on_position_0"] = shares
    r["sink_head_max"] = max(max(layer) for layer in shares)
    r = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
    r["attention_on_position_0"] = [[round(h, 4) for h in layer] for layer in shares]
    r["heldout_windows"] = len(wins)
    r["bos"] = lead
    r["met"] = {key: meets(r[key], bound) for key, _, bound in TARGETS if bound is not None}
    return r


def needle_probes(held: torch.Tensor, ids: torch.Tensor, seed: int = 0, bos: int | None = None) -> tuple[list, list]:
    """The needle target's probes: (the NEEDLE_DEPTHS depths, the middle of each tenth of the room before the
    question; per depth its NEEDLE_K needles, each seeded by its depth and index)."""
    depths = [(d + 0.5) / NEEDLE_DEPTHS for d in range(NEEDLE_DEPTHS)]
    return depths, [[recall.needle(held, ids, EVAL_LEN, depth, seed + 8_000 + 100 * d + i, bos)
                     for i in range(NEEDLE_K)] for d, depth in enumerate(depths)]


def far_retrieval(model: Decoder, held: torch.Tensor, ids: torch.Tensor, seed: int = 0, bos: int | None = None) -> dict:
    """Retrieval from far back in held-out text (``harness.core.recall``), random ids of ``ids`` planted in windows
    of ``held`` (the held-out stream, <|endoftext|> between chapters as training reads it): the far copy, a needle
    at each of NEEDLE_DEPTHS depths (the middle of each tenth of the room before the question), and RECALL_EVAL pairs
    each asked once. Each figure is the mean of its sequences' accuracies; ``retrieval`` holds, per figure, its n
    (sequences) and 95% t-interval over them, and ``needle_depths`` each depth's accuracy."""
    n, gap = FAR_COPY
    far = recall.accuracy(model, [recall.far_copy(held, ids, n, gap, seed + 7_000 + i, bos) for i in range(FAR_K)])
    depths, probes = needle_probes(held, ids, seed, bos)
    needles = [recall.accuracy(model, at_depth) for at_depth in probes]
    pairs = recall.accuracy(model, [recall.recall(held, ids, EVAL_LEN, RECALL_EVAL, seed + 9_000 + i, bos)
                                    for i in range(RECALL_K)])
    per = {f"far{n}_after{gap}_text": far, f"recall{RECALL_EVAL}": pairs,
           **{f"needle_{depth:.2f}": acc for depth, acc in zip(depths, needles)}}
    out = {key: mean_interval(v)[0] for key, v in per.items() if not key.startswith("needle_")}
    out["needle_depths"] = [round(mean_interval(v)[0], 4) for v in needles]
    out["needle_min"] = min(out["needle_depths"])
    out["retrieval"] = {key: _accuracy_interval(v) for key, v in per.items()}
    return out


def _accuracy_interval(values: list[float]) -> dict:
    """{mean, lo, hi, n}: the mean of per-sequence accuracies and its 95% t-interval, cut to [0, 1] (an accuracy's
    range; a symmetric interval around a mean near 0 or 1 would leave it)."""
    m, lo, hi, n = mean_interval(values)
    if n > 1:
        lo, hi = max(lo, 0.0), min(hi, 1.0)
    return {"mean": round(m, 4), "lo": round(lo, 4), "hi": round(hi, 4), "n": n}


def meets(value: float, bound: tuple) -> bool:
    """Whether ``value`` meets a target's bound ("<=" or ">=", number)."""
    op, limit = bound
    return value <= limit if op == "<=" else value >= limit


def targets_table(r: dict) -> str:
    """The targets as one plain-text table: what, value, bound, met."""
    rows = [("target", "value", "bound", "met")]
    spread = r.get("retrieval") or {}
    for key, what, bound in TARGETS:
        iv = spread.get(key) if key != "needle_min" else None
        value = f"{r[key]:+.3f}" if any(w in key for w in ("cost", "gain", "used")) else f"{r[key]:.3f}"
        if iv and iv.get("n", 0) > 1:
            value += f" [{iv['lo']:.3f}, {iv['hi']:.3f}] n={iv['n']}"
        rows.append((what, value,
                     f"{bound[0]} {bound[1]}" if bound else "reported",
                     ("yes" if r["met"][key] else "NO") if bound else ""))
    if r.get("needle_depths"):
        rows.append((f"needle value accuracy at each of {len(r['needle_depths'])} depths (n={NEEDLE_K} each)",
                     " ".join(f"{a:.2f}" for a in r["needle_depths"]), "reported", ""))
    for layer, shares in enumerate(r["attention_on_position_0"]):
        shares = shares if isinstance(shares, list) else [shares]  # a record from before the per-head shares
        rows.append((f"layer {layer}: share of attention on position 0 per head (queries >= {SINK_FROM})",
                     " ".join(f"{h:.3f}" for h in shares), "reported", ""))
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
    """``--evaluate DIR``: every target of the checkpoint in DIR, measured now, and its prompts.txt NLL (behind the
    first token it was trained with, if any: config.json's kvlab_bos): (figures, the table)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise TrainError(f"--evaluate {folder}: no config.json there; give a checkpoint folder")
    try:
        model = load_model(folder).eval()
        bos = first_token(folder)
    except CheckpointError as e:
        raise TrainError(f"--evaluate {folder}: {e}") from None
    data = TrainingData(EVAL_LEN, EVAL_TOKENS)
    seed = (finished(folder) or {}).get("seed", 0)
    r = evaluate(model, data.held_stream, data.copy_ids(full=True), seed=seed, bos=bos)
    r["prompts_nll"] = round(prompts_nll(model, data.tok, bos), 4)
    return r, targets_table(r)


def check_recordable(folder: str | os.PathLike) -> dict:
    """The config.json of a checkpoint kvlab trained (it carries a ``kvlab_train`` record, and the folder is kvlab's:
    ``check_recordable_folder``); refused (TrainError, one line) for any other, before anything is measured: kvlab
    writes only into checkpoints it trained."""
    try:
        cfg = hf_read_config(Path(folder))
    except CheckpointError as e:
        raise TrainError(f"--record {folder}: cannot read its config.json ({e}); give a checkpoint folder kvlab "
                         "trained") from None
    if not isinstance(cfg.get("kvlab_train"), dict):
        raise TrainError(f"--record {folder}: its config.json has no kvlab_train record (kvlab did not train it); "
                         "kvlab writes only into checkpoints it trained")
    check_recordable_folder(Path(folder))
    return cfg


def record_targets(folder: str | os.PathLike, r: dict) -> None:
    """``--evaluate DIR --record``: write what was measured now into DIR's ``kvlab_train`` record (its targets, and
    the held-out and prompts NLLs they include), so the record says what the code measures today."""
    cfg = check_recordable(folder)
    rec = cfg["kvlab_train"]
    rec["targets"] = {k: v for k, v in r.items() if k != "prompts_nll"}
    rec.update(heldout_nll=r["heldout_nll"], heldout_tokens=r["heldout_tokens"], prompts_nll=r["prompts_nll"])
    atomic_write(Path(folder) / "config.json", (json.dumps(cfg, indent=2) + "\n").encode())

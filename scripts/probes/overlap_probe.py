"""How much of the held-out text the reference models saw in training anyway: the share of each held-out chapter's
word 8-grams (lower-cased words, punctuation dropped) that also occur anywhere in the training chapters. The KJV
repeats itself (parallel histories, genealogies, repeated laws), so a chapter held out whole can still share long
passages with training. Prints the share over all held-out chapters, each chapter's (its paragraph of heldout.txt,
where it is line i), and the chapters at or above ``--leaking`` (default 5%) as the argument
``python -m harness.scorecard --leave-out`` takes, to judge the paper presets again without their texts.

    .venv/bin/python scripts/probes/overlap_probe.py                 # ~10 s; --n 8 --leaking 0.05 by default
    .venv/bin/python scripts/probes/overlap_probe.py --n 13 --top 5

docs/reference-model.md (the held-out texts) reads its output.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

from harness.analysis.scorecard import compact  # noqa: E402
from harness.train.corpus import corpus_documents, split_documents  # noqa: E402


def grams(text: str, n: int) -> list[tuple[str, ...]]:
    """The text's word n-grams: lower-cased words (letters and apostrophes), in order, overlapping."""
    words = re.findall(r"[a-z']+", text.lower())
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def overlap(n: int = 8) -> tuple[float, list[tuple[int, int, float, int]]]:
    """(the share of all held-out n-grams that occur in training, and per held-out chapter: (its paragraph of
    heldout.txt, from 1; its chapter index in the corpus; its share; its n-grams))."""
    docs = corpus_documents()
    train, held = split_documents(docs)
    seen = {g for i in train for g in grams(docs[i], n)}
    rows, hit, total = [], 0, 0
    for line, i in enumerate(held, 1):
        g = grams(docs[i], n)
        h = sum(x in seen for x in g)
        rows.append((line, i, h / len(g) if g else 0.0, len(g)))
        hit, total = hit + h, total + len(g)
    return hit / total if total else 0.0, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8, help="words per n-gram (default 8)")
    ap.add_argument("--leaking", type=float, default=0.05, help="a chapter leaks from this share (default 0.05)")
    ap.add_argument("--top", type=int, default=10, help="chapters listed, most shared first (default 10)")
    a = ap.parse_args(argv)
    if a.n < 1 or not 0 < a.leaking <= 1 or a.top < 0:
        print(f"overlap_probe: give --n >= 1, --leaking in (0, 1] and --top >= 0 (got {a.n}, {a.leaking}, {a.top})",
              file=sys.stderr)
        return 2
    share, rows = overlap(a.n)
    print(f"held-out word {a.n}-grams that occur in training: {share:.1%} of {sum(r[3] for r in rows):,} "
          f"({len(rows)} chapters)")
    print("paragraph of heldout.txt | corpus chapter | share | n-grams")
    for line, i, s, k in sorted(rows, key=lambda r: -r[2])[:a.top]:
        print(f"{line:>4} | {i:>5} | {s:6.1%} | {k:,}")
    leaking = {r[0] for r in rows if r[2] >= a.leaking}
    print(f"{len(leaking)} chapters at or above {a.leaking:.0%}: --leave-out {compact(leaking).replace(', ', ',')}"
          if leaking else f"no chapter at or above {a.leaking:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

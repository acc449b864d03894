"""Where in its context a shipped model can find a needle: the needle target's probe (``harness.core.recall.needle``:
an 8-id key and an 8-id value in held-out text, the key asked at the end), with the needle placed by its distance
to the question (``--gaps``: ids of text between the needle and the question) in contexts of each of ``--lengths``
ids, and, with the needle just before its question (gap 0), in contexts of each of ``--edge`` lengths, which moves
the needle's absolute position alone. A figure that falls with the gap at one length but not at another is about
where the needle lies, not how far back. For a GPT-2 (learned positions) it also prints the norm of each 8
positions' embeddings from --norms-from on. With ``--sources``, no model: where the copy phase's rows read from a
random start (``--copy-offsets``) put a span's first showing, per 16 positions from --norms-from on, relative to the
positions 400-599, for each ``--offset-draw``: the only rows that train a GPT-2's position embeddings to be copied
from before text joins.

    .venv/bin/python scripts/probes/needle_position_probe.py --weights models/weights/mini        # ~40 s
    .venv/bin/python scripts/probes/needle_position_probe.py --weights models/weights/mini-llama --k 32
    .venv/bin/python scripts/probes/needle_position_probe.py --sources                          # ~3 s

Prints one JSON line per figure: the length, the gap, the needle's first position (the first token counted), and the
value ids' top-1 accuracy: mean over --k needles, its 95% t-interval over them (cut to [0, 1]) and n.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402

from harness.common.stats import mean_interval  # noqa: E402
from harness.core import recall  # noqa: E402
from harness.train.corpus import TrainingData  # noqa: E402
from harness.train.recipe import BATCH, CURRICULUM, EVAL_LEN, EVAL_TOKENS, IGNORE, KEY_IDS, NEEDLE_K  # noqa: E402
from harness.train.rows import OFFSET_DRAWS, offset_starts, twice_rows  # noqa: E402
from models.families import load_model  # noqa: E402
from models.hf_checkpoint import first_token  # noqa: E402

SPAN = 2 * KEY_IDS  # a needle: its key and its value


def needle_at(held: torch.Tensor, ids: torch.Tensor, length: int, gap: int, k: int, bos, seed: int = 60_000):
    """(the needle's first position in the sequence, ``k`` needle probes of ``length`` ids with ``gap`` ids of text
    between the needle and its question), each seeded by length, gap and index."""
    room = length - (bos is not None) - 2 * SPAN
    if not 0 <= gap <= room:
        raise SystemExit(f"needle_position_probe: gap {gap} does not fit a context of {length} (give 0 .. {room})")
    depth = (room - gap) / room
    first = round(depth * room) + (bos is not None)
    return first, [recall.needle(held, ids, length, depth, seed + 10 * length + 100_000 * gap + i, bos)
                   for i in range(k)]


def figure(model, held, ids, length: int, gap: int, k: int, bos) -> dict:
    """One JSON row: where the needle lies and how often its value ids are found (95% t-interval over needles)."""
    first, probes = needle_at(held, ids, length, gap, k, bos)
    mean, lo, hi, n = mean_interval(recall.accuracy(model, probes))
    return {"length": length, "gap": gap, "needle_at": first, "accuracy": round(mean, 4),
            "interval": [round(max(lo, 0.0), 4), round(min(hi, 1.0), 4)], "n": n}  # an accuracy's: cut to [0, 1]


def copy_phase_sources(draw: str, steps: int = 200, seed: int = 0, n_positions: int = EVAL_LEN) -> torch.Tensor:
    """(n_positions,): how many first showings of a copied span each position holds over ``steps`` batches of the
    copy phase's offset rows (CURRICULUM's first length, the first token at 0), their starts drawn by ``draw``."""
    length = CURRICULUM[0][0]
    rows = BATCH * EVAL_LEN // length
    g = torch.Generator().manual_seed(seed)
    count = torch.zeros(n_positions)
    for _ in range(steps):
        _, y = twice_rows(rows, length - 1, 1000, 999, g)
        starts = offset_starts(rows, n_positions, length, draw, g)
        for r in range(rows):
            second = (y[r] != IGNORE).nonzero().flatten()  # the second showing's inputs, its first id on
            n = len(second) + 1
            at = int(starts[r]) + 1 + int(second[0]) - n  # the first showing, in the model's positions
            count[at:at + n] += 1
    return count


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, e.g. 0,16,50") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", help="a checkpoint folder, e.g. models/weights/mini")
    p.add_argument("--sources", action="store_true",
                   help="no model: the copy phase's first showings by position, for each --offset-draw")
    p.add_argument("--k", type=int, default=NEEDLE_K, help=f"needles per figure (default {NEEDLE_K}, the target's)")
    p.add_argument("--gaps", type=_ints, default=[0, 16, 32, 50, 100, 200, 400],
                   help="ids of text between the needle and its question (default 0,16,32,50,100,200,400)")
    p.add_argument("--lengths", type=_ints, default=[512, EVAL_LEN], help="context lengths of the gap grid")
    p.add_argument("--edge", type=_ints, default=[900, 940, 960, 980, 1000, 1012, EVAL_LEN],
                   help="context lengths at gap 0: the needle's place moves with the length alone")
    p.add_argument("--norms-from", type=int, default=896, help="a GPT-2's position-embedding norms from here on")
    a = p.parse_args(argv)
    if a.sources:
        for draw in OFFSET_DRAWS:
            count = copy_phase_sources(draw)
            middle = float(count[400:600].mean())
            print(json.dumps({"offset_draw": draw, "first_showings_vs_400_599": {
                i: round(float(count[i:i + 16].mean()) / middle, 2) for i in range(a.norms_from, EVAL_LEN, 16)}}))
        return 0
    if not a.weights:
        p.error("give --weights DIR (a checkpoint folder), or --sources")
    if a.k < 2:
        p.error(f"--k {a.k}: give at least 2 needles (an interval needs two)")
    data = TrainingData(EVAL_LEN, EVAL_TOKENS)
    model, bos = load_model(a.weights).eval(), first_token(a.weights)
    held, ids = data.held_stream, data.copy_ids(full=True)
    for length in a.lengths:
        for gap in a.gaps:
            print(json.dumps(figure(model, held, ids, length, gap, a.k, bos)), flush=True)
    for length in a.edge:
        print(json.dumps(figure(model, held, ids, length, 0, a.k, bos)), flush=True)
    wpe = getattr(getattr(model, "transformer", None), "wpe", None)
    if wpe is not None:
        norms = wpe.weight.detach().float().norm(dim=1)
        print(json.dumps({"position_norms": {i: round(float(norms[i:i + 8].mean()), 3)
                                             for i in range(a.norms_from, len(norms), 8)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

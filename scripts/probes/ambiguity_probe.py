"""Why a copy of ids the held-out text uses, 100 of them behind 800 others (the ``copy100_after800_text`` target),
fails where the same copy of ids drawn from the whole training vocabulary holds: is it the repeated keys? A copy
step predicts the id after an id of the second showing; when that id also occurs elsewhere before it (in the 800
or earlier in the span), a one-token match finds several successors and only a longer match tells them apart.
The ~3,500 ids of the held-out text repeat far more in 1,000 draws than the training split's ~9,500 do.

On the ``--evaluate`` probe's own sequences (``harness.core.copying.copy_sequences``: the same draw, more of them)
each scored position of the second showing is *ambiguous* when its input id occurs at another position before it
(its first-showing counterpart aside), *clean* otherwise. Per sequence: top-1 accuracy on each kind, and the paired
difference, with a 95% t-interval over the sequences (``harness.common.stats.mean_interval``).

    .venv/bin/python scripts/probes/ambiguity_probe.py --weights models/weights/mini-llama --pool text    # ~20 s
    .venv/bin/python scripts/probes/ambiguity_probe.py --weights outputs/train/mini-llama-66c --pool random

Prints one JSON line: the pool, its size, the share of scored positions that are ambiguous, and each accuracy.
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
from harness.core.copying import copy_sequences, top1  # noqa: E402
from harness.core.inputs import behind  # noqa: E402
from harness.train.corpus import TrainingData  # noqa: E402
from harness.train.recipe import COPY_FROM, EOT, EVAL_LEN, EVAL_TOKENS  # noqa: E402
from models.families import load_model  # noqa: E402
from models.hf_checkpoint import first_token  # noqa: E402


def ambiguous_positions(seq: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """(n - 1,) bool: for each scored step of the second showing (inputs at start + n .. start + 2n - 2, each
    predicting the next id), whether its input id occurs at another earlier position than its counterpart in the
    first showing (start + i for the input at start + n + i)."""
    out = torch.zeros(n - 1, dtype=torch.bool)
    for i in range(n - 1):
        at = start + n + i
        earlier = (seq[:at] == seq[at]).nonzero().flatten().tolist()
        out[i] = any(j != start + i for j in earlier)
    return out


def measure(model, pool: torch.Tensor, k: int, seed: int, bos: int | None) -> dict:
    n, after = COPY_FROM[0], COPY_FROM[1][-1]
    seqs = behind(torch.cat(copy_sequences(pool, n, k, seed, after)), bos)  # (k, lead + after + 2n)
    lead = int(bos is not None)
    start = lead + after
    clean, amb, diff, share = [], [], [], []
    with torch.no_grad():
        for i in range(0, k, 8):
            x = seqs[i:i + 8]
            pred = top1(model.eval(), x, start + n, start + 2 * n - 1)  # predicts ids start+n+1 .. start+2n-1
            for row in range(len(x)):
                right = pred[row] == x[row, start + n + 1:start + 2 * n]
                a = ambiguous_positions(x[row], start, n)
                share.append(float(a.float().mean()))
                if a.any() and (~a).any():
                    amb.append(float(right[a].float().mean()))
                    clean.append(float(right[~a].float().mean()))
                    diff.append(clean[-1] - amb[-1])

    def iv(v):
        m, lo, hi, cnt = mean_interval(v)
        return {"mean": round(m, 4), "lo": round(lo, 4), "hi": round(hi, 4), "n": cnt}

    return dict(ambiguous_share=iv(share), clean=iv(clean), ambiguous=iv(amb), clean_minus_ambiguous=iv(diff))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True, help="a checkpoint folder (full vocabulary)")
    p.add_argument("--pool", choices=("text", "random"), default="text",
                   help="the held-out text's ids (the _text target) or the training split's (the random-id one)")
    p.add_argument("--k", type=int, default=48, help="sequences (default 48; the target uses 8)")
    p.add_argument("--seed", type=int, default=1000, help="their seed (default 1000: not the target's)")
    a = p.parse_args(argv)
    data = TrainingData(EVAL_LEN, EVAL_TOKENS)
    held = data.held_stream
    pool = torch.unique(held[held != EOT]) if a.pool == "text" else data.copy_ids(full=True)
    model = load_model(a.weights)
    r = measure(model, pool, a.k, a.seed, first_token(a.weights))
    print(json.dumps({"weights": a.weights, "pool": a.pool, "pool_ids": len(pool), **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a shipped model's heads look while it copies: for each layer and head, the most-attended key's offset from
the query (key position minus query position) at every step of the second showing of ``n`` random ids shown twice,
the offset most queries share and the share that share it, and how often the most-attended key holds the token being
produced (Wu et al.'s retrieval score, as ``python -m harness.heads`` counts it). On mini-llama it shows why that
score finds no head: layer 0 looks a fixed 24 and 25 positions back, layer 1 looks ``n`` - 25 back (25 past the
current token's earlier showing), and no head's most-attended key is the copied token (docs/cache-kinds.md, duo).

    .venv/bin/python scripts/probes/copy_offsets.py --model mini-llama      # n = 50, 64, 100; ~5 s
    .venv/bin/python scripts/probes/copy_offsets.py --model mini --n 64

Prints, per span length, one line per layer: each head's (offset, share of the queries at it, share whose
most-attended key is the copied token).
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

from harness.core import copying  # noqa: E402
from harness.tools.heads import load  # noqa: E402
from harness.train.targets import attention_probs  # noqa: E402


@torch.no_grad()
def offsets(model, bos, n: int, seed: int = 0) -> list[list[tuple[int, float, float]]]:
    """Per layer and query head: (the commonest offset of the most-attended key from the query, the share of the
    second showing's queries at it, the share whose most-attended key is the token they produce)."""
    ids = copying.distinct_ids(model)
    lead = int(bos is not None)
    if lead:
        ids = ids[ids != bos]
    seq = next(iter(copying.copy_sequences(ids, n, 1, seed)))
    if lead:
        seq = torch.cat([seq.new_full((1, 1), bos), seq], 1)
    queries = torch.arange(lead + n, lead + 2 * n - 1)
    out = []
    for p in attention_probs(model, seq):
        top = p[0, :, queries].argmax(-1)  # (heads, steps)
        rel = top - queries
        heads = []
        for h in range(top.shape[0]):
            mode = torch.mode(rel[h]).values
            copied = (seq[0, top[h]] == seq[0, queries + 1]) & (top[h] < lead + n)
            heads.append((int(mode), float((rel[h] == mode).float().mean()), float(copied.float().mean())))
        out.append(heads)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mini-llama", help="a model preset with shipped weights, or a checkpoint folder")
    p.add_argument("--n", type=int, nargs="*", default=[50, 64, 100], help="span lengths (default 50 64 100)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model, bos, what = load(args.model)
    print(f"{what}: the most-attended key's offset from the query, per layer and head "
          "(offset, share of the queries, share on the copied token)")
    for n in args.n:
        print(f"n = {n}")
        for layer, heads in enumerate(offsets(model, bos, n, args.seed)):
            print(f"  layer {layer}: " + "  ".join(f"({o:+d}, {s:.2f}, {c:.2f})" for o, s, c in heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())

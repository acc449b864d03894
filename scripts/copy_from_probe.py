"""Where can a copy circuit copy from? A 2-layer toy (2,000 random ids, harness.train's initialisation, optimiser and
schedule) learns to copy in rows of 32 tokens (the recipe's first curriculum stage), then trains on rows of 128
tokens of one kind; every --every steps, top-1 accuracy on the second showing of 16 random sequences of 16 tokens
that start at position 0, or behind 32 or 96 other random tokens (``harness.train.copy_accuracy(after=)``).

    .venv/bin/python scripts/copy_from_probe.py --rows repeated   # harness.train's copy rows (from 0, repeated)
    .venv/bin/python scripts/copy_from_probe.py --rows placed     # harness.train's placed rows (twice, anywhere)
    .venv/bin/python scripts/copy_from_probe.py --rows mixed      # half each
    .venv/bin/python scripts/copy_from_probe.py --fifths models/weights/mini   # a checkpoint: where its copying stops

docs/reference-model.md ("Copying from anywhere") reads its output (one JSON line per evaluation; ~2 min each on one
core, with 3 at once on 2 cores). The toy's "text" is random ids, so a placed row is a random span shown twice among
random tokens; with few ids (--ids 64) a prefix of random tokens holds the copied ids too and confounds the test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import train as T  # noqa: E402
from models.gpt2 import GPT2Config  # noqa: E402

SHORT, LONG, FORM_STEPS = 32, 128, 400
N_IDS = 2000  # --ids


def batch(kind: str, step: int, stream: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if step < FORM_STEPS:  # the circuit forms in short rows
        return T.copy_rows(64, SHORT, N_IDS + 1, N_IDS, gen, span_min=4)
    repeated = {"repeated": 16, "placed": 0, "mixed": 8}[kind]
    parts = []
    if repeated:
        parts.append(T.copy_rows(repeated, LONG, N_IDS + 1, N_IDS, gen, span_min=4))
    if repeated < 16:
        parts.append(T.placed_rows(stream, 16 - repeated, LONG, N_IDS + 1, N_IDS, gen, span_min=4))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@torch.no_grad()
def fifths(folder: str) -> None:
    """Per length n: top-1 accuracy on each fifth of the second showing of 4 random sequences of n of the training
    split's ids (each shown twice from position 0), for a full-vocabulary checkpoint."""
    from models.gpt2 import GPT2

    model = GPT2.from_pretrained(folder).float().eval()
    ids = T._Data(T.EVAL_LEN, T.EVAL_TOKENS).copy_ids(full=True)
    gen = torch.Generator().manual_seed(0)
    for n in (100, 200, 300, 500):
        span = ids[torch.randint(0, len(ids), (4, n), generator=gen)]
        x = torch.cat([span, span], 1)
        right = (model(x).argmax(-1)[:, n:2 * n - 1] == x[:, n + 1:]).float().mean(0)
        print(json.dumps(dict(n=n, second=round(float(right.mean()), 3),
                              fifths=[round(float(c.mean()), 2) for c in right.split(max(n // 5, 1))])), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", choices=["repeated", "placed", "mixed"], help="the long rows' kind")
    p.add_argument("--fifths", metavar="DIR", help="instead: where a checkpoint's copying stops")
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ids", type=int, default=2000,
                   help="how many ids the toy's sequences are drawn from (few: a prefix holds the copied ids too)")
    p.add_argument("--offsets", action="store_true",
                   help="short rows start at a random position (0 .. 128 - 32) instead of 0 (harness.train's "
                        "position_offsets)")
    a = p.parse_args()
    global N_IDS
    N_IDS = a.ids
    torch.set_num_threads(1)
    if a.fifths:
        return fifths(a.fifths)
    if not a.rows:
        p.error("give --rows repeated|placed|mixed (or --fifths DIR)")
    torch.manual_seed(0)
    model = T.compact_model(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=LONG), N_IDS + 1)
    opt = T.make_optimizer(model, a.lr)
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(N_IDS)
    stream = torch.randint(0, N_IDS, (200_000,), generator=torch.Generator().manual_seed(9))
    t0 = time.time()
    for step in range(a.steps + 1):
        if step % a.every == 0:
            acc = {f"after{o}": round(T.copy_accuracy(model, ids, 16, k=16, after=o)[1], 3) for o in (0, 32, 96)}
            print(json.dumps(dict(rows=a.rows, step=step, s=round(time.time() - t0), **acc)), flush=True)
        if step == a.steps:
            break
        for g in opt.param_groups:
            g["lr"] = T.lr_at(step / a.steps, a.lr)
        x, y = batch(a.rows, step, stream, gen)
        starts = (torch.randint(0, LONG - x.shape[1] + 1, (len(x), 1), generator=gen) if a.offsets else None)
        with T.position_offsets(model, starts):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=T.IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()

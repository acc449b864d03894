"""Where can a copy circuit copy from? A 2-layer toy (2,000 random ids, harness.train's initialisation, optimiser and
schedule) learns to copy in rows of 32 tokens (the recipe's first curriculum stage), then trains on rows of 128
tokens of one kind; every --every steps, top-1 accuracy on the second showing of 16 random sequences of 16 tokens
that start at position 0, or behind 32 or 96 other random tokens (``harness.core.copying.model_copy_accuracy``).

    .venv/bin/python scripts/probes/copy_from_probe.py --rows repeated   # harness.train's copy rows (from 0, repeated)
    .venv/bin/python scripts/probes/copy_from_probe.py --rows placed     # harness.train's placed rows (twice, anywhere)
    .venv/bin/python scripts/probes/copy_from_probe.py --rows mixed      # half each
    .venv/bin/python scripts/probes/copy_from_probe.py --fifths models/weights/mini   # where its copying stops
    .venv/bin/python scripts/probes/copy_from_probe.py --prev-heads models/weights/mini   # does any head look one back?
    .venv/bin/python scripts/probes/copy_from_probe.py --state DIR/train_state.pt   # a harness.train run in progress
    .venv/bin/python scripts/probes/copy_from_probe.py --rows repeated --prev-steps 200 [--hold-prev]
        # a previous-token stage first: rows whose every target is the token before it (a previous-token head
        # at every position)

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

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.core.copying import model_copy_accuracy  # noqa: E402
from harness.train.corpus import TrainingData  # noqa: E402
from harness.train.model import (attention_only_at, compact_model, lr_at, make_optimizer, mlps_left_out,  # noqa: E402
                                 position_offsets)
from harness.train.recipe import EVAL_LEN, EVAL_TOKENS, IGNORE, INIT_STD  # noqa: E402
from harness.train.rows import copy_rows, placed_rows  # noqa: E402
from harness.train.targets import attention_probs  # noqa: E402
from models.gpt2 import GPT2Config  # noqa: E402

SHORT, LONG, FORM_STEPS = 32, 128, 400
N_IDS = 2000  # --ids
PREV_STEPS = 0  # --prev-steps


def batch(kind: str, step: int, stream: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if step < PREV_STEPS:  # rows of random ids whose every target is the token before it
        xx = torch.randint(0, N_IDS, (16, LONG + 1), generator=gen)
        return xx[:, 1:], xx[:, :-1].clone()
    step -= PREV_STEPS
    if step < FORM_STEPS:  # the circuit forms in short rows
        return copy_rows(64, SHORT, N_IDS + 1, N_IDS, gen, span_min=4)
    repeated = {"repeated": 16, "placed": 0, "mixed": 8}[kind]
    parts = []
    if repeated:
        parts.append(copy_rows(repeated, LONG, N_IDS + 1, N_IDS, gen, span_min=4))
    if repeated < 16:
        parts.append(placed_rows(stream, 16 - repeated, LONG, N_IDS + 1, N_IDS, gen, span_min=4))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@torch.no_grad()
def fifths(folder: str) -> None:
    """Per length n: top-1 accuracy on each fifth of the second showing of 4 random sequences of n of the training
    split's ids (each shown twice from position 0), for a full-vocabulary checkpoint."""
    from models.gpt2 import GPT2

    model = GPT2.from_pretrained(folder).float().eval()
    ids = TrainingData(EVAL_LEN, EVAL_TOKENS).copy_ids(full=True)
    gen = torch.Generator().manual_seed(0)
    for n in (100, 200, 300, 500):
        span = ids[torch.randint(0, len(ids), (4, n), generator=gen)]
        x = torch.cat([span, span], 1)
        right = (model(x).argmax(-1)[:, n:2 * n - 1] == x[:, n + 1:]).float().mean(0)
        print(json.dumps(dict(n=n, second=round(float(right.mean()), 3),
                              fifths=[round(float(c.mean()), 2) for c in right.split(max(n // 5, 1))])), flush=True)


@torch.no_grad()
def previous_token_share(model, x: torch.Tensor, buckets=((0, 15), (15, 63), (63, 255), (255, 1023))) -> list:
    """Per layer, per head: the mean attention a query at position i puts on key i - 1, averaged over each bucket
    of query positions (a previous-token head: near 1 at every position)."""
    out = []
    for att in attention_probs(model, x):
        n = att.shape[-1]
        prev = torch.diagonal(att, offset=-1, dim1=-2, dim2=-1).mean(0)  # (nh, n - 1): query i + 1 on key i
        out.append([[round(float(prev[hd, a:min(b, n - 1)].mean()), 2) for a, b in buckets if a < n - 1]
                    for hd in range(att.shape[1])])
    return out


def prev_heads(folder: str) -> None:
    """A checkpoint's previous-token attention per layer and head, on 2 sequences of 1,024 random training ids."""
    from models.gpt2 import GPT2

    model = GPT2.from_pretrained(folder).float().eval()
    ids = TrainingData(EVAL_LEN, EVAL_TOKENS).copy_ids(full=True)
    x = ids[torch.randint(0, len(ids), (2, 1024), generator=torch.Generator().manual_seed(0))]
    for layer, heads in enumerate(previous_token_share(model, x)):
        print(json.dumps(dict(layer=layer, positions="0-15, 15-63, 63-255, 255-1023", heads=heads)), flush=True)


def hold_previous(model, held: dict | None) -> dict:
    """--hold-prev: the first call (after the previous-token stage) keeps layer 0's query/key weights and the
    position embeddings and re-draws layer 0's value and output weights (whose output the stage trained to be the
    token itself, in the embedding's own directions); every later call puts the kept weights back after a step."""
    at, C = model.transformer.h[0].attn, model.config.n_embd
    with torch.no_grad():
        if held is None:
            held = dict(w=at.c_attn.weight[:2 * C].clone(), b=at.c_attn.bias[:2 * C].clone(),
                        pe=model.transformer.wpe.weight.clone())
            at.c_attn.weight[2 * C:].normal_(0, INIT_STD)
            at.c_attn.bias[2 * C:].zero_()
            at.c_proj.weight.normal_(0, INIT_STD / 2)
            at.c_proj.bias.zero_()
        at.c_attn.weight[:2 * C] = held["w"]
        at.c_attn.bias[:2 * C] = held["b"]
        model.transformer.wpe.weight.copy_(held["pe"])
    return held


STATE_LENGTHS, STATE_AFTER = (8, 16, 50), (0, 8, 16, 25, 50, 100, 200, 400, 800)


@torch.no_grad()
def state(path: str) -> None:
    """A harness.train run in progress (its train_state.pt): the compact model as it trains at that step (attention
    only inside an --mlp-off phase), top-1 accuracy on the second showing of 8 random sequences of n training ids
    behind 0 .. 800 other random ids. One JSON line per n."""
    st = torch.load(path, map_location="cpu", weights_only=True)
    s = st["settings"]
    data = TrainingData(s["seq_len"], 1024)
    model = compact_model(GPT2Config(**s["config"]), len(data.vocab) + 1, s["init_std"])
    model.load_state_dict(st["model"])
    model.eval()
    alone = attention_only_at(s, st["step"], st["elapsed"])
    ids = data.copy_ids(full=False)
    with mlps_left_out(model, alone):
        for n in STATE_LENGTHS:
            acc = {f"after{o}": round(model_copy_accuracy(model, ids, n, k=8, after=o).second, 3)
                   for o in STATE_AFTER if o + 2 * n <= model.config.n_positions}
            print(json.dumps(dict(step=st["step"], attention_only=alone, n=n, **acc)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", choices=["repeated", "placed", "mixed"], help="the long rows' kind")
    p.add_argument("--fifths", metavar="DIR", help="instead: where a checkpoint's copying stops")
    p.add_argument("--prev-heads", metavar="DIR", help="instead: a checkpoint's attention on the previous token")
    p.add_argument("--state", metavar="FILE", help="instead: a harness.train run's train_state.pt, as it trains now")
    p.add_argument("--prev-steps", type=int, default=0,
                   help="steps of previous-token rows (rows of 128 random ids, each target the token before it) "
                        "before the copy stages")
    p.add_argument("--hold-prev", action="store_true",
                   help="after --prev-steps: keep layer 0's query/key weights and the position embeddings, re-draw "
                        "its value/output weights")
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--ids", type=int, default=2000,
                   help="how many ids the toy's sequences are drawn from (few: a prefix holds the copied ids too)")
    p.add_argument("--offsets", action="store_true",
                   help="short rows start at a random position (0 .. 128 - 32) instead of 0 (harness.train's "
                        "position_offsets)")
    a = p.parse_args()
    global N_IDS, PREV_STEPS
    N_IDS, PREV_STEPS = a.ids, a.prev_steps
    torch.set_num_threads(1)
    if a.fifths:
        return fifths(a.fifths)
    if a.prev_heads:
        return prev_heads(a.prev_heads)
    if a.state:
        return state(a.state)
    if a.hold_prev and not a.prev_steps:
        p.error("--hold-prev holds what --prev-steps N taught: give both")
    if not a.rows:
        p.error("give --rows repeated|placed|mixed (or --fifths DIR)")
    torch.manual_seed(0)
    model = compact_model(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=LONG), N_IDS + 1)
    opt = make_optimizer(model, a.lr)
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(N_IDS)
    stream = torch.randint(0, N_IDS, (200_000,), generator=torch.Generator().manual_seed(9))
    t0, held = time.time(), None
    for step in range(a.steps + 1):
        if step % a.every == 0:
            acc = {f"after{o}": round(model_copy_accuracy(model, ids, 16, k=16, after=o).second, 3)
                   for o in (0, 32, 96)}
            x = ids[torch.randint(0, N_IDS, (8, LONG), generator=torch.Generator().manual_seed(5))]
            prev = [max(c) for c in zip(*previous_token_share(model, x, ((0, 31), (31, 63), (63, 127)))[0])]
            print(json.dumps(dict(rows=a.rows, step=step, s=round(time.time() - t0), **acc, layer0_prev=prev)),
                  flush=True)
        if step == a.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step / a.steps, a.lr)
        x, y = batch(a.rows, step, stream, gen)
        starts = (torch.randint(0, LONG - x.shape[1] + 1, (len(x), 1), generator=gen) if a.offsets else None)
        with position_offsets(model, starts):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if a.hold_prev and step + 1 >= a.prev_steps:
            held = hold_previous(model, held if step + 1 > a.prev_steps else None)


if __name__ == "__main__":
    main()

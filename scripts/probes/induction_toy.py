"""Which architecture choices lengthen the induction plateau? A 2-layer transformer written here, apart from kvlab's
GPT2 (pre-LN, learned positions, AdamW (0.9, 0.95) without weight decay, one thread), trained only on rows of
2 * --span-max + 32 random ids in which one span of random length 8..--span-max is shown twice at a random place; the
loss is on the second showing (its first token excepted), the only tokens a circuit that finds the earlier showing
and copies what followed it can predict. Because the place and the length are random, copying here is evidence of a
circuit that works from anywhere, not only near position 0 (see docs/reference-model.md).

Every --every steps it prints the second showing's top-1 accuracy on 64 held rows (acc2), the attention layer 1's
best head puts on the key right after the query's earlier showing (ind) and layer 0's best head on the previous key
(prev). The unembedding is separate unless --tied (GPT-2 ties it to the token embedding); there is no MLP unless
--mlp (GPT-2 has one per layer).

    .venv/bin/python scripts/probes/induction_toy.py --ids 500                 # attention-only, untied
    .venv/bin/python scripts/probes/induction_toy.py --ids 500 --tied --steps 5000
    .venv/bin/python scripts/probes/induction_toy.py --ids 500 --mlp --steps 5000
    .venv/bin/python scripts/probes/induction_toy.py --ids 500 --mlp --small-ids 100:1500   # ids < 100 for 1,500 steps
    .venv/bin/python scripts/probes/induction_toy.py --ids 500 --mlp --mlp-from 3000 --steps 5000  # MLPs join at 3,000

About 0.15 s a step on one core (0.26 with --mlp) at the defaults.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.train.model import sinusoids  # noqa: E402


class Layer(nn.Module):
    def __init__(self, width: int, heads: int, mlp: bool):
        super().__init__()
        self.heads = heads
        self.qkv, self.o, self.ln = nn.Linear(width, 3 * width), nn.Linear(width, width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width)) if mlp else None
        self.att = None  # the last forward's attention probabilities (b, heads, t, t)
        self.mlp_on = True  # False: the layer is attention only (--mlp-from)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        a = a.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        self.att = a.detach()
        x = x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x) if self.mlp is not None and self.mlp_on else x


class Toy(nn.Module):
    def __init__(self, ids: int, width: int, heads: int, length: int, tied: bool, mlp: bool, std: float,
                 pos: str = "learned"):
        super().__init__()
        self.e, self.p = nn.Embedding(ids, width), nn.Embedding(length, width)
        self.layers = nn.ModuleList([Layer(width, heads, mlp), Layer(width, heads, mlp)])
        self.ln, self.u = nn.LayerNorm(width), nn.Linear(width, ids, bias=False)
        for w in self.parameters():
            if w.dim() > 1:
                nn.init.normal_(w, std=std)
        if tied:
            self.u.weight = self.e.weight
        if pos == "sin":
            with torch.no_grad():
                self.p.weight.copy_(sinusoids(length, width) * std * math.sqrt(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.e(x) + self.p(torch.arange(x.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.u(self.ln(h))


def rows(n_rows: int, length: int, ids: int, span_max: int, gen: torch.Generator,
         fill: bool = False) -> tuple[torch.Tensor, ...]:
    """(x, scored, key): random ids with one span shown twice at a random place; scored[i, t] marks the positions
    whose token is trained on (the second showing past its first token); key[i, t], for a query t in the second
    showing, is the position right after its token's first showing (where an induction head looks). With ``fill``
    the span recurs from its first showing to the row's end (every showing after the first scored: many sources,
    the nearest one span back)."""
    x = torch.randint(0, ids, (n_rows, length), generator=gen)
    scored = torch.zeros(n_rows, length, dtype=torch.bool)
    key = torch.zeros(n_rows, length, dtype=torch.long)
    for i in range(n_rows):
        n = int(torch.randint(8, span_max + 1, (1,), generator=gen))
        p = int(torch.randint(0, length - 2 * n + 1, (1,), generator=gen))
        end = length if fill else p + 2 * n
        x[i, p + n:end] = x[i, p:p + n].repeat(math.ceil((end - p - n) / n))[:end - p - n]
        scored[i, p + n + 1:end] = True
        key[i, p + n:end] = torch.arange(p + n, end) - n + 1
    return x, scored, key


@torch.no_grad()
def score(model: Toy, x: torch.Tensor, scored: torch.Tensor, key: torch.Tensor) -> dict:
    """acc2 (top-1 on the scored tokens), ind (layer 1's best head on the induction key), prev (layer 0's on t - 1)."""
    pred = model(x)[:, :-1].argmax(-1)
    acc = (pred == x[:, 1:])[scored[:, 1:]].float().mean().item()
    b, t = torch.nonzero(scored[:, 1:], as_tuple=True)
    ind = model.layers[1].att[b, :, t, key[b, t]].max(-1).values.mean().item()
    later = torch.arange(1, x.shape[1])
    prev = model.layers[0].att[:, :, later, later - 1].max(1).values.mean().item()
    return dict(acc2=acc, ind=ind, prev=prev)


def train(a: argparse.Namespace, log=print) -> dict:
    """Train the toy as ``a`` says, logging a line every a.every steps; returns the last evaluation."""
    length = 2 * a.span_max + 32
    torch.manual_seed(a.seed)
    model = Toy(a.ids, a.width, a.heads, length, a.tied, a.mlp, a.std, a.pos)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen, held = torch.Generator().manual_seed(a.seed), rows(64, length, a.ids, a.span_max,
                                                              torch.Generator().manual_seed(a.seed + 1))
    small, small_steps = a.small_ids or (a.ids, 0)
    t0, last = time.time(), {}
    for step in range(a.steps + 1):
        for layer in model.layers:
            layer.mlp_on = step >= a.mlp_from
        if step % a.every == 0 or step == a.steps:
            last = score(model, *held)
            log(f"step {step} s {time.time() - t0:.0f} " + " ".join(f"{k} {v:.3f}" for k, v in last.items()))
        if step == a.steps:
            break
        x, scored, _ = rows(a.batch, length, small if step < small_steps else a.ids, a.span_max, gen, a.fill)
        logits = model(x)
        if a.score_all:  # every next token, as a language model trains (the random ones are noise: ln ids)
            scored = torch.ones_like(scored)
        loss = F.cross_entropy(logits[:, :-1][scored[:, 1:]], x[:, 1:][scored[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return last


def small_ids(text: str) -> tuple[int, int]:
    try:
        ids, steps = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--small-ids wants IDS:STEPS (e.g. 100:1500), got {text!r}") from None
    return ids, steps


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ids", type=int, default=500, help="vocabulary: ids 0..IDS-1 (default 500)")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--span-max", type=int, default=48, help="span lengths 8..SPAN_MAX; rows of 2 * SPAN_MAX + 32")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--std", type=float, default=0.02, help="std of the initial weights (GPT-2's: 0.02)")
    p.add_argument("--tied", action="store_true", help="tie the unembedding to the token embedding, as GPT-2 does")
    p.add_argument("--mlp", action="store_true", help="an MLP in each layer, as GPT-2 has")
    p.add_argument("--mlp-from", type=int, default=0, metavar="STEP",
                   help="with --mlp: leave the MLPs out of the forward until STEP (an attention-only phase)")
    p.add_argument("--small-ids", type=small_ids, default=None, metavar="IDS:STEPS",
                   help="draw the training rows from ids < IDS for the first STEPS steps (a vocabulary curriculum)")
    p.add_argument("--fill", action="store_true",
                   help="training rows repeat the span from its first showing to the row's end (held rows do not)")
    p.add_argument("--score-all", action="store_true",
                   help="train on every next token, not only the second showing (the copy targets a small share "
                        "of the loss, as in mini's rows; held rows are scored as before)")
    p.add_argument("--pos", choices=("learned", "sin"), default="learned",
                   help="initial position embeddings: random like the rest (GPT-2's) or sinusoids (still learnt)")
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.ids < 2 or a.span_max < 8 or a.width % a.heads or (a.small_ids and not 1 < a.small_ids[0] <= a.ids):
        p.error("need --ids >= 2, --span-max >= 8, --width divisible by --heads and 1 < --small-ids IDS <= --ids")
    if a.mlp_from and not a.mlp:
        p.error(f"--mlp-from {a.mlp_from} leaves out MLPs the toy does not have: add --mlp")
    return a


if __name__ == "__main__":
    torch.set_num_threads(1)
    train(parse())

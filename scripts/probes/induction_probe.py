"""Does the second half of an induction circuit form? The toy of scripts/copy_from_probe.py (2 layers, 2 heads, 64
wide, random ids), scored every --every steps on 16 random sequences of 16 tokens shown twice behind 96 other random
tokens: the attention each layer-1 head puts on the key right after the query's earlier showing (an induction head:
near 1; attention spread evenly: ~0.008), layer 0's on the previous key, and top-1 copy accuracy on the second showing
from position 0 / behind 32 / behind 96 (``harness.core.copying.model_copy_accuracy``). One JSON line per
evaluation.

    .venv/bin/python scripts/probes/induction_probe.py                  # the toy as copy_from_probe --rows repeated
    .venv/bin/python scripts/probes/induction_probe.py --layer0 held    # a previous-token stage, its query/key held
    .venv/bin/python scripts/probes/induction_probe.py --layer0 frozen  # ... the whole of layer 0 frozen after it
    .venv/bin/python scripts/probes/induction_probe.py --rows twice --steps 6000  # a span twice at a random place
    .venv/bin/python scripts/probes/induction_probe.py --apart           # a 2-layer attention-only model written here,
        # apart from kvlab's GPT2 (no MLP, std 0.02, AdamW lr 1e-3): is the plateau in our model code?

docs/reference-model.md ("Copying from anywhere") reads its output; about 1 minute per 1,000 steps on one core.
"""

from __future__ import annotations

import argparse
import json
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

from harness.core.copying import model_copy_accuracy  # noqa: E402
from harness.train.model import compact_model, lr_at, make_optimizer  # noqa: E402
from harness.train.recipe import IGNORE  # noqa: E402
from harness.train.rows import copy_rows, twice_rows  # noqa: E402
from harness.train.targets import attention_io, attention_probs  # noqa: E402
from models.gpt2 import GPT2Config  # noqa: E402
from scripts.probes import copy_from_probe as P  # noqa: E402

LONG = P.LONG


def twice(rows: int, n_ids: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """--rows twice: rows of LONG random ids (0 .. n_ids - 1) with one span of 4-32 of them shown twice at a random
    place; only the second showing past its first token is a target (harness.train's ``twice_rows``)."""
    return twice_rows(rows, LONG, n_ids + 1, n_ids, gen, span_min=4, span_max=32)


class Apart(nn.Module):
    """A 2-layer attention-only transformer (pre-LayerNorm, learned positions, tied embedding), written apart from
    models.gpt2; ``keep`` collects each layer's attention probabilities."""

    def __init__(self, n_ids: int, d: int = 64, heads: int = 2, std: float = 0.02):
        super().__init__()
        self.d, self.heads = d, heads
        self.wte, self.wpe = nn.Embedding(n_ids, d), nn.Embedding(LONG, d)
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(3))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0, std)

    def forward(self, idx: torch.Tensor, keep: list | None = None) -> torch.Tensor:
        B, n = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(n))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for layer in range(2):
            q, k, v = self.qkv[layer](self.ln[layer](x)).view(B, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~causal, float("-inf")).softmax(-1)
            if keep is not None:
                keep.append(att)
            x = x + self.out[layer]((att @ v).transpose(1, 2).reshape(B, n, self.d))
        return self.ln[2](x) @ self.wte.weight.T


@torch.no_grad()
def scores(model, n_ids: int, apart: bool) -> dict:
    """Attention on the induction key, the same token and the previous key (layer: per head), and copy accuracy."""
    g = torch.Generator().manual_seed(3)
    span, before = torch.randint(0, n_ids, (8, 16), generator=g), torch.randint(0, n_ids, (8, 96), generator=g)
    x = torch.cat([before, span, span], 1)  # the first showing at 96-111, queries at 112-126
    keep: list = []
    model.eval()
    if apart:
        model(x, keep)
    else:
        keep = attention_probs(model, x)
    j = torch.arange(112, 127)
    att = {layer: dict(induction=[round(float(v), 3) for v in a[:, :, j, j - 15].mean((0, 2))],
                       same=[round(float(v), 3) for v in a[:, :, j, j - 16].mean((0, 2))],
                       previous=[round(float(v), 3) for v in a[:, :, j, j - 1].mean((0, 2))])
           for layer, a in enumerate(keep)}
    ids = torch.arange(n_ids)
    copy = {f"after{o}": round(model_copy_accuracy(model, ids, 16, k=16, after=o).second, 3) for o in (0, 32, 96)}
    model.train()
    return dict(**copy, attention=att)


class Frozen:
    """--layer0 frozen: after the previous-token stage, layer 0 and the position embeddings are put back after
    every step (--layer0 held: copy_from_probe.hold_previous, its query/key and the positions only)."""

    def __init__(self, model):
        self.model, self.kept = model, None

    def __call__(self) -> None:
        block, wpe = self.model.transformer.h[0], self.model.transformer.wpe.weight
        if self.kept is None:
            self.kept = ({k: v.clone() for k, v in block.state_dict().items()}, wpe.clone())
        with torch.no_grad():
            for k, v in block.state_dict().items():
                v.copy_(self.kept[0][k])
            wpe.copy_(self.kept[1])


def linear_probe(model, n_ids: int) -> dict:
    """Top-1 accuracy of a linear map (Adam, 500 steps, on 64 rows of 128 random ids; scored on 16 others) from
    layer 1's attention input at each position to the previous token and to the position's own token."""
    g = torch.Generator().manual_seed(7)
    train, test = torch.randint(0, n_ids, (64, LONG), generator=g), torch.randint(0, n_ids, (16, LONG), generator=g)
    with torch.no_grad():
        f_train, f_test = (attention_io(model, x)[1][0][:, 1:] for x in (train, test))
    out = {}
    for name, target in (("previous_token", lambda x: x[:, :-1]), ("own_token", lambda x: x[:, 1:])):
        torch.manual_seed(0)
        lin = nn.Linear(f_train.shape[-1], n_ids)
        opt = torch.optim.Adam(lin.parameters(), 1e-2)
        for _ in range(500):
            loss = F.cross_entropy(lin(f_train).flatten(0, 1), target(train).flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            out[name] = round(float((lin(f_test).argmax(-1) == target(test)).float().mean()), 3)
    return out


def make(a):
    """The model, its optimiser and the step hook that keeps layer 0 (None: nothing kept)."""
    torch.manual_seed(0)
    if a.apart:
        model = Apart(a.ids + 1, a.width, a.heads)
        return model, torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95)), None
    model = compact_model(GPT2Config(n_layer=2, n_head=a.heads, n_embd=a.width, n_positions=LONG), a.ids + 1)
    opt = make_optimizer(model, a.lr)
    if a.layer0 == "frozen":
        return model, opt, Frozen(model)
    if a.layer0 == "held":
        held = {}

        def hold():
            held["w"] = P.hold_previous(model, held.get("w"))
        return model, opt, hold
    return model, opt, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", choices=["repeated", "twice"], default="repeated",
                   help="repeated: copy_from_probe's (short copy rows, then rows of 128); twice: a span shown twice "
                        "at a random place among random ids, rows of 128 from the start")
    p.add_argument("--layer0", choices=["trained", "held", "frozen"], default="trained",
                   help="held / frozen: 200 steps of previous-token rows first, then layer 0 kept (see Frozen)")
    p.add_argument("--stage-layer0-only", action="store_true",
                   help="the previous-token stage trains only layer 0's attention and the positions (the token "
                        "embedding and the rest stay as drawn)")
    p.add_argument("--linear-probe", action="store_true",
                   help="instead of training on: after the previous-token stage, how well a linear map reads the "
                        "previous token and the position's own token from layer 1's input")
    p.add_argument("--apart", action="store_true", help="the attention-only model written here instead of GPT2")
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--lr", type=float, default=None, help="default: 1e-2 (GPT2 toy), 1e-3 (--apart)")
    p.add_argument("--ids", type=int, default=2000)
    p.add_argument("--width", type=int, default=64, help="n_embd")
    p.add_argument("--heads", type=int, default=2, help="heads per layer")
    a = p.parse_args()
    if a.width % a.heads:
        p.error(f"--width {a.width} is not divisible by --heads {a.heads}")
    if (a.linear_probe or a.stage_layer0_only) and a.layer0 == "trained":
        p.error("--linear-probe and --stage-layer0-only are about the previous-token stage: give --layer0 held|frozen")
    if a.apart and a.layer0 != "trained":
        p.error("--layer0 held/frozen keeps layers of kvlab's GPT2; --apart has none to keep")
    a.lr = a.lr or (1e-3 if a.apart else 1e-2)
    torch.set_num_threads(1)
    P.N_IDS, P.PREV_STEPS = a.ids, 0 if a.layer0 == "trained" else 200
    model, opt, keep = make(a)
    gen = torch.Generator().manual_seed(0)
    staged = [q for n, q in model.named_parameters()
              if not (n.startswith("transformer.h.0.attn.") or n.startswith("transformer.wpe"))]
    t0 = time.time()
    for step in range(a.steps + 1):
        for q in staged if a.stage_layer0_only else []:
            q.requires_grad_(step >= P.PREV_STEPS)
        if a.linear_probe and step == P.PREV_STEPS:
            return print(json.dumps(dict(step=step, **linear_probe(model, a.ids))))
        if step % a.every == 0:
            print(json.dumps(dict(step=step, s=round(time.time() - t0), **scores(model, a.ids, a.apart))), flush=True)
        if step == a.steps:
            break
        if not a.apart:
            for g in opt.param_groups:
                g["lr"] = lr_at(step / a.steps, a.lr)
        if a.rows == "twice" and step >= P.PREV_STEPS:
            x, y = twice(16, a.ids, gen)
        elif a.apart:  # copy_from_probe's short-then-long copy rows, a third of the steps short
            n = P.SHORT if step < a.steps // 3 else LONG
            x, y = copy_rows(2048 // n, n, a.ids + 1, a.ids, gen, span_min=4)
        else:
            x, y = P.batch("repeated", step, None, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if keep is not None and step + 1 >= P.PREV_STEPS:
            keep()


if __name__ == "__main__":
    main()

"""A short probe of how soon the induction (copy) circuit forms: harness.train's data mix, model and optimiser at
one row length, copy accuracy and held-out text loss every --every steps, one JSON line each.

    .venv/bin/python scripts/probes/copy_probe.py --seq 32 --batch 64 --steps 400 --every 25 --tag rows32
    .venv/bin/python scripts/probes/copy_probe.py --seq 128 --batch 16 --steps 400 --tag rows128 [--pe sin]
    .venv/bin/python scripts/probes/copy_probe.py --state DIR/train_state.pt --lengths 8 16 30 50   # a run's state

docs/reference-model.md ("The previous mini's row-length curriculum: the probes") reads its output; the runs it
cites are in scripts/probes/data/. Copy accuracy is top-1 on the second showing of 8 random sequences of
min(50, seq / 2) of the training ids (chance 1/9,519); the learning rate is harness.train's schedule (``lr_at``: a
warmup over 3% of --steps, then a cosine down to 10% of --lr).
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
from harness.train.model import compact_model, lr_at, make_optimizer, sinusoids  # noqa: E402
from harness.train.recipe import COPY_SHARE, IGNORE, INIT_STD, MINI_CONFIG, PEAK_LR, SPAN_MIN  # noqa: E402
from harness.train.rows import make_batch  # noqa: E402
from models.gpt2 import GPT2Config  # noqa: E402


def probe_state(path: Path, lengths: list[int]) -> None:
    """Copy accuracy (second and first showing, 4 random sequences per n) of the compact model in a training state."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    cfg = GPT2Config(**state["settings"]["config"])
    m = compact_model(cfg, state["model"]["transformer.wte.weight"].shape[0])
    m.load_state_dict(state["model"])
    ids = torch.arange(m.config.vocab_size - 2)  # the compact ids without <|endoftext|> (second last) and "other"
    for n in lengths:
        second, first = model_copy_accuracy(m, ids, n, k=4)
        print(json.dumps(dict(state=str(path), step=int(state["step"]), n=n, copy=round(second, 3),
                              first=round(first, 3))), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=128, help="tokens per row")
    p.add_argument("--batch", type=int, default=16, help="rows per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--std", type=float, default=INIT_STD, help="initial weights' std")
    p.add_argument("--lr", type=float, default=PEAK_LR)
    p.add_argument("--copy", type=float, default=COPY_SHARE, help="share of rows that are copy rows")
    p.add_argument("--span-min", type=int, default=SPAN_MIN)
    p.add_argument("--pe", choices=["default", "sin"], default="default", help="position embeddings' init")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    p.add_argument("--state", help="only measure copy accuracy of a harness.train state (train_state.pt)")
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 30, 50], help="with --state: the n to copy")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.state:
        return probe_state(Path(a.state), a.lengths)
    d = TrainingData(a.seq, None)
    torch.manual_seed(0)
    m = compact_model(GPT2Config(**MINI_CONFIG), len(d.vocab) + 1, a.std)
    if a.pe == "sin":  # Vaswani et al.'s position signals, scaled to --std
        pe = sinusoids(1024, m.config.n_embd)
        with torch.no_grad():
            m.transformer.wpe.weight.copy_(pe * a.std / pe.std())
    opt = make_optimizer(m, a.lr)
    gen = torch.Generator().manual_seed(0)
    ids, t0 = d.copy_ids(full=False), time.time()
    for s in range(a.steps + 1):
        if s % a.every == 0:
            m.eval()
            copy = model_copy_accuracy(m, ids, min(50, a.seq // 2), k=8).second
            with torch.no_grad():
                lg = m(d.quick_eval[:4, :a.seq])
                text = F.cross_entropy(lg.flatten(0, 1), d.quick_tgt[:4, 1:a.seq + 1].flatten(), ignore_index=IGNORE)
            m.train()
            print(json.dumps(dict(tag=a.tag, step=s, s=round(time.time() - t0), copy=round(copy, 3),
                                  text=round(float(text), 3))), flush=True)
        if s == a.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(s / a.steps, a.lr)
        x, y = make_batch(d.ctrain, a.batch, a.seq, a.copy, len(d.vocab), d.eot, gen, span_min=a.span_min)
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()


if __name__ == "__main__":
    main()

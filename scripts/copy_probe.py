"""A short probe of how soon the induction (copy) circuit forms: harness.train's data mix, model and optimiser at
one row length, copy accuracy and held-out text loss every --every steps, one JSON line each.

    .venv/bin/python scripts/copy_probe.py --seq 32 --batch 64 --steps 400 --every 25 --tag rows32
    .venv/bin/python scripts/copy_probe.py --seq 128 --batch 16 --steps 400 --tag rows128 [--pe sin]
    .venv/bin/python scripts/copy_probe.py --state DIR/train_state.pt --lengths 8 16 30 50   # a training run's state

docs/reference-model.md ("Why this recipe") reads its output. Copy accuracy is top-1 on the second showing of 8
random sequences of min(50, seq / 2) of the training ids (chance 1/9,519); the learning rate warms up over 3% of
--steps, then follows a cosine down to 10% of --lr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # a Python without torch: run again with the repo's .venv, or one line (scripts/_venv.py)
    import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import train as T  # noqa: E402
from models.gpt2 import GPT2Config  # noqa: E402


def sinusoids(n: int, d: int, std: float) -> torch.Tensor:
    """Vaswani et al.'s position signals, scaled to ``std``."""
    pos = torch.arange(n).float().unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe * std / pe.std()


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over 3% of the steps, then cosine down to 10% of ``peak``: harness.train.lr_at's shape, by step;
    the warmup's first steps differ slightly. Kept as the probes in docs/attempts were run, so they reproduce."""
    w = max(1, int(0.03 * steps))
    if step < w:
        return peak * (step + 1) / w
    p = (step - w) / max(1, steps - w)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def probe_state(path: Path, lengths: list[int]) -> None:
    """Copy accuracy (second and first showing, 4 random sequences per n) of the compact model in a training state."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    cfg = GPT2Config(**state["settings"]["config"])
    m = T.compact_model(cfg, state["model"]["transformer.wte.weight"].shape[0])
    m.load_state_dict(state["model"])
    ids = torch.arange(m.config.vocab_size - 2)  # the compact ids without <|endoftext|> (second last) and "other"
    for n in lengths:
        first, second = T.copy_accuracy(m.eval(), ids, n, k=4)
        print(json.dumps(dict(state=str(path), step=int(state["step"]), n=n, copy=round(second, 3),
                              first=round(first, 3))), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=128, help="tokens per row")
    p.add_argument("--batch", type=int, default=16, help="rows per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--std", type=float, default=T.INIT_STD, help="initial weights' std")
    p.add_argument("--lr", type=float, default=T.PEAK_LR)
    p.add_argument("--copy", type=float, default=T.COPY_SHARE, help="share of rows that are copy rows")
    p.add_argument("--span-min", type=int, default=T.SPAN_MIN)
    p.add_argument("--pe", choices=["default", "sin"], default="default", help="position embeddings' init")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    p.add_argument("--state", help="only measure copy accuracy of a harness.train state (train_state.pt)")
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 30, 50], help="with --state: the n to copy")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.state:
        return probe_state(Path(a.state), a.lengths)
    d = T._Data(a.seq, None)
    torch.manual_seed(0)
    m = T.compact_model(GPT2Config(**T.MINI_CONFIG), len(d.vocab) + 1, a.std)
    if a.pe == "sin":
        with torch.no_grad():
            m.transformer.wpe.weight.copy_(sinusoids(1024, m.config.n_embd, a.std))
    opt = T.make_optimizer(m, a.lr)
    gen = torch.Generator().manual_seed(0)
    ids, t0 = d.copy_ids(full=False), time.time()
    for s in range(a.steps + 1):
        if s % a.every == 0:
            m.eval()
            _, copy = T.copy_accuracy(m, ids, min(50, a.seq // 2), k=8)
            with torch.no_grad():
                lg = m(d.quick_eval[:4, :a.seq])
                text = F.cross_entropy(lg.flatten(0, 1), d.quick_tgt[:4, 1:a.seq + 1].flatten(), ignore_index=T.IGNORE)
            m.train()
            print(json.dumps(dict(tag=a.tag, step=s, s=round(time.time() - t0), copy=round(copy, 3),
                                  text=round(float(text), 3))), flush=True)
        if s == a.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(s, a.steps, a.lr)
        n_copy = round(a.batch * a.copy)
        x, y = T.text_rows(d.ctrain, a.batch - n_copy, a.seq, gen)
        if n_copy:
            cx, cy = T.copy_rows(n_copy, a.seq, len(d.vocab), d.eot, gen, span_min=a.span_min)
            x, y = torch.cat([cx, x]), torch.cat([cy, y])
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten(), ignore_index=T.IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()


if __name__ == "__main__":
    main()

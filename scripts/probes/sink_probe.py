"""Does a fixed first token make an attention sink, and does weight decay make it sooner? Toys trained by
``harness.train`` itself (its rows, model, schedule and first token), on KJV text rows only, one arm each: without
the first token, with it, and with it and weight decay 0.5 (Gu et al., ICLR 2025, arXiv 2410.10781: a token fixed at
a position puts the sink there; weight decay 0.5 gives more sink heads than 0.1). Each arm's training log has the
most attention one head puts on position 0 every --every steps (``sink_max``); at the end each prints that share
per layer and head, and what a --window-token window costs at the second half's positions without and with the
first position kept (sinks 0 and 1).

    .venv/bin/python scripts/probes/sink_probe.py                     # gpt2 toy, 600 steps an arm, ~12 min an arm
    .venv/bin/python scripts/probes/sink_probe.py --family llama --steps 300 --arms bos,bos-wd0.5
    .venv/bin/python scripts/probes/sink_probe.py --out DIR           # keep each arm's checkpoint (default: a temp)

One thread, rows of --seq tokens, 16 a step (the issue's pilot: 4 layers, 128 wide, 2 heads, rows of 256, lr 3e-3).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402

from harness.train import loop  # noqa: E402
from harness.train.corpus import load_data, windows  # noqa: E402
from harness.train.recipe import EOT  # noqa: E402
from harness.train.targets import attention_on_first, position_nll  # noqa: E402
from models.gpt2 import GPT2Config  # noqa: E402
from models.llama import LlamaConfig  # noqa: E402

ARMS = {"no-bos": dict(bos=False), "bos": dict(bos=True), "bos-wd0.5": dict(bos=True, weight_decay=0.5)}


def toy_config(family: str, seq: int):
    """The pilot's toy: 4 layers, 128 wide, 2 heads of 64 (Llama: 4 query heads of 64 over 2 K/V heads)."""
    if family == "gpt2":
        return GPT2Config(n_layer=4, n_head=2, n_embd=128, n_positions=seq)
    return LlamaConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, head_dim=64, intermediate_size=352,
                       n_positions=seq, bos_token_id=EOT, eos_token_id=EOT)


@torch.no_grad()
def window_costs(model, seq: int, bos: bool, window: int) -> tuple[float, float]:
    """What a ``window``-token window costs (NLL rise) at positions >= seq // 2 of held-out windows: without and with
    the first position kept."""
    wins = windows(load_data()[2], T=seq, bos=bos)[:16]
    late = seq // 2
    full = float(position_nll(model, wins, start=late).mean())
    return tuple(float(position_nll(model, wins, start=late, window=window, sinks=s).mean()) - full for s in (0, 1))


def run_arm(name: str, out: Path, args) -> None:
    meta = loop.train(out / name, steps=args.steps, config=toy_config(args.family, args.seq), batch=16,
                      seq_len=args.seq, eval_every=args.every, progress=False, copy_phase=0.0, mlp_off=0.0,
                      curriculum=False, copy_share=0.0, threads=1, family=args.family, **ARMS[name])
    model = meta["_model"]
    trail = [row.get("sink_max") for row in loop_log(out / name)]
    wins = windows(load_data()[2], T=args.seq, bos=ARMS[name]["bos"])[:8, :-1]
    shares = attention_on_first(model, wins, from_pos=min(64, args.seq // 2))
    w0, w1 = window_costs(model, args.seq, ARMS[name]["bos"], args.window)
    print(f"{name}: held-out NLL {meta['heldout_nll']:.3f}; most on position 0 along the way: "
          f"{' '.join(str(s) for s in trail)}")
    print("  per layer and head: " + " | ".join(" ".join(f"{h:.3f}" for h in layer) for layer in shares))
    print(f"  window {args.window}: +{w0:.3f} nats without the first position, +{w1:.3f} with it", flush=True)


def loop_log(folder: Path) -> list[dict]:
    import csv

    with open(folder / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--out", default=None, help="keep each arm's checkpoint under DIR/<arm> (default: a temp folder)")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not 2 <= args.seq <= 1024 or args.steps < 1 or args.every < 1 or not 1 <= args.window < args.seq:
        p.error(f"arms {bad} unknown (use {', '.join(ARMS)})" if bad else
                "--seq 2 .. 1024, --steps and --every >= 1, --window 1 .. seq - 1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        for name in arms:
            run_arm(name, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Retrieval from far back in held-out text, on a shipped checkpoint or on a training run in progress: the far copy, a
needle at each of 10 depths and 16 key-value pairs, as ``python -m harness.train --evaluate`` measures them
(``harness.train.targets.far_retrieval``), without the rest of the evaluation. On a training state (``--state``) the
model is the compact one training holds (its vocabulary the training split's ids), read in that vocabulary: what the
retrain of issue 66 is watched by, every few hundred steps, before its export.

    .venv/bin/python scripts/probes/recall_probe.py --weights models/weights/mini          # ~10 s
    .venv/bin/python scripts/probes/recall_probe.py --state outputs/train/mini-66a/train_state.pt
    .venv/bin/python scripts/probes/recall_probe.py --weights models/weights/mini --misses   # and what the needles miss

Prints one JSON line: the step (a state's), each figure with its n and 95% t-interval, and the needles by depth.
``--misses`` adds, per depth, the needles' missed value ids (of recipe.NEEDLE_K x 8), how many of them were the
value's first id, and how many were predicted as one of the FREQUENT most frequent ids of the training text (a
word's prior winning over the copy): ``needle_misses``.
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

from harness.train.corpus import TrainingData  # noqa: E402
from harness.train.model import compact_model  # noqa: E402
from harness.core.copying import top1  # noqa: E402
from harness.train.recipe import EVAL_LEN, EVAL_TOKENS  # noqa: E402
from harness.train.targets import far_retrieval, needle_probes  # noqa: E402
from models.families import load_model  # noqa: E402
from models.gpt2 import GPT2Config  # noqa: E402
from models.hf_checkpoint import first_token  # noqa: E402
from models.llama import LlamaConfig  # noqa: E402

CONFIGS = {"gpt2": GPT2Config, "llama": LlamaConfig}
FREQUENT = 20  # --misses: a missed id predicted as one of the training text's FREQUENT most frequent ids


@torch.no_grad()
def needle_misses(model, held: torch.Tensor, ids: torch.Tensor, frequent: torch.Tensor, bos, seed: int = 0) -> list:
    """Per needle depth (the targets' own needles, ``targets.needle_probes``), [missed value ids, of them the value's
    first id, of them predicted as one of ``frequent``]."""
    out = []
    for probes in needle_probes(held, ids, seed, bos)[1]:
        x = torch.stack([p.seq for p in probes])
        at = torch.tensor(probes[0].scored)  # the same positions in every probe of one length
        pred = top1(model.eval(), x, int(at[0]) - 1, int(at[-1]))  # the ids predicted for the value's positions
        missed = pred != x[:, at]
        out.append([int(missed.sum()), int(missed[:, 0].sum()), int((missed & torch.isin(pred, frequent)).sum())])
    return out


def from_state(path: Path, data: TrainingData):
    """(the compact model of a training state, the step, its first token's compact id or None)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    settings = state["settings"]
    cfg = CONFIGS[settings.get("family", "gpt2")](**settings["config"])
    model = compact_model(cfg, len(data.vocab) + 1, settings["init_std"], n_full=cfg.vocab_size)
    model.load_state_dict(state["model"])
    return model.eval(), int(state["step"]), data.eot if settings.get("bos") else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--weights", help="a checkpoint folder (full vocabulary), e.g. models/weights/mini")
    g.add_argument("--state", help="a training state, DIR/train_state.pt (the compact model)")
    p.add_argument("--misses", action="store_true",
                   help="also each depth's missed value ids: [missed, of them the first, of them one of the "
                        f"{FREQUENT} most frequent ids of the training text]")
    a = p.parse_args(argv)
    data = TrainingData(EVAL_LEN, EVAL_TOKENS)
    if a.state:
        model, step, bos = from_state(Path(a.state), data)
        held, ids = data.remap[data.held_stream], data.copy_ids(full=False)
    else:
        model, step, bos = load_model(a.weights).eval(), None, first_token(a.weights)
        held, ids = data.held_stream, data.copy_ids(full=True)
    r = far_retrieval(model, held, ids, bos=bos)
    extra = {}
    if a.misses:
        frequent = torch.bincount(data.train_stream).topk(FREQUENT).indices
        frequent = data.remap[frequent] if a.state else frequent
        extra["needle_misses"] = needle_misses(model, held, ids, frequent, bos)
    print(json.dumps({"source": a.state or a.weights, "step": step, **r["retrieval"],
                      "needle_depths": r["needle_depths"], **extra}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

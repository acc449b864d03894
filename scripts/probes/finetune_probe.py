"""Is the text-id copy a matter of what the rows train, or of what the model can hold? Continue training a shipped
checkpoint for a few hundred steps at the recipe's final learning rate on one of two mixes, and measure the copy
targets of ids the held-out text uses (``copy100_after800_text``, ``copy500_text``) along the way:

- ``mix``: the recipe's own mix (``rows.make_batch`` as the checkpoint's record says): the control, more of the same;
- ``tail``: the same rows, but each key-value recall row's questions are followed by text of a length uniform in
  0 .. ``--tail`` x the row (``rows.recall_rows``' ``tail``), so a row's last positions are not always questions:
  whether the mini's needle edge (it cannot copy from its last 56 positions) is taught by questions that always sit
  at the end of a row; measured by the needle target's depth 0.95 and a needle at position 968 (``needle_edge``);
- ``textspans``: the same rows, but every random span (planted copies, far copies, key-value pairs, deep copies) is
  drawn from the vocabulary of a stretch of training text (``rows.window_vocab_ids``) instead of from every id, with
  the chance ``--text-share`` (``rows.span_draw``, training's ``--text-spans``): copies of ids that look like words,
  at every distance.

If the control stays put and ``textspans`` moves, the rows are the lever (a recipe change); if neither moves, the
model's size is. Training is in the compact vocabulary of the training split (the full checkpoint's embedding rows
gathered), as ``harness.train`` trains.

    .venv/bin/python scripts/probes/finetune_probe.py --weights models/weights/mini-llama --rows textspans --steps 200

Prints one JSON line per evaluation: the step, the held-out NLL on 16 windows and the copy accuracies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.common.stats import mean_interval  # noqa: E402
from harness.core import recall  # noqa: E402
from harness.core.copying import model_copy_accuracy  # noqa: E402
from harness.train import rows  # noqa: E402
from harness.train.corpus import TrainingData, windows  # noqa: E402
from harness.train.model import hidden, make_optimizer  # noqa: E402
from harness.train.targets import needle_probes  # noqa: E402
from harness.train.recipe import EOT, EVAL_LEN, EVAL_TOKENS, IGNORE, MIN_LR_FRAC, PEAK_LR  # noqa: E402
from models.families import load_model  # noqa: E402
from models.hf_checkpoint import first_token  # noqa: E402


def measure(model, held, bos, data) -> dict:
    pool = torch.unique(held[held != EOT])
    model.eval()
    out = {}
    with torch.no_grad():
        out["copy100_after800_text"] = model_copy_accuracy(model, pool, 100, k=8, seed=900, after=800, bos=bos,
                                                           batch=4).second
        out["copy500_text"] = model_copy_accuracy(model, pool, 500, k=8, seed=500, bos=bos, batch=4).second
        out["copy100_after800"] = model_copy_accuracy(model, data.copy_ids(full=True), 100, k=8, seed=900,
                                                      after=800, bos=bos, batch=4).second
        ids = data.copy_ids(full=True)
        depth95 = needle_probes(held, ids, bos=bos)[1][-1]  # the target's own needles at its last depth, 0.95
        edge = [recall.needle(held, ids, 1000, 1.0, 61_000 + i, bos) for i in range(64)]
        out["needle_depth95"] = mean_interval(recall.accuracy(model, depth95))[0]
        out["needle_edge968"] = mean_interval(recall.accuracy(model, edge))[0]
        wins = windows(held, 16 * EVAL_LEN, T=EVAL_LEN, bos=bos is not None)
        logits = torch.cat([model(wins[i:i + 4, :-1]) for i in range(0, len(wins), 4)])
        out["heldout_nll16"] = float(F.cross_entropy(logits[:, 1:].reshape(-1, logits.size(-1)),
                                                     wins[:, 2:].reshape(-1)))
    model.train()
    return {k: round(v, 4) for k, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True)
    p.add_argument("--rows", choices=("mix", "tail", "textspans"), required=True)
    p.add_argument("--tail", type=float, default=0.25, help="with --rows tail: the text after the questions, at most "
                   "this share of the row (default 0.25)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--text-share", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=PEAK_LR * MIN_LR_FRAC)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_model(a.weights).float()
    rec = json.loads((Path(a.weights) / "config.json").read_text())["kvlab_train"]
    bos_full = first_token(a.weights)
    data = TrainingData(EVAL_LEN, EVAL_TOKENS)
    held = data.held_stream
    gen = torch.Generator().manual_seed(a.seed)
    opt = make_optimizer(model, a.lr, rec.get("weight_decay", 0.1))
    vocab = data.vocab
    t0 = time.time()
    print(json.dumps(dict(step=0, rows=a.rows, **measure(model, held, bos_full, data))), flush=True)
    for step in range(1, a.steps + 1):
        x, y = rows.make_batch(data.ctrain, rec["batch"], rec["seq_len"] - 1, rec["copy_share"], len(vocab),
                               data.eot, gen, rec["placed_share"], far_share=rec["far_share"],
                               deep_draw=rec.get("deep_draw", "window"),
                               text_spans=a.text_share if a.rows == "textspans" else rec.get("text_spans", 0.0),
                               needle_share=rec.get("needle_share", rows.NEEDLE_SHARE),
                               tail=a.tail if a.rows == "tail" else 0.0)
        x, y = rows.with_bos(x, y, data.eot)
        h = hidden(model, vocab[x])
        trained = y != IGNORE
        w = model.get_input_embeddings().weight[vocab]  # the compact projection: the training split's ids
        logits = model.final_norm(h[trained]) @ w.T
        loss = F.cross_entropy(logits, y[trained])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % a.every == 0 or step == a.steps:
            print(json.dumps(dict(step=step, rows=a.rows, loss=round(loss.item(), 4),
                                  s_per_step=round((time.time() - t0) / step, 2),
                                  **measure(model, held, bos_full, data))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Why the evicting kinds score as they do on a shipped reference model: where each keeps its slots, and how far
each drifts from fp32 full attention along a text.

    .venv/bin/python scripts/probes/eviction_probe.py                        # budget 128 (docs/cache-kinds.md reads it)
    .venv/bin/python scripts/probes/eviction_probe.py --model mini-llama --texts 4
    .venv/bin/python scripts/probes/eviction_probe.py --budget 256 --texts 2 --cache window:budget=256,sinks=24

Each held-out text of the model (1,024 tokens, led by the token the checkpoint was trained to see first, as a run's
texts are) is teacher-forced through each cache after a 32-token prompt, as the
text-drift measurement does. Printed per cache: where its kept positions lie after the last token (median, the
share before position 256 and the share among the newest ``budget``), and the mean KL(fp32 full ‖ cache) in bands of
positions. Kept positions are only had from an evicting kind (``kept_positions``); others print the KL alone.
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

from harness.tools.bench import parse_kind  # noqa: E402
from harness.core.engines import KvlabEngine  # noqa: E402
from harness.core.inputs import led, text_prompts  # noqa: E402
from models.families import load_model  # noqa: E402
from models.hf_checkpoint import first_token  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402

WEIGHTS = Path(__file__).resolve().parents[2] / "models" / "weights"
BANDS = [(0, 128), (128, 256), (256, 512), (512, 768), (768, 1023)]
PROMPT = 32


def drift_along(engine: KvlabEngine, spec, seq: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, object]:
    """KL(ref ‖ cache) at every position (L - 1,), and the cache after the text."""
    cache = spec.new(engine, seq.shape[1])
    logits = [engine.prefill(seq[:, :PROMPT], cache)[0]]
    for i in range(PROMPT, seq.shape[1] - 1):
        logits.append(engine.decode(seq[:, i:i + 1], cache)[0])
    lp = torch.log_softmax(torch.cat(logits).float(), -1)  # (L - 1, vocab)
    return (ref.exp() * (ref - lp)).sum(-1), cache


def where_kept(cache, budget: int, last: int) -> str:
    if not getattr(cache, "evicts", False):
        return ""
    pos = torch.stack([cache.kept_positions(layer) for layer in range(cache.n_layer)])  # (L, B, nh, slots)
    p = pos[pos >= 0].float()
    return (f" · kept: median position {p.median():.0f}, {(p < 256).float().mean():.0%} before 256, "
            f"{(p > last - budget).float().mean():.0%} among the newest {budget}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mini", choices=["mini", "mini-llama"], help="a shipped reference model")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--texts", type=int, default=1, help="held-out texts of 1,024 tokens")
    ap.add_argument("--cache", action="append", metavar="KIND[:OPT=V,...]",
                    help="a cache to probe (repeatable); default: h2o (recent 8), tova, random and snapkv at "
                         "--budget, and window at --budget with 4 and with 24 sinks")
    args = ap.parse_args(argv)
    if args.budget < 2 or args.budget > 1023 or args.texts < 1:
        ap.error(f"--budget must be 2 .. 1023 and --texts >= 1 (got {args.budget}, {args.texts})")
    b = args.budget
    kinds = args.cache or [f"h2o:budget={b},recent=8", f"tova:budget={b}", f"random:budget={b}",
                           f"snapkv:budget={b}", f"window:budget={b},sinks=4", f"window:budget={b},sinks=24"]
    try:
        specs = [parse_kind(k) for k in kinds]
    except ValueError as e:
        ap.error(str(e))
    torch.set_grad_enabled(False)
    folder = WEIGHTS / args.model
    if not (folder / "config.json").is_file():
        ap.error(f"no checkpoint in {folder}: build it with python -m harness.train --out {folder}")
    engine = KvlabEngine(load_model(folder).float().eval())
    first = first_token(folder)
    texts = [t if first is None else led(t, first)
             for t in text_prompts(folder / "heldout.txt", args.texts, 1024, Tokenizer())]
    for n, seq in enumerate(texts):
        ref = torch.log_softmax(engine.forward(seq)[0, :-1].float(), -1)
        print(f"text {n}: {seq.shape[1]} tokens, prompt {PROMPT}; KL(fp32 full || cache) by positions "
              + ", ".join(f"{a}-{z - 1}" for a, z in BANDS))
        for spec in specs:
            kl, cache = drift_along(engine, spec, seq, ref)
            bands = " ".join(f"{kl[a:z].mean():.3f}" for a, z in BANDS)
            print(f"  {spec.label:<34} mean {kl.mean():.3f} | {bands}{where_kept(cache, b, seq.shape[1] - 2)}")


if __name__ == "__main__":
    main()

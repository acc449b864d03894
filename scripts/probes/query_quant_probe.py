"""Why llama.cpp's q8_0 K cache moves a model's outputs more than kvlab's blocks of the same codes: llama.cpp's CPU dot
product of a q8_0 K row with the query first quantises the query to q8_0 blocks too (its ``vec_dot_type``), while
kvlab's quant cache dequantises K and multiplies by the query in full precision. This probe quantises, inside every
attention of a full forward, K alone to llama.cpp's symmetric blocks (per token, groups of 32 channels: what
``cache=quant cache.scheme=symmetric cache.k_axis=token cache.quantize=k`` stores, each token's K on its own), then
K and the query both (the query in q8_0 blocks whatever K's bits: what llama.cpp does for q4_0 rows too), and
scores each against the fp32 forward on the same texts: mean KL (fp32 || arm) over every position, and the second
arm over the first with a paired t-interval over the texts (``harness.analysis.intervals``). The texts are the ones
a run of paper_kv_types on the model scores (drawn from across its held-out chapters, each led by its first token). What
docs/papers.md's "kvlab's blocks beside llama.cpp's own q8_0" reads.

    .venv/bin/python scripts/probes/query_quant_probe.py [--weights models/weights/mini-llama] [--texts 30]
        [--length 512] [--bits 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import models.gpt2  # noqa: E402
import models.llama  # noqa: E402
from harness.analysis import intervals  # noqa: E402
from harness.core.inputs import disjoint_texts, led  # noqa: E402
from models.families import load_model  # noqa: E402
from models.hf_checkpoint import first_token  # noqa: E402
from models.kv_cache.quant import offset, quantize_symmetric  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GROUP = 32  # llama.cpp's block: 32 values along the head dimension, a scale each


def blocks(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (..., hs) through llama.cpp's symmetric blocks of 32 along its last dimension and back."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
    q, scale = quantize_symmetric(g, bits, -1)
    return ((q.float() - offset(bits)) * scale.float()).reshape(shape).to(x.dtype)  # stored q + N -> q * scale


def quantised_attend(bits: int, query: bool):
    """models.attention.attend with K through ``bits``-bit blocks (and the query, if ``query``, through 8-bit ones:
    llama.cpp's vec_dot_type is q8_0 for its q8_0 and q4_0 rows alike) first."""
    from models.attention import attend

    def attend_q(q, k, v, cache=None, layer=0, mask=None):
        return attend(blocks(q, 8) if query else q, blocks(k, bits), v, cache, layer, mask)
    return attend_q


@torch.no_grad()
def kl_rows(model, texts: list[torch.Tensor], arm: str, bits: int) -> pd.DataFrame:
    """One row per scored position: text id and KL(fp32 || the arm's forward)."""
    rows = []
    originals = (models.gpt2.attend, models.llama.attend)
    for i, x in enumerate(texts):
        ref = F.log_softmax(model(x).float(), -1)
        try:
            models.gpt2.attend = models.llama.attend = quantised_attend(bits, arm == "K and query")
            got = F.log_softmax(model(x).float(), -1)
        finally:
            models.gpt2.attend, models.llama.attend = originals
        kl = (ref.exp() * (ref - got)).sum(-1)[0]
        rows += [dict(text=f"t{i:03d}", kl=float(v)) for v in kl]
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=str(REPO / "models" / "weights" / "mini-llama"))
    ap.add_argument("--texts", type=int, default=30, help="disjoint held-out texts (default 30, paper_kv_types')")
    ap.add_argument("--length", type=int, default=512, help="tokens a text (default 512)")
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4), help="8: q8_0 (default); 4: q4_0's rule")
    a = ap.parse_args(argv)
    folder = Path(a.weights)
    model = load_model(folder).eval()
    if model.config.n_embd // model.config.n_head % GROUP:
        ap.error(f"the head size {model.config.n_embd // model.config.n_head} is not a multiple of {GROUP}")
    bos = first_token(folder)  # the texts a run on this model scores: joined with it, each led by it
    texts = disjoint_texts(folder / "heldout.txt", a.texts, a.length, Tokenizer(), sep=bos).texts
    texts = texts if bos is None else [led(t, bos) for t in texts]
    arms = {arm: kl_rows(model, texts, arm, a.bits) for arm in ("K", "K and query")}
    for arm, rows in arms.items():
        query = ", the query in q8_0" if arm != "K" else ""
        print(f"{arm} (K in q{a.bits}_0 blocks{query}): mean KL {rows.kl.mean():.3g} over {len(texts)} texts of "
              f"{a.length}")
    iv = intervals.compare(arms["K and query"], arms["K"], "kl", "mean", "ratio", unit="text")
    print(f"K and query over K alone: {iv.estimate:.3g}x [{iv.lo:.3g}, {iv.hi:.3g}] (paired 95% t-interval over "
          f"{iv.n} texts)")


if __name__ == "__main__":
    main()

"""Each K/V head's retrieval score, the input of ``cache=duo`` (``cache.heads=FILE``).

    python -m harness.heads --model mini --out heads.csv          # a preset (shipped weights where there are some)
    python -m harness.heads --model path/to/checkpoint --out heads.csv --n 64 --k 16

A retrieval head, as Wu et al. (arXiv 2404.15574) define one, copies: while the model reproduces a span it has seen,
the key the head attends to most is the token being produced. Here each of ``k`` sequences is ``n`` random ids the
model tells apart, shown twice (``harness.core.copying.copy_sequences``), behind the model's fixed first token if it
was trained with one; at every query of the second showing, a head *copies* when its most-attended key lies in the
first showing and holds the token the sequence continues with. A head's score on a sequence is the share of such
steps; the figure is its mean over the ``k`` sequences, with a 95% t-interval over them. A K/V head shared by several
query heads scores the mean of its group's. The CSV has one row per layer and K/V head (``layer, kv_head, score, lo,
hi, n``); a PNG beside it draws the scores by layer and head.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from harness.common.ownership import atomic_write
from harness.common.stats import mean_interval

COLUMNS = ("layer", "kv_head", "score", "lo", "hi", "n")
MAX_N, MAX_K = 4096, 1000


def load(name_or_folder: str):
    """(model, first token or None, what it is): a checkpoint folder, a preset with shipped weights
    (models/weights/NAME), or a preset's seeded initialisation (said so)."""
    from models import families
    from models.hf_checkpoint import first_token

    folder = Path(name_or_folder)
    shipped = Path(__file__).resolve().parents[2] / "models" / "weights" / name_or_folder
    for f in (folder, shipped):
        if (f / "config.json").is_file():
            return families.load_model(f).eval(), first_token(f), str(f)
    torch.manual_seed(0)
    cfg = families.preset_config(name_or_folder)  # an unknown name is refused here, in one line
    return families.build(cfg).eval(), None, f"preset {name_or_folder}, seeded initialisation (no weights)"


@torch.no_grad()
def score_heads(model, n: int = 64, k: int = 16, seed: int = 0, bos: int | None = None):
    """The per-head table (``COLUMNS``) on ``k`` copy sequences of ``n`` ids each."""
    import pandas as pd

    from harness.core import copying
    from harness.train.targets import attention_probs

    cfg = model.config
    ids = copying.distinct_ids(model)
    if bos is not None:
        ids = ids[ids != bos]
    lead = int(bos is not None)
    n_kv = getattr(cfg, "n_kv_head", None) or cfg.n_head
    per = [[[] for _ in range(n_kv)] for _ in range(cfg.n_layer)]  # per layer and K/V head, a score per sequence
    for seq in copying.copy_sequences(ids, n, k, seed):
        if lead:
            seq = torch.cat([seq.new_full((1, 1), bos), seq], 1)
        probs = attention_probs(model, seq)  # per layer (1, n_head, T, T)
        queries = torch.arange(lead + n, lead + 2 * n - 1)  # each predicts the next token of the second showing
        target = seq[0, queries + 1]
        for layer, p in enumerate(probs):
            top = p[0, :, queries].argmax(-1)  # (n_head, steps): each query's most-attended key
            hit = (top >= lead) & (top < lead + n) & (seq[0, top] == target)  # in the first showing, the token
            share = hit.float().mean(-1).view(n_kv, -1).mean(-1)  # per K/V head: its group's mean
            for h in range(n_kv):
                per[layer][h].append(float(share[h]))
    rows = []
    for layer in range(cfg.n_layer):
        for h in range(n_kv):
            mean, lo, hi, count = mean_interval(per[layer][h])  # a share: its interval cut to [0, 1]
            rows.append(dict(layer=layer, kv_head=h, score=mean, lo=max(lo, 0.0), hi=min(hi, 1.0), n=count))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def figure(table, title: str):
    """The scores as a layer x K/V head grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = table.pivot(index="layer", columns="kv_head", values="score")
    fig, ax = plt.subplots(figsize=(1.2 + 0.5 * grid.shape[1], 1.0 + 0.4 * grid.shape[0]))
    im = ax.imshow(grid.values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xlabel("K/V head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(grid.shape[1]))
    ax.set_yticks(range(grid.shape[0]))
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="retrieval score")
    return fig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.heads", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model preset (mini, mini-llama, ...) or a checkpoint folder")
    p.add_argument("--out", required=True, help="the CSV to write (a PNG of the scores is written beside it)")
    p.add_argument("--n", type=int, default=64, help="ids per copied span (default 64)")
    p.add_argument("--k", type=int, default=16, help="copy sequences (default 16): the n of each head's interval")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = _checked_out(args)
        model, bos, what = load(args.model)
        if 2 * args.n + int(bos is not None) > model.config.n_positions:
            raise ValueError(f"--n {args.n}: two showings need {2 * args.n} positions and the model has "
                             f"{model.config.n_positions:,}; lower --n")
    except ValueError as e:
        print(f"heads: error: {e}", file=sys.stderr)
        return 2
    table = score_heads(model, args.n, args.k, args.seed, bos)
    atomic_write(out, table.to_csv(index=False, float_format="%.4f").encode())
    png = out.with_suffix(".png")
    atomic_write(png, _png(figure(table, f"{args.model}: retrieval score ({args.k} x {args.n}-id copies)")))
    print(f"heads: {what}; {len(table)} K/V heads scored on {args.k} copies of {args.n} ids -> {out} and {png}")
    print(table.sort_values("score", ascending=False).head(8).to_string(index=False))
    return 0


def _checked_out(args) -> Path:
    """--out, refused in one line unless it is a .csv that does not exist or is a heads file kvlab wrote (its
    first line is COLUMNS), with sizes in range."""
    out = Path(args.out)
    if out.suffix != ".csv":
        raise ValueError(f"--out {args.out}: give a .csv path (the figure goes beside it as .png)")
    if not 1 <= args.k <= MAX_K or not 2 <= args.n <= MAX_N:
        raise ValueError(f"--n {args.n} --k {args.k}: give 2 <= n <= {MAX_N} and 1 <= k <= {MAX_K}")
    for f in (out, out.with_suffix(".png")):
        if f.exists() and not _ours(out):
            raise ValueError(f"--out {args.out}: {f} exists and is not a heads file kvlab wrote; give another --out")
    return out


def _ours(csv_path: Path) -> bool:
    try:
        with csv_path.open("rb") as f:
            return f.readline(256).decode(errors="replace").strip() == ",".join(COLUMNS)
    except OSError:
        return False


def _png(fig) -> bytes:
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


if __name__ == "__main__":
    sys.exit(main())

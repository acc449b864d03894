"""Each K/V head's retrieval score, the input of ``cache=duo`` (``cache.heads=FILE``).

    python -m harness.heads --model mini --out heads.csv          # a preset (shipped weights where there are some)
    python -m harness.heads --model path/to/checkpoint --out heads.csv --n 64 --k 16

Two definitions, on the same copy sequences: each of ``k`` sequences is ``n`` random ids the model tells apart, shown
twice (``harness.core.copying.copy_sequences``), behind the model's fixed first token if it was trained with one.

- ``--method attention`` (the default): a retrieval head, as Wu et al. (arXiv 2404.15574) define one, copies: at
  every query of the second showing, the head's most-attended key lies in the first showing and holds the token the
  sequence continues with. A head's score on a sequence is the share of such steps. A K/V head shared by several
  query heads scores the mean of its group's.
- ``--method streaming``: DuoAttention's definition (Xiao et al., arXiv 2410.10819: retrieval heads are those that
  "significantly alter model outputs when restricted to recent tokens and attention sinks"), measured head by head
  rather than by training gates: a K/V head's score on a sequence is the copy accuracy (top-1 on the second showing)
  at full attention minus the accuracy when that head alone (all its query heads) sees only the first ``sinks`` and
  the ``recent`` newest positions. The span lies beyond that reach (``n`` > sinks + recent), so a head the copy
  needs loses it. A model whose copy circuit attends somewhere other than the copied token (mini-llama's reads it
  through a fixed positional offset) scores no head by the first definition and its copy heads by this one.

Each figure is the mean over the ``k`` sequences, with a 95% t-interval over them. The CSV has one row per layer and
K/V head (``layer, kv_head, score, lo, hi, n, method``); a PNG beside it draws the scores by layer and head.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from harness.common.ownership import atomic_write
from harness.common.stats import mean_interval

COLUMNS = ("layer", "kv_head", "score", "lo", "hi", "n", "method")
METHODS = ("attention", "streaming")
SINKS, RECENT = 16, 64  # --method streaming: what a streaming head keeps (cache=duo's defaults)
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
    """The per-head table (``COLUMNS``) by Wu et al.'s definition, on ``k`` copy sequences of ``n`` ids each."""
    from harness.core import copying
    from harness.train.targets import attention_probs

    cfg = model.config
    ids = copying.distinct_ids(model)
    if bos is not None:
        ids = ids[ids != bos]
    lead = int(bos is not None)
    n_kv = _kv_heads(cfg)
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
    return _table(per, "attention", 0.0)


def _table(per: list, method: str, low: float):
    """The CSV's rows from per[layer][kv_head] = a score per sequence: mean and 95% t-interval, cut to [low, 1]."""
    import pandas as pd

    rows = []
    for layer, heads in enumerate(per):
        for h, scores in enumerate(heads):
            mean, lo, hi, count = mean_interval(scores)
            rows.append(dict(layer=layer, kv_head=h, score=mean, lo=max(lo, low), hi=min(hi, 1.0), n=count,
                             method=method))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _kv_heads(cfg) -> int:
    return getattr(cfg, "n_kv_head", None) or cfg.n_head


def _streaming_head(layer: int, kv_head: int, sinks: int, recent: int):
    """Inside: in every uncached forward, layer ``layer``'s query heads that share K/V head ``kv_head`` attend only
    to the first ``sinks`` and the ``recent`` newest positions (causal); every other head as before."""
    from harness.train.targets import attention_replaced

    def make(real):
        def streaming(q, k, v, cache=None, at=0, mask=None):
            if cache is not None or mask is not None or at != layer:
                return real(q, k, v, cache, at, mask)
            T, groups = q.size(2), q.size(1) // k.size(1)
            i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
            causal = j <= i
            see = causal.expand(q.size(1), T, T).clone()
            see[kv_head * groups:(kv_head + 1) * groups] = causal & ((j < sinks) | (i - j < recent))
            kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            att = (q @ kk.transpose(-1, -2)) / math.sqrt(q.size(-1))
            return att.masked_fill(~see, float("-inf")).softmax(-1) @ vv
        return streaming
    return attention_replaced(make)


@torch.no_grad()
def streaming_scores(model, n: int = 256, k: int = 16, seed: int = 0, bos: int | None = None,
                     sinks: int = SINKS, recent: int = RECENT):
    """The per-head table (``COLUMNS``) by DuoAttention's definition: copy accuracy lost when one K/V head keeps
    only ``sinks`` + ``recent`` positions, on ``k`` copy sequences of ``n`` ids each (n > sinks + recent)."""
    from harness.core import copying

    cfg = model.config
    ids = copying.distinct_ids(model)
    if bos is not None:
        ids = ids[ids != bos]
    lead = int(bos is not None)
    per = [[[] for _ in range(_kv_heads(cfg))] for _ in range(cfg.n_layer)]
    queries = torch.arange(lead + n, lead + 2 * n - 1)  # each predicts the next token of the second showing
    for seq in copying.copy_sequences(ids, n, k, seed):
        if lead:
            seq = torch.cat([seq.new_full((1, 1), bos), seq], 1)
        target = seq[0, queries + 1]
        full = float((model(seq)[0, queries].argmax(-1) == target).float().mean())
        for layer, heads in enumerate(per):
            for h, scores in enumerate(heads):
                with _streaming_head(layer, h, sinks, recent):
                    acc = float((model(seq)[0, queries].argmax(-1) == target).float().mean())
                scores.append(full - acc)
    return _table(per, "streaming", -1.0)


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
    p.add_argument("--method", choices=METHODS, default="attention",
                   help="attention: Wu et al.'s retrieval score (the most-attended key is the copied token); "
                        "streaming: DuoAttention's, the copy accuracy lost when the head alone keeps only --sinks "
                        "and --recent positions (default attention)")
    p.add_argument("--n", type=int, default=None,
                   help="ids per copied span (default 64; with --method streaming 256, beyond a streaming head's "
                        "reach)")
    p.add_argument("--sinks", type=int, default=SINKS, help=f"--method streaming: first positions kept ({SINKS})")
    p.add_argument("--recent", type=int, default=RECENT, help=f"--method streaming: newest positions kept ({RECENT})")
    p.add_argument("--k", type=int, default=16, help="copy sequences (default 16): the n of each head's interval")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.n is None:
        args.n = 256 if args.method == "streaming" else 64
    try:
        out = _checked_out(args)
        model, bos, what = load(args.model)
        if 2 * args.n + int(bos is not None) > model.config.n_positions:
            raise ValueError(f"--n {args.n}: two showings need {2 * args.n} positions and the model has "
                             f"{model.config.n_positions:,}; lower --n")
    except ValueError as e:
        print(f"heads: error: {e}", file=sys.stderr)
        return 2
    if args.method == "streaming":
        table = streaming_scores(model, args.n, args.k, args.seed, bos, args.sinks, args.recent)
        how = f"copy accuracy lost as a streaming head ({args.sinks} sinks + {args.recent} recent)"
    else:
        table = score_heads(model, args.n, args.k, args.seed, bos)
        how = "retrieval score"
    atomic_write(out, table.to_csv(index=False, float_format="%.4f").encode())
    png = out.with_suffix(".png")
    atomic_write(png, _png(figure(table, f"{args.model}: {how}\n({args.k} x {args.n}-id copies)")))
    print(f"heads: {what}; {len(table)} K/V heads scored ({how}) on {args.k} copies of {args.n} ids -> {out} and "
          f"{png}")
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
    if args.method == "streaming" and not (args.sinks >= 0 and args.recent >= 1 and args.n > args.sinks + args.recent):
        raise ValueError(f"--method streaming --n {args.n} --sinks {args.sinks} --recent {args.recent}: the span must "
                         "lie beyond a streaming head's reach (n > sinks + recent, sinks >= 0, recent >= 1)")
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

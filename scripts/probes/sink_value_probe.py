"""What a window's kept first tokens give: their value as context, or a place to park attention? On a shipped model,
texts as a run makes them (led by the first token), the text NLL of full attention and of a window of --window
tokens (the window cache kind's uncached reference, ``model(idx, window=W, sinks=S)``):

- ``window``: no sinks;
- ``sinks S``: the first S tokens kept;
- ``sinks S, values zeroed``: the first S tokens' keys kept, so attention still puts on them what it did, but what
  they return is zero for every query past them (the softmax is not renormalised: the share they draw is spent on
  nothing). Their own positions are untouched, so every later layer's keys and values are the model's.

If zeroing the values costs about what dropping the tokens costs, what the window lost was their value; if it costs
about nothing, it was a place to park attention. Printed: each arm's ΔNLL against full attention (nats/token,
mean over texts, 95% t-interval over texts) and the paired differences that decide.

    .venv/bin/python scripts/probes/sink_value_probe.py                      # the mini, 8 texts, window 64
    .venv/bin/python scripts/probes/sink_value_probe.py --model mini-llama --texts 8
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402

from harness.analysis.server import t_interval  # noqa: E402
from models import attention  # noqa: E402
from scripts.probes.kv_stats import attend_with, shipped  # noqa: E402

WEIGHTS = Path(__file__).resolve().parents[2] / "models" / "weights"


def zeroed_values(sinks: int):
    """An ``attention.attend`` whose uncached masked attention returns, for every query past the first ``sinks``
    positions, nothing from those positions' values (their probabilities kept, not renormalised)."""
    real = attention.attend

    def attend(q, k, v, cache=None, layer=0, mask=None):
        if cache is not None or mask is None:
            return real(q, k, v, cache, layer, mask)
        groups = q.size(1) // k.size(1)
        kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        att = (q @ kk.transpose(-1, -2)) / math.sqrt(q.size(-1))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        att[..., sinks:, :sinks] = 0.0  # the keys drew their share; their values give nothing back
        return (att @ vv).to(q.dtype)

    return attend


def nll(model, idx: torch.Tensor, attend=None, **window) -> float:
    """Mean next-token NLL of ``idx`` (1, T) in nats, with ``attend`` in place of the families' attention."""
    with attend_with(attend or attention.attend), torch.no_grad():
        logits = model(idx, **window)[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, idx[0, 1:]))


def interval(values: list[float]) -> str:
    m, lo, hi, n = t_interval(values)
    return f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]" if n > 1 else f"{m:+.3f} (n = 1: no interval)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mini", choices=["mini", "mini-llama"], help="a shipped reference model")
    p.add_argument("--texts", type=int, default=8, help="held-out texts of 1,024 tokens (default 8)")
    p.add_argument("--window", type=int, default=64, help="the window's recent tokens (default 64)")
    p.add_argument("--sinks", type=int, nargs="+", default=[1, 4], help="kept first tokens to try (default 1 4)")
    a = p.parse_args(argv)
    if a.texts < 2 or not 1 <= a.window < 1024 or any(not 1 <= s < a.window for s in a.sinks):
        p.error("give --texts >= 2, 1 <= --window < 1024 and 1 <= each --sinks < --window")
    folder = WEIGHTS / a.model
    model, first, texts = shipped(folder, a.texts)
    arms = {"window": lambda x: nll(model, x, window=a.window)}
    for s in a.sinks:
        arms[f"sinks {s}"] = lambda x, s=s: nll(model, x, window=a.window, sinks=s)
        arms[f"sinks {s}, values zeroed"] = lambda x, s=s: nll(model, x, zeroed_values(s), window=a.window, sinks=s)
    delta = {name: [] for name in arms}
    for x in texts:
        full = nll(model, x)
        for name, f in arms.items():
            delta[name].append(f(x) - full)
    print(f"{folder}: {a.texts} texts x 1024 tokens" + ("" if first is None else f", each led by {first}") +
          f"; window {a.window}; ΔNLL against full attention, nats/token, mean [95% t-interval over texts]")
    for name, d in delta.items():
        print(f"  {name:<26} {interval(d)}")
    for s in a.sinks:
        kept, zeroed, none = delta[f"sinks {s}"], delta[f"sinks {s}, values zeroed"], delta["window"]
        gap = [n - k for n, k in zip(none, kept)]
        lost = [z - k for z, k in zip(zeroed, kept)]
        print(f"  sinks {s}: what keeping them buys {interval(gap)}; zeroing their values (keys kept) costs "
              f"{interval(lost)}, {100 * sum(lost) / sum(gap):.0f}% of it (paired over the texts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

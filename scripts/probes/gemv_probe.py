"""Where a GPT-2-small decode step's projection time goes: each of its weight shapes as one row vector times the
weight (``F.linear``, batch 1), in the two memory layouts a weight can have ((out, in)-major, nn.Linear's own, and
(in, out)-major, what ``Decoder.store_weights_input_major`` gives a weight that widens), with the bias added by the
product or after it; ms per product (median of ``--repeats``, every variant in turns within a repeat) and the GB/s
that streaming the weight once takes. Then one whole decode step at depth ``--depth``: the model as built
(``store_weights_input_major``: (in, out)-major where a weight has at least as many outputs as inputs, the MLP's
down projection (out, in)-major), a copy with every block weight (in, out)-major (the layout before 2026-12-06), one
with every block weight (out, in)-major, and a plain copy of the model as built (the same layout in fresh memory:
how much placement alone moves a step). The tied embedding / output projection stays as built in each. What
docs/engine.md's "Where our eager step goes" follows up.

    .venv/bin/python scripts/probes/gemv_probe.py [--repeats 200] [--depth 960] [--steps 30]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.core.engines import KvlabEngine  # noqa: E402
from harness.tools.turns import prompt_and_token  # noqa: E402
from models.gpt2 import GPT2, GPT2Config  # noqa: E402

C = 768
SHAPES = {"c_attn": (3 * C, C), "attn.c_proj": (C, C), "c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C),
          "lm_head": (50257, C)}  # (out, in), as nn.Linear holds them


def variants(out: int, inp: int, g: torch.Generator) -> dict:
    """name -> a zero-argument product of one (1, 1, in) row with an (out, in) weight."""
    x = torch.randn(1, 1, inp, generator=g)
    w_out = torch.randn(out, inp, generator=g)  # (out, in)-major: each output's weights contiguous
    w_in = w_out.t().contiguous().t()  # the same values, (in, out)-major
    b = torch.randn(out, generator=g)
    return {"out-major, bias in": lambda: F.linear(x, w_out, b),
            "out-major, bias after": lambda: F.linear(x, w_out) + b,
            "in-major, bias in": lambda: F.linear(x, w_in, b), "in-major, bias after": lambda: F.linear(x, w_in) + b}


def in_turns(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each function, all of them called once per repeat, in turns (who goes first rotates)."""
    names = list(fns)
    for f in fns.values():  # warm
        f()
    times = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def output_major(model: nn.Module, only: str | None = None) -> nn.Module:
    """A copy of ``model`` with every block's projection weights (or only those whose name ends with ``only``) laid
    out (out, in)-major, nn.Linear's own layout (the tied embedding / output projection as built)."""
    m = copy.deepcopy(model)
    for name, module in m.named_modules():
        if isinstance(module, nn.Linear) and module is not m.lm_head and (only is None or name.endswith(only)):
            module.weight = nn.Parameter(module.weight.detach().contiguous())
    return m


def input_major(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every block's projection weights laid out (in, out)-major (before 2026-12-06, what
    ``store_weights_input_major`` did to every weight, the narrowing ones too)."""
    m = copy.deepcopy(model)
    for module in m.modules():
        if isinstance(module, nn.Linear) and module is not m.lm_head:
            module.weight = nn.Parameter(module.weight.detach().t().contiguous().t())
    return m


def step_times(depth: int, steps: int) -> dict[str, float]:
    """Median ms of one decode step at ``depth`` (batch 1, prealloc), the model as built against output-major
    blocks and against output-major MLP down projections alone."""
    torch.manual_seed(0)
    built = GPT2(GPT2Config()).eval()
    engines = {"as built": KvlabEngine(built), "every block weight in-major": KvlabEngine(input_major(built)),
               "every block weight out-major": KvlabEngine(output_major(built)),
               "as built, copied": KvlabEngine(output_major(built, "mlp.c_proj"))}
    prompt, token = prompt_and_token(built.config.vocab_size, depth, 0)
    fns = {}
    for name, e in engines.items():
        cache = e.new_cache("prealloc", max_len=depth + 1)
        e.prefill(prompt, cache)
        back = e.checkpoint(cache)

        def step(e=e, cache=cache, back=back):
            e.decode(token, cache)
            back()
        fns[name] = step
    with torch.no_grad():
        return in_turns(fns, steps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200, help="products timed per variant (default 200)")
    ap.add_argument("--depth", type=int, default=960, help="the whole step's context (default 960)")
    ap.add_argument("--steps", type=int, default=30, help="whole decode steps timed per layout (default 30)")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.steps < 1 or not 1 <= a.depth <= 1023:
        ap.error("--repeats and --steps must be >= 1 and --depth within 1 .. 1023 (GPT-2 small's positions)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per product (median of {a.repeats}), "
          "GB/s of the weight")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, (out, inp) in SHAPES.items():
            ms = in_turns(variants(out, inp, g), a.repeats)
            gb = out * inp * 4 / 1e9
            print(f"{name:<12} ({out:>5} x {inp:>4}): " + "  ".join(f"{v} {t:.3f} ms ({gb / t * 1e3:.1f} GB/s)"
                                                                    for v, t in ms.items()))
    steps = step_times(a.depth, a.steps)
    base = steps["as built"]
    print(f"whole decode step at depth {a.depth} (median of {a.steps}): " + "  ".join(
        f"{n} {t:.2f} ms ({t / base:.2f}x)" for n, t in steps.items()))


if __name__ == "__main__":
    main()

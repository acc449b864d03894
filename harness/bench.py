"""Decode-step benchmark: our engine vs HF transformers on the same weights, in one run.

    python -m harness.bench                      # gpt2 size, fp32, batch 1, contexts 32 and 512
    python -m harness.bench --model tiny --contexts 16 64 --repeats 20

For each context length and layout (ours ConcatKVCache vs HF DynamicCache; ours PreallocKVCache vs HF StaticCache)
both caches are prefilled with the same prompt; then each repeat times one decode step of each engine, alternating
which goes first, and rewinds the step, so every timed step runs at exactly that context. Prints the medians and
the ratio ours / HF measured in this run. The weights are a seeded random init (no pretrained weights needed: the
cost of a step does not depend on their values).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness.engines import HFEngine, KvlabEngine
from models.gpt2 import GPT2, GPT2Config, PRESETS


def time_steps(engines, layout: str, ctx: int, repeats: int, warmup: int, seed: int = 0) -> dict[str, list[float]]:
    """Per-engine decode-step times (seconds) at context ``ctx``; engines alternate within each repeat."""
    g = torch.Generator().manual_seed(seed)
    vocab = engines[0].model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, ctx), generator=g)
    token = torch.randint(0, vocab, (1, 1), generator=g)
    caches = []
    for e in engines:
        cache = e.new_cache(layout, max_len=ctx + 1)
        e.prefill(prompt, cache)
        caches.append(cache)
    times: dict[str, list[float]] = {e.name: [] for e in engines}
    for r in range(warmup + repeats):
        order = list(zip(engines, caches))
        if r % 2:
            order.reverse()
        for e, cache in order:
            t0 = time.perf_counter()
            e.decode(token, cache)
            dt = time.perf_counter() - t0
            e.rewind(cache, 1)
            if r >= warmup:
                times[e.name].append(dt)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", choices=sorted(PRESETS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = GPT2Config.preset(args.model)
    if args.repeats < 1 or args.warmup < 0:
        ap.error(f"--repeats must be >= 1 and --warmup >= 0 (got {args.repeats}, {args.warmup})")
    for ctx in args.contexts:
        if ctx < 1:
            ap.error(f"context {ctx}: contexts must be >= 1 token")
        if ctx + 1 > cfg.n_positions:
            ap.error(f"context {ctx} + 1 decode token exceeds n_positions {cfg.n_positions} of {args.model}")
    torch.manual_seed(args.seed)
    model = GPT2(cfg).eval()
    engines = [KvlabEngine(model), HFEngine(model)]
    print(f"model {args.model} (seeded random init, seed {args.seed}), fp32, batch 1, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} steps after {args.warmup} warm-up")
    print(f"{'context':>7}  {'layout':<9} {'kvlab ms':>9} {'HF ms':>9} {'HF cache':<13} {'kvlab/HF':>8}")
    hf_cache = {"concat": "DynamicCache", "prealloc": "StaticCache"}
    for ctx in args.contexts:
        for layout in ("concat", "prealloc"):
            t = time_steps(engines, layout, ctx, args.repeats, args.warmup, args.seed)
            ours, hf = statistics.median(t["kvlab"]) * 1e3, statistics.median(t["hf"]) * 1e3
            print(f"{ctx:>7}  {layout:<9} {ours:>9.2f} {hf:>9.2f} {hf_cache[layout]:<13} {ours / hf:>7.2f}x")


if __name__ == "__main__":
    main()

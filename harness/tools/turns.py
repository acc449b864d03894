"""Decode steps timed in turns, for the benchmarks (``harness.bench`` and its ``--peers``): the same prompt and next
token for every engine, each repeat one step of each in turn, each cache put back after its step."""

from __future__ import annotations

import time

import torch


def prompt_and_token(vocab: int, ctx: int, seed: int, batch: int = 1,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompt, token = torch.randint(0, vocab, (batch, ctx), generator=g), torch.randint(0, vocab, (batch, 1), generator=g)
    return prompt.to(device), token.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_in_turns(runners: list[tuple], token: torch.Tensor, repeats: int, warmup: int) -> dict[str, list[float]]:
    """``runners``: (label, engine, prefilled cache). Each repeat times one decode step of each in turn, starting one
    further along every repeat, and puts each cache back (``checkpoint``), so every step runs at the same context.
    Returns label -> seconds per step (after ``warmup`` repeats)."""
    backs = [engine.checkpoint(cache) for _, engine, cache in runners]
    times: dict[str, list[float]] = {label: [] for label, _, _ in runners}
    for r in range(warmup + repeats):
        for i in range(len(runners)):
            j = (r + i) % len(runners)
            label, engine, cache = runners[j]
            sync(token.device)
            t0 = time.perf_counter()
            engine.decode(token, cache)
            sync(token.device)
            dt = time.perf_counter() - t0
            backs[j]()
            if r >= warmup:
                times[label].append(dt)
    return times

"""Copying: random sequences shown twice, and how well a model copies the second copy (the retrieval measurement,
training's copy targets and the probes all use these)."""

from __future__ import annotations

import torch


def distinct_ids(model) -> torch.Tensor:
    """Token ids whose embedding row is unique (1-D, sorted)."""
    wte = (model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.transformer.wte).weight
    rows = wte.detach()[:, :16].float().cpu()  # 16 channels tell distinct rows apart; shared rows share them
    _, inverse, counts = torch.unique(rows, dim=0, return_inverse=True, return_counts=True)
    return torch.nonzero(counts[inverse] == 1)[:, 0]


def copy_sequences(ids: torch.Tensor, n: int, k: int, seed: int) -> list[torch.Tensor]:
    """k sequences (1, 2n): n random ids from ``ids`` (seeded), then the same n again."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        first = ids[torch.randint(0, len(ids), (n,), generator=g)]
        out.append(torch.cat([first, first]).unsqueeze(0))
    return out


def copy_accuracy(logits: torch.Tensor, seq: torch.Tensor, n: int) -> tuple[float, float]:
    """(second-copy, first-copy) top-1 accuracy from the logits (2n - 1, vocab) that predicted tokens 1 .. 2n - 1."""
    pred = logits.argmax(-1).cpu()
    target = seq[0, 1:].cpu()
    second = (pred[n - 1:] == target[n - 1:]).float().mean().item()
    first = (pred[:n - 1] == target[:n - 1]).float().mean().item() if n > 1 else float("nan")
    return second, first

"""What the Hadamard rotation does to a 4-bit K on a shipped model, block by block: the cause paper_rotation's verdicts
rest on. K as each layer hands it to attention (``kv_stats.attention_inputs``: a rotary K rotated by its positions
already), quantised as ``experiment=paper_rotation`` quantises it: per token, in blocks of 32 channels, llama.cpp's
symmetric q4_0 (``quantize_symmetric``), with and without ``rotate=hadamard`` first (an orthonormal rotation of the
head dimension, so errors compare in either basis). Per layer:

- block peak/RMS: a block's largest |x| over its RMS, median over blocks. q4_0's step is the block's largest value
  over 8, so a higher peak/RMS means coarser steps for the rest of the block; a rotation pulls it towards Gaussian
  noise's.
- K error: ||K - K̂|| / ||K|| over every block.
- score error: the RMS of q·(k - k̂) / sqrt(hs) over the layer's queries and their visible keys, over the RMS of the
  scores q·k / sqrt(hs): the error attention's logits see (the rotation is undone against q, so q·k is unchanged).

    .venv/bin/python scripts/probes/rotation_probe.py                       # the mini, 2 texts
    .venv/bin/python scripts/probes/rotation_probe.py --model mini-llama
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

from models.kv_cache.quant import SCALE_DTYPE, hadamard, offset, quantize_symmetric  # noqa: E402
from scripts.probes.kv_stats import attention_inputs, shipped  # noqa: E402

WEIGHTS = Path(__file__).resolve().parents[2] / "models" / "weights"
GROUP, BITS = 32, 4  # paper_rotation's blocks: q4_0 over 32 channels of a token


def q4_0(k: torch.Tensor) -> torch.Tensor:
    """``k`` (…, hs) quantised per token in blocks of GROUP channels, symmetric q4_0, and dequantised."""
    blocks = k.reshape(*k.shape[:-1], k.shape[-1] // GROUP, GROUP)
    q, scale = quantize_symmetric(blocks.float(), BITS, dim=-1)
    return ((q.float() - offset(BITS)) * scale.to(SCALE_DTYPE).float()).reshape(k.shape)


def peak_to_rms(k: torch.Tensor) -> float:
    blocks = k.reshape(*k.shape[:-1], k.shape[-1] // GROUP, GROUP)
    return float((blocks.abs().amax(-1) / blocks.pow(2).mean(-1).sqrt().clamp_min(1e-12)).median())


def score_error(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor) -> float:
    """RMS of the causal scores' error over the RMS of the scores (each query against the keys it sees)."""
    groups = q.size(1) // k.size(1)
    k, k_hat = k.repeat_interleave(groups, 1), k_hat.repeat_interleave(groups, 1)
    T, hs = q.size(2), q.size(-1)
    seen = torch.ones(T, T, dtype=torch.bool).tril()
    s, err = (q @ k.transpose(-1, -2)) / hs ** 0.5, (q @ (k - k_hat).transpose(-1, -2)) / hs ** 0.5
    return float(err[..., seen].pow(2).mean().sqrt() / s[..., seen].pow(2).mean().sqrt())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mini", choices=["mini", "mini-llama"], help="a shipped reference model")
    p.add_argument("--texts", type=int, default=2, help="held-out texts of 1,024 tokens (default 2)")
    a = p.parse_args(argv)
    if a.texts < 1:
        p.error("give --texts >= 1")
    folder = WEIGHTS / a.model
    model, _, texts = shipped(folder, a.texts)
    inputs = attention_inputs(model, torch.cat(texts))
    hs = inputs[0][1].shape[-1]
    rot = hadamard(hs)
    noise = torch.randn(inputs[0][1].shape, generator=torch.Generator().manual_seed(0))
    print(f"{folder}: {a.texts} texts x 1024 tokens; K per token in blocks of {GROUP}, q4_0; plain | rotated")
    print(f"{'layer':>5} {'block peak/RMS':>16} {'K error':>18} {'score error':>18}")
    for layer, (q, k, _) in enumerate(inputs):
        kr, qr = k @ rot, q @ rot
        k_hat, kr_hat = q4_0(k), q4_0(kr)
        rel = [float((x - x_hat).norm() / x.norm()) for x, x_hat in ((k, k_hat), (kr, kr_hat))]
        print(f"{layer:>5} {peak_to_rms(k):>7.2f} | {peak_to_rms(kr):<6.2f} {rel[0]:>8.4f} | {rel[1]:<7.4f} "
              f"{score_error(q, k, k_hat):>8.4f} | {score_error(qr, kr, kr_hat):<7.4f}")
    print(f"{'noise':>5} {peak_to_rms(noise):>7.2f} | {peak_to_rms(noise @ rot):<6.2f} "
          f"{float((noise - q4_0(noise)).norm() / noise.norm()):>8.4f} |   (Gaussian K of the same shape)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

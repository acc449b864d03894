"""What the papers' findings depend on, measured on a checkpoint: outlier channels in K and V (KIVI's and the
rotation's premise) and attention sinks (StreamingLLM's). docs/papers.md reads it.

    .venv/bin/python scripts/probes/kv_stats.py            # the shipped mini, 2 held-out texts of 1,024 tokens
    .venv/bin/python scripts/probes/kv_stats.py --model mini-llama   # the shipped Llama-family reference model
    .venv/bin/python scripts/probes/kv_stats.py --weights DIR --texts 4
    .venv/bin/python scripts/probes/kv_stats.py --outliers 20   # the mini with outlier channels (model.outliers)

Texts are made as a run makes them (``text_prompts`` over the checkpoint's heldout.txt), each led by the model's first
token where it was trained with one (``first_token``). Printed per layer, K and V as attention reads them: the
tensors each layer hands to attention, so a rotary model's K after its rotation, each K/V head's head_dim channels,
over every token of the texts:
- channel ratio: the largest channel's max |x| over the median channel's (mean over heads). Large: a few channels
  carry outliers, which a scale per channel (KIVI's K) contains and a scale per token over channels does not.
- token peak: a token's max |x| over its RMS, over the head's channels (median over tokens and heads), before and
  after the Hadamard rotation ``rotate=hadamard`` applies. What a scale per token pays for is this peak; a rotation
  brings it near that of Gaussian noise (the last row: Gaussian K/V of the same shape).
- token/channel range: a scale per token's group range over a scale per channel's (32 tokens): above 1, K or V
  quantised per channel takes finer steps than per token at the same bits (see ``axis_ranges``).
- sink share: the attention queries at positions >= 64 put on position 0 (mean over heads).

``--outliers S`` first gives the model one K and one V channel per head, S times their size, the model's function
kept (``models.outliers.inject``, what ``model.outliers.scale=S`` does to a run's model): the channel ratios then
read about S times the model's own.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402

from harness.core.inputs import led, text_prompts  # noqa: E402
from harness.train.targets import attention_on_first  # noqa: E402
from models import attention  # noqa: E402
from models.families import MODEL_CLASSES, load_model  # noqa: E402
from models.hf_checkpoint import CheckpointError, first_token  # noqa: E402
from models.kv_cache.quant import hadamard  # noqa: E402
from models.outliers import inject  # noqa: E402
from models.tokenizer import for_checkpoint  # noqa: E402

WEIGHTS = Path(__file__).resolve().parents[2] / "models" / "weights"


@contextmanager
def attend_with(attend):
    """Inside: every family's layers call ``attend`` in place of ``models.attention.attend`` (the probes' hook)."""
    real, modules = attention.attend, {sys.modules[cls.__module__] for cls in MODEL_CLASSES.values()}
    for m in modules:
        m.attend = attend
    try:
        yield real
    finally:
        for m in modules:
            m.attend = real


def attention_inputs(model, idx: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: q, k and v as the layer hands them to attention in a full forward of ``idx`` (a rotary family's q
    and k rotated already): (B, n_head, T, hs), (B, n_kv_head, T, hs) twice."""
    seen = []

    def recording(q, k, v, cache=None, layer=0, mask=None):
        seen.append((q.detach(), k.detach(), v.detach()))
        return real(q, k, v, cache, layer, mask)

    with attend_with(recording) as real, torch.no_grad():
        model(idx)
    if len(seen) != model.config.n_layer:
        raise RuntimeError(f"recorded {len(seen)} layers' attention inputs of {model.config.n_layer}")
    return seen


def shipped(folder: Path, n: int, length: int = 1024):
    """A reference model's checkpoint folder as the probes read it: (the model in fp32, its first token or None, ``n``
    held-out texts of ``length`` tokens made as a run makes them, each (1, length) and led by the first token)."""
    model = load_model(folder).float().eval()
    first = first_token(folder)
    texts = [t if first is None else led(t, first)
             for t in text_prompts(folder / "heldout.txt", n, length, for_checkpoint(folder))]
    return model, first, texts


def keys_values(model, idx: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: K and V as the layer hands them to attention (``attention_inputs``), (B, n_kv_head, T, hs) each."""
    return [(k, v) for _, k, v in attention_inputs(model, idx)]


def channel_ratio(x: torch.Tensor) -> float:
    """Largest channel's max |x| over the median channel's, per head, averaged over heads. x: (B, nh, T, hs)."""
    amax = x.abs().amax(dim=(0, 2))  # (nh, hs)
    return float((amax.amax(-1) / amax.median(-1).values).mean())


def axis_ranges(x: torch.Tensor, group: int = 32) -> float:
    """How much wider a per-token group's range is than a per-channel group's: the median over tokens of max - min
    across the head's channels, over the median over (channel, run of ``group`` tokens) of max - min across those
    tokens. A quantiser's step is its group's range / levels, so above 1 a scale per channel takes the finer steps
    (KIVI's case for K), below 1 a scale per token does. x: (B, nh, T, hs), T a multiple of ``group``."""
    per_token = x.amax(-1) - x.amin(-1)  # (B, nh, T)
    B, nh, T, hs = x.shape
    runs = x.view(B, nh, T // group, group, hs)
    per_channel = runs.amax(3) - runs.amin(3)  # (B, nh, T / group, hs)
    return float(per_token.median() / per_channel.median())


def token_peak(x: torch.Tensor) -> float:
    """Median over tokens and heads of a token's max |x| over its RMS across the head's channels."""
    return float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt().clamp_min(1e-12)).median())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mini", choices=["mini", "mini-llama"],
                   help="a shipped reference model (default mini)")
    p.add_argument("--weights", default=None, help="a checkpoint folder of either family instead (with heldout.txt)")
    p.add_argument("--texts", type=int, default=2, help="held-out texts of 1,024 tokens (default 2)")
    p.add_argument("--outliers", type=float, default=1.0, metavar="S",
                   help="give one K and one V channel per head S times their size first, the function kept (default "
                        "1: the checkpoint as it is)")
    a = p.parse_args(argv)
    folder = Path(a.weights) if a.weights else WEIGHTS / a.model
    if a.texts < 1 or not (folder / "heldout.txt").is_file():
        print(f"kv_stats: give --texts >= 1 and a checkpoint folder holding heldout.txt (got {a.texts}, {folder})",
              file=sys.stderr)
        return 2
    try:
        model, first, texts = shipped(folder, a.texts)
    except (CheckpointError, ValueError) as e:
        print(f"kv_stats: {e}", file=sys.stderr)
        return 2
    try:
        chosen = inject(model, a.outliers)
    except ValueError as e:
        print(f"kv_stats: --outliers: {e}", file=sys.stderr)
        return 2
    n = texts[0].shape[-1]
    idx = torch.cat(texts)
    pairs = keys_values(model, idx)
    with torch.no_grad():
        sinks = [sum(heads) / len(heads) for heads in attention_on_first(model, idx)]  # mean over heads
    rot = hadamard(pairs[0][0].shape[-1])
    lead = "" if first is None else f", each led by its first token ({first})"
    print(f"{folder}: {a.texts} texts x {n} tokens{lead}, head_dim {pairs[0][0].shape[-1]}, "
          f"{pairs[0][0].shape[1]} K/V heads" + (
        "" if chosen["k_channels"] is None else f", outliers x{a.outliers:g} (K channels {chosen['k_channels']}, V "
        f"channels {chosen['v_channels']} per layer and head)"))
    print(f"{'layer':>5} {'K channel ratio':>16} {'V channel ratio':>16} {'K token peak':>13} {'rotated':>8} "
          f"{'V token peak':>13} {'rotated':>8} {'K tok/ch range':>15} {'V tok/ch range':>15} {'sink share':>11}")
    for layer, ((k, v), sink) in enumerate(zip(pairs, sinks)):
        print(f"{layer:>5} {channel_ratio(k):>16.2f} {channel_ratio(v):>16.2f} {token_peak(k):>13.2f} "
              f"{token_peak(k @ rot):>8.2f} {token_peak(v):>13.2f} {token_peak(v @ rot):>8.2f} "
              f"{axis_ranges(k):>15.2f} {axis_ranges(v):>15.2f} {sink:>11.4f}")
    noise = torch.randn(pairs[0][0].shape, generator=torch.Generator().manual_seed(0))
    print(f"{'noise':>5} {channel_ratio(noise):>16.2f} {channel_ratio(noise):>16.2f} {token_peak(noise):>13.2f} "
          f"{token_peak(noise @ rot):>8.2f} {'':>13} {'':>8} {axis_ranges(noise):>15.2f} {'':>15} {'':>11}"
          "   (Gaussian K/V of the same shape: no outliers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

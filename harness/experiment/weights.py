"""Which weights a run measures: ``model.weights`` -> a ``Weights`` answer, decided once, before any model is built.

- ``random``: the model family's own initialisation under ``model.seed`` (bytes and step times do not depend on the values).
- ``auto`` (the default of gpt2 ... gpt2-xl): the real checkpoint (``openai-community/gpt2``, ``-medium``, ``-large``,
  ``-xl``) when it is in the local HF cache or the hub answers; otherwise the seeded init, with one printed line
  saying why. The hub is asked with a bounded wait (``KVLAB_HUB_TIMEOUT`` seconds, default 5): a closed port, a DNS
  failure or a firewall that drops packets costs seconds, never a hang. ``HF_HUB_OFFLINE=1`` skips the asking (the
  local cache is still used). A preset with no published checkpoint (``tiny``) gets the seeded init.
- a folder (absolute, relative to the working directory or to the repository): an HF GPT-2, Llama, Qwen2 or Mistral
  checkpoint folder (``models.load_model``: the family from config.json's model_type).
- anything else: a hub id, fetched by ``models.load_model`` (which says what to do when it cannot).

Nothing here builds a model; ``harness.experiment.runner`` loads what this decides.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# the published checkpoint of each preset (HF's canonical ids)
HUB_IDS = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
           "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl",
           "smollm2-135m": "HuggingFaceTB/SmolLM2-135M", "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
           "llama-3.2-1b": "meta-llama/Llama-3.2-1B"}  # (Meta's is gated: without access, auto falls back)
FILES = ("config.json", "model.safetensors")
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Weights:
    kind: str  # "random" or "pretrained" (any checkpoint: a hub id or a folder)
    source: str  # "random", the hub id, or the folder
    load_from: str | None  # what models.load_model gets (a folder or a hub id); None for random
    detail: str  # one line for people: what was used and why

    @property
    def random(self) -> bool:
        return self.kind == "random"


def random_init(seed: int, why: str = "") -> Weights:
    return Weights("random", "random", None,
                   f"random init (the model family's own initialisation, seed {seed}), not pretrained"
                   + (f": {why}" if why else ""))


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() not in ("0", "", "false", "no", "off")


def hub_timeout() -> float:
    text = os.environ.get("KVLAB_HUB_TIMEOUT", "")
    try:
        return max(0.1, float(text)) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        return DEFAULT_TIMEOUT_S


def cached_folder(hub_id: str) -> Path | None:
    """The local HF cache's snapshot folder of ``hub_id`` when it holds config.json and model.safetensors (no
    network)."""
    from huggingface_hub import try_to_load_from_cache

    found = [try_to_load_from_cache(hub_id, f) for f in FILES]
    if all(isinstance(p, str) and Path(p).is_file() for p in found):
        return Path(found[0]).parent
    return None


def hub_answers(hub_id: str, timeout: float) -> str | None:
    """Ask the hub about ``hub_id``, waiting at most ``timeout`` seconds in all (name resolution included, which no
    socket timeout bounds: the question runs in a daemon thread that is abandoned when late). None when the hub
    answered that it has the repository; otherwise why not, in a few words."""
    from huggingface_hub import HfApi

    answer: list[str | None] = []

    def ask():
        try:
            HfApi().model_info(hub_id, timeout=timeout)
            answer.append(None)
        except Exception as e:  # no network, refused, unknown repo, rate limit: all mean "use the fallback"
            answer.append(f"{type(e).__name__}: {' '.join(str(e).split())[:100]}")

    t = threading.Thread(target=ask, daemon=True, name="kvlab-hub-probe")
    t.start()
    t.join(timeout)
    if not answer:
        return f"no answer within {timeout:g} s"
    return answer[0]


_DECIDED: dict[tuple[str, str, int], Weights] = {}  # a sweep of many runs in one process asks the hub once


def checkpoint_folder(text: str) -> Path | None:
    """``text`` as an existing folder: as given (working directory), else relative to the repository."""
    path = Path(text).expanduser()
    if path.exists():
        return path
    if not path.is_absolute() and (REPO / path).exists():
        return REPO / path
    return None


def resolve(m, announce=print) -> Weights:
    """The weights the run's model choice asks for (``harness.experiment.plan.ModelChoice``: ``preset``, ``weights``,
    ``seed``; plain values, never the config). Only ``auto`` may touch the network, with a bounded wait, and says in
    one line when it falls back to the seeded init."""
    text = str(m.weights)
    if text == "random":
        return random_init(m.seed)
    if text != "auto":
        folder = checkpoint_folder(text)
        if folder is not None:
            return Weights("pretrained", str(folder), str(folder), f"checkpoint {folder}")
        return Weights("pretrained", text, text, f"checkpoint {text}")  # a hub id (or missing: the load says so)
    key = (m.preset, text, int(m.seed))
    if key not in _DECIDED:
        _DECIDED[key] = _auto(m.preset, int(m.seed), announce)
    return _DECIDED[key]


def _auto(preset: str, seed: int, announce) -> Weights:
    hub_id = HUB_IDS.get(preset)
    if hub_id is None:
        return random_init(seed, f"{preset} has no published checkpoint")
    folder = cached_folder(hub_id)
    if folder is not None:
        return Weights("pretrained", hub_id, str(folder), f"pretrained {hub_id} (local HF cache)")
    if hub_offline():
        why = f"{hub_id} is not in the local HF cache and HF_HUB_OFFLINE is set"
    else:
        timeout = hub_timeout()
        why = hub_answers(hub_id, timeout)
        if why is None:
            from huggingface_hub import snapshot_download

            try:
                got = Path(snapshot_download(hub_id, allow_patterns=list(FILES), etag_timeout=timeout))
                return Weights("pretrained", hub_id, str(got), f"pretrained {hub_id} (downloaded from the hub)")
            except Exception as e:
                why = f"the download failed ({type(e).__name__})"
        why = f"the hub did not give {hub_id} ({why})"
    w = random_init(seed, why)
    announce(f"kvlab: model.weights=auto: {w.detail}", file=sys.stderr)
    return w


def first_token_of(w: Weights | None, preset: str | None = None) -> int | None:
    """The token a checkpoint folder was trained to see first (``models.hf_checkpoint.first_token``), or None. A
    random init of a reference model's preset (its untrained control) gets the token its shipped checkpoint was
    trained with, so the two read the same sequences."""
    from models.hf_checkpoint import first_token

    if w is not None and w.random and preset is not None:
        shipped = REPO / "models" / "weights" / preset
        return first_token(shipped) if (shipped / "config.json").is_file() else None
    if w is None or w.random or not Path(w.load_from).is_dir():
        return None
    return first_token(w.load_from)


def first_token_share_of(w: Weights | None, bos: int | None) -> float | None:
    """The share of attention the checkpoint's first token draws (``models.hf_checkpoint.first_token_share``): only
    for a trained checkpoint with a first token (a random init's attention was never measured)."""
    from models.hf_checkpoint import first_token_share

    if bos is None or w is None or w.random or not Path(w.load_from).is_dir():
        return None
    return first_token_share(w.load_from)

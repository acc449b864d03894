"""The decoder families kvlab computes, and the one place a family is chosen: by config.json's ``model_type`` for a
checkpoint folder, by name for a preset. Adding a family is a module (a config class with ``from_hf_dict``, ``preset``
and the geometry every family's config gives, a ``Decoder`` subclass with ``from_pretrained``) and a line here; the
harness asks the model and its config, never a family's name.

    from models import load_model
    model = load_model("path/to/checkpoint")          # GPT-2, Llama, Qwen2 or Mistral, from config.json's model_type
    cfg = preset_config("smollm2-135m")               # a preset's config (random init: build(cfg))
"""

from __future__ import annotations

import os
from pathlib import Path

from models import hf_checkpoint as hf
from models.decoder import Decoder
from models.gpt2 import GPT2, GPT2Config
from models.gpt2 import PRESETS as GPT2_PRESETS
from models.hf_checkpoint import CheckpointError
from models.llama import MODEL_TYPES as LLAMA_TYPES
from models.llama import PRESETS as LLAMA_PRESETS
from models.llama import Llama, LlamaConfig

MODEL_CLASSES: dict[str, type[Decoder]] = {"gpt2": GPT2, **{t: Llama for t in LLAMA_TYPES}}
CONFIG_CLASSES = {GPT2: GPT2Config, Llama: LlamaConfig}
PRESETS = {**{name: GPT2Config for name in GPT2_PRESETS}, **{name: LlamaConfig for name in LLAMA_PRESETS}}


def preset_config(name: str):
    """The config of a named preset of any family (GPT-2's gpt2 .. gpt2-xl, mini, tiny; Llama-family smollm2-135m,
    qwen2.5-0.5b, llama-3.2-1b, tiny-gqa)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name].preset(name)


def model_class(config) -> type[Decoder]:
    """The decoder a config builds: its own class's (a family's config may extend another's)."""
    for cls, cfg_cls in CONFIG_CLASSES.items():
        if type(config) is cfg_cls:
            return cls
    for cls, cfg_cls in CONFIG_CLASSES.items():
        if isinstance(config, cfg_cls):
            return cls
    raise TypeError(f"{type(config).__name__} is no decoder family's config: use one of "
                    f"{', '.join(c.__name__ for c in CONFIG_CLASSES.values())}")


def build(config) -> Decoder:
    """A model of ``config``'s family, randomly initialised (seeded by the caller's torch seed)."""
    return model_class(config)(config)


def config_from_hf(d: dict, source: str = hf.CONFIG):
    """Our config of the family config.json's ``model_type`` names."""
    mt = d.get("model_type") if isinstance(d, dict) else None
    if mt not in MODEL_CLASSES:
        raise CheckpointError(f"{source}: model_type is {mt!r}; kvlab loads {', '.join(MODEL_CLASSES)}")
    return CONFIG_CLASSES[MODEL_CLASSES[mt]].from_hf_dict(d, source=source)


def read_config(folder: str | os.PathLike):
    """The config of a checkpoint folder's config.json, of whichever family it names; faults name the file."""
    return config_from_hf(hf.read_config(folder), source=str(Path(folder) / hf.CONFIG))


def load_model(path_or_id: str | os.PathLike) -> Decoder:
    """A checkpoint folder (config.json + model.safetensors, its shards, or pytorch_model.bin read with
    weights_only=True) or a hub id where the hub answers, as kvlab's model of the family config.json's model_type
    names; every tensor checked (``hf_checkpoint``). Faults are one-line ``CheckpointError``s."""
    folder = hf.resolve(path_or_id)
    cfg = read_config(folder)
    return model_class(cfg).from_pretrained(folder)

"""Tiny HF GPT-2 checkpoints with random weights, and edits to their config and weights (faults to load)."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def hf_checkpoint(folder: Path, **config) -> Path:
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    settings = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=300, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(HFConfig(**{**settings, **config})).save_pretrained(folder)
    return folder


def edit_config(folder: Path, change) -> None:
    f = folder / "config.json"
    f.write_text(json.dumps(change(json.loads(f.read_text()))))


def edit_weights(folder: Path, change) -> None:
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    save_file(change(state), str(folder / "model.safetensors"))


def nan_weight(state):
    state["transformer.h.0.attn.c_attn.weight"][0, 0] = float("nan")
    return state

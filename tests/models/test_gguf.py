"""GGUF conversion (models/gguf.py): every tensor read back equals the model's own once the conversion's
transformations are undone, the same model writes the same bytes, the Llama q/k interleave keeps every attention
score, and what it cannot write is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models import gguf as G
from models.families import build, preset_config
from models.gpt2 import GPT2, GPT2Config
from models.llama import Rope, inverse_frequencies, rotate


def tiny(name: str):
    torch.manual_seed(0)
    if name == "gpt2":
        return GPT2(GPT2Config.preset("tiny")).eval()
    return build(preset_config("tiny-gqa")).eval()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_every_tensor_reads_back_as_the_models_own(tmp_path, name, dtype):
    model = tiny(name)
    path = G.write_gguf(model, tmp_path / "m.gguf", dtype)
    meta, tensors = G.read_gguf(path)
    back = G.as_state_dict(model, tensors)
    own = model.state_dict()
    assert set(back) <= set(own)
    missing = set(own) - set(back)  # only what the file need not hold: Llama's output, tied to the embedding
    assert missing == ({"lm_head.weight"} if name == "llama" else set())
    assert all(torch.equal(own[k], own["model.embed_tokens.weight"]) for k in missing)
    half = {"f16": torch.float16, "bf16": torch.bfloat16}.get(dtype)
    for k, t in back.items():
        ref = own[k].float()
        if half is not None and t.dtype == half:
            ref = ref.to(half)  # rounded to nearest even: bf16's raw bits as torch rounds them
        assert t.shape == ref.shape and torch.equal(t.to(ref.dtype), ref), k
    assert meta["general.architecture"] == ("gpt2" if name == "gpt2" else "llama")
    assert meta[f"{meta['general.architecture']}.vocab_size"] == model.config.vocab_size
    assert meta["tokenizer.ggml.model"] == "none"
    two_d = [t for t in tensors.values() if t.dim() == 2]
    assert all(t.dtype == (half or torch.float32) for t in two_d if t.shape[0] != model.config.n_positions)
    assert all(t.dtype == torch.float32 for t in tensors.values() if t.dim() == 1)
    assert meta["general.file_type"] == {"f32": 0, "f16": 1, "bf16": 32}[dtype]  # ALL_F32, MOSTLY_F16, MOSTLY_BF16


def test_a_bf16_model_writes_its_own_bits_and_reads_them_back(tmp_path):
    model = tiny("gpt2").to(torch.bfloat16)
    with torch.no_grad():  # values an fp16 file could not hold: bf16's range, not fp16's
        model.transformer.h[0].mlp.c_fc.weight[0, :3] = torch.tensor([1e30, -3e-30, 0.0])
    _, tensors = G.read_gguf(G.write_gguf(model, tmp_path / "m.gguf", "bf16"))
    back, own = G.as_state_dict(model, tensors), model.state_dict()
    for k, t in back.items():
        if t.dim() == 2 and k != "transformer.wpe.weight":
            assert t.dtype == torch.bfloat16 and torch.equal(t.view(torch.int16), own[k].view(torch.int16)), k
    assert G.write_gguf(model, tmp_path / "b.gguf", "bf16").read_bytes() == (tmp_path / "m.gguf").read_bytes()


def test_the_same_model_writes_the_same_bytes_and_another_model_other_bytes(tmp_path):
    model = tiny("llama")
    a = G.write_gguf(model, tmp_path / "a.gguf").read_bytes()
    b = G.write_gguf(model, tmp_path / "b.gguf").read_bytes()
    assert a == b and G.model_digest(model) == G.model_digest(tiny("llama"))
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] += 1
    assert G.write_gguf(model, tmp_path / "c.gguf").read_bytes() != a
    assert G.model_digest(model) != G.model_digest(tiny("llama"))
    assert [p.name for p in tmp_path.iterdir()] and not list(tmp_path.glob("*.part*"))  # no half-file left


def adjacent_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama.cpp's ``llama`` rotation: channels (2i, 2i + 1) turned by pair i's angle (cos, sin in rotate-half
    layout: pair i's angle at i and i + hd / 2)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def test_interleaved_q_and_k_under_adjacent_pairs_give_the_same_scores():
    cfg = preset_config("tiny-gqa")
    torch.manual_seed(1)
    hd, T = cfg.head_dim, 7
    q, k = torch.randn(1, 1, T, hd), torch.randn(1, 1, T, hd)
    rope = Rope(inverse_frequencies(cfg), torch.arange(T), torch.float32)
    ours = rotate(q, rope.cos, rope.sin) @ rotate(k, rope.cos, rope.sin).transpose(-1, -2)
    qi, ki = (G.interleave_rows(t[0, 0].T.contiguous(), 1).T for t in (q, k))  # rows of the projection = channels
    theirs = adjacent_rotate(qi, rope.cos, rope.sin) @ adjacent_rotate(ki, rope.cos, rope.sin).transpose(-1, -2)
    torch.testing.assert_close(theirs, ours[0, 0], atol=1e-5, rtol=1e-5)
    w = torch.randn(3 * hd, 5)
    assert torch.equal(G.uninterleave_rows(G.interleave_rows(w, 3), 3), w)
    assert not torch.equal(G.interleave_rows(w, 3), w)


@pytest.mark.parametrize("change, why", [
    (dict(qkv_bias=True), "biases"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=64)), "rope_scaling"),
])
def test_what_it_cannot_write_is_refused_in_one_line(tmp_path, change, why):
    model = build(dataclasses.replace(preset_config("tiny-gqa"), **change))
    with pytest.raises(G.GGUFError, match=why) as e:
        G.write_gguf(model, tmp_path / "m.gguf")
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())
    with pytest.raises(G.GGUFError, match="give one of f32, f16"):
        G.write_gguf(tiny("gpt2"), tmp_path / "m.gguf", "q8")

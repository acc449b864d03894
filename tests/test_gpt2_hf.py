"""Our GPT-2 against HF transformers' GPT2LMHeadModel (random weights, saved and loaded; nothing downloaded)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config as HFConfig
from transformers import GPT2LMHeadModel

from models.gpt2 import GPT2, CheckpointError, GPT2Config

CONFIGS = [
    dict(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=300),
    dict(n_layer=3, n_head=3, n_embd=48, n_positions=40, vocab_size=257),  # odd head count
    dict(n_layer=2, n_head=5, n_embd=120, n_positions=32, vocab_size=1000),  # n_embd not a power of two
    dict(n_layer=1, n_head=1, n_embd=32, n_positions=16, vocab_size=50),
]


def hf_checkpoint(folder, seed=0, **cfg):
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(HFConfig(**cfg, bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():  # HF zero-inits biases and unit-inits LayerNorm: perturb so every tensor matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder)
    return hf


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"L{c['n_layer']}h{c['n_head']}d{c['n_embd']}")
def test_logits_match_hf_at_every_position(tmp_path, cfg):
    hf = hf_checkpoint(tmp_path, **cfg)
    ours = GPT2.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, cfg["vocab_size"], (2, cfg["n_positions"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(idx).logits
        got = ours(idx)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5


def test_pytorch_bin_checkpoint_loads_with_weights_only(tmp_path):
    cfg = CONFIGS[0]
    hf = hf_checkpoint(tmp_path, **cfg)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = GPT2.from_pretrained(tmp_path)
    idx = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max().item() <= 1e-5


def test_cached_decode_matches_hf_logits(tmp_path):
    cfg = CONFIGS[1]
    hf = hf_checkpoint(tmp_path, **cfg)
    ours = GPT2.from_pretrained(tmp_path).eval()
    from models.generate import greedy

    prompt = torch.tensor([[5, 17, 3, 200]])
    out = greedy(ours, prompt, 20, layout="prealloc")
    full = torch.cat([prompt, out.tokens], dim=1)
    with torch.no_grad():
        ref = hf(full).logits[:, prompt.shape[1] - 1:-1]  # the logits each generated token was chosen from
    assert (out.logits - ref).abs().max().item() <= 1e-5


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        GPT2.from_pretrained(tmp_path / "nope")


def test_not_gpt2_names_config_and_model_type(tmp_path):
    hf_checkpoint(tmp_path, **CONFIGS[0])
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*model_type is 'llama'"):
        GPT2.from_pretrained(tmp_path)


def test_shape_disagreeing_with_config_names_file_and_tensor(tmp_path):
    hf_checkpoint(tmp_path, **CONFIGS[0])
    state = load_file(str(tmp_path / "model.safetensors"))
    state["transformer.h.1.mlp.c_fc.weight"] = state["transformer.h.1.mlp.c_fc.weight"][:, :-1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'transformer\.h\.1\.mlp\.c_fc\.weight'.*shape"):
        GPT2.from_pretrained(tmp_path)


def test_missing_tensor_and_missing_weights_file(tmp_path):
    hf_checkpoint(tmp_path, **CONFIGS[0])
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["transformer.ln_f.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'transformer\.ln_f\.bias' is missing"):
        GPT2.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        GPT2.from_pretrained(tmp_path)


def test_hub_id_offline_says_how_to_use_a_local_folder():
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained("openai-community/gpt2")
    msg = str(e.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE" in msg and "pass DIR" in msg


def test_seeded_init_is_deterministic_and_follows_gpt2():
    cfg = GPT2Config(n_layer=4, n_head=4, n_embd=128, n_positions=64, vocab_size=2000)
    torch.manual_seed(3)
    a = GPT2(cfg)
    torch.manual_seed(3)
    b = GPT2(cfg)
    torch.manual_seed(4)
    c = GPT2(cfg)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["transformer.h.0.attn.c_attn.weight"], sc["transformer.h.0.attn.c_attn.weight"])
    assert a.lm_head.weight is a.transformer.wte.weight
    std = sa["transformer.h.0.attn.c_attn.weight"].std().item()
    proj_std = torch.cat([sa[f"transformer.h.{i}.mlp.c_proj.weight"].flatten() for i in range(4)]).std().item()
    assert abs(std - 0.02) < 0.001
    assert abs(proj_std - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.0005
    assert torch.equal(sa["transformer.h.0.ln_1.weight"], torch.ones(128))
    assert torch.equal(sa["transformer.h.0.attn.c_attn.bias"], torch.zeros(3 * 128))


@pytest.mark.parametrize("name,layers,heads,width", [
    ("gpt2", 12, 12, 768), ("gpt2-medium", 24, 16, 1024), ("gpt2-large", 36, 20, 1280), ("gpt2-xl", 48, 25, 1600)])
def test_presets_are_the_gpt2_sizes(name, layers, heads, width):
    c = GPT2Config.preset(name)
    assert (c.n_layer, c.n_head, c.n_embd, c.n_positions, c.vocab_size) == (layers, heads, width, 1024, 50257)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="gpt2-medium"):
        GPT2Config.preset("gpt3")


def test_tensors_the_config_does_not_describe_are_refused(tmp_path):
    hf_checkpoint(tmp_path, **dict(CONFIGS[0], n_layer=3))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["n_layer"] = 2  # the weights hold three blocks
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor\(s\) the config does not account for.*transformer\.h\.2\."):
        GPT2.from_pretrained(tmp_path)


@pytest.mark.parametrize("flag,value", [("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False)])
def test_attention_scaling_other_than_gpt2s_is_refused(tmp_path, flag, value):
    hf_checkpoint(tmp_path, **CONFIGS[0])
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[flag] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="attention scaling"):
        GPT2.from_pretrained(tmp_path)

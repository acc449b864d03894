"""Our GPT-2 against HF transformers' GPT2LMHeadModel (random weights, saved and loaded; nothing downloaded)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config as HFConfig
from transformers import GPT2LMHeadModel

from models.gpt2 import GPT2, CheckpointError, GPT2Config
from models.hf_checkpoint import CONV1D, FORMATS, GPT2_FORMAT, from_hf, to_hf, to_safetensors, write_folder

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


# ---- the checkpoint format (models.hf_checkpoint) ------------------------------------------------------------------

def perturbed_model(seed=0, **cfg):
    """Our GPT-2 with every tensor random (our init zeros the biases and unit-inits LayerNorm)."""
    torch.manual_seed(seed)
    model = GPT2(GPT2Config(**cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def hf_model(**cfg):
    return GPT2LMHeadModel(HFConfig(**cfg, bos_token_id=0, eos_token_id=0)).eval()


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: f"L{c['n_layer']}h{c['n_head']}d{c['n_embd']}")
def test_round_trip_ours_to_hf_and_back(cfg):
    """ours -> to_hf -> an HF GPT2LMHeadModel (built from a config, random weights, then overwritten): the same
    logits; HF -> from_hf -> ours: the same tensors, strict (every name, nothing extra)."""
    ours = perturbed_model(**cfg)
    theirs = hf_model(**cfg)
    missing, unexpected = theirs.load_state_dict(to_hf(ours.state_dict()), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # the tied head comes with the tie
    assert theirs.lm_head.weight is theirs.transformer.wte.weight
    idx = torch.randint(0, cfg["vocab_size"], (2, cfg["n_positions"]), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(idx) - theirs(idx).logits).abs().max().item() <= 1e-5

    back = GPT2(GPT2Config(**cfg))
    back.load_state_dict(from_hf(theirs.state_dict()))  # strict: our names and layouts exactly
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in back.state_dict().items())
    assert back.lm_head.weight is back.transformer.wte.weight
    again = from_hf(to_hf(ours.state_dict()))
    assert again.keys() == ours.state_dict().keys() - {"lm_head.weight"}
    assert all(torch.equal(again[k], ours.state_dict()[k]) for k in again)


def test_to_hf_writes_contiguous_copies_in_the_dtype_asked():
    model = perturbed_model(**CONFIGS[0])
    state = model.state_dict()
    out = to_hf(state, torch.float16)
    assert "lm_head.weight" not in out
    for name, t in out.items():
        assert t.dtype == torch.float16 and t.is_contiguous(), name
        assert t.untyped_storage().data_ptr() != state[name].untyped_storage().data_ptr(), name
        want = state[name].t() if name.endswith(CONV1D) else state[name]
        assert torch.equal(t, want.half()), name
    views = to_hf(state, clone=False)  # what the HF peer loads from: no second copy of the model
    assert views["transformer.h.0.mlp.c_fc.weight"].data_ptr() == state["transformer.h.0.mlp.c_fc.weight"].data_ptr()


def test_the_transposes_are_declared_once(tmp_path):
    """The engine (GPT2.from_pretrained), the HF peer (HFEngine) and the writer (write_folder / to_safetensors)
    all go through the one declaration: the peer's tensors are the file's, the engine reads back the model written,
    HF transformers reads the file as the peer holds it, and the declared transposes are exactly HF's Conv1D."""
    from transformers.pytorch_utils import Conv1D

    from harness.core.engines import HFEngine

    model = perturbed_model(**CONFIGS[1])
    folder = write_folder(tmp_path / "ckpt", model.state_dict(), model.hf_config_dict())
    written = load_file(str(folder / "model.safetensors"))
    assert (folder / "model.safetensors").read_bytes() == to_safetensors(model.state_dict())
    peer = HFEngine(model).model
    peer_state = {k: v for k, v in peer.state_dict().items() if k not in GPT2_FORMAT.tied}
    assert written.keys() == peer_state.keys()
    assert all(torch.equal(written[k], peer_state[k]) for k in written)
    loaded = GPT2.from_pretrained(folder)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    theirs = GPT2LMHeadModel.from_pretrained(folder).eval()
    assert all(torch.equal(theirs.state_dict()[k], peer_state[k]) for k in peer_state)
    conv1d = {f"{n}.weight" for n, m in peer.named_modules() if isinstance(m, Conv1D)}
    assert conv1d == {k for k in model.state_dict() if GPT2_FORMAT.is_transposed(k)}
    assert FORMATS["gpt2"] is GPT2_FORMAT and GPT2_FORMAT.transposed == CONV1D


def test_written_config_says_dtype_and_tie(tmp_path):
    model = perturbed_model(**CONFIGS[3])
    folder = write_folder(tmp_path, model.state_dict(), model.hf_config_dict(), dtype=torch.bfloat16)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True and cfg["model_type"] == "gpt2"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(folder / "model.safetensors")).values())
    with pytest.raises(ValueError, match="model_type"):
        write_folder(tmp_path / "other", model.state_dict(), {**cfg, "model_type": "llama"})


def test_a_base_model_state_dict_with_mask_buffers_loads():
    """HF GPT2Model's names (no ``transformer.`` prefix) and the causal-mask buffers older HF versions saved."""
    theirs = hf_model(**CONFIGS[0])
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    base = dict(theirs.transformer.state_dict())
    base["h.0.attn.bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
    base["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    ours = GPT2(GPT2Config(**CONFIGS[0]))
    ours.load_hf_state_dict(base)
    idx = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        assert (ours(idx) - theirs(idx).logits).abs().max().item() <= 1e-5


def test_a_tied_head_that_differs_is_refused():
    model = perturbed_model(**CONFIGS[0])
    state = {**to_hf(model.state_dict()), "lm_head.weight": torch.zeros_like(model.lm_head.weight)}
    with pytest.raises(CheckpointError, match="lm_head.weight differs from transformer.wte.weight; GPT-2 ties them"):
        GPT2(GPT2Config(**CONFIGS[0])).load_hf_state_dict(state, source="x")


@pytest.mark.parametrize("payload,message", [
    ([1, 2], "holds a list, not a state dict"),
    ({"transformer.wte.weight": 3}, "entry 'transformer.wte.weight' is a int, not a tensor"),
], ids=["list", "int-entry"])
def test_a_pytorch_bin_that_is_not_a_state_dict_is_refused(tmp_path, payload, message):
    hf_checkpoint(tmp_path, **CONFIGS[0])
    (tmp_path / "model.safetensors").unlink()
    torch.save(payload, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value) and "pytorch_model.bin" in str(e.value)

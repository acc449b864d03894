"""harness.tools.kvcalc against byte counts worked out by hand for published configs (written here as config.json files,
with the published numbers), against our quant kind's own accounting, and its command line."""

import json
import subprocess
import sys

import pytest
import torch

from harness.tools.kvcalc import (
    bytes_per_token,
    kv_cache_bytes,
    kv_geometry,
    main,
    parse_memory,
    sequences_that_fit,
)
from models.kv_cache import kv_bytes, make_cache
from models.kv_cache.quant import QuantKVCache, QuantOptions

# Published config.json contents (only the fields that matter, as the hub files spell them).
CONFIGS = {
    # openai-community/gpt2
    "gpt2": {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024,
             "n_ctx": 1024, "vocab_size": 50257},
    # openai-community/gpt2-xl
    "gpt2-xl": {"model_type": "gpt2", "n_layer": 48, "n_head": 25, "n_embd": 1600, "n_positions": 1024,
                "vocab_size": 50257},
    # meta-llama/Meta-Llama-3-8B (no head_dim in the file: 4096 / 32 = 128)
    "llama3-8b": {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0, "vocab_size": 128256},
    # tiiuae/falcon-7b (no max positions in the file)
    "falcon-7b": {"model_type": "falcon", "num_hidden_layers": 32, "num_attention_heads": 71, "hidden_size": 4544,
                  "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True, "alibi": False,
                  "vocab_size": 65024},
    # google/gemma-2-9b, with layer_types as newer transformers write it (layer 0 sliding, alternating)
    "gemma2-9b": {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16,
                  "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584, "sliding_window": 4096,
                  "max_position_embeddings": 8192,
                  "layer_types": ["sliding_attention", "full_attention"] * 21},
    # mistralai/Mistral-7B-v0.1: a 4096 window on every layer
    "mistral-7b": {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096,
                   "max_position_embeddings": 32768},
    # Qwen/Qwen2-7B: sliding_window present but use_sliding_window false, so no layer is windowed
    "qwen2-7b": {"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "hidden_size": 3584, "sliding_window": 131072,
                 "use_sliding_window": False, "max_window_layers": 28, "max_position_embeddings": 131072},
}


@pytest.fixture
def write(tmp_path):
    def _write(name, cfg=None):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(CONFIGS[name] if cfg is None else cfg))
        return str(path)
    return _write


def test_gpt2_small_preset_and_config_json(write):
    # 2 (K,V) x 12 layers x 12 heads x 64 head_dim (768 / 12) x 4 bytes (fp32) = 73,728 B/token
    for g in (kv_geometry("gpt2"), kv_geometry(write("gpt2"))):
        assert (g["n_layer"], g["n_kv_head"], g["head_dim"], g["max_positions"]) == (12, 12, 64, 1024)
        assert bytes_per_token(g) == 73_728
        assert kv_cache_bytes(g, 1024) == 75_497_472  # 73,728 x 1,024
        assert kv_cache_bytes(g, 1024, batch=8, dtype="fp16") == 301_989_888  # 36,864 x 1,024 x 8
        assert kv_cache_bytes(g, 1024) == kv_bytes(12, 12, 64, 1024)  # and the engine's own formula agrees


def test_gpt2_xl(write):
    # 2 x 48 layers x 25 heads x 64 head_dim (1600 / 25) x 4 bytes = 2 x 48 x 1600 x 4 = 614,400 B/token
    for g in (kv_geometry("gpt2-xl"), kv_geometry(write("gpt2-xl"))):
        assert bytes_per_token(g, "fp32") == 614_400
        assert kv_cache_bytes(g, 1024) == 629_145_600  # 614,400 x 1,024


def test_llama3_8b_gqa(write):
    g = kv_geometry(write("llama3-8b"))
    assert (g["n_layer"], g["n_head"], g["n_kv_head"], g["head_dim"]) == (32, 32, 8, 128)
    # fp16: 2 x 32 layers x 8 kv heads x 128 head_dim x 2 bytes = 131,072 B/token (fp32: 262,144)
    assert bytes_per_token(g, "fp16") == 131_072
    assert bytes_per_token(g, "bf16") == 131_072
    assert bytes_per_token(g, "fp32") == 262_144
    assert bytes_per_token(g, "fp8") == 65_536
    # at its 8,192 max positions: 131,072 x 8,192 = 1,073,741,824 (1 GiB) per sequence
    assert kv_cache_bytes(g, 8192, dtype="fp16") == 1_073_741_824
    # 80 GB: floor(80e9 / 1,073,741,824) = floor(74.5...) = 74; 80 GiB: exactly 80
    assert sequences_that_fit(g, 8192, 80_000_000_000, dtype="fp16") == 74
    assert sequences_that_fit(g, 8192, parse_memory("80GiB"), dtype="fp16") == 80


def test_falcon_7b_mqa(write):
    g = kv_geometry(write("falcon-7b"))
    assert (g["n_kv_head"], g["head_dim"], g["max_positions"]) == (1, 64, None)  # 4544 / 71 = 64
    # fp16: 2 x 32 layers x 1 kv head x 64 head_dim x 2 bytes = 8,192 B/token
    assert bytes_per_token(g, "fp16") == 8_192
    assert kv_cache_bytes(g, 2048, dtype="fp16") == 16_777_216  # 8,192 x 2,048
    # Falcon-40B style (new_decoder_architecture: num_kv_heads, not multi_query) -> 8 kv heads
    g40 = kv_geometry(write("f40", {"num_hidden_layers": 60, "num_attention_heads": 128, "hidden_size": 8192,
                                    "new_decoder_architecture": True, "multi_query": True, "num_kv_heads": 8}))
    assert (g40["n_kv_head"], g40["head_dim"]) == (8, 64)
    assert bytes_per_token(g40, "fp16") == 122_880  # 2 x 60 x 8 x 64 x 2


def test_gemma2_9b_alternating_windows(write):
    g = kv_geometry(write("gemma2-9b"))
    assert g["head_dim"] == 256  # given, not 3584 / 16 = 224
    assert g["windows"][:4] == [4096, None, 4096, None] and g["windows"].count(None) == 21
    # bf16 per token while no window is full: 2 x 42 x 8 x 256 x 2 = 344,064
    assert bytes_per_token(g, "bf16") == 344_064
    # one layer, one token: 2 x 8 x 256 x 2 = 8,192 B. At 8,192 tokens: 21 full layers hold 8,192 and 21 sliding
    # layers hold 4,096: 8,192 x (21 x 8,192 + 21 x 4,096) = 8,192 x 258,048 = 2,113,929,216
    assert kv_cache_bytes(g, 8192, dtype="bf16") == 2_113_929_216
    assert kv_cache_bytes(g, 4096, dtype="bf16") == 1_409_286_144  # every layer 4,096: 344,064 x 4,096
    # the same model from an older config.json without layer_types: model_type gemma2 alternates the same way
    old = {k: v for k, v in CONFIGS["gemma2-9b"].items() if k != "layer_types"}
    assert kv_geometry(write("gemma2-old", old))["windows"] == g["windows"]


def test_mistral_7b_every_layer_windowed(write):
    g = kv_geometry(write("mistral-7b"))
    assert g["windows"] == [4096] * 32
    assert bytes_per_token(g, "fp16") == 131_072  # 2 x 32 x 8 x 128 x 2
    # at 8,192 tokens every layer holds only 4,096: 131,072 x 4,096 = 536,870,912
    assert kv_cache_bytes(g, 8192, dtype="fp16") == 536_870_912
    assert kv_cache_bytes(g, 1000, dtype="fp16") == 131_072_000  # under the window: 131,072 x 1,000


def test_qwen2_sliding_window_rules(write):
    g = kv_geometry(write("qwen2-7b"))
    assert g["windows"] == [None] * 28  # use_sliding_window false
    assert bytes_per_token(g, "bf16") == 57_344  # 2 x 28 x 4 x 128 (3584 / 28) x 2
    # use_sliding_window true: the bottom max_window_layers (20) layers are full, layers 20..27 (8) windowed
    on = dict(CONFIGS["qwen2-7b"], use_sliding_window=True, max_window_layers=20, sliding_window=4096)
    g = kv_geometry(write("qwen2-swa", on))
    assert g["windows"] == [None] * 20 + [4096] * 8
    # 2 x 4 x 128 x 2 = 2,048 B per layer-token; 20 x 8,192 + 8 x 4,096 = 196,608 -> 402,653,184
    assert kv_cache_bytes(g, 8192, dtype="bf16") == 402_653_184


def test_quantised_bits_agree_with_the_quant_kind():
    g = kv_geometry("gpt2")
    # 4/4 bits, G 32, head_dim 64, per layer and head: K 32 packed + 4 x 64 / 32 = 8, V 32 + 4 x 2 = 8 -> 80 B;
    # x 12 layers x 12 heads = 11,520 B/token
    assert bytes_per_token(g, kv_bits=(4, 4), group_size=32) == 11_520
    opts = QuantOptions(k_bits=4, v_bits=4, group_size=32)
    assert bytes_per_token(g, kv_bits=(4, 4)) == QuantKVCache.bytes_per_token(12, 12, 64, "fp32", opts)
    # 1,024 slots fp32: K: Qk = floor(1023 / 32) x 32 = 992 quantised (31 groups), 32 fp32:
    #   992 x 32 + 31 x 64 x 4 + 32 x 64 x 4 = 31,744 + 7,936 + 8,192 = 47,872
    # V: 1,024 x 32 + 1,024 x 2 x 4 = 40,960; (47,872 + 40,960) x 144 = 12,791,808
    assert kv_cache_bytes(g, 1024, kv_bits=(4, 4)) == 12_791_808
    assert kv_cache_bytes(g, 1024, kv_bits=(4, 4)) == QuantKVCache.nbytes_formula(12, 12, 64, 1024, 1, "fp32",
                                                                                 1024, opts)
    assert kv_cache_bytes(g, 1024, batch=3, kv_bits=(8, 2), group_size=16, dtype="fp16") == \
        QuantKVCache.nbytes_formula(12, 12, 64, 1024, 3, "fp16", 1024, QuantOptions(8, 2, 16))
    # and the storage a real quant cache allocates (tiny: 2 layers, 2 heads, head_dim 32, 128 positions)
    cache = make_cache("quant", 2, 2, 32, 128, 2, dtype=torch.float32, k_bits=4, v_bits=2, group_size=16)
    assert kv_cache_bytes("tiny", 128, batch=2, kv_bits=(4, 2), group_size=16) == cache.nbytes


def test_symmetric_bits_are_llama_cpps_blocks_and_agree_with_the_quant_kind(capsys):
    """scheme=symmetric keeps an fp16 scale per group and no minimum: per 32 values 34 B at 8 bits (llama.cpp's
    q8_0), 18 B at 4 (q4_0). GPT-2, K and V per channel / per token as the kind's defaults, G 32, head_dim 64, per
    layer and head: K 64 + 2 x 64 / 32 = 68, V 32 + 2 x 2 = 36 -> 104 B; x 144 = 14,976 B/token."""
    g = kv_geometry("gpt2")
    assert bytes_per_token(g, kv_bits=(8, 4), scheme="symmetric") == 14_976
    # 1,024 slots fp32: K 992 x 64 + 31 x 64 x 2 + 32 x 64 x 4 = 75,648; V 1,024 x 32 + 1,024 x 2 x 2 = 36,864
    assert kv_cache_bytes(g, 1024, kv_bits=(8, 4), scheme="symmetric") == 144 * (75_648 + 36_864)
    cache = make_cache("quant", 2, 2, 32, 128, 2, k_bits=4, v_bits=2, group_size=16, scheme="symmetric")
    assert kv_cache_bytes("tiny", 128, batch=2, kv_bits=(4, 2), group_size=16, scheme="symmetric") == cache.nbytes
    assert kv_cache_bytes("tiny", 128, batch=2, kv_bits=(4, 2), group_size=16) > cache.nbytes  # + the minimums
    assert main(["gpt2", "--kv-bits", "8,4", "--scheme", "symmetric", "--tokens", "1024", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["scheme"], r["bytes_per_token"], r["bytes"]) == ("symmetric", 14_976, 144 * (75_648 + 36_864))
    assert "2x64/32=4" in r["formula_per_token"] and "31x64x2" in r["formula"]
    assert main(["gpt2", "--scheme", "symmetric"]) == 2
    assert "pass --kv-bits K,V with it" in capsys.readouterr().err


def test_memory_parsing():
    assert parse_memory("80GB") == 80_000_000_000
    assert parse_memory("80GiB") == 85_899_345_920
    assert parse_memory("24e9") == 24_000_000_000
    assert parse_memory("512MB") == 512_000_000
    assert parse_memory("1.5 TiB") == 1_649_267_441_664


def test_cli_prints_integers_and_the_formula(write, capsys):
    assert main(["gpt2"]) == 0
    out = capsys.readouterr().out
    assert "73,728" in out and "75,497,472" in out
    assert "2 (K,V) x 12 layers x 12 kv_heads x 64 head_dim x 4 bytes = 73,728 B/token" in out
    assert main([write("llama3-8b"), "--dtype", "fp16", "--tokens", "8192", "--memory", "80GB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["bytes_per_token"], r["bytes"], r["sequences_that_fit"]) == (131_072, 1_073_741_824, 74)
    assert "2 (K,V) x 32 layers x 8 kv_heads x 128 head_dim x 2 bytes = 131,072 B/token" == r["formula_per_token"]
    assert main([write("gemma2-9b"), "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "2,113,929,216" in out and "21 layers x 8,192 tokens + 21 layers x 4,096 tokens" in out
    assert main(["gpt2", "--kv-bits", "4,4", "--group-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "11,520" in out and "12,791,808" in out and "QuantKVCache" in out


@pytest.mark.parametrize("argv, says", [
    (["no-such-model"], "not a preset"),
    (["@notjson"], "not JSON"),
    (["@nolayers"], "no layer count"),
    (["@badheads"], "not divisible"),
    (["gpt2", "--tokens", "-5"], "tokens must be"),
    (["gpt2", "--memory", "lots"], "cannot read memory"),
    (["gpt2", "--dtype", "fp4"], "unknown dtype"),
    (["@falcon-7b"], "--tokens"),
    (["gpt2", "--kv-bits", "3,3"], "8, 4 or 2"),
])
def test_bad_input_exits_2_with_one_line(argv, says, tmp_path, write, capsys):
    files = {"@notjson": tmp_path / "x.json", "@nolayers": tmp_path / "y.json", "@badheads": tmp_path / "z.json"}
    files["@notjson"].write_text("{not json")
    files["@nolayers"].write_text(json.dumps({"hidden_size": 768}))
    files["@badheads"].write_text(json.dumps({"n_layer": 2, "n_head": 12, "n_embd": 770}))
    files["@falcon-7b"] = write("falcon-7b")
    argv = [str(files.get(a, a)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err


@pytest.mark.slow
def test_module_runs_as_a_script():
    ok = subprocess.run([sys.executable, "-m", "harness.kvcalc", "gpt2"], capture_output=True, text=True,
                        check=False)
    assert ok.returncode == 0 and "73,728" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "harness.kvcalc", "gpt2", "--memory", "x"], capture_output=True,
                         text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_an_evicting_kinds_bytes_under_each_allocation_equal_a_filled_caches(capsys):
    """--evict KIND: the slots per layer and the bytes a real cache of that kind holds once full, under uniform,
    pyramid and ada; the pyramid's layers, worked out by hand from PyramidKV's rule (the mini: 6 layers; snapkv's
    window of 8 reserved, 56 slots on average beyond it: top 56 / 20 = 2.8, bottom 2 x 56 - 2.8 = 109.2, a step of
    21.28 between), hold what uniform's do."""
    from harness.tools.kvcalc import evicting_bytes, evicting_slots
    from models.kv_cache import CACHE_KINDS

    g = kv_geometry("mini")
    slots, _ = evicting_slots(g, "snapkv", 1024, budget=64, allocation="pyramid")
    assert slots == [8 + n for n in (109, 88, 67, 45, 24, 3)] and sum(slots) == 6 * 64
    for allocation in ("uniform", "pyramid", "ada"):
        cache = CACHE_KINDS["snapkv"](6, 2, 64, 300, batch=2, budget=64, allocation=allocation)
        k = torch.randn(2, 2, 300, 64)
        for layer in range(6):  # one forward of 300 tokens, every layer's attention uniform over its keys
            keys = cache.update(layer, k, k)[0].shape[2]
            cache.after_attention(layer, torch.full((2, 2, 300, keys), 1 / keys))
        cache.pos = 300
        assert cache.nbytes == evicting_bytes(g, "snapkv", 300, batch=2, budget=64, allocation=allocation)
        assert sum(map(sum, (cache.slots_of(layer)[0] for layer in range(6)))) == 2 * 6 * 64
    assert main(["mini", "--tokens", "1024", "--evict", "h2o", "--budget", "64", "--allocation", "pyramid"]) == 0
    out = capsys.readouterr().out
    assert "h2o B64 pyramid beta=20 recent=8: slots per K/V head, bottom layer first: 117 96 75 53 32 11" in out
    assert main(["mini", "--budget", "64"]) == 2
    assert "--budget: how an evicting kind spends its slots; pass --evict KIND with it" in capsys.readouterr().err
    assert main(["mini", "--evict", "tova", "--floor", "0.5"]) == 2
    assert "floor=0.5 has no effect with allocation=uniform" in capsys.readouterr().err

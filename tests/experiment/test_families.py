"""Runs on a Llama-family model through run.py: a sweep over both engines (kvlab's Llama and transformers' own)
records the family and its K/V heads, holds the bytes kvcalc says, and is exact; a checkpoint folder of the family
runs by ``model.weights=DIR``; what the family cannot do yet is refused in one line."""

import json
import math

import pytest
import torch

from harness.tools.kvcalc import kv_cache_bytes, kv_geometry
from models.families import build, preset_config
from tests.helpers import NO_REPORT, REPO, run_py

# the tiny run's settings without its model (each test names its own)
SHORT = ["n_prompts=2", "new_tokens=8", "prompt_len=6", "repeats=2", "warmup=1", "context_lengths=[8,32]",
         "tracking=disabled"]


def records(sweep):
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(sweep.glob("*/results.json"))}


@pytest.mark.slow
def test_a_gqa_sweep_on_both_engines_is_exact_and_holds_the_bytes_kvcalc_says(tmp_path):
    sweep = tmp_path / "sweep"
    p = run_py(["-m", "model=tiny-gqa", "engine=kvlab,hf", "cache=prealloc", "max_len=64", *SHORT,
                "measurements=[equivalence,memory]", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = records(sweep)
    assert sorted(r["engine"] for r in runs.values()) == ["hf", "kvlab"]
    expect = kv_cache_bytes(kv_geometry("tiny-gqa"), tokens=64, batch=1, dtype="fp32")
    for r in runs.values():
        assert r["status"] == "ok" and r["tokens_identical"] is True, r
        assert (r["model_family"], r["n_head"], r["n_kv_head"]) == ("llama", 4, 2)
        assert r["cache_nbytes"] == r["predicted_nbytes"] == expect == 2 * 2 * 2 * 16 * 64 * 4
    assert "llama" in (sweep / "report" / "results.csv").read_text()


@pytest.mark.slow
def test_a_checkpoint_with_its_own_tokenizer_reads_the_prompts_file_with_it(tmp_path):
    """A folder with tokenizer.json (here a 300-token BPE trained on the prompts file, for a 300-token model): the
    run's text prompts are its ids, the record names the tokenizer, the sample is decoded with it; without one, a
    vocabulary smaller than GPT-2's is refused in one line."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from models import hf_checkpoint as hf
    from models.llama import Llama, LlamaConfig

    torch.manual_seed(2)
    model = Llama(LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64, vocab_size=300))
    folder = tmp_path / "ckpt"
    hf.write_folder(folder, model.state_dict(), model.hf_config_dict(), fmt=model.hf_format)
    refused = tmp_path / "refused"
    p = run_py(["model=tiny-gqa", f"model.weights={folder}", *SHORT, f"hydra.run.dir={refused}"], tmp_path)
    assert p.returncode == 1 and "GPT-2's 50,257-token vocabulary, but model tiny-gqa has vocab_size 300" in (
        json.loads((refused / "results.json").read_text())["error"] if (refused / "results.json").exists()
        else p.stderr)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train([str(REPO / "harness" / "prompts.txt")], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    run_dir = tmp_path / "run"
    p = run_py(["model=tiny-gqa", f"model.weights={folder}", "measurements=[equivalence]", *SHORT,
                f"hydra.run.dir={run_dir}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((run_dir / "results.json").read_text())
    assert rec["prompt_tokenizer"] == str(folder / "tokenizer.json")
    first = (REPO / "harness" / "prompts.txt").read_text().split("\n\n")[0]
    assert rec["sample_prompt"] == tok.decode(tok.encode(first).ids[:6])  # prompt_len 6 of the file's first text


@pytest.mark.slow
def test_a_llama_checkpoint_folder_runs_by_model_weights(tmp_path):
    torch.manual_seed(1)
    model = build(preset_config("tiny-gqa"))
    folder = tmp_path / "ckpt"
    from models import hf_checkpoint as hf

    hf.write_folder(folder, model.state_dict(), model.hf_config_dict(), fmt=model.hf_format)
    run_dir = tmp_path / "run"
    p = run_py(["model=tiny-gqa", f"model.weights={folder}", "cache=concat", "measurements=[equivalence,memory]",
                *SHORT, f"hydra.run.dir={run_dir}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((run_dir / "results.json").read_text())
    assert rec["status"] == "ok" and rec["model_family"] == "llama" and rec["weights_source"] == str(folder)
    assert rec["cache_nbytes"] == rec["predicted_nbytes"]


def test_the_presets_have_their_own_conf_files():
    for name in ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "tiny-gqa"):
        text = (REPO / "conf" / "model" / f"{name}.yaml").read_text()
        assert f"preset: {name}" in text
        assert preset_config(name).n_kv_head < preset_config(name).n_head  # each is grouped-query


@pytest.mark.slow
def test_a_repositioned_window_runs_8x_past_the_trained_length_and_gpt2_refuses_it(tmp_path):
    """tiny-gqa was built for 128 positions; a run at max_len 1,024 with the re-positioned window is exact against
    its reference, scores a 1,024-token text with a finite NLL and holds S + W slots; GPT-2 refuses the option."""
    run_dir = tmp_path / "stream"
    p = run_py(["model=tiny-gqa", "cache=window", "cache.positions=cache", "cache.window=32", "cache.sinks=4",
                "max_len=1024", "drift_text_len=1024", "drift_texts=1", "prompts_file=models/weights/mini/heldout.txt",
                "measurements=[equivalence,text_drift,memory]", *SHORT, f"hydra.run.dir={run_dir}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((run_dir / "results.json").read_text())
    assert rec["status"] == "ok" and rec["tokens_identical"] is True and rec["max_len"] == 1024
    assert rec["cache_nbytes"] == rec["predicted_nbytes"] == 2 * 2 * 2 * 16 * 36 * 4  # 36 slots at any length
    assert math.isfinite(rec["text_nll"]) and math.isfinite(rec["drift_delta_nll"])
    g2 = tmp_path / "gpt2"
    p = run_py(["model=tiny", "cache=window", "cache.positions=cache", *SHORT, f"hydra.run.dir={g2}"], tmp_path)
    rec = json.loads((g2 / "results.json").read_text())
    assert p.returncode == 1 and "positions=cache re-positions keys by their place in the cache, which needs " \
                                  "rotary positions" in rec["error"]


@pytest.mark.slow
def test_experiment_gqa_measures_bytes_halving_with_the_kv_heads_and_refuses_heads_it_cannot_build(tmp_path):
    """experiment=gqa: one width, 8, 4, 2 and 1 K/V heads; each run exact, its bytes the formula, each half the
    last. model.n_kv_head is refused in one line on GPT-2, on a checkpoint, and where it does not divide the heads."""
    sweep = tmp_path / "gqa"
    p = run_py(["experiment=gqa", "repeats=2", "warmup=1", "context_lengths=[64]", "n_prompts=1", "new_tokens=4",
                "tracking=disabled", NO_REPORT, f"hydra.sweep.dir={sweep}"], tmp_path)  # its report is not read
    assert p.returncode == 0, p.stderr[-3000:]
    runs = sorted(records(sweep).values(), key=lambda r: -r["n_kv_head"])
    assert [r["n_kv_head"] for r in runs] == [8, 4, 2, 1] and all(r["n_head"] == 8 for r in runs)
    assert all(r["status"] == "ok" and r["tokens_identical"] and r["cache_nbytes"] == r["predicted_nbytes"]
               for r in runs)
    assert [r["bytes_per_token"] for r in runs] == [2 * 4 * n * 64 * 4 for n in (8, 4, 2, 1)]
    assert [r["model"] for r in runs] == [f"gqa-base kv{n}" for n in (8, 4, 2, 1)]
    refusals = [(["model=tiny", "model.n_kv_head=1"], "tiny (gpt2) has one K/V head per query head"),
                (["model=gqa-base", "model.n_kv_head=3"], "n_kv_head 3 does not divide n_head 8"),
                (["model=tiny-gqa", f"model.weights={REPO}", "model.n_kv_head=1"],
                 "loads a checkpoint whose heads are its own")]
    for i, (args, says) in enumerate(refusals):
        run_dir = tmp_path / f"refused-{i}"
        p = run_py([*args, *SHORT, f"hydra.run.dir={run_dir}"], tmp_path)
        rec = json.loads((run_dir / "results.json").read_text())
        assert p.returncode == 1 and says in rec["error"], rec["error"]
        assert "Traceback" not in p.stderr


def test_keys_added_later_keep_the_ids_of_runs_made_before_them_at_their_old_meaning():
    """A resumed sweep recognises its finished runs: a config id is the same with model.n_kv_head null, group_score
    mean, positions absolute, k_pre_rope false, engine.rotate auto, allocation uniform, beta 20 or floor 0.2 as it was
    before those keys existed, and differs otherwise."""
    from omegaconf import OmegaConf

    from harness.experiment.config import LATER_KEYS, config_id, later_nodes

    before = {"model": {"name": "tiny", "preset": "tiny", "weights": "random", "seed": 0},
              "cache": {"kind": "h2o", "budget": 8, "recent": 2}, "dtype": {"storage": "fp32"},
              "engine": {"name": "llamacpp"}}
    old = config_id(OmegaConf.create(before))
    for (group, key), default in LATER_KEYS.items():
        now = {**before, group: {**before[group], key: default}}
        assert config_id(OmegaConf.create(now)) == old, key
        other = {None: 4, "mean": "max", "absolute": "cache", False: True, "auto": "none", "uniform": "ada", 20.0: 4.0,
                 0.2: 0.5}[default]
        assert config_id(OmegaConf.create({**before, group: {**before[group], key: other}})) != old, key
    for name, default in later_nodes().items():  # a node added later (serve), at its defaults
        assert config_id(OmegaConf.create({**before, name: default})) == old, name
        assert config_id(OmegaConf.create({**before, name: {**default, "requests": 8}})) != old, name


def test_what_a_kind_cannot_do_on_this_model_is_refused_before_anything_runs():
    """check_model / validate on composed configs: group_score=max where no query heads share a K/V head, the
    re-positioned window with ragged prompts, and the fused GQA step off the CPU are refused in one line; on the
    CPU (device=auto here resolves to it) the fused GQA step is allowed."""
    from hydra import compose, initialize_config_dir

    from harness.experiment.config import ConfigError, check_model, read, register, validate

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        def rc(*overrides):
            return read(compose(config_name="config", overrides=list(overrides)))

        with pytest.raises(ConfigError, match="group_score=max has no effect on model tiny"):
            check_model(rc("model=tiny", "cache=h2o", "cache.group_score=max"), preset_config("tiny"))
        check_model(rc("model=tiny-gqa", "cache=h2o", "cache.group_score=max"), preset_config("tiny-gqa"))
        with pytest.raises(ConfigError, match="does not run ragged batches \\(with positions=cache"):
            validate(rc("model=tiny-gqa", "cache=window", "cache.positions=cache", "prompt_lengths=ragged",
                        "batch=3"), 128, 16)
        with pytest.raises(ConfigError, match="off the CPU reads one K/V head per query head"):
            check_model(rc("model=tiny-gqa", "cache=quant", "compile=true", "device=cuda"), preset_config("tiny-gqa"))
        if not torch.cuda.is_available():
            check_model(rc("model=tiny-gqa", "cache=paged", "compile=true", "device=auto"), preset_config("tiny-gqa"))


def test_a_checkpoint_of_another_family_than_the_preset_is_refused_naming_both(tmp_path):
    """model=tiny (GPT-2) with a Llama folder would run a Llama model labelled as GPT-2's preset: refused in one line
    before anything is built."""
    from harness.experiment import weights
    from harness.experiment.config import ConfigError
    from harness.experiment.plan import ModelChoice
    from harness.experiment.prepare import model_config
    from models import hf_checkpoint as hf

    torch.manual_seed(1)
    model = build(preset_config("tiny-gqa"))
    folder = tmp_path / "llama"
    hf.write_folder(folder, model.state_dict(), model.hf_config_dict(), fmt=model.hf_format)
    m = ModelChoice(name="tiny", preset="tiny", weights=str(folder), seed=0)
    with pytest.raises(ConfigError, match="holds a llama checkpoint, and model=tiny is a gpt2 preset"):
        model_config(weights.resolve(m), m)
    ok = ModelChoice(name="tiny-gqa", preset="tiny-gqa", weights=str(folder), seed=0)
    assert model_config(weights.resolve(ok), ok).n_kv_head == 2


@pytest.mark.slow
def test_a_checkpoint_trained_with_a_first_token_gets_it_in_front_of_every_sequence(tmp_path):
    """config.json's kvlab_bos: every prompt, text and retrieval sequence of a run starts with bos_token_id (the
    sequence keeps its length), recorded as first_token; a checkpoint without it gets none; a bad flag is one line."""
    from models import hf_checkpoint as hf

    torch.manual_seed(3)
    model = build(preset_config("tiny-gqa"))
    folder = tmp_path / "ckpt"
    hf.write_folder(folder, model.state_dict(), {**model.hf_config_dict(), "bos_token_id": 50256, hf.FIRST_TOKEN_KEY:
                                                 True}, fmt=model.hf_format)
    assert hf.first_token(folder) == 50256
    run_dir = tmp_path / "run"
    p = run_py(["model=tiny-gqa", f"model.weights={folder}", "measurements=[equivalence,retrieval]", "max_len=64",
                "retrieval_n=40", *SHORT, f"hydra.run.dir={run_dir}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((run_dir / "results.json").read_text())
    assert rec["first_token"] == 50256 and rec["sample_prompt"].startswith("<|endoftext|>")
    assert rec["retrieval_n"] == 31 and rec["tokens_identical"] is True  # 1 + 2 x 31 tokens fit in max_len 64
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, hf.FIRST_TOKEN_KEY: "yes"}))
    with pytest.raises(hf.CheckpointError, match="kvlab_bos must be true or false"):
        hf.first_token(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "bos_token_id": cfg["vocab_size"]}))
    with pytest.raises(hf.CheckpointError, match=r"bos_token_id is 50257; give .* \(0 .. vocab_size - 1\)"):
        hf.first_token(folder)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != hf.FIRST_TOKEN_KEY}))
    assert hf.first_token(folder) is None


def test_led_keeps_a_sequences_length_and_puts_the_first_token_in_front():
    from harness.core.inputs import led

    assert led(torch.tensor([[5, 6, 7]]), 9).tolist() == [[9, 5, 6]]
    assert led(torch.tensor([5, 6, 7]), 9).tolist() == [9, 5, 6]

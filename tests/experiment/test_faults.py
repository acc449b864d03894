"""Every bad input answered: one clear line that says what was wrong and what would be right, a non-zero exit where
it ends the run, no traceback, nothing half-written. Each case has an id; docs/faults.md's "Bad inputs and faults" table
lists the same ids (``test_the_readme_table_lists_every_case``)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.experiment.config import ConfigError, validate
from harness.core.inputs import text_prompts
from models.generate import decode_step, greedy, new_cache, prefill
from models.gpt2 import GPT2, CheckpointError
from models.kv_cache import kv_bytes, make_cache
from models.tokenizer import Tokenizer
from tests.helpers import NO_REPORT, QUICK, REPO, TINY, case_ids, run_py
from tests.helpers.inproc import run_here
from tests.helpers.checkpoints import edit_config, edit_weights, hf_checkpoint, nan_weight
from tests.helpers.inproc import compose_cfg

# ---- config values: refused before any work -------------------------------------------------------------------

CONFIG = [
    ("n-prompts-zero", ["n_prompts=0"], "n_prompts=0 must be at least 1"),
    ("new-tokens-zero", ["new_tokens=0"], "new_tokens=0 must be at least 1"),
    ("prompt-len-zero", ["prompt_len=0"], "prompt_len=0 must be at least 1"),
    ("repeats-zero", ["repeats=0"], "repeats=0 must be at least 1"),
    ("warmup-negative", ["warmup=-1"], "warmup=-1 must be 0 or more"),
    ("drift-text-len-one", ["drift_text_len=1"], "drift_text_len=1 must be at least 2"),
    ("batch-size-zero", ["batch_sizes=[0,8]"], "batch_sizes has 0: give batch sizes >= 1"),
    ("max-len-too-long", ["max_len=2048"], "max_len=2048 > n_positions=1024"),
    ("lengths-past-max-len", ["new_tokens=1000"], "prompt_len + new_tokens = 32 + 1000 > max_len=1024"),
    ("context-past-max-len", ["context_lengths=[32,1024]"], "context_lengths has 1024"),
    ("contexts-empty", ["context_lengths=[]"], "context_lengths is empty"),
    ("context-repeated", ["context_lengths=[8,32,32]"], "repeats a length"),
    ("storage-dtype-unknown", ["dtype.storage=fp8"], "dtype.storage='fp8'"),
    ("compute-dtype-unknown", ["dtype.compute=int8"], "dtype.compute='int8'"),
    ("device-unknown", ["device.name=tpu"], "device='tpu'"),
    ("engine-unknown", ["engine.name=vllm"], "engine='vllm': use one of kvlab, hf"),
    ("tracking-mode-unknown", ["tracking.mode=loud"], "tracking.mode='loud'"),
    ("prompts-source-unknown", ["prompts=web"], "prompts='web'"),
    ("full-prompts-negative", ["full_prompts=-1"], "full_prompts=-1"),
    ("seed-negative", ["seed=-1"], "seed=-1: use an integer 0 <= seed < 2**63"),
    ("seed-huge", ["model.seed=100000000000000000000000"], "model.seed=100000000000000000000000"),
    ("wandb-project-name", ["tracking.project=team/kv"], "W&B names are 1-128 characters"),
    ("model-name-empty", ["model.name= "], "model.name is empty"),
    ("cache-kind-unknown", ["cache.kind=lru"], "cache.kind='lru': use one of concat, prealloc"),
    ("cache-option-range", ["cache=quant", "cache.k_bits=3"], "cache option k_bits=3: use 8, 4 or 2"),
    ("cache-window-zero", ["cache=window", "cache.window=0"], "window must be an integer >= 1"),
    ("window-budget-not-above-sinks", ["cache=window", "cache.budget=4"], "cache option budget 4 must be more than "
     "sinks 4"),
    ("window-budget-over-max-len", ["cache=window", "cache.budget=300", "max_len=256"],
     "cache=window: cache option budget 300 is more than max_len 256"),
    ("batch-zero", ["batch=0"], "batch=0 must be an integer >= 1 (sequences served together)"),
    ("prompt-lengths-unknown", ["prompt_lengths=zigzag"], "prompt_lengths='zigzag': use one of uniform, ragged"),
    ("ragged-on-quant", ["cache=quant", "prompt_lengths=ragged"],
     "prompt_lengths=ragged: cache kind 'quant' does not run ragged batches (its K groups span tokens"),
    ("ragged-on-hf", ["engine=hf", "prompt_lengths=ragged"],
     "prompt_lengths=ragged: engine=hf runs batches of one prompt length here; use engine=kvlab"),
    ("hf-no-counterpart", ["engine=hf", "cache=window"],
     "engine=hf cache=window: HF transformers has no counterpart of cache kind 'window' here: it runs concat"),
    ("hf-storage-dtype", ["engine=hf", "dtype=fp16"],
     "engine=hf: HF caches store K/V in the model's dtype: dtype.storage=fp16 with compute fp32; set "
     "dtype.compute=fp16"),
    ("hf-quant-bits", ["engine=hf", "cache=quant/token", "cache.k_bits=8"],
     "engine=hf cache=quant: HF's QuantizedCache does not run k_bits=8 (quanto quantises K and V to one width, its "
     "nbits: 4 or 2): pass cache.k_bits=4, or use engine=kvlab"),
    ("hf-quant-rotate", ["engine=hf", "cache=quant/token", "cache.rotate=hadamard"],
     "engine=hf cache=quant: HF's QuantizedCache does not run rotate=hadamard (quanto rotates nothing): pass "
     "cache.rotate=none, or use engine=kvlab"),
    # HF runs quant per token, both K and V, and nothing else: every option it cannot honour is refused, none ignored
    ("hf-quant-k-axis", ["engine=hf", "cache=quant"],
     "engine=hf cache=quant: HF's QuantizedCache does not run k_axis=channel (quanto groups K per token, axis_key=0: "
     "its per-channel axis fails on a growing cache): pass cache.k_axis=token, or use engine=kvlab"),
    ("hf-quant-quantize", ["engine=hf", "cache=quant/token", "cache.quantize=v"],
     "engine=hf cache=quant: HF's QuantizedCache does not run quantize=v (QuantizedCache quantises K and V both): "
     "pass cache.quantize=kv, or use engine=kvlab"),
    ("hf-quant-v-axis", ["engine=hf", "cache=quant/token", "cache.v_axis=channel"],
     "engine=hf cache=quant: HF's QuantizedCache does not run v_axis=channel (quanto groups V per token, "
     "axis_value=0): pass cache.v_axis=token, or use engine=kvlab"),
    ("hf-quant-v-bits", ["engine=hf", "cache=quant/token", "cache.k_bits=2"],
     "engine=hf cache=quant: HF's QuantizedCache does not run v_bits=4 (quanto quantises K and V to one width, its "
     "nbits: v_bits must equal k_bits): pass cache.v_bits=2, or use engine=kvlab"),
    ("hf-quant-residual-one", ["engine=hf", "cache=quant/token", "cache.residual=1"],
     "engine=hf cache=quant: HF's QuantizedCache does not run residual=1 (quanto flushes its full-precision tail "
     "every residual_length steps, and at 1 every step as at 0): pass cache.residual=0, or use engine=kvlab"),
    ("hf-quant-group-size", ["engine=hf", "cache=quant/token", "cache.group_size=48"],
     "engine=hf cache=quant: HF's QuantizedCache does not run group_size=48 (quanto's q_group_size must divide the "
     "head size 64): pass cache.group_size=32, or use engine=kvlab"),
    # options with no effect at the run's max_len or head size: refused, never labelled as what did not run
    ("window-never-slides", ["cache=window", "cache.window=1020"],
     "cache=window: sinks 4 + window 1020 = 1024 slots hold every token a sequence of max_len=1024 can have: the "
     "window never slides at that max_len and the run is full attention; use sinks + window < 1024"),
    ("window-sinks-never-slide", ["cache=window", "cache.sinks=2000"],
     "cache=window: sinks 2000 + window 32 = 2032 slots hold every token a sequence of max_len=1024 can have"),
    ("window-given-with-budget", ["cache=window", "cache.budget=64", "cache.window=100"],
     "cache=window: cache option window=100 has no effect with budget=64: the window is budget - sinks = 60; give "
     "window alone (budget=0) or budget alone"),
    ("eviction-budget-equals-max-len", ["cache=h2o", "cache.budget=256", "max_len=256"],
     "cache=h2o: cache option budget 256 equals max_len 256: it keeps every token a sequence can have, so nothing "
     "is ever evicted and the run is full attention; use budget < 256"),
    ("snapkv-kernel-too-wide", ["cache=snapkv", "cache.kernel=2049"],
     "cache=snapkv: cache option kernel=2049 is wider than any prompt of max_len=1024 needs: from 2047 on, every "
     "key's pooling window spans every key, so wider runs the same; use kernel <= 2047"),
    ("random-seed-negative", ["cache=random", "cache.seed=-1"],
     "cache=random: cache option seed must be an integer 0 <= seed < 2**32"),
    ("random-seed-aliased", ["cache=random", "cache.seed=4294967296"],
     "(the hash is 32-bit: seed and seed + 2**32 keep the same positions), got 4294967296"),
    ("quant-residual-over-max-len", ["cache=quant", "cache.residual=1024"],
     "cache=quant: cache option residual=1024 keeps every one of max_len=1024 tokens in full precision, so nothing "
     "is ever quantised: use residual < 1024"),
    ("quant-channel-group-never-fills", ["cache=quant", "cache.residual=1000"],
     "cache=quant: K is grouped per channel over group_size=32 tokens beyond the newest residual=1000: at "
     "max_len=1024 no group ever fills (that needs residual + group_size < max_len), so K is never quantised"),
    ("quant-group-over-head", ["cache=quant/token", "cache.group_size=128"],
     "cache=quant: cache option group_size=128 is more than the head size 64: a per-token group spans at most the "
     "head's 64 channels, so it runs as group_size=64 would; use group_size <= 64"),
    ("paged-block-size-over-max-len", ["cache=paged", "cache.block_size=2048"],
     "cache=paged: cache option block_size=2048 is more than max_len=1024: a block's slots past max_len never hold "
     "a token; use block_size <= 1024"),
    ("paged-pool-too-small", ["cache=paged", "cache.blocks=5"],
     "cache=paged: cache option blocks=5 is too few for this run: the decode step at context 512 holds 1 sequence "
     "of 513 tokens, 33 blocks of 16; use cache.blocks >= 33 (or blocks=0: every sequence can reach max_len)"),
    ("paged-pool-too-small-batch", ["cache=paged", "cache.blocks=40", "batch=16", "context_lengths=[32]"],
     "cache=paged: cache option blocks=40 is too few for this run: the served batch of 16 holds 16 sequences of 63 "
     "tokens, 64 blocks of 16; use cache.blocks >= 64"),
    ("batch-context-over-max-len", ["batch_sizes=[1,8]", "batch_context=2000"],
     "batch_context=2000: a batch timed at context c needs 1 <= c < max_len=1024; use batch_context <= 1023"),
    # every count is bounded before anything is read or allocated by it
    ("n-prompts-huge", ["n_prompts=100000000"],
     "n_prompts=100000000 is over kvlab's cap of 10,000 prompts per run: give 1 .. 10,000"),
    ("repeats-huge", ["repeats=100000"], "repeats=100000 is over kvlab's cap of 10,000 timed repeats per step: give "
     "1 .. 10,000"),
    ("warmup-huge", ["warmup=5000"], "warmup=5000 is over kvlab's cap of 1,000 warm-up steps: give 0 .. 1,000"),
    ("full-prompts-huge", ["full_prompts=20000"],
     "full_prompts=20000 is over kvlab's cap of 10,000 prompts: give 0 .. 10,000 (n_prompts caps it)"),
    ("retrieval-k-huge", ["retrieval_k=5000"], "retrieval_k=5000 is over kvlab's cap of 1,000 sequences: give "
     "1 .. 1,000"),
    ("contexts-too-many", [f"context_lengths=[{','.join(map(str, range(1, 102)))}]"],
     "context_lengths has 101 lengths, over kvlab's cap of 100 per run: give at most 100"),
    ("batch-sizes-too-many", [f"batch_sizes=[{','.join(map(str, range(1, 102)))}]"],
     "batch_sizes has 101 sizes, over kvlab's cap of 100 per run: give at most 100"),
    ("batch-size-repeated", ["batch_sizes=[1,8,8]"], "batch_sizes [1, 8, 8] repeats a size: give each once"),
    ("quant-axis-unknown", ["cache=quant", "cache.k_axis=row"], "cache option k_axis='row': use channel or token"),
    ("paged-block-size-zero", ["cache=paged", "cache.block_size=0"], "block_size must be an integer >= 1"),
    ("compile-not-prealloc", ["cache=concat", "compile=true"],
     "compile=true compiles the pre-allocated kind's decode step (static shapes) and the decode attention of the "
     "kinds that read K/V where they lie (quant, paged): use cache=prealloc or cache=quant or cache=paged, not "
     "cache=concat"),
    ("eviction-budget-zero", ["cache=h2o", "cache.budget=0"], "cache option budget must be an integer >= 1"),
    ("eviction-budget-over-max-len", ["cache=tova", "cache.budget=300", "max_len=256"],
     "cache=tova: cache option budget 300 is more than max_len 256"),
    ("h2o-recent-over-budget", ["cache=h2o", "cache.budget=8", "cache.recent=9"],
     "cache option recent 9 must be at most budget 8"),
    ("snapkv-kernel-even", ["cache=snapkv", "cache.kernel=4"], "cache option kernel must be an odd integer >= 1"),
    ("snapkv-window-over-prompt", ["cache=snapkv", "prompt_len=6", "cache.window=8"],
     "cache=snapkv: prompt_len=6 is shorter than the 8 prompt tokens this kind needs"),
    ("snapkv-ragged", ["cache=snapkv", "prompt_lengths=ragged"],
     "cache=snapkv: prompt_lengths=ragged draws prompts of 1 .. prompt_len tokens"),
    ("hf-eviction", ["engine=hf", "cache=h2o"],
     "engine=hf cache=h2o: HF transformers has no counterpart of cache kind 'h2o' here"),
]
HYDRA = [  # refused by Hydra while composing, against kvlab's typed schema
    ("group-option-unknown", ["cache=lru"], "Could not find 'cache/lru'"),
    ("engine-option-unknown", ["engine=vllm"], "Could not find 'engine/vllm'"),
    ("value-wrong-type", ["n_prompts=many"], "n_prompts"),
    ("option-of-another-kind", ["cache=quant", "cache.window=8"], "Could not override 'cache.window'"),
    ("key-unknown", ["n_promts=3"], "n_promts"),
]


@pytest.mark.parametrize("case,overrides,message", CONFIG, ids=[c[0] for c in CONFIG])
def test_config_values_are_refused_in_one_line(case, overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(overrides), 1024, 64)  # gpt2's geometry, the default model's
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case,overrides,message", HYDRA, ids=[c[0] for c in HYDRA])
def test_hydra_refuses_what_the_schema_does_not_allow(case, overrides, message):
    with pytest.raises(Exception, match=re.escape(message)):
        compose_cfg(overrides)


@pytest.mark.slow
def test_a_refused_config_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    proc = run_py([*TINY, "warmup=-1", "tracking=disabled", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "warmup=-1 must be 0 or more" in proc.stderr
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "failed" and not (out / "steps.csv").exists()
    proc = run_py([*TINY, "cache=lru", f"hydra.run.dir={tmp_path / 'x'}"], tmp_path)
    assert proc.returncode == 1 and "Could not find 'cache/lru'" in proc.stderr and "Traceback" not in proc.stderr


# ---- checkpoints ----------------------------------------------------------------------------------------------

class Payload:
    """Unpickling this would create a marker file: a pickle-only checkpoint must never be unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def pickle_only(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"transformer.wte.weight": Payload(folder.parent / "PWNED")}, folder / "pytorch_model.bin")


CHECKPOINTS = [
    ("ckpt-missing", lambda d: d.rename(d.with_name("gone")), "no such checkpoint folder"),
    ("ckpt-is-a-file", None, "is a file"),  # model.weights=.../config.json
    ("ckpt-bad-json", lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    ("ckpt-empty-json", lambda d: (d / "config.json").write_text(""), "not valid JSON"),
    ("ckpt-json-list", lambda d: (d / "config.json").write_text("[1, 2]"), "holds a JSON list"),
    ("ckpt-missing-n-embd", lambda d: edit_config(d, lambda c: {k: v for k, v in c.items() if k != "n_embd"}),
     "missing 'n_embd'"),
    ("ckpt-n-head-zero", lambda d: edit_config(d, lambda c: {**c, "n_head": 0}), "n_head must be a positive"),
    ("ckpt-n-head-string", lambda d: edit_config(d, lambda c: {**c, "n_head": "two"}), "n_head must be a positive"),
    ("ckpt-huge-positions", lambda d: edit_config(d, lambda c: {**c, "n_positions": 10 ** 10}),
     "is beyond what kvlab builds"),
    ("ckpt-not-gpt2", lambda d: edit_config(d, lambda c: {**c, "model_type": "llama"}), "kvlab loads only 'gpt2'"),
    ("ckpt-wrong-shape", lambda d: edit_config(d, lambda c: {**c, "n_positions": 32}), "has shape"),
    ("ckpt-corrupt-safetensors", lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage" * 10),
     "not a readable safetensors file"),
    ("ckpt-pickle-only", pickle_only, "cannot be read with weights_only=True"),
    ("ckpt-extra-tensors", lambda d: edit_weights(d, lambda s: {**s, "transformer.h.9.mlp.c_fc.weight":
                                                                 torch.zeros(2)}), "does not account for"),
    ("ckpt-nan-weights", lambda d: edit_weights(d, nan_weight), "non-finite values (NaN/inf)"),
]


@pytest.mark.parametrize("case,fault,message", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_checkpoint_faults_name_the_file_and_what_is_wrong(tmp_path, case, fault, message):
    folder = hf_checkpoint(tmp_path / "ckpt")
    target = folder
    if case == "ckpt-is-a-file":
        target = folder / "config.json"
    else:
        fault(folder)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(target)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "PWNED").exists()  # the pickle payload never ran


@pytest.mark.slow
def test_nan_weights_fail_the_run_never_called_equivalent(tmp_path):
    folder = hf_checkpoint(tmp_path / "ckpt")
    edit_weights(folder, nan_weight)
    out = tmp_path / "run"
    proc = run_py([*TINY, f"model.weights={folder}", "prompts=random", "tracking=disabled", f"hydra.run.dir={out}"],
                  tmp_path)
    record = json.loads((out / "results.json").read_text())
    assert proc.returncode == 1 and record["status"] == "failed" and record.get("tokens_identical") is None
    assert "transformer.h.0.attn.c_attn.weight" in record["error"] and "non-finite" in record["error"]
    assert "Traceback" not in proc.stderr


def test_non_finite_values_made_while_running_fail_with_where(tiny_model):
    import copy

    from harness import measurements
    from harness.core import measure
    from harness.core.engines import KvlabEngine

    bad = copy.deepcopy(tiny_model)
    with torch.no_grad():
        bad.transformer.h[1].attn.c_attn.bias[64 + 3] = -1e6  # a K channel below fp16's range: quant scales fail
    spec = measure.CacheSpec("quant", {"group_size": 2})
    with pytest.raises(measure.NonFiniteError, match="in the cached generation of prompt 0 at step 0; first "
                                                     "non-finite values in the K/V the quant cache returned at "
                                                     "layer 1"):
        measurements.run_on(KvlabEngine(bad), spec, [torch.tensor([[1, 2, 3]])], 5, full_prompts=1)
    with torch.no_grad():
        bad = copy.deepcopy(tiny_model)
        bad.transformer.h[0].mlp.c_proj.bias[0] = float("inf")
    with pytest.raises(measure.NonFiniteError, match="first non-finite values in the weight"):
        measurements.run_on(KvlabEngine(bad), measure.CacheSpec("prealloc"), [torch.tensor([[1, 2, 3]])], 5,
                            full_prompts=1)


@pytest.mark.slow
def test_text_prompts_on_a_small_vocabulary_model(tmp_path):
    folder = hf_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    proc = run_py([*TINY, f"model.weights={folder}", "tracking=disabled", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 1 and "vocab_size 300: use prompts=random" in proc.stderr
    assert "IndexError" not in proc.stderr and "Traceback" not in proc.stderr


# ---- prompts files --------------------------------------------------------------------------------------------

PROMPTS = [
    ("prompts-missing", None, "does not exist"),
    ("prompts-empty", b"", "has no text"),
    ("prompts-whitespace", b"  \n\t\n   \n", "has no text"),
    ("prompts-binary", bytes(range(256)) * 4, "is not UTF-8 text"),
    ("prompts-folder", "folder", "is a folder"),
]


@pytest.mark.parametrize("case,content,message", PROMPTS, ids=[c[0] for c in PROMPTS])
def test_prompts_file_faults(tmp_path, monkeypatch, capsys, case, content, message):
    path = tmp_path / "prompts.txt"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    if case == "prompts-missing":  # checked in the run, before tokenizing (the run's door, in this process)
        got = run_here(monkeypatch, [*TINY, f"prompts_file={path}", "tracking=disabled"], tmp_path / "r")
        err = capsys.readouterr().err
        assert got["status"] == "failed" and message in err and "Traceback" not in err
        return
    with pytest.raises(ConfigError, match=message):
        text_prompts(path, 2, 8, Tokenizer())


def test_a_long_prompts_file_costs_what_the_prompts_read(tmp_path):
    """40,000 short lines used to take 50 s to cut two prompts; only the paragraphs the prompts read are tokenized."""
    path = tmp_path / "many.txt"
    path.write_text("".join(f"line {i} of many.\n" for i in range(40_000)))

    class Counting(Tokenizer):
        calls = 0

        def encode(self, text):
            Counting.calls += 1
            return super().encode(text)

    prompts = text_prompts(path, 2, 16, Counting())
    assert len(prompts) == 2 and all(p.shape == (1, 16) for p in prompts)
    assert Counting.calls < 100  # of 40,000 lines


# ---- the Python API -------------------------------------------------------------------------------------------

def api_cases(model):
    cache = new_cache(model, "prealloc", max_len=6)
    prefill(model, torch.tensor([[1, 2, 3, 4, 5, 6]]), cache)
    c = model.config
    return {
        "api-empty-prompt": (lambda: greedy(model, [], 3), "(B, T) with B, T >= 1"),
        "api-3d-ids": (lambda: greedy(model, torch.zeros(1, 2, 3, dtype=torch.long), 3), "(B, T) with B, T >= 1"),
        "api-float-ids": (lambda: greedy(model, torch.tensor([[1.0, 2.0]]), 3), "token ids must be integers"),
        "api-negative-ids": (lambda: greedy(model, [[5, -1]], 3), "token ids must lie in [0, 50257)"),
        "api-ids-out-of-range": (lambda: greedy(model, [[5, 50257]], 3), "token ids must lie in [0, 50257)"),
        "api-decode-past-max-len": (lambda: decode_step(model, torch.tensor([[7]]), cache),
                                    "KV cache overflow: pos 6 + 1 new tokens > max_len 6"),
        "api-cache-other-geometry": (
            lambda: prefill(model, torch.tensor([[1, 2]]), make_cache("prealloc", c.n_layer, 4, 16, 8)),
            "but this cache holds (batch, heads, t, head_dim) = (1, 4, t, 16)"),
        "api-cache-other-batch": (
            lambda: prefill(model, torch.tensor([[1, 2], [3, 4]]), new_cache(model, "concat", max_len=8)),
            "k_new has shape (2, 2, 2, 32) but this cache holds"),
        "api-restore-foreign-snapshot": (
            lambda: new_cache(model, "prealloc", max_len=9).restore(cache.snapshot()), "cannot restore into one"),
        "api-integer-cache-dtype": (lambda: greedy(model, [[1, 2]], 3, "prealloc", cache_dtype=torch.int8),
                                    "torch.int8 is not a K/V storage dtype"),
        "api-negative-bytes": (lambda: kv_bytes(12, 12, 64, -5), "n_tokens must be an integer >= 0"),
        "api-two-tokens-decode": (lambda: decode_step(model, torch.tensor([[1, 2]]), new_cache(model, "concat", 8)),
                                  "exactly one token"),
        "api-ragged-on-quant": (lambda: greedy(model, [[1, 2, 3], [4]], 3, "quant"),
                                "cache kind 'quant' does not run ragged batches"),
        "api-pad-too-wide": (lambda: model(torch.zeros(2, 3, dtype=torch.long), pad=[0, 3]),
                             "pad must lie in [0, 3) so that every sequence of the 3 slots keeps a token"),
        "api-paged-pool-empty": (
            lambda: prefill(model, torch.zeros(2, 9, dtype=torch.long),
                            new_cache(model, "paged", max_len=40, batch=2, block_size=4, blocks=5)),
            "paged pool out of blocks: 6 more needed, 5 of 5 free"),
    }


API = ["api-empty-prompt", "api-3d-ids", "api-float-ids", "api-negative-ids", "api-ids-out-of-range",
       "api-decode-past-max-len", "api-cache-other-geometry", "api-cache-other-batch", "api-restore-foreign-snapshot",
       "api-integer-cache-dtype", "api-negative-bytes", "api-two-tokens-decode", "api-ragged-on-quant",
       "api-pad-too-wide", "api-paged-pool-empty"]


@pytest.mark.parametrize("case", API)
def test_python_api_misuse_says_what_is_wrong(tiny_model, case):
    call, message = api_cases(tiny_model)[case]
    with pytest.raises(ValueError) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- the run's surroundings -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_an_unwritable_outputs_folder(tmp_path):
    for where in ("hydra.run.dir=/proc/kvlab/run", "hydra.sweep.dir=/proc/kvlab/sweep"):
        proc = run_py([*TINY, "tracking=disabled", where] + (["-m"] if "sweep" in where else []), tmp_path)
        assert proc.returncode == 2 and "cannot write the" in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_ctrl_c_mid_run_leaves_a_clear_record_and_nothing_half_written(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_DIR=str(tmp_path))
    args = [sys.executable, "run.py", "model=tiny", "n_prompts=30", "full_prompts=30", "new_tokens=90",
            "prompt_len=8", "repeats=200", "context_lengths=[8,32,64]", "tracking=disabled",
            f"hydra.run.dir={out}"]  # a minute of work: Ctrl-C lands in the middle of it
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / ".hydra" / "config.yaml").exists():
        time.sleep(0.2)
    time.sleep(3.0)  # well into the measurements
    assert not (out / "results.json").exists() and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-1500:]
    assert "Traceback" not in stderr and "interrupted" in stderr
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "interrupted" and "resume" in record["error"]
    assert not list(out.glob(".*.tmp")) and not (out / "steps.csv").exists()


@pytest.mark.slow
def test_online_tracking_without_a_key_falls_back_to_offline(tmp_path):
    out = tmp_path / "run"
    env = {"WANDB_API_KEY": "", "WANDB_BASE_URL": "http://127.0.0.1:9"}
    proc = run_py([*QUICK, "tracking=online", f"hydra.run.dir={out}"], tmp_path, {**env, "WANDB_MODE": ""})
    assert proc.returncode == 0 and "logging offline instead" in proc.stderr
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
def test_the_report_builds_from_whatever_is_readable(tmp_path):
    from harness.analysis.report import build_report

    # the measurements whose tables it spoils; no sweep report: the test builds its own from the folder
    proc = run_py(["-m", "cache=concat,prealloc", *TINY, "measurements=[equivalence,memory,step_time]",
                   "tracking=disabled", NO_REPORT, f"hydra.sweep.dir={tmp_path / 's'}"], tmp_path)
    assert proc.returncode == 0
    runs = sorted(p for p in (tmp_path / "s").iterdir() if (p / "results.json").exists())
    (runs[0] / "steps.csv").write_bytes(b"\x00\xff" * 50)  # binary
    (runs[1] / "memory.csv").write_text("a,b\n1,2\n")  # another tool's table
    good = json.loads((runs[0] / "results.json").read_text())
    for name, text in (("list", "[1, 2]"), ("foreign", '{"status": "ok", "score": 3}'), ("broken", "{"),
                       ("almost", '{"status": "ok", "run_name": "x", "model": "m", "cache": "c"}'),
                       ("group-list", json.dumps({**good, "group": [1]})),
                       ("dtype-null", json.dumps({**good, "dtype": None}))):
        (tmp_path / "s" / name).mkdir()
        (tmp_path / "s" / name / "results.json").write_text(text)
    (tmp_path / "s" / "odd").mkdir()  # a kvlab-shaped record whose numbers are text: its figure is skipped
    (tmp_path / "s" / "odd" / "results.json").write_text(json.dumps({**good, "config_id": "odd",
                                                                    "cache_nbytes": "many"}))
    (tmp_path / "s" / "killed" / ".hydra").mkdir(parents=True)
    rep = build_report(tmp_path / "s", tmp_path / "report")
    assert len(rep["runs"]) == 3
    why = "\n".join(f"{f} {w}" for f, w in rep["skipped"])
    assert why.count("is not a kvlab record") == 5 and "unreadable results.json" in why and "interrupted" in why
    assert "unreadable steps.csv" in why and "memory.csv is not kvlab's" in why
    page = (tmp_path / "report" / "report.html").read_text()
    assert "Skipped" in page and "killed" in page
    cli = subprocess.run([sys.executable, "-m", "harness.report", str(tmp_path / "nowhere")], cwd=REPO,
                         capture_output=True, text=True)
    assert cli.returncode == 2 and "no such folder" in cli.stderr and "Traceback" not in cli.stderr


def test_a_write_error_is_one_line_and_counts_as_not_ok(capsys):
    from harness.experiment import runner as experiment

    experiment.new_invocation()
    try:
        ok = experiment._write(Path("/proc/kvlab-nowhere"), {"run_name": "r", "status": "ok"})
        err = capsys.readouterr().err
        assert not ok and err.count("\n") == 1 and "cannot write the results of run r to /proc/kvlab-nowhere" in err
        assert any("cannot write" in f for f in experiment.invocation_failures())
    finally:
        experiment.forget_invocation()


def test_runs_on_two_checkpoint_folders_get_two_labels():
    from types import SimpleNamespace

    from harness.experiment.describe import model_label

    a = SimpleNamespace(name="tiny", preset="tiny", weights="/ckpts/run-a")
    b = SimpleNamespace(name="tiny", preset="tiny", weights="/ckpts/run-b")
    assert model_label(a) == "tiny@run-a" and model_label(b) == "tiny@run-b"
    assert model_label(SimpleNamespace(name="mine", preset="tiny", weights="/ckpts/run-a")) == "mine"
    assert model_label(SimpleNamespace(name="gpt2", preset="gpt2", weights="random")) == "gpt2"


# ---- the docs list every case ---------------------------------------------------------------------------------

OTHER = ["run-refused-config", "run-nan-weights", "run-non-finite-while-running", "run-small-vocabulary",
         "prompts-many-lines", "outputs-unwritable", "ctrl-c", "tracking-online-no-key", "report-bad-files",
         "sweeps-into-one-folder", "resume-after-kill", "model-name-path", "cuda-without-cuda", "api-key-never-logged",
         "run-write-error", "hub-unreachable", "model-checkpoint-missing", "prompts-too-short"]


def test_a_prompts_file_too_short_for_disjoint_drift_texts_is_one_line(tmp_path, monkeypatch, capsys):  # prompts-too-short
    """Drift scores n_prompts texts that share no token: a file that cannot hold them fails the run in one line
    that says what would fit (the generation prompts alone may wrap around a short file)."""
    path = tmp_path / "short.txt"
    path.write_text("A short file of a single line.\n")
    out = tmp_path / "run"
    got = run_here(monkeypatch, [*TINY, f"prompts_file={path}", "dtype=fp16", "tracking=disabled"], out)
    assert got["status"] == "failed" and "Traceback" not in capsys.readouterr().err
    err = json.loads((out / "results.json").read_text())["error"]
    assert "holds 9 tokens, and 2 disjoint texts of 128 tokens" in err and "need 256" in err, err


def test_a_missing_checkpoint_says_how_to_build_it(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    got = run_here(monkeypatch, ["model=mini", f"model.weights={tmp_path / 'no-mini'}", "tracking=disabled"], out)
    assert got["status"] == "failed" and "Traceback" not in capsys.readouterr().err
    err = json.loads((out / "results.json").read_text())["error"]
    assert "needs its checkpoint folder" in err and "python -m harness.train --out models/weights/mini" in err


def test_the_readme_table_lists_every_case():
    doc = (REPO / "docs" / "faults.md").read_text()
    start = doc.index("## Bad inputs and faults")
    end = doc.find("\n## ", start + 1)
    table = doc[start:end if end >= 0 else len(doc)]
    listed = set(re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.M))
    # each file's CASES, read (not imported: no test file imports another) from the file
    safe = {c for f in ("models/test_safe_engine.py", "experiment/test_safe_runs.py", "analysis/test_safe_report.py",
                        "tools/test_safe_tools.py", "experiment/test_safe_options.py",
                        "experiment/test_safe_bounds.py", "experiment/test_safe_second_pass.py",
                        "analysis/test_findings.py", "core/test_llamacpp.py", "experiment/test_safe_third_pass.py",
                        "experiment/test_safe_options_third.py", "tools/test_safe_tools_third.py",
                        "train/test_safe_train_folder.py", "models/test_safe_checkpoint_files.py",
                        "analysis/test_scorecard.py", "experiment/test_leaderboard.py",
                        "models/test_cpu_kernels.py")
            for c in case_ids(REPO / "tests" / f)}
    cases = {c[0] for c in CONFIG + HYDRA + CHECKPOINTS + PROMPTS} | set(API) | set(OTHER) | safe
    assert listed == cases, (sorted(cases - listed), sorted(listed - cases))
    assert len(cases) >= 30

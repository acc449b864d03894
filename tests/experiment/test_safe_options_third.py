"""Safe runs, third pass on options (issue 64): engine and cache options that crashed llama.cpp or did nothing are
refused in one line when the config is checked, before anything runs: engine.threads past a stated cap,
engine.rotate=none where llama.cpp rotates nothing, k_pre_rope with K left unquantised, and a cache=quant
group_size its per-token groups cannot span (the label would name groups that never ran); and the plan's model
check says a bad engine or cache option as validation does (no traceback, no exception's name).
Each case has an id; docs/faults.md's fault table lists them (``CASES``)."""

import json
from types import SimpleNamespace

import pytest

from harness.core import llamacpp as L
from harness.experiment.config import ConfigError, check_model, config_id, read, validate
from models.families import preset_config
from models.kv_cache import cache_kind
from tests.helpers import one_line, run_py, untested_cases
from tests.helpers.inproc import compose_cfg

CASES = [
    ("llamacpp-threads-bound", "`engine=llamacpp engine.threads=100000` (was a segfault inside llama.cpp, exit "
                               "139, no record, a stale lock): `engine.threads=100000: give 0 (as many as torch "
                               "uses) or 1 .. 256 (llama.cpp's CPU threads; this machine has C cores)`, exit 1, "
                               "before anything runs; the cap is 256 or the cores if more, at most ggml's 512 "
                               "(GGML_MAX_N_THREADS)"),
    ("llamacpp-rotate-unquantised", "`engine=llamacpp engine.rotate=none` where neither K nor V type is quantised, "
                                    "or the head size is not a multiple of 64 (llama.cpp rotates nothing either way): "
                                    "refused in one line saying so; engine.rotate=auto accepted, its ids kept"),
    ("quant-k-pre-rope-without-k", "`cache=quant cache.quantize=v cache.k_pre_rope=true` (K never quantised, so "
                                   "k_pre_rope changed nothing but the label): `cache=quant: cache option "
                                   "k_pre_rope=true quantises keys before the rotary rotation, and quantize=v leaves "
                                   "K unquantised ...: use quantize=kv or k, or k_pre_rope=false`"),
    ("quant-group-label", "`model=tiny-gqa cache=quant` (head size 16: V grouped per token ran in groups of 16 under "
                          "the label g32): `cache option group_size=32 is more than the head size 16: V, grouped per "
                          "token, spans at most the head's 16 channels, so it would run in groups of 16 while K's "
                          "per-channel groups span 32 tokens; use group_size <= 16, or cache.v_axis=channel`"),
    ("engine-name-unknown-run", "`python run.py engine.name=vllm` (was a KeyError traceback while the record was "
                                "written): `engine='vllm': use one of kvlab, hf, llamacpp`, exit 1, a failed record"),
    ("plan-option-line", "`cache=quant cache.k_bits=3` or `cache.kind=lru` from run.py (the model's check ran first "
                         "and printed `ValueError: ...`): the line validation gives, `cache=quant: cache option "
                         "k_bits=3: use 8, 4 or 2` / `cache.kind='lru': use one of ...`"),
]


def test_every_case_has_a_test():
    assert not untested_cases(__file__, CASES)


def refused(overrides, model="tiny") -> str:
    """The one line the plan's checks refuse ``overrides`` with (the model's check, then validation)."""
    cfg = compose_cfg([f"model={model}", *overrides])
    mcfg = preset_config(cfg.model.preset)
    with pytest.raises(ConfigError) as e:
        check_model(read(cfg), mcfg)
        validate(cfg, mcfg.n_positions, mcfg.head_dim)
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- llama.cpp's threads ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [100000, 5000, -1, True, 257])
def test_llama_cpp_threads_past_the_cap_are_refused_naming_the_range(threads, monkeypatch):
    # llamacpp-threads-bound
    monkeypatch.setattr(L.os, "cpu_count", lambda: 2)
    why = L.refuses_types(L.LlamaCppOptions(threads=threads), "fp32", 32)
    assert why == (f"engine.threads={threads!r}: give 0 (as many as torch uses) or 1 .. 256 (llama.cpp's CPU "
                   "threads; this machine has 2 cores)")
    for ok in (0, 1, 3, 256):  # 0: torch's count; more than the cores is allowed (the same count reproduces a run)
        assert L.refuses_types(L.LlamaCppOptions(threads=ok), "fp32", 32) is None


@pytest.mark.parametrize("cores, most", [(None, 256), (300, 300), (4096, 512)])
def test_the_threads_cap_is_the_cores_if_more_and_never_past_ggmls(cores, most, monkeypatch):
    # llamacpp-threads-bound
    monkeypatch.setattr(L.os, "cpu_count", lambda: cores)
    assert L.max_threads() == most
    assert L.refuses_types(L.LlamaCppOptions(threads=most), "fp32", None) is None
    assert f"1 .. {most} " in L.refuses_types(L.LlamaCppOptions(threads=most + 1), "fp32", None)


@pytest.mark.slow  # a subprocess: seconds
def test_threads_are_refused_by_the_plan_and_the_run_in_one_line_before_anything_runs(tmp_path):
    # llamacpp-threads-bound
    assert refused(["engine=llamacpp", "engine.threads=100000"]).startswith(
        "engine=llamacpp on model tiny: engine.threads=100000: give 0 (as many as torch uses) or 1 .. ")
    with pytest.raises(ConfigError, match=r"^engine=llamacpp: engine.threads=100000: give 0 "):
        validate(compose_cfg(["model=tiny", "engine=llamacpp", "engine.threads=100000"]), 128)
    run = tmp_path / "run"
    p = run_py(["model=tiny", "engine=llamacpp", "engine.threads=100000", "tracking=disabled",
                f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "engine.threads=100000: give 0 (as many as torch uses) or 1 .. " in p.stderr.splitlines()[0]
    rec = json.loads((run / "results.json").read_text())
    assert rec["status"] == "failed" and rec["failed_stage"] == "check the config"
    assert {f.name for f in run.iterdir()} == {".hydra", ".kvlab-manifest.json", "results.json", "run.log"}  # no lock


# ---- llama.cpp's rotation -----------------------------------------------------------------------------------------

HEAD_32, HEAD_64 = SimpleNamespace(head_dim=32), SimpleNamespace(head_dim=64)


@pytest.mark.parametrize("engine, storage, config, says", [
    ({}, "fp32", None, "this run stores K f32 V f32 (nothing quantised, nothing rotated either way)"),
    ({}, "fp16", HEAD_64, "this run stores K f16 V f16 (nothing quantised"),
    (dict(type_k="f16"), "fp32", HEAD_64, "this run stores K f16 V f32 (nothing quantised"),
    (dict(type_k="q4_0"), "fp32", HEAD_32, "which it does only where the head size is a multiple of 64, and this "
                                           "model's is 32 (nothing rotated either way): leave engine.rotate=auto"),
])
def test_engine_rotate_none_where_llama_cpp_rotates_nothing_is_refused(engine, storage, config, says):
    # llamacpp-rotate-unquantised
    opts = L.LlamaCppOptions(rotate="none", **engine)
    why = L.LlamaCppEngine.refuses_rotate(opts, storage, config, "prealloc")
    assert why.startswith("engine.rotate=none turns off llama.cpp's rotation of a quantised K/V") and says in why
    # auto is what ran before the option existed: always accepted
    assert L.LlamaCppEngine.refuses_rotate(L.LlamaCppOptions(**engine), storage, config, "prealloc") is None


def test_engine_rotate_none_that_turns_a_rotation_off_is_accepted_and_cache_quant_keeps_its_own_line(monkeypatch):
    # llamacpp-rotate-unquantised
    monkeypatch.setattr(L, "available", lambda: True)  # the line is the options', with llama.cpp built or not
    for engine in (dict(type_k="q4_0"), dict(type_v="q8_0"), dict(type_k="q8_0", type_v="q4_1")):
        assert L.LlamaCppEngine.refuses_rotate(L.LlamaCppOptions(rotate="none", **engine), "fp32", HEAD_64,
                                               "prealloc") is None
    # under cache=quant its rotation is cache.rotate: engine.rotate=none is refused there as "give it once"
    assert L.LlamaCppEngine.refuses_rotate(L.LlamaCppOptions(rotate="none"), "fp32", HEAD_64, "quant") is None
    assert "give llama.cpp's rotation once" in refused(
        ["engine=llamacpp", "cache=quant", "cache.scheme=symmetric", "cache.k_axis=token", "engine.rotate=none"])


def test_engine_rotate_none_is_refused_by_the_plan_and_auto_keeps_its_id():
    # llamacpp-rotate-unquantised
    assert refused(["engine=llamacpp", "engine.rotate=none"]) == (
        "engine=llamacpp on model tiny: engine.rotate=none turns off llama.cpp's rotation of a quantised K/V, and "
        "this run stores K f32 V f32 (nothing quantised, nothing rotated either way): leave engine.rotate=auto, or "
        "give engine.type_k / engine.type_v a quantised type (q8_0, q4_0, ...)")
    assert "and this model's is 32" in refused(["engine=llamacpp", "engine.rotate=none", "engine.type_k=q4_0"])
    with pytest.raises(ConfigError, match=r"^engine=llamacpp: engine.rotate=none turns off"):
        validate(compose_cfg(["model=tiny", "engine=llamacpp", "engine.rotate=none"]), 128)
    auto = compose_cfg(["model=tiny", "engine=llamacpp", "engine.rotate=auto"])
    assert config_id(auto) == config_id(compose_cfg(["model=tiny", "engine=llamacpp"]))


# ---- cache=quant ---------------------------------------------------------------------------------------------------

def test_k_pre_rope_with_k_unquantised_is_refused_in_one_line():
    # quant-k-pre-rope-without-k
    quant = cache_kind("quant")
    with pytest.raises(ValueError, match=r"^cache option k_pre_rope=true quantises keys before the rotary rotation, "
                                         r"and quantize=v leaves K unquantised"):
        quant.parse_options(quantize="v", k_pre_rope=True)
    for quantize in ("kv", "k"):
        assert quant.parse_options(quantize=quantize, k_pre_rope=True).k_pre_rope
    assert quant.parse_options(quantize="v").axis("k") == "none"
    line = refused(["cache=quant", "cache.quantize=v", "cache.k_pre_rope=true", "cache.group_size=16"], "tiny-gqa")
    assert line.startswith("cache=quant: cache option k_pre_rope=true") and line.endswith(
        "use quantize=kv or k, or k_pre_rope=false")


@pytest.mark.parametrize("options, says", [
    ({}, "cache option group_size=32 is more than the head size 16: V, grouped per token, spans at most the head's "
         "16 channels, so it would run in groups of 16 while K's per-channel groups span 32 tokens; use group_size "
         "<= 16, or cache.v_axis=channel"),
    (dict(k_axis="token", v_axis="channel"), "K, grouped per token, spans at most the head's 16 channels, so it "
                                             "would run in groups of 16 while V's per-channel groups span 32 tokens; "
                                             "use group_size <= 16, or cache.k_axis=channel"),
    (dict(k_axis="token"), "a per-token group spans at most the head's 16 channels, so it runs as group_size=16 "
                           "would; use group_size <= 16"),  # both per token: the line it had
    (dict(quantize="v"), "a per-token group spans at most the head's 16 channels"),  # V alone, per token
])
def test_a_per_token_group_wider_than_the_head_is_refused_not_labelled_as_run(options, says):
    # quant-group-label
    quant = cache_kind("quant")
    with pytest.raises(ValueError) as e:
        quant.check_head_dim(quant.parse_options(**options), 16)
    assert says in str(e.value) and "\n" not in str(e.value)
    for fits in (dict(options, group_size=16), dict(options, group_size=8)):  # what the line says to pass
        quant.check_head_dim(quant.parse_options(**fits), 16)


def test_the_group_size_is_checked_against_the_models_head_size_when_the_run_is_planned():
    # quant-group-label
    quant = cache_kind("quant")
    for ok in (dict(quantize="k"), dict(v_axis="channel"), dict(group_size=16)):  # K per channel: groups of tokens
        quant.check_head_dim(quant.parse_options(**ok), 16)
    quant.check_head_dim(quant.parse_options(), 64)  # gpt2, the mini: their head of 64 holds a group of 32
    assert refused(["cache=quant"], "tiny-gqa").startswith(
        "cache=quant: cache option group_size=32 is more than the head size 16: V, grouped per token")


# ---- the plan's own check: the line validation gives ---------------------------------------------------------------

@pytest.mark.slow  # a subprocess: seconds
def test_an_unknown_engine_is_one_line_from_run_py_and_its_record_says_what_was_asked(tmp_path):
    # engine-name-unknown-run
    from harness.experiment.describe import config_record

    rc = read(compose_cfg(["model=tiny", "engine.name=vllm"]))
    assert config_record(rc)["engine"] == "vllm"  # was a KeyError while the failed record was written
    assert refused(["engine.name=vllm"]) == "engine='vllm': use one of kvlab, hf, llamacpp"
    run = tmp_path / "run"
    p = run_py(["model=tiny", "engine.name=vllm", "tracking=disabled", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.splitlines()[0] == "kvlab: run run failed: engine='vllm': use one of kvlab, hf, llamacpp"
    assert json.loads((run / "results.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("overrides, line", [
    (["cache=quant", "cache.k_bits=3"], "cache=quant: cache option k_bits=3: use 8, 4 or 2"),
    (["cache.kind=lru"], "cache.kind='lru': use one of concat, prealloc, quant"),
])
def test_the_models_check_says_a_bad_option_as_validation_does(overrides, line):
    # plan-option-line
    said = refused(overrides)
    assert said.startswith(line) and "Error" not in said
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(["model=tiny", *overrides]), 128, 32)
    assert one_line(str(e.value)) == said

"""The Hydra harness: every config combination composes and validates; real sweeps on the tiny model write the
right results; a failing run is recorded and leaves the runs around it complete; W&B offline touches no network."""

import itertools
import sys
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import measurements
from harness.common import stats
from harness.core import measure
from harness.experiment.config import ConfigError, cache_options, dtype_label, register, validate
from models.families import preset_config
from harness.core.engines import HF_COUNTERPARTS, KvlabEngine, hf_refuses
from harness.core.inputs import batch_lengths, disjoint_texts, text_prompts
from harness.analysis.papers import PAPERS
from tests.helpers import NO_REPORT, REPO, TINY, run_py
from models.kv_cache import CACHE_KINDS, cache_kind, kv_bytes
from models.tokenizer import Tokenizer

GROUPS = {g: sorted(p.stem for p in (REPO / "conf" / g).glob("*.yaml"))
          for g in ("model", "engine", "cache", "dtype", "device", "tracking", "experiment")}
# experiments that pin their model (and kind): composed and validated on their own
# presets that set their own model and caches (the leaderboard's grid: tests/experiment/test_leaderboard.py composes and
# validates every cell of it on both reference models)
PINNED = (*PAPERS, "gqa", "streaming", "serving", "serving_prefix", "leaderboard")


def test_groups_hold_what_users_sweep():
    assert set(GROUPS["model"]) == {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "mini", "tiny", "smollm2-135m",
                                    "qwen2.5-0.5b", "llama-3.2-1b", "tiny-gqa", "gqa-base", "mini-llama"}
    # one YAML per registered kind, and cache=external's (its class cache.target's: tests/experiment/test_external.py)
    assert set(GROUPS["cache"]) == set(CACHE_KINDS) | {"external"}
    assert set(GROUPS["engine"]) == {"kvlab", "hf", "llamacpp"}
    assert set(GROUPS["dtype"]) == {"fp32", "fp16", "bf16"}
    assert set(GROUPS["device"]) == {"cpu", "cuda", "auto"}
    assert set(GROUPS["tracking"]) == {"offline", "online", "disabled"}
    assert set(GROUPS["experiment"]) == {"quick", "seed_protocol", "long", "bench", "gqa", "streaming", "serving",
                                         "serving_prefix", "leaderboard", *PAPERS}


# one model of each family and number of positions is crossed with every cache kind and experiment; the others,
# whose positions and family repeat one of these, take turns like the choices nothing else constrains
CROSSED_MODELS = ("gpt2", "mini", "tiny", "tiny-gqa", "gqa-base")


def _composes_and_validates(overrides: list[str]) -> None:
    cfg = compose(config_name="config", overrides=overrides)
    n_pos = preset_config(cfg.model.preset).n_positions
    if cfg.model.name in ("tiny", "tiny-gqa") and cfg.experiment in ("long", "bench"):
        with pytest.raises(ConfigError, match="context_lengths has (128|512)"):
            validate(cfg, n_pos)
    else:
        max_len, contexts = validate(cfg, n_pos)
        assert max_len == n_pos and all(c < max_len for c in contexts)


@pytest.mark.slow  # 240 compositions, about twenty seconds
def test_every_group_combination_composes_and_validates():
    """Every model x cache x experiment (the model's n_positions bounds the experiment's contexts and the cache's
    options), the models that repeat another's family and positions taking turns; dtype, device and tracking (which
    no other choice constrains) take turns."""
    register()
    checked, seen = 0, {"dtype": set(), "device": set(), "tracking": set(), "model": set()}
    crossed = ("model", "cache", "experiment")
    turns = {**GROUPS, "model": [m for m in GROUPS["model"] if m not in CROSSED_MODELS]}
    assert set(CROSSED_MODELS) < set(GROUPS["model"])
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        general = {**GROUPS, "experiment": [e for e in GROUPS["experiment"] if e not in PINNED],
                   "model": list(CROSSED_MODELS), "cache": list(CACHE_KINDS)}  # external: its target's options
        for i, combo in enumerate(itertools.product(*(general[g] for g in crossed))):
            overrides = [f"{g}={o}" for g, o in zip(crossed, combo)]
            if combo[0] == CROSSED_MODELS[0]:  # beside it, a model taking its turn with the same cache and experiment
                turn = turns["model"][i % len(turns["model"])]
                seen["model"].add(turn)
                _composes_and_validates([f"model={turn}", *overrides[1:]])
            for g in ("dtype", "device", "tracking"):
                seen[g].add(GROUPS[g][i % len(GROUPS[g])])
                overrides.append(f"{g}={GROUPS[g][i % len(GROUPS[g])]}")
            _composes_and_validates(overrides)
            checked += 1
        with pytest.raises(Exception, match="n_prompts"):  # the schema types every node
            compose(config_name="config", overrides=["n_prompts=many"])
    # (each paper preset pins its model and kind: tests/analysis/test_findings.py composes and validates its whole grid)
    assert checked == len(CROSSED_MODELS) * len(CACHE_KINDS) * (len(GROUPS["experiment"]) - len(PINNED))
    assert all(seen[g] == set(turns[g]) for g in seen)


@pytest.mark.slow
def test_experiment_serving_composes_every_kind_rate_and_seed_and_its_budget_serves_each_kind():
    """experiment=serving: on the mini, every swept kind, rate and seed composes, validates and passes the server's
    own check (the kind can serve; the K/V budget holds its longest request), before anything is built."""
    import torch

    from harness.experiment.config import check_measurements, read
    from harness.experiment.prepare import check_with_model

    register()
    sweep = (REPO / "conf" / "experiment" / "serving.yaml").read_text()
    for line in ("cache: prealloc,paged,quant", "serve.rate: 4,16,inf", "seed: 0,1,2"):
        assert line in sweep
    def checked(*overrides):  # composed, validated and checked by the server as a run would be
        cfg = compose(config_name="config", overrides=list(overrides))
        mcfg = preset_config(cfg.model.preset)
        max_len, _ = validate(cfg, mcfg.n_positions)
        rc = read(cfg)
        check_measurements(rc, max_len)
        check_with_model(rc, mcfg, max_len, torch.float32, torch.float32)
        assert rc.option("serve")["requests"] > 0 and rc.measurements == ("server",)
        return rc

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for cache, rate, seed in itertools.product(("prealloc", "paged", "quant"), ("4", "16", "inf"), (0, 1, 2)):
            checked("experiment=serving", f"cache={cache}", f"serve.rate={rate}", f"seed={seed}")
        for shared, seed in itertools.product(("false", "true"), (0, 1, 2)):  # experiment=serving_prefix
            rc = checked("experiment=serving_prefix", f"serve.prefix_caching={shared}", f"seed={seed}")
            assert rc.cache.kind == "paged" and rc.option("serve")["system_prompt"] == 128


def test_experiment_streaming_composes_a_stream_8x_the_trained_length_for_each_number_of_sinks():
    """experiment=streaming: mini-llama, a window re-positioned within the cache, sinks 0, 1 and 4; each validates
    with max_len and the drift text 8 x the 1,024 trained positions (the kind streams; GPT-2 would be refused)."""
    from harness.experiment.config import check_model, read

    register()
    sweep = (REPO / "conf" / "experiment" / "streaming.yaml").read_text()
    assert "cache.sinks: 0,1,4" in sweep
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for sinks in (0, 1, 4):
            cfg = compose(config_name="config", overrides=["experiment=streaming", f"cache.sinks={sinks}"])
            assert cfg.model.name == "mini-llama" and cfg.cache.kind == "window" and cfg.cache.positions == "cache"
            mcfg = preset_config(cfg.model.preset)
            check_model(read(cfg), mcfg)
            max_len, _ = validate(cfg, mcfg.n_positions, mcfg.head_dim)
            assert max_len == cfg.drift_text_len == 8 * mcfg.n_positions


@pytest.mark.slow  # seconds: not in make test-fast
def test_each_cache_yaml_is_its_kinds_defaults_and_options_are_typed():
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for kind, cls in CACHE_KINDS.items():
            cfg = compose(config_name="config", overrides=[f"cache={kind}"])
            assert cfg.cache.kind == kind and cache_options(cfg.cache) == cls.option_defaults()
        cfg = compose(config_name="config", overrides=["cache=quant", "cache.k_bits=4", "cache.v_bits=8"])
        assert (cfg.cache.k_bits, cfg.cache.v_bits) == (4, 8)
        cfg = compose(config_name="config", overrides=["cache=window", "cache.window=256", "cache.sinks=4"])
        assert validate(cfg, 1024) and (cfg.cache.window, cfg.cache.sinks) == (256, 4)
        with pytest.raises(Exception, match="k_bits"):  # typed: not an int
            compose(config_name="config", overrides=["cache=quant", "cache.k_bits=four"])
        with pytest.raises(Exception, match="window"):  # the option belongs to another kind
            compose(config_name="config", overrides=["cache=quant", "cache.window=8"])
        cfg = compose(config_name="config", overrides=["cache=quant", "cache.k_bits=3"])
        with pytest.raises(ConfigError, match="cache=quant: cache option k_bits=3: use 8, 4 or 2"):
            validate(cfg, 1024)


@pytest.mark.parametrize("override,message", [
    ("max_len=2048", "max_len=2048 > n_positions=1024"),
    ("new_tokens=1000", "prompt_len + new_tokens = 32 + 1000 > max_len=1024"),
    ("context_lengths=[32,1024]", "context_lengths has 1024"),
    ("cache.kind=lru", "cache.kind='lru': use one of concat, prealloc"),
    ("dtype.storage=fp8", "dtype.storage='fp8'"),
    ("full_prompts=-1", "full_prompts=-1"),
])
def test_impossible_configs_are_refused_in_one_line(override, message):
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[override])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1024)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_repeated_context_length_is_refused():
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["context_lengths=[8,32,32]"])
    with pytest.raises(ConfigError, match="repeats a length"):
        validate(cfg, 1024)


@pytest.mark.parametrize("storage,compute,label", [("fp32", "fp32", "fp32"), ("fp16", "auto", "fp16"),
                                                   ("bf16", "auto", "bf16"), ("fp16", "fp16", "fp16/fp16"),
                                                   ("bf16", "fp32", "bf16/fp32"), ("fp32", "fp16", "fp32/fp16")])
def test_dtype_label_follows_storage_and_compute(storage, compute, label):
    assert dtype_label(storage, compute) == label


class IgnoresCacheDtype(KvlabEngine):
    """A harness bug: the cache is made in fp32 whatever dtype was asked for."""

    def new_cache(self, kind, max_len, batch=1, dtype=None, **options):
        return super().new_cache(kind, max_len, batch, torch.float32, **options)


@pytest.mark.parametrize("kind", ["concat", "prealloc"])
def test_cache_memory_checks_bytes_against_the_asked_dtype(tiny_model, kind):
    prompt = torch.tensor([[464, 3290, 318]])
    spec = measure.CacheSpec(kind, {}, torch.float16)
    good, curve, _ = measure.cache_memory(KvlabEngine(tiny_model), spec, prompt, 5, 20)
    assert good["nbytes_match"] and good["cache_tokens"] == (7 if kind == "concat" else 20)
    c = tiny_model.config
    assert good["bytes_per_token"] == 2 * c.n_layer * c.n_embd * 2
    measured = curve.dropna()
    assert list(measured.tokens) == [3, 4, 5, 6, 7] and good["nbytes_curve_match"]
    bad, _, _ = measure.cache_memory(IgnoresCacheDtype(tiny_model), spec, prompt, 5, 20)
    assert not bad["nbytes_match"] and bad["cache_nbytes"] == 2 * bad["predicted_nbytes"]
    assert not bad["nbytes_curve_match"]


def test_text_prompts_are_real_text_of_exact_length():
    tok = Tokenizer()
    path = REPO / "harness" / "prompts.txt"
    first = path.read_text().splitlines()[0]
    prompts = text_prompts(path, 30, 40, tok)  # more prompts than paragraphs
    assert all(p.shape == (1, 40) for p in prompts)
    assert first.startswith(tok.decode(prompts[0][0, :10]))
    assert len({tuple(p[0].tolist()) for p in prompts}) == 30
    short = text_prompts(path, 1, 200, tok)[0]  # longer than one paragraph: runs on into the next
    assert tok.decode(short[0]).startswith(first) and short.shape == (1, 200)


def test_drift_texts_are_disjoint_spans_drawn_from_across_the_file():
    """Drift's texts share no token: whole windows of the file's token stream, one drawn from each n-th of it (so the
    last texts come from its end, not its start), in order, the same on every draw; each names the paragraphs it
    spans. Joined as a reference model was trained, with its first token between paragraphs, the stream is the
    paragraphs' tokens each followed by it. A file too short for them is one line that says what would fit."""
    tok = Tokenizer()
    path = REPO / "harness" / "prompts.txt"
    paragraphs = [p.strip() for p in path.read_text().splitlines() if p.strip()]
    stream = [t for p in paragraphs for t in tok.encode(p + "\n\n")]
    drawn = disjoint_texts(path, 3, 150, tok)
    assert [t.shape for t in drawn.texts] == [(1, 150)] * 3
    slots = len(stream) // 150
    starts = [next(j for j in range(slots) if stream[j * 150:(j + 1) * 150] == t[0].tolist()) for t in drawn.texts]
    assert [k * slots // 3 <= j < (k + 1) * slots // 3 for k, j in enumerate(starts)] == [True] * 3  # one a third
    again = disjoint_texts(path, 3, 150, tok)  # the same texts every time
    assert again.paragraphs == drawn.paragraphs and all(torch.equal(a, b) for a, b in zip(again.texts, drawn.texts))
    first, last = drawn.paragraphs[0]
    assert tok.decode(drawn.texts[0][0]) in "\n\n".join(paragraphs[first - 1:last]) + "\n\n"
    assert drawn.record() == ";".join(f"{a}" if a == b else f"{a}-{b}" for a, b in drawn.paragraphs)
    every = disjoint_texts(path, slots, 150, tok)  # as many texts as fit: all of them, in order
    assert torch.cat([t[0] for t in every.texts]).tolist() == stream[:slots * 150]
    eot = disjoint_texts(path, 2, 150, tok, sep=50256)
    joined = [t for p in paragraphs for t in tok.encode(p) + [50256]]
    assert all(any(t[0].tolist() == joined[j * 150:(j + 1) * 150] for j in range(len(joined) // 150))
               for t in eot.texts) and 50256 in torch.cat([t[0] for t in eot.texts]).tolist()
    with pytest.raises(ConfigError, match=f"holds {len(stream):,} tokens, and {slots + 1} disjoint texts of 150 "
                                          f"tokens .* need {(slots + 1) * 150:,}: lower drift_texts or "
                                          "drift_text_len, or give a longer file"):
        disjoint_texts(path, slots + 1, 150, tok)


class OffByOneReference(KvlabEngine):
    """An uncached reference that disagrees from position 5 on: the checks must notice."""

    def forward(self, ids, **ref):
        logits = super().forward(ids, **ref).clone()
        logits[:, 5:, 0] += 1000.0
        return logits


def test_generation_checks_catch_a_disagreeing_reference(tiny_model):
    prompts = [torch.tensor([[464, 3290, 318]])]
    spec = measure.CacheSpec("prealloc", {}, torch.float32)
    good, tables = measurements.run_on(KvlabEngine(tiny_model), spec, prompts, 10, full_prompts=1)
    table = tables["drift"]
    assert good["tokens_identical"] and good["max_abs_logit_diff"] < 1e-4 and good["first_diff_step"] is None
    assert list(table.step) == list(range(10)) and table.drift_kl.isna().all()
    bad, _ = measurements.run_on(OffByOneReference(tiny_model), spec, prompts, 10, full_prompts=0)
    assert not bad["tokens_identical"]
    assert bad["first_diff_step"] == 5 - 2  # prompt of 3: position 5 chose generated token 3
    assert bad["max_abs_logit_diff"] > 999


def test_drift_is_measured_against_fp32(tiny_model):
    engine = KvlabEngine(tiny_model)
    prompts = [torch.tensor([[464, 3290, 318]]), torch.tensor([[15496, 995]])]
    s, tables = measurements.run_on(engine, measure.CacheSpec("concat", {}, torch.bfloat16), prompts, 12,
                                    full_prompts=1, ref32=engine)
    table = tables["drift"]
    assert 0 < s["drift_max_abs"] and 0 < s["drift_gen_kl"] and 0 <= s["drift_top1_agreement"] <= 1
    assert table.drift_kl.notna().all() and len(table) == 12
    assert s["drift_max_abs"] == pytest.approx(table.drift_max_abs.max())


def test_step_times_table(tiny_model):
    # max_len 17 leaves room for exactly one step at context 16: every timed step must be rewound, or the next
    # one overflows the cache
    for kind in CACHE_KINDS:
        spec = measure.CacheSpec(kind, CACHE_KINDS[kind].examples[0], torch.float32)
        df = measure.step_times(KvlabEngine(tiny_model), spec, [4, 16], 17, repeats=3, warmup=1,
                                device=torch.device("cpu"))
    assert set(zip(df.context_len, df["mode"])) == {(4, "cached"), (4, "uncached"), (16, "cached"),
                                                   (16, "uncached")}
    assert (df.repeats == 3).all() and (df.ms_median > 0).all()
    for ctx, g in df.groupby("context_len"):
        g = g.set_index("mode")
        assert g.loc["cached", "speedup"] == pytest.approx(g.loc["uncached", "ms_median"] / g.loc["cached",
                                                                                                   "ms_median"])


# ---- real runs of run.py -------------------------------------------------------------------------------------

def results(folder):
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(Path(folder).glob("*/results.json"))}


@pytest.mark.slow
def test_sweep_writes_complete_runs_offline_without_network(tiny_sweep):
    sweep, proc, trip = tiny_sweep
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = results(sweep)
    assert len(runs) == 4
    assert {(r["cache"], r["dtype"]) for r in runs.values()} == {
        ("concat", "fp32"), ("concat", "fp16"), ("prealloc", "fp32"), ("prealloc", "fp16")}
    for name, r in runs.items():
        assert r["status"] == "ok" and r["error"] is None
        assert r["nbytes_match"] and r["cache_nbytes"] == r["predicted_nbytes"]
        held = r["prompt_len"] + r["new_tokens"] - 1 if r["cache"] == "concat" else r["max_len"]
        assert r["cache_tokens"] == held and r["cache_exact"] and r["cache_label"] == r["cache"]
        assert r["group"] == f"quick-{sweep.name}" and "random init" in r["weights_detail"] and r["weights"] == "random"
        for key in ("torch_version", "device_name", "threads", "attn_backend", "tf32", "git_commit"):
            assert key in r
        if sys.platform == "linux":  # the peak is reset per run, even though the sweep's jobs share a process
            assert r["peak_memory_kind"] == "process_peak_rss" and r["peak_memory_bytes"] > 0
        if r["dtype"] == "fp32":
            assert r["tokens_identical"] and r["max_abs_logit_diff"] <= 1e-4
            assert "drift_kl" not in r and "drift_top1_agreement" not in r  # no drift: its own fp32 reference
            assert "fp32 reference" in r["generation_drift_skipped"] and "fp32" in r["text_drift_skipped"]
        else:
            assert r["storage_dtype"] == "float16" and r["compute_dtype"] == "float32"
            assert r["drift_kl"] > 0 and 0 <= r["drift_top1_agreement"] <= 1
        steps = pd.read_csv(sweep / name / "steps.csv")
        assert set(zip(steps.context_len, steps["mode"])) == {(c, m) for c in (8, 32)
                                                             for m in ("cached", "uncached")}
        assert len(pd.read_csv(sweep / name / "drift.csv")) == r["new_tokens"]
        offline = list((sweep / name / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(offline) == 1 and offline[0].stat().st_size > 0
    assert trip.hits == 0  # offline W&B and the rest of the run never opened a connection


@pytest.mark.slow
def test_a_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    # equivalence and step times (steps.csv), what it reads; no sweep report: it reads none
    proc = run_py(["-m", "max_len=1000,64", "tracking=disabled", *TINY, "measurements=[equivalence,step_time]",
                   NO_REPORT, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode != 0
    runs = {r["max_len"]: r for r in results(sweep).values()}
    assert runs[64]["status"] == "ok" and runs[64]["tokens_identical"]
    assert (Path(runs[64]["run_dir"]) / "steps.csv").is_file()
    failed = runs[1000]
    assert failed["status"] == "failed" and "max_len=1000 > n_positions=128" in failed["error"]
    assert not (Path(failed["run_dir"]) / "steps.csv").exists()
    assert f"run {Path(failed['run_dir']).name} failed" in proc.stderr
    assert not list(sweep.glob("*/wandb"))  # tracking=disabled writes no W&B files


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: device=cuda would succeed")
def test_cuda_asked_without_cuda_fails_in_one_line(tmp_path):
    out = tmp_path / "run"
    proc = run_py(["device=cuda", "tracking=disabled", *TINY, f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 1
    r = json.loads((out / "results.json").read_text())
    assert r["status"] == "failed" and r["error"].startswith("device=cuda but torch")
    assert "device=cpu" in r["error"] and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_run_on_a_checkpoint_folder(tmp_path):
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    GPT2LMHeadModel(HFConfig(n_layer=2, n_head=3, n_embd=48, n_positions=64, vocab_size=500,
                             bos_token_id=0, eos_token_id=0)).save_pretrained(ckpt)
    out = tmp_path / "run"
    proc = run_py([*TINY, f"model.weights={ckpt}", "model.name=my-ckpt", "prompts=random", "tracking=disabled",
                   "measurements=[equivalence,memory]", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads((out / "results.json").read_text())
    assert r["status"] == "ok" and r["weights"] == "pretrained" and r["model"] == "my-ckpt"
    assert r["weights_source"] == str(ckpt)
    assert (r["n_layer"], r["n_head"], r["n_embd"], r["max_len"]) == (2, 3, 48, 64)
    assert r["tokens_identical"] and r["nbytes_match"]
    bad = run_py([*TINY, f"model.weights={tmp_path / 'missing'}", "tracking=disabled",
                  f"hydra.run.dir={tmp_path / 'bad'}"], tmp_path)
    assert bad.returncode == 1 and "no such checkpoint folder" in bad.stderr


@pytest.mark.slow  # a run or a trained model's drift: tens of seconds
def test_a_ragged_batch_is_served_on_every_layout_with_its_waste(tmp_path):
    """`-m cache=concat,prealloc,paged batch=5 prompt_lengths=ragged`: each run serves the same ragged batch, every
    sequence equals its own reference, and the waste is what each layout's slots give, worked out here."""
    sweep = tmp_path / "sweep"
    proc = run_py(["-m", "cache=concat,prealloc,paged", "batch=5", "prompt_lengths=ragged", "tracking=disabled",
                   *TINY, "measurements=[serving]", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = {r["cache"]: r for r in results(sweep).values()}
    prompt_len, new = int(TINY[3].split("=")[1]), int(TINY[2].split("=")[1])
    lengths = batch_lengths(5, prompt_len, "ragged", 0)
    assert len(set(lengths)) > 1 and max(lengths) == prompt_len
    tokens = [n + new - 1 for n in lengths]  # the last generated token is never fed back
    held = {"concat": 5 * (prompt_len + new - 1), "prealloc": 5 * 128,
            "paged": sum(-(-t // 16) * 16 for t in tokens)}
    for kind, r in runs.items():
        assert r["status"] == "ok" and r["serve_batch"] == 5 and r["prompt_lengths"] == "ragged"
        assert r["serve_tokens_identical"] and r["serve_max_abs_logit"] <= 1e-4
        assert r["serve_prompt_tokens"] == sum(lengths) and r["kv_token_slots"] == sum(tokens)
        assert r["kv_held_slots"] == held[kind]
        assert r["kv_waste"] == pytest.approx(1 - sum(tokens) / held[kind])
        assert r["tokens_per_s"] > 0
    # (prompts of 1..6 tokens fill few of paged's 16-slot blocks: its waste beats concat's only on longer ones)
    assert max(runs["paged"]["kv_waste"], runs["concat"]["kv_waste"]) < runs["prealloc"]["kv_waste"]
    report = sweep / "report"
    assert (report / "serving.png").is_file() and "Served batches" in (report / "report.html").read_text()


def test_the_record_says_of_each_kind_what_its_class_says():
    """The figures read a kind's facts from the run's record, never from the registry: whether it is full attention
    with the run's options, and which options the others imply. For every kind's own examples (and its defaults),
    the record says what the class says; a window given a budget implies its window, and a sweep's varied option
    is implied in no run but the one at its default."""
    from harness.experiment.plan import CacheChoice
    from harness.experiment.describe import cache_record

    for kind, cls in CACHE_KINDS.items():
        for given in ({}, *cls.examples):
            rec = cache_record(CacheChoice(kind, dict(given)))
            opts = cls.parse_options(**given)
            assert rec["cache_full_attention"] is bool(cls.full_attention(opts)), (kind, given)
            for name in given:
                without = {k: getattr(opts, k) for k in given if k != name}
                try:
                    same = getattr(cls.parse_options(**without), name) == getattr(opts, name)
                except ValueError:
                    same = False
                assert (name in rec["cache_implied"].split(",")) is same, (kind, given, name)
    rec = cache_record(CacheChoice("window", {"budget": 64, "sinks": 8, "window": 32}))
    assert rec["cache_window"] == 56 and rec["cache_implied"].split(",") == ["window"]
    assert cache_record(CacheChoice("window", {"sinks": 4}))["cache_implied"] == "sinks"  # the default
    assert cache_record(CacheChoice("prealloc", {}))["cache_full_attention"] is True
    assert cache_record(CacheChoice("lru", {}))["cache_full_attention"] is None  # no such kind: the run fails on it
    # a record written before these keys: read back, it gets them from its kind and options
    from harness.experiment.records import kind_facts

    old = {"cache": "window", "cache_budget": 64, "cache_sinks": 8, "cache_window": 56}
    assert kind_facts(old) == {"cache_full_attention": False, "cache_implied": "window"}
    assert kind_facts({"cache": "prealloc"})["cache_full_attention"] is True and kind_facts({"cache": "lru"}) == {}


def test_the_cost_model_recovers_known_coefficients():
    T = [32, 128, 512, 960]
    lin = pd.DataFrame({"context_len": T * 2, "mode": ["cached"] * 4 + ["uncached"] * 4,
                        "ms_median": [2 + 0.01 * t for t in T] + [99.0] * 4})
    fit = stats.cost_model(lin)
    assert fit["cost_a_ms"] == pytest.approx(2) and fit["cost_b_ms_per_token"] == pytest.approx(0.01)
    assert stats.cost_model(lin[lin.context_len == 32])["cost_a_ms"] is None  # one context: nothing to fit


def test_bandwidth_columns_count_weights_once_and_the_kv_history(tiny_model):
    from harness.core.engines import KvlabEngine

    e = KvlabEngine(tiny_model)
    c = tiny_model.config
    params = sum(p.numel() for p in tiny_model.parameters()) * 4  # the tied lm_head counts once
    assert measure.weight_bytes(tiny_model) == params - (c.n_positions - 1) * c.n_embd * 4
    steps = pd.DataFrame({"context_len": [8, 8], "mode": ["cached", "uncached"], "ms_median": [1.0, 2.0]})
    got = measure.with_bandwidth(steps, e, measure.CacheSpec("prealloc", {}, torch.float16), 64)
    kv = 2 * c.n_layer * c.n_embd * 2 * 9  # K and V, fp16, ctx + 1 tokens
    assert got.loc[0, "kv_bytes"] == kv and got.loc[0, "bytes_read"] == kv + measure.weight_bytes(tiny_model)
    assert got.loc[0, "gb_per_s"] == pytest.approx(got.loc[0, "bytes_read"] / 1e-3 / 1e9)
    assert np.isnan(got.loc[1, "gb_per_s"])
    matrices = sum(p.numel() for n, p in tiny_model.named_parameters() if p.dim() == 2 and "wpe" not in n)
    assert got.loc[0, "flops"] == 2 * matrices + 4 * c.n_layer * c.n_embd * 9  # q.k and the sum of V over 9 keys
    assert got.loc[0, "flop_per_byte"] == pytest.approx(got.loc[0, "flops"] / got.loc[0, "bytes_read"])
    assert np.isnan(got.loc[0, "roofline_ms"])  # no probe given: no roofline
    roof = measure.with_bandwidth(steps, e, measure.CacheSpec("prealloc", {}, torch.float16), 64, probe_gbps=20.0)
    assert roof.loc[0, "roofline_ms"] == pytest.approx(roof.loc[0, "bytes_read"] / 20e9 * 1e3)  # bytes at 20 GB/s
    assert roof.loc[0, "roofline_fraction"] == pytest.approx(roof.loc[0, "roofline_ms"] / 1.0)  # of the 1 ms step
    assert np.isnan(roof.loc[1, "roofline_ms"]) and np.isnan(roof.loc[1, "roofline_fraction"])
    win = measure.with_bandwidth(steps, e, measure.CacheSpec("window", {"window": 4, "sinks": 1}, torch.float32), 64)
    assert win.loc[0, "kv_bytes"] == 2 * c.n_layer * c.n_embd * 4 * 5  # the 1 + 4 slots a window keeps


def test_bench_kinds_prints_each_kinds_roofline_from_its_own_probe(tiny_model, monkeypatch):
    from harness.tools import bench
    from harness.core.engines import KvlabEngine

    monkeypatch.setattr(measure, "bandwidth_probe", lambda device, nbytes: {"probe_gbps": 10.0})
    e = KvlabEngine(tiny_model)
    specs = [measure.CacheSpec("prealloc"), measure.CacheSpec("window", {"window": 4, "sinks": 1})]
    ms = {specs[0].label: {16: 2.0}, specs[1].label: {16: 4.0}}
    lines = bench.roofline_table(e, specs, ms, [16], 64).splitlines()
    assert "10.0 GB/s" in lines[0] and len(lines) == 4
    for spec, line in zip(specs, lines[2:]):
        roof = (measure.weight_bytes(tiny_model) + measure.kv_read_bytes(e, spec, 64, 16)) / 10e9 * 1e3
        assert line.startswith(spec.label) and f"{roof:.2f} ({roof / ms[spec.label][16]:.2f})" in line


def test_a_batched_steps_roofline_reads_every_sequences_kv_and_the_weights_once(tiny_model):
    from harness.core.engines import KvlabEngine

    e, spec = KvlabEngine(tiny_model), measure.CacheSpec("prealloc")
    steps = pd.DataFrame({"context_len": [16], "mode": ["cached"], "ms_median": [2.0]})
    one, eight = (measure.with_bandwidth(steps, e, spec, 64, 10.0, batch=b).iloc[0] for b in (1, 8))
    assert eight.kv_bytes == 8 * one.kv_bytes and eight.weight_bytes == one.weight_bytes
    assert eight.flops == 8 * one.flops
    assert eight.roofline_ms == pytest.approx((one.weight_bytes + 8 * one.kv_bytes) / 10e9 * 1e3)


def test_bench_kinds_times_a_batch_and_checks_the_kind_targets_it_measured(tiny_model):
    """time_kinds decodes `batch` sequences on each cache (each holds batch x one sequence's bytes); kind_targets
    reports exactly the targets whose kind, batch and context the run measured, each against its own bound."""
    from harness.tools import bench
    from harness.core.engines import KvlabEngine

    specs = [measure.CacheSpec("prealloc"), bench.parse_kind("quant:k_bits=4,v_bits=4"), bench.parse_kind("paged")]
    t1, held1 = bench.time_kinds(KvlabEngine(tiny_model), specs, 12, 64, repeats=2, warmup=0)
    t3, held3 = bench.time_kinds(KvlabEngine(tiny_model), specs, 12, 64, repeats=2, warmup=0, batch=3)
    assert held3 == {k: 3 * v for k, v in held1.items()} and all(len(v) == 2 for v in t3.values())
    quant, paged, base = specs[1].label, specs[2].label, specs[0].label
    ms = {base: {960: 10.0, 32: 1.0}, quant: {960: 11.0, 32: 5.0}, paged: {960: 12.0, 32: 1.0}}
    at1 = bench.kind_targets(specs, ms, base, 1, [32, 960])
    assert len(at1) == 2  # quant and paged at batch 1, context 960; nothing at 32
    assert "1.10x" in at1[0] and "1.15x" in at1[0] and at1[0].endswith(" met")  # quant 1.10 within 1.15
    assert "1.20x" in at1[1] and at1[1].endswith("NOT met")  # paged 1.20 over 1.10
    at8 = bench.kind_targets(specs, ms, base, 8, [960])
    assert len(at8) == 1 and quant in at8[0] and at8[0].endswith("NOT met")  # 1.10 over batch 8's 1.00
    assert bench.kind_targets(specs[:1], ms, base, 1, [960]) == []


@pytest.mark.parametrize("argv, says", [
    (["--batch", "2"], "--batch is for --kinds or --paged"),
    (["--kinds", "--batch", "0"], "--batch must be >= 1"),
    (["--compile"], "--compile is for --kinds"),
    (["--kinds", "--device", "tpu"], "is not a device"),
    (["--dtype", "fp16"], "--dtype is for --kinds and --peers"),
    (["--device", "cuda"], "--device is for --kinds"),
])
def test_bench_refuses_options_it_cannot_honour_in_one_line(capsys, monkeypatch, argv, says):
    from harness.tools.bench import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine: still the CPU's comparisons
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_benchmark_is_a_sweep_of_both_engines_on_two_models():
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["experiment=bench"], return_hydra_config=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    params = {k: set(str(v).split(",")) for k, v in cfg.hydra.sweeper.params.items()}
    assert {k: v for k, v in params.items() if k != "cache"} == {"model": {"gpt2", "gpt2-medium"},
                                                                   "engine": {"kvlab", "hf"}}
    assert list(cfg.context_lengths) == [32, 512, 960] and list(cfg.batch_sizes) == [1, 8]
    assert cfg.dtype.storage == "fp32"
    kinds = []
    for choice in params["cache"]:  # every kind HF has a counterpart of, each in a setting HF runs as named
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            node = compose(config_name="config", overrides=["experiment=bench", f"cache={choice}"]).cache
        opts = cache_kind(node.kind).parse_options(**cache_options(node))
        assert hf_refuses(node.kind, opts, 64) is None, choice
        kinds.append(node.kind)
    assert sorted(kinds) == sorted(HF_COUNTERPARTS)


@pytest.mark.parametrize("kind", [k for k, c in CACHE_KINDS.items() if c.full_attention(c.Options())])
def test_prefix_reuse_gives_the_cold_prefills_first_token(tiny_model, kind):
    """The prefix benchmark's two ways to the first token (prefill everything, or restore the prefix's snapshot and
    prefill the rest) agree, and each was timed `repeats` times."""
    from harness.tools.bench import time_prefix_reuse

    t = time_prefix_reuse(KvlabEngine(tiny_model), measure.CacheSpec(kind), prefix=24, suffix=6, repeats=3, warmup=1)
    assert t["max_abs"] < 1e-4 and len(t["cold"]) == len(t["reuse"]) == 3
    c = tiny_model.config  # a copy of 24 tokens of K/V, or (paged) shared blocks and no new bytes at all
    assert t["snapshot_nbytes"] == (0 if CACHE_KINDS[kind].pooled else kv_bytes(c.n_layer, c.n_head, c.head_dim, 24))


def test_prefix_bench_refuses_what_does_not_fit(capsys):
    from harness.tools.bench import main

    with pytest.raises(SystemExit) as e:
        main(["--prefix", "--model", "tiny", "--prefixes", "120", "--suffix", "16"])
    assert e.value.code == 2 and "exceeds n_positions 128 of tiny" in capsys.readouterr().err


@pytest.mark.slow  # about 25 s: three layouts serve the same requests
def test_serving_a_ragged_batch_counts_waste_from_each_layouts_slots(tiny_model):
    """The paged benchmark's bookkeeping, worked out here: prealloc holds max_len slots a row from the start, paged
    with one-token blocks holds exactly the live requests' tokens (finished ones hand theirs back), and every layout
    gives each request the same tokens."""
    from harness.tools.bench import serve_ragged

    g = torch.Generator().manual_seed(2)
    p_lens, o_lens = [9, 2, 17, 5], [6, 11, 3, 8]
    prompts = [torch.randint(0, 50257, (n,), generator=g) for n in p_lens]
    engine = KvlabEngine(tiny_model)
    runs = {kind: serve_ragged(engine, measure.CacheSpec(kind, opts), prompts, o_lens, 128)
            for kind, opts in (("prealloc", {}), ("concat", {}), ("paged", {"block_size": 1}))}
    assert runs["prealloc"]["tokens"] == runs["concat"]["tokens"] == runs["paged"]["tokens"]
    assert [len(t) for t in runs["paged"]["tokens"]] == o_lens
    assert runs["prealloc"]["waste"][0] == pytest.approx(1 - sum(p_lens) / (4 * 128))
    assert runs["concat"]["waste"][0] == pytest.approx(1 - sum(p_lens) / (4 * 17))
    assert all(w == 0 for w in runs["paged"]["waste"])  # no padding, no partial block, nothing kept for the done
    assert len(runs["paged"]["times"]) == max(o_lens) - 1
    fused = KvlabEngine(tiny_model, compile=True)  # --paged --compile: paged reads each sequence's keys in place
    for bs in (1, 16):
        assert serve_ragged(fused, measure.CacheSpec("paged", {"block_size": bs}), prompts, o_lens,
                            128)["tokens"] == runs["prealloc"]["tokens"]
    assert fused.compile_stats["compiled_steps"] == 2 * (max(o_lens) - 2)  # every step after each first one


def test_paged_bench_prints_each_layouts_waste(capsys):
    from harness.tools.bench import main

    main(["--paged", "--model", "tiny", "--batch", "4", "--prompt-max", "30", "--output-max", "12"])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("prealloc", "concat", "paged"))}
    assert set(rows) == {"prealloc", "concat", "paged(block_size=16)"}
    waste = {k: float(r[1].rstrip("%")) for k, r in rows.items()}
    assert waste["paged(block_size=16)"] < waste["prealloc"] and waste["concat"] < waste["prealloc"]
    assert all(r[-1] == "True" for r in rows.values())  # every request's tokens equal prealloc's
    with pytest.raises(SystemExit, match="exceeds n_positions 128 of tiny"):
        main(["--paged", "--model", "tiny", "--prompt-max", "100", "--output-max", "40"])


def test_bench_steps_run_in_turns_each_at_the_same_context(tiny_model):
    """Every runner is timed `repeats` times, and each step is put back: the caches end where the prompt left them,
    holding what they held, so no timed step ran at a longer context than asked."""
    from harness.tools.bench import time_in_turns

    e = KvlabEngine(tiny_model)
    prompt = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(0))
    runners = []
    for kind in ("concat", "prealloc", "paged"):
        cache = e.new_cache(kind, 64)
        e.prefill(prompt, cache)
        runners.append((kind, e, cache))
    held = {kind: e.nbytes(c) for kind, _, c in runners}
    times = time_in_turns(runners, torch.tensor([[7]]), repeats=4, warmup=2)
    assert {k: len(t) for k, t in times.items()} == {"concat": 4, "prealloc": 4, "paged": 4}
    assert all(c.pos == 12 and e.nbytes(c) == held[k] for k, _, c in runners)

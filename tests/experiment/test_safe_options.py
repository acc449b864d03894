"""Safe runs, second pass (issue 44), options: every option an engine or kind cannot honour is refused at validation,
from one declaration per HF counterpart that names every option of the kind (an option it does not name is refused),
so a run's label says only what ran; every count a run scales by is bounded before it is read or allocated; a paged
pool is sized against the caches the run builds; and a run's identity does not depend on the order of its lists.
Each case has an id; docs/faults.md's fault table lists them (``CASES``)."""

import dataclasses
import json
import re

import pytest
import torch

from harness import measurements
from harness.core import measure
from harness.experiment import memory
from harness.experiment.config import ConfigError, config_id, validate
from harness.core.engines import HF_COUNTERPARTS, ENGINES, Counterpart, HFEngine, KvlabEngine, counterpart_options, \
    hf_refuses
from models.gpt2 import GPT2Config
from models.kv_cache import CACHE_KINDS, cache_kind
from models.kv_cache.quant import AXES, BITS, QUANTIZED, ROTATIONS, SCHEMES, TAILS
from tests.helpers import TINY, run_py
from tests.helpers.inproc import compose_cfg

CASES = [
    ("hf-declaration-covers-every-option", "every option of every kind HF has a counterpart for is declared in "
                                           "harness/core/engines.py HF_COUNTERPARTS, with the values HF honours: an option "
                                           "added to a kind without a declaration fails this test"),
    ("hf-undeclared-option-refused", "an option a counterpart's declaration does not name is refused (fail closed), "
                                     "at validation and by HFEngine.new_cache, in one line naming it"),
    ("hf-quant-refusals-say-what-to-pass", "every value of every quant option that quanto does not honour is refused "
                                           "in one line, and the options the line says to pass are accepted"),
    ("hf-quant-every-option-has-an-effect", "every option HF's QuantizedCache is let through with changes what it "
                                            "stores or returns: no two labels of HF runs name the same computation"),
    ("hf-quant-cli", "`python run.py engine=hf cache=quant` (K per channel, which quanto does not run): one line "
                     "saying to pass cache.k_axis=token, exit 1, a failed record and no measurement file"),
    ("hf-quant-group-size-plan", "engine=hf cache=quant/token cache.group_size=24 on model=tiny (head size 32): "
                                 "refused when the run is planned, from the checkpoint's geometry, before anything is "
                                 "loaded or opened"),
    ("quant-hadamard-odd-head", "rotate=hadamard on an odd head size rotates nothing (blocks of 1 channel): refused "
                                "once the model's head size is known"),
    ("window-refused-iff-it-never-slides", "a window kind is refused at max_len exactly when its last query would "
                                           "still see every position (sinks + window >= max_len)"),
    ("quant-refused-iff-never-quantised", "a quant kind is refused at max_len exactly when a cache of max_len, "
                                          "filled, would hold nothing quantised of K or of V (whichever it "
                                          "quantises): residual >= max_len, or a per-channel group that never fills"),
    ("paged-pool-exact", "the blocks a paged run is refused below are exactly what each measurement's caches take: "
                         "with that many it runs, with one fewer it runs out"),
    ("paged-pool-over-memory", "a paged pool (cache.blocks) too big for the machine is refused naming cache.blocks "
                               "and the most that fits, never 'use a smaller model' on a 13 MB model"),
    ("config-id-list-order", "a run's identity does not depend on the order of measurements or context_lengths; a "
                             "list already in its measured order keeps the id it had; contexts are timed ascending"),
]


# ---- HF's counterparts: one declaration each, every option named ---------------------------------------------------

@pytest.mark.parametrize("kind", list(HF_COUNTERPARTS))
def test_every_option_of_every_counterpart_kind_is_declared(kind):
    declared = set(HF_COUNTERPARTS[kind].options)
    options = set(cache_kind(kind).option_fields())
    assert declared == options, (f"HF_COUNTERPARTS[{kind!r}] must declare exactly the options of cache kind {kind!r}: "
                                 f"missing {sorted(options - declared)}, stale {sorted(declared - options)}")
    for name, how in HF_COUNTERPARTS[kind].options.items():
        assert how.runs and (how.values or how.rule is not None), name  # says what HF does, and what it takes


def test_an_undeclared_option_is_refused(monkeypatch, tiny_model):
    quant = HF_COUNTERPARTS["quant"]
    partial = Counterpart(quant.name, quant.build, {k: v for k, v in quant.options.items() if k != "rotate"})
    monkeypatch.setitem(HF_COUNTERPARTS, "quant", partial)
    opts = cache_kind("quant").parse_options(**counterpart_options("quant"))
    why = hf_refuses("quant", opts, 32)
    assert why and "no declared counterpart of cache option rotate" in why and "\n" not in why
    with pytest.raises(ConfigError, match="engine=hf cache=quant: HF's QuantizedCache has no declared counterpart "
                                          "of cache option rotate"):
        validate(compose_cfg(["engine=hf", "cache=quant/token"]), 1024, 64)
    with pytest.raises(ValueError, match="no declared counterpart of cache option rotate"):
        HFEngine(tiny_model).new_cache("quant", 16, **counterpart_options("quant"))


QUANT_VALUES = {"k_bits": BITS, "v_bits": BITS, "group_size": (1, 8, 16, 24, 32, 48, 64), "residual": (0, 1, 2, 7),
                "k_axis": AXES, "v_axis": AXES, "rotate": ROTATIONS, "quantize": QUANTIZED, "scheme": SCHEMES,
                "tail": TAILS, "k_pre_rope": (False, True)}


def test_quant_refusals_name_what_to_pass_and_that_is_accepted():
    assert set(QUANT_VALUES) == set(cache_kind("quant").option_fields())
    base = counterpart_options("quant")
    assert base == {"k_axis": "token"} and hf_refuses("quant", cache_kind("quant").parse_options(**base), 64) is None
    accepted = {}
    for name, values in QUANT_VALUES.items():
        for value in values:
            options = {**base, name: value}
            why = hf_refuses("quant", cache_kind("quant").parse_options(**options), 64)
            accepted[name, value] = why is None
            if why is None:
                continue
            assert "\n" not in why and re.search(r"does not run \w+=\w+ \(", why), why
            fixes = dict(re.findall(r"cache\.(\w+)=(\w+)", why.split(": pass ")[1]))
            types = cache_kind("quant").option_types()
            fixed = {**options, **{k: v == "true" if types[k] is bool else types[k](v) for k, v in fixes.items()}}
            assert hf_refuses("quant", cache_kind("quant").parse_options(**fixed), 64) is None, (options, why)
    # what quanto runs: 4 or 2 bits for both, a group size dividing the head, K and V per token, nothing rotated, both,
    # a scale and a zero point per group
    assert {k for k, ok in accepted.items() if ok} == {
        ("k_bits", 4), ("v_bits", 4), ("group_size", 1), ("group_size", 8), ("group_size", 16), ("group_size", 32),
        ("group_size", 64), ("residual", 0), ("residual", 2), ("residual", 7), ("k_axis", "token"),
        ("v_axis", "token"), ("rotate", "none"), ("quantize", "kv"), ("scheme", "asymmetric"),
        ("tail", "group"), ("k_pre_rope", False)}


def test_every_option_hf_quant_runs_with_changes_what_it_computes(tiny_model):
    """The bug this replaces: quantize=k / k_axis=token / v_axis on HF ran bit-identical to the default under other
    labels. Now every setting HF accepts that differs from the base in one option differs in what it computes."""
    hf = HFEngine(tiny_model)
    prompt = torch.randint(0, 50257, (1, 9), generator=torch.Generator().manual_seed(4))
    tokens = torch.randint(0, 50257, (1, 6), generator=torch.Generator().manual_seed(5))

    def run(**options):
        cache = hf.new_cache("quant", 32, **options)
        logits = [hf.prefill(prompt, cache, last_only=True)]
        sizes = [hf.nbytes(cache)]
        for i in range(tokens.shape[1]):
            logits.append(hf.decode(tokens[:, i:i + 1], cache))
            sizes.append(hf.nbytes(cache))
        return torch.cat(logits, dim=1), sizes

    base = dict(counterpart_options("quant"))
    ref = run(**base)
    for change in ({"k_bits": 2, "v_bits": 2}, {"group_size": 16}, {"residual": 3}):
        got = run(**{**base, **change})
        assert got[1] != ref[1] or not torch.equal(got[0], ref[0]), change


@pytest.mark.slow
def test_engine_hf_cache_quant_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    proc = run_py([*TINY, "engine=hf", "cache=quant", "tracking=disabled", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("kvlab: run ")]
    assert len(said) == 1 and said[0].endswith("failed: engine=hf cache=quant: HF's QuantizedCache does not run "
                                               "k_axis=channel (quanto groups K per token, axis_key=0: its "
                                               "per-channel axis fails on a growing cache): pass cache.k_axis=token, "
                                               "or use engine=kvlab")
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "failed" and "pass cache.k_axis=token" in record["error"]
    assert not (out / "steps.csv").exists() and not (out / "memory.csv").exists()


def test_hf_group_size_is_checked_against_the_checkpoints_head_size():
    from harness.experiment.config import read
    from harness.experiment.prepare import plan_run

    with pytest.raises(ConfigError) as e:  # model=tiny: 2 heads of 32
        plan_run(read(compose_cfg(["model=tiny", "engine=hf", "cache=quant/token", "cache.group_size=24",
                                   "tracking=disabled"])))
    assert str(e.value) == ("engine=hf cache=quant: HF's QuantizedCache does not run group_size=24 (quanto's "
                            "q_group_size must divide the head size 32): pass cache.group_size=16, or use engine=kvlab")
    plan_run(read(compose_cfg(["model=tiny", "engine=hf", "cache=quant/token", "cache.group_size=16",
                               "tracking=disabled"])))


def test_kvlab_runs_every_option_of_every_kind():
    for kind, cls in CACHE_KINDS.items():
        for example in cls.examples:
            assert KvlabEngine.refuses(kind, cls.parse_options(**example), 32) is None
    assert set(ENGINES) == {"kvlab", "hf", "llamacpp"}


# ---- options with no effect at the run's max_len or head size --------------------------------------------------------

def test_hadamard_on_an_odd_head_size_is_refused():
    cls = cache_kind("quant")
    with pytest.raises(ValueError, match="the head size, and 3 is odd: blocks of 1 channel, nothing rotated"):
        cls.check_head_dim(cls.parse_options(rotate="hadamard", k_axis="token", group_size=3), 3)
    cls.check_head_dim(cls.parse_options(rotate="hadamard", group_size=6), 6)  # blocks of 2: it rotates
    with pytest.raises(ConfigError, match="cache=quant: cache option rotate=hadamard rotates blocks"):
        validate(compose_cfg(["cache=quant", "cache.rotate=hadamard", "cache.group_size=3"]), 1024, 3)


@pytest.mark.parametrize("sinks,window", [(0, 1), (2, 5), (4, 12), (3, 13), (0, 16), (16, 1), (1, 30)])
def test_a_window_is_refused_exactly_when_it_never_slides(sinks, window):
    """Fill a cache of max_len 16 one token at a time: the last query's keys are every position exactly when
    check_max_len refuses."""
    cls, L = cache_kind("window"), 16
    opts = cls.parse_options(window=window, sinks=sinks)
    cache = cls(1, 1, 4, L, 1, window=window, sinks=sinks)
    for _ in range(L):
        seen = cache.key_positions(1)
        cache.update(0, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
        cache.advance(1)
    full = sorted(seen.tolist()) == list(range(L))
    try:
        cls.check_max_len(opts, L)
        refused = False
    except ValueError:
        refused = True
    assert refused == full


@pytest.mark.parametrize("options", [dict(residual=0), dict(residual=15), dict(residual=16), dict(residual=8),
                                     dict(residual=7, group_size=8), dict(residual=8, group_size=8),
                                     dict(residual=3, group_size=8, k_axis="token"),
                                     dict(residual=15, k_axis="token"), dict(residual=16, k_axis="token"),
                                     dict(residual=7, group_size=8, quantize="v"),
                                     dict(residual=8, group_size=8, quantize="v"), dict(group_size=16),
                                     dict(group_size=15)])
def test_quant_is_refused_exactly_when_k_or_v_would_never_be_quantised(options):
    cls, L = cache_kind("quant"), 16
    opts = cls.parse_options(**{"group_size": 4, **options})
    cache = cls(1, 1, 8, L, 1, **{"group_size": 4, **options})
    cache.update(0, torch.randn(1, 1, L, 8), torch.randn(1, 1, L, 8))
    cache.advance(L)
    never = [which for n, which in zip(cache._split(L), ("k", "v")) if opts.axis(which) != "none" and n == 0]
    try:
        cls.check_max_len(opts, L)
        refused = False
    except ValueError as e:
        refused = True
        assert "\n" not in str(e)
    assert refused == bool(never)


# ---- a paged pool, sized against the caches the run builds -----------------------------------------------------------

P, N, L, BS = 6, 5, 40, 4  # prompt_len, new_tokens, max_len, block_size
RUN = dict(max_len=L, context_lengths=[9, 13], prompt_len=P, new_tokens=N, batch=3, batch_sizes=[1, 2], batch_context=10,
           drift_text_len=11, retrieval_n=7, storage="fp16")


@pytest.mark.parametrize("name", ["equivalence", "text_drift", "retrieval", "memory", "step_time", "batches",
                                  "serving"])
def test_the_pool_a_run_is_refused_below_is_exactly_what_it_takes(tiny_model, name):
    cls = cache_kind("paged")
    fills = memory.cache_fills(kind="paged", options={"block_size": BS}, measurements=[name], **RUN)
    need = max(cls.blocks_needed(cls.parse_options(block_size=BS), b, n) for _, b, n in fills)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50257, (1, P), generator=g)]
    text = [torch.randint(0, 50257, (1, RUN["drift_text_len"]), generator=g)]
    served = [torch.randint(0, 50257, (P,), generator=g) for _ in range(RUN["batch"])]
    engine = KvlabEngine(tiny_model)

    def run(blocks):
        spec = measure.CacheSpec("paged", {"block_size": BS, "blocks": blocks})
        measurements.run_on(engine, spec, prompts, N, names=[name], max_len=L, ref32=engine, texts=text,
                            served=served, contexts=RUN["context_lengths"], repeats=1, warmup=0, full_prompts=0,
                            batch_sizes=RUN["batch_sizes"], batch_context=RUN["batch_context"],
                            retrieval_n=RUN["retrieval_n"], retrieval_k=1)

    run(need)
    with pytest.raises(ValueError, match="paged pool out of blocks"):
        run(need - 1)
    with pytest.raises(ValueError, match=f"use cache.blocks >= {need}"):
        cls.check_fills(cls.parse_options(block_size=BS, blocks=need - 1), fills)


def test_a_pool_too_big_names_cache_blocks():
    tiny = GPT2Config.preset("tiny")
    need = memory.run_bytes(tiny, kind="paged", options={"blocks": 10 ** 12}, max_len=128, prompt_len=32,
                            new_tokens=32)
    with pytest.raises(ConfigError) as e:
        memory.check(need, 20 * 10 ** 9)
    said = str(e.value)
    assert said.endswith(" would fit") and "cache.blocks <= " in said and "smaller model" not in said
    most = int(re.search(r"cache.blocks <= (\d+)", said).group(1))
    fits = memory.run_bytes(tiny, kind="paged", options={"blocks": most}, max_len=128, prompt_len=32, new_tokens=32)
    over = memory.run_bytes(tiny, kind="paged", options={"blocks": most + 1}, max_len=128, prompt_len=32,
                            new_tokens=32)
    assert fits.total <= memory.usable(20 * 10 ** 9) < over.total


# ---- a run's identity -----------------------------------------------------------------------------------------------

def _old_id(cfg):
    """config_id before list order stopped mattering: the resolved config as it is."""
    import hashlib

    from omegaconf import OmegaConf

    keys = [k for k in cfg.keys() if k not in ("tracking", "resume", "hydra")
            and not (k == "measurements" and cfg[k] is None)]
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
             for k in keys}
    plain["model"].pop("outliers")  # at scale 1 not hashed: its configs had no model.outliers
    plain["model"].pop("n_kv_head")  # at null not hashed: nor model.n_kv_head
    plain.pop("serve")  # at its defaults (serve.requests 0) not hashed: nor the server's node
    plain.pop("leaderboard")  # experiment=leaderboard's grid: read by its sweeper, never by a run
    if plain["cache"].get("target") is None:
        plain["cache"].pop("target", None)  # cache=external's class: null (not hashed) for every other kind
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]


@pytest.mark.slow
def test_list_order_does_not_change_a_runs_identity():
    ids = {config_id(compose_cfg([f"measurements={m}", f"context_lengths={c}"]))
           for m in ("[equivalence,memory,step_time]", "[step_time,memory,equivalence]",
                     "[memory,equivalence,step_time,memory]")
           for c in ("[8,32,128]", "[128,8,32]", "[32,128,8]")}
    assert len(ids) == 1
    assert len({config_id(compose_cfg([f"context_lengths={c}"])) for c in ("[8,32]", "[8,64]")}) == 2
    for overrides in ([], ["experiment=bench"], ["context_lengths=[8,32]"], ["measurements=[equivalence,memory]"]):
        cfg = compose_cfg(overrides)  # a list already in its measured order keeps the id it had
        assert config_id(cfg) == _old_id(cfg), overrides
    assert validate(compose_cfg(["context_lengths=[512,32,128]"]), 1024)[1] == [32, 128, 512]


def test_the_cases_are_what_this_file_tests():
    assert len({c[0] for c in CASES}) == len(CASES)
    assert all(dataclasses.is_dataclass(c) for c in HF_COUNTERPARTS.values())


def test_compile_with_a_tail_the_stored_bytes_do_not_hold_is_refused():
    """compile=true reads quant's K/V where they lie; cache.tail=residual reads a per-channel group still filling
    quantised, which is not what is stored: refused in one line, so the record never says a fused step ran. Per
    token (no group fills) and tail=group compile as before."""
    bad = compose_cfg(["model=tiny", "cache=quant", "cache.tail=residual", "compile=true"])
    with pytest.raises(ConfigError, match=r"^compile=true attends over the stored bytes, and cache.tail=residual .*: "
                                          r"use cache.tail=group, or compile=false$"):
        validate(bad, 64)
    for ok in (["cache.tail=group"], ["cache.tail=residual", "cache.k_axis=token"]):
        validate(compose_cfg(["model=tiny", "cache=quant", "compile=true", *ok]), 64)


@pytest.mark.parametrize("overrides, threads", [(["engine=llamacpp", "engine.threads=3"], 3),
                                                (["engine=llamacpp"], "torch"), (["engine=hf"], None), ([], None)])
def test_the_record_says_how_many_threads_llama_cpp_computed_with(overrides, threads):
    """engine.threads is llama.cpp's own count, which can differ from torch's (the fingerprint's threads); the
    record says which it was (0 asks for torch's count), and nothing on the engines that compute in torch."""
    from harness.experiment.config import read
    from harness.experiment.describe import config_record

    rec = config_record(read(compose_cfg(["model=tiny", *overrides, "tracking=disabled"])))
    assert rec["engine_threads"] == (torch.get_num_threads() if threads == "torch" else threads)

"""harness.experiment.memory: a run's peak bytes from its config alone, what the machine has free, and the one-line refusal.
Nothing here builds more than a tiny model; every other size is arithmetic."""

import os
import re

import pytest
import torch

from harness.experiment.config import ConfigError
from harness.core.engines import QuantoStorage
from harness.core.sizes import cache_bytes, param_count
from harness.experiment.memory import available_bytes, cgroup_free, check, run_bytes, size, usable
from models.gpt2 import GPT2, GPT2Config
from models.kv_cache import CACHE_KINDS, KVCache, cache_kind, make_cache

GB = 10 ** 9
CUSTOM = [GPT2Config.preset("tiny"), GPT2Config(n_layer=3, n_head=4, n_embd=32, n_positions=64, vocab_size=1000),
          GPT2Config(n_layer=1, n_head=1, n_embd=8, n_positions=16, vocab_size=50)]


@pytest.mark.parametrize("cfg", CUSTOM, ids=["tiny", "3x32", "1x8"])
def test_param_count_is_the_models(cfg):
    torch.manual_seed(0)
    model = GPT2(cfg)
    assert param_count(cfg) == model.num_params()
    need = run_bytes(cfg)
    assert need.params == model.num_params()
    assert need.weights == sum(p.numel() * p.element_size() for p in model.parameters())  # one fp32 copy
    half = run_bytes(cfg, storage="fp16", compute="fp16")  # keeps model32 and an fp16 copy
    assert half.weights == model.num_params() * (4 + 2)
    hf = run_bytes(cfg, engine="hf")  # transformers' model holds its own copy
    assert hf.weights == 2 * need.weights


def test_presets_are_counted_without_building_them():
    assert param_count(GPT2Config.preset("gpt2")) == 124_439_808
    assert param_count(GPT2Config.preset("gpt2-xl")) == 1_557_611_200


@pytest.mark.parametrize("kind", list(CACHE_KINDS))
def test_cache_term_is_the_kinds_formula(kind):
    cfg = GPT2Config.preset("tiny")
    cls = cache_kind(kind)
    options = cls.examples[0]
    opts = cls.parse_options(**options)
    for batch, n in ((1, 0), (3, 40), (2, 128)):
        got = cache_bytes(cfg, kind, options, "fp32", 128, batch, n)
        if cls.pooled:
            assert got == make_cache(kind, 2, 2, 32, 128, batch, **options).pool_nbytes  # the whole pool
        else:
            assert got == cls.nbytes_formula(2, 2, 32, 128, batch, torch.float32, n, opts)
    # the run's step-time phase holds one such cache of batch 1, filled to max_len
    need = run_bytes(cfg, kind=kind, options=options, max_len=128, prompt_len=8, new_tokens=8)
    phases = {name: c for name, c, _ in need.phases}
    one = cache_bytes(cfg, kind, options, "fp32", 128, 1, 128)
    snapshots = cls.checkpoint is not KVCache.checkpoint  # its checkpoint holds a copy during the timed steps
    assert phases["step_times"] == (2 if snapshots else 1) * one


def test_the_hf_engine_counts_its_own_quantised_layout():
    cfg = GPT2Config.preset("tiny")
    options = dict(k_bits=4, v_bits=4, group_size=32, residual=4)
    opts = cache_kind("quant").parse_options(**options)
    for prefilled, n in ((6, 6), (6, 13), (0, 9)):
        want = QuantoStorage(prefilled).nbytes_formula(2, 2, 32, 128, 3, torch.float32, n, opts)
        assert cache_bytes(cfg, "quant", options, "fp32", 128, 3, n, engine="hf", prefilled=prefilled) == want


@pytest.mark.parametrize("kind", ["prealloc", "window", "quant", "paged"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_cache_term_is_what_a_real_empty_cache_allocates(kind, dtype):
    """Kinds that allocate their storage up front: an empty cache already holds what the formula says."""
    cfg = GPT2Config.preset("tiny")
    options = cache_kind(kind).examples[0]
    cache = make_cache(kind, cfg.n_layer, cfg.n_head, cfg.head_dim, 96, 3, dtype=dtype, **options)
    real = cache.pool_nbytes if cache_kind(kind).pooled else cache.nbytes
    assert cache_bytes(cfg, kind, options, dtype, 96, 3, 0) == real


def test_a_huge_model_is_refused_in_one_line_naming_the_sizes():
    big = GPT2Config(n_layer=64, n_head=32, n_embd=4096)  # ~13 G parameters: about 52 GB in fp32
    need = run_bytes(big)
    assert 52 * GB < need.weights < 53 * GB
    with pytest.raises(ConfigError) as e:
        check(need, 24 * GB)
    msg = str(e.value)
    assert "\n" not in msg
    assert re.search(r"needs about [\d.]+ GB \(weights 52\.\d GB, cache [\d.]+ [kMG]?B, measurement [\d.]+ "
                     r"[kMG]?B", msg), msg
    assert "24 GB free" in msg and "use a smaller model" in msg
    check(run_bytes(GPT2Config.preset("tiny")), 24 * GB)  # the tiny model fits


def test_a_huge_batch_is_refused_with_a_batch_that_fits():
    gpt2 = GPT2Config.preset("gpt2")
    with pytest.raises(ConfigError) as e:
        check(run_bytes(gpt2, batch=200000), 24 * GB)
    msg = str(e.value)
    assert "\n" not in msg and "serve_batch" in msg
    fit = int(re.search(r"batch <= (\d+) would fit", msg).group(1))
    assert 1 <= fit < 200000
    check(run_bytes(gpt2, batch=fit), 24 * GB)  # the suggestion itself fits
    with pytest.raises(ConfigError):  # and is the largest that does
        check(run_bytes(gpt2, batch=fit + 1), 24 * GB)


def test_throughput_batches_and_max_len_get_their_own_suggestions():
    gpt2 = GPT2Config.preset("gpt2")
    with pytest.raises(ConfigError) as e:
        check(run_bytes(gpt2, batch_sizes=[1, 8, 64, 4096]), 8 * GB)
    sizes = [int(b) for b in re.search(r"batch_sizes=\[([\d,]+)\] would fit", str(e.value)).group(1).split(",")]
    assert sizes[:2] == [1, 8] and 8 < sizes[-1] < 4096
    check(run_bytes(gpt2, batch_sizes=sizes), 8 * GB)
    with pytest.raises(ConfigError):
        check(run_bytes(gpt2, batch_sizes=sizes[:-1] + [sizes[-1] + 1]), 8 * GB)
    # a long context: the uncached forward's attention scores grow as max_len squared
    long = GPT2Config(n_layer=2, n_head=12, n_embd=96, n_positions=65536, vocab_size=1000)
    with pytest.raises(ConfigError) as e:
        check(run_bytes(long), 8 * GB)
    m = int(re.search(r"max_len <= (\d+) would fit", str(e.value)).group(1))
    check(run_bytes(long, max_len=m), 8 * GB)
    with pytest.raises(ConfigError):
        check(run_bytes(long, max_len=m + 1), 8 * GB)


def test_the_estimate_grows_with_what_the_run_holds():
    gpt2 = GPT2Config.preset("gpt2")
    base = run_bytes(gpt2)
    assert base.total == base.weights + base.cache + base.measurement
    assert run_bytes(gpt2, batch=64).total > base.total
    assert run_bytes(gpt2, batch_sizes=[1, 64, 256]).total > base.total
    assert run_bytes(gpt2, engine="hf").total > base.total
    # llama.cpp's fp32 is not kvlab's: its exact fp32 run measures text drift, and the estimate counts it
    phases = {engine: {p[0] for p in run_bytes(gpt2, engine=engine).phases} for engine in ("kvlab", "llamacpp")}
    assert "text_drift" in phases["llamacpp"] and "text_drift" not in phases["kvlab"]
    # drift on text and retrieval pass several texts at once (harness.core.measure.text_rows): more texts, more bytes
    quant = dict(kind="quant", options={"k_bits": 4}, drift_text_len=512)
    assert run_bytes(gpt2, **quant, drift_texts=8).total > run_bytes(gpt2, **quant, drift_texts=1).total
    assert run_bytes(gpt2, retrieval_n=256, retrieval_k=8).total > run_bytes(gpt2, retrieval_n=256, retrieval_k=1).total
    # a reduced-precision run keeps the fp32 model and its copy; on a CUDA device its cache is half the bytes
    half = run_bytes(gpt2, storage="fp16", compute="auto", device="cuda", batch=64)
    assert dict(half.weights_copies) == {"fp32 model": gpt2_bytes(4), "fp16 copy": gpt2_bytes(2)}
    line = half.describe()
    assert "\n" not in line and "weights" in line and "cache" in line and line.startswith("about ")


def gpt2_bytes(itemsize: int) -> int:
    return param_count(GPT2Config.preset("gpt2")) * itemsize


def test_margin_and_sizes():
    assert usable(100 * GB) == 90 * GB
    assert usable(1 * GB) == 1 * GB - (256 << 20)  # at least 256 MiB are kept free
    assert size(52_412_000_000) == "52.4 GB" and size(302_000_000) == "0.302 GB" and size(12_500) == "12.5 kB"


def test_available_bytes_is_what_this_machine_has():
    free = available_bytes("cpu")
    assert isinstance(free, int) and free > 0
    assert free < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_cgroup_limits_are_read_v2_and_v1(tmp_path):
    # v2: the process's cgroup and its parent; the parent's limit is the tighter one
    own = tmp_path / "v2" / "job" / "step"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("8000000000\n")
    (own / "memory.current").write_text("3000000000\n")
    (own / "memory.stat").write_text("anon 2000000000\ninactive_file 1000000000\n")
    (own.parent / "memory.max").write_text("5000000000\n")
    (own.parent / "memory.current").write_text("3000000000\n")
    (tmp_path / "v2" / "memory.max").write_text("max\n")  # unlimited: ignored
    (tmp_path / "v2" / "memory.current").write_text("1\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    assert sorted(cgroup_free(tmp_path / "v2", proc)) == [2_000_000_000, 6_000_000_000]
    # v1: the memory controller's own line
    v1 = tmp_path / "v1" / "memory" / "task"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("4000000000\n")
    (v1 / "memory.usage_in_bytes").write_text("1000000000\n")
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (tmp_path / "v1" / "memory" / "memory.usage_in_bytes").write_text("1000000000\n")
    proc.write_text("4:memory:/task\n0::/\n")
    assert cgroup_free(tmp_path / "v1", proc) == [3_000_000_000]


def test_every_phase_of_the_estimate_is_a_measurements_own():
    """run_bytes names no measurement: its phases are those the chosen measurements declare (``memory``), so
    choosing measurements keeps exactly theirs, and a phase two of them share (the generation checks) counts once."""
    from harness.measurements import MEASUREMENTS

    cfg = CUSTOM[0]
    knobs = dict(batch_sizes=[1, 2], compile=True, retrieval_n=8, context_lengths=[8], storage="fp16",
                 compute="fp16", serve=dict(requests=2, kv_budget="1MB"))
    every = [p[0] for p in run_bytes(cfg, **knobs).phases]
    own = {name: {p[0] for p in run_bytes(cfg, measurements=[name], **knobs).phases} - {"setup"}
           for name in MEASUREMENTS}
    default = [name for name, cls in MEASUREMENTS.items() if not cls.optional]  # what a run naming none makes
    assert set(every) - {"setup"} == set().union(*(own[n] for n in default)) and len(every) == len(set(every)) >= 12
    assert own["niah"] == {"niah"} and own["mqar"] == {"mqar"} and not {"niah", "mqar"} & set(every)
    assert own["memory"] == {"cache_memory"} and own["equivalence"] == own["generation_drift"] == {"generation"}
    assert own["peak_memory"] == set()
    with pytest.raises(TypeError, match="no measurement has: batch_size"):
        run_bytes(cfg, batch_size=[1])

"""engine=llamacpp (harness/core/llamacpp.py): llama.cpp running kvlab's GGUF conversion of the same weights gives
kvlab's fp32 greedy tokens and logits (GPT-2 within llama.cpp's GELU table, Llama within 1e-4), its cache steps
back exactly, its batches are their sequences run alone, its bytes are its allocated cells' by its own count, its
quantised K/V types move the logits in the order of their bits, and what it cannot do is refused in one line.
llama-cpp-python is built by `make llamacpp` (which `make test` runs first): without it these tests fail and say so."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from harness.core import llamacpp as L
from harness.core.engines import KvlabEngine
from models.families import build, preset_config
from models.gpt2 import GPT2, GPT2Config
from tests.helpers import run_py
from tests.helpers.inproc import run_here

# the bad inputs and faults of this file that docs/faults.md's table lists
CASES = [
    ("llamacpp-quant-rotated", "llama.cpp's quantised K is stored as the run says: unrotated under cache.rotate=none "
                               "or engine.rotate=none, llama.cpp's Hadamard rotation under rotate=hadamard (GPT-2, "
                               "head size 64) or engine.rotate=auto; engine_rotation says which"),
]


def test_llama_cpp_is_built():
    assert L.available(), f"llama-cpp-python is missing: {L.BUILD}"


def test_llama_cpps_log_says_its_errors_and_nothing_else(capsys):
    """llama.cpp's warnings (e.g. a context padded past the model's trained length) stay out of a run's output;
    an error, and the rest of its message, reach stderr."""
    L._llama_cpp()
    for level, text in ((3, b"context overflow warning\n"), (2, b"info\n"), (4, b"failed to "), (5, b"decode\n"),
                        (3, b"again a warning\n")):
        L._log_errors(level, text, None)
    assert capsys.readouterr().err == "failed to decode\n"


def tiny(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2(GPT2Config.preset("tiny")).eval()
    return build(preset_config("tiny-gqa")).eval()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv(L.GGUF_CACHE_ENV, str(tmp_path_factory.mktemp("gguf")))
    model = tiny(request.param)
    yield request.param, model, L.LlamaCppEngine(model, threads=1), KvlabEngine(model)
    mp.undo()


TOL = {"gpt2": 5e-3, "llama": 1e-4}  # GPT-2's GELU is an f16 table in llama.cpp; Llama's path is f32 throughout


def prompts(model, B=2, T=12, seed=1):
    return torch.randint(0, model.config.vocab_size - 1, (B, T), generator=torch.Generator().manual_seed(seed))


def test_greedy_tokens_and_logits_are_kvlabs_fp32(pair):
    family, model, ours, ref = pair
    p = prompts(model)
    got, want = ours.greedy(p, 12, "prealloc"), ref.greedy(p, 12, "prealloc")
    assert torch.equal(got.tokens, want.tokens)
    assert (got.logits - want.logits).abs().max() < TOL[family]
    torch.testing.assert_close(ours.forward(p), ref.forward(p), atol=TOL[family], rtol=0)
    assert torch.equal(ours.greedy(p, 12, None).tokens, got.tokens)  # uncached: one batch per step


def test_a_checkpoint_and_a_rewind_put_the_cache_back_exactly(pair):
    _, model, ours, _ = pair
    p = prompts(model, B=1)
    cache = ours.new_cache("prealloc", 64)
    ours.prefill(p, cache)
    back = ours.checkpoint(cache)
    first = ours.decode(p[:, :1], cache)
    ours.decode(p[:, 1:2], cache)
    back()
    assert cache.n == p.shape[1] and torch.equal(ours.decode(p[:, :1], cache), first)
    ours.rewind(cache, 1)
    assert torch.equal(ours.decode(p[:, :1], cache), first)
    ours.reset(cache)
    assert cache.n == 0 and torch.equal(ours.prefill(p, cache, last_only=True), ours.forward_last(p))
    cache.close()


def test_a_batch_is_its_sequences_run_alone(pair):
    family, model, ours, _ = pair
    p = prompts(model, B=3, seed=4)
    together = ours.greedy(p, 8, "prealloc")
    for b in range(3):
        alone = ours.greedy(p[b:b + 1], 8, "prealloc")
        assert torch.equal(alone.tokens[0], together.tokens[b])
        assert (alone.logits[0] - together.logits[b]).abs().max() < TOL[family]


def test_a_prefill_longer_than_a_micro_batch_gives_the_same_logits(pair, monkeypatch):
    """llama.cpp computes at most UBATCH tokens at once: a prefill of two sequences longer than that runs in several
    micro-batches, each over the cells before it, and agrees with kvlab's fp32 at every position."""
    family, model, _, ref = pair
    monkeypatch.setattr(L, "UBATCH", 16)
    small = L.LlamaCppEngine(model, threads=1)
    p = prompts(model, B=2, T=40, seed=7)
    cache = small.new_cache("prealloc", 48, 2)
    assert small.lc.llama_n_ubatch(cache.ctx.ctx) == 16
    torch.testing.assert_close(small.prefill(p, cache), ref.forward(p), atol=TOL[family], rtol=0)
    cache.close()


@pytest.mark.parametrize("max_len, batch", [(64, 1), (300, 2)])
def test_bytes_are_the_allocated_cells_by_llama_cpps_own_count(pair, max_len, batch):
    _, model, ours, _ = pair
    cache = ours.new_cache("prealloc", max_len, batch)
    cfg = model.config
    from harness.core.measure import CacheSpec

    store = ours.storage(CacheSpec("prealloc"))
    formula = store.nbytes_formula(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, max_len, batch, "fp32", 0, None)
    per_cell = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4  # K and V, f32
    assert ours.nbytes(cache) == formula == batch * L.cells(max_len) * per_cell
    cache.close()


def test_quantised_types_move_the_logits_in_the_order_of_their_bits(tmp_path, monkeypatch):
    monkeypatch.setenv(L.GGUF_CACHE_ENV, str(tmp_path))
    torch.manual_seed(0)
    model = build(dataclasses.replace(preset_config("tiny-gqa"), head_dim=32)).eval()  # one block of 32 per head
    p = prompts(model, B=1, T=40)
    ref = KvlabEngine(model).forward(p)
    err = {}
    for t in ("q8_0", "q5_0", "q4_0"):
        eng = L.LlamaCppEngine(model, type_k=t, type_v=t, threads=1)
        cache = eng.new_cache("prealloc", 64)
        eng.prefill(p[:, :8], cache)
        steps = torch.cat([eng.decode(p[:, i:i + 1], cache) for i in range(8, 40)], 1)
        err[t] = float((steps - ref[:, 8:40]).abs().mean())
        per_cell = L.LlamaCppStorage(t, t).bytes_per_token(2, 2, 32, "fp32", None)
        assert per_cell == 2 * 2 * 2 * 32 / 32 * L.CACHE_TYPES[t][2]  # layers x K,V x heads x one block
    assert 0 < err["q8_0"] < err["q5_0"] < err["q4_0"]


REFUSED = [
    (["cache=window"], "engine=llamacpp cache=window: llama.cpp has no window cache"),
    (["cache=concat"], "llama.cpp has no concat cache: its one layout is a K/V buffer allocated up front"),
    (["engine.type_k=q3_k"], "engine.type_k=q3_k: llama.cpp stores K/V as auto (the dtype.storage) or one of f32"),
    (["engine.type_v=q8_0", "model=tiny-gqa"], "engine.type_v=q8_0 quantises blocks of 32 values: the head size 16"),
    (["dtype=bf16"], "dtype.storage=bf16 has no llama.cpp type"),
    (["model=qwen2.5-0.5b", "model.weights=random"], "no GGUF conversion for model_type 'qwen2' here"),
    (["engine.rotate=hadamard"], "engine.rotate='hadamard': give auto (llama.cpp's Hadamard rotation"),
    (["cache=quant", "cache.scheme=symmetric", "cache.k_axis=token", "cache.group_size=16", "engine.rotate=none"],
     "cache.group_size=16 (give 32)"),
    (["cache=quant", "cache.scheme=symmetric", "cache.k_axis=token", "cache.group_size=32", "engine.rotate=none"],
     "give llama.cpp's rotation once: under cache=quant it is cache.rotate"),
    (["model=tiny-gqa", "cache=quant", "cache.scheme=symmetric", "cache.k_axis=token", "cache.group_size=16",
      "cache.rotate=hadamard"], "cache.group_size=16 (give 32)"),
]
LLAMACPP_SMALL = ["model=tiny", "engine=llamacpp", "n_prompts=1", "new_tokens=4", "prompt_len=4", "repeats=1",
                  "warmup=0", "context_lengths=[8]", "max_len=32", "tracking=disabled", "measurements=[equivalence]"]


@pytest.mark.parametrize("args, why", REFUSED)
def test_what_it_cannot_run_is_refused_in_one_line(tmp_path, monkeypatch, capsys, args, why):
    """Each refusal through the run's door in this process (tests.helpers.inproc): one line naming what was wrong,
    recorded as the run's error, nothing measured."""
    monkeypatch.setenv(L.GGUF_CACHE_ENV, str(tmp_path / "gguf"))
    got = run_here(monkeypatch, [*LLAMACPP_SMALL, *args], tmp_path / "run")
    err = capsys.readouterr().err
    assert got["status"] == "failed" and why in got["error"]
    line = next(ln for ln in err.splitlines() if why in ln)
    assert "Traceback" not in err and line.startswith("kvlab")
    rec = json.loads((tmp_path / "run" / "results.json").read_text())  # the refusal recorded, nothing measured
    assert rec["status"] != "ok" and why in rec["error"] and "tokens_identical" not in rec


@pytest.mark.slow  # each starts a process (seconds): not in make test-fast
@pytest.mark.parametrize("args, why", [pytest.param(*REFUSED[0], id="refused"), pytest.param([], None, id="runs")])
def test_run_py_on_llamacpp_exits_by_what_it_ran(tmp_path, args, why):
    """Through ``python run.py``: a refusal is one line and a non-zero exit; a run it can make is ok, exact."""
    proc = run_py([*LLAMACPP_SMALL, *args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                  extra_env={L.GGUF_CACHE_ENV: str(tmp_path / "gguf")})
    rec = json.loads((tmp_path / "run" / "results.json").read_text())
    if why is None:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert rec["status"] == "ok" and rec["engine"] == "llamacpp" and rec["tokens_identical"] is True
        assert rec["engine_rotation"] == "none"  # nothing quantised: nothing rotated
        return
    assert proc.returncode != 0 and rec["status"] != "ok" and "Traceback" not in proc.stderr
    assert next(ln for ln in proc.stderr.splitlines() if why in ln).startswith("kvlab")


@pytest.mark.parametrize("opts, types", [
    (dict(k_bits=8, v_bits=8, quantize="k"), ("q8_0", "f32")),
    (dict(k_bits=4, v_bits=4, quantize="v"), ("f32", "q4_0")),
    (dict(k_bits=4, v_bits=4, scheme="asymmetric"), ("q4_1", "q4_1")),
    (dict(k_bits=4, v_bits=8), ("q4_0", "q8_0")),
])
def test_cache_quant_runs_as_llama_cpps_own_type_of_the_same_scheme(tmp_path, monkeypatch, opts, types):
    """cache=quant in llama.cpp's layout (blocks of 32 per token, symmetric unless said) is llama.cpp's type of the
    same bits and scheme: the same bytes per token as ours, and logits as close to fp32 as ours are."""
    monkeypatch.setenv(L.GGUF_CACHE_ENV, str(tmp_path))
    torch.manual_seed(0)
    model = build(dataclasses.replace(preset_config("tiny-gqa"), head_dim=32)).eval()
    opts = {**dict(group_size=32, residual=0, k_axis="token", v_axis="token", scheme="symmetric"), **opts}
    eng, ours = L.LlamaCppEngine(model, threads=1), KvlabEngine(model)
    cache = eng.new_cache("quant", 64, 1, None, **opts)
    assert (cache.type_k, cache.type_v) == types
    from harness.core.measure import CacheSpec

    spec = CacheSpec("quant", opts)
    cfg = model.config
    theirs = eng.storage(spec).bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, "fp32", spec.opts)
    mine = spec.cls.bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, torch.float32, spec.opts)
    assert theirs == mine  # one f16 scale (and minimum) per 32 values, as llama.cpp's blocks
    p = prompts(model, B=1, T=40)
    ref = ours.forward(p)[:, 8:40]
    eng.prefill(p[:, :8], cache)
    got = torch.cat([eng.decode(p[:, i:i + 1], cache) for i in range(8, 40)], 1)
    mine_cache = ours.new_cache("quant", 64, 1, None, **opts)
    ours.prefill(p[:, :8], mine_cache)
    want = torch.cat([ours.decode(p[:, i:i + 1], mine_cache) for i in range(8, 40)], 1)
    err_theirs, err_mine = float((got - ref).abs().mean()), float((want - ref).abs().mean())
    assert 0 < err_theirs < 3 * err_mine and 0 < err_mine < 3 * err_theirs


@pytest.mark.parametrize("opts, why", [
    (dict(k_axis="channel"), "cache.k_axis=channel (give token)"),
    (dict(residual=16, k_axis="token"), "cache.residual=16 (give 0)"),
    (dict(k_bits=2, v_bits=2, k_axis="token"), "llama.cpp has no asymmetric 2-bit K/V type"),
    (dict(k_bits=8, v_bits=8, k_axis="token"), "llama.cpp has no asymmetric 8-bit K/V type"),
])
def test_cache_quant_llama_cpp_has_no_type_for_is_refused_in_one_line(opts, why):
    from models.kv_cache import cache_kind

    msg = L.LlamaCppEngine.refuses("quant", cache_kind("quant").parse_options(**opts), 64)
    assert why in msg and "\n" not in msg


@pytest.mark.parametrize("kind, options, engine, storage, label, exact", [
    ("prealloc", {}, {}, "fp32", "prealloc · llamacpp", True),
    ("prealloc", {}, {}, "fp16", "prealloc · llamacpp", True),
    ("prealloc", {}, dict(type_v="q4_0"), "fp32", "prealloc · llamacpp K f32 V q4_0", False),
    ("prealloc", {}, dict(type_k="f16"), "fp32", "prealloc · llamacpp K f16 V f32", False),  # f16 under fp32
    ("quant", dict(k_bits=8, v_bits=8, quantize="k", group_size=32, residual=0, k_axis="token",
                   scheme="symmetric"), {}, "fp32", " · llamacpp K q8_0 V f32", False),
    ("prealloc", {}, dict(type_k="q4_0", rotate="none"), "fp32", "prealloc · llamacpp K q4_0 V f32 unrotated",
     False),  # llama.cpp's default rotation off: another series than the rotated one
    ("prealloc", {}, dict(type_k="f16", rotate="none"), "fp32", "prealloc · llamacpp K f16 V f32", False),  # no
    # quantised type: nothing llama.cpp would rotate, so nothing to say
])
def test_a_run_says_which_k_v_types_llama_cpp_stored(kind, options, engine, storage, label, exact):
    """Two llama.cpp runs that differ in engine.type_k / type_v are told apart by their label and their
    engine_type_k / engine_type_v, and a kind is held exact there only in the storage dtype's types (a lossy run
    that called itself exact would be judged against a reference it cannot meet, or worse, pass as exact)."""
    from harness.experiment.plan import CacheChoice
    from harness.experiment.describe import cache_record

    rec = cache_record(CacheChoice(kind, options), "llamacpp", L.LlamaCppOptions(**engine), storage)
    assert rec["cache_label"].endswith(label) and rec["cache_exact"] is exact
    types = (rec["cache_label"].removesuffix(" unrotated").split(" K ")[-1].split(" V ") if " K " in label
             else [L.cache_type("auto", storage)] * 2)
    assert [rec["engine_type_k"], rec["engine_type_v"]] == types
    assert "engine_type_k" not in cache_record(CacheChoice(kind, options), "kvlab", None, storage)


def test_texts_passed_together_each_get_what_they_get_alone(pair):
    """text_drift passes texts of one length as the rows of one cache: llama.cpp's sequences (a q4_0 V too, where
    the head size is a multiple of its blocks of 32: the GPT-2) keep the rows apart."""
    from harness.core import measure

    family, model, _, _ = pair
    texts = prompts(model, B=3, T=20, seed=5)
    spec = measure.CacheSpec("prealloc", {}, torch.float32)
    for type_v in ("auto", "q4_0") if family == "gpt2" else ("auto",):
        engine = L.LlamaCppEngine(model, type_v=type_v, threads=1)
        rows, _ = measure.text_pass_rows(engine, spec, texts, 6)
        for b in range(3):
            alone, _ = measure.text_pass(engine, spec, texts[b:b + 1], 6)
            assert (rows[b] - alone).abs().max().item() <= TOL[family], (type_v, b)


def stored_k(engine, cache, n_layer: int) -> list[tuple[int, np.ndarray]]:
    """llama.cpp's K rows of sequence 0 read back from its own state (``llama_state_seq_get_data``): per layer, its
    ggml type and (cells, row bytes). The layout of this build: u32 magic, u32 version, u32 streams, u32 cells, each
    cell (i32 position, u32 n_seq_id, that many i32 ids), u32 v_trans, u32 layers, each layer (i32 K type, u64 row
    bytes, the rows)."""
    lc = engine.lc
    size = lc.llama_state_seq_get_size(cache.ctx.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    written = lc.llama_state_seq_get_data(cache.ctx.ctx, buf, size, 0)
    data = bytes(buf)[:written]
    at = 8

    def take(dtype, n=1):
        nonlocal at
        a = np.frombuffer(data, dtype=dtype, count=n, offset=at)
        at += a.nbytes
        return a

    assert int(take(np.uint32)[0]) == 1  # one stream
    n_cells = int(take(np.uint32)[0])
    positions = []
    for _ in range(n_cells):
        positions.append(int(take(np.int32)[0]))
        take(np.int32, int(take(np.uint32)[0]))
    assert positions == list(range(n_cells)) and int(take(np.uint32, 2)[1]) == n_layer
    layers = []
    for _ in range(n_layer):
        kind, row = int(take(np.int32)[0]), int(take(np.uint64)[0])
        layers.append((kind, take(np.uint8, row * n_cells).reshape(n_cells, row)))
    return layers


def q4_0_blocks(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's q4_0 rows (cells, bytes) as (f16 scales (cells, blocks), codes 0..15 (cells, channels)): a block
    is an f16 scale and 16 bytes, value j of the block in the low nibble of byte j, value j + 16 in its high one."""
    blocks = rows.reshape(rows.shape[0], -1, 18)
    scales = blocks[:, :, :2].copy().view(np.float16)[..., 0]
    nibbles = blocks[:, :, 2:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows.shape[0], -1)
    return torch.from_numpy(scales.astype(np.float32)), torch.from_numpy(codes.astype(np.int64))


@pytest.mark.parametrize("kind, options, engine, n_head, rotation", [
    ("quant", dict(rotate="none"), {}, 2, "none"),
    ("quant", dict(rotate="hadamard"), {}, 2, "k"),
    ("prealloc", {}, dict(type_k="q4_0"), 2, "k"),  # llama.cpp's own default: rotated
    ("prealloc", {}, dict(type_k="q4_0", rotate="none"), 2, "none"),
    ("prealloc", {}, dict(type_k="q4_0"), 4, "none"),  # heads of 32: llama.cpp rotates none of them
])
def test_llama_cpp_stores_k_code_for_code_as_kvlabs_blocks_rotated_as_the_run_says(tmp_path, monkeypatch, kind,
                                                                                   options, engine, n_head, rotation):
    """llama.cpp rotates a quantised K by a 64-channel Hadamard matrix before storing it, by default. On a GPT-2
    model of head size 64, the q4_0 K it stores (read back from its state) is kvlab's symmetric blocks code for code
    and scale for scale: unrotated where the run says none (cache.rotate=none, engine.rotate=none), and kvlab's
    rotate=hadamard where it says k; and not the other one's."""
    from harness.core.measure import CacheSpec
    from models.kv_cache.quant import unpack

    monkeypatch.setenv(L.GGUF_CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(L.ROTATE_ENV, raising=False)
    torch.manual_seed(0)
    model = GPT2(dataclasses.replace(GPT2Config.preset("tiny"), n_embd=128, n_head=n_head)).eval()  # heads of 64, 32
    cfg, quant = model.config, dict(scheme="symmetric", k_axis="token", group_size=32, residual=0, k_bits=4,
                                    v_bits=4, quantize="k")
    eng = L.LlamaCppEngine(model, threads=1, **engine)
    opts = {**quant, **options} if kind == "quant" else {}
    assert eng.rotation(CacheSpec(kind, opts)) == rotation
    ids, fed = prompts(model, B=1, T=40), 8
    cache = eng.new_cache(kind, 48, 1, None, **opts)
    assert cache.rotated == rotation and L.ROTATE_ENV not in os.environ  # put back once made
    eng.forward(ids[:, :8])  # llama.cpp's own uncached forward (the equivalence reference) as engine.rotate says
    assert {c.rotated for c in eng._scratch.values()} == {eng.rotation(CacheSpec("prealloc", {}))}
    eng.prefill(ids[:, :fed], cache)
    for i in range(fed, 40):
        eng.decode(ids[:, i:i + 1], cache)
    layer_type, rows = stored_k(eng, cache, cfg.n_layer)[0]
    cache.close()
    assert layer_type == L.CACHE_TYPES["q4_0"][0]
    scales, codes = q4_0_blocks(rows[:40])
    ours = KvlabEngine(model)
    mine = {}
    for rot in ("none", "hadamard"):  # layer 0's K depends on the tokens alone: the same K on both engines
        c = ours.new_cache("quant", 48, 1, None, **quant, rotate=rot)
        ours.prefill(ids[:, :fed], c)
        for i in range(fed, 40):
            ours.decode(ids[:, i:i + 1], c)
        n, hd = c.pos, cfg.head_dim
        mine[rot] = (c.k_scale[0, 0, :, :n].float().permute(1, 0, 2).reshape(n, -1),
                     unpack(c.k_q[0, 0, :, :n], 4, hd).permute(1, 0, 2).reshape(n, -1).long())
    want, other = ("hadamard", "none") if rotation == "k" else ("none", "hadamard")
    assert torch.equal(codes, mine[want][1]) and torch.equal(scales, mine[want][0])
    assert (codes != mine[other][1]).float().mean() > 0.5  # the other rotation's codes are another thing


@pytest.mark.parametrize("head_dim, rotary, why", [
    (64, False, None),  # a GPT-2 model of head size 64: llama.cpp's rotation is kvlab's
    (None, None, None),  # before the model is known
    (128, False, "llama.cpp's rotation equals kvlab's at head size 64, and this model's is 128"),
    (64, True, "llama.cpp rotates K in its own channel order, which on a rotary model interleaves"),
])
def test_cache_quant_rotate_hadamard_runs_on_llama_cpp_only_where_it_is_kvlabs_rotation(head_dim, rotary, why):
    from models.kv_cache import cache_kind

    opts = cache_kind("quant").parse_options(k_bits=4, v_bits=4, group_size=32, residual=0, k_axis="token",
                                             scheme="symmetric", rotate="hadamard")
    msg = L.LlamaCppEngine.refuses("quant", opts, head_dim, rotary)
    assert msg is None if why is None else (why in msg and "\n" not in msg)
    plain = cache_kind("quant").parse_options(k_bits=4, v_bits=4, group_size=32, residual=0, k_axis="token",
                                              scheme="symmetric")
    assert L.LlamaCppEngine.refuses("quant", plain, head_dim, rotary) is None  # unrotated blocks run anywhere

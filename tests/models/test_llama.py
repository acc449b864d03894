"""The Llama family (models/llama.py) against its oracle, HF transformers' LlamaForCausalLM / Qwen2ForCausalLM /
MistralForCausalLM built from the same config with the same random weights, at every position; the seed's
equivalence (cached greedy tokens identical to the uncached ones, logits within 1e-4 in fp32) for multi-head,
grouped-query and multi-query configs in both layouts; every cache kind on GQA and MQA models; checkpoints from a
folder (``models.load_model``), sharded too."""

import json
import re

import pytest
import torch
import transformers

from models import hf_checkpoint as hf
from models import load_model
from models.families import build, preset_config, read_config
from models.generate import decode_step, greedy, new_cache, prefill
from models.gpt2 import GPT2, GPT2Config
from models.hf_checkpoint import CheckpointError
from models.kv_cache import CACHE_KINDS, KeepRecord, kv_bytes
from models.llama import Llama, LlamaConfig, inverse_frequencies, llama_format
from tests.helpers.caches import CASES, seed_prompts

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
SHAPES = {  # n_head 4 over 4, 2 and 1 K/V heads; Qwen2's biases and untied head; Llama 3's rescaled rotations
    "llama-mha": dict(n_kv_head=4),
    "llama-gqa": dict(n_kv_head=2),
    "llama-mqa": dict(n_kv_head=1),
    "qwen2-gqa": dict(n_kv_head=2, model_type="qwen2", qkv_bias=True, tie_word_embeddings=False),
    "mistral-gqa": dict(n_kv_head=2, model_type="mistral", rope_theta=1e6),
    "llama3-scaled": dict(n_kv_head=2, rope_theta=500000.0, rope_scaling=LLAMA3),
}


def config(n_kv_head=2, vocab_size=300, n_positions=128, **kw) -> LlamaConfig:
    return LlamaConfig(n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=64, intermediate_size=96,
                       n_positions=n_positions, vocab_size=vocab_size, **kw)


def randomized(cfg: LlamaConfig, seed: int = 0) -> Llama:
    """A model with weights far from init (norm weights and biases away from 1 and 0), so every parameter matters."""
    torch.manual_seed(seed)
    model = Llama(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.15)
    return model


def hf_twin(model: Llama):
    """transformers' own model of the same config.json fields, holding the same weights."""
    d = model.hf_config_dict()
    hcfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    twin = transformers.AutoModelForCausalLM.from_config(hcfg).eval()
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    if model.config.tie_word_embeddings:
        assert twin.lm_head.weight.data_ptr() == twin.model.embed_tokens.weight.data_ptr()
    return twin


@pytest.mark.parametrize("shape", SHAPES)
def test_every_position_equals_transformers_with_and_without_a_cache(shape):
    """The uncached forward, and prefill then one-token decode steps through a prealloc cache, each equal HF's
    logits at every position within 1e-4 (fp32)."""
    model = randomized(config(**SHAPES[shape]))
    twin = hf_twin(model)
    ids = torch.randint(0, 300, (2, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = twin(ids).logits
        assert (model(ids) - want).abs().max().item() <= 1e-4
        cache = new_cache(model, "prealloc", max_len=90, batch=2)
        steps = [model(ids[:, :60], cache)] + [model(ids[:, t:t + 1], cache) for t in range(60, 90)]
    assert cache.pos == 90 and (torch.cat(steps, dim=1) - want).abs().max().item() <= 1e-4
    assert want.abs().max().item() > 1  # logits of a model that computes something, not all near zero


def test_the_rotation_matters_and_llama3_scaling_moves_only_long_wavelengths():
    """Positions change the output (a permutation of the context changes the last logits), and Llama 3's rescaling
    slows the lowest frequencies by its factor while leaving the highest as they were."""
    plain = inverse_frequencies(config(rope_theta=500000.0))
    scaled = inverse_frequencies(config(rope_theta=500000.0, rope_scaling=LLAMA3))
    assert scaled[0] == plain[0] and torch.allclose(scaled[-1], plain[-1] / 8)  # (the HF oracle checks the rest)
    model = randomized(config())
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(2))
    swapped = torch.cat([ids[:, 1:10], ids[:, :1], ids[:, 10:]], dim=1)
    with torch.no_grad():
        assert (model(ids)[0, -1] - model(swapped)[0, -1]).abs().max().item() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["concat", "prealloc"])
@pytest.mark.parametrize("n_kv_head", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_seed_protocol_cached_equals_uncached_20_prompts_x_100_tokens(layout, n_kv_head):
    model = randomized(config(n_kv_head=n_kv_head, vocab_size=50257, n_positions=128))
    worst = 0.0
    for p in seed_prompts(128):
        out = greedy(model, p, 100, layout=layout)
        with torch.no_grad():
            ref = model(torch.cat([p, out.tokens], dim=1))[0, p.shape[1] - 1:-1]
        assert torch.equal(ref.argmax(-1), out.tokens[0]), f"prompt of {p.shape[1]} tokens diverged"
        worst = max(worst, (out.logits[0] - ref).abs().max().item())
    assert worst <= 1e-4


@pytest.fixture(scope="module", params=[2, 1], ids=["gqa", "mqa"])
def grouped(request) -> Llama:
    return randomized(config(n_kv_head=request.param, vocab_size=50257, n_positions=64), seed=3)


@pytest.mark.parametrize("kind,opts", [c for c in CASES if CACHE_KINDS[c.values[0]].exact])
def test_every_exact_kind_equals_its_reference_on_grouped_heads(grouped, kind, opts):
    """Chunked prefill, then greedy decoding of a batch of two, against the kind's uncached reference (its window,
    or the keep-mask an evicting kind noted), on a GQA and an MQA model."""
    cls = CACHE_KINDS[kind]
    reference = cls.reference(cls.parse_options(**opts))
    ids = torch.randint(0, 50257, (2, 23), generator=torch.Generator().manual_seed(7))
    cache = new_cache(grouped, kind, max_len=40, batch=2, **opts)
    noted, pieces = KeepRecord(), []
    for a, b in [(0, 5), (5, 6), (6, 17), (17, 23)]:
        noted.note(cache, b - a)
        pieces.append(prefill(grouped, ids[:, a:b], cache)[0])
    with torch.no_grad():
        full = grouped(ids, **reference, **({"keep": noted} if cache.evicts else {}))
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() <= 1e-4
    out = greedy(grouped, ids, 17, layout=kind, **opts)
    ref = greedy(grouped, ids, 17, **reference, **({} if out.keeps is None else {"keep": out.keeps}))
    assert torch.equal(out.tokens, ref.tokens) and (out.logits - ref.logits).abs().max().item() <= 1e-4


@pytest.mark.slow  # every kind's every example, twice over: in the full suite
@pytest.mark.parametrize("kind,opts", CASES)
def test_every_kind_holds_n_kv_head_heads_and_its_bytes_are_the_formula_there(grouped, kind, opts):
    """After a generation, every kind's cache holds exactly its formula at n_kv_head (no expanded copies), and a
    kind whose bytes scale with the heads holds n_head / n_kv_head times less than on the same model with a K/V
    head per query head."""
    cfg = grouped.config
    prompt = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(5))

    def generated(model):
        cache = new_cache(model, kind, max_len=40, **opts)
        logits = prefill(model, prompt, cache, last_only=True)[0]
        for _ in range(20):
            logits = decode_step(model, logits[:, -1:].argmax(-1), cache)[0]
        return cache

    cache = generated(grouped)
    assert cache.n_kv_head == cfg.n_kv_head and cache.pos == 32 and cache.nbytes == cache.formula_nbytes()
    wide = generated(randomized(config(n_kv_head=4, vocab_size=50257, n_positions=64), seed=3))
    assert wide.nbytes == wide.formula_nbytes() > cache.nbytes
    # storage per head alone: the bytes are heads x the same per head (duo: a share of the heads is kept whole,
    # rounded over all of them, so 1 K/V head in each of 2 layers keeps 1 whole at 0.25 and 4 keep 2)
    if kind not in ("quant", "paged", "duo"):
        assert wide.nbytes == cache.nbytes * cfg.n_head // cfg.n_kv_head


def test_evicting_kinds_score_each_kv_head_from_its_query_group():
    """group_score=mean averages, max takes the largest of, the probabilities of the query heads sharing a K/V head
    (consecutive heads, as attention's repeat_interleave pairs them); kept positions are (B, n_kv_head, n)."""
    cache = new_cache(randomized(config(n_kv_head=2)), "tova", max_len=20, batch=1, budget=4)
    probs = torch.rand(1, 4, 3, 7)
    mean = cache.group_probs(probs)
    assert mean.shape == (1, 2, 3, 7) and torch.allclose(mean[0, 1], (probs[0, 2] + probs[0, 3]) / 2)
    hi = new_cache(randomized(config(n_kv_head=2)), "tova", max_len=20, batch=1, budget=4, group_score="max")
    assert torch.equal(hi.group_probs(probs)[0, 0], torch.maximum(probs[0, 0], probs[0, 1]))
    model = randomized(config(n_kv_head=2))
    cache = new_cache(model, "h2o", max_len=20, batch=3, budget=5, recent=2)
    prefill(model, torch.arange(30).view(3, 10), cache)
    assert cache.kept_positions(0).shape == (3, 2, 5) and cache.k[0].shape[1] == 2
    with pytest.raises(ValueError, match="group_score='sum': use mean or max"):
        CACHE_KINDS["h2o"].parse_options(group_score="sum")
    with pytest.raises(ValueError, match="group_score=max has no effect on knorm, which scores no attention"):
        CACHE_KINDS["knorm"].parse_options(group_score="max")


def test_the_grouped_cache_is_smaller_by_the_group_and_kv_bytes_says_so():
    """The seed's question, on the formula and on a measured cache: 4 query heads over 1 K/V head hold a quarter."""
    for n_kv in (4, 2, 1):
        cfg = config(n_kv_head=n_kv)
        cache = new_cache(Llama(cfg), "prealloc", max_len=50)
        assert cache.nbytes == kv_bytes(2, n_kv, 16, 50) == 2 * 2 * n_kv * 16 * 50 * 4


@pytest.mark.parametrize("bad,why", [
    (dict(n_kv_head=3), "n_kv_head 3 does not divide n_head 4"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling of type 'yarn' is not computed here"),
    (dict(model_type="gemma"), "model_type 'gemma'"),
    (dict(head_dim=15), "head_dim 15 is odd"),
])
def test_configs_the_decoder_cannot_compute_are_refused_in_one_line(bad, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        config(**bad)


# ---- checkpoints --------------------------------------------------------------------------------------------------

def write(model, folder, shards: int = 1):
    """An HF checkpoint folder of ``model``: config.json and model.safetensors, or ``shards`` shards and their index."""
    fmt = model.hf_format if hasattr(model, "hf_format") else hf.GPT2_FORMAT
    hf.write_folder(folder, model.state_dict(), model.hf_config_dict(), fmt=fmt)
    if shards > 1:
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / hf.SAFETENSORS))
        names = sorted(state)
        weight_map = {}
        for i in range(shards):
            part = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            chunk = names[i::shards]
            save_file({n: state[n] for n in chunk}, str(folder / part), metadata={"format": "pt"})
            weight_map.update({n: part for n in chunk})
        (folder / hf.SAFETENSORS).unlink()
        (folder / hf.SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("shape", ["llama-gqa", "qwen2-gqa", "mistral-gqa", "llama3-scaled"])
def test_load_model_reads_a_folder_of_each_family_sharded_or_not_and_transformers_agrees(tmp_path, shape):
    model = randomized(config(**SHAPES[shape]))
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids)
    for shards in (1, 3):
        folder = write(model, tmp_path / f"{shape}-{shards}", shards)
        back = load_model(folder)
        assert isinstance(back, Llama) and back.config == model.config
        with torch.no_grad():
            assert torch.equal(back(ids), want)
    twin = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{shape}-1").eval()
    with torch.no_grad():
        assert (twin(ids).logits - want).abs().max().item() <= 1e-4  # what we write, transformers reads the same


def test_load_model_takes_gpt2_folders_too_and_refuses_other_families_in_one_line(tmp_path):
    torch.manual_seed(0)
    gpt2 = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=300)).eval()
    back = load_model(write(gpt2, tmp_path / "gpt2"))
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        assert isinstance(back, GPT2) and torch.equal(back(ids), gpt2(ids))
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma2", "num_hidden_layers": 2}))
    with pytest.raises(CheckpointError, match=r"model_type is 'gemma2'; kvlab loads gpt2, llama, qwen2, mistral"):
        load_model(folder)


def test_a_checkpoint_that_disagrees_with_its_config_is_refused_before_anything_is_built(tmp_path):
    folder = write(randomized(config(n_kv_head=2)), tmp_path / "m")
    d = json.loads((folder / "config.json").read_text())
    d["num_key_value_heads"] = 4
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"self_attn.k_proj.weight' has shape \(32, 64\) in the file, the "
                                              r"config asks for \(64, 64\)"):
        load_model(folder)
    index = write(randomized(config()), tmp_path / "s", shards=2) / hf.SHARD_INDEX
    d = json.loads(index.read_text())
    d["weight_map"] = {k: "model-00009-of-00002.safetensors" for k in d["weight_map"]}
    index.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="names shard 'model-00009-of-00002.safetensors', which is not a file"):
        load_model(index.parent)


def test_presets_have_the_real_models_shapes_and_read_config_gives_them_back(tmp_path):
    """Each preset's parameter count is its model's; a folder written from a preset's config reads back equal."""
    counts = {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400}
    for name, n in counts.items():
        cfg = preset_config(name)
        assert cfg.num_params() == n
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg.hf_dict()))
        assert read_config(folder) == cfg
    d = preset_config("smollm2-135m").hf_dict()
    hcfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):  # transformers' count of the same config, nothing allocated
        assert transformers.AutoModelForCausalLM.from_config(hcfg).num_parameters() == counts["smollm2-135m"]
    tiny = build(preset_config("tiny-gqa"))
    assert isinstance(tiny, Llama) and tiny.config.n_kv_head == 2 and llama_format(tiny.config).tied


# ---- ragged batches, prefix reuse and the compiled step on the family ------------------------------------------------

RAGGED = (5, 1, 19, 12)


@pytest.mark.slow
@pytest.mark.parametrize("kind,opts", [pytest.param(None, {}, id="uncached")] + [
    c for c in CASES if CACHE_KINDS[c.values[0]].exact and not CACHE_KINDS[c.values[0]].why_no_padding
    and CACHE_KINDS[c.values[0]].min_prompt(CACHE_KINDS[c.values[0]].parse_options(**c.values[1])) <= 1])
def test_each_sequence_of_a_ragged_batch_equals_running_it_alone_on_a_gqa_model(grouped, kind, opts):
    """Left padding with rotary positions: each sequence's positions (so its rotations) count from its own first
    token, and no query sees padding; every exact kind that runs ragged batches gives each sequence its own run."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 50257, (n,), generator=g).tolist() for n in RAGGED]
    reference = {} if kind is None else CACHE_KINDS[kind].reference(CACHE_KINDS[kind].parse_options(**opts))
    out = greedy(grouped, prompts, 12, layout=kind, **opts)
    for i, p in enumerate(prompts):
        noted = {} if out.keeps is None else {"keep": out.keeps.sequence(i)}
        alone = greedy(grouped, [p], 12, **reference, **noted)
        assert torch.equal(out.tokens[i], alone.tokens[0]), f"sequence {i} ({len(p)} tokens) diverged"
        assert (out.logits[i] - alone.logits[0]).abs().max().item() <= 1e-4


def test_forked_paged_continuations_of_one_prompt_equal_prealloc_on_a_gqa_model(grouped):
    """Prefix reuse: three continuations share the prompt's blocks (K/V heads only) and each equals its own whole
    sequence through prealloc."""
    prompt = torch.randint(0, 50257, (1, 10), generator=torch.Generator().manual_seed(5))
    one = new_cache(grouped, "paged", max_len=32, batch=1, block_size=4, blocks=16)
    prefill(grouped, prompt, one)
    forks = one.fork(3)
    firsts = torch.tensor([[11], [7], [4242]])
    seen = [decode_step(grouped, firsts, forks)[0]]
    for _ in range(4):
        seen.append(decode_step(grouped, seen[-1].argmax(-1), forks)[0])
    seen = torch.cat(seen, dim=1)
    for i in range(3):
        ctx = torch.cat([prompt[0], firsts[i], seen[i, :-1].argmax(-1)]).unsqueeze(0)
        want = prefill(grouped, ctx, new_cache(grouped, "prealloc", max_len=32))[0][0, 10:]
        assert (seen[i] - want).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["gqa", "mqa"])
def test_the_compiled_static_step_runs_grouped_query_attention_as_eager_does(n_kv_head):
    from harness.core.engines import KvlabEngine

    model = randomized(config(n_kv_head=n_kv_head, vocab_size=300, n_positions=64))
    prompt = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(6))
    compiled, eager = KvlabEngine(model, compile=True), KvlabEngine(model)
    outs = []
    for engine in (compiled, eager):
        cache = engine.new_cache("prealloc", max_len=40, batch=2)
        logits = [engine.prefill(prompt, cache, last_only=True)]
        for _ in range(10):
            logits.append(engine.decode(logits[-1][:, -1:].argmax(-1), cache))
        outs.append(torch.cat(logits, dim=1))
    st = compiled.compile_stats  # the first step compiles (counted apart), the other nine run compiled
    assert st["compiled_steps"] == 9 and (outs[0] - outs[1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind,opts", [("quant", dict(group_size=8)),
                                       ("quant", dict(group_size=8, k_axis="token", k_bits=2, residual=3)),
                                       ("quant", dict(group_size=4, rotate="hadamard", scheme="symmetric")),
                                       ("paged", dict(block_size=4))])
@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["gqa", "mqa"])
def test_the_cpu_kernels_read_each_query_heads_group_kv_head(kind, opts, n_kv_head):
    """compile=true's decode attention for quant and paged (the C++ kernels, K/V read where they lie) on a cache of
    n_kv_head heads with 4 query heads: each query head reads its group's K/V head, equal within float32 rounding to
    attention over the history update returns for the same stored bytes."""
    from models.kv_cache import kernels, make_cache

    if kernels.load() is None:
        pytest.fail("the decode kernels are not built: make setup builds them (a C++ compiler is needed)")
    g = torch.Generator().manual_seed(11)
    fused, plain = (make_cache(kind, 2, n_kv_head, 16, 40, 2, **opts) for _ in range(2))
    for cache in (fused, plain):  # the same history in both: 21 tokens over a few decode steps
        gen = torch.Generator().manual_seed(12)
        for t in (17, 1, 1, 1, 1):
            for layer in range(2):
                cache.update(layer, *(torch.randn(2, n_kv_head, t, 16, generator=gen) for _ in range(2)))
            cache.advance(t)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k_new, v_new = (torch.randn(2, n_kv_head, 1, 16, generator=g) for _ in range(2))
    fused.fused = True
    got = fused.attend_decode(1, q, k_new, v_new)
    k, v = plain.update(1, k_new, v_new)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4 // n_kv_head, 1), v.repeat_interleave(4 // n_kv_head, 1))
    assert got.shape == (2, 4, 1, 16) and (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("opts", [dict(k_bits=2, v_bits=4, group_size=8), dict(k_bits=4, v_bits=2, group_size=8,
                                                                                 k_axis="token", v_axis="channel")],
                         ids=["kivi-axes", "swapped-axes"])
def test_quant_on_grouped_heads_keeps_its_error_bound_and_scales_per_kv_head(grouped, opts):
    """What attention reads from a quant cache on a GQA or MQA model is within the kind's stated bound of what was
    written, per K/V head, through prefill and decode steps."""
    cache = new_cache(grouped, "quant", max_len=40, **opts)
    written = [[], []]
    inner = cache.update

    def update(layer, k, v):
        if layer == 0:
            written[0].append(k.to(cache.dtype))
            written[1].append(v.to(cache.dtype))
        kr, vr = inner(layer, k, v)
        if layer == 0:
            kb, vb = cache.error_bound(0)
            for got, want, bound in ((kr, torch.cat(written[0], 2), kb), (vr, torch.cat(written[1], 2), vb)):
                assert got.shape[1] == grouped.config.n_kv_head
                assert ((got.float() - want.float()).abs() <= bound * (1 + 1e-5) + 1e-6).all()
        return kr, vr

    cache.update = update
    prompt = torch.randint(0, 50257, (1, 17), generator=torch.Generator().manual_seed(9))
    logits = prefill(grouped, prompt, cache)[0]
    for _ in range(12):
        logits = decode_step(grouped, logits[:, -1:].argmax(-1), cache)[0]
    del cache.update  # the check's closure holds what was written: not the cache's bytes
    assert len(written[0]) == 13 and cache.nbytes == cache.formula_nbytes()


@pytest.mark.parametrize("edit,says", [
    (dict(rope_parameters="x"), "rope_parameters must be an object"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                        "original_max_position_embeddings": "x"}),
     "rope_scaling's original_max_position_embeddings must be a positive finite number"),
    (dict(rope_theta=float("inf")), "rope_theta must be a positive finite number"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
    (dict(num_key_value_heads=0), "num_key_value_heads must be a positive integer"),
])
def test_config_fields_of_the_wrong_kind_are_refused_naming_the_field(tmp_path, edit, says):
    folder = write(randomized(config()), tmp_path / "m")
    d = json.loads((folder / "config.json").read_text())
    d.update(edit)
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=says.replace("(", r"\(")) as e:
        load_model(folder)
    assert str(e.value).startswith(str(folder / "config.json")) and "\n" not in str(e.value)


def test_shards_that_repeat_a_tensor_or_name_no_file_and_weights_of_other_dtypes_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write(randomized(config()), tmp_path / "s", shards=2)
    index = json.loads((folder / hf.SHARD_INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    extra = load_file(str(folder / first))
    name = next(iter(extra))
    second = sorted(set(index["weight_map"].values()))[1]
    save_file({**load_file(str(folder / second)), name: extra[name]}, str(folder / second))
    with pytest.raises(CheckpointError, match=f"tensor '{re.escape(name)}' is also in"):
        load_model(folder)
    index["weight_map"] = {k: 1 for k in index["weight_map"]}
    (folder / hf.SHARD_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="weight_map must name each tensor's shard file"):
        load_model(folder)
    one = write(randomized(config()), tmp_path / "f8")
    state = load_file(str(one / hf.SAFETENSORS))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(state, str(one / hf.SAFETENSORS))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is float8_e4m3fn: kvlab loads float32, float16"):
        load_model(one)


def test_a_mistral_sliding_window_is_the_length_the_model_runs(tmp_path):
    m = randomized(config(model_type="mistral"))
    d = m.hf_config_dict()
    d.update(sliding_window=16)
    folder = tmp_path / "mis"
    hf.write_folder(folder, m.state_dict(), d, fmt=m.hf_format)
    cfg = read_config(folder)
    assert cfg.n_positions == 16 == cfg.sliding_window
    with pytest.raises(ValueError, match="sliding_window 16"):
        load_model(folder)(torch.zeros(1, 17, dtype=torch.long))


def test_the_repositioned_reference_stays_exact_on_long_streams_of_large_logits():
    """Large weights (logits of tens) and a stream 13 times the trained length: the uncached reference of the
    re-positioned window, one long forward, equals the cached steps within 1e-4 (its angles are computed in fp64,
    so a rotation by a distance does not depend on how far along the stream it is)."""
    torch.manual_seed(4)
    m = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, n_positions=32,
                          vocab_size=300)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.3) if name.endswith("norm.weight") else p.normal_(0.0, 0.3)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(5))
    out = greedy(m, ids, 400, layout="window", window=8, sinks=0, positions="cache")
    with torch.no_grad():
        ref = m(torch.cat([ids, out.tokens], dim=1), window=8, sinks=0, positions="cache")[0, 11:-1]
    assert out.logits.abs().max().item() > 10
    assert torch.equal(ref.argmax(-1), out.tokens[0]) and (out.logits[0] - ref).abs().max().item() <= 1e-4

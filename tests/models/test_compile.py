"""The compiled decode step (``compile=true``): gpt-fast's static-shape step on the prealloc kind, through
torch.compile with fullgraph (a graph break is an error). It must equal the eager step, compile once per cache
geometry, and never recompile across decode steps. On CPU inductor needs a C++ compiler; on a GPU the same test runs
with CUDA graphs (mode reduce-overhead) and also counts CUDA-graph skips."""

import copy
import shutil
from dataclasses import asdict

import pytest
import torch

from harness.core.engines import KvlabEngine
from models.gpt2 import GPT2, GPT2Config
from models.generate import StaticDecoder, new_cache

pytestmark = pytest.mark.slow  # compiling takes seconds


def counters():
    """torch._dynamo's event counters, imported when a test runs (importing dynamo costs each worker seconds at
    collection)"""
    from torch._dynamo.utils import counters as dynamo_counters

    return dynamo_counters


def run_compiled(model, device, batch=2, prompt=9, steps=12):
    """Two caches of one geometry, decoded eager and compiled from the same prompt: the largest |Δlogit| and
    whether every greedy token agrees."""
    eager, compiled = KvlabEngine(model), KvlabEngine(model, compile=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=g).to(device)
    worst, same = 0.0, True
    for _ in range(2):  # a second cache of the same geometry: the buffers are swapped, nothing recompiles
        a, b = new_cache(model, "prealloc", 40, batch), new_cache(model, "prealloc", 40, batch)
        la, lb = eager.prefill(ids, a, last_only=True), compiled.prefill(ids, b, last_only=True)
        for _ in range(steps):
            nxt = la[:, -1:].argmax(-1)
            la, lb = eager.decode(nxt, a), compiled.decode(nxt, b)
            worst = max(worst, float((la.float() - lb.float()).abs().max()))
            same &= bool(torch.equal(la.argmax(-1), lb.argmax(-1)))
        assert a.pos == b.pos == prompt + steps
    return compiled.compile_stats, worst, same


def check(stats, worst, same, tol):
    assert stats["compile_graphs"] == 1 and stats["compile_recompiles"] == 0
    assert stats["compiled_steps"] == 2 * 12 - 1 and stats["compile_s"] > 0
    assert not counters()["graph_break"]  # fullgraph=True would have raised; and none were counted
    assert same and worst <= tol


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor compiles CPU kernels with a C++ compiler; none on this machine")
def test_compiled_cpu_step_equals_eager_and_never_recompiles(tiny_model):
    counters().clear()
    stats, worst, same = run_compiled(tiny_model, "cpu")
    check(stats, worst, same, 1e-5)
    assert stats["compile_cudagraph_skips"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU path runs CUDA graphs")
def test_compiled_gpu_step_with_cuda_graphs_equals_eager_and_never_recompiles(tiny_model):
    counters().clear()
    model = copy.deepcopy(tiny_model).to("cuda", torch.float16)
    stats, worst, same = run_compiled(model, "cuda")
    check(stats, worst, same, 2e-2)
    assert stats["compile_cudagraph_skips"] == 0


def test_a_static_step_refuses_what_it_cannot_run(tiny_model):
    with pytest.raises(ValueError, match="runs on a prealloc cache of one prompt length"):
        StaticDecoder(tiny_model, new_cache(tiny_model, "concat", 8))
    engine = KvlabEngine(tiny_model, compile=True)
    cache = new_cache(tiny_model, "prealloc", 3)
    engine.prefill(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match=r"KV cache overflow: pos 3 \+ 1 new tokens > max_len 3"):
        engine.decode(torch.tensor([[4]]), cache)
    n = tiny_model.config.n_positions
    long = new_cache(tiny_model, "prealloc", n + 4)
    engine.prefill(torch.zeros(1, n, dtype=torch.long), long)
    with pytest.raises(ValueError, match=f"sequence too long: {n} cached \\+ 1 new tokens > n_positions {n}"):
        engine.decode(torch.tensor([[4]]), long)


def quant_options() -> tuple[dict, ...]:
    """The quant kind's conformance option sets and the layouts its kernel paths split on."""
    from models.kv_cache import QuantKVCache

    return QuantKVCache.examples + ({"k_bits": 8, "v_bits": 4, "group_size": 24},  # 32 channels: 24 + 8
                                    # group_size 32 (the default): K per 32 tokens, V per 32 channels
                                    {"k_bits": 4, "v_bits": 4}, {"k_bits": 2, "v_bits": 8},
                                    {"k_bits": 8, "v_bits": 2, "residual": 5},
                                    # groups of 6 channels split 2-bit bytes: the kernel's row-by-row path
                                    {"k_bits": 2, "v_bits": 2, "group_size": 6, "k_axis": "token"},
                                    # the symmetric scheme (no minimum stored) on the whole-row loops of 64-channel
                                    # heads (K per channel, V per token, groups of 32) and on the row-by-row path
                                    {"k_bits": 4, "v_bits": 8, "residual": 5, "scheme": "symmetric"},
                                    {"k_bits": 4, "v_bits": 2, "group_size": 6, "k_axis": "token",
                                     "v_axis": "channel", "scheme": "symmetric"})


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor compiles CPU kernels with a C++ compiler; none on this machine")
@pytest.mark.parametrize("path, dtype, head", [("kernel", torch.float32, 32), ("kernel", torch.bfloat16, 32),
                                               ("inductor", torch.float32, 32), ("kernel", torch.float32, 64)])
def test_quant_attention_over_its_packed_storage_equals_the_dequantised_path(tiny_model, path, dtype, head,
                                                                            monkeypatch):
    """compile=true on the quant kind: decode attention reads the packed bytes, scales and tails where they lie
    instead of a dequantised copy: on the CPU through the C++ kernel (``kernel_attention``), on a GPU through
    torch.compile (``stored_attention``, run here on the CPU too). For every conformance option set (both axes,
    2/4/8 bits, residual, a partial channel group, the rotation, K or V alone, either scheme: a symmetric cache
    stores no minimum, and both paths take it as -N * scale) and across group boundaries, the logits equal the
    eager path's within float32 rounding (bf16: within its own rounding of the same values), one graph per layout
    (the kernel: none), no recompile across steps, and the caches hold the same bytes (later layers' K/V differ by
    the rounding of earlier layers' attention). Heads of 64 channels (GPT-2's) take the
    kernel's whole-row loops for K per channel and V per token in groups of 32; the tiny model's 32, the general ones."""
    from models.kv_cache import QuantKVCache, quant

    if head == 64:
        torch.manual_seed(0)
        tiny_model = GPT2(GPT2Config(**{**asdict(tiny_model.config), "n_embd": 128})).eval()
        assert tiny_model.config.n_embd // tiny_model.config.n_head == 64

    monkeypatch.setattr(quant, "FORCE_INDUCTOR", path == "inductor")

    counters().clear()
    model = copy.deepcopy(tiny_model).to(dtype)
    eager, compiled = KvlabEngine(model), KvlabEngine(model, compile=True)
    options = quant_options()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    for opts in options:
        a, b = new_cache(model, "quant", 48, 2, **opts), new_cache(model, "quant", 48, 2, **opts)
        la, lb = eager.prefill(ids, a, last_only=True), compiled.prefill(ids, b, last_only=True)
        for _ in range(30):  # past several groups of 8 and 16 tokens
            nxt = la[:, -1:].argmax(-1)
            la, lb = eager.decode(nxt, a), compiled.decode(nxt, b)
            # fp32: within 1e-4 of the logits' scale. A layer's attention differs from the eager path's by float32
            # rounding (~1e-7: test_quant_kernel_equals_stored_attention_on_the_same_bytes holds it to that), which
            # can move a value of the next layer's K or V across a quantisation boundary: one 8-bit step there
            # moves these logits by ~2e-5 of their scale, and the difference then stays in the cache
            scale = float(la.float().abs().max())
            tol = 1e-4 * scale if dtype == torch.float32 else 2e-2 * scale
            assert float((la.float() - lb.float()).abs().max()) <= tol, opts
        assert a.pos == b.pos == 37 and a.nbytes == b.nbytes
        # layer 0 saw the same K/V up to the rounding of the compiled step's projection (the eager step's is
        # another): what each stored is within one quantisation step of the other's, value by value
        for which, n_quant in zip("kv", a._split(a.pos)):
            if n_quant:
                da = a._dequantized(0, which, n_quant)
                gap = (da - b._dequantized(0, which, n_quant)).abs()
                step = 2 * torch.maximum(a._half_steps(0, which, n_quant), b._half_steps(0, which, n_quant))
                rounding = 4 * torch.finfo(dtype).eps * float(da.abs().max())  # of the projection, in dtype
                assert bool((gap <= step * 1.01 + rounding).all()), (opts, which, float((gap - step).max()))
        torch.testing.assert_close(b.v_tail.float(), a.v_tail.float(), atol=tol, rtol=0)
    st = compiled.compile_stats
    assert st["compile_recompiles"] == 0 and st["compiled_steps"] == len(options) * 29
    # the kernel: the step compiled whole once, the kind's attention one opaque op whatever its layout; inductor's
    # attention: one graph per layout (bits, axes, group) for every layer and step, the rest of the step eager
    # (tail=residual reads a filling per-channel group quantised, not what is stored: its step takes the update path
    # and compiles no attention graph of its own; its logits are held to the eager path's above all the same)
    stored = [o for o in options if o.get("tail") != "residual"]
    assert len(stored) < len(options)
    assert st["compile_graphs"] == (len(stored) if path == "inductor" else 1)
    assert not counters()["graph_break"]


def test_text_drift_records_what_a_fused_quant_step_read(tiny_model):
    """The text-drift pass records the K/V attention read at its last step; a fused quant step never calls update,
    so it records them through stored_history: the same history, the same logits as the eager pass."""
    from harness.core import measure

    spec = measure.CacheSpec("quant", {"k_bits": 4, "v_bits": 2, "group_size": 8, "residual": 4})
    seq = torch.randint(0, tiny_model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    eager, seen_e = measure.text_pass(KvlabEngine(tiny_model), spec, seq, 12)
    fused, seen_f = measure.text_pass(KvlabEngine(tiny_model, compile=True), spec, seq, 12)
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=0)
    assert sorted(seen_f) == sorted(seen_e) == list(range(tiny_model.config.n_layer))
    for layer in seen_e:
        for a, b in zip(seen_e[layer][:2], seen_f[layer][:2]):
            assert a.shape == b.shape == (1, tiny_model.config.n_head, 39, tiny_model.config.head_dim)
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_through_its_block_table_equals_the_gathered_path(tiny_model, dtype):
    """compile=true on the paged kind: a decode step reads every key and value row through the block table where it
    lies in the pool (the CPU kernel) instead of gathering the blocks into a copy. For each conformance block size,
    batch 2, across block boundaries, the logits equal the gathering path's within float32 rounding (bf16: its own
    rounding), and the drift pass records the same history through stored_history."""
    from harness.core import measure
    from models.kv_cache import PagedKVCache

    model = copy.deepcopy(tiny_model).to(dtype)
    eager, compiled = KvlabEngine(model), KvlabEngine(model, compile=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    for opts in PagedKVCache.examples:
        a, b = new_cache(model, "paged", 48, 2, **opts), new_cache(model, "paged", 48, 2, **opts)
        la, lb = eager.prefill(ids, a, last_only=True), compiled.prefill(ids, b, last_only=True)
        for _ in range(25):
            nxt = la[:, -1:].argmax(-1)
            la, lb = eager.decode(nxt, a), compiled.decode(nxt, b)
            scale = float(la.float().abs().max())
            assert float((la.float() - lb.float()).abs().max()) <= (1e-5 if dtype == torch.float32 else 2e-2) * scale
        assert a.pos == b.pos == 32 and a.nbytes == b.nbytes
    assert compiled.compile_stats["compiled_steps"] == len(PagedKVCache.examples) * 24
    spec = measure.CacheSpec("paged", {"block_size": 4})
    seq = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(6))
    (le, se), (lf, sf) = (measure.text_pass(e, spec, seq, 9) for e in (eager, compiled))
    assert float((le - lf).abs().max()) <= (1e-5 if dtype == torch.float32 else 2e-2) * float(le.abs().max())
    assert all(sf[i][0].shape == se[i][0].shape == (1, model.config.n_head, 29, model.config.head_dim) for i in se)


def test_paged_attention_in_a_ragged_batch_reads_each_sequences_own_keys(tiny_model):
    """A ragged paged batch (left padding, sequences that end and hand their blocks back) decoded with compile=true:
    each sequence's step reads its own first keys through the kernel (its length, not a mask over gathered blocks),
    and every live sequence's logits equal the update path's within float32 rounding, step after step."""
    from models.generate import left_pad
    from models.kv_cache import PagedKVCache

    eager, compiled = KvlabEngine(tiny_model), KvlabEngine(tiny_model, compile=True)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, tiny_model.config.vocab_size, (n,), generator=g) for n in (3, 11, 6, 1)]
    ends = {0: 5, 2: 9}  # sequence: the step after which it ends
    idx, pad = left_pad(prompts)
    for opts in PagedKVCache.examples:
        a, b = new_cache(tiny_model, "paged", 64, 4, **opts), new_cache(tiny_model, "paged", 64, 4, **opts)
        la = eager.prefill(idx, a, last_only=True, pad=pad)[:, -1]
        lb = compiled.prefill(idx, b, last_only=True, pad=pad)[:, -1]
        live = set(range(4))
        for step in range(20):
            for seq, at in ends.items():
                if step == at:
                    live.discard(seq)
                    a.end(seq), b.end(seq)
            nxt = la.argmax(-1, keepdim=True)
            la, lb = eager.decode(nxt, a)[:, -1], compiled.decode(nxt, b)[:, -1]
            rows = sorted(live)
            assert torch.isfinite(lb).all()
            assert float((la[rows] - lb[rows]).abs().max()) <= 1e-5 * float(la[rows].abs().max())
        assert not b._uniform and b._lens.tolist() == [1, 11 + 20, 1, 1 + 20]  # ended: one stale key each
    assert compiled.compile_stats["compiled_steps"] == len(PagedKVCache.examples) * 19  # the first: the compile


@pytest.mark.parametrize("head", [32, 64])
def test_quant_kernel_equals_stored_attention_on_the_same_bytes(head):
    """The C++ kernel's decode attention (``kernel_attention``: the cache's tensors as it holds them, fp16 scales
    read in place) against ``stored_attention`` (torch ops over the same packed bytes) on one cache, for every
    option set, at token counts on and between group boundaries, in fp32 and bf16 storage: equal within float32
    rounding (2e-6 of the output's scale), for a later layer as for the first."""
    from models.kv_cache import kernels, make_cache, quant

    kernel = kernels.load()
    g = torch.Generator().manual_seed(head)
    for opts in quant_options():
        for storage in (torch.float32, torch.bfloat16):
            c = make_cache("quant", 2, 3, head, 48, 2, dtype=storage, **opts)
            for n in (16, 37, 40):
                c.reset()
                for layer in (0, 1):
                    c.update(layer, *(torch.randn(2, 3, n, head, generator=g).to(storage) for _ in range(2)))
                c.advance(n)
                q = torch.randn(2, 3, 1, head, generator=g)
                n_k, n_v = c._split(n)
                o = c.opts

                def parts(which):  # min None: the symmetric scheme
                    packed = getattr(c, f"{which}_q")[1]
                    held = o.axis(which) != "none" and packed.shape[2] > 0
                    stored = (getattr(c, f"{which}_{p}") for p in ("q", "scale", "min"))
                    return (*(t[1] if held and t is not None else None for t in stored),
                            getattr(c, f"{which}_tail")[1])

                layout = ((o.bits("k"), o.axis("k")), (o.bits("v"), o.axis("v")), o.group_size, head)
                want = quant.stored_attention(q, parts("k"), parts("v"), torch.tensor(n_k), torch.tensor(n_v),
                                              torch.tensor(n), c._rotation(), layout)
                got = quant.kernel_attention(kernel, c, 1, q, n_k, n_v, n)
                assert got.shape == want.shape and got.dtype == q.dtype
                assert float((got - want).abs().max()) <= 2e-6 * float(want.abs().max()), (opts, storage, n)


@pytest.mark.parametrize("scheme", ["asymmetric", "symmetric"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_the_kernels_token_quantiser_gives_quantize_and_packs_bytes(bits, scheme):
    """What the compiled step stores for a per-token group is, byte for byte, what quant.quantize (symmetric:
    quant.quantize_symmetric, no minimum) + pack store: full, partial and whole-row channel groups, tiny to
    fp16-overflowing ranges, a constant row, tied magnitudes, inf and NaN."""
    from models.kv_cache import kernels, quant

    kernel = kernels.load()
    symmetric = scheme == "symmetric"
    g = torch.Generator().manual_seed(bits)
    for hs, G in ((64, 32), (64, 24), (30, 16), (64, 64)):
        for magnitude in (1e-3, 1.0, 7e4) + ((1e8,) if symmetric else ()):  # 1e8: a scale beyond fp16
            x = torch.randn(40, hs, generator=g) * magnitude
            x[3], x[4, :5], x[5, 7] = 0.0, float("inf"), float("nan")
            if symmetric:  # tied magnitudes: the first is m (q4_0's rule), the other is clamped
                x[6, 2], x[6, 9] = -5 * magnitude, 5 * magnitude
            ng = -(-hs // G)
            padded = torch.cat([x, x[:, -1:].expand(40, ng * G - hs)], -1)
            if symmetric:
                q, scale = quant.quantize_symmetric(padded.view(40, ng, G), bits, dim=2)
                want = (quant.pack(q.view(40, ng * G)[:, :hs], bits), scale.squeeze(2))
            else:
                q, scale, lo = quant.quantize(padded.view(40, ng, G), bits, dim=2)
                want = (quant.pack(q.view(40, ng * G)[:, :hs], bits), scale.squeeze(2), lo.squeeze(2))
            got_all = kernel.quantize_tokens(x.contiguous(), bits, G, symmetric)
            assert got_all[2].numel() == (0 if symmetric else 40 * ng)
            for w, got in zip(want, got_all):
                assert torch.equal(w.view(torch.uint8 if w.dtype == torch.uint8 else torch.int16),
                                   got.view(torch.uint8 if got.dtype == torch.uint8 else torch.int16)), (hs, G)
            # in place, as a decode step writes: 2 x 4 rows of 5 tokens into slots 3..7 of layer 1 of 2; the
            # other slots and the other layer keep what they held
            stores = [torch.full((2, 2, 4, 9, want[0].shape[1]), 0xAB, dtype=torch.uint8),
                      *(torch.full((2, 2, 4, 9, ng), -7.0, dtype=torch.float16) for _ in range(len(want) - 1))]
            before = [t.clone() for t in stores]
            lo = [] if not symmetric else [torch.empty(0, dtype=torch.float16)]
            kernel.quantize_into(x.view(2, 4, 5, hs), 1, *stores, *lo, 3, bits, G, symmetric)
            for w, got, old in zip(want, stores, before):
                as_bits = (lambda t: t.view(torch.uint8 if t.dtype == torch.uint8 else torch.int16))
                assert torch.equal(as_bits(got[1, :, :, 3:8]), as_bits(w.view(2, 4, 5, -1))), (hs, G)
                got[1, :, :, 3:8] = old[1, :, :, 3:8]
                assert torch.equal(as_bits(got), as_bits(old)), (hs, G)

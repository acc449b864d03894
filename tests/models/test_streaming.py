"""What rotary positions make possible (models/llama.py, docs/models.md): a window that re-positions its keys by
their place in the cache (``cache=window cache.positions=cache``, StreamingLLM's) and keys quantised before the
rotation (``cache=quant cache.k_pre_rope=true``, KVQuant's); and GPT-2 refusing both in one line."""

import pytest
import torch
import transformers

from models.generate import greedy, new_cache, prefill
from models.gpt2 import GPT2, GPT2Config
from models.kv_cache import CACHE_KINDS
from models.llama import Llama, LlamaConfig

S, W = 3, 10


def model(n_layer=2, n_kv_head=2, seed=0) -> Llama:
    torch.manual_seed(seed)
    m = Llama(LlamaConfig(n_layer=n_layer, n_head=4, n_kv_head=n_kv_head, n_embd=64, intermediate_size=96,
                          n_positions=64, vocab_size=300)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0, 0.2) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    return m


def test_one_layer_repositioned_step_is_full_attention_over_the_kept_tokens_at_positions_0_to_S_plus_W():
    """StreamingLLM's definition, literally: in a one-layer model a key is its token's projection rotated by its
    position, so the re-positioned window's step at t is full attention over the kept tokens (the S sinks, then the
    W newest) laid out at positions 0 .. S + W - 1. Checked against transformers' own Llama on that short sequence,
    at t far past the 64 positions the model was built for."""
    m = model(n_layer=1)
    d = m.hf_config_dict()
    twin = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(d.pop("model_type"), **d))
    twin.load_state_dict(m.state_dict(), strict=False)
    twin.eval()
    ids = torch.randint(0, 300, (1, 8 * 64 + 5), generator=torch.Generator().manual_seed(1))
    cache = new_cache(m, "window", max_len=ids.shape[1], window=W, sinks=S, positions="cache")
    with torch.no_grad():
        logits = [prefill(m, ids[:, :40], cache)[0][:, -1]]
        logits += [m(ids[:, t:t + 1], cache)[:, -1] for t in range(40, ids.shape[1])]
        for t in (40, 41, 300, ids.shape[1] - 1):
            kept = torch.cat([ids[:, :S], ids[:, t - W + 1:t + 1]], dim=1)  # sinks, then the window, in order
            want = twin(kept).logits[:, -1]
            assert (logits[t - 39] - want).abs().max().item() <= 1e-4, t
    assert cache.nbytes == cache.formula_nbytes() == 2 * 1 * 2 * (S + W) * 16 * 4  # flat: S + W slots


@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["gqa", "mqa"])
def test_the_repositioned_window_equals_its_reference_past_8x_the_trained_length(n_kv_head):
    """Chunked prefill and one-token steps against ``model(idx, window=W, sinks=S, positions="cache")``, out to 8x
    the model's 64 positions, with finite logits and the same bytes from the first full window on; before the
    window slides it is the plain window, after it differs from it."""
    m = model(n_kv_head=n_kv_head)
    ids = torch.randint(0, 300, (2, 8 * 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(ids, window=W, sinks=S, positions="cache")
        plain = m(ids[:, :64], window=W, sinks=S)
        cache = new_cache(m, "window", max_len=ids.shape[1], batch=2, window=W, sinks=S, positions="cache")
        pieces, sizes = [], []
        for a, b in [(0, 5), (5, 30), (30, 31), (31, 100)] + [(t, t + 1) for t in range(100, ids.shape[1])]:
            pieces.append(m(ids[:, a:b], cache))
            sizes.append(cache.nbytes)
    got = torch.cat(pieces, dim=1)
    assert torch.isfinite(got).all() and (got - ref).abs().max().item() <= 1e-4
    assert len(set(sizes)) == 1 and sizes[0] == cache.formula_nbytes()
    assert (ref[:, :S + W] - plain[:, :S + W]).abs().max().item() <= 1e-5
    assert (ref[:, S + W:64] - plain[:, S + W:]).abs().max().item() > 1e-2
    out = greedy(m, ids[:, :20], 30, layout="window", window=W, sinks=S, positions="cache")
    want = greedy(m, ids[:, :20], 30, window=W, sinks=S, positions="cache")
    assert torch.equal(out.tokens, want.tokens) and (out.logits - want.logits).abs().max().item() <= 1e-4


def test_gpt2_refuses_repositioning_and_pre_rotation_keys_in_one_line():
    torch.manual_seed(0)
    gpt2 = GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=32, vocab_size=100)).eval()
    ids = torch.randint(0, 100, (1, 12))
    with pytest.raises(ValueError, match="GPT2 has no rotary positions"):
        gpt2(ids, window=4, sinks=1, positions="cache")
    for kind, opts in (("window", dict(window=4, sinks=1, positions="cache")), ("quant", dict(k_pre_rope=True))):
        with pytest.raises(ValueError, match="GPT2 has no rotary positions"):
            prefill(gpt2, ids, new_cache(gpt2, kind, max_len=20, **opts))
        why = CACHE_KINDS[kind].needs_rotary(CACHE_KINDS[kind].parse_options(**opts))
        assert "needs rotary positions" in why and CACHE_KINDS[kind].needs_rotary(
            CACHE_KINDS[kind].parse_options()) is None
    with pytest.raises(ValueError, match="does not run ragged batches"):
        new_cache(model(), "window", max_len=20, batch=2, positions="cache").set_padding([0, 2])


def test_k_pre_rope_quantises_the_keys_before_the_rotation_and_rotates_what_it_dequantises():
    """What the cache holds are the key projections as they leave k_proj (within the quantiser's bound), not the
    rotated keys; at 8 bits the model's output stays within a small distance of full precision; its bytes are the
    plain quant formula; compile=true's fused path and HF refuse it."""
    m = model()
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(3))
    seen = []
    hook = m.model.layers[0].self_attn.k_proj.register_forward_hook(lambda mod, i, o: seen.append(o.detach()))
    cache = new_cache(m, "quant", max_len=60, k_bits=8, v_bits=8, group_size=16, k_axis="token", k_pre_rope=True)
    plain = new_cache(m, "quant", max_len=60, k_bits=8, v_bits=8, group_size=16, k_axis="token")
    with torch.no_grad():
        got = prefill(m, ids, cache)[0]
        hook.remove()
        raw = seen[0].view(1, 40, 2, 16).transpose(1, 2)  # (B, nkv, T, hd) as k_proj gave them
        k, _ = cache.update(0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))  # what attention would read
        bound, _ = cache.error_bound(0)
        assert ((k[:, :, :40] - raw).abs() <= bound[:, :, :40] * (1 + 1e-5) + 1e-6).all()
        full = m(ids)
        assert (got - full).abs().max().item() < 0.2 and (got - full).abs().max().item() > 0
        prefill(m, ids, plain)
    assert cache.formula_nbytes() == plain.formula_nbytes()
    opts = CACHE_KINDS["quant"].parse_options(k_pre_rope=True)
    assert "k_pre_rope" in CACHE_KINDS["quant"].refuses_fused(opts)
    from harness.core.engines import hf_refuses
    assert "store keys after the rotation" in hf_refuses("quant", opts, 16)

"""Cache storage: bytes against the formula, overflow, history, dtype, reset, crop, snapshot."""

import pytest
import torch

from models.generate import decode_step, greedy, new_cache, prefill
from models.gpt2 import GPT2Config
from models.kv_cache import ConcatKVCache, PreallocKVCache, kv_bytes

LAYOUTS = ["concat", "prealloc"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_formula_gpt2_small_per_token():
    c = GPT2Config.preset("gpt2")
    # the spec's numbers: 2 (K, V) x 12 layers x 768 wide x 4 B (FP32) or 2 B (FP16)
    assert kv_bytes(c.n_layer, c.n_head, c.head_dim, 1) == 2 * 12 * 768 * 4 == 73_728
    assert kv_bytes(c.n_layer, c.n_head, c.head_dim, 1, dtype=torch.float16) == 36_864
    assert kv_bytes(c.n_layer, c.n_head, c.head_dim, 10, batch=3, dtype="bf16") == 3 * 10 * 36_864


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpt2_small_caches_hold_exactly_the_formula(dtype):
    c = GPT2Config.preset("gpt2")
    k = torch.randn(2, c.n_head, 7, c.head_dim)
    concat = ConcatKVCache(c.n_layer, c.n_head, c.head_dim, 50, 2, dtype=dtype)
    pre = PreallocKVCache(c.n_layer, c.n_head, c.head_dim, 50, 2, dtype=dtype)
    for cache in (concat, pre):
        for layer in range(c.n_layer):
            cache.update(layer, k, k)
        cache.advance(7)
    per_token = kv_bytes(c.n_layer, c.n_head, c.head_dim, 1, dtype=dtype)
    assert concat.nbytes == kv_bytes(c.n_layer, c.n_head, c.head_dim, 7, batch=2, dtype=dtype) == 14 * per_token
    assert pre.nbytes == kv_bytes(c.n_layer, c.n_head, c.head_dim, 50, batch=2, dtype=dtype) == 100 * per_token
    assert pre.filled_nbytes == concat.nbytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nbytes_tracks_generation(tiny_model, layout):
    c = tiny_model.config
    cache = new_cache(tiny_model, layout, max_len=40)
    prefill(tiny_model, torch.tensor([[1, 2, 3, 4, 5]]), cache)
    for _ in range(6):
        decode_step(tiny_model, torch.tensor([[7]]), cache)
    assert cache.pos == 11
    n = 11 if layout == "concat" else 40
    assert cache.nbytes == kv_bytes(c.n_layer, c.n_head, c.head_dim, n)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_overflow_past_max_len_raises_and_writes_nothing(tiny_model, layout):
    cache = new_cache(tiny_model, layout, max_len=6)
    prefill(tiny_model, torch.tensor([[1, 2, 3, 4, 5]]), cache)
    decode_step(tiny_model, torch.tensor([[6]]), cache)
    before = cache.snapshot()
    with pytest.raises(ValueError, match=r"pos 6 \+ 1 new tokens > max_len 6"):
        decode_step(tiny_model, torch.tensor([[7]]), cache)
    assert cache.pos == 6
    assert torch.equal(torch.as_tensor(before["k"][0]), torch.as_tensor(cache.snapshot()["k"][0]))
    with pytest.raises(ValueError, match=r"pos 0 \+ 9 new tokens > max_len 6"):
        prefill(tiny_model, torch.arange(9).unsqueeze(0), new_cache(tiny_model, layout, max_len=6))


def test_model_refuses_positions_past_n_positions(tiny_model):
    n = tiny_model.config.n_positions
    with pytest.raises(ValueError, match=f"n_positions {n}"):
        tiny_model(torch.zeros(1, n + 1, dtype=torch.long))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_storage_dtype_is_reduced_while_compute_stays_fp32(tiny_model, layout, dtype):
    prompt = torch.tensor([[464, 3290, 318, 257]])
    ref = greedy(tiny_model, prompt, 10, layout=layout)
    low = greedy(tiny_model, prompt, 10, layout=layout, cache_dtype=dtype)
    cache = new_cache(tiny_model, layout, 8, dtype=dtype)
    k, _ = cache.update(0, torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32))
    assert k.dtype == dtype
    assert low.logits.dtype == torch.float32
    drift = (low.logits - ref.logits).abs().max().item()
    assert 0 < drift < 0.05  # rounded K/V move the logits a little, never a lot


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reset_crop_and_snapshot_restore(tiny_model, layout):
    prompt = torch.tensor([[10, 20, 30, 40]])
    cache = new_cache(tiny_model, layout, max_len=20)
    first = prefill(tiny_model, prompt, cache)[0]
    snap = cache.snapshot()
    a = decode_step(tiny_model, torch.tensor([[5]]), cache)[0]
    cache.crop(4)
    assert cache.pos == 4
    b = decode_step(tiny_model, torch.tensor([[5]]), cache)[0]
    cache.restore(snap)
    c = decode_step(tiny_model, torch.tensor([[5]]), cache)[0]
    assert torch.equal(a, b) and torch.equal(a, c)
    # the snapshot shares no storage: overwrite the snapshotted positions, restore, and the old step comes back
    assert snap["k"][0].untyped_storage().data_ptr() != cache.k[0].untyped_storage().data_ptr()
    cache.crop(2)
    prefill(tiny_model, torch.tensor([[99, 98]]), cache)
    assert not torch.equal(decode_step(tiny_model, torch.tensor([[5]]), cache)[0], a)
    cache.restore(snap)
    assert torch.equal(decode_step(tiny_model, torch.tensor([[5]]), cache)[0], a)
    cache.reset()
    assert cache.pos == 0
    again = prefill(tiny_model, prompt, cache)[0]
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="cannot crop to 9"):
        cache.crop(9)


def test_bad_constructor_arguments_are_named():
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        PreallocKVCache(2, 2, 4, 0, 1)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        ConcatKVCache(2, 2, 4, 8, 1, dtype="fp8")

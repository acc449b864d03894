"""The window kind and its reference: the mask rule by hand, what a position can and cannot see in the model,
bounded memory, and GPT-2's absolute positions still ending the sequence."""

import pytest
import torch

from models.generate import decode_step, greedy, new_cache, prefill
from models.gpt2 import attention_mask
from models.kv_cache import kv_bytes


def test_mask_rule_by_hand():
    # window 2, sinks 1: query t sees key 0 and keys t-1, t
    want = torch.tensor([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],
                         [1, 0, 1, 1, 0, 0],
                         [1, 0, 0, 1, 1, 0],
                         [1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(attention_mask(0, 6, None, "cpu", window=2, sinks=1), want)
    # a chunk of 2 after 4 cached positions sees the same rows
    assert torch.equal(attention_mask(4, 2, None, "cpu", window=2, sinks=1), want[4:])
    assert attention_mask(0, 6, None, "cpu") is None  # plain causal: attention's own fast path


def perturbed_logits(model, ids, where, **ref):
    other = ids.clone()
    other[0, where] = (other[0, where] + 1000) % 50257
    with torch.no_grad():
        return model(ids, **ref)[0], model(other, **ref)[0]


def test_a_position_sees_only_what_the_window_shows(tiny_model):
    ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(0))
    # window 1, no sinks: every position sees itself alone, in every layer
    a, b = perturbed_logits(tiny_model, ids, [0, 3, 7], window=1, sinks=0)
    changed = (a - b).abs().amax(-1) > 0
    assert changed.tolist() == [i in (0, 3, 7) for i in range(12)]
    # window 1 + 1 sink: every position also sees position 0
    a, b = perturbed_logits(tiny_model, ids, [0], window=1, sinks=1)
    assert ((a - b).abs().amax(-1) > 0).all()
    a, b = perturbed_logits(tiny_model, ids, [4], window=1, sinks=1)
    assert ((a - b).abs().amax(-1) > 0).tolist() == [i == 4 for i in range(12)]
    # window 3: position 4 reaches position 10 only through layers (2 layers x 2 back), not at 10
    a, b = perturbed_logits(tiny_model, ids, [4], window=3, sinks=0)
    assert ((a - b).abs().amax(-1) > 0).tolist() == [4 <= i <= 8 for i in range(12)]


def test_a_window_wider_than_the_sequence_is_full_attention(tiny_model):
    ids = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (tiny_model(ids, window=20, sinks=0) - tiny_model(ids)).abs().max() <= 1e-5
        assert (tiny_model(ids, window=5, sinks=0) - tiny_model(ids)).abs().max() > 1e-3
    out = greedy(tiny_model, ids, 10, "window", window=64, sinks=0)
    assert torch.equal(out.tokens, greedy(tiny_model, ids, 10, "prealloc").tokens)


def test_memory_stops_growing_and_positions_still_end(tiny_model):
    cache = new_cache(tiny_model, "window", max_len=128, window=6, sinks=2)
    c = tiny_model.config
    prefill(tiny_model, torch.randint(0, 50257, (1, 30)), cache)
    sizes = set()
    for _ in range(40):
        decode_step(tiny_model, torch.tensor([[5]]), cache)
        sizes.add(cache.nbytes)
    assert sizes == {kv_bytes(c.n_layer, c.n_head, c.head_dim, 8)}
    full = new_cache(tiny_model, "window", max_len=c.n_positions, window=6, sinks=2)
    prefill(tiny_model, torch.randint(0, 50257, (1, c.n_positions)), full)
    with pytest.raises(ValueError, match="KV cache overflow|sequence too long"):
        decode_step(tiny_model, torch.tensor([[5]]), full)


def test_bad_window_options_and_mixed_use(tiny_model):
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        new_cache(tiny_model, "window", max_len=16, window=0)
    with pytest.raises(ValueError, match="sinks must be an integer >= 0"):
        new_cache(tiny_model, "window", max_len=16, sinks=-1)
    cache = new_cache(tiny_model, "prealloc", max_len=16)
    with pytest.raises(ValueError, match="a cache applies its own kind's rule"):
        tiny_model(torch.tensor([[1, 2]]), cache=cache, window=4)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        tiny_model(torch.tensor([[1, 2]]), window=0)

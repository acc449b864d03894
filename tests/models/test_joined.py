"""Continuous batching's running batch (``models.kv_cache.batch.joined``): requests prefilled alone, each into its
own one-sequence cache, then decoded together one token a step, joining late and leaving early. Every kind that can
join must give each request exactly the tokens (and, within float32 rounding, the logits) it gets alone with the
same kind, and hold exactly what it would hold alone."""

import pytest
import torch

from models.generate import decode_step, greedy, new_cache, prefill
from models.kv_cache import CACHE_KINDS
from models.kv_cache.batch import RaggedStep, joined, refuses_joining
from models.llama import Llama, LlamaConfig

LENGTHS = (9, 1, 19, 4)  # prompt tokens per request
STARTS = (0, 0, 3, 5)  # the step each joins the running batch at
NEW = (9, 4, 7, 6)  # tokens each generates (the second leaves early)
# each kind with the first option set its class lists (the kinds' own suites vary the options)
KINDS = [pytest.param(kind, cls.examples[0] if cls.examples else {}, id=kind) for kind, cls in CACHE_KINDS.items()]


def _prompts(least: int = 1):
    """The requests' prompts, each at least ``least`` tokens (what a SnapKV window takes)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 50257, (max(n, least),), generator=g) for n in LENGTHS]


def serve(model, kind, opts, prompts, max_len=64, shared_pool=False):
    """The requests served continuously: (tokens, logits) per request, and the caches."""
    caches, logits, nxt = {}, {i: [] for i in range(len(prompts))}, {}
    first = None
    for step in range(max(s + n for s, n in zip(STARTS, NEW))):
        for i, p in enumerate(prompts):  # joining: a prefill of its own
            if STARTS[i] == step:
                if shared_pool and first is not None:
                    caches[i] = first.empty_like(1)
                else:
                    caches[i] = new_cache(model, kind, max_len, 1, **opts)
                    first = first or caches[i]
                out = prefill(model, p.view(1, -1), caches[i], last_only=True)[0][:, -1]
                logits[i].append(out)
                nxt[i] = out.argmax(-1, keepdim=True)
        running = [i for i in caches if len(logits[i]) < NEW[i]]
        if running:
            with joined([caches[i] for i in running]) as batch:
                out = decode_step(model, torch.cat([nxt[i] for i in running]).view(-1, 1), batch)[0][:, -1]
            for row, i in enumerate(running):
                logits[i].append(out[row:row + 1])
                nxt[i] = out[row:row + 1].argmax(-1, keepdim=True)
        for i in [i for i in caches if len(logits[i]) == NEW[i]]:  # leaving: its cache goes at once
            del caches[i]
            logits[i] = torch.cat(logits[i])
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("kind,opts", KINDS)
def test_each_request_of_a_running_batch_gets_what_it_gets_alone(tiny_model, kind, opts):
    cls = CACHE_KINDS[kind]
    prompts = _prompts(cls.min_prompt(cls.parse_options(**opts)))
    got = serve(tiny_model, kind, opts, prompts)
    for i, p in enumerate(prompts):
        alone = greedy(tiny_model, p.view(1, -1), NEW[i], layout=kind, **opts)
        assert torch.equal(got[i].argmax(-1), alone.tokens[0]), f"request {i} ({len(p)} tokens) diverged"
        assert (got[i] - alone.logits[0]).abs().max().item() <= 1e-4


def test_paged_requests_on_one_pool_join_through_their_own_block_tables(tiny_model):
    prompts = _prompts()
    got = serve(tiny_model, "paged", {"block_size": 4}, prompts, shared_pool=True)
    for i, p in enumerate(prompts):
        alone = greedy(tiny_model, p.view(1, -1), NEW[i], layout="paged", block_size=4)
        assert torch.equal(got[i].argmax(-1), alone.tokens[0])
        assert (got[i] - alone.logits[0]).abs().max().item() <= 1e-4


def test_a_paged_step_takes_blocks_into_the_requests_tables_and_releases_none(tiny_model):
    a = new_cache(tiny_model, "paged", 64, 1, block_size=4, blocks=16)
    b = a.empty_like(1)
    prefill(tiny_model, torch.arange(4).view(1, -1), a)  # a fills its one block; b holds 3 of 4
    prefill(tiny_model, torch.arange(3).view(1, -1), b)
    assert (a.pool.used, len(a.tables[0]), len(b.tables[0])) == (2, 1, 1)
    with joined([a, b]) as step:
        decode_step(tiny_model, torch.tensor([[5], [6]]), step)
    assert (a.pos, b.pos) == (5, 4)
    assert (len(a.tables[0]), len(b.tables[0]), a.pool.used) == (2, 1, 3)  # a took a block, b filled its own
    del step
    assert a.pool.used == 3  # the step's tables were the requests': dropping it gives nothing back


def test_a_paged_step_with_too_few_blocks_writes_nothing(tiny_model):
    a = new_cache(tiny_model, "paged", 64, 1, block_size=2, blocks=2)
    b = a.empty_like(1)
    prefill(tiny_model, torch.arange(2).view(1, -1), a)
    prefill(tiny_model, torch.arange(2).view(1, -1), b)
    with pytest.raises(ValueError, match="out of blocks"):
        with joined([a, b]) as step:
            decode_step(tiny_model, torch.tensor([[5], [6]]), step)
    assert (a.pos, b.pos, a.pool.used, a.tables[0], b.tables[0]) == (2, 2, 2, [0], [1])


def test_only_one_sequence_caches_of_one_kind_join(tiny_model):
    one = new_cache(tiny_model, "prealloc", 16, 1)
    with pytest.raises(ValueError, match="one-sequence caches"):
        with joined([one, new_cache(tiny_model, "prealloc", 16, 2)]):
            pass
    with pytest.raises(ValueError, match="one kind and options"):
        with joined([one, new_cache(tiny_model, "concat", 16, 1)]):
            pass
    with pytest.raises(ValueError, match="at least one"):
        with joined([]):
            pass


def test_kinds_that_store_keys_before_the_rotation_cannot_join():
    window = CACHE_KINDS["window"]
    why = refuses_joining(window, window.parse_options(window=8, sinks=1, positions="cache"))
    assert why and "different lengths" in why
    assert refuses_joining(window, window.parse_options(window=8)) is None
    quant = CACHE_KINDS["quant"]
    assert refuses_joining(quant, quant.parse_options(k_pre_rope=True))
    model = Llama(LlamaConfig.preset("tiny-gqa")).eval()
    cache = new_cache(model, "window", 32, 1, window=8, sinks=1, positions="cache")
    with pytest.raises(ValueError, match="stores keys before the rotary rotation"):
        with joined([cache]):
            pass


@pytest.mark.slow
def test_grouped_query_attention_joins_too():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny-gqa")).eval()
    prompts = _prompts()
    for kind, opts in (("prealloc", {}), ("h2o", {"budget": 8})):
        got = serve(model, kind, opts, prompts)
        for i, p in enumerate(prompts):
            alone = greedy(model, p.view(1, -1), NEW[i], layout=kind, **opts)
            assert torch.equal(got[i].argmax(-1), alone.tokens[0]), f"{kind}: request {i} diverged"


def test_the_generic_step_pads_each_requests_keys_with_empty_slots(tiny_model):
    caches = [new_cache(tiny_model, "prealloc", 16, 1) for _ in range(2)]
    prefill(tiny_model, torch.arange(3).view(1, -1), caches[0])
    prefill(tiny_model, torch.arange(6).view(1, -1), caches[1])
    step = RaggedStep(caches)
    assert (step.pos, step.pad.tolist()) == (6, [3, 0])
    assert step.key_positions(1).tolist() == [[0, 1, 2, 3, -1, -1, -1], [0, 1, 2, 3, 4, 5, 6]]

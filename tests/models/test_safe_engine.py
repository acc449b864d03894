"""The engine's side of safe runs: byte accounting that no container can hide a buffer from, bad arguments refused in
one line (never a float ``pos``, a silently ignored option or a traceback from inside torch), tampered snapshots
refused before anything is restored, and a checkpoint's shapes checked against its safetensors header before the
model is built. ``CASES`` lists each case with what kvlab now does (docs/faults.md's fault table lists the same ids)."""

import collections
import functools
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from models.generate import decode_step, greedy, new_cache, prefill
from models.gpt2 import GPT2, CheckpointError, GPT2Config
from models.kv_cache import CACHE_KINDS, PreallocKVCache, kv_bytes
from models.kv_cache.base import held_buffers

CASES = [
    ("bytes-hidden-buffer", "a buffer a cache holds in a SimpleNamespace, deque, set, dict key, closure, partial, "
                            "bound method, __slots__, nested object or numpy array counts in cache.nbytes (each "
                            "storage once, cycles end, a closure's globals are not followed), so nbytes != formula "
                            "shows it"),
    ("bytes-kinds-after-prefill", "every registered kind's nbytes equals its byte formula after a prefill and decode "
                                  "steps through the model, with the walk that enters every container"),
    ("api-crop-float", "cache.crop(3.5) / crop(True) / crop(tensor) / crop('2') refused in one line: `crop takes an "
                       "integer number of tokens, got 3.5`; the cache is unchanged"),
    ("api-sinks-without-window", "model(idx, sinks=2) and greedy(..., sinks=2) without window= refused in one line: "
                                 "`sinks=2 needs a window: give window=W too`; sinks=0 alone still runs"),
    ("api-prompts-list-of-2d", "a list of 2-D tensors as prompts refused in one line naming the prompt and its shape "
                               "(give one (B, T) tensor)"),
    ("api-prompts-ragged-numpy", "a numpy object array (ragged rows) refused in one line; a list of 1-D numpy arrays "
                                 "of different lengths runs as ragged prompts, like a list of id lists"),
    ("api-prompts-string", "a string as prompt ids refused in one line: encode text first"),
    ("api-ragged-with-pad", "prompts of different lengths together with pad= refused in one line (either a list of "
                            "prompts or a padded batch with pad, not both)"),
    ("api-prefill-ids-out-of-range", "prefill of ids outside the vocabulary (given as lists or a CPU tensor) refused "
                                     "in one line instead of an IndexError from the embedding"),
    ("api-decode-list-ids", "decode_step takes the token as a list too ([[5]]): the same logits as a tensor"),
    ("api-restore-tampered-snapshot", "restore() of a snapshot whose tensors have the wrong shape, dtype or device, "
                                      "a missing key, pos beyond max_len or a paged table naming blocks it does not "
                                      "hold: refused in one line naming the key, the cache left as it was"),
    ("ckpt-shapes-vs-header", "from_pretrained checks every tensor shape config.json implies against the "
                              "safetensors header before the model is built: `config.json asks for 64 layers x 4096 "
                              "wide but model.safetensors holds 2 layers x 32 wide: tensor ... has shape ... in the "
                              "file, the config asks for ...`; nothing is allocated, no tensor is read"),
    ("ckpt-param-count", "GPT2Config.num_params() / param_nbytes(dtype) / param_shapes() give a model's size from "
                         "its config alone, exactly GPT2(cfg)'s"),
]


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text
    return text


# ---- bytes: no container hides a buffer -----------------------------------------------------------------------

GEOM = dict(n_layer=2, n_head=2, head_dim=8, max_len=16, batch=2)
_GLOBAL = torch.zeros(4096)  # what a function reads as a global is the module's, not the cache's


class Slotted:
    __slots__ = ("buf", "__private")

    def __init__(self, buf, private):
        self.buf = buf
        self.__private = private


class Holder:
    def __init__(self, buf):
        self.buf = buf

    def use(self):
        return self.buf


def reads_global():
    return _GLOBAL


def t(n: int) -> torch.Tensor:
    return torch.ones(n)  # float32: 4 n bytes


def capturing(n: int):
    buf = t(n)
    return lambda: buf.sum()  # the tensor lives only in the lambda's closure cell


def capturing_the_cache(cache, n: int):
    buf = t(n)
    return lambda: (cache, buf)  # a cycle: the closure holds the cache that holds the closure


# (name, make(cache) -> (what the cache also holds, the bytes that keeps alive beyond the formula))
HIDERS = [
    ("namespace", lambda c: (types.SimpleNamespace(buf=t(100)), 400)),
    ("deque", lambda c: (collections.deque([t(50), t(25)]), 300)),
    ("set", lambda c: ({t(10)}, 40)),
    ("frozenset", lambda c: (frozenset([t(11)]), 44)),
    ("dict-key", lambda c: ({t(12): "x"}, 48)),
    ("closure", lambda c: (capturing(21), 84)),
    ("default-arg", lambda c: ((lambda x=t(7): x), 28)),
    ("partial", lambda c: (functools.partial(torch.add, t(9)), 36)),
    ("bound-method", lambda c: (Holder(t(13)).use, 52)),
    ("slots", lambda c: (Slotted(t(14), t(15)), 116)),
    ("nested-object", lambda c: (Holder(Holder([{"deep": (Holder(t(16)),)}])), 64)),
    ("defaultdict-factory", lambda c: (collections.defaultdict(t(17).clone), 68)),
    ("numpy", lambda c: (np.ones(20, dtype=np.float64)[::2], 160)),  # a view: its owner's 20 x 8 bytes
    ("numpy-object", lambda c: (np.array([t(18), None], dtype=object), 72)),
    ("module", lambda c: (nn.Linear(4, 4), 4 * (16 + 4))),  # a module it holds: its parameters are held
    ("cycle", lambda c: (capturing_the_cache(c, 19), 76)),
    ("view-of-own-storage", lambda c: (types.SimpleNamespace(k=c.k[0, :, :, :3]), 0)),  # counted once already
    ("same-tensor-twice", lambda c: ([c.v, collections.deque([c.v])], 0)),
    ("global", lambda c: (reads_global, 0)),  # a function's globals are not the cache's
    ("class", lambda c: (type("WithTensor", (), {"buf": t(1000)}), 0)),  # a class is the program's
]


class Hoarder(PreallocKVCache):
    """A prealloc cache that also keeps something of its own (not registered: a test kind)."""

    def __init__(self, *args, hide=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.hidden, self.extra = hide(self)


@pytest.mark.parametrize("name,hide", HIDERS, ids=[h[0] for h in HIDERS])
def test_a_hidden_buffer_is_counted(name, hide):
    cache = Hoarder(GEOM["n_layer"], GEOM["n_head"], GEOM["head_dim"], GEOM["max_len"], GEOM["batch"], hide=hide)
    formula = cache.formula_nbytes()
    assert formula == kv_bytes(2, 2, 8, 16, batch=2)
    assert cache.nbytes == formula + cache.extra
    if cache.extra:
        assert cache.nbytes != formula


def test_a_hidden_buffer_is_counted_through_a_whole_generation(tiny_model):
    """The issue's case: a kind that keeps half as much again in a SimpleNamespace, a deque and a closure."""
    class Greedy(PreallocKVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            spare = torch.zeros_like(self.k[:, :, :, : self.max_len // 2])  # (L, B, nh, max_len / 2, hs)
            self.ns = types.SimpleNamespace(spare=spare.clone())
            self.q = collections.deque([spare.clone()])
            self.later = (lambda s=spare.clone(): s)
            self.extra = 3 * spare.numel() * spare.element_size()

    c = tiny_model.config
    cache = Greedy(c.n_layer, c.n_head, c.head_dim, 16, 1)
    prefill(tiny_model, torch.tensor([[1, 2, 3, 4]]), cache)
    decode_step(tiny_model, torch.tensor([[5]]), cache)
    assert cache.extra == 3 * kv_bytes(c.n_layer, c.n_head, c.head_dim, 8) // 2
    assert cache.nbytes == cache.formula_nbytes() + cache.extra > cache.formula_nbytes()


def test_the_walk_stops_at_tensors_and_ends_on_cycles():
    a = types.SimpleNamespace()
    a.me, a.buf = a, torch.ones(3)
    b = [a]
    b.append(b)
    tensors, arrays = held_buffers(types.SimpleNamespace(x=b, y=lambda: (a, b)))
    assert len(tensors) == 1 and tensors[0] is a.buf and arrays == []


KIND_CASES = [pytest.param(kind, opts, id=f"{kind}-{'-'.join(f'{k}{v}' for k, v in opts.items()) or 'default'}")
              for kind, cls in CACHE_KINDS.items() for opts in cls.examples]


@pytest.mark.parametrize("kind,opts", KIND_CASES)
def test_every_kind_holds_its_formula_after_a_prefill(tiny_model, kind, opts):
    cache = new_cache(tiny_model, kind, max_len=24, batch=2, **opts)
    g = torch.Generator().manual_seed(0)
    prefill(tiny_model, torch.randint(0, 50257, (2, 10), generator=g), cache)
    assert cache.nbytes == cache.formula_nbytes()
    for t in (11, 12):
        decode_step(tiny_model, torch.tensor([[t], [t + 1]]), cache)
    assert cache.pos == 12 and cache.nbytes == cache.formula_nbytes() > 0


# ---- crop ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["concat", "prealloc", "window", "paged"])
@pytest.mark.parametrize("n", [3.5, True, torch.tensor(2), "2", None], ids=["float", "bool", "tensor", "str", "none"])
def test_crop_takes_an_integer(tiny_model, kind, n):
    cache = new_cache(tiny_model, kind, max_len=12)
    prefill(tiny_model, torch.tensor([[1, 2, 3, 4]]), cache)
    with pytest.raises(ValueError) as e:
        cache.crop(n)
    assert one_line(e) == f"crop takes an integer number of tokens, got {n!r}"
    assert cache.pos == 4 and type(cache.pos) is int
    cache.crop(2)  # an integer still crops
    assert cache.pos == 2


# ---- sinks without a window ------------------------------------------------------------------------------------

def test_sinks_without_a_window_is_refused(tiny_model):
    idx = torch.tensor([[1, 2, 3, 4, 5]])
    for call in (lambda: tiny_model(idx, sinks=2), lambda: greedy(tiny_model, idx, 2, sinks=2)):
        with pytest.raises(ValueError) as e:
            call()
        assert one_line(e) == ("sinks=2 needs a window: give window=W too (sinks are kept beside the last W "
                               "tokens)")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="sinks must be an integer >= 0"):
            tiny_model(idx, window=2, sinks=bad)
    with torch.no_grad():  # sinks=0 alone is plain causal attention; with a window, sinks change the result
        assert torch.equal(tiny_model(idx, sinks=0), tiny_model(idx))
        assert not torch.equal(tiny_model(idx, window=2, sinks=2), tiny_model(idx, window=2))


# ---- prompts ---------------------------------------------------------------------------------------------------

def test_a_list_of_2d_tensors_is_refused(tiny_model):
    rows = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]])]
    for call in (lambda: greedy(tiny_model, rows, 2), lambda: greedy(tiny_model, rows, 2, "prealloc"),
                 lambda: prefill(tiny_model, rows, new_cache(tiny_model, "prealloc", 8, batch=2))):
        with pytest.raises(ValueError) as e:
            call()
        assert one_line(e).startswith("prompt 0 is a 2-D Tensor of shape (1, 3): a list of prompts takes 1-D")


def test_ragged_numpy_prompts(tiny_model):
    ragged = np.array([[1, 2, 3], [4]], dtype=object)
    for call in (lambda: greedy(tiny_model, ragged, 2),
                 lambda: prefill(tiny_model, ragged, new_cache(tiny_model, "concat", 8, batch=2))):
        with pytest.raises(ValueError) as e:
            call()
        assert "numpy object array of shape (2,)" in one_line(e)
    # a list of 1-D arrays of different lengths is a list of prompts, as a list of id lists is
    arrays = greedy(tiny_model, [np.array([1, 2, 3]), np.array([4])], 3, "prealloc")
    lists = greedy(tiny_model, [[1, 2, 3], [4]], 3, "prealloc")
    assert torch.equal(arrays.tokens, lists.tokens) and torch.equal(arrays.logits, lists.logits)


def test_what_torch_cannot_read_as_ids_is_one_line(tiny_model):
    with pytest.raises(ValueError) as e:
        greedy(tiny_model, "Hello world", 2)
    assert "got a string: encode text first" in one_line(e)
    with pytest.raises(ValueError) as e:
        greedy(tiny_model, [[1, [2]], [3]], 2)
    assert one_line(e).startswith("prompt ids must be a (B, T) batch of integer token ids")


def test_ragged_prompts_with_pad_are_refused(tiny_model):
    with pytest.raises(ValueError) as e:
        greedy(tiny_model, [[1, 2, 3], [4]], 2, "prealloc", pad=[0, 2])
    assert "give either a list of prompts or a padded (B, T) batch with pad, not both" in one_line(e)
    assert "(3, 1 tokens)" in str(e.value)
    with pytest.raises(ValueError) as e:
        prefill(tiny_model, [[1, 2, 3], [4]], new_cache(tiny_model, "prealloc", 8, batch=2), pad=[0, 2])
    assert "not both" in one_line(e)
    # an already padded batch with its pad still runs, and equals the list of prompts it pads
    padded = greedy(tiny_model, [[0, 0, 4], [1, 2, 3]], 2, "prealloc", pad=[2, 0])
    assert torch.equal(padded.tokens, greedy(tiny_model, [[4], [1, 2, 3]], 2, "prealloc").tokens)


def test_prefill_refuses_ids_outside_the_vocabulary(tiny_model):
    for ids in ([[1, 50257]], torch.tensor([[1, -3]])):
        cache = new_cache(tiny_model, "prealloc", 8)
        with pytest.raises(ValueError) as e:
            prefill(tiny_model, ids, cache)
        assert one_line(e).startswith("token ids must lie in [0, 50257)") and cache.pos == 0


def test_decode_step_takes_a_list(tiny_model):
    a, b = new_cache(tiny_model, "prealloc", 8), new_cache(tiny_model, "prealloc", 8)
    prefill(tiny_model, [[1, 2, 3]], a)
    prefill(tiny_model, [[1, 2, 3]], b)
    assert torch.equal(decode_step(tiny_model, [[5]], a)[0], decode_step(tiny_model, torch.tensor([[5]]), b)[0])
    with pytest.raises(ValueError, match="exactly one token per sequence"):
        decode_step(tiny_model, [5, 6], a)


# ---- tampered snapshots ----------------------------------------------------------------------------------------

HEADER = ("kind", "geometry", "pos", "pad")


def _first_tensor_key(snap):
    for key, value in snap.items():
        if key in HEADER:
            continue
        t = value[0] if isinstance(value, list) else value
        if isinstance(t, torch.Tensor) and t.shape[-2] > 0:  # one that holds slots (a longer one is then wrong)
            return key
    raise AssertionError("snapshot holds no tensor")


def _tamper(snap, key, change):
    out = type(snap)(snap)  # a paged snapshot stays one (its blocks are held by the original, still alive)
    if isinstance(out[key], list):
        out[key] = [change(out[key][0])] + out[key][1:]
    else:
        out[key] = change(out[key])
    return out


def _tampered(snap, max_len):
    key = "tables" if "tables" in snap else _first_tensor_key(snap)
    t = snap[key][0] if isinstance(snap[key], list) else snap[key]
    wrong_dtype = torch.int32 if not t.is_floating_point() else (
        torch.float16 if t.dtype != torch.float16 else torch.float32)
    wrong_shape = (lambda x: x[:1]) if key == "tables" else (lambda x: torch.cat([x, x[..., :1, :]], dim=-2))
    cases = [
        ("shape", _tamper(snap, key, wrong_shape), "has shape"),
        ("dtype", _tamper(snap, key, lambda x: x.to(wrong_dtype)), f"is {wrong_dtype} but this cache keeps it as"),
        ("device", _tamper(snap, key, lambda x: x.to("meta")), "is on meta but this cache keeps it on"),
        ("missing", {k: v for k, v in snap.items() if k != key}, f"snapshot has no {key!r}"),
        ("pos-beyond", {**snap, "pos": max_len + 5}, f"is not a number of tokens in [0, max_len {max_len}]"),
        ("pos-float", {**snap, "pos": 3.5}, "snapshot's pos 3.5 is not a number of tokens"),
        ("pad", {**snap, "pad": torch.tensor([1, 2, 3])}, "snapshot's 'pad' has shape (3,)"),
    ]
    if key == "tables":
        cases.append(("blocks", _tamper(snap, key, lambda x: x + 1000), "name blocks it does not hold"))
    for name, bad, message in cases:
        if name in ("missing", "pos-beyond", "pos-float", "pad") and "tables" in snap:
            bad = type(snap)(bad)
        yield name, bad, message


@pytest.mark.parametrize("kind,opts", KIND_CASES)
def test_a_tampered_snapshot_is_refused_and_changes_nothing(tiny_model, kind, opts):
    cache = new_cache(tiny_model, kind, max_len=16, batch=2, **opts)
    prefill(tiny_model, torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]), cache)
    snap = cache.snapshot()
    decode_step(tiny_model, torch.tensor([[13], [14]]), cache)
    seen = set()
    for name, bad, message in _tampered(snap, 16):
        with pytest.raises(ValueError) as e:
            cache.restore(bad)
        assert message in one_line(e), (name, str(e.value))
        assert cache.pos == 7 and cache.pad is None, name  # nothing was restored
        seen.add(name)
    assert {"shape", "dtype", "device", "missing", "pos-beyond"} <= seen
    cache.restore(snap)  # the snapshot itself still restores exactly
    assert cache.pos == 6
    twin = new_cache(tiny_model, kind, max_len=16, batch=2, **opts)
    prefill(tiny_model, torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]), twin)
    step = torch.tensor([[15], [16]])
    assert torch.equal(decode_step(tiny_model, step, cache)[0], decode_step(tiny_model, step, twin)[0])


# ---- checkpoints: shapes against the header, before anything is built ------------------------------------------

def hf_checkpoint(folder: Path, **config) -> Path:
    """A tiny HF GPT-2 checkpoint with random weights (the pattern of tests/helpers/checkpoints.py)."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    settings = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=300, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(HFConfig(**{**settings, **config})).save_pretrained(folder)
    return folder


def edit_config(folder: Path, **change) -> None:
    f = folder / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **change}))


@pytest.fixture
def built(monkeypatch):
    """Every GPT2 built (its config), and every safetensors file read whole, while the test runs."""
    calls = {"built": [], "read": []}
    real_init = GPT2.__init__

    def init(self, cfg):
        calls["built"].append(cfg)
        real_init(self, cfg)

    import safetensors.torch
    real_load = safetensors.torch.load_file

    def load_file(path, *args, **kwargs):
        calls["read"].append(path)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(GPT2, "__init__", init)
    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    return calls


def test_a_config_bigger_than_its_weights_is_refused_before_the_model_is_built(tmp_path, built):
    folder = hf_checkpoint(tmp_path / "ckpt")
    GPT2.from_pretrained(folder)  # the checkpoint as written loads: the spies see it built and read
    assert len(built["built"]) == 1 and len(built["read"]) == 1
    edit_config(folder, n_layer=64, n_embd=4096)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    msg = one_line(e)
    assert msg.startswith(f"{folder / 'model.safetensors'}: config.json asks for 64 layers x 4096 wide but "
                          "model.safetensors holds 2 layers x 32 wide: tensor 'transformer.wte.weight' has shape "
                          "(300, 32) in the file, the config asks for (300, 4096)")
    assert len(built["built"]) == 1 and len(built["read"]) == 1  # never built, no tensor read


@pytest.mark.parametrize("change,message", [
    (dict(n_layer=5), "asks for 5 layers x 32 wide but model.safetensors holds 2 layers x 32 wide: tensor "
                      "'transformer.h.2.ln_1.weight' is missing, the config asks for (32,)"),
    (dict(n_positions=128), "asks for 128 positions but model.safetensors holds 64 positions: tensor "
                            "'transformer.wpe.weight' has shape (64, 32) in the file, the config asks for (128, 32)"),
    (dict(vocab_size=50257), "asks for 50257 tokens but model.safetensors holds 300 tokens"),
], ids=["more-layers", "more-positions", "more-tokens"])
def test_each_shape_mismatch_names_the_tensor(tmp_path, built, change, message):
    folder = hf_checkpoint(tmp_path / "ckpt")
    edit_config(folder, **change)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert message in one_line(e)
    assert built["built"] == [] and built["read"] == []


def test_a_pytorch_bin_is_checked_before_the_model_is_built(tmp_path, built):
    from safetensors.torch import load_file

    folder = hf_checkpoint(tmp_path / "ckpt")
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    edit_config(folder, n_layer=64, n_embd=4096)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert "pytorch_model.bin: config.json asks for 64 layers x 4096 wide" in one_line(e)
    assert built["built"] == []


@pytest.mark.parametrize("preset", ["tiny", "mini", "gpt2", "gpt2-medium"])
def test_param_count_from_the_config_alone(preset):
    cfg = GPT2Config.preset(preset)
    if preset == "tiny":
        torch.manual_seed(0)
        model = GPT2(cfg)
    else:  # the same module on the meta device: shapes without memory
        with torch.device("meta"):
            model = GPT2(cfg)
    assert cfg.num_params() == model.num_params()
    assert dict(cfg.param_shapes()) == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert 2 * cfg.param_nbytes(torch.float16) == cfg.param_nbytes(torch.float32) == 4 * cfg.num_params()


def test_param_count_of_the_big_presets_without_building_them():
    assert GPT2Config.preset("gpt2").num_params() == 124_439_808  # GPT-2 small, tied lm_head once
    assert GPT2Config.preset("gpt2-xl").num_params() == 1_557_611_200
    huge = GPT2Config(n_layer=10 ** 6, n_head=2, n_embd=64)
    assert huge.num_params() > 10 ** 10  # closed form: nothing is spelled out per layer
    assert sum(1 for _ in zip(range(5), huge.param_shapes())) == 5  # a generator: stops where its caller stops

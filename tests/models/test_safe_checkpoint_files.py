"""Every file of a checkpoint folder is bounded before it is read: config.json, the shard index and tokenizer.json by a
cap each (their size checked before they are opened, never more than the cap read), a safetensors header by its
declared length and then tensor by tensor against config.json before any tensor is read, a pytorch_model.bin by its
size and its zip members' declared sizes before torch.load; a folder, FIFO, device or dangling link at a name kvlab
reads is one line, never opened, and never replaced by a fallback (GPT-2's tokenizer). Big files are sparse: nothing
here writes more than a few MB. ``CASES`` lists each case with what kvlab now does (docs/faults.md's fault table lists
the same ids)."""

import json
import os
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import hf_checkpoint as hf
from models import load_model
from models.gpt2 import GPT2, CheckpointError, GPT2Config
from models.llama import Llama, LlamaConfig
from models.tokenizer import FileTokenizer, for_checkpoint
from tests.helpers import TINY, run_py, untested_cases

CASES = [
    ("ckpt-config-too-big", "a 400 MB config.json (sparse): `DIR/config.json: 400,000,000 bytes, more than the "
                            "16,777,216 (16 MiB) kvlab reads for a config.json; an HF config.json is a few kB`, its "
                            "size checked before it is opened (was read whole: 1.2 GB of memory in run.py); run.py: a "
                            "failed run with that line, exit 1"),
    ("ckpt-index-too-big", "a 300 MB model.safetensors.index.json: `...index.json: 300,000,000 bytes, more than the "
                           "67,108,864 (64 MiB) kvlab reads for a model.safetensors.index.json; an index is ~100 bytes "
                           "a tensor`, no shard opened"),
    ("ckpt-tokenizer-too-big", "a 300 MB tokenizer.json: `...tokenizer.json: 300,000,000 bytes, more than the "
                               "67,108,864 (64 MiB) kvlab reads for a tokenizer.json; a tokenizer.json is a few MB: "
                               "the checkpoint has a tokenizer.json kvlab cannot read, ...`"),
    ("ckpt-bin-huge-member", "a pytorch_model.bin of 600 MB, or a small one whose zip directory declares a 600 MB "
                             "member: `...pytorch_model.bin: its 35 archive members declare 600,151,082 bytes (the "
                             "largest, 'archive/data/99', 600,000,000), more than the 1,399,304 bytes config.json "
                             "implies ...`, before torch.load (was read whole, then refused)"),
    ("ckpt-tokenizer-not-a-file", "tokenizer.json a folder, a link to /dev/zero, a dangling link or a FIFO: `...: is "
                                  "a folder, not a regular file (kvlab reads tokenizer.json only from one, and never "
                                  "opens anything else): the checkpoint has a tokenizer.json kvlab cannot read, and "
                                  "GPT-2's tokenizer is no stand-in for it` (was a silent fall back to GPT-2's)"),
    ("ckpt-window-negative", "a Mistral config.json with sliding_window -5: `DIR/config.json: sliding_window must be a "
                             "positive integer (the attention window, in tokens) or null (none), got -5` (was blamed "
                             "on n_positions)"),
    ("ckpt-json-true", "config.json holding `true` (or null, a string, a number): `DIR/config.json: holds the JSON "
                       "value true, not an object of model settings (a config.json is a JSON object: model_type and "
                       "the model's sizes)` (was `model_type None`)"),
    ("ckpt-float64", "float64 weights are refused, as the message always said: from the safetensors header before "
                     "any tensor is read (`tensor '...' is float64: kvlab loads float32, float16 or bfloat16 weights "
                     "(each exact in its fp32 model); convert the checkpoint to one of them`), in a pytorch_model.bin "
                     "and in load_hf_state_dict alike (was loaded, rounded to fp32)"),
    ("ckpt-not-regular-files", "config.json a FIFO, model.safetensors a folder or a link to /dev/zero, config.json a "
                               "dangling link: one line naming the file and what it is, never opened (a FIFO config "
                               "was `not found`)"),
    ("ckpt-header-extra-tensors", "a model.safetensors or a shard holding a tensor config.json does not account for "
                                  "(a 1,000,000-element 'junk'), or a mask buffer bigger than n_positions implies: "
                                  "refused from the header, no tensor read (`1 tensor(s) the config does not account "
                                  "for (4,000,000 bytes), e.g. 'junk' (1000000,)`)"),
    ("ckpt-header-too-big", "a safetensors file (40 MB, sparse) whose header declares 32 MiB: `its header declares "
                            "33,554,432 bytes, more than the 16,777,216 (16 MiB) kvlab reads for a safetensors header "
                            "(~150 bytes a tensor)`; one declaring more than the file holds (any file that is not "
                            "safetensors): `not a readable safetensors file (its first 8 bytes declare a header of N "
                            "bytes, and the file has M)`"),
    ("ckpt-index-hostile", "an index naming 100,000 shards of tensors config.json does not account for: refused from "
                           "the index, no shard opened; a shard named '../x', a missing shard, a shard linked to "
                           "/dev/zero: one line each; a shard linked to a regular file outside the folder (the HF "
                           "cache's layout) loads"),
    ("ckpt-json-deep", "config.json nested 100,000 deep, or an integer of 5,000 digits: `not valid JSON (...)`, one "
                       "line"),
]


def test_every_case_has_a_test():
    assert not untested_cases(__file__, CASES)


def msg(e) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def gpt2_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    m = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=300))
    return hf.write_folder(folder, m.state_dict(), m.hf_config_dict())


def sparse(path: Path, size: int) -> None:
    """``path`` as a file of ``size`` bytes that takes no disk (its old bytes kept, zeros after)."""
    with open(path, "ab") as f:
        f.truncate(size)


@pytest.fixture
def spies(monkeypatch):
    """Every safetensors file read whole, every torch.load, every tensor read from a shard and every model built."""
    import safetensors
    import safetensors.torch

    seen = {"read": [], "torch_load": [], "get_tensor": [], "built": []}
    real_load, real_torch_load, real_open = safetensors.torch.load_file, torch.load, safetensors.safe_open
    real_gpt2, real_llama = GPT2.__init__, Llama.__init__

    class Opened:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def get_tensor(self, name):
            seen["get_tensor"].append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors.torch, "load_file", lambda p, *a, **k: seen["read"].append(p) or real_load(p))
    monkeypatch.setattr(safetensors, "safe_open", Opened)
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen["torch_load"].append(a[0]) or real_torch_load(*a, **k))
    monkeypatch.setattr(GPT2, "__init__", lambda self, cfg: seen["built"].append(cfg) or real_gpt2(self, cfg))
    monkeypatch.setattr(Llama, "__init__", lambda self, cfg: seen["built"].append(cfg) or real_llama(self, cfg))
    return seen


def clear(spies) -> None:
    for seen in spies.values():
        seen.clear()


# ---- the small files: config.json, the shard index, tokenizer.json ----------------------------------------------

def test_a_huge_config_json_is_refused_from_its_size(tmp_path):  # ckpt-config-too-big
    folder = gpt2_folder(tmp_path / "ckpt")
    GPT2.from_pretrained(folder)  # as written, it loads
    sparse(folder / "config.json", 400_000_000)
    tracemalloc.start()
    try:
        for load in (GPT2.from_pretrained, load_model, hf.first_token):
            with pytest.raises(CheckpointError) as e:
                load(folder)
            assert msg(e) == (f"{folder / 'config.json'}: 400,000,000 bytes, more than the 16,777,216 (16 MiB) kvlab "
                              "reads for a config.json; an HF config.json is a few kB")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2 ** 20  # nothing near the file's size was read


def test_a_config_json_that_grows_past_the_cap_is_never_read_past_it(tmp_path, monkeypatch):  # ckpt-config-too-big
    folder = gpt2_folder(tmp_path / "ckpt")
    monkeypatch.setattr(hf, "CONFIG_MAX", 100)  # the file (a few hundred bytes) is over it
    with pytest.raises(CheckpointError, match=r"config.json: [\d,]+ bytes, more than the 100 \("):
        hf.read_config(folder)
    data = (folder / "config.json").read_bytes()
    assert hf.read_small(folder / "config.json", len(data)) == data  # at the cap exactly: read
    with pytest.raises(CheckpointError, match="more than the"):
        hf.read_small(folder / "config.json", len(data) - 1)


@pytest.mark.slow  # a subprocess: seconds
def test_run_py_refuses_a_huge_config_json_in_one_line(tmp_path):  # ckpt-config-too-big
    folder = gpt2_folder(tmp_path / "ckpt")
    sparse(folder / "config.json", 400_000_000)
    out = tmp_path / "run"
    proc = run_py([*TINY, f"model.weights={folder}", "prompts=random", "tracking=disabled", f"hydra.run.dir={out}"],
                  tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    line = (f"{folder / 'config.json'}: 400,000,000 bytes, more than the 16,777,216 (16 MiB) kvlab reads for a "
            "config.json")
    assert line in proc.stderr
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "failed" and line in record["error"]


def test_a_huge_shard_index_is_refused_before_any_shard_is_opened(tmp_path, spies):  # ckpt-index-too-big
    folder = gpt2_folder(tmp_path / "ckpt")
    state = load_file(str(folder / hf.SAFETENSORS))
    (folder / hf.SAFETENSORS).unlink()
    save_file(state, str(folder / "model-00001-of-00001.safetensors"))
    index = folder / hf.SHARD_INDEX
    index.write_text(json.dumps({"weight_map": {k: "model-00001-of-00001.safetensors" for k in state}}))
    assert isinstance(GPT2.from_pretrained(folder), GPT2)  # the sharded folder loads
    clear(spies)
    sparse(index, 300_000_000)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == (f"{index}: 300,000,000 bytes, more than the 67,108,864 (64 MiB) kvlab reads for a "
                      "model.safetensors.index.json; an index is ~100 bytes a tensor")
    assert spies["get_tensor"] == [] and spies["built"] == []


def tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_a_huge_tokenizer_json_is_refused_from_its_size(tmp_path):  # ckpt-tokenizer-too-big
    folder = gpt2_folder(tmp_path / "ckpt")
    tokenizer_json(folder / "tokenizer.json")
    tok = for_checkpoint(folder)
    assert isinstance(tok, FileTokenizer) and tok.encode("hello world") == [1, 2]  # read as it was written
    sparse(folder / "tokenizer.json", 300_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as e:
            for_checkpoint(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert msg(e).startswith(f"{folder / 'tokenizer.json'}: 300,000,000 bytes, more than the 67,108,864 (64 MiB) "
                             "kvlab reads for a tokenizer.json; a tokenizer.json is a few MB: the checkpoint has a "
                             "tokenizer.json kvlab cannot read")
    assert peak < 4 * 2 ** 20


@pytest.mark.parametrize("make,what", [
    (lambda p: p.mkdir(), "is a folder, not a regular file"),
    (lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
    (lambda p: p.symlink_to(p.parent / "gone.json"), "is a link to"),
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
], ids=["folder", "dev-zero", "dangling-link", "fifo"])
def test_a_tokenizer_json_that_is_not_a_file_is_refused_never_replaced(tmp_path, make, what):
    # ckpt-tokenizer-not-a-file
    folder = gpt2_folder(tmp_path / "ckpt")
    make(folder / "tokenizer.json")
    with pytest.raises(ValueError) as e:
        for_checkpoint(folder)
    text = msg(e)
    assert text.startswith(f"{folder / 'tokenizer.json'}: {what}") and text.endswith(
        "the checkpoint has a tokenizer.json kvlab cannot read, and GPT-2's tokenizer is no stand-in for it; put the "
        "model's own tokenizer.json there, or use prompts=random")
    assert type(for_checkpoint(None)).__name__ == "Tokenizer"  # no folder: GPT-2's


def test_the_run_refuses_a_tokenizer_json_that_is_a_folder(tmp_path):  # ckpt-tokenizer-not-a-file
    from harness.common.errors import ConfigError
    from harness.experiment.prepare import prompt_tokenizer
    from harness.experiment.weights import Weights

    folder = gpt2_folder(tmp_path / "ckpt")
    w = Weights("pretrained", str(folder), str(folder), "checkpoint")
    assert type(prompt_tokenizer(w, None, "tiny")).__name__ == "Tokenizer"  # no tokenizer.json: GPT-2's
    (folder / "tokenizer.json").mkdir()
    with pytest.raises(ConfigError, match="is a folder, not a regular file .* the checkpoint has a tokenizer.json "
                                          "kvlab cannot read"):
        prompt_tokenizer(w, None, "tiny")


# ---- config.json's messages --------------------------------------------------------------------------------------

def llama_folder(folder: Path, model_type: str = "mistral", **change) -> Path:
    torch.manual_seed(0)
    m = Llama(LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64, vocab_size=300,
                          model_type=model_type, qkv_bias=model_type == "qwen2"))
    return hf.write_folder(folder, m.state_dict(), {**m.hf_config_dict(), **change}, fmt=m.hf_format)


@pytest.mark.parametrize("window", [-5, 0, 2.5, "16", True])
def test_a_sliding_window_that_is_not_a_window_is_named(tmp_path, window):  # ckpt-window-negative
    folder = llama_folder(tmp_path / "ckpt", sliding_window=window)
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert msg(e) == (f"{folder / 'config.json'}: sliding_window must be a positive integer (the attention window, "
                      f"in tokens) or null (none), got {window!r}")
    assert load_model(llama_folder(tmp_path / "ok", sliding_window=16)).config.n_positions == 16
    qwen = llama_folder(tmp_path / "qwen", "qwen2", sliding_window=-5, use_sliding_window=False)  # unused: unread
    assert load_model(qwen).config.sliding_window is None


@pytest.mark.parametrize("text,shown", [("true", "the JSON value true"), ("null", "the JSON value null"),
                                        ('"gpt2"', "a JSON string"), ("3", "a JSON number"),
                                        ("[1, 2]", "a JSON list")])
def test_a_config_json_that_is_not_an_object_says_what_it_holds(tmp_path, text, shown):  # ckpt-json-true
    folder = gpt2_folder(tmp_path / "ckpt")
    (folder / "config.json").write_text(text)
    for load in (load_model, GPT2.from_pretrained, Llama.from_pretrained, hf.first_token):
        with pytest.raises(CheckpointError) as e:
            load(folder)
        assert msg(e) == (f"{folder / 'config.json'}: holds {shown}, not an object of model settings (a config.json "
                          "is a JSON object: model_type and the model's sizes)")


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"n_layer": ' + "9" * 5000 + "}"],
                         ids=["deep", "long-int"])
def test_json_that_python_cannot_parse_is_one_line(tmp_path, text):  # ckpt-json-deep
    folder = gpt2_folder(tmp_path / "ckpt")
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert msg(e).startswith(f"{folder / 'config.json'}: not valid JSON (")


# ---- the weights: float64, the header, pytorch_model.bin ---------------------------------------------------------

def test_float64_weights_are_refused_before_any_tensor_is_read(tmp_path, spies):  # ckpt-float64
    folder = gpt2_folder(tmp_path / "ckpt")
    state = load_file(str(folder / hf.SAFETENSORS))
    save_file({k: v.double() if k == "transformer.wpe.weight" else v for k, v in state.items()},
              str(folder / hf.SAFETENSORS))
    said = ("tensor 'transformer.wpe.weight' is float64: kvlab loads float32, float16 or bfloat16 weights (each exact "
            "in its fp32 model); convert the checkpoint to one of them")
    clear(spies)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == f"{folder / hf.SAFETENSORS}: {said}"
    assert spies["read"] == [] and spies["built"] == []
    (folder / hf.SAFETENSORS).unlink()
    torch.save({k: v.double() if k == "transformer.wpe.weight" else v for k, v in state.items()},
               folder / hf.PYTORCH_BIN)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == f"{folder / hf.PYTORCH_BIN}: {said}" and spies["built"] == []
    model = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=300))
    with pytest.raises(CheckpointError) as e:
        model.load_hf_state_dict({k: v.double() if k == "transformer.wpe.weight" else v for k, v in state.items()},
                                 source="x")
    assert msg(e) == f"x: {said}"
    for dtype in (torch.float16, torch.bfloat16):  # what the message names loads
        model.load_hf_state_dict({k: v.to(dtype) for k, v in state.items()}, source="x")


def test_a_tensor_the_config_does_not_account_for_is_refused_from_the_header(tmp_path, spies):
    # ckpt-header-extra-tensors
    folder = gpt2_folder(tmp_path / "ckpt")
    state = load_file(str(folder / hf.SAFETENSORS))
    save_file({**state, "junk": torch.zeros(1_000_000)}, str(folder / hf.SAFETENSORS))
    clear(spies)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == (f"{folder / hf.SAFETENSORS}: 1 tensor(s) the config does not account for (4,000,000 bytes), "
                      "e.g. 'junk' (1000000,): does config.json describe these weights?")
    assert spies["read"] == [] and spies["built"] == []
    # GPT-2's mask buffers are allowed up to (1, 1, n_positions, n_positions) at 4 bytes an element
    masks = {"transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64, dtype=torch.bool).tril(),
             "transformer.h.0.attn.masked_bias": torch.tensor(-1e4)}
    save_file({**state, **masks}, str(folder / hf.SAFETENSORS))
    assert isinstance(GPT2.from_pretrained(folder), GPT2)
    save_file({**state, "transformer.h.0.attn.bias": torch.ones(1, 1, 640, 640)}, str(folder / hf.SAFETENSORS))
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == (f"{folder / hf.SAFETENSORS}: buffer 'transformer.h.0.attn.bias' ((1, 1, 640, 640), float32) "
                      "holds 1,638,400 bytes, more than the 16,384 the config implies ((1, 1, 64, 64) at 4 bytes); "
                      "does config.json describe these weights?")


def test_a_shard_with_an_extra_tensor_is_refused_before_any_tensor_is_read(tmp_path, spies):
    # ckpt-header-extra-tensors
    folder = gpt2_folder(tmp_path / "ckpt")
    state = load_file(str(folder / hf.SAFETENSORS))
    (folder / hf.SAFETENSORS).unlink()
    names = sorted(state)
    for i in (0, 1):
        save_file({n: state[n] for n in names[i::2]}, str(folder / f"s{i}.safetensors"))
    (folder / hf.SHARD_INDEX).write_text(json.dumps({"weight_map": {n: f"s{names.index(n) % 2}.safetensors"
                                                                    for n in names}}))
    assert isinstance(GPT2.from_pretrained(folder), GPT2)
    clear(spies)
    save_file({**{n: state[n] for n in names[1::2]}, "junk": torch.zeros(1_000_000)}, str(folder / "s1.safetensors"))
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == (f"{folder / 's1.safetensors'}: 1 tensor(s) the config does not account for (4,000,000 bytes), "
                      "e.g. 'junk' (1000000,): does config.json describe these weights?")
    assert spies["get_tensor"] == []


def test_a_header_longer_than_the_cap_is_refused_before_it_is_parsed(tmp_path):  # ckpt-header-too-big
    folder = gpt2_folder(tmp_path / "ckpt")
    st = folder / hf.SAFETENSORS
    st.write_bytes((32 * 2 ** 20).to_bytes(8, "little") + b"{")
    sparse(st, 40 * 2 ** 20)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == (f"{st}: its header declares 33,554,432 bytes, more than the 16,777,216 (16 MiB) kvlab reads for "
                      "a safetensors header (~150 bytes a tensor)")
    st.write_bytes((2 ** 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == (f"{st}: not a readable safetensors file (its first 8 bytes declare a header of "
                      "1,099,511,627,776 bytes, and the file has 10)")


def bin_folder(tmp_path: Path) -> tuple[Path, dict]:
    folder = gpt2_folder(tmp_path / "ckpt")
    state = load_file(str(folder / hf.SAFETENSORS))
    (folder / hf.SAFETENSORS).unlink()
    torch.save(state, folder / hf.PYTORCH_BIN)
    return folder, state


def test_a_pytorch_bin_bigger_than_its_config_implies_is_never_loaded(tmp_path, spies):  # ckpt-bin-huge-member
    folder, _ = bin_folder(tmp_path)
    assert isinstance(GPT2.from_pretrained(folder), GPT2) and len(spies["torch_load"]) == 1  # as written: loads
    binf = folder / hf.PYTORCH_BIN
    sparse(binf, 600_000_000)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    text = msg(e)
    assert text.startswith(f"{binf}: 600,000,000 bytes, more than the ") and text.endswith(
        " bytes config.json implies (its tensors at 4 bytes an element and the archive's records); does config.json "
        "describe these weights?")
    assert len(spies["torch_load"]) == 1  # never loaded


@pytest.mark.slow  # seconds: not in make test-fast
def test_a_pytorch_bin_whose_directory_declares_a_huge_member_is_never_loaded(tmp_path, spies):
    # ckpt-bin-huge-member
    folder, _ = bin_folder(tmp_path)
    binf = folder / hf.PYTORCH_BIN
    with zipfile.ZipFile(binf, "a") as z:  # 600 MB of zeros, deflated: a small file that declares them
        info = zipfile.ZipInfo("archive/data/99")
        info.compress_type = zipfile.ZIP_DEFLATED
        chunk = bytes(2 ** 22)
        with z.open(info, "w", force_zip64=True) as f:
            left = 600_000_000
            while left:
                left -= f.write(chunk[:min(left, len(chunk))])
    assert binf.stat().st_size < 2 * 2 ** 20
    clear(spies)
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    text = msg(e)
    assert text.startswith(f"{binf}: its ") and "(the largest, 'archive/data/99', 600,000,000), more than the " in text
    assert spies["torch_load"] == [] and spies["built"] == []


# ---- what is not a regular file, and hostile shard indexes -------------------------------------------------------

@pytest.mark.parametrize("name,make,what", [
    ("config.json", lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file (kvlab reads config.json "
                                            "only from one, and never opens anything else)"),
    ("config.json", lambda p: p.symlink_to(p.parent / "elsewhere.json"), "is a link to"),
    ("model.safetensors", lambda p: p.mkdir(), "is a folder, not a regular file"),
    ("model.safetensors", lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
], ids=["config-fifo", "config-dangling", "weights-folder", "weights-dev-zero"])
def test_what_is_not_a_regular_file_is_refused_never_opened(tmp_path, name, make, what):  # ckpt-not-regular-files
    folder = gpt2_folder(tmp_path / "ckpt")
    (folder / name).unlink()
    make(folder / name)
    with pytest.raises(CheckpointError) as e:  # a FIFO opened for reading would block here
        load_model(folder)
    assert msg(e).startswith(f"{folder / name}: {what}")


def sharded(tmp_path: Path) -> tuple[Path, dict]:
    folder = gpt2_folder(tmp_path / "ckpt")
    state = load_file(str(folder / hf.SAFETENSORS))
    (folder / hf.SAFETENSORS).unlink()
    save_file(state, str(folder / "s0.safetensors"))
    weight_map = {k: "s0.safetensors" for k in state}
    (folder / hf.SHARD_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return folder, weight_map


def test_hostile_shard_indexes_are_one_line(tmp_path, spies):  # ckpt-index-hostile
    folder, weight_map = sharded(tmp_path)
    index = folder / hf.SHARD_INDEX
    clear(spies)
    many = {**weight_map, **{f"junk.{i}": f"model-{i:06d}-of-100000.safetensors" for i in range(100_000)}}
    index.write_text(json.dumps({"weight_map": many}))
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(folder)
    assert msg(e) == (f"{index}: names 100,000 tensor(s) the config does not account for, e.g. 'junk.0': does "
                      "config.json describe these weights?")
    for shard, said in [("../s0.safetensors", "names shard '../s0.safetensors', which is not a file in"),
                        ("gone.safetensors", "names shard 'gone.safetensors', which is not a file in"),
                        ("zero.safetensors", "zero.safetensors: is a character device, not a regular file")]:
        index.write_text(json.dumps({"weight_map": {k: shard for k in weight_map}}))
        if shard == "zero.safetensors":
            (folder / shard).symlink_to("/dev/zero")
        with pytest.raises(CheckpointError) as e:
            GPT2.from_pretrained(folder)
        assert said in msg(e)
    assert spies["get_tensor"] == [] and spies["built"] == []
    # a link to a regular file outside the folder is how the HF cache lays out a snapshot: it loads
    (folder / "s0.safetensors").rename(tmp_path / "blob")
    (folder / "s0.safetensors").symlink_to(tmp_path / "blob")
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert isinstance(GPT2.from_pretrained(folder), GPT2)

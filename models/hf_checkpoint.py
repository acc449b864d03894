"""The Hugging Face checkpoint format, in one place: its names and layouts, reading a folder, writing one.

A family's format facts are one declaration (``Format``, in ``FORMATS`` keyed by config.json's ``model_type``):
which weights HF stores transposed (GPT-2's four Conv1D weights, (in, out), where ``nn.Linear`` keeps (out, in)),
which tensors of an HF state dict are not weights (GPT-2's causal-mask buffers), which weights are tied (not written;
must agree when present), and the names that say a checkpoint's size. Everything here reads those facts, so a
second family adds a declaration, not a second copy of this code. Nothing here knows a config class: the caller
gives what it expects (an object with ``param_shapes()`` and the attributes its format's ``sizes`` name).

    to_hf(state, dtype=None)           our state dict -> HF's names and layouts (what a checkpoint file holds)
    from_hf(state)                     an HF state dict -> ours (prefix added, transposed back, buffers dropped)
    resolve(path_or_id)                a checkpoint folder, or a hub id fetched when the machine is online
    read_config(folder)                config.json as a dict
    read_weights(folder, expect=None)  (file, HF state dict): model.safetensors (or its shards, through
                                       model.safetensors.index.json), else pytorch_model.bin read with
                                       ``weights_only=True``; with ``expect``, every shape checked before any tensor
                                       is read (``check_shapes``)
    load_state(module, state, source)  an HF state dict copied into a module, every tensor checked
    to_safetensors(state, dtype=None)  the bytes of model.safetensors for our state dict
    write_folder(folder, state, config, dtype=None)   model.safetensors, then config.json (last: a folder with
                                       config.json is complete)

Every fault is a ``CheckpointError``: one line that names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"  # a sharded checkpoint: {"weight_map": {tensor name: shard file}}
PYTORCH_BIN = "pytorch_model.bin"


class CheckpointError(ValueError):
    """A checkpoint that is missing, of a family kvlab does not load, or disagrees with its own config."""


@dataclass(frozen=True, eq=False)  # hashable by identity (it holds a dict)
class Format:
    """One family's HF checkpoint facts (names are ours, which are HF's ``*LMHeadModel`` names)."""

    model_type: str  # config.json's model_type
    name: str  # what messages call the family
    transposed: tuple[str, ...] = ()  # name suffixes HF stores (in, out) and we keep (out, in)
    ignored: tuple[str, ...] = ()  # name suffixes HF state dicts may carry that are not weights
    tied: dict[str, str] = field(default_factory=dict)  # weight -> the weight it is tied to (not written)
    roots: tuple[str, ...] = ()  # the top-level prefixes of our names
    base: str = ""  # the prefix a base-model state dict (no head) leaves out
    layer: str = ""  # regex of a block's names, group 1 its index
    embedding: str = ""  # the token embedding, (vocab, width)
    positions: str | None = None  # the position embedding, (positions, width), if the family has one
    sizes: tuple[tuple[str, str], ...] = ()  # (what a shape message calls it, the config attribute holding it)

    def is_transposed(self, name: str) -> bool:
        return name.endswith(self.transposed) if self.transposed else False

    def is_ignored(self, name: str) -> bool:
        return name.endswith(self.ignored) if self.ignored else False

    def full_name(self, name: str) -> str:
        """``name`` with the base model's prefix when a base-model state dict left it out."""
        return name if not self.base or name.startswith(self.roots) else self.base + name


GPT2_FORMAT = Format(
    model_type="gpt2",
    name="GPT-2",
    # HF GPT-2 stores these four as Conv1D, weight (in, out); nn.Linear keeps (out, in)
    transposed=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
    # causal-mask buffers that HF GPT-2 state dicts may carry; not weights
    ignored=(".attn.bias", ".attn.masked_bias"),
    tied={"lm_head.weight": "transformer.wte.weight"},
    roots=("transformer.", "lm_head."),
    base="transformer.",
    layer=r"transformer\.h\.(\d+)\.",
    embedding="transformer.wte.weight",
    positions="transformer.wpe.weight",
    sizes=(("layers", "n_layer"), ("wide", "n_embd"), ("tokens", "vocab_size"), ("positions", "n_positions")),
)
FORMATS = {f.model_type: f for f in (GPT2_FORMAT,)}  # config.json's model_type -> its format

CONV1D = GPT2_FORMAT.transposed
MASK_BUFFERS = GPT2_FORMAT.ignored


# ---- layouts ----------------------------------------------------------------------------------------------------

def to_hf(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None, fmt: Format = GPT2_FORMAT,
          clone: bool = True) -> dict[str, torch.Tensor]:
    """Our state dict in HF's names and layouts: the transposed weights (GPT-2's Conv1D) as (in, out), tied weights
    left out (the tie gives them), floating tensors in ``dtype`` when given. ``clone``: each tensor a contiguous copy
    of its own (what a file needs: safetensors refuses shared or strided storage); False: views where possible, for
    a caller that copies them itself (``load_state_dict``) and must not hold a second copy of a large model."""
    out = {}
    for name, t in state.items():
        if name in fmt.tied:
            continue
        t = t.detach()
        if fmt.is_transposed(name) and t.dim() == 2:
            t = t.t()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.clone(memory_format=torch.contiguous_format) if clone else t
    return out


def from_hf(state: dict[str, torch.Tensor], fmt: Format = GPT2_FORMAT) -> dict[str, torch.Tensor]:
    """An HF state dict in our names and layouts: a base model's names get their prefix, the transposed weights are
    turned back (views, no copy), the buffers that are not weights dropped; tied weights are kept as given (a loader
    checks that they agree)."""
    out = {}
    for name, t in state.items():
        name = fmt.full_name(name)
        if fmt.is_ignored(name):
            continue
        if fmt.is_transposed(name) and isinstance(t, torch.Tensor) and t.dim() == 2:
            t = t.t()
        out[name] = t
    return out


# ---- reading ----------------------------------------------------------------------------------------------------

def resolve(path_or_id: str | os.PathLike) -> Path:
    """The checkpoint folder ``path_or_id`` names, or a hub id such as ``openai-community/gpt2`` fetched through
    huggingface_hub (config.json and the safetensors) when the machine is online."""
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path}: is a file; pass the checkpoint folder that holds {CONFIG}")
        return path
    text = str(path_or_id)
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep in text.replace("/", ""):
        raise CheckpointError(f"{text}: no such checkpoint folder")
    # a hub id such as "gpt2" or "openai-community/gpt2"
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")

    def unreachable(why: str) -> CheckpointError:
        return CheckpointError(f"{text}: no such folder here, and cannot fetch {text!r} from the hub ({why}); download "
                               f"it on a machine with network (e.g. `huggingface-cli download {text} {CONFIG} "
                               f"{SAFETENSORS} --local-dir DIR`) and pass DIR")

    if offline:
        raise unreachable("HF_HUB_OFFLINE is set")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=[CONFIG, "*.safetensors", SHARD_INDEX]))
    except Exception as e:  # no network, unknown repo, auth: one line that says what to do
        raise unreachable(type(e).__name__) from None


def read_config(folder: str | os.PathLike) -> dict:
    """A checkpoint folder's config.json, parsed (what it says is the family's to check). Faults name the file."""
    cfg_file = Path(folder) / CONFIG
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: not found; an HF checkpoint folder holds {CONFIG} and {SAFETENSORS}")
    try:
        return json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise CheckpointError(f"{cfg_file}: cannot be read ({e.strerror or type(e).__name__})") from None


FIRST_TOKEN_KEY = "kvlab_bos"  # config.json: true when every training row began with the model's bos_token_id


def first_token(folder: str | os.PathLike) -> int | None:
    """The token a checkpoint was trained to see first in every sequence (its config.json says ``kvlab_bos: true``:
    kvlab's own reference models), which every sequence a run feeds it then starts with; None for any other
    checkpoint. A ``kvlab_bos`` that is not true/false, or true without a bos_token_id, is refused in one line."""
    d = read_config(folder)
    flag = d.get(FIRST_TOKEN_KEY, False)
    if not isinstance(flag, bool):
        raise CheckpointError(f"{Path(folder) / CONFIG}: {FIRST_TOKEN_KEY} must be true or false, got {flag!r:.60}")
    if not flag:
        return None
    bos, vocab = d.get("bos_token_id"), d.get("vocab_size")
    if isinstance(bos, bool) or not isinstance(bos, int) or bos < 0 or (isinstance(vocab, int) and bos >= vocab):
        raise CheckpointError(f"{Path(folder) / CONFIG}: {FIRST_TOKEN_KEY} is true but bos_token_id is {bos!r:.60}; "
                              f"give the id of the token every sequence starts with (0 .. vocab_size - 1)")
    return bos


def check_shapes(expect, shapes: dict[str, tuple], source: str | os.PathLike, asked_by: str = CONFIG,
                 fmt: Format = GPT2_FORMAT) -> None:
    """Every parameter ``expect`` implies (``expect.param_shapes()``: our names and layouts) is among a checkpoint's
    tensors (HF names and layouts, a base model's prefix optional) with the shape ``expect`` gives it; the first that
    is not is refused in one line naming the file, the tensor, its shape in the file and the shape asked for, led by
    the sizes that differ (``fmt.sizes``: "config.json asks for 64 layers x 4096 wide but model.safetensors holds 2
    layers x 32 wide"). ``shapes`` come from the safetensors header, so this runs before anything is allocated.
    Tensors the config does not account for are left to ``load_state``."""
    shapes = {fmt.full_name(k): tuple(v) for k, v in shapes.items()}
    for name, want in expect.param_shapes():
        want = tuple(want)
        if fmt.is_transposed(name):
            want = want[::-1]
        have = shapes.get(name)
        if have == want:
            continue
        ours = {what: getattr(expect, attr) for what, attr in fmt.sizes}
        theirs = _sizes_in_file(shapes, fmt)
        differ = [k for k in ours if theirs.get(k) is not None and theirs[k] != ours[k]]
        if {"layers", "wide"} & set(differ):  # the model's size: both, as "L layers x C wide"
            differ = ["layers", "wide"] + [k for k in differ if k not in ("layers", "wide")]

        def size(d):
            s = [f"{'?' if d.get(k) is None else d[k]} {k}" for k in differ]
            return " x ".join(s[:2]) + "".join(f", {x}" for x in s[2:]) if differ[:1] == ["layers"] else ", ".join(s)

        whole = f"{asked_by} asks for {size(ours)} but {Path(source).name} holds {size(theirs)}: " if differ else ""
        what = "is missing" if have is None else f"has shape {have} in the file"
        raise CheckpointError(f"{source}: {whole}tensor {name!r} {what}, the config asks for {want}; does "
                              f"{asked_by} describe these weights?")


def _sizes_in_file(shapes: dict[str, tuple], fmt: Format) -> dict[str, int | None]:
    """The sizes a checkpoint's tensor shapes say: layers (the highest block index + 1), width and vocabulary (the
    token embedding), positions (the position embedding, if the family has one); None where the file does not say."""
    layers = [int(m.group(1)) for k in shapes if fmt.layer and (m := re.match(fmt.layer, k))]
    emb = shapes.get(fmt.embedding)
    pos = shapes.get(fmt.positions) if fmt.positions else None
    return {"layers": max(layers, default=-1) + 1, "wide": emb[1] if emb and len(emb) == 2 else None,
            "tokens": emb[0] if emb else None, "positions": pos[0] if pos else None}


def read_weights(folder: str | os.PathLike, expect=None, fmt: Format = GPT2_FORMAT,
                 ) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file read, its tensors as stored: HF names and layouts) from model.safetensors, else pytorch_model.bin
    (``torch.load(weights_only=True)``: kvlab never unpickles code). With ``expect`` (see ``check_shapes``) every
    shape is checked first: for safetensors from the header alone, before any tensor is read."""
    folder = Path(folder)
    st = folder / SAFETENSORS
    if not st.is_file() and (folder / SHARD_INDEX).is_file():
        return _read_shards(folder, expect, fmt)
    if st.is_file():
        from safetensors import safe_open
        from safetensors.torch import load_file

        try:
            with safe_open(str(st), framework="pt") as f:  # reads the header only
                shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as e:
            raise CheckpointError(f"{st}: not a readable safetensors file ({e})") from None
        if expect is not None:
            check_shapes(expect, shapes, st, fmt=fmt)
        try:
            return st, load_file(str(st))
        except Exception as e:
            raise CheckpointError(f"{st}: not a readable safetensors file ({e})") from None
    binf = folder / PYTORCH_BIN
    if binf.is_file():
        try:
            state = torch.load(binf, map_location="cpu", weights_only=True)
        except Exception as e:
            why = ("it holds pickled objects, not only tensors" if isinstance(e, pickle.UnpicklingError)
                   else f"{type(e).__name__}: {' '.join(str(e).split())[:120]}")
            raise CheckpointError(f"{binf}: cannot be read with weights_only=True ({why}); kvlab never unpickles "
                                  f"code: save the weights as {SAFETENSORS}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{binf}: holds a {type(state).__name__}, not a state dict (tensor names to "
                                  "tensors)")
        odd = next((k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None)
        if odd is not None:
            raise CheckpointError(f"{binf}: entry {odd!r} is a {type(state[odd]).__name__}, not a tensor; a state "
                                  "dict maps tensor names to tensors")
        if expect is not None:
            check_shapes(expect, {k: v.shape for k, v in state.items()}, binf, fmt=fmt)
        return binf, state
    raise CheckpointError(f"{folder}: no {SAFETENSORS} (or {PYTORCH_BIN}) in the checkpoint folder")


def _read_shards(folder: Path, expect, fmt: Format) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded safetensors checkpoint: the index's weight map names each tensor's shard; every shard's header is
    read (and, with ``expect``, every shape checked) before any tensor is."""
    from safetensors import safe_open

    index = folder / SHARD_INDEX
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a shard index with a weight_map ({type(e).__name__})") from None
    odd = next((v for v in shards if not isinstance(v, str)), None)
    if odd is not None or not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map must name each tensor's shard file, got {odd!r:.60}")
    shapes, names = {}, {}
    for shard in shards:
        path = folder / shard
        if Path(shard).name != shard or not path.is_file():
            raise CheckpointError(f"{index}: names shard {shard!r}, which is not a file in {folder}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in names:
                        raise CheckpointError(f"{path}: tensor {name!r} is also in {names[name].name}: a tensor "
                                              "lives in one shard")
                    shapes[name] = tuple(f.get_slice(name).get_shape())
                    names[name] = path
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    lost = sorted(k for k, v in weight_map.items() if names.get(k) != folder / v)
    if lost:
        raise CheckpointError(f"{index}: tensor {lost[0]!r} is not in the shard the index names "
                              f"({weight_map[lost[0]]})")
    if expect is not None:
        check_shapes(expect, shapes, index, fmt=fmt)
    state = {}
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as f:
            state.update({name: f.get_tensor(name) for name in f.keys()})
    return index, state


def load_state(module: nn.Module, state: dict[str, torch.Tensor], source: str = "state dict",
               fmt: Format = GPT2_FORMAT) -> None:
    """Copy an HF state dict (``from_hf`` turns it into ours) into ``module``, every tensor checked, one line naming
    ``source`` on the first fault: a tensor the module has no place for, one missing, a shape that differs, a
    non-finite value, a tied weight that differs from its tie. Tied weights the state leaves out come with the tie."""
    state = from_hf(state, fmt)
    ours = module.state_dict()
    extra = sorted(k for k in state if k not in ours)
    if extra:
        raise CheckpointError(f"{source}: {len(extra)} tensor(s) the config does not account for, e.g. "
                              f"{extra[0]!r}: does config.json describe these weights?")
    for name, target in ours.items():
        if name in fmt.tied:
            continue  # given by its tie (checked below when the state holds it too)
        if name not in state:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        src = state[name]
        if src.shape != target.shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(src.shape)} but the config "
                                  f"implies {tuple(target.shape)}")
        if src.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise CheckpointError(f"{source}: tensor {name!r} is {str(src.dtype).removeprefix('torch.')}: kvlab loads "
                                  "float32, float16 or bfloat16 weights")
        if src.is_floating_point() and not torch.isfinite(src).all():
            bad = int((~torch.isfinite(src)).sum())
            raise CheckpointError(f"{source}: tensor {name!r} holds {bad} non-finite values (NaN/inf): the "
                                  "checkpoint is corrupt; nothing measured on it could be trusted")
        with torch.no_grad():
            target.copy_(src)
    ours = module.state_dict()
    for name, tie in fmt.tied.items():
        if name in state and name in ours and not torch.equal(state[name].to(ours[tie].dtype), ours[tie]):
            raise CheckpointError(f"{source}: {name} differs from {tie}; {fmt.name} ties them")


# ---- writing ----------------------------------------------------------------------------------------------------

def to_safetensors(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                   fmt: Format = GPT2_FORMAT) -> bytes:
    """The bytes of model.safetensors holding our state dict (``to_hf``: HF names and layouts, in ``dtype``)."""
    from safetensors.torch import save

    return save(to_hf(state, dtype, fmt), metadata={"format": "pt"})


def write_folder(folder: str | os.PathLike, state: dict[str, torch.Tensor], config: dict,
                 dtype: torch.dtype | None = None, fmt: Format = GPT2_FORMAT) -> Path:
    """An HF checkpoint folder: model.safetensors (``to_safetensors``), then ``config`` as config.json (last: a folder
    with config.json is complete), each written whole or not at all. ``config`` gets ``torch_dtype`` (from ``dtype``)
    and ``tie_word_embeddings`` unless it gives them. Returns the folder."""
    if config.get("model_type") != fmt.model_type:
        raise ValueError(f"config's model_type is {config.get('model_type')!r}, the format written is "
                         f"{fmt.model_type!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _replace(folder / SAFETENSORS, to_safetensors(state, dtype, fmt))
    config = dict(config)
    if dtype is not None:
        config.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    config.setdefault("tie_word_embeddings", bool(fmt.tied))
    _replace(folder / CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return folder


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


__all__ = ["CONFIG", "CONV1D", "FIRST_TOKEN_KEY", "FORMATS", "GPT2_FORMAT", "MASK_BUFFERS", "PYTORCH_BIN",
           "SAFETENSORS", "SHARD_INDEX", "CheckpointError", "Format", "check_shapes", "first_token", "from_hf",
           "load_state", "read_config", "read_weights", "resolve", "to_hf", "to_safetensors", "write_folder"]

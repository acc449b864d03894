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
    read_config(folder)                config.json as a dict (a JSON object)
    read_small(path, cap)              a small file's bytes: a regular file of at most ``cap`` bytes, else refused
    read_weights(folder, expect=None)  (file, HF state dict): model.safetensors (or its shards, through
                                       model.safetensors.index.json), else pytorch_model.bin read with
                                       ``weights_only=True``; with ``expect``, every tensor the file holds checked
                                       against the config before any is read (``check_tensors``)
    load_state(module, state, source)  an HF state dict copied into a module, every tensor checked
    to_safetensors(state, dtype=None)  the bytes of model.safetensors for our state dict
    write_folder(folder, state, config, dtype=None)   model.safetensors, then config.json (last: a folder with
                                       config.json is complete)

Every fault is a ``CheckpointError``: one line that names the file and what is wrong with it. Every file of a folder
is bounded before it is read: config.json, the shard index and tokenizer.json by a cap each (``CONFIG_MAX``,
``INDEX_MAX``, ``TOKENIZER_MAX``), a safetensors header by ``HEADER_MAX`` and then tensor by tensor against the
config, a pytorch_model.bin by its size and its zip members' declared sizes against what the config implies; a
folder, FIFO, device or dangling link at a name kvlab reads is refused, never opened.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pickle
import re
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"  # a sharded checkpoint: {"weight_map": {tensor name: shard file}}
PYTORCH_BIN = "pytorch_model.bin"
TOKENIZER = "tokenizer.json"

MIB = 2 ** 20
CONFIG_MAX = 16 * MIB  # config.json: an HF one is a few kB (harness.tools.kvcalc reads as much)
INDEX_MAX = 64 * MIB  # the shard index: ~100 bytes a tensor (DeepSeek-V3's 91,000 tensors: ~9 MB)
TOKENIZER_MAX = 64 * MIB  # tokenizer.json: GPT-2's 1.4 MB, Llama 3's 9 MB, Gemma 3's 33 MB
HEADER_MAX = 16 * MIB  # a safetensors header: ~150 bytes a tensor
TYPICAL = {CONFIG: "an HF config.json is a few kB", SHARD_INDEX: "an index is ~100 bytes a tensor",
           TOKENIZER: "a tokenizer.json is a few MB"}
# safetensors' dtype names -> torch's and their bytes
ST_DTYPES = {"BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "F8_E5M2": ("float8_e5m2", 1),
             "F8_E4M3": ("float8_e4m3fn", 1), "I16": ("int16", 2), "U16": ("uint16", 2), "F16": ("float16", 2),
             "BF16": ("bfloat16", 2), "I32": ("int32", 4), "U32": ("uint32", 4), "F32": ("float32", 4),
             "I64": ("int64", 8), "U64": ("uint64", 8), "F64": ("float64", 8)}
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")  # what a weight may be stored as (each exact in fp32)
DTYPE_BYTES = dict(ST_DTYPES.values())


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
            mode = path.stat().st_mode
            what = "a file" if stat.S_ISREG(mode) else f"{_what_it_is(mode)}, not a folder"
            raise CheckpointError(f"{path}: is {what}; pass the checkpoint folder that holds {CONFIG}")
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


def _what_it_is(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def regular_file(path: str | os.PathLike, missing: str | None = None, what: str | None = None) -> os.stat_result | None:
    """``os.stat`` of ``path`` when it is a regular file (or a link to one); None when nothing is there (``missing``:
    the line to refuse it with instead). A folder, FIFO, device, socket or dangling link is refused in one line,
    never opened (``what``: what the line calls the file, by default its name)."""
    path = Path(path)
    what = what or path.name
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise CheckpointError(f"{path}: is a link to {os.readlink(path)!r}, which does not exist (kvlab reads "
                                  f"{what} only from a regular file)") from None
        if missing is not None:
            raise CheckpointError(missing) from None
        return None
    except OSError as e:  # a loop of links, no permission, a name too long
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: is {_what_it_is(st.st_mode)}, not a regular file (kvlab reads {what} only "
                              "from one, and never opens anything else)")
    return st


def read_small(path: str | os.PathLike, cap: int, missing: str | None = None) -> bytes | None:
    """The bytes of a small file of a checkpoint folder (config.json, the shard index, tokenizer.json): a regular file
    (``regular_file``) of at most ``cap`` bytes, its size checked before it is opened and never more than ``cap`` + 1
    bytes read (a file that grows meanwhile is refused too). None when nothing is there and ``missing`` is None."""
    path = Path(path)
    st = regular_file(path, missing)
    if st is None:
        return None

    def too_big(size: str) -> CheckpointError:
        why = TYPICAL.get(path.name, "")
        return CheckpointError(f"{path}: {size} bytes, more than the {cap:,} ({cap / MIB:g} MiB) kvlab reads for a "
                               f"{path.name}" + (f"; {why}" if why else ""))

    if st.st_size > cap:
        raise too_big(f"{st.st_size:,}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO swapped in meanwhile never blocks
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CheckpointError(f"{path}: is {_what_it_is(os.fstat(f.fileno()).st_mode)}, not a regular file "
                                      f"(kvlab reads {path.name} only from one)")
            data = f.read(cap + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if len(data) > cap:
        raise too_big(f"more than {cap:,}")
    return data


def _json(data: bytes, path: Path):
    """The JSON value of a file's bytes; what is not JSON is refused in one line naming the file."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON (not UTF-8 text at byte {e.start:,})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested deeper than kvlab parses)") from None
    except ValueError as e:  # JSONDecodeError, or an integer literal of more than 4,300 digits
        why = " ".join(str(e).split(";")[0].split())[:120]
        raise CheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {why})") from None


def _json_kind(value) -> str:
    if isinstance(value, bool) or value is None:
        return f"the JSON value {json.dumps(value)}"
    return {list: "a JSON list", str: "a JSON string"}.get(type(value), "a JSON number")


def read_config(folder: str | os.PathLike) -> dict:
    """A checkpoint folder's config.json, parsed: a JSON object (what it says is the family's to check), read only
    from a regular file of at most ``CONFIG_MAX`` bytes. Faults name the file."""
    cfg_file = Path(folder) / CONFIG
    d = _json(read_small(cfg_file, CONFIG_MAX, missing=f"{cfg_file}: not found; an HF checkpoint folder holds "
                                                         f"{CONFIG} and {SAFETENSORS}"), cfg_file)
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_file}: holds {_json_kind(d)}, not an object of model settings (a config.json "
                              "is a JSON object: model_type and the model's sizes)")
    return d


FIRST_TOKEN_KEY = "kvlab_bos"  # config.json: true when every training row began with the model's bos_token_id


def first_token_share(folder: str | os.PathLike) -> float | None:
    """The most attention one head of a kvlab reference checkpoint puts on its first token, as its training
    evaluation measured it (config.json ``kvlab_train.targets.sink_head_max``: queries at positions >= 64 of
    held-out text); None when the checkpoint records none (any other checkpoint) or records something that is not
    a share in [0, 1]."""
    targets = (read_config(folder).get("kvlab_train") or {})
    targets = targets.get("targets") if isinstance(targets, dict) else None
    share = targets.get("sink_head_max") if isinstance(targets, dict) else None
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        return None
    return float(share)


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
    Tensors the config does not account for are ``check_tensors``' (and ``load_state``'s) to refuse."""
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


def _nbytes(shape: tuple, dtype: str) -> int:
    return math.prod(shape) * DTYPE_BYTES.get(dtype, 8)


def _refuse_dtype(source, name: str, dtype: str) -> CheckpointError:
    return CheckpointError(f"{source}: tensor {name!r} is {dtype}: kvlab loads float32, float16 or bfloat16 weights "
                           "(each exact in its fp32 model); convert the checkpoint to one of them")


def _accounting(expect, fmt: Format) -> tuple[dict, dict]:
    """(parameter -> shape, buffer -> shape) that ``expect`` implies, in HF names (a transposed weight's shape as HF
    stores it). Spelled out only once ``check_shapes`` has found every parameter in the file: no more than it holds."""
    want = {n: tuple(s)[::-1] if fmt.is_transposed(n) else tuple(s) for n, s in expect.param_shapes()}
    for name, tie in fmt.tied.items():
        if name not in want and tie in want:
            want[name] = want[tie]  # a tied weight may be stored too (it must then equal its tie)
    buffers = {n: tuple(s) for n, s in getattr(expect, "buffer_shapes", tuple)()}
    return want, buffers


def _check_accounted(tensors: dict[str, tuple[tuple, str]], want: dict, buffers: dict, source,
                     fmt: Format, asked_by: str = CONFIG) -> None:
    """Each tensor of a file (name -> (shape, dtype)) is a parameter of ``want`` in its shape, stored as float32,
    float16 or bfloat16, or a buffer the format ignores that is no bigger than ``buffers`` gives it (at 4 bytes an
    element); anything else is refused in one line."""
    extra = []
    for stored, (shape, dtype) in tensors.items():
        name = fmt.full_name(stored)
        if name in want:
            if tuple(shape) != want[name]:
                raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(shape)} in the file, the config "
                                      f"asks for {want[name]}; does {asked_by} describe these weights?")
            if dtype not in WEIGHT_DTYPES:
                raise _refuse_dtype(source, name, dtype)
        elif fmt.is_ignored(name) and name in buffers:
            cap = 4 * math.prod(buffers[name])
            if _nbytes(shape, dtype) > cap:
                raise CheckpointError(f"{source}: buffer {name!r} ({tuple(shape)}, {dtype}) holds "
                                      f"{_nbytes(shape, dtype):,} bytes, more than the {cap:,} the config implies "
                                      f"({buffers[name]} at 4 bytes); does {asked_by} describe these weights?")
        else:
            extra.append((stored, tuple(shape), dtype))  # named as the file names it
    if extra:
        name, shape, dtype = extra[0]
        total = sum(_nbytes(s, d) for _, s, d in extra)
        raise CheckpointError(f"{source}: {len(extra)} tensor(s) the config does not account for ({total:,} bytes), "
                              f"e.g. {name!r} {shape}: does {asked_by} describe these weights?")


def check_tensors(expect, tensors: dict[str, tuple[tuple, str]], source: str | os.PathLike,
                  fmt: Format = GPT2_FORMAT, asked_by: str = CONFIG) -> None:
    """Every tensor a checkpoint file holds (name -> (shape, dtype name as torch spells it), from a safetensors header:
    nothing read yet) against what ``expect`` implies: every parameter there in its shape (``check_shapes``), each
    stored as float32, float16 or bfloat16; a stored tied weight in its tie's shape; a buffer the format ignores
    (GPT-2's attention masks) no bigger than ``expect.buffer_shapes()`` gives it; nothing else. So the file holds no
    more bytes than the config implies, and the first fault is one line naming the file and the tensor."""
    check_shapes(expect, {k: v[0] for k, v in tensors.items()}, source, asked_by, fmt)
    _check_accounted(tensors, *_accounting(expect, fmt), source, fmt, asked_by)


def _st_header(path: Path) -> dict[str, tuple[tuple, str]]:
    """A safetensors file's tensors (name -> (shape, dtype)) from its header alone: its declared length checked
    against ``HEADER_MAX`` before the header is parsed."""
    from safetensors import safe_open

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            head, size = f.read(8), os.fstat(f.fileno()).st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    n = int.from_bytes(head, "little") if len(head) == 8 else None
    if n is not None and n > size - 8:
        raise CheckpointError(f"{path}: not a readable safetensors file (its first 8 bytes declare a header of {n:,} "
                              f"bytes, and the file has {size:,})")
    if n is not None and n > HEADER_MAX:
        raise CheckpointError(f"{path}: its header declares {n:,} bytes, more than the {HEADER_MAX:,} "
                              f"({HEADER_MAX / MIB:g} MiB) kvlab reads for a safetensors header (~150 bytes a tensor)")
    try:
        with safe_open(str(path), framework="pt") as f:  # reads the header only
            out = {}
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (tuple(s.get_shape()), ST_DTYPES.get(s.get_dtype(), (s.get_dtype().lower(),))[0])
            return out
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _bin_budget(expect, fmt: Format, need: int) -> int:
    """The most bytes a pytorch_model.bin of ``expect`` may hold: its parameters (a stored tied weight too) and
    buffers at 4 bytes an element, with 1 MiB and 4 KiB a tensor for the archive's own records; counted only until it
    reaches ``need`` (a config of a million layers is not spelled out to weigh a small file)."""
    total, ties = MIB, set(fmt.tied.values())
    for name, shape in itertools.chain(expect.param_shapes(), getattr(expect, "buffer_shapes", tuple)()):
        total += 4 * math.prod(shape) * (2 if name in ties else 1) + 4096
        if total >= need:
            break
    return total


def _check_bin_size(binf: Path, size: int, expect, fmt: Format) -> None:
    """pytorch_model.bin weighed before torch.load: its size, and (a zip archive, torch's format) its members'
    declared sizes, each against what the config implies (``_bin_budget``)."""
    budget = _bin_budget(expect, fmt, size)
    if size > budget:
        raise CheckpointError(f"{binf}: {size:,} bytes, more than the {budget:,} bytes {CONFIG} implies (its tensors "
                              f"at 4 bytes an element and the archive's records); does {CONFIG} describe these "
                              "weights?")
    if not zipfile.is_zipfile(binf):
        return  # torch's legacy format: read as a whole, and the file is no bigger than the config implies
    try:
        with zipfile.ZipFile(binf) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CheckpointError(f"{binf}: not a readable zip archive ({type(e).__name__}: {e}); a pytorch_model.bin is "
                              "one") from None
    declared = sum(m.file_size for m in members)
    budget = _bin_budget(expect, fmt, declared)
    if declared > budget:
        big = max(members, key=lambda m: m.file_size)
        raise CheckpointError(f"{binf}: its {len(members):,} archive members declare {declared:,} bytes (the largest, "
                              f"{big.filename!r}, {big.file_size:,}), more than the {budget:,} bytes {CONFIG} implies "
                              "(its tensors at 4 bytes an element and the archive's records); does "
                              f"{CONFIG} describe these weights?")


def read_weights(folder: str | os.PathLike, expect=None, fmt: Format = GPT2_FORMAT,
                 ) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the file read, its tensors as stored: HF names and layouts) from model.safetensors, else its shards (through
    model.safetensors.index.json), else pytorch_model.bin (``torch.load(weights_only=True)``: kvlab never unpickles
    code). Each is a regular file (``regular_file``). With ``expect`` every tensor is checked first
    (``check_tensors``): for safetensors from the header alone, before any tensor is read; a pytorch_model.bin is
    weighed (its size, its zip members' declared sizes) against what the config implies before torch.load."""
    folder = Path(folder)
    st = folder / SAFETENSORS
    if regular_file(st) is not None:
        from safetensors.torch import load_file

        tensors = _st_header(st)
        if expect is not None:
            check_tensors(expect, tensors, st, fmt=fmt)
        try:
            return st, load_file(str(st))
        except Exception as e:
            raise CheckpointError(f"{st}: not a readable safetensors file ({e})") from None
    if regular_file(folder / SHARD_INDEX) is not None:
        return _read_shards(folder, expect, fmt)
    binf = folder / PYTORCH_BIN
    found = regular_file(binf)
    if found is not None:
        if expect is not None:
            _check_bin_size(binf, found.st_size, expect, fmt)
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
            check_tensors(expect, {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()},
                          binf, fmt=fmt)
        return binf, state
    raise CheckpointError(f"{folder}: no {SAFETENSORS} (or {PYTORCH_BIN}) in the checkpoint folder")


def files_read(folder: str | os.PathLike) -> list[Path]:
    """Every file of a checkpoint folder a load reads, as ``read_weights`` chooses them: config.json, the weights
    (model.safetensors; else the shard index and the shards it names; else pytorch_model.bin) and tokenizer.json;
    those present as regular files, in name order. What a run's results depend on (its resume fingerprint)."""
    folder = Path(folder)

    def there(name: str) -> bool:
        try:
            return regular_file(folder / name) is not None
        except CheckpointError:
            return False

    names = [CONFIG, TOKENIZER]
    if there(SAFETENSORS):
        names.append(SAFETENSORS)
    elif there(SHARD_INDEX):
        names.append(SHARD_INDEX)
        try:
            d = _json(read_small(folder / SHARD_INDEX, INDEX_MAX), folder / SHARD_INDEX)
            shards = {v for v in d["weight_map"].values() if isinstance(v, str) and Path(v).name == v}
        except (CheckpointError, KeyError, TypeError, AttributeError):  # a load refuses it: nothing more to name
            shards = set()
        names += sorted(shards)
    else:
        names.append(PYTORCH_BIN)
    return [folder / n for n in sorted(set(names)) if there(n)]


def _read_shards(folder: Path, expect, fmt: Format) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded safetensors checkpoint: the index (at most ``INDEX_MAX`` bytes) names each tensor's shard; with
    ``expect`` a name the config does not account for is refused from the index, before any shard is opened. Every
    shard's header is read and every tensor checked (``check_tensors``) before any tensor is."""
    from safetensors import safe_open

    index = folder / SHARD_INDEX
    d = _json(read_small(index, INDEX_MAX), index)
    weight_map = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: not a shard index with a weight_map (it holds "
                              f"{_json_kind(d) if not isinstance(d, dict) else 'no weight_map object'})")
    odd = next((v for v in weight_map.values() if not isinstance(v, str)), None)
    if odd is not None:
        raise CheckpointError(f"{index}: weight_map must name each tensor's shard file, got {odd!r:.60}")
    shards = sorted(set(weight_map.values()))
    if expect is not None:
        _check_index(expect, weight_map, index, fmt)
    tensors, names, per_shard = {}, {}, {}
    for shard in shards:
        path = folder / shard
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index}: names shard {shard!r}, which is not a file in {folder}")
        regular_file(path, missing=f"{index}: names shard {shard!r}, which is not a file in {folder}")
        per_shard[path] = _st_header(path)
        for name, info in per_shard[path].items():
            if name in names:
                raise CheckpointError(f"{path}: tensor {name!r} is also in {names[name].name}: a tensor lives in one "
                                      "shard")
            tensors[name], names[name] = info, path
    lost = sorted(k for k, v in weight_map.items() if names.get(k) != folder / v)
    if lost:
        raise CheckpointError(f"{index}: tensor {lost[0]!r} is not in the shard the index names "
                              f"({weight_map[lost[0]]})")
    if expect is not None:
        check_shapes(expect, {k: v[0] for k, v in tensors.items()}, index, fmt=fmt)
        want, buffers = _accounting(expect, fmt)
        for path, held in per_shard.items():
            _check_accounted(held, want, buffers, path, fmt)
    state = {}
    for shard in shards:
        try:
            with safe_open(str(folder / shard), framework="pt") as f:
                state.update({name: f.get_tensor(name) for name in f.keys()})
        except Exception as e:
            raise CheckpointError(f"{folder / shard}: not a readable safetensors file ({e})") from None
    return index, state


def _check_index(expect, weight_map: dict, index: Path, fmt: Format) -> None:
    """The tensor names of a shard index against the config, before any shard is opened: a name the config does not
    account for is refused (so an index naming 100,000 shards of unknown tensors opens none). The config's names are
    spelled out only up to as many as the index holds: a config asking for more is refused by the headers' check."""
    named = {fmt.full_name(k): k for k in weight_map}
    want = set()
    for i, (name, _) in enumerate(expect.param_shapes()):
        if i > len(named):
            return
        want.add(name)
    want |= set(fmt.tied)
    buffers = {n for n, _ in getattr(expect, "buffer_shapes", tuple)()}
    extra = sorted(k for n, k in named.items() if n not in want and not (fmt.is_ignored(n) and n in buffers))
    if extra:
        raise CheckpointError(f"{index}: names {len(extra):,} tensor(s) the config does not account for, e.g. "
                              f"{extra[0]!r}: does {CONFIG} describe these weights?")


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
        if str(src.dtype).removeprefix("torch.") not in WEIGHT_DTYPES:
            raise _refuse_dtype(source, name, str(src.dtype).removeprefix("torch."))
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


__all__ = ["CONFIG", "CONFIG_MAX", "CONV1D", "FIRST_TOKEN_KEY", "FORMATS", "GPT2_FORMAT", "HEADER_MAX", "INDEX_MAX",
           "MASK_BUFFERS", "PYTORCH_BIN", "SAFETENSORS", "SHARD_INDEX", "TOKENIZER", "TOKENIZER_MAX", "CheckpointError",
           "Format", "check_shapes", "check_tensors", "first_token", "from_hf", "load_state", "read_config",
           "read_small", "read_weights", "regular_file", "resolve", "to_hf", "to_safetensors", "write_folder"]

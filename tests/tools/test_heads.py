"""``python -m harness.heads`` (each K/V head's retrieval score) and ``cache=duo`` reading what it writes."""

import pandas as pd
import pytest
import torch

from harness.tools.heads import COLUMNS, main, score_heads
from models.families import build, preset_config
from models.kv_cache import make_cache
from models.kv_cache.duo import read_scores


def test_a_head_that_attends_to_the_token_it_copies_scores_one_and_the_others_zero(monkeypatch):
    """The score is the share of copy steps whose most-attended key holds the token being produced, in the first
    showing: attention made to point exactly there in layer 1's K/V head 0 (and nowhere useful elsewhere) scores
    1 there and 0 in every other head, over each of k sequences."""
    import harness.train.targets as targets

    torch.manual_seed(0)
    model = build(preset_config("tiny-gqa")).eval()  # 2 layers, 4 query heads over 2 K/V heads
    n, lead = 6, 0

    def probs(_model, seq):
        T = seq.shape[1]
        out = []
        for layer in range(2):
            p = torch.zeros(1, 4, T, T)
            p[0, :, :, 0] = 1.0  # every head on the first key: not the copied token (distinct ids)
            if layer == 1:
                for q in range(lead + n, T):  # query q predicts seq[q + 1], first shown at q + 1 - n
                    src = q + 1 - n
                    p[0, :2, q] = 0.0
                    p[0, :2, q, min(src, q)] = 1.0  # the two query heads of K/V head 0
            out.append(p)
        return out

    monkeypatch.setattr(targets, "attention_probs", probs)
    table = score_heads(model, n=n, k=3, seed=1)
    assert list(table.columns) == list(COLUMNS) and len(table) == 4
    got = {(r.layer, r.kv_head): r.score for r in table.itertuples()}
    assert got == {(0, 0): 0.0, (0, 1): 0.0, (1, 0): 1.0, (1, 1): 0.0}
    assert (table.n == 3).all() and (table.lo <= table.score).all() and (table.score <= table.hi).all()


def test_the_command_writes_what_duo_reads_and_duo_keeps_the_top_share_whole(tmp_path, capsys):
    out = tmp_path / "heads.csv"
    assert main(["--model", "tiny", "--out", str(out), "--n", "8", "--k", "2"]) == 0
    said = capsys.readouterr().out
    assert out.with_suffix(".png").stat().st_size > 0 and "preset tiny, seeded initialisation" in said
    table = pd.read_csv(out)
    assert list(table.columns) == list(COLUMNS) and len(table) == 2 * 2
    table["score"] = [0.1, 0.9, 0.5, 0.2]  # layer 0 head 1 highest, then layer 1 head 0
    table.to_csv(out, index=False)
    assert read_scores(str(out), 2, 2) == {(0, 0): 0.1, (0, 1): 0.9, (1, 0): 0.5, (1, 1): 0.2}
    cache = make_cache("duo", 2, 2, 16, 40, heads=str(out), retrieval=0.5, sinks=1, recent=3)
    assert cache.retrieval_heads() == {(0, 1), (1, 0)}
    assert cache.head_roles(0) == ["streaming", "retrieval"] and cache.slots_of(0) == [[4, 40]]
    assert cache.nbytes == cache.formula_nbytes() == (2 * 40 + 2 * 4) * (2 * 16 * 4 + 8)
    assert main(["--model", "tiny", "--out", str(out), "--n", "8", "--k", "1"]) == 0  # its own file: rewritten


@pytest.mark.parametrize("content,says", [
    (None, "no such file"),
    ("a,b\n1,2\n", "has no layer, kv_head and score columns"),
    ("layer,kv_head,score\n0,0,0.5\n0,0,0.1\n0,1,1\n1,0,1\n1,1,1\n", "layer 0 head 0 is given twice"),
    ("layer,kv_head,score\n0,0,nan\n0,1,1\n1,0,1\n1,1,1\n", "is not a finite number"),
    ("layer,kv_head,score\n0,0,1\n0,1,1\n1,0,1\n", "scores 3 heads, not this model's 2 layers x 2 K/V heads"),
    ("layer,kv_head,score\n0,x,1\n", "is not (layer, kv_head, score) numbers"),
])
def test_a_heads_file_that_is_not_this_models_is_refused_in_one_line(tmp_path, content, says):
    path = tmp_path / "heads.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=r"cache\.heads=.*" + says.replace("(", r"\(").replace(")", r"\)")):
        make_cache("duo", 2, 2, 16, 40, heads=str(path))


def test_the_command_refuses_bad_arguments_and_a_file_it_did_not_write(tmp_path, capsys):
    theirs = tmp_path / "mine.csv"
    theirs.write_text("a user's,file\n")
    for argv, says in [(["--out", str(theirs)], "exists and is not a heads file kvlab wrote"),
                       (["--out", str(tmp_path / "h.txt")], "give a .csv path"),
                       (["--out", str(tmp_path / "h.csv"), "--k", "0"], "give 2 <= n <= 4096 and 1 <= k <= 1000"),
                       (["--out", str(tmp_path / "h.csv"), "--n", "100"], "two showings need 200 positions"),
                       (["--out", str(tmp_path / "h.csv"), "--model", "nosuch"], "unknown model preset 'nosuch'")]:
        model = [] if "--model" in argv else ["--model", "tiny"]
        assert main([*model, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("heads: error: ") and says in err[0], err
    assert theirs.read_text() == "a user's,file\n" and not (tmp_path / "h.csv").exists()


def test_a_streaming_head_attends_to_its_sinks_and_recent_keys_only():
    """--method streaming's forward: in the chosen layer, the query heads of the chosen K/V head attend over the
    first ``sinks`` and the ``recent`` newest keys alone (checked query by query against a softmax over exactly those
    keys), every other head and every other layer as the model computes them; sinks + recent covering the sequence
    changes nothing, so every score is 0."""
    import models.llama as llama
    from harness.tools import heads
    from models import attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)  # heads 2, 3 share K/V 1
    with heads._streaming_head(1, 1, sinks=1, recent=3):
        got, other_layer = llama.attend(q, k, v, None, 1), llama.attend(q, k, v, None, 0)
    plain = attention.attend(q, k, v, None, 1)
    torch.testing.assert_close(other_layer, plain)
    torch.testing.assert_close(got[:, :2], plain[:, :2])  # K/V head 0's query heads: unchanged
    for h in (2, 3):
        for t in range(12):
            keys = sorted({0} | set(range(max(0, t - 2), t + 1)))  # the sink, and the 3 newest up to t
            w = (q[0, h, t] @ k[0, 1, keys].T / 8 ** 0.5).softmax(-1)
            torch.testing.assert_close(got[0, h, t], w @ v[0, 1, keys])
    assert not torch.allclose(got[:, 2:], plain[:, 2:])
    assert llama.attend is attention.attend  # put back
    model = build(preset_config("tiny-gqa")).eval()
    table = heads.streaming_scores(model, n=5, k=2, recent=100)  # every head sees everything: nothing is lost
    assert len(table) == 4 and (table.score == 0.0).all() and (table.method == "streaming").all()


def test_the_streaming_command_writes_its_method_and_refuses_a_span_within_reach(tmp_path, capsys):
    out = tmp_path / "heads.csv"
    assert main(["--model", "tiny", "--out", str(out), "--method", "streaming", "--n", "12", "--k", "2",
                 "--sinks", "1", "--recent", "4"]) == 0
    assert "streaming head (1 sinks + 4 recent)" in capsys.readouterr().out
    table = pd.read_csv(out)
    assert list(table.columns) == list(COLUMNS) and (table.method == "streaming").all() and (table.n == 2).all()
    assert main(["--model", "tiny", "--out", str(out), "--method", "streaming", "--n", "64"]) == 2  # 16 + 64 >= 64
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the span must lie beyond a streaming head's reach" in err[0]


def test_a_duo_sweep_over_models_gives_each_model_its_own_heads_file():
    """experiment=paper_duo sweeps cache.heads='models/heads/{model}.csv': each run reads its own model's file (a
    sweep's ${model.name} would be resolved once, for the first model), and both shipped models' files exist and
    are this project's (python -m harness.heads wrote them: its columns, one row per layer and K/V head)."""
    from hydra import compose, initialize_config_dir

    from harness.experiment.config import read, register
    from tests.helpers import REPO

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for model in ("mini", "mini-llama"):
            cfg = compose(config_name="config", overrides=["experiment=paper_duo", f"model={model}",
                                                           "cache.heads='models/heads/{model}.csv'"])
            heads = read(cfg).cache.options["heads"]
            assert heads == f"models/heads/{model}.csv"
            table = pd.read_csv(REPO / heads)
            assert list(table.columns) == list(COLUMNS) and len(table) == 12 and (table.method == "streaming").all()
            assert read_scores(str(REPO / heads), 6, 2)  # what duo reads


def test_a_duo_runs_inputs_hash_its_heads_file_so_a_rewritten_file_is_measured_again(tmp_path):
    """cache.heads is an input of the run beside its config (inputs_cache): a resumed sweep whose heads file was
    rewritten measures its duo runs again; the random control reads no file."""
    from harness.experiment.config import read
    from harness.experiment.folder import changed_inputs, input_ids
    from harness.experiment.prepare import cache_files
    from models.kv_cache import DuoKVCache
    from tests.helpers import REPO
    from tests.helpers.inproc import compose_cfg

    heads = tmp_path / "heads.csv"
    heads.write_text((REPO / "models" / "heads" / "mini.csv").read_text())
    assert DuoKVCache.input_files(DuoKVCache.parse_options(heads=str(heads))) == (str(heads),)
    assert DuoKVCache.input_files(DuoKVCache.parse_options()) == ()  # random: no file
    rc = read(compose_cfg(["model=mini", "cache=duo", f"cache.heads={heads}"]))
    assert cache_files(rc) == (str(heads),)
    assert cache_files(read(compose_cfg(["model=mini", "cache=duo"]))) == ()
    before = input_ids(None, 0, None, cache_files=cache_files(rc))
    assert before["inputs_cache"] is not None and input_ids(None, 0, None)["inputs_cache"] is None
    heads.write_text(heads.read_text().replace("streaming", "streaming", 1) + "\n")
    after = input_ids(None, 0, None, cache_files=cache_files(rc))
    assert changed_inputs(before, after) == [f"the cache kind's files changed ({before['inputs_cache']} -> "
                                             f"{after['inputs_cache']})"]

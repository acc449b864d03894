"""The long-context retrieval tasks (``niah``, ``mqar``): the probes they build, their passes through the run's cache
beside fp32 full attention, their refusals, and that a run names them to run them."""

import json

import pandas as pd
import pytest
import torch

from harness import measurements
from harness.core import recall
from harness.experiment.config import ConfigError
from tests.helpers import inproc

SMALL = ["model=tiny", "n_prompts=1", "new_tokens=4", "prompt_len=4", "repeats=1", "warmup=0", "context_lengths=[8]",
         "drift_text_len=12", "max_len=32", "tracking=disabled"]


def run_here(tmp_path, monkeypatch, overrides) -> tuple[dict, object]:
    """One run in this process into ``tmp_path/run``: (its record, its folder)."""
    out = tmp_path / "run"
    return inproc.run_here(monkeypatch, overrides, out), out


def test_a_haystack_holds_its_needles_apart_and_asks_the_first_at_its_depth():
    """The needle asked sits at its depth of the room before the questions; every needle planted is whole and apart
    from the others; the questions are the asked needles, key then value, and the scored ids are their values."""
    hay, ids = torch.arange(1000, 1400), torch.arange(10, 60)
    for depth in (0.05, 0.5, 0.95):
        p = recall.haystack(hay, ids, depth, seed=3, keys=3, queries=2)
        span = recall.KEY + recall.VALUE
        room = len(hay) - 2 * span
        assert p.asked == room and len(p.seq) == len(hay) and len(p.scored) == 2 * recall.VALUE
        planted = (p.seq[:room] < 1000).nonzero().flatten().tolist()  # the needles' ids are below the text's
        assert len(planted) == 3 * span  # three whole needles, none over another
        asked = [p.seq[room + j * span:room + (j + 1) * span] for j in range(2)]
        starts = [s for s in range(room - span + 1) if any(torch.equal(p.seq[s:s + span], a) for a in asked)]
        assert len(starts) == 2
        assert round(depth * (room - span)) in starts  # the first needle, at its depth
        assert sorted(p.depths[::recall.VALUE]) == sorted(s / (room - span) for s in starts)
        for j, a in enumerate(asked):
            at = room + j * span + recall.KEY
            assert p.scored[j * recall.VALUE:(j + 1) * recall.VALUE] == list(range(at, at + recall.VALUE))
            assert torch.equal(p.seq[at:at + recall.VALUE], a[recall.KEY:])
    with pytest.raises(ValueError, match="1 <= queries <= keys"):
        recall.haystack(hay, ids, 0.5, seed=0, keys=1, queries=2)
    with pytest.raises(ValueError, match="a haystack of at least 112 ids"):
        recall.haystack(torch.arange(1000, 1100), ids, 0.5, seed=0, keys=3, queries=1)
    many = recall.haystack(torch.arange(1000, 1240), ids, 0.5, seed=5, keys=7, queries=1)  # the room just enough
    assert int((many.seq[:224] < 1000).sum()) == 7 * 16


def test_mqar_asks_every_distinct_key_once_and_scores_its_value():
    ids = torch.arange(100, 110)  # few ids: keys would repeat unless drawn distinct
    p = recall.mqar(ids, pairs=8, seed=1, key=1, value=1)
    pairs = {int(p.seq[2 * i]): int(p.seq[2 * i + 1]) for i in range(8)}
    assert len(pairs) == 8 and p.asked == 16 and len(p.seq) == 32
    asked = [int(p.seq[16 + 2 * j]) for j in range(8)]
    assert sorted(asked) == sorted(pairs) and p.scored == [17 + 2 * j for j in range(8)]
    assert [int(p.seq[t]) for t in p.scored] == [pairs[k] for k in asked]
    assert sorted(p.depths) == [i / 7 for i in range(8)]
    wide = recall.mqar(torch.arange(1000), pairs=4, seed=2, key=2, value=3)
    assert len(wide.seq) == 40 and len(wide.scored) == 12


@pytest.mark.slow  # seconds: not in make test-fast
def test_through_an_exact_cache_each_answer_is_what_full_attention_gives_and_a_run_names_the_tasks(
        tmp_path, monkeypatch):
    """prealloc is full attention: every scored id's top-1 through it equals fp32 full attention's, at every depth
    and length; the tables hold every probe's answers with their depths; a run that names no measurements runs
    neither task (``optional``)."""
    rec, out = run_here(tmp_path, monkeypatch, [*SMALL, "max_len=128", "cache=prealloc",
                                                "measurements=[equivalence,niah,mqar]", "niah_k=2", "niah_depths=4",
                                                "niah_lengths=[64,128]", "mqar_k=3", "mqar_pairs=20"])
    assert rec["status"] == "ok", rec.get("error")
    saved = json.loads((out / "results.json").read_text())
    niah, mqar = (pd.read_csv(out / f"{t}_positions.csv") for t in ("niah", "mqar"))
    assert (niah.correct == niah.correct_ref).all() and (mqar.correct == mqar.correct_ref).all()
    assert saved["niah_acc"] == saved["niah_acc_ref"] and saved["mqar_acc"] == saved["mqar_acc_ref"]
    assert len(niah) == saved["niah_values"] == 2 * 2 * 4 * recall.VALUE  # lengths x haystacks x depths x values
    assert sorted(niah.depth_bucket.unique()) == [0, 1, 2, 3] and sorted(niah.context_len.unique()) == [64, 128]
    assert saved["niah_lengths"] == "64,128" and saved["mqar_pairs"] == 20 and len(mqar) == 3 * 20
    assert niah.groupby("probe").seq_id.nunique().eq(1).all()
    assert "niah" not in measurements.chosen(None) and "mqar" not in measurements.chosen(None)
    assert "niah" in measurements.chosen(["niah"])


def test_bad_task_options_are_refused_in_one_line():
    from harness.measurements.recall_tasks import Mqar, Niah

    assert Niah.lengths(Niah.Options(), 1024) == [1024] and Mqar.pairs(Mqar.Options(), 1024) == 255
    for opts, says in [(Niah.Options(niah_queries=2), "niah_queries=2 must be an integer 1 .. 1"),
                       (Niah.Options(niah_lengths=[2048]), "niah_lengths entry 2048 must be"),
                       (Niah.Options(niah_lengths=[256, 256]), "names a length twice"),
                       (Niah.Options(niah_k=200), "niah_k=200 must be an integer 1 .. 100")]:
        with pytest.raises(ConfigError, match=says):
            Niah.check(opts, 1024)
    with pytest.raises(ConfigError, match="mqar_pairs=600 must be an integer 1 .. 255"):
        Mqar.check(Mqar.Options(mqar_pairs=600), 1024)
    with pytest.raises(ConfigError, match="mqar needs max_len >= 5"):
        Mqar.check(Mqar.Options(), 2)


@pytest.mark.slow
def test_on_the_trained_mini_a_window_loses_the_needles_beyond_its_reach(tmp_path, monkeypatch):
    """On the shipped mini, which finds needles at full attention: a 32-position window without sinks answers no id
    of a needle planted beyond its reach (every depth but the last, which lies within 32 of the questions at 256),
    while fp32 full attention answers most of them; MQAR's pairs are all beyond it too."""
    rec, out = run_here(tmp_path, monkeypatch, ["model=mini", "n_prompts=1", "new_tokens=4", "prompt_len=8",
                                                "tracking=disabled", "cache=window", "cache.window=32",
                                                "cache.sinks=0", "measurements=[niah,mqar]", "niah_k=2",
                                                "niah_depths=8", "niah_lengths=[256]", "mqar_k=2", "mqar_pairs=60"])
    assert rec["status"] == "ok", rec.get("error")
    niah = pd.read_csv(out / "niah_positions.csv")
    deep = niah[niah.depth_bucket < 7]  # needles more than 32 positions before the questions
    assert deep.correct.sum() == 0 and deep.correct_ref.mean() >= 0.8
    saved = json.loads((out / "results.json").read_text())
    assert saved["niah_ref_ok"] and saved["mqar_ref_ok"] and saved["mqar_acc"] < 0.1 < 0.9 < saved["mqar_acc_ref"]

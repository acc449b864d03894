"""harness.core.recall: needles, far copies and key-value recall planted in text, scored only where the answer can be
known; checked against an oracle that copies what followed the last earlier showing of the current id (a perfect
induction head: it answers every probe), and a model that never looks back (it answers none)."""

import pytest
import torch

from harness.core import recall

TEXT = torch.arange(3_000) % 97  # "text": ids 0 .. 96, repeating
IDS = torch.arange(1_000, 2_000)  # planted ids: never in the text


class Induction(torch.nn.Module):
    """Logits that put all their mass on the id that followed the last earlier showing of the current id (or 0)."""

    def forward(self, x):
        B, T = x.shape
        out = torch.zeros(B, T, 2_100)
        for b in range(B):
            last = {}
            for t in range(T):
                tok = int(x[b, t])
                if tok in last:
                    out[b, t, int(x[b, last[tok] + 1])] = 1.0
                last[tok] = t
        return out


class Blind(torch.nn.Module):
    def forward(self, x):
        return torch.zeros(*x.shape, 2_100)


@pytest.mark.parametrize("bos", [None, 2_050])
def test_a_needle_sits_at_its_depth_and_its_value_is_what_is_scored(bos):
    lead = bos is not None
    for depth in (0.0, 0.5, 1.0):
        p = recall.needle(TEXT, IDS, 200, depth, seed=3, bos=bos)
        assert len(p.seq) == 200 and (p.seq[0] == bos if lead else True)
        kv = p.seq[-16:]
        assert (kv >= 1_000).all() and p.scored == list(range(192, 200))  # the value: the last 8 ids
        planted = [t for t in range(lead, 200 - 16) if p.seq[t] >= 1_000]
        room = 200 - lead - 32
        assert planted == list(range(lead + round(depth * room), lead + round(depth * room) + 16))
        assert torch.equal(p.seq[planted[0]:planted[0] + 16], kv)
    assert recall.accuracy(Induction(), [recall.needle(TEXT, IDS, 200, d, seed=int(d * 10)) for d in (0.1, 0.9)]) == \
        [1.0, 1.0]
    assert recall.accuracy(Blind(), [recall.needle(TEXT, IDS, 200, 0.5, seed=1)]) == [0.0]


def test_a_far_copy_has_its_gap_of_text_and_scores_the_second_showing_after_its_first():
    seed = next(s for s in range(100)  # a span of 10 distinct ids (the oracle copies from an id's last showing)
                if len(set(recall.far_copy(TEXT, IDS, n=10, gap=50, seed=s).seq[:10].tolist())) == 10)
    p = recall.far_copy(TEXT, IDS, n=10, gap=50, seed=seed, bos=7)
    assert len(p.seq) == 1 + 10 + 50 + 10 and torch.equal(p.seq[1:11], p.seq[-10:])
    assert (p.seq[11:61] < 1_000).all() and p.scored == list(range(62, 71))
    assert recall.accuracy(Induction(), [p]) == [1.0]


def test_recall_plants_every_pair_apart_and_asks_each_once():
    seed = next(s for s in range(200)  # 96 distinct planted ids (the oracle copies from an id's last showing)
                if len(set(recall.recall(TEXT, IDS, 600, 6, seed=s).seq[-96:].tolist())) == 96)
    p = recall.recall(TEXT, IDS, 600, pairs=6, seed=seed)
    asked = p.seq[-6 * 16:].view(6, 16)
    context = p.seq[:-6 * 16]
    starts = [t for t in range(len(context)) if context[t] >= 1_000 and (t == 0 or context[t - 1] < 1_000)]
    assert len(starts) == 6  # six pairs, none touching another
    planted = sorted(tuple(context[s:s + 16].tolist()) for s in starts)
    assert planted == sorted(tuple(a.tolist()) for a in asked)  # every pair asked once
    assert p.scored == [600 - 96 + j * 16 + 8 + v for j in range(6) for v in range(8)]  # the values
    assert recall.accuracy(Induction(), [p]) == [1.0] and recall.accuracy(Blind(), [p]) == [0.0]
    assert recall.recall(TEXT, IDS, 600, 6, seed=seed).seq.tolist() == p.seq.tolist()  # seeded


def test_what_does_not_fit_is_one_line():
    with pytest.raises(ValueError, match="needs depth in \\[0, 1\\] and L >= 33"):
        recall.needle(TEXT, IDS, 20, 0.5, seed=0)
    with pytest.raises(ValueError, match="16 pairs of 16 ids and their questions need L >= 513"):
        recall.recall(TEXT, IDS, 400, 16, seed=0)
    with pytest.raises(ValueError, match="the text holds 3,000 ids; a context of 5,000"):
        recall.needle(TEXT, IDS, 5_000, 0.5, seed=0)

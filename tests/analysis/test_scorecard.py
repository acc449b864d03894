"""harness.analysis.papers.scorecard: Holm's step-down correction over a scorecard's claims, on claims whose
p-values are known (each decided exactly when its level's alpha reaches its p-value), against Holm's procedure
written out from its definition; and on a preset's own runs, where a claim decided at 95% that Holm's level cannot
decide turns inconclusive while sanity rows stay out of the family."""

import numpy as np
import pytest

from harness.analysis import intervals, papers
from harness.analysis.papers import ClaimRow, scorecard
from tests.helpers import untested_cases
from tests.helpers.claims import N_TEXTS, judged, kivi_sweep, positions_of, streaming_sweep

# python -m harness.scorecard's refusals (docs/faults.md lists the ids): each one line, exit 2, nothing written
CASES = [
    ("scorecard-leave-out-bad", "--leave-out 3-1 or x: one line naming what a range of paragraphs is"),
    ("scorecard-not-a-folder", "a sweep folder that does not exist: one line"),
    ("scorecard-out-not-ours", "--out naming a file kvlab did not write, or in a missing folder: refused, untouched"),
    ("scorecard-leave-out-unrecorded", "--leave-out on runs that recorded no drift_text_paragraphs: one line"),
]


def test_every_case_has_a_test():
    assert not untested_cases(__file__, CASES)


HOLDS, FAILS, UNSURE = intervals.HOLDS, intervals.FAILS, intervals.INCONCLUSIVE


def known(p: float, direction: str = HOLDS, kind: str = papers.PAPER) -> ClaimRow:
    """A claim whose intervals decide it (``direction``) at every level 1 - alpha with alpha >= p."""
    decide = lambda level: direction if 1 - level >= p else UNSURE  # noqa: E731
    return ClaimRow("c", "s", "q", "ps", "pn", kind, "kl", "—", "—", decide(0.95), (), decide=decide)


def holm_by_definition(ps: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm (1979): sort the p-values; reject H_(k) while p_(k) <= alpha / (m - k + 1), stopping at the first that
    is not."""
    order, m = np.argsort(ps, kind="stable"), len(ps)
    rejected = [False] * m
    for k, i in enumerate(order):
        if ps[i] > alpha / (m - k):
            break
        rejected[i] = True
    return rejected


@pytest.mark.parametrize("seed", range(20))
def test_the_scorecard_is_holms_procedure(seed):
    rng = np.random.default_rng(seed)
    ps = list(rng.choice([1e-5, 0.002, 0.006, 0.011, 0.02, 0.04, 0.3], size=int(rng.integers(1, 9))))
    rows = scorecard([known(p, FAILS if i % 3 == 0 else HOLDS) for i, p in enumerate(ps)], "made up")
    want = holm_by_definition(ps)
    assert [r.adjusted != UNSURE for r in rows] == want, ps
    assert all(r.adjusted == r.verdict for r, w in zip(rows, want) if w)  # a decided claim keeps its direction


def test_only_claims_with_a_verdict_are_the_family():
    """A sanity row (by construction), a row not judged and a row with nothing to judge are outside it: the family
    is the two claims, and a p of 0.03 survives two tests (0.05 / 1 after the first); among four, with one of 0.04
    left beside it at the second step (0.05 / 2), neither does."""
    sanity = known(1e-9, kind=papers.CONSTRUCTION)
    unjudged = papers.dataclasses.replace(known(1e-9), not_judged="the runs have dtype bf16")
    nothing = papers.dataclasses.replace(known(1e-9), verdict=None)
    rows = scorecard([known(0.001), known(0.03), sanity, unjudged, nothing], "made up")
    assert [r.adjusted for r in rows] == [HOLDS, HOLDS, None, None, None]
    assert rows[0].family == "2 claims: made up; Holm's step-down, 5% family-wise" and rows[2].family == ""
    four = scorecard([known(0.001), known(0.03), known(0.04), known(0.001)], "made up")
    assert [r.adjusted for r in four] == [HOLDS, UNSURE, UNSURE, HOLDS]


def test_a_marginal_claim_turns_inconclusive_on_a_presets_runs():
    """StreamingLLM's six claims on a model trained with a sink: "one or two are not enough", decided at 95% by a
    share of the gap 1 sink leaves whose interval barely clears the 10% margin ([+10.0%, +15.0%]), is inconclusive
    once Holm widens its intervals (to 97.5%: "four are enough" is undecided beside it); the clear claims stay
    decided; the copy row (by construction) is in no family."""
    runs = streaming_sweep([2.0, 0.64, 0.7, 0.4, 0.24], first_token=50256, first_token_share=0.6)
    rows = judged(runs, noise=0.2)
    assert rows[2].verdict == HOLDS and rows[2].adjusted == UNSURE, rows[2].our_number
    assert rows[0].verdict == rows[0].adjusted == HOLDS
    assert rows[4].kind == papers.CONSTRUCTION and rows[4].adjusted is None
    assert rows[0].family.startswith("5 claims: experiment=paper_streamingllm's claims judged")


def test_sanity_rows_show_what_they_gave_and_why_they_cannot_fail():
    rows = judged(kivi_sweep())
    sanity = [r for r in rows if r.kind == papers.CONSTRUCTION]
    assert len(sanity) == 2 and all(papers.verdict_text(r) == "by construction (holds)" for r in sanity)
    assert "K per channel must win" in sanity[0].why_fixed and "V per token must lose" in sanity[1].why_fixed
    assert all(r.adjusted is None for r in sanity) and rows[0].family.startswith("2 claims:")


# ---- python -m harness.scorecard: over sweeps written as runs write them -----------------------------------------

def _write_sweep(root, runs, positions, paragraphs=True):
    """Each run's results.json and per-position tables, as a run writes them; its texts span paragraphs t+1 (text t)
    when ``paragraphs``, or nothing recorded."""
    from harness.experiment import tracking
    for _, r in runs.iterrows():
        rec = {k: v for k, v in r.items() if not (isinstance(v, float) and np.isnan(v))}
        rec.update(group=root.name, config_id=rec["run_name"], device="cpu", measurements="text_drift,retrieval")
        if paragraphs:
            rec["drift_text_paragraphs"] = ";".join(str(t + 1) for t in range(N_TEXTS))
        tables = {name: df[df.run_name == rec["run_name"]].drop(columns="run_name") for name, df in positions.items()
                  if len(df)}
        tracking.write_run_files(root / rec["run_name"], rec, tracking.with_identity(tables, rec))


@pytest.mark.slow  # seconds: not in make test-fast
def test_the_command_corrects_several_presets_as_one_family(tmp_path, capsys):
    from harness.analysis import scorecard
    sink = streaming_sweep([2.0, 0.8, 0.7, 0.4, 0.39], first_token=50256, first_token_share=0.6)
    kivi = kivi_sweep()
    _write_sweep(tmp_path / "streaming", sink, positions_of(sink))
    _write_sweep(tmp_path / "kivi", kivi, positions_of(kivi))
    assert scorecard.main([str(tmp_path / "streaming"), str(tmp_path / "kivi")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Family: 7 claims: the claims of paper_streamingllm, paper_kivi; Holm's step-down")
    assert "| paper_kivi: K wants a scale per channel | mini |" in out and f"| {N_TEXTS} texts |" in out
    assert out.splitlines()[-1].endswith("| by construction (holds) | — |")  # sanity rows last, outside it
    # five paragraphs left out: five texts fewer, in every claim that reads texts
    assert scorecard.main([str(tmp_path / "streaming"), "--leave-out", "1-3,7,9", "--out",
                           str(tmp_path / "card.md")]) == 0
    card = (tmp_path / "card.md").read_text()
    assert card.startswith(scorecard.MARKER) and f"| {N_TEXTS - 5} texts |" in card and f"| {N_TEXTS} texts |" not in card
    assert "leaving out the texts of paragraphs 1-3, 7, 9" in card
    assert scorecard.main([str(tmp_path / "streaming"), "--out", str(tmp_path / "card.md")]) == 0  # its own: replaced


@pytest.mark.parametrize("args, said", [
    (["{tmp}/streaming", "--leave-out", "3-1"], "--leave-out '3-1': 3-1 is no range of paragraphs"),
    (["{tmp}/streaming", "--leave-out", "x"], "--leave-out 'x': give paragraph numbers and ranges"),
    (["{tmp}/nothing"], "{tmp}/nothing: no such folder"),
    (["{tmp}/streaming", "--out", "{tmp}/theirs.md"], "a file kvlab did not write"),
    (["{tmp}/streaming", "--out", "{tmp}/no/card.md"], "folder {tmp}/no does not exist"),
    (["{tmp}/bare", "--leave-out", "1"], "recorded no drift_text_paragraphs"),
    (["{tmp}/streaming", "--bogus"], "unrecognized arguments: --bogus (see python -m harness.scorecard --help)"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, said):
    # scorecard-leave-out-bad, scorecard-not-a-folder, scorecard-out-not-ours, scorecard-leave-out-unrecorded
    from harness.analysis import scorecard
    sink = streaming_sweep(SINK, first_token=50256, first_token_share=0.6)
    _write_sweep(tmp_path / "streaming", sink, positions_of(sink))
    _write_sweep(tmp_path / "bare", sink, positions_of(sink), paragraphs=False)
    (tmp_path / "theirs.md").write_text("mine\n")
    assert scorecard.main([a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and said.format(tmp=tmp_path) in err, err
    assert (tmp_path / "theirs.md").read_text() == "mine\n"


SINK = [2.0, 0.8, 0.7, 0.4, 0.39]


def test_the_overlap_probe_names_paragraphs_the_scorecard_takes(capsys):
    """scripts/probes/overlap_probe.py: a chapter's 8-grams counted as the docs state (8 words make one 8-gram, 9
    make two), and its last line an argument --leave-out parses into held-out paragraphs (1 .. 60)."""
    from harness.analysis import scorecard
    from scripts.probes import overlap_probe

    assert overlap_probe.grams("In the beginning God created the heaven and the earth", 8)[1] == tuple(
        "the beginning god created the heaven and the".split())
    assert len(overlap_probe.grams("a b c d e f g h i", 8)) == 2 and overlap_probe.grams("a b", 8) == []
    assert overlap_probe.main([]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    left = scorecard.paragraphs(last.split("--leave-out ")[1])
    assert left and all(1 <= p <= 60 for p in left)

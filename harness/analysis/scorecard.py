"""The scorecard over several paper presets' sweeps: every claim they judge, one family, Holm-corrected together.

A preset's findings.md corrects its own claims for their number; a page that sets several presets' verdicts side by
side (docs/reference-model.md's scorecard) is a larger family, and is corrected as one here. ``--leave-out`` judges
the same runs again without the texts that touch some paragraphs of the prompts file (the held-out chapters whose
word 8-grams also occur in training: ``scripts/probes/overlap_probe.py`` names them), so a reader can see whether a
verdict rests on them.

    python -m harness.scorecard outputs/paper_streamingllm outputs/paper_kivi ...        # the table, on stdout
    python -m harness.scorecard SWEEP... --leave-out 5,11,17-20 --out scorecard.md       # without those paragraphs

    from harness.analysis import scorecard
    rows = scorecard.rows([Path("outputs/paper_kivi")], leave_out={17, 18})

Pure but for reading the sweeps' results and writing ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pandas as pd

from harness.analysis import papers, results
from harness.analysis.papers import ClaimRow
from harness.common import ownership
from harness.common.errors import one_line

TEXTS = "text_positions"
PARAGRAPHS = "drift_text_paragraphs"


class ScorecardError(ValueError):
    """Bad input: one line, exit code 2."""


def paragraphs(text: str) -> set[int]:
    """'5,11,17-20' -> {5, 11, 17, 18, 19, 20} (paragraphs of the prompts file, from 1). Raises ScorecardError."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        a, _, b = part.partition("-")
        try:
            lo, hi = int(a), int(b or a)
        except ValueError:
            raise ScorecardError(f"--leave-out {text!r}: give paragraph numbers and ranges, e.g. 5,11,17-20") from None
        if not 1 <= lo <= hi or hi - lo > 1_000_000:
            raise ScorecardError(f"--leave-out {text!r}: {part} is no range of paragraphs (from 1, low to high)")
        out.update(range(lo, hi + 1))
    if not out:
        raise ScorecardError(f"--leave-out {text!r}: name at least one paragraph, e.g. 5,11,17-20")
    return out


def spans(record) -> list[tuple[int, int]]:
    """A run's ``drift_text_paragraphs`` ('3-4;7') as (first, last) per text, in text order."""
    out = []
    for part in str(record).split(";"):
        a, _, b = part.partition("-")
        out.append((int(a), int(b or a)))
    return out


def leave_out(runs: pd.DataFrame, frames: dict, left: set[int]) -> dict:
    """``frames`` without the text rows of any text that spans a paragraph in ``left`` (each run's texts, as its
    ``drift_text_paragraphs`` records them). Raises ScorecardError for a run that scored texts but recorded none."""
    texts = frames.get(TEXTS)
    if texts is None or not len(texts):
        return frames
    drop = []
    for _, run in runs.iterrows():
        name = run.get("run_name")
        if not (texts["run_name"] == name).any():
            continue
        record = run.get(PARAGRAPHS)
        if record is None or (isinstance(record, float) and pd.isna(record)):
            raise ScorecardError(f"run {name} recorded no {PARAGRAPHS} (the paragraphs its texts span): it cannot "
                                 "be judged without some of them; run it again")
        drop += [(name, i) for i, (a, b) in enumerate(spans(record)) if any(a <= p <= b for p in left)]
    keys = pd.MultiIndex.from_frame(texts[["run_name", "text"]])
    return {**frames, TEXTS: texts[~keys.isin(drop)]}


def rows(sweeps: list[Path], leave: set[int] | None = None) -> list[ClaimRow]:
    """Every claim the sweeps' paper presets judge (``papers.claim_rows``), with Holm's correction over all of them
    at once (``papers.scorecard``); ``leave``: paragraphs whose texts are left out first."""
    out, presets = [], []
    for sweep in sweeps:
        runs = results.load_runs(sweep)
        frames = results.load_tables(sweep)
        if leave:
            frames = leave_out(runs, frames, leave)
        found = papers.claim_rows(runs, frames)
        if not found:
            raise ScorecardError(f"{sweep}: no paper preset's runs here (experiment=paper_...): give the folders of "
                                 "paper presets' sweeps")
        preset = papers.preset_of(runs)
        presets.append(preset)
        models = sorted(set(papers.ok_runs(runs).get("model", pd.Series(dtype=object)).dropna().map(papers.base_model)))
        out += [dataclasses.replace(r, claim=f"{preset}: {r.claim}", model=r.model or ", ".join(models))
                for r in found]
    words = f"the claims of {', '.join(dict.fromkeys(presets))}" + (f", leaving out the texts of paragraphs {compact(leave)}"
                                                      if leave else "")
    return papers.scorecard(out, words)


def compact(ps: set[int]) -> str:
    """{5, 11, 17, 18, 19} -> '5, 11, 17-19'."""
    out, run = [], []
    for p in sorted(ps):
        if run and p == run[-1] + 1:
            run.append(p)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
        run = [p]
    out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
    return ", ".join(out)


def markdown(found: list[ClaimRow]) -> str:
    """The scorecard as a markdown table: each claim on each model, kvlab's number, n, the claim's own verdict and
    the verdict after Holm; sanity rows (by construction) last, outside the family."""
    family = next((r.family for r in found if r.family), "")
    head = ["claim", "model", "paper", "kvlab", "n", "verdict", "after Holm"]
    lines = [f"Family: {family}." if family else "No claim has a verdict: nothing to correct.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(found, key=lambda r: r.kind == papers.CONSTRUCTION)  # stable: sanity rows last
    for r in order:
        cells = [r.claim, r.model or "—", r.paper_number, r.our_number, r.n or "—", papers.verdict_text(r),
                 papers.adjusted_text(r)]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


MARKER = "<!-- written by python -m harness.scorecard: kvlab replaces this file, and only files with this line -->"
PROG = "python -m harness.scorecard"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise ScorecardError(f"{message} (see {PROG} --help)")


def out_path(text: str) -> Path:
    """The file ``--out`` writes: new, or one this command wrote (its first line ``MARKER``), in a folder that
    exists; else ScorecardError, before anything is read."""
    path = Path(text)
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise ScorecardError(f"--out {text}: not a regular file: give the markdown file to write, e.g. scorecard.md")
    if not path.parent.is_dir():
        raise ScorecardError(f"--out {text}: folder {path.parent} does not exist: give a file in an existing folder")
    if path.exists():
        with open(path, "rb") as f:
            head = f.read(4096).splitlines()[:1]
        if head != [MARKER.encode()]:
            raise ScorecardError(f"--out {text}: a file kvlab did not write (its first line is not {PROG}'s "
                                 "marker); kvlab replaces only its own files: give a new file")
    return path


def main(argv=None) -> int:
    ap = _Parser(prog=PROG, description="The paper presets' claims over several sweeps, Holm-corrected as one "
                                        "family.")
    ap.add_argument("path", nargs="+", help="a paper preset's sweep folder (experiment=paper_...), one or more")
    ap.add_argument("--leave-out", help="paragraphs of the prompts file (from 1) whose texts are left out: 5,11,17-20")
    ap.add_argument("--out", help="write the table to this markdown file (default: print it)")
    try:
        args = ap.parse_args(argv)
        leave = paragraphs(args.leave_out) if args.leave_out is not None else None
        out = out_path(args.out) if args.out else None
        for p in args.path:
            if not Path(p).is_dir():
                raise ScorecardError(f"{p}: no such folder (give a paper preset's sweep folder)")
        text = markdown(rows([Path(p) for p in args.path], leave))
        if out is not None:
            ownership.atomic_write(out, f"{MARKER}\n{text}".encode())
            print(f"kvlab scorecard: {out}")
        else:
            print(text, end="")
    except (ScorecardError, ownership.NotOurs, OSError) as e:
        print(f"kvlab scorecard: {e if isinstance(e, ScorecardError) else one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

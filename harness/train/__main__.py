"""Train kvlab's small reference GPT-2 ("mini") on CPU, offline, and write it as an HF GPT-2 checkpoint folder.

    python -m harness.train --out models/weights/mini            # the shipped checkpoint (DEFAULT_STEPS steps)
    python -m harness.train --out DIR [--steps N | --minutes M] [--seed S] [--threads T] [--restart]
    python -m harness.train --evaluate DIR [--record]            # the targets table of a checkpoint (no training)
    python -m harness.train --out DIR --family llama             # the Llama-family reference model (mini-llama)
    python -m harness.train --out DIR [--copy-phase F] [--copy-offsets F|none] [--offset-draw uniform|clamped]
                            [--mlp-off F] [--copy-share F]
                            [--placed-share F] [--far-share F] [--deep-draw window|frequency] [--text-spans F]
                            [--needle-share F] [--question-tail F] [--curriculum LEN:SHARE,...|none] [--heads N]

The command line: every number bounded before anything is read or built (one line, exit 2), then ``loop.train`` (or
``targets.evaluate_folder``) inside the one stop-signal protocol (``harness.common.signals``): a stop signal is one
line on stderr and exit 128 + its number, bad input one line and exit 2, a failed write one line and exit 1. Run as
``python -m harness.train``, a stop signal while torch and the rest load (seconds) is one line too: the handler is
installed before anything else is imported.
"""

from __future__ import annotations

import os
import signal
import sys

from harness.common.signals import signal_name


def _stopped_while_starting(signum, frame) -> None:
    """The CLI's stop-signal handler while torch and the rest load (seconds), before --out is even looked at."""
    print(f"interrupted by {signal_name(signum)}: stopped while starting, before --out was read or written; nothing "
          "was saved or changed, run the same command again", file=sys.stderr, flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":  # python -m harness.train: a stop signal while importing is one line too
    for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP):
        if signal.getsignal(_s) is not signal.SIG_IGN:  # one the caller ignores (nohup: SIGHUP) stays ignored
            signal.signal(_s, _stopped_while_starting)

import argparse  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402

import torch  # noqa: E402

from harness.common.signals import Interrupted, stop_signals  # noqa: E402
from harness.train.loop import train  # noqa: E402
from harness.train.recipe import (BATCH, BOS, COPY_OFFSETS, COPY_PHASE, COPY_SHARE, CURRICULUM,  # noqa: E402
                                  DEEP_DRAW, DEFAULT_STEPS, FAMILY_PRESETS, FAR_SHARE, MAX_MINUTES, MAX_STEPS,
                                  MAX_THREADS, MINI_CONFIG, NEEDLE_SHARE, OFFSET_DRAW, QUESTION_TAIL,
                                  MLP_OFF, PLACED_SHARE, SEQ_LEN, SHARE_FLAGS, TEXT_SPANS, WEIGHT_DECAY, TrainError,
                                  check_curriculum, parse_curriculum)
from harness.train.rows import DEEP_DRAWS, OFFSET_DRAWS  # noqa: E402
from harness.train.targets import check_recordable, evaluate_folder, record_targets  # noqa: E402
from models.gpt2 import GPT2Config  # noqa: E402


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The model's flags: its family, the first token, weight decay, heads."""
    p.add_argument("--family", default="gpt2", choices=sorted(FAMILY_PRESETS),
                   help="the decoder family: gpt2 (the mini preset, model=mini) or llama (the mini-llama preset, "
                        "model=mini-llama: rotary positions, 4 query heads over 2 K/V heads)")
    p.add_argument("--bos", action=argparse.BooleanOptionalAction, default=BOS,
                   help="put <|endoftext|> at position 0 of every row, where attention sinks form (default on; "
                        "--no-bos trains as the first mini was)")
    p.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY,
                   help=f"AdamW's weight decay on the matrices (default {WEIGHT_DECAY}, the shipped models'; more "
                        "gives more attention sinks in the literature: 0 .. 1)")
    p.add_argument("--heads", type=int, default=None,
                   help=f"attention heads of the gpt2 family's {MINI_CONFIG['n_embd']}-wide model (default "
                        f"{MINI_CONFIG['n_head']}, the shipped mini's; GPT-2's 64 channels a head; 4 gives 32, see "
                        "docs/reference-model.md)")


def _retrieval_flags(p: argparse.ArgumentParser) -> None:
    """The retrieval rows' flags (issue 66): their share of a batch, the deep copies' draw, the spans' draw."""
    p.add_argument("--far-share", type=float, default=FAR_SHARE,
                   help="share of each batch's rows, after the copy phase, that are retrieval rows in text: a span "
                        "shown twice at any distance, and key-value pairs asked at the end (default "
                        f"{FAR_SHARE}; see docs/reference-model.md)")
    p.add_argument("--deep-draw", default=DEEP_DRAW, choices=sorted(DEEP_DRAWS),
                   help="how half the deep copies (a third of the retrieval rows) draw their ids: 'window', uniformly "
                        "from the vocabulary of a stretch of training text (the mini's recipe), or 'frequency', as the "
                        f"training text uses them (mini-llama's) (default {DEEP_DRAW})")
    p.add_argument("--text-spans", type=float, default=TEXT_SPANS,
                   help="the chance that a random span of the copy and retrieval rows draws its ids from the vocabulary "
                        "of a stretch of training text (words) rather than from every id (default "
                        f"{TEXT_SPANS:g}; see docs/reference-model.md)")
    p.add_argument("--needle-share", type=float, default=NEEDLE_SHARE,
                   help="of the key-value recall rows, the share that hold one pair (a needle) rather than 1 to 16 "
                        f"(default {NEEDLE_SHARE:g}; see docs/reference-model.md)")
    p.add_argument("--question-tail", type=float, default=QUESTION_TAIL,
                   help="text after a recall row's questions, of a length uniform in 0 .. this share of the row, so a "
                        f"row's last positions are not always questions (0 .. 0.5; default {QUESTION_TAIL:g}, the "
                        "questions end the row; see docs/reference-model.md)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="checkpoint folder to write (resumed if it holds a partial run)")
    p.add_argument("--evaluate", metavar="DIR", help="print the targets table of the checkpoint in DIR (no training)")
    p.add_argument("--record", action="store_true",
                   help="with --evaluate: also write the targets measured now into DIR's kvlab_train record (a "
                        "checkpoint kvlab trained)")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"a wall-clock budget of the training loop instead of --steps (not reproducible; more than 0, "
                        f"at most {MAX_MINUTES:,})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"step budget (deterministic; default {DEFAULT_STEPS}, the shipped model's; 1 .. "
                        f"{MAX_STEPS:,})")
    p.add_argument("--seed", type=int, default=0, help="0 <= seed < 2**63")
    p.add_argument("--threads", type=int, default=None,
                   help=f"CPU threads, 1 .. {MAX_THREADS} or the cores if more (default, flag left out: every core; "
                        "fewer can be faster on a machine busy with other work)")
    p.add_argument("--restart", action="store_true", help="discard a partial or finished run in --out, start over")
    p.add_argument("--save-dtype", default="fp16", choices=["fp16", "fp32"],
                   help="dtype of model.safetensors (fp16 keeps mini under 20 MB)")
    p.add_argument("--placed-share", type=float, default=PLACED_SHARE,
                   help="share of the copy rows whose span is shown twice at a random place of a text row instead of "
                        f"repeated from position 0 (default {PLACED_SHARE}, the shipped mini's; see "
                        "docs/reference-model.md)")
    _retrieval_flags(p)
    p.add_argument("--mlp-off", type=float, default=MLP_OFF,
                   help="share of the budget trained attention only, every MLP left out of the forward, so the copy "
                        f"circuit forms before the MLPs join (default {MLP_OFF}, the shipped mini's; see "
                        "docs/reference-model.md)")
    p.add_argument("--copy-phase", type=float, default=COPY_PHASE,
                   help="share of the budget, from the start, whose rows are all random ids with one span shown twice "
                        "at a random place, trained only on the second showing (no text), so a circuit that copies "
                        f"from anywhere forms first (default {COPY_PHASE}, the shipped mini's)")
    p.add_argument("--copy-offsets", default=None, metavar="F|none",
                   help="from this share of the budget until --copy-phase ends, each twice row reads the position "
                        "embeddings from a random start, so the circuit formed in the first positions trains at "
                        f"every position (default {COPY_OFFSETS}, the shipped mini's, when the copy phase is longer; "
                        "none: never)")
    p.add_argument("--offset-draw", default=OFFSET_DRAW, choices=OFFSET_DRAWS,
                   help="how --copy-offsets draws a row's start: 'uniform' over the starts whose row fits (the last "
                        "positions in fewer rows), or 'clamped', uniform over every position with a start past the "
                        "last whole row's moved back to it (the last positions in at least as many rows as the middle "
                        f"ones) (default {OFFSET_DRAW}; see docs/reference-model.md)")
    p.add_argument("--copy-share", type=float, default=COPY_SHARE,
                   help=f"share of each batch's rows that are copy rows after any --copy-phase (default {COPY_SHARE})")
    p.add_argument("--curriculum", default=None, metavar="SPEC",
                   help="row lengths before the full rows: LEN:SHARE pairs of the budget, in order (default "
                        + ",".join(f"{n}:{share:g}" for n, share in CURRICULUM) + ", the shipped mini's), or none")
    _model_flags(p)
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: interrupt after N steps

    def error(message):  # one line, exit 2 (argparse would print the usage first)
        print(f"error: {message} (see python -m harness.train --help)", file=sys.stderr)
        raise SystemExit(2)

    p.error = error
    return p


def _cores() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), os.cpu_count() or 1)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_numbers(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every number of the command line bounded before anything is read or built (one line, exit 2): a count in its
    range, a share a finite number in its interval; NaN and infinity refused by name."""
    cores = _cores()
    most = max(MAX_THREADS, cores)  # more than the cores is allowed (the same --threads reproduces a run bit for bit)
    if args.threads is not None and not 1 <= args.threads <= most:
        p.error(f"--threads {args.threads}: give 1 .. {most:,} (the CPU threads to train with; this machine has "
                f"{cores}; leave the flag out to use every core)")
    if args.steps is not None and not 1 <= args.steps <= MAX_STEPS:
        p.error(f"--steps {args.steps:,}: give 1 .. {MAX_STEPS:,} (the step budget; the shipped model took "
                f"{DEFAULT_STEPS:,})")
    if args.minutes is not None and not (math.isfinite(args.minutes) and 0 < args.minutes <= MAX_MINUTES):
        p.error(f"--minutes {args.minutes:g}: give a number of minutes more than 0 and at most {MAX_MINUTES:,}")
    if args.minutes is not None and args.steps is not None:
        p.error("give one budget: --minutes or --steps, not both")
    if not 0 <= args.seed < 2 ** 63:
        p.error(f"--seed {args.seed}: use an integer 0 <= seed < 2**63")
    for name, (lo, hi, closed) in SHARE_FLAGS.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and lo <= value and (value <= hi if closed else value < hi)):
            p.error(f"--{name.replace('_', '-')} {value:g}: give a share in [{lo:g}, {hi:g}{']' if closed else ')'}")
    if not (math.isfinite(args.weight_decay) and 0 <= args.weight_decay <= 1):
        p.error(f"--weight-decay {args.weight_decay:g}: give a number in [0, 1]")
    if args.stop_after is not None and not 1 <= args.stop_after <= MAX_STEPS:
        p.error(f"--stop-after {args.stop_after}: give 1 .. {MAX_STEPS:,}")


def _restored(handler):
    """What stop_signals puts back on exit: the default for the while-starting handler (done with), else the one
    that was there."""
    return signal.SIG_DFL if handler is _stopped_while_starting else handler


def _evaluate(folder: str, record: bool) -> int:
    """``--evaluate DIR [--record]``: the targets table of a checkpoint, and with --record into its record."""
    if record:
        check_recordable(folder)  # before minutes of measuring
    r, table = evaluate_folder(folder)
    print(table, flush=True)
    if record:
        record_targets(folder, r)
        print(f"wrote the targets into {folder}/config.json (kvlab_train.targets)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = p.parse_args(argv)
        if not args.out and not args.evaluate:
            p.error("give --out DIR to train (or --evaluate DIR to measure a checkpoint)")
        if args.record and not args.evaluate:
            p.error("--record writes what --evaluate DIR measures: give --evaluate DIR with it")
        try:
            curriculum = True if args.curriculum is None else parse_curriculum(args.curriculum)
        except ValueError as e:
            p.error(str(e))
        try:
            copy_offsets = ("default" if args.copy_offsets is None else None
                            if args.copy_offsets.strip().lower() == "none" else float(args.copy_offsets))
        except ValueError:
            p.error(f"--copy-offsets {args.copy_offsets!r}: give a share of the budget (e.g. {COPY_OFFSETS}) or none")
        if args.heads is not None and args.family != "gpt2":
            p.error(f"--heads is the gpt2 family's; the {args.family} family's reference model is its preset's")
        if args.heads is not None and (args.heads < 1 or MINI_CONFIG["n_embd"] % args.heads):
            p.error(f"--heads {args.heads} must divide the model's width {MINI_CONFIG['n_embd']} (e.g. 1, 2, 4, 8)")
        _check_numbers(p, args)
        if copy_offsets not in ("default", None) and not (math.isfinite(copy_offsets) and 0 <= copy_offsets
                                                          < args.copy_phase):
            p.error(f"--copy-offsets {args.copy_offsets}: give a share in [0, --copy-phase {args.copy_phase:g}) or "
                    "none")
        if curriculum not in (True, None):
            try:
                check_curriculum(curriculum, BATCH, SEQ_LEN)
            except TrainError as e:
                p.error(str(e))
    except SystemExit as e:
        return int(e.code or 0)
    command = "python -m harness.train " + " ".join(shlex.quote(a) for a in argv)
    with stop_signals(restore=_restored):  # held until the last line is printed
        try:
            torch.set_num_threads(args.threads or os.cpu_count() or 1)
            if args.evaluate:
                return _evaluate(args.evaluate, args.record)
            train(args.out, minutes=args.minutes, steps=args.steps, seed=args.seed, restart=args.restart,
                  stop_after=args.stop_after, save_dtype=args.save_dtype, command=command, threads=args.threads,
                  placed_share=args.placed_share, mlp_off=args.mlp_off, curriculum=curriculum,
                  copy_phase=args.copy_phase, copy_share=args.copy_share, copy_offsets=copy_offsets,
                  family=args.family, bos=args.bos, weight_decay=args.weight_decay, far_share=args.far_share,
                  deep_draw=args.deep_draw, text_spans=args.text_spans, needle_share=args.needle_share,
                  offset_draw=args.offset_draw, question_tail=args.question_tail,
                  **({} if args.heads in (None, MINI_CONFIG["n_head"]) else  # the default: train()'s own preset
                     {"config": GPT2Config(**{**MINI_CONFIG, "n_head": args.heads})}))
        except TrainError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Interrupted as e:
            print(f"interrupted by {e.message}", file=sys.stderr)
            return e.exit_code
        except OSError as e:  # e.g. the disk filled up while saving: what was written before is intact
            print(f"error: cannot write {e.filename or args.out}: {e.strerror or e}; free space or give another "
                  "--out", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

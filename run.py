"""kvlab's entry point: compose the Hydra config, run one experiment (or a sweep with -m), exit non-zero if any run
of this invocation did not end ok (read from the runs' own results.json files).

    python run.py                                          # gpt2 size, prealloc cache, fp32, quick preset
    python run.py -m cache=concat,prealloc dtype=fp32,fp16 # a sweep: four runs, then a report in the sweep folder
    python run.py model=mini -m dtype=fp32,fp16,bf16       # -m may come after overrides
"""

import sys

import hydra
from omegaconf import DictConfig

from harness.config import register
from harness.experiment import catch_signals, forget_invocation, interruption, invocation_failures, new_invocation, run

register()


def flags_first(argv: list[str]) -> list[str]:
    """``-m``/``--multirun`` anywhere on the line, as users type it (``python run.py model=mini -m dtype=fp32,fp16``):
    Hydra's parser takes it only before the overrides, so it is moved there."""
    flags = [a for a in argv[1:] if a in ("-m", "--multirun")]
    return argv[:1] + flags + [a for a in argv[1:] if a not in ("-m", "--multirun")]


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    return run(cfg)


if __name__ == "__main__":
    sys.argv = flags_first(sys.argv)
    new_invocation()  # this invocation's id (never a parent's), inherited by every job a launcher starts
    catch_signals()  # SIGTERM, SIGHUP, SIGUSR2 end it as Ctrl-C does: a record, one line, exit 128 + n
    try:
        main()
    except KeyboardInterrupt as e:
        what, code = interruption(e)
        print(f"kvlab: interrupted ({what}); finished runs are complete on disk, and the same command resumes",
              file=sys.stderr)
        forget_invocation()
        sys.exit(code)
    except SystemExit:  # a run stopped by a signal, or an outputs folder that cannot be written
        forget_invocation()
        raise
    failures = invocation_failures()
    forget_invocation()
    for line in failures:
        print(f"kvlab: not ok: {line}", file=sys.stderr)
    sys.exit(1 if failures else 0)

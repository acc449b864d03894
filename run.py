"""kvlab's entry point: compose the Hydra config, run one experiment (or a sweep with -m), exit non-zero if any run
of this invocation did not end ok (read from the runs' own results.json files).

    python run.py                                          # gpt2 size, prealloc cache, fp32, quick preset
    python run.py -m cache=concat,prealloc dtype=fp32,fp16 # a sweep: four runs, then a report in the sweep folder
    python run.py model=mini -m dtype=fp32,fp16,bf16       # -m may come after overrides

A stop signal while it starts (torch and Hydra load for seconds) is one line, exit 128 + n: nothing is written that
early. A sweep through a Slurm launcher (``-m hydra/launcher=slurm``, ``slurm_cpu``) first checks that Slurm answers
(harness/experiment/slurm_check.py) and, if not, says what is missing in one line, exit 2, before any folder is made. A Slurm job that ends without returning a result (killed while it starts, say) fails its
run in one line and the sweep goes on (harness/experiment/slurm_jobs.py).
"""

import os
import signal
import sys

STARTING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)


def _stopped_while_starting(signum, frame) -> None:
    """A stop signal before the run's own handlers are in place (imports, the Slurm check): nothing is written yet."""
    print(f"kvlab: interrupted ({signal.Signals(signum).name}) while starting; nothing was written", file=sys.stderr,
          flush=True)
    os._exit(128 + signum)


def _while_starting() -> dict:
    """Install the start-up handler for every stop signal not ignored (nohup's SIGHUP stays ignored) and not taken
    by a handler installed before this process ran Python code of its own; returns the handlers it replaced."""
    replaced = {}
    for s in STARTING:
        current = signal.getsignal(s)
        if current in (signal.SIG_DFL, signal.default_int_handler, None):
            replaced[s] = signal.signal(s, _stopped_while_starting)
    return replaced


def flags_first(argv: list[str]) -> list[str]:
    """``-m``/``--multirun`` anywhere on the line, as users type it (``python run.py model=mini -m dtype=fp32,fp16``):
    Hydra's parser takes it only before the overrides, so it is moved there."""
    flags = [a for a in argv[1:] if a in ("-m", "--multirun")]
    return argv[:1] + flags + [a for a in argv[1:] if a not in ("-m", "--multirun")]


class _BadFlag(Exception):
    pass


def bad_flags(argv: list[str]) -> str | None:
    """What is wrong with the command line's flags, parsed by Hydra's own parser as Hydra will parse them (an unknown
    flag, a flag without its value, two commands at once), in one line; None: nothing. Hydra itself would print its
    usage (an unknown flag) or a traceback (``-m --cfg job``, ``--resolve`` alone)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def error(message):
        raise _BadFlag(message)

    parser.error = error
    try:
        args = parser.parse_args(argv)
    except _BadFlag as e:
        return str(e)
    commands = [name for name, given in (("--run", args.run), ("--multirun", args.multirun),
                                         ("--cfg", args.cfg is not None), ("--shell-completion", args.shell_completion),
                                         ("--info", args.info is not None)) if given]
    if len(commands) > 1:
        return f"{' and '.join(commands)}: give only one of --run, --multirun, --cfg, --info, --shell-completion"
    if args.resolve and args.cfg is None and not args.help:
        return "--resolve goes with --cfg (or --help): it resolves the config that --cfg prints"
    return None


if __name__ == "__main__":
    _REPLACED = _while_starting()
    from harness.experiment.slurm_check import precheck  # the standard library only: before torch and Hydra load

    _refused = precheck(sys.argv[1:])
    if _refused is not None:
        print(_refused, file=sys.stderr, flush=True)
        sys.exit(2)
    _bad = bad_flags(flags_first(sys.argv)[1:])  # Hydra's parser alone: before torch loads
    if _bad is not None:
        print(f"kvlab: {_bad} (see python run.py --help)", file=sys.stderr, flush=True)
        sys.exit(2)

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from harness.common.errors import ConfigError  # noqa: E402
from harness.experiment.config import register  # noqa: E402
from harness.experiment.runner import (  # noqa: E402
    catch_signals, forget_invocation, interruption, invocation_failures, new_invocation, run)
from harness.experiment.slurm_jobs import lost_jobs_are_failures  # noqa: E402

try:
    register()  # the kinds installed packages declare, and cache=external's cache.target classes, loaded here
except ConfigError as _e:  # a target that does not load: one line, before any folder is made
    print(f"kvlab: {_e}", file=sys.stderr, flush=True)
    sys.exit(2)
try:
    from models import cpu_kernels  # noqa: E402

    cpu_kernels.mode_now()  # KVLAB_KERNELS read (and the kernels found) before any folder is made
except ValueError as _e:
    print(f"kvlab: {_e}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    return run(cfg)


if __name__ == "__main__":
    sys.argv = flags_first(sys.argv)
    # the run's own handlers take over with the signals held, so that none lands between the two
    signal.pthread_sigmask(signal.SIG_BLOCK, STARTING)
    for _s, _old in _REPLACED.items():
        signal.signal(_s, _old)
    new_invocation()  # this invocation's id (never a parent's), inherited by every job a launcher starts
    catch_signals()  # SIGTERM, SIGHUP, SIGUSR2 end it as Ctrl-C does: a record, one line, exit 128 + n
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTING)  # one that arrived meanwhile is delivered now
        with lost_jobs_are_failures():  # a Slurm job that ends without a result fails its run, not the sweep
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

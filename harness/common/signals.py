"""The one stop-signal protocol of kvlab: a run (``harness.experiment``) and training (``harness.train``) stop the
same way on SIGINT (Ctrl-C), SIGTERM (what Slurm sends on pre-emption), SIGUSR2 (submitit's) and SIGHUP.

- A stop signal raises ``Interrupted`` (a KeyboardInterrupt, so ``except Exception`` never hides it) carrying the
  signal's number; its exit code is 128 + that number (130, 143, 140, 129), its message one line.
- ``stop_signals()`` installs the handler for a block; ``catch_signals()`` for the rest of the process (SIGINT stays
  Python's own KeyboardInterrupt there). A signal the process ignores (nohup's SIGHUP) stays ignored.
- ``Stop.defer``: while True, the first signal is noted (``Stop.signum``) and work goes on to a safe point, where
  the caller checks ``Stop.signum``; ``Stop.stopping``: once the caller handles a stop, later signals change nothing.
- ``held_signals()`` notes the signals that arrive during a block that must be written whole (a run's record) and
  leaves stopping to the caller after it; ``blocked()`` holds them at the kernel (a file saved whole), delivering
  them when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2, signal.SIGHUP)
CAUGHT = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)  # what catch_signals takes (SIGINT is Python's already)


def signal_name(signum: int) -> str:
    """"SIGINT (Ctrl-C)" or the signal's own name."""
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


class Interrupted(KeyboardInterrupt):
    """A stop signal: ``signum``, ``exit_code`` (128 + signum) and ``message`` (one line; the signal's name unless the
    stopped work says what it saved)."""

    def __init__(self, signum: int, message: str | None = None):
        signum = int(signum)
        message = message or signal.Signals(signum).name
        super().__init__(message)
        self.signum, self.exit_code, self.message = signum, 128 + signum, message


def interruption(e: KeyboardInterrupt) -> tuple[str, int]:
    """(what stopped the work, for people; the exit code: 128 + the signal's number). Ctrl-C without a handler is
    SIGINT."""
    n = int(getattr(e, "signum", signal.SIGINT))
    return ("Ctrl-C" if n == signal.SIGINT else signal.Signals(n).name), 128 + n


class Stop:
    """The state of the stop protocol (one per process: signals reach the main thread only)."""

    signum: int | None = None  # the first stop signal received
    defer: bool = False  # True while work runs to a safe point: the first signal waits for it
    stopping: bool = False  # True once the caller handles a stop: later signals change nothing

    @classmethod
    def reset(cls) -> None:
        cls.signum, cls.defer, cls.stopping = None, False, False


def raise_interrupted(signum, frame) -> None:
    """The stop handler: note the first signal; raise ``Interrupted`` unless the work defers it or already stops."""
    first = Stop.signum is None
    if first:
        Stop.signum = int(signum)
    if Stop.stopping or (first and Stop.defer):
        return
    raise Interrupted(signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_signals(restore=None):
    """While inside, every stop signal raises ``Interrupted`` (``Stop`` reset on entry and exit). Outside the main
    thread this changes nothing (Ctrl-C stays a KeyboardInterrupt). ``restore(old handler)``: the handler to put back
    on exit (default: the one that was there)."""
    Stop.reset()
    old = {}
    if _main_thread():
        old = {s: signal.signal(s, raise_interrupted) for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, restore(handler) if restore else handler)
        Stop.reset()


def catch_signals(keep=None) -> None:
    """SIGTERM, SIGHUP and SIGUSR2 raise ``Interrupted`` in this process from now on, as SIGINT raises
    KeyboardInterrupt. A signal another handler already takes (a launcher's) is left to it, unless ``keep(signum,
    handler)`` returns a handler to install instead (``harness.experiment.runner``: submitit's, in a Slurm job)."""
    if not _main_thread():
        return
    for s in CAUGHT:
        current = signal.getsignal(s)
        chosen = keep(s, current) if keep else None
        if chosen is not None:
            signal.signal(s, chosen)
        elif current in (signal.SIG_DFL, None):
            signal.signal(s, raise_interrupted)


def ignore_signals() -> None:
    """Every stop signal ignored from now on: a second signal must not cut in half what the first one's handling
    writes."""
    if _main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


@contextlib.contextmanager
def held_signals():
    """The stop signals that arrive during the block are noted in the list it yields, not acted on, so what the
    block writes is written whole; the caller stops after it."""
    pending: list[int] = []
    if not _main_thread():
        yield pending
        return
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in before:
        if before[s] is not signal.SIG_IGN:
            signal.signal(s, lambda n, f: pending.append(n))
    try:
        yield pending
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@contextlib.contextmanager
def blocked():
    """Stop signals wait at the kernel until the block is done (a file is written whole, or not at all)."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    except (AttributeError, OSError, ValueError):
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def reader_gone() -> int:
    """stdout's reader went away (``| head``): the rest of a command's output goes nowhere, quietly; the exit status
    is a Unix tool's that SIGPIPE stopped (128 + 13). The tools call it on a BrokenPipeError."""
    with contextlib.suppress(OSError, ValueError):  # (pytest's captured stdout has no descriptor)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE

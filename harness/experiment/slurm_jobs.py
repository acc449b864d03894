"""A Slurm job that ends without returning (killed before kvlab's run began, by a signal that came while Python was
still importing, the out-of-memory killer, a node that failed, or a run that ended its process on a signal after
recording it) is one failure of its sweep, not the sweep's end.

Hydra's submitit launcher waits for each job in turn with submitit's ``Job.results()``, which raises for a job that
left no result: the sweep would stop there with some 30 lines of traceback, no report, and the later jobs' results
never read. Around the sweep (run.py), ``lost_jobs_are_failures`` has such a job return a failed result instead:
one line on stderr naming the job, its overrides and the last line of its error stream; the failure noted for the
invocation's exit code (``invocation_failures``); and the sweep goes on to its other jobs and its report. The run
has no complete results.json, so the same command measures it again.
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

from harness.common import signals
from harness.experiment.invocation import note_failure


def _last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip() and not set(line.strip()) <= {"-"}]
    return lines[-1] if lines else "no error output"


def lost_job_line(job, error: BaseException) -> str:
    """One line for a job without a result: its id, the overrides it ran, and the last line submitit read of why."""
    try:
        overrides = " ".join(job.submission().args[0])
    except Exception:  # the submission file is gone or unreadable: the job id alone names it
        overrides = "overrides unknown"
    return (f"Slurm job {job.job_id} ({overrides}) ended without returning a result: {_last_line(error)} "
            "(its run has no complete results.json unless it recorded why; the same command runs it again)")


@contextmanager
def lost_jobs_are_failures():
    """While the sweep runs, a submitit job that raises instead of returning is a failed result (see the module)."""
    try:
        from hydra.core.utils import JobReturn, JobStatus
        from submitit.core.core import Job
    except ImportError:  # no submitit launcher installed: nothing to guard
        yield
        return
    waited = Job.results

    def results(self):
        try:
            return waited(self)
        except Exception as e:
            line = lost_job_line(self, e)
            print(f"kvlab: {line}", file=sys.stderr, flush=True)
            note_failure(line)
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=dict(status="failed", error=line))]

    Job.results = results
    try:
        yield
    finally:
        Job.results = waited


class OutOfTime(RuntimeError):
    """The Slurm job reached its time limit and will not be requeued again: the run failed, and says why."""


def _submitits(handler) -> bool:
    """The handler is one submitit installed in a Slurm job (its SignalHandler's methods)."""
    return type(getattr(handler, "__self__", None)).__module__.startswith("submitit")


def _after_submitit(inner):
    """submitit's handler of SIGUSR2 (Slurm's warning before the time limit), kept: it requeues the job (then
    raises SystemExit) or says why it will not (raises an error). Requeued: the run is interrupted, and the requeued
    job measures it again. Not requeued: the run failed, out of time, and its record says so."""
    def handler(signum, frame):
        try:
            inner(signum, frame)
        except SystemExit:
            raise signals.Interrupted(signum) from None
        except Exception as e:
            job = slurm_record()["slurm_job_id"]
            raise OutOfTime(f"Slurm job {job} reached its time limit (hydra.launcher.timeout_min) after being "
                            f"requeued {os.environ.get('SLURM_RESTART_COUNT', '0')} time(s) "
                            f"(hydra.launcher.max_num_timeout): {' '.join(str(e).split())}") from None

    return handler


def _submitit_kept(s, current):
    """In a Slurm job, submitit's handlers: its SIGTERM handler ignores the signal (so scancel and scontrol requeue
    would kill the run unrecorded a few seconds later): kvlab takes SIGTERM over; its SIGUSR2 handler (the time
    limit) is kept, and what it does is recorded (``_after_submitit``)."""
    if not _submitits(current):
        return None
    return _after_submitit(current) if s == signal.SIGUSR2 else signals.raise_interrupted


def catch_signals() -> None:
    """SIGTERM, SIGHUP and SIGUSR2 raise ``Interrupted`` in this process (``harness.common.signals``), submitit's
    handlers in a Slurm job taken over or kept (``_submitit_kept``)."""
    signals.catch_signals(_submitit_kept)


def slurm_record() -> dict:
    """The Slurm job this process runs in (None outside Slurm): an array task as ``<array job>_<task>``, as sacct
    and scancel name it."""
    env = os.environ
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else env.get("SLURM_JOB_ID")
    return dict(slurm_job_id=job, slurm_array_task_id=int(task) if task and task.isdigit() else None)

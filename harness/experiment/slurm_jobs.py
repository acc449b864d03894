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

import sys
from contextlib import contextmanager

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

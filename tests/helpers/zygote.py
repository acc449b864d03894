"""``python run.py ARGS`` without paying for Python's start and torch's import each time: a process per pytest
worker (the zygote) imports the libraries every run imports first (torch, numpy, pandas, Hydra: about 1.7 s of
the 2.2 s a run.py spends before its first line of kvlab) and forks a child per call. The child is then what
``python run.py`` would be: its own working folder, environment, argv and sys.path, stdout and stderr into files,
stdin empty; it imports kvlab, transformers and W&B itself (they read the environment when imported), runs
run.py as ``__main__`` and ends through Python's own exit (atexit handlers, threads joined), with run.py's exit
code. The zygote imports nothing of kvlab and never runs a torch operation, so no thread pool is forked.

``tests.helpers.run_py`` goes through it; ``KVLAB_TEST_ZYGOTE=0`` makes every call a fresh process again. Tests of
how a process starts (signals while it imports, what it imports first) start their own processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# what the zygote runs: read a request per line, fork, answer with the child's exit status
_SERVE = r"""
import json, os, sys, time
import numpy, pandas, torch, hydra, omegaconf  # what every run imports first; nothing of kvlab
import hydra._internal.utils, hydra.core.hydra_config  # noqa: F401

def serve():
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            return req
        deadline, status = time.monotonic() + req["timeout"], None
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
            elif time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                status = "timeout"
            else:
                time.sleep(0.01)
        sys.stdout.write(json.dumps({"rc": status}) + "\n")
        sys.stdout.flush()
    os._exit(0)

req = serve()
os.chdir(req["cwd"])
os.environ.clear()
os.environ.update(req["env"])
if "OMP_NUM_THREADS" in req["env"]:  # the OpenMP runtime read it when torch loaded: say it again
    torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
numpy.random.seed()  # a fresh process's global generator, not the zygote's copy
fd_in = os.open(os.devnull, os.O_RDONLY)
os.dup2(fd_in, 0)
for fd, path in ((1, req["out"]), (2, req["err"])):
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(f, fd)
    os.close(f)
sys.stdin = open(os.devnull)
sys.argv = list(req["argv"])
sys.path[0] = req["cwd"]
import runpy
runpy.run_path(req["argv"][0], run_name="__main__")
"""


class Zygote:
    """The worker's zygote (started on first use; ends when the worker does: its stdin closes)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def run(self, argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="kvlab-run-py-") as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            req = dict(argv=argv, cwd=str(cwd), env=env, out=str(out), err=str(err), timeout=timeout)
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
            if not reply:
                raise RuntimeError(f"the test zygote ended (exit {self.proc.poll()}); KVLAB_TEST_ZYGOTE=0 runs "
                                   "each run.py as a process of its own")
            rc = json.loads(reply)["rc"]
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if rc == "timeout":
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
        return subprocess.CompletedProcess([sys.executable, *argv], rc, stdout, stderr)


_ZYGOTE: list[Zygote] = []


def run(argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python ARGV`` (a script's path, then its arguments) in ``cwd`` with exactly ``env``, through the worker's
    zygote (started, or started again if it ended): stdout and stderr as text, the exit code as subprocess's."""
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [Zygote()]
    return _ZYGOTE[0].run(argv, cwd, env, timeout)

"""``python run.py ARGS`` for the tests, without paying Python's and torch's start-up each time: a zygote process
imports what run.py imports once, then forks a child per call, which runs run.py as ``__main__`` with the call's
argv, environment, working folder and stdio, and exits as the process would (atexit handlers, threads, the exit
code; a signal's death as a negative return code). About 3 s of start-up per call becomes a fork: the suite starts
a few hundred runs.

What a fork keeps from the zygote is what the modules it imported read at import time. kvlab's own modules read
the environment when they run, not when they are imported; the third-party ones that read it at import time
(huggingface_hub's HF_* settings) get the zygote's environment, so a call whose environment differs from the
zygote's in anything but ``FREE`` runs as a real process instead (``run``). Tests of signals and process groups use
real processes (subprocess.Popen) throughout.

Protocol (one zygote per pytest worker, a SOCK_SEQPACKET pair): the client sends {"argv", "env", "cwd"} with three
file descriptors (stdin, stdout, stderr); the zygote answers {"pid"} once the child is forked and {"pid",
"status"} when it has exited. The zygote is single-threaded: it forks only between requests."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FREE = ("WANDB_", "KVLAB_", "TMPDIR", "SLURM_")  # variables read when a run runs, never at import
WARM = ("torch", "hydra", "omegaconf", "pandas", "numpy", "tqdm", "harness.experiment.config",
        "harness.experiment.runner", "harness.measurements", "harness.analysis.report", "submitit",
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher", "models.families")


# ---- the zygote ---------------------------------------------------------------------------------------------------

def _child(request: dict, fds: list[int], sock: socket.socket) -> None:
    """In the forked child: become ``python run.py ARGV`` and never return."""
    sock.close()
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1 if os.isatty(1) else -1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        sys.argv = list(request["argv"])
        sys.path[0] = request["cwd"]
        import runpy

        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # what the interpreter prints for an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    finally:  # exit as an interpreter does: its threads, then atexit, then the streams
        try:
            import threading

            threading._shutdown()
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(fd: int) -> None:
    """The zygote's loop: fork a child per request, report each child's pid and, when it ends, its status."""
    for name in WARM:
        __import__(name)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                sock.send(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}).encode())
        if sock in ready:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not data:
                return  # the client is gone
            pid = os.fork()
            if pid == 0:
                os.close(wake_r)
                os.close(wake_w)
                _child(json.loads(data), fds, sock)
            for f in fds:
                os.close(f)
            children.add(pid)
            sock.send(json.dumps({"pid": pid}).encode())


# ---- the client ---------------------------------------------------------------------------------------------------

class _Zygote:
    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = base_env()
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())],
                                     cwd=REPO, env=self.env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.status = ours, {}
        self._read(timeout=120)  # {"ready": pid}: everything imported

    def _read(self, timeout: float | None = None) -> dict:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            raise TimeoutError("the test zygote did not answer")
        data = self.sock.recv(1 << 16)
        if not data:
            raise RuntimeError(f"the test zygote died (exit {self.proc.poll()})")
        msg = json.loads(data)
        if "status" in msg:
            self.status[msg["pid"]] = msg["status"]
        return msg

    def spawn(self, argv: list[str], env: dict, cwd: str, fds: list[int]) -> int:
        socket.send_fds(self.sock, [json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()], fds)
        while True:
            msg = self._read(timeout=60)
            if "status" not in msg:
                return msg["pid"]

    def wait(self, pid: int, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.status:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"run.py (pid {pid})", timeout)
            try:
                self._read(timeout=left)
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"run.py (pid {pid})", timeout) from None
        return self.status.pop(pid)


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote | None:
    """This worker's zygote (started on first use), or None where the environment asks for real processes."""
    global _ZYGOTE
    if os.environ.get("KVLAB_TEST_ZYGOTE", "1") == "0":
        return None
    if _ZYGOTE is None or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def base_env() -> dict:
    """The zygote's environment: the worker's, offline (as every run the tests start)."""
    return dict(os.environ, HF_HUB_OFFLINE="1")


def forkable(env: dict) -> bool:
    """Whether a run with ``env`` may be forked from the zygote: it differs from the zygote's environment only in
    variables read at run time (``FREE``)."""
    z = _ZYGOTE.env if _ZYGOTE is not None else base_env()
    differ = {k for k in set(env) | set(z) if env.get(k) != z.get(k)}
    return all(k.startswith(FREE) for k in differ)


def run(args: list[str], env: dict, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python run.py ARGS`` in REPO with ``env``, its output captured as text, as subprocess.run would give it:
    forked from the zygote where ``forkable``, else a real process."""
    z = _zygote() if forkable(env) else None
    if z is None:
        return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull) as null:
        pid = z.spawn(["run.py", *args], env, str(REPO), [null.fileno(), out.fileno(), err.fileno()])
        try:
            code = z.wait(pid, timeout)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            z.wait(pid)
            raise
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess([sys.executable, "run.py", *args], code, texts[0], texts[1])


if __name__ == "__main__":
    sys.path[0] = str(REPO)  # as `python run.py` in REPO has it (this file's own folder is no package root)
    serve(int(sys.argv[1]))

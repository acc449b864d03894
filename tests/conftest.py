"""Shared fixtures. Nothing here touches the network: the hub is offline and W&B writes to temporary folders."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_TMP = tempfile.mkdtemp(prefix="kvlab-tests-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
    os.environ[var] = os.path.join(_TMP, var.lower())
    os.makedirs(os.environ[var], exist_ok=True)
os.environ.pop("WANDB_API_KEY", None)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # a suite started as a background job of a shell without job control inherits SIGINT ignored, and so would
    # every run it starts: the Ctrl-C tests would then press a Ctrl-C nothing hears. Python's own handler again.
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    # the same for a suite started under nohup: kvlab keeps an ignored SIGHUP ignored (nohup's promise), so the
    # SIGHUP tests would send a signal nothing hears. Its default again, for this process and what it starts.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
os.environ["WANDB_SILENT"] = "true"

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    # N pytest-xdist workers on C cores: C // N threads each, inherited by the runs they start (C threads in every
    # worker oversubscribes the cores, and torch's threads then wait on each other)
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import pytest  # noqa: E402
import torch  # noqa: E402

from models.gpt2 import GPT2, GPT2Config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model() -> GPT2:
    torch.manual_seed(0)
    return GPT2(GPT2Config.preset("tiny")).eval()


REPO = Path(__file__).resolve().parent.parent
# small and quick: what every run.py test runs
TINY = ["model=tiny", "n_prompts=2", "new_tokens=8", "prompt_len=6", "repeats=2", "warmup=1",
        "context_lengths=[8,32]"]


class Tripwire:
    """A local TCP listener that counts connections: point W&B's and every HTTP client's server at it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port, self.hits = self.sock.getsockname()[1], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            self.took(conn)

    def took(self, conn) -> None:
        conn.close()


def run_py(args, tmp_path, extra_env=None) -> subprocess.CompletedProcess:
    """``python run.py ARGS`` in a subprocess, offline, W&B's folders under tmp_path."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        env[var] = str(Path(tmp_path) / var.lower())
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory):
    """The users' sweep, `-m cache=concat,prealloc dtype=fp32,fp16`, on the tiny model with W&B offline and every
    network client pointed at a tripwire. Returns (sweep folder, the finished process, the tripwire)."""
    tmp = tmp_path_factory.mktemp("sweep")
    trip = Tripwire()
    url = f"http://127.0.0.1:{trip.port}"
    sweep = tmp / "sweep"
    proc = run_py(["-m", "cache=concat,prealloc", "dtype=fp32,fp16", "tracking=offline", *TINY,
                   f"hydra.sweep.dir={sweep}"], tmp,
                  dict(WANDB_BASE_URL=url, HTTP_PROXY=url, HTTPS_PROXY=url, http_proxy=url, https_proxy=url))
    return sweep, proc, trip


def one_line(err: str) -> str:
    """The one line a refusal prints (asserted: one line, no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def untested_cases(path: str, cases: list) -> list[str]:
    """The ids of a test file's ``CASES`` that no test below the list names (``# id`` or ``, id``); asserts each id is
    listed once."""
    text = open(path, encoding="utf-8").read().split("\nCASES = [", 1)[1].split("\n]\n", 1)[1]
    assert len({c for c, _ in cases}) == len(cases)
    return [c for c, _ in cases if f"# {c}" not in text and f", {c}" not in text]

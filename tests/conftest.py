"""Shared fixtures (the utilities the tests share live in tests/helpers). Nothing here touches the network: the hub
is offline and W&B writes to temporary folders."""

import os
import signal
import tempfile

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
from tests.helpers import TINY, Tripwire, run_py  # noqa: E402


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)
# this worker's own, as it started: read before any fixture (a module's fixture runs before a test's, so what a
# test finds at its start may already be a fixture's)
WORKER_STATE = ({s: signal.getsignal(s) for s in STOP_SIGNALS}, torch.get_num_threads())


@pytest.fixture(autouse=True)
def process_state_put_back():
    """What kvlab sets for the rest of a process, put back to the worker's own after each test, so that no later
    test on the same worker inherits it (which test would depends on how the files are shared out): the stop-signal
    handlers a run installs (``runner.run(cfg)``, the report's ``main``) and torch's thread count (training in this
    process takes every core, and two workers each on both cores crawl)."""
    yield
    handlers, threads = WORKER_STATE
    for s, handler in handlers.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model() -> GPT2:
    torch.manual_seed(0)
    return GPT2(GPT2Config.preset("tiny")).eval()


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



def pytest_configure(config):
    """pytest-xdist's loadfile keeps the collection's order of files (``pytest_collection_modifyitems``); left to
    itself it orders them by how many tests each holds, which put the Slurm tests (four, mostly waiting) last."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """The files in ``tests.helpers.LONGEST_FIRST`` first, in that order (why: there); the order within a file,
    and of the other files, is kept."""
    from tests.helpers import in_hand_out_order

    items[:] = in_hand_out_order(items, key=lambda item: item.nodeid)


@pytest.fixture
def no_model(monkeypatch):
    """A model built by ``python -m harness.bench``, or llama.cpp asked, fails the test: its refusals come first and
    need neither."""
    from harness.core import llamacpp
    from harness.tools import bench

    def built(*a, **kw):
        raise AssertionError("the benchmark built a model before refusing")

    def asked(*a, **kw):
        raise AssertionError("the refusal asked llama.cpp")

    monkeypatch.setattr(bench, "build", built)
    monkeypatch.setattr(llamacpp, "available", asked)


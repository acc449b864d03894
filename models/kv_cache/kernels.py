"""kvlab's CPU kernels, built on first use: the decode attention (``csrc/decode_attention.cpp``: the quant kind's
reductions over packed K/V, the paged kind's attention through its block table) and a decode step's linear layers and
dense attention (``csrc/decode_linear.cpp``, used by ``models.cpu_kernels``).

``load()`` and ``load_linear()`` compile them with torch's C++ extension builder (a C++ compiler and torch's headers;
about a minute each, once per Python environment and source, built under ``build_dir``: the environment's
``kvlab-kernels/``) and return the module, or None where it cannot be built (no compiler), saying why once. A build
killed half-way is taken up again by the next one, never waited on. ``make setup`` builds both ahead, so no test or run pays for the build.

    python -c "from models.kv_cache.kernels import main; main()"   # build (or find) them: where, how long
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
NAME = "kvlab_decode_attention"
FLAGS = ["-O3", "-march=native", "-fopenmp"]  # built where it runs: this CPU's vector instructions
LINEAR_SOURCE = SOURCE.with_name("decode_linear.cpp")
LINEAR_NAME = "kvlab_decode_linear"
# no -march: each instruction set's kernel is compiled for its own target and chosen at run time (isa_best), so the
# one build runs on any x86-64 CPU (and the portable path on any other)
LINEAR_FLAGS = ["-O3", "-fopenmp"]
MAX_HEAD_DIM = 256  # the quant kernel's rows unpack on the stack (MAX_HS in the source): wider heads go elsewhere


@functools.lru_cache(maxsize=None)
def load():
    """The built kernel module (``scores``, ``weighted``), or None where no C++ compiler is found."""
    return _build(NAME, SOURCE, FLAGS, "compile=true's decode attention for quant and paged falls back to "
                  "torch.compile / the eager path")


@functools.lru_cache(maxsize=None)
def load_linear():
    """The built linear-layer module (``linear``, ``isa_best``, ``isa_supported``, ``read_gbps``), or None where no
    C++ compiler is found."""
    return _build(LINEAR_NAME, LINEAR_SOURCE, LINEAR_FLAGS, "the linear layers run torch's kernels")


def build_dir(name: str) -> Path | None:
    """Where a kernel module is built and found: beside the Python environment that runs it
    (``sys.prefix/kvlab-kernels/<name>``, or ``KVLAB_KERNELS_DIR/<name>``), so a run under another HOME (a test's, a
    cluster job's) finds what ``make setup`` built; None (torch's own ``~/.cache/torch_extensions``) where that
    folder cannot be written."""
    d = Path(os.environ.get("KVLAB_KERNELS_DIR") or Path(sys.prefix) / "kvlab-kernels") / name
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return d if os.access(d, os.W_OK) else None


def _build(name: str, source: Path, flags: list[str], fallback: str):
    if shutil.which("c++") is None and shutil.which("g++") is None:
        warnings.warn(f"no C++ compiler: {fallback}")
        return None
    from torch.utils import cpp_extension

    d = build_dir(name)
    args = dict(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    if d is None:
        return cpp_extension.load(**args)
    with open(d / "kvlab-build.lock", "w") as held:  # one kvlab build at a time here; the OS lets go if it dies
        fcntl.flock(held, fcntl.LOCK_EX)
        (d / "lock").unlink(missing_ok=True)  # torch's own lock file, left only by a build that was killed
        return cpp_extension.load(**args, build_directory=str(d))


def main() -> None:
    for what, name, loader in (("decode-attention", NAME, load), ("linear", LINEAR_NAME, load_linear)):
        t0 = time.perf_counter()
        mod = loader()
        if mod is None:
            sys.exit("kernels: no C++ compiler (c++ or g++) on this machine; install one (Debian: g++)")
        print(f"{what} kernels {name}: {mod.__file__} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()

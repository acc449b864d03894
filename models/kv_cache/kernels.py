"""kvlab's CPU decode-attention kernels (``csrc/decode_attention.cpp``: the quant kind's reductions over packed
K/V, the paged kind's attention through its block table), built on first use.

``load()`` compiles it with torch's C++ extension builder (a C++ compiler and torch's headers; about a minute, once
per machine and source: torch caches the build under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) and returns the module, or None where it cannot be built (no compiler), saying why
once. ``make setup`` builds it ahead, so no test or run pays for the build.

    python -c "from models.kv_cache.kernels import main; main()"   # build (or find) it: where, how long
"""

from __future__ import annotations

import functools
import shutil
import sys
import time
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
NAME = "kvlab_decode_attention"
FLAGS = ["-O3", "-march=native", "-fopenmp"]  # built where it runs: this CPU's vector instructions
MAX_HEAD_DIM = 256  # the quant kernel's rows unpack on the stack (MAX_HS in the source): wider heads go elsewhere


@functools.lru_cache(maxsize=None)
def load():
    """The built kernel module (``scores``, ``weighted``), or None where no C++ compiler is found."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        warnings.warn("no C++ compiler: compile=true's decode attention for quant and paged falls back to torch.compile / the eager path")
        return None
    from torch.utils import cpp_extension

    return cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                              verbose=False)


def main() -> None:
    t0 = time.perf_counter()
    mod = load()
    if mod is None:
        sys.exit("kernels: no C++ compiler (c++ or g++) on this machine; install one (Debian: g++)")
    print(f"decode-attention kernels {NAME}: {mod.__file__} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()

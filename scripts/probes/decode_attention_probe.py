"""One GPT-2-small layer's decode attention at context 960, timed alone (ms per call, median of 200): the quant
kind's kernel path (kernel_attention) and its two reductions, the step's write (_store of K and V, eager and as the
compiled step writes it), and SDPA over
fp32 K/V of the same length for comparison. What docs/cache-kinds.md's "compile=true" section splits quant's cost by.

    .venv/bin/python scripts/probes/decode_attention_probe.py [--batch 8] [--bits 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file: the repo on the path; a Python without torch: run again with the repo's
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # .venv, or one line (scripts/_venv.py)
    from scripts import _venv

    _venv.ensure(__file__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.kv_cache import kernels, make_cache  # noqa: E402
from models.kv_cache import quant as Q  # noqa: E402

NH, HS, CTX, MAX_LEN = 12, 64, 960, 1024


def timed(fn, n: int = 200) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bits", type=int, default=4, choices=Q.BITS)
    a = ap.parse_args()
    kern = kernels.load()
    if kern is None:
        sys.exit("decode_attention_probe: the kernels need a C++ compiler")
    torch.manual_seed(0)
    B = a.batch
    c = make_cache("quant", 1, NH, HS, MAX_LEN, B, k_bits=a.bits, v_bits=a.bits)
    c.update(0, torch.randn(B, NH, CTX, HS), torch.randn(B, NH, CTX, HS))
    c.advance(CTX)
    q, new = torch.randn(B, NH, 1, HS), torch.randn(B, NH, 1, HS)
    parts = {w: tuple(getattr(c, f"{w}_{p}")[0] for p in ("q", "scale", "min", "tail")) for w in ("k", "v")}
    n_k, n_v = c._split(CTX)
    kq, ks, kl, _ = parts["k"]
    vq, vs, vl, _ = parts["v"]
    BH, p = B * NH, torch.rand(B * NH, CTX)
    flat = [t.reshape(BH, *t.shape[2:]) for t in (kq, ks, kl, vq, vs, vl)]
    kk = torch.randn(B, NH, CTX + 1, HS)

    def store(fused: bool):
        c.fused = fused
        c._store(0, "k", new, CTX + 1, CTX + 2), c._store(0, "v", new, CTX + 1, CTX + 2)
        c.fused = False

    # what the model calls per layer in a compiled decode step (write, glue and kernel), on a cache whose step
    # quantises no group of K (31 steps of 32; the 32nd quantises a group of K per channel, eagerly)
    c1 = make_cache("quant", 1, NH, HS, MAX_LEN, B, k_bits=a.bits, v_bits=a.bits)
    c1.update(0, torch.randn(B, NH, CTX - 2, HS), torch.randn(B, NH, CTX - 2, HS))
    c1.advance(CTX - 2)

    def layer_call():
        c1.fused = True
        c1.attend_decode(0, q, new, new)
        c1.fused = False

    rows = {
        "attend_decode (the layer's whole call)": layer_call,
        "kernel_attention (whole layer)": lambda: Q.kernel_attention(kern, c, 0, q, n_k, n_v, CTX),
        "  q.K^T over packed K": lambda: kern.scores(q.reshape(BH, HS).contiguous(), flat[0], flat[1], flat[2], n_k, a.bits, True, c.opts.group_size),
        "  p.V over packed V": lambda: kern.weighted(p, flat[3], flat[4], flat[5], n_v, HS, a.bits,
                                                     False, c.opts.group_size),
        # a step between K's groups (31 of every 32): V's token is quantised, K's joins the full-precision tail
        "write the step's K and V (eager _store)": lambda: store(False),
        "  the same, compiled (kernel quantiser)": lambda: store(True),
        "SDPA over fp32 K/V (prealloc's)": lambda: F.scaled_dot_product_attention(q, kk, kk),
    }
    print(f"batch {B}, {a.bits}-bit K/V, context {CTX}, {NH} heads x {HS}, {torch.get_num_threads()} threads")
    for name, fn in rows.items():
        print(f"{name:<42}{timed(fn):>8.3f} ms")


if __name__ == "__main__":
    main()

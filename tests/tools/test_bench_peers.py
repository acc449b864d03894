"""``python -m harness.bench --peers``: every engine's decode step (ours eager and compiled, HF, llama.cpp) on the
same weights, in one run, for both dtypes and both batches (or the one --dtype and --batch given), each as a ratio to
llama.cpp's; the goal line judges the ratio it printed; an option it cannot honour is refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

from harness.core import llamacpp as L
from harness.tools import bench_peers
from harness.tools.bench import main


@pytest.mark.slow
def test_peers_times_every_engine_for_every_dtype_batch_and_depth(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(L.GGUF_CACHE_ENV, str(tmp_path))
    results = main(["--model", "tiny", "--peers", "--contexts", "24", "--repeats", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert set(results) == {(d, b, c) for d in bench_peers.PEER_DTYPES for b in bench_peers.PEER_BATCHES
                            for c in (24,)}
    for ms in results.values():
        assert set(ms) == {"kvlab", "kvlab compiled", "hf", "llamacpp"} and all(v > 0 for v in ms.values())
    row = next(ln for ln in out.splitlines() if re.match(r"fp32\s+1\s+24\s", ln))
    ms = results[("fp32", 1, 24)]
    ratios = [float(x) for x in re.findall(r"\(\s*([\d.]+)x\)", row)]
    assert ratios == pytest.approx([round(ms[k] / ms["llamacpp"], 2) for k in ("kvlab", "kvlab compiled", "hf",
                                                                                  "llamacpp")], abs=0.006)
    goal = next(ln for ln in out.splitlines() if ln.startswith("goal:"))
    best = min(ms["kvlab"], ms["kvlab compiled"]) / ms["llamacpp"]
    assert f"{best:.2f}x" in goal and ("met" in goal) == (best <= bench_peers.GOAL)


def test_peers_times_only_the_dtype_and_batch_given(capsys, monkeypatch):
    from harness.core.engines import KvlabEngine

    made = []  # the grid's logic alone: four eager engines stand in for the peers (no compile, no GGUF)

    def engines(model, dtype):
        made.append(dtype)
        m = model.to(dtype)
        return [(label, KvlabEngine(m)) for label in ("kvlab", "kvlab compiled", "hf", "llamacpp")]

    monkeypatch.setattr(bench_peers, "peer_engines", engines)
    results = main(["--model", "tiny", "--peers", "--dtype", "fp16", "--batch", "2", "--contexts", "16", "24",
                    "--repeats", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert set(results) == {("fp16", 2, 16), ("fp16", 2, 24)} and made == [torch.float16]
    assert [ln.split()[:3] for ln in out.splitlines() if re.match(r"fp(16|32)\s", ln)] == [
        ["fp16", "2", "16"], ["fp16", "2", "24"]]
    goal = next(ln for ln in out.splitlines() if ln.startswith("goal:"))
    assert "not judged" in goal and "fp32, batch 1, depth 24" in goal
    assert "fp16, batch 2," in out.splitlines()[0]  # the header names the grid timed


@pytest.mark.parametrize("argv", [["--compile"], ["--kinds"], ["--dtype", "bf16"]])
def test_peers_refuses_what_it_cannot_honour_in_one_line(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--peers", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert any(s in err for s in ("drop --compile", "give one of --kinds, --prefix, --paged, --peers",
                                  "give --dtype fp32 or fp16, or neither for both (got bf16)"))

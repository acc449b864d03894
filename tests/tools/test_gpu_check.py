"""scripts/gpu-check without a GPU: its argument handling, its plan, and its table and targets computed from rows
measured here on the CPU (the same code measures the GPU where one is lent)."""

from __future__ import annotations

import importlib.machinery
import importlib.util

import pytest
import torch

from tests.helpers import REPO


def load():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(REPO / "scripts" / "gpu-check"))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


gc = load()


def test_the_dry_run_plans_every_kind_eager_and_the_compiled_ones_compiled(capsys):
    assert gc.main(["--dry-run", "--models", "gpt2", "gpt2-xl", "--contexts", "512", "960"]) == 0
    rows = gc.plan(gc.parse_args(["--dry-run", "--contexts", "512", "960"]))
    from harness.core.engines import KvlabEngine

    compiled = [k for k in gc.KINDS if KvlabEngine.refuses_compile(k) is None]
    assert len(rows) == 2 * 2 * (len(gc.KINDS) + len(compiled))  # models x contexts x (eager + compiled kinds)
    assert {r["mode"] for r in rows if r["cache"] == "prealloc"} == {"eager", "compiled"}
    out = capsys.readouterr().out
    assert out.startswith("plan: the CUDA tests") and out.count("\n") == len(rows) + 1


@pytest.mark.parametrize("argv, says", [
    (["--models", "gpt5"], "not a model preset"),
    (["--kinds", "concat"], "must include prealloc"),
    (["--kinds", "prealloc", "quant:bits=9"], "--kinds 'quant:bits=9'"),
    (["--contexts", "1024"], "exceeds n_positions 1024 of gpt2"),
    (["--warmup", "1"], "at least 3"),
    (["--budget-s", "0"], "must be > 0"),
    (["--budget-s", "nan"], "--budget-s nan: must be > 0 and at most 86,400 seconds"),  # bench-count-bounds
    (["--card-gbps", "inf"], "--card-gbps inf: must be > 0"),
    (["--batch", "100000000"], "--batch 100,000,000 is beyond what gpu-check runs: give 1 .. 65,536"),
    (["--repeats", "20000"], "--repeats 20,000 is beyond what gpu-check runs: give 1 .. 10,000"),
    (["--contexts", *map(str, range(1, 80))], "--contexts has 79 entries: give at most 64"),
])
def test_bad_arguments_get_one_line_and_exit_2(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        gc.parse_args(["--dry-run", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err  # one line: no usage before it


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_says_so_unless_asked_for_the_plan(capsys):
    with pytest.raises(SystemExit) as e:
        gc.parse_args([])
    assert e.value.code == 2 and "sees no CUDA device here" in capsys.readouterr().err


@pytest.mark.slow
def test_measured_rows_make_the_table_and_the_targets(monkeypatch):
    """measure_model on the CPU (tiny, as gpt2-xl's stand-in): every planned row measured, ratios against eager
    prealloc, and the targets computed from the rows' own figures."""
    a = gc.parse_args(["--dry-run", "--models", "tiny", "--contexts", "16", "--kinds", "prealloc", "concat",
                       "--repeats", "2", "--warmup", "3"])
    a.device, a.dtype = "cpu", "fp32"
    from harness.core import measure

    monkeypatch.setattr(measure, "bandwidth_probe", lambda device, nbytes: {"probe_gbps": 10.0})
    rows = gc.measure_model(a, "tiny", deadline=float("inf"))
    assert [(r["cache"], r["mode"]) for r in rows] == [(r["cache"], r["mode"]) for r in gc.plan(a)]
    assert all(r["probe_gbps"] == 10.0 and r["gb_per_s"] == pytest.approx(r["bytes_read"] / r["ms"] / 1e6)
               for r in rows)
    lines = gc.table(rows).splitlines()
    assert len(lines) == 1 + len(rows) and "1.00x" in lines[1]  # eager prealloc against itself
    xl = [{**r, "model": "gpt2-xl"} for r in rows]
    c = next(r for r in xl if r["mode"] == "compiled")
    e = next(r for r in xl if r["mode"] == "eager" and r["cache"] == "prealloc")
    got = gc.targets(xl, card_gbps=None)
    share, speedup = c["gb_per_s"] / 10.0, e["ms"] / c["ms"]
    assert f"= {share:.0%} of the probe's 10 GB/s" in got[0]
    assert got[0].endswith("NOT met" if share < 0.7 else "met") and f"{speedup:.2f}x faster" in got[1]
    assert "of the card's 2 GB/s" in gc.targets(xl, card_gbps=2.0)[0]
    assert gc.targets(rows, None) == ["targets: not measured (they need gpt2-xl prealloc at batch 1)"]
    assert gc.measure_model(a, "tiny", deadline=0.0) == []  # the budget spent: nothing more is started


def test_on_a_gpu_each_model_is_checked_against_its_free_memory_first(monkeypatch, capsys):  # bench-memory
    """Without a GPU here: CUDA as a GPU with 8 GB free would report it. gpt2-xl at batch 4,096 does not fit, and the
    line says which batch would (harness.tools.bench's own estimate); batch 1 passes."""
    from harness.experiment import memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 8 * 10 ** 9)
    with pytest.raises(SystemExit) as e:
        gc.parse_args(["--models", "gpt2-xl", "--batch", "4096", "--skip-tests"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and line.startswith("scripts/gpu-check: error: the benchmark (--kinds, --model gpt2-xl, "
                                                  "fp16, batch 4096) needs about ")
    assert "but Fake GPU has 8 GB free" in line and "--batch <= " in line and "--kinds" in line
    assert gc.parse_args(["--models", "gpt2", "--skip-tests"]).batch == 1
    with pytest.raises(SystemExit):
        gc.parse_args(["--device", "cuda:3"])
    assert "this machine has 1 CUDA device(s)" in capsys.readouterr().err

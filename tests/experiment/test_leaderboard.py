"""experiment=leaderboard: the grid of runs its sweeper makes (harness.experiment.leaderboard), the table, marks and
figures its report writes (harness.analysis.leaderboard), and one small sweep end to end."""

import json
import os
import subprocess
import sys

import math
import pandas as pd
import pytest

from harness.analysis import leaderboard as board_of
from harness.common.errors import ConfigError
from harness.experiment import leaderboard as lb
from models.kv_cache import CACHE_KINDS, kv_bytes
from tests.helpers import REPO


def options_of(cell: lb.Cell) -> tuple[str, dict]:
    """A cell's cache kind and options, read back from its overrides."""
    kind = next(o.split("=", 1)[1] for o in cell.overrides if o.startswith("cache="))
    opts = {}
    for o in cell.overrides:
        key, value = o.split("=", 1)
        if key.startswith("cache."):
            value = value.strip("'")
            try:
                value = json.loads(value)
            except ValueError:
                pass
            opts[key[len("cache."):]] = value
    return kind, opts


def test_the_default_grid_is_every_method_at_every_ratio_and_each_quant_once():
    grid = lb.cells(None, lb.RATIOS, 1024)
    by = {(c.method, c.ratio): c for c in grid}
    assert len(grid) == 9 * 4 + 3 and len(by) == len(grid)
    assert by[("snapkv", 0.875)].overrides == ("cache=snapkv", "cache.budget=128")
    assert by[("snapkv-pyramid", 0.25)].overrides == ("cache=snapkv", "cache.budget=768", "cache.allocation=pyramid")
    assert by[("h2o", 0.5)].overrides == ("cache=h2o", "cache.budget=512", "cache.recent=256")  # H2O's half recent
    assert by[("window", 0.75)].overrides == ("cache=window", "cache.sinks=4", "cache.budget=256")
    # each quant at the asked ratio nearest its own (its bits fix it), computed from the kind's own formula
    assert {m: c.ratio for (m, _), c in by.items() if m.startswith("quant")} == {"quant8": 0.75, "quant4": 0.875,
                                                                                 "quant2": 0.875}
    cls = CACHE_KINDS["quant"]
    for bits in lb.QUANT_BITS:
        held = cls.nbytes_formula(2, 3, 64, 1024, 1, "fp32", 1024, cls.parse_options(k_bits=bits, v_bits=bits))
        assert lb.quant_ratio(bits) == pytest.approx(1 - held / kv_bytes(2, 3, 64, 1024, 1, "fp32"))


@pytest.mark.parametrize("ratio", lb.RATIOS)
def test_duo_holds_the_ratios_bytes_before_its_heads_are_rounded(ratio):
    share = lb.duo_share(ratio, 1024)
    kept = share + (1 - share) * (lb.DUO_SINKS + lb.DUO_RECENT) / 1024
    assert kept == pytest.approx(1 - ratio)


def test_the_report_reads_each_cells_ratio_back_from_what_the_run_records():
    """The analysis works out the ratio a run stands in from its options alone (a budget, a duo share, or a quant's
    own bytes): it must be the ratio the sweeper asked for."""
    grid = lb.cells(None, [0.3, 0.5, 0.75, 0.875], 1024)
    for cell in grid:
        kind, opts = options_of(cell)
        row = {"cache": kind, "max_len": 1024, "n_layer": 6, "n_kv_head": 2, "n_embd": 128, "n_head": 2,
               "dtype": "fp32", **{f"cache_{k}": v for k, v in opts.items()}}
        if kind == "quant":  # what its run's memory measurement records, by the kind's own formula
            cls = CACHE_KINDS[kind]
            row["nbytes_at_max_len"] = cls.nbytes_formula(6, 2, 64, 1024, 1, "fp32", 1024, cls.parse_options(**opts))
            row["full_nbytes_at_max_len"] = kv_bytes(6, 2, 64, 1024, 1, "fp32")
            row["ratio_held"] = board_of.held(pd.Series(row))[1]
            assert abs(row["ratio_held"] - lb.quant_ratio(opts["k_bits"])) < 1e-9
        assert board_of.asked_ratio(pd.Series(row), [0.3, 0.5, 0.75, 0.875]) == cell.ratio, cell
        assert board_of.method_of(pd.Series(row)) == cell.method


@pytest.mark.slow  # seconds: not in make test-fast
@pytest.mark.parametrize("model", ["mini", "mini-llama"])
def test_every_cell_of_the_default_grid_is_a_run_the_checks_accept(model):
    from hydra import compose, initialize_config_dir

    from harness.experiment.config import read, register, validate

    register()
    cfg_model = json.loads((REPO / "models" / "weights" / model / "config.json").read_text())
    head_dim = cfg_model.get("head_dim") or cfg_model.get("n_embd", cfg_model.get("hidden_size")) // cfg_model.get(
        "n_head", cfg_model.get("num_attention_heads"))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        for cell in lb.cells(None, lb.RATIOS, 1024):
            cfg = compose(config_name="config", overrides=["experiment=leaderboard", f"model={model}",
                                                           *cell.overrides])
            rc = read(cfg)
            assert rc.cache.kind == cell.overrides[0].split("=")[1]
            max_len, _ = validate(rc, 1024, head_dim)
            assert max_len == 1024


def test_narrowing_keeps_the_methods_and_ratios_asked():
    assert [c.method for c in lb.cells(["snapkv", "quant4"], [0.875])] == ["snapkv", "quant4"]
    assert [c.method for c in lb.cells(["h2o-ada"], [0.5])] == ["h2o-ada"]


# (id, leaderboard.methods, leaderboard.ratios, leaderboard.context, what the one line says): docs/faults.md's rows
CASES = [
    ("leaderboard-unknown-method", ["lru"], [0.5], 1024, "leaderboard.methods names 'lru': use some of"),
    ("leaderboard-unknown-allocation", ["snapkv-lumpy"], [0.5], 1024, "leaderboard.methods names 'snapkv-lumpy'"),
    ("leaderboard-no-methods", [], [0.5], 1024, "leaderboard.methods is empty"),
    ("leaderboard-no-ratios", ["snapkv"], [], 1024, "leaderboard.ratios is empty"),
    ("leaderboard-ratio-outside", ["snapkv"], [1.5], 1024, "leaderboard.ratios holds 1.5"),
    ("leaderboard-ratio-bool", ["snapkv"], [True], 1024, "leaderboard.ratios holds True"),
    ("leaderboard-quant-far", ["quant8"], [0.25], 1024, "no run to make: the quant methods' own ratios (quant8 0.71)"),
    ("leaderboard-context-small", ["snapkv"], [0.5], 8, "leaderboard.context=8"),
    ("leaderboard-duo-short", ["duo", "snapkv"], [0.5], 128,
     "leaderboard.context=128: duo's streaming heads hold 80 slots"),
]


@pytest.mark.parametrize("case,methods,ratios,context,says", CASES, ids=[c[0] for c in CASES])
def test_a_grid_it_cannot_run_is_refused_in_one_line(case, methods, ratios, context, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")) as e:
        lb.cells(methods, ratios, context)
    assert "\n" not in str(e.value)


def test_marks_bold_the_best_and_the_scores_whose_interval_reaches_it():
    def row(method, kl, lo, hi, niah, ok=True):
        return {"model": "m", "method": method, "ratio": 0.5, "status": "ok", "text": kl, "text_lo": lo,
                "text_hi": hi, "copy": math.nan, "copy_lo": math.nan, "copy_hi": math.nan, "niah": niah,
                "niah_lo": math.nan, "niah_hi": math.nan, "mqar": math.nan, "mqar_lo": math.nan, "mqar_hi": math.nan,
                "text_ref_ok": True, "copy_ref_ok": True, "niah_ref_ok": ok, "mqar_ref_ok": True}

    board = pd.DataFrame([row(board_of.FULL, 0.0, math.nan, math.nan, 0.9), row("a", 0.20, 0.15, 0.25, 0.5),
                          row("b", 0.30, 0.24, 0.36, 0.6), row("c", 0.40, 0.30, 0.45, 0.7)])
    marks = board_of.marks(board)
    assert list(marks["text"]) == ["", "best", "tie", ""]  # b's interval reaches a's; c's does not
    assert list(marks["niah"]) == ["", "", "", "best"]  # no intervals: only an equal score would tie
    board["niah_ref_ok"] = False
    assert list(board_of.marks(board)["niah"]) == ["", "", "", ""]  # the model cannot do it: nothing is best


def leaderboard_sweep(tmp_path, *extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "WANDB_DIR": str(tmp_path),
           "WANDB_CACHE_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)}
    cmd = [sys.executable, "run.py", "-m", "experiment=leaderboard", "model=mini", "max_len=128", "prompt_len=64",
           "n_prompts=1", "new_tokens=4", "drift_texts=2", "retrieval_k=2", "niah_k=1", "niah_depths=4", "mqar_k=2",
           "context_lengths=[96]", "repeats=2", "warmup=1", "tracking=disabled",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_small_leaderboard_sweep_writes_its_table_and_figures(tmp_path):
    p = leaderboard_sweep(tmp_path, "leaderboard.methods=[snapkv,window,quant4]", "leaderboard.ratios=[0.75]")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "leaderboard: 3 runs a model" in p.stdout
    report = tmp_path / "sweep" / "report"
    board = pd.read_csv(report / "leaderboard.csv")
    assert list(board["method"]) == ["full attention", "snapkv", "window", "quant4"]
    assert list(board["ratio"]) == [0.0, 0.75, 0.75, 0.75]
    assert (board["status"] == "ok").all() and board["text"].iloc[1:].gt(0).all()
    held = board.set_index("method")["bytes_held"]  # a quarter of full attention's, by each kind's formula
    assert held["snapkv"] < held["full attention"] / 3 and held["window"] == held["full attention"] / 4
    assert ((board["ratio_held"] - board["ratio"]).abs() < 0.02).all()
    md = (report / "leaderboard.md").read_text()
    assert "## mini" in md and md.count("**") >= 2 * 4  # a best in each column at least
    for task in ("text", "copy", "niah", "mqar"):
        assert (report / f"leaderboard_{task}.png").stat().st_size > 10_000
    page = (report / "report.html").read_text()
    assert "Compression leaderboard" in page and "leaderboard_niah" in page


@pytest.mark.slow  # seconds: not in make test-fast
def test_the_leaderboard_refuses_a_cache_on_the_command_line_and_makes_nothing(tmp_path):
    p = leaderboard_sweep(tmp_path, "cache=h2o")
    assert p.returncode != 0
    said = [line for line in p.stderr.splitlines() if "experiment=leaderboard sets each run's cache" in line]
    assert len(said) == 1 and "cache=h2o" in said[0]
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").iterdir())

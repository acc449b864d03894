"""``model.outliers`` on a run: the loaded model is transformed (``models.outliers.inject``) before anything measures
it or copies it (the compute-dtype copy, the references, HF's engine), results.json records the scale and the channels
(scale 1 and none without it), a run without it keeps the identity it had, and bad values are refused in one line
before any work."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from harness import measurements
from harness.experiment.config import ConfigError, config_id, read, validate
from harness.experiment.prepare import build_model
from harness.experiment.prepare import load, plan_run
from models.gpt2 import GPT2Config
from models.outliers import choose
from tests.helpers import TINY, run_py
from tests.helpers import inproc
from tests.helpers.inproc import compose_cfg

SMALL = ["model=tiny", "n_prompts=1", "new_tokens=4", "prompt_len=4", "repeats=1", "warmup=0", "context_lengths=[8]",
         "max_len=32", "tracking=disabled", "measurements=[equivalence]"]


def run_here(tmp_path, monkeypatch, overrides) -> dict:
    """One run in this process into ``tmp_path/run``; its results.json as written."""
    inproc.run_here(monkeypatch, overrides, tmp_path / "run")
    return json.loads((tmp_path / "run" / "results.json").read_text())


def test_a_run_records_the_outliers_it_measured_and_a_plain_run_records_none(tmp_path, monkeypatch):
    rec = run_here(tmp_path / "a", monkeypatch, [*SMALL, "model.outliers.scale=20"])
    assert rec["status"] == "ok", rec.get("error")  # an exact kind in fp32: cached == uncached on the new weights
    expect = choose(GPT2Config.preset("tiny"), 20.0)  # the seeded choice, model.outliers.seed=0
    assert rec["outlier_scale"] == 20.0
    assert json.loads(rec["outlier_k_channels"]) == expect["k_channels"]
    assert json.loads(rec["outlier_v_channels"]) == expect["v_channels"]
    assert rec["model"] == "tiny · outliers x20" and "x20" in (tmp_path / "a" / "run" / "run.log").read_text()
    assert measurements.undeclared(rec) == [] and measurements.check_result_types(rec) == []
    plain = run_here(tmp_path / "b", monkeypatch, SMALL)
    assert plain["status"] == "ok", plain.get("error")
    assert plain["outlier_scale"] == 1.0 and plain["outlier_k_channels"] is None is plain["outlier_v_channels"]
    assert plain["model"] == "tiny" and plain["config_id"] != rec["config_id"]


@pytest.mark.parametrize("engine", ["kvlab", "hf"])
def test_the_loaded_model_is_transformed_before_anything_uses_it(engine):
    rc = read(compose_cfg([*SMALL, f"engine={engine}", "model.outliers.scale=20", "model.outliers.k_channels=3",
                           "model.outliers.v_channels=[5,7]"]))
    plan = plan_run(rc)
    loaded = load(plan)
    fresh = build_model(plan.weights, rc.model, plan.model_cfg)  # the weights as loaded
    C, hs = plan.model_cfg.n_embd, plan.model_cfg.head_dim
    for block, block0 in zip(loaded["model32"].transformer.h, fresh.transformer.h):
        w, w0 = block.attn.c_attn.weight, block0.attn.c_attn.weight
        for h, vc in enumerate([5, 7]):
            assert torch.allclose(w[C + h * hs + 3], 20 * w0[C + h * hs + 3])  # K
            assert torch.allclose(w[h * hs + 3], w0[h * hs + 3] / 20)  # Q
            assert torch.allclose(w[2 * C + h * hs + vc], 20 * w0[2 * C + h * hs + vc])  # V
    x = loaded["prompts"][0]
    with torch.no_grad():
        assert (loaded["engine"].forward(x) - fresh(x)).abs().max().item() < 1e-5  # the function kept
    if engine == "hf":  # HF's copy of the weights is the transformed one (Conv1D: (in, out), K's channel a column)
        hf_w = loaded["engine"].model.transformer.h[0].attn.c_attn.weight
        assert torch.allclose(hf_w[:, C + 3], 20 * fresh.transformer.h[0].attn.c_attn.weight[C + 3])


def test_a_run_without_outliers_keeps_the_identity_it_had():
    cfg = compose_cfg(["model=mini"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    del plain["model"]["outliers"]  # a config from before the key existed
    assert config_id(cfg) == config_id(OmegaConf.create(plain))
    ids = {config_id(compose_cfg(["model=mini", f"model.outliers.scale={s}"])) for s in (1, 20, 40)}
    assert len(ids) == 3 and config_id(cfg) in ids


BAD = [
    (["model.outliers.scale=0"], "model.outliers.scale=0.0: use a positive finite number"),
    (["model.outliers.scale=-20"], "model.outliers.scale=-20.0: use a positive finite number"),
    (["model.outliers.scale=inf"], "model.outliers.scale=inf: use a positive finite number"),
    (["model.outliers.scale=nan"], "model.outliers.scale=nan: use a positive finite number"),
    (["model.outliers.seed=-1"], "model.outliers.seed=-1: use an integer 0 <= seed < 2**63"),
]
NEEDS_MODEL = [  # tiny: 2 layers, 2 heads of 32 channels
    (["model.outliers.k_channels=32"], "model.outliers.k_channels=32: channel 32 is not one of a head's 32 channels: "
                                       "use 0 .. 31"),
    (["model.outliers.v_channels=[1,2,3]"], "model.outliers.v_channels=[1, 2, 3]: give one channel for every head "
                                            "(an int), 2 (one per head) or 2 lists of 2 (one per layer and head)"),
    (["model.outliers.k_channels=[[1,2]]"], "model.outliers.k_channels=[[1, 2]]: give one channel for every head"),
    (["model.outliers.k_channels=abc"], "model.outliers.k_channels='abc': give one channel for every head"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_values_are_refused_in_one_line_by_validation(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(["model=tiny", "model.outliers.scale=20", *overrides]), 128, 32)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,message", NEEDS_MODEL)
def test_channels_that_do_not_fit_the_model_are_refused_when_the_run_is_planned(overrides, message):
    for scale in (20, 1):  # checked whatever the scale: a typo is a typo
        rc = read(compose_cfg([*SMALL, f"model.outliers.scale={scale}", *overrides]))
        with pytest.raises(ConfigError) as e:
            plan_run(rc)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.slow  # a run.py process: seconds
def test_a_refused_scale_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    proc = run_py([*TINY, "model.outliers.scale=-1", "tracking=disabled", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "model.outliers.scale=-1.0: use a positive finite number" in proc.stderr
    record = json.loads((out / "results.json").read_text())
    assert record["status"] == "failed" and record["outlier_scale"] == -1.0 and not (out / "steps.csv").exists()

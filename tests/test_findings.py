"""The findings a report opens with, on synthetic sweeps whose answers are known: the quality-per-byte frontier, one
sentence per swept axis with each value's median, what contradicts a kind's promise, and the paper presets' claims
with the direction worked out from the numbers given here."""

import math

import numpy as np
import pandas as pd
import pytest

from harness import findings
from harness.findings import claim_rows, sweep_findings


def run(name, cache="quant", status="ok", dtype="fp32", exact=None, **values):
    """One results row as a run records it; ``cache_<option>`` columns for the kind's options."""
    exact = values.pop("cache_exact", cache in ("prealloc", "concat", "window", "h2o") if exact is None else exact)
    label = values.pop("label", values.pop("cache_label", None)) or cache + "".join(
        f" {k[6:]}{v}" for k, v in values.items() if k.startswith("cache_") and k != "cache_nbytes")
    return dict(run_name=name, status=status, model="mini", engine="kvlab", cache=cache, cache_label=label,
                cache_exact=exact, dtype=dtype, storage_dtype="float32" if dtype == "fp32" else "float16",
                compute_dtype="float32", device="cpu", batch=1, **values)


def frame(*rows) -> pd.DataFrame:
    return pd.DataFrame(list(rows))


def texts(found, kind):
    return [f for f in found if f.kind == kind]


def test_the_frontier_names_exactly_the_settings_nothing_beats():
    """prealloc (the fp32 reference: drift 0), quant 8 and 4 bits and a 2-bit setting with the fewest bytes are on
    the frontier; a 4-bit setting with more bytes and a worse ΔNLL than the other 4-bit one is not."""
    runs = frame(run("ref", "prealloc", drift_delta_nll=np.nan, cache_nbytes=1000),
                 run("q8", cache_k_bits=8, drift_delta_nll=0.01, cache_nbytes=300),
                 run("q4", cache_k_bits=4, drift_delta_nll=0.05, cache_nbytes=170),
                 run("q4-worse", cache_k_bits=4, label="quant 4 g16", drift_delta_nll=0.08, cache_nbytes=250),
                 run("q2", cache_k_bits=2, drift_delta_nll=0.5, cache_nbytes=100))
    (front,) = texts(sweep_findings(runs), "frontier")
    assert front.runs == ("q2", "q4", "q8", "ref")  # fewest bytes first
    assert "quant 4 g16" not in front.text and "The other 1 setting" in front.text
    assert "+0.050 at 170 B" in front.text and "prealloc · fp32 (text ΔNLL +0.000 at 1 kB)" in front.text


def test_each_swept_axis_gets_its_medians_as_multiples_of_the_best():
    runs = frame(run("a", cache_k_bits=2, cache_v_bits=4, drift_kl_p99=0.4),
                 run("b", cache_k_bits=2, cache_v_bits=8, drift_kl_p99=0.6),
                 run("c", cache_k_bits=8, cache_v_bits=4, drift_kl_p99=0.01),
                 run("d", cache_k_bits=8, cache_v_bits=8, drift_kl_p99=0.03))
    axes = {f.text.split(":")[0]: f for f in texts(sweep_findings(runs), "axis")}
    assert set(axes) == {"cache.k_bits", "cache.v_bits"}
    assert "KL p99 2 0.500 (25× 8's), 8 0.020" in axes["cache.k_bits"].text  # medians 0.5 and 0.02
    assert "KL p99 4 0.205, 8 0.315 (1.54× 4's)" in axes["cache.v_bits"].text
    assert sorted(axes["cache.k_bits"].runs) == ["a", "b", "c", "d"]


def test_an_axis_that_follows_another_is_said_once():
    """A window of budget - sinks splits the runs as the sinks do: one sentence, naming both."""
    rows = [run(f"s{s}", "window", cache_sinks=s, cache_window=64 - s, cache_budget=64, drift_delta_nll=1.0 / (s + 1))
            for s in (0, 1, 4)]
    axis = texts(sweep_findings(frame(*rows)), "axis")
    assert len(axis) == 1 and axis[0].text.startswith("cache.sinks:") and "cache.window varied with it" in axis[0].text


def test_what_contradicts_a_kinds_promise_is_said_with_its_runs():
    runs = frame(
        run("broken", "concat", status="not_equivalent", max_abs_logit_diff=0.25),
        run("ref", "prealloc", cache_nbytes=1000, step_ms_cached_at_max_context=30.8, max_context_len=960,
            drift_kl=np.nan),
        run("slow", cache_k_bits=4, cache_nbytes=170, step_ms_cached_at_max_context=57.1, max_context_len=960,
            drift_kl=1e-3, drift_max_abs=0.1),
        run("still", cache_k_bits=8, cache_nbytes=300, step_ms_cached_at_max_context=20.0, max_context_len=960,
            drift_kl=0.0, drift_max_abs=0.0))
    found = {f.runs: f.text for f in texts(sweep_findings(runs), "surprise")}
    assert "exact kind whose output differs" in found[("broken",)] and "0.250" in found[("broken",)]
    assert "moved nothing" in found[("still",)]
    assert found[("slow", "ref")].startswith("quant k_bits4 · fp32 holds 0.17× prealloc · fp32's bytes")
    assert "takes 1.85× its time" in found[("slow", "ref")]
    assert not any("still" in r and "ref" in r for r in found)  # fewer bytes and faster: as promised


def test_a_sweep_with_one_setting_or_no_ok_run_says_nothing():
    assert sweep_findings(frame(run("a", drift_kl_p99=0.1, cache_nbytes=10))) == []
    assert sweep_findings(frame(run("a", status="failed"), run("b", status="failed"))) == []
    assert claim_rows(frame(run("a"))) == []  # not a paper preset


def h2o_sweep(both, local, heavy, acc=(0.27, 0.13, 0.02)):
    return frame(*[run(f"r{recent}", "h2o", experiment="paper_h2o", cache_budget=205, cache_recent=recent,
                       drift_delta_nll=d, retrieval_acc=a, retrieval_acc_ref=0.4, retrieval_n=512)
                   for recent, d, a in ((102, both, acc[1]), (205, local, acc[2]), (0, heavy, acc[0]))])


def test_h2o_claims_take_their_direction_from_the_numbers():
    rows = claim_rows(h2o_sweep(both=0.2, local=0.6, heavy=1.0))
    assert [r.holds for r in rows] == [True, False, True]  # both best; heavy alone worse than local; copies better
    assert rows[0].our_number == "+0.200 / +0.600 / +1.000" and rows[0].runs == ("r102", "r205", "r0")
    assert rows[0].paper_number == "78.51 / 55.82 / 67.25 / 78.45" and "Table 6" in rows[0].source
    flipped = claim_rows(h2o_sweep(both=0.7, local=0.6, heavy=0.3, acc=(0.01, 0.1, 0.2)))
    assert [r.holds for r in flipped] == [False, True, False]


def test_a_claim_whose_runs_are_missing_says_so():
    runs = h2o_sweep(0.2, 0.6, 1.0).iloc[:2]  # no heavy-hitters-only run
    rows = claim_rows(runs)
    assert all(r.holds is None and "not in this sweep" in r.our_number for r in rows)


def streaming_sweep(dnll):
    return frame(*[run(f"s{s}", "window", experiment="paper_streamingllm", cache_budget=64, cache_sinks=s,
                       cache_window=64 - s, drift_delta_nll=d, drift_text_positions=2046, retrieval_acc=0.01,
                       retrieval_acc_ref=0.2, retrieval_n=200) for s, d in zip((0, 1, 2, 4, 8), dnll)])


def test_streamingllm_claims():
    rows = claim_rows(streaming_sweep([2.0, 1.2, 1.1, 1.0, 0.98]))
    assert [r.holds for r in rows] == [True, True, True, True]
    assert "1 sink recovers 80% of what 4 do" in rows[1].our_number
    assert rows[0].our_number.startswith("ΔNLL +2.000 vs +1.000") and f"×{math.exp(2.0):.2f}" in rows[0].our_number
    rows = claim_rows(streaming_sweep([2.0, 1.9, 1.5, 1.0, 0.5]))
    assert [r.holds for r in rows[:3]] == [True, False, False]  # one sink recovers 10%; 8 sinks far better than 4


def test_kv_types_and_rotation_claims():
    kv = frame(*[run(f"{q}{b}", experiment="paper_kv_types", cache_k_bits=b, cache_v_bits=b, cache_k_axis="token",
                     cache_v_axis="token", cache_group_size=32, cache_quantize=q, drift_kl=kl)
                 for q, b, kl in (("k", 8, 2e-4), ("v", 8, 5e-4), ("kv", 8, 6e-4), ("k", 4, 3e-3), ("v", 4, 1e-3))])
    rows = claim_rows(kv)
    # V the more sensitive at 8 bits here; both (6e-4) is 3x K alone (2e-4), not within 1.25x; K at 4 bits
    assert [r.holds for r in rows] == [False, False, True]
    assert rows[0].our_number == "2.00e-04 vs 5.00e-04 (0.40×)"
    rot = frame(*[run(f"{r}{b}", experiment="paper_rotation", cache_k_bits=b, cache_k_axis="token",
                      cache_quantize="k", cache_rotate=r, text_nll=3.4 + d, text_nll_fp32=3.4,
                      step_ms_cached_at_max_context=ms, max_context_len=960)
                  for r, b, d, ms in (("none", 4, 0.1, 2.0), ("hadamard", 4, 0.01, 2.5), ("none", 2, 0.5, 2.0),
                                      ("hadamard", 2, 0.6, 2.4))])
    rows = claim_rows(rot)
    assert [r.holds for r in rows] == [True, False, None]
    assert rows[0].our_number == f"{100 * (math.exp(0.1) - 1):+.2f}% vs {100 * (math.exp(0.01) - 1):+.2f}%"
    assert rows[2].our_number == "2.00 vs 2.50 ms (1.25×)"


def test_every_preset_has_its_claims_and_its_config():
    from pathlib import Path

    conf = Path(__file__).resolve().parent.parent / "conf" / "experiment"
    for preset, claims in findings.PAPERS.items():
        assert (conf / f"{preset}.yaml").is_file() and claims
        assert all(c.source and c.paper_setting and c.paper_number for c in claims)


def test_markdown_and_html_carry_the_claims_and_the_sentences():
    runs = h2o_sweep(0.2, 0.6, 1.0)
    made = findings.make(runs)
    md = findings.markdown(made)
    assert md.startswith("# Findings") and "| claim | source |" in md and md.count("| holds |") == 2
    assert "does not hold" in md and "- cache.recent:" in md
    page = findings.html_section(made)
    assert page.startswith("<h2>Findings</h2>") and page.count("<tr>") == 4 and "<li>cache.recent:" in page


@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_runs_that_are_not_ok_are_never_read_as_findings(status):
    runs = h2o_sweep(0.2, 0.6, 1.0)
    runs.loc[0, "status"] = status
    assert all("r102" not in f.runs for f in sweep_findings(runs))
    assert claim_rows(runs)[0].holds is None


def preset_grid(preset: str) -> pd.DataFrame:
    """The runs a preset's sweep makes, as results rows: each point of its grid composed as run.py composes it, the
    cache options resolved as a run records them, and made-up numbers for every key a claim reads."""
    import itertools

    from hydra import compose, initialize_config_dir

    from harness.config import register, validate
    from harness.experiment import cache_record
    from models.gpt2 import GPT2Config
    from tests.conftest import REPO

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        base = compose(config_name="config", overrides=[f"experiment={preset}"], return_hydra_config=True)
        axes = {k: str(v).split(",") for k, v in base.hydra.sweeper.params.items()}
        rows = []
        for i, point in enumerate(itertools.product(*axes.values())):
            overrides = [f"experiment={preset}"] + [f"{k}={v}" for k, v in zip(axes, point)]
            cfg = compose(config_name="config", overrides=overrides)
            validate(cfg, GPT2Config.preset(cfg.model.preset).n_positions)  # a point the sweep would refuse fails here
            rows.append(run(f"run{i}", cfg.cache.kind, experiment=cfg.experiment, **cache_record(cfg.cache),
                            drift_delta_nll=0.1 * (i + 1), drift_kl=1e-3 * (i + 1), drift_kl_p99=1e-2 * (i + 1),
                            drift_text_positions=1023, retrieval_acc=0.1, retrieval_acc_ref=0.2, retrieval_n=200,
                            text_nll=3.5 + 0.01 * i, text_nll_fp32=3.5, step_ms_cached_at_max_context=2.0 + i,
                            max_context_len=960))
    return frame(*rows)


@pytest.mark.parametrize("preset", sorted(findings.PAPERS))
def test_every_claim_finds_its_runs_in_its_presets_grid(preset):
    """What each preset sweeps is what its claims read: composed from conf/, no claim says 'not in this sweep'."""
    runs = preset_grid(preset)
    assert findings.preset_of(runs) == preset and len(runs) <= 8
    for row in claim_rows(runs):
        assert "not in this sweep" not in row.our_number and "could not be read" not in row.our_number, row
        assert row.runs and set(row.runs) <= set(runs.run_name)

"""Measurements as plug-ins: the registry's declarations, the keys a run writes, choosing what runs, adding one
measurement from a test file, and the conformance suite over MEASUREMENTS (every measurement on every kind and
both engines where it applies)."""

import dataclasses
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from harness import measurements
from harness.measurements import record
from harness.analysis import report
from harness.experiment.config import ConfigError, validate
from harness.analysis import figures
from harness.analysis.figures import Figure
from harness.measurements import MEASUREMENTS, Measurement, Table, key
from harness.measurements.base import conforms, hints
from models.kv_cache import CACHE_KINDS
from tests.helpers import NO_REPORT, REPO, run_py
from tests.helpers import inproc
from tests.helpers.inproc import compose_cfg

SMALL = ["model=tiny", "n_prompts=1", "new_tokens=4", "prompt_len=4", "repeats=1", "warmup=0", "context_lengths=[8]",
         "drift_text_len=12", "max_len=32", "batch_sizes=[1,2]", "batch_context=8", "tracking=disabled"]


def run_here(tmp_path, monkeypatch, overrides) -> tuple[dict, Path]:
    """One run in this process (so a measurement registered by the test is seen), into ``tmp_path/run``."""
    out = tmp_path / "run"
    return inproc.run_here(monkeypatch, overrides, out), out


# ---- the declarations --------------------------------------------------------------------------------------------

def test_every_measurement_declares_its_keys_tables_and_options_fully():
    seen = {}
    for name, cls in MEASUREMENTS.items():
        assert cls.name == name and cls.about and "\n" not in cls.about
        assert dataclasses.is_dataclass(cls.Result) and cls.Result.__dataclass_params__.frozen
        types = hints(cls.Result)
        for f in cls.fields():
            assert f.metadata.get("meaning"), f"{name}.{f.name} has no meaning"
            assert f.name not in seen, f"{f.name} is declared by {seen.get(f.name)} and {name}"
            assert conforms(None, types[f.name]) or types[f.name] in (int, float, bool, str)
            seen[f.name] = name
        for f in dataclasses.fields(cls.Options):
            assert f.metadata.get("meaning"), f"option {f.name} of {name} has no meaning"
        for t in cls.tables:
            assert t.columns[:len(t.on)] == t.on and t.file.endswith(".csv")
        for need in cls.needs:
            assert list(MEASUREMENTS).index(need) < list(MEASUREMENTS).index(name), f"{name} runs before {need}"
        for p in cls.panels:  # a line draws history keys, a bar headline keys (the W&B Report's summary)
            assert p.kind in ("line", "bar")
            assert all(y in cls.history for y in p.y) if p.kind == "line" else set(p.y) <= set(
                measurements.shown_keys("wandb"))
    run_keys = {f.name for part in record.PARTS for f in dataclasses.fields(part)}
    assert not run_keys & set(seen), "a key is both the run's and a measurement's"


def test_a_run_writes_only_declared_keys_of_their_declared_types(tmp_path, monkeypatch):
    rec, out = run_here(tmp_path, monkeypatch, [*SMALL, "dtype=fp16"])
    assert rec["status"] == "ok", rec.get("error")
    saved = json.loads((out / "results.json").read_text())
    assert measurements.undeclared(saved) == []
    assert measurements.check_result_types(saved) == []
    for name, ran in measurements.results_of(saved).items():  # each measurement ran, or says why it did not
        assert ran or f"{name}_skipped" in saved or MEASUREMENTS[name].optional, name  # (optional: not named)
    assert "compile=false" in saved["compile_skipped"]


@pytest.mark.slow
def test_keys_cli_prints_every_key_a_run_can_write():
    proc = subprocess.run([sys.executable, "-m", "harness.measurements", "--keys"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    assert all(len(r) == 4 and all(r) for r in rows)
    by_key = {r[0]: r for r in rows}
    assert len(by_key) == len(rows)
    for name, cls in MEASUREMENTS.items():
        for f in cls.fields():
            assert by_key[f.name][1] == name and f.metadata["meaning"] in by_key[f.name][3]
    assert by_key["status"][1] == "run" and by_key["drift_kl"][2] == "float"
    assert by_key["first_diff_step"][2] == "int | None"
    assert all(f"cache_{o}" in by_key for c in CACHE_KINDS.values() for o in c.option_types())


def test_docs_results_md_is_generated_from_the_registry():
    doc = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    assert doc == measurements.results_doc(), "docs/results.md is stale: run `make docs`"


def test_no_function_in_harness_or_models_is_longer_than_60_lines():
    import ast

    long = []
    for path in sorted([*(REPO / "harness").rglob("*.py"), *(REPO / "models").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert long == []


def test_readers_look_results_up_by_declared_names():
    from harness.measurements import KEYS

    declared = measurements.declared_names()
    assert KEYS.drift_kl == "drift_kl" and KEYS.ms_median == "ms_median" and KEYS.run_name == "run_name"
    with pytest.raises(AttributeError, match="'drift_kll' is not a results.json key.*--keys"):
        KEYS.drift_kll
    used = set()
    for path in sorted((REPO / "harness").rglob("*.py")):
        used |= {(path.name, k) for k in re.findall(r"\bKEYS\.(\w+)", path.read_text(encoding="utf-8"))}
    assert {f for f, _ in used} >= {"plots.py", "report.py", "tracking.py"}
    assert [(f, k) for f, k in sorted(used) if k not in declared] == []


# ---- choosing what runs ------------------------------------------------------------------------------------------

def test_only_the_chosen_measurements_run(tmp_path, monkeypatch):
    rec, out = run_here(tmp_path, monkeypatch, [*SMALL, "measurements=[equivalence,memory]"])
    assert rec["status"] == "ok", rec.get("error")
    saved = json.loads((out / "results.json").read_text())
    assert not (out / "steps.csv").exists() and not (out / "batches.csv").exists()
    assert not [k for k in saved if k.startswith(("step_ms_", "probe_", "ttft", "tokens_per_s"))]
    assert not [k for k in saved if k.endswith("_skipped")]  # not asked for is not "skipped"
    assert saved["measurements"] == "equivalence,memory" and saved["tokens_identical"] and saved["nbytes_match"]
    assert {"drift.csv", "memory.csv", "results.json", "run.log"} <= {p.name for p in out.iterdir()}
    text = (out / "run.log").read_text()
    assert "cache bytes" in text and "decode step" not in text


@pytest.mark.parametrize("value,message", [("[equivalence,bogus]", "unknown measurement 'bogus'"),
                                           ("[]", "measurements is empty")])
def test_an_unknown_measurement_is_refused_in_one_line_listing_the_names(value, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg([f"measurements={value}"]), 1024)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert all(name in str(e.value) for name in MEASUREMENTS)


def test_a_measurement_that_does_not_apply_says_why(tmp_path, monkeypatch):
    rec, out = run_here(tmp_path, monkeypatch, [*SMALL, "measurements=[equivalence,text_drift,batches]",
                                                "batch_sizes=null"])
    assert rec["status"] == "ok"  # not applying is not a failure
    assert "fp32 reference" in rec["text_drift_skipped"] and "batch_sizes" in rec["batches_skipped"]
    assert "drift_kl" not in rec and not (out / "layers.csv").exists()


def test_the_default_still_runs_every_measurement_and_keeps_the_config_id():
    """A run that names no measurements makes every one but the optional (the long-context tasks, which run only
    when named)."""
    cfg = compose_cfg(["model=tiny"])
    optional = [n for n, cls in MEASUREMENTS.items() if cls.optional]
    assert optional == ["niah", "mqar"]
    assert cfg.measurements is None and measurements.chosen(None) == [n for n in MEASUREMENTS if n not in optional]
    # a config without the key (every run made before it existed) has the same identity
    plain = {k: v for k, v in cfg.items() if k != "measurements"}
    from omegaconf import OmegaConf

    from harness.experiment.config import config_id
    assert config_id(cfg) == config_id(OmegaConf.create(plain))
    assert config_id(compose_cfg(["model=tiny", "measurements=[memory]"])) != config_id(cfg)


# ---- a measurement added from this file, and nothing else changed ------------------------------------------------

def _draw_context_tokens(df):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.bar(df["cache_label"], df["context_tokens_total"])
    return fig


class ContextTokens(Measurement):
    name = "context_tokens"
    about = "tokens every prompt and generation put in the cache (a test's measurement)"

    @dataclass(frozen=True)
    class Result:
        context_tokens_total: int = key("prompt + generated tokens over every prompt", "tokens")

    tables = (Table("context_tokens", "context_tokens.csv", on=("prompt",), columns=("prompt", "tokens")),)
    def run(self):
        per = [p.shape[1] + self.ctx.new_tokens for p in self.ctx.prompts]
        return self.Result(context_tokens_total=sum(per)), {"context_tokens": pd.DataFrame(
            {"prompt": range(len(per)), "tokens": per})}

    @classmethod
    def summary(cls, r, tables):
        return [f"  context tokens    {r['context_tokens_total']} (prompts + generated)"]


CONTEXT_FIGURE = Figure("context_tokens", "runs", _draw_context_tokens, "Tokens the prompts put in the cache.",
                        by=("context_tokens",))


@pytest.fixture
def registered(monkeypatch):
    """The measurement registered, and its figure declared where every figure is (harness.analysis.figures)."""
    monkeypatch.setattr(figures, "FIGURES", (*figures.FIGURES, CONTEXT_FIGURE))
    measurements.register(ContextTokens)
    try:
        yield ContextTokens
    finally:
        MEASUREMENTS.pop(ContextTokens.name)


def test_adding_a_measurement_is_one_module(tmp_path, monkeypatch, registered):
    rec, out = run_here(tmp_path, monkeypatch, [*SMALL, "n_prompts=2", "measurements=[memory,context_tokens]"])
    assert rec["status"] == "ok", rec.get("error")
    saved = json.loads((out / "results.json").read_text())
    assert saved["context_tokens_total"] == 2 * (4 + 4)
    assert "context tokens    8" not in (out / "run.log").read_text()
    assert "context tokens    16 (prompts + generated)" in (out / "run.log").read_text()
    table = pd.read_csv(out / "context_tokens.csv")
    assert list(table.tokens) == [8, 8] and table["run_name"].eq("run").all()
    assert "context_tokens_total\tcontext_tokens\tint\t" in measurements.keys_text()
    rep = report.build_report(out, tmp_path / "rep")
    assert "context_tokens" in rep["images"] and rep["images"]["context_tokens"].stat().st_size > 0
    page = rep["html"].read_text()
    assert "Tokens the prompts put in the cache." in page
    assert (tmp_path / "rep" / "context_tokens.csv").is_file()


class PromptSums(Measurement):
    """A throwaway measurement that uses every hook the run layer calls generically: the inputs it builds for itself,
    a check once the model is known, a memory phase and a file it reads."""

    name = "prompt_sums"
    about = "sums of prompts it draws itself (a test's measurement)"
    marker: Path | None = None  # the file it reads (set by the test)

    @dataclass(frozen=True)
    class Result:
        prompt_sums_total: int = key("the sum of the token ids of the prompts it built", "")
        prompt_sums_vocab: int = key("the model's vocabulary, as its checks saw it", "tokens")

    @classmethod
    def check_plan(cls, opts, s):
        if s.prompt_len == 5:
            raise ConfigError(f"prompt_sums refuses prompt_len=5 on a model of {s.model.vocab_size} tokens")

    @classmethod
    def memory(cls, s, opts):
        return [("prompt_sums_phase", 0, 10 ** 15 if s.batch == 3 else 1)]

    @classmethod
    def inputs(cls, opts, src, s):
        return {"sums_of": [int(p.sum()) for p in src.prompts(3, s.prompt_len)], "vocab": s.model.vocab_size}

    @classmethod
    def files(cls, opts):
        return [str(cls.marker)] if cls.marker else []

    def run(self):
        return self.Result(prompt_sums_total=sum(self.ctx.inputs["sums_of"]),
                           prompt_sums_vocab=self.ctx.inputs["vocab"])


def test_a_measurement_gets_its_inputs_checks_memory_and_files_from_the_run(tmp_path, monkeypatch):
    """The run calls a new measurement's hooks without naming it: the inputs it builds reach it, its check once the
    model is known refuses in one line, its memory phase is the run's peak, the file it reads is part of the run's
    inputs (a changed file: a resumed run measures again)."""
    from harness.core.inputs import random_prompts

    measurements.register(PromptSums)
    try:
        PromptSums.marker = tmp_path / "marker.txt"
        PromptSums.marker.write_text("one")
        rec, out = run_here(tmp_path, monkeypatch, [*SMALL, "prompts=random", "measurements=[prompt_sums]"])
        assert rec["status"] == "ok", rec.get("error")
        want = sum(int(p.sum()) for p in random_prompts(3, rec["prompt_len"], rec["prompt_sums_vocab"],
                                                        rec["seed"]))
        assert rec["prompt_sums_total"] == want
        first = rec["inputs_trace"]
        PromptSums.marker.write_text("two")
        again, _ = run_here(tmp_path, monkeypatch, [*SMALL, "prompts=random", "measurements=[prompt_sums]"])
        assert again["status"] == "ok" and again["inputs_trace"] != first
        refused, _ = run_here(tmp_path, monkeypatch, [*SMALL, "prompt_len=5", "measurements=[prompt_sums]"])
        assert refused["status"] == "failed" and (f"prompt_sums refuses prompt_len=5 on a model of "
                                                  f"{rec['prompt_sums_vocab']} tokens") in refused["error"]
        big, _ = run_here(tmp_path, monkeypatch, [*SMALL, "batch=3", "measurements=[prompt_sums]"])
        assert big["status"] == "failed" and "at its peak in prompt_sums_phase" in big["error"]
    finally:
        MEASUREMENTS.pop(PromptSums.name)
        PromptSums.marker = None


# ---- the conformance suite over MEASUREMENTS ---------------------------------------------------------------------

KVLAB_KINDS = ",".join(CACHE_KINDS)
HF_KINDS = ["concat", "prealloc"]


# the every-kind sweep evicts: 40 + 8 tokens against window S4+W32 (36 slots) and budgets of 32; its retrieval
# passes (2 x 24 tokens, not max_len's 2 x 64) evict too, at two fifths of the decode steps
EVERY_KIND = ["prompt_len=40", "new_tokens=8", "max_len=128", "drift_text_len=48", "retrieval_n=24"]
# and every kind serves a few requests continuously (the server measurement; serve.requests is 0 elsewhere)
# and every kind runs the tasks that run only when named (niah, mqar), as the rest: a few probes
EVERY_MEASUREMENT = [f"measurements=[{','.join(MEASUREMENTS)}]", "niah_k=1", "niah_depths=4", "mqar_k=2"]
SERVED = ["serve.requests=3", "serve.kv_budget=400KB", "serve.max_tokens=6", "serve.prompt_most=24",
          "serve.prompt_median=10", "serve.output_median=4", "serve.rate=inf"]
FULL_ATTENTION = [k for k, cls in CACHE_KINDS.items() if cls.full_attention(cls.Options())]


@pytest.fixture(scope="module")
def conformance(tmp_path_factory):
    """Sweeps of every kind on both engines (every kind in fp32 on ours, the full-attention kinds in fp16 too, so
    that each drifts somewhere), two budgets of an evicting kind and a window, and one compiled run: the runs and
    their sweep reports."""
    tmp = tmp_path_factory.mktemp("conformance")
    sweeps = {"kvlab": ["-m", f"cache={KVLAB_KINDS}", "dtype=fp32", "engine=kvlab", *EVERY_KIND, *SERVED,
                        *EVERY_MEASUREMENT],
              # the fp16 sweeps' reports would draw nothing the others do not: none is made
              "kvlab16": ["-m", f"cache={','.join(FULL_ATTENTION)}", "dtype=fp16", "engine=kvlab", NO_REPORT],
              "budgets": ["-m", "cache=h2o,window", "cache.budget=16,24", "engine=kvlab", *EVERY_KIND],
              # HF's exact caches and its QuantizedCache (4 bits, K per token: the layout quanto runs), beside ours
              "hf": ["-m", "engine=kvlab,hf", f"cache={','.join(HF_KINDS)},quant/token", "dtype=fp32",
                     "context_lengths=[8,32]", "max_len=40"],
              "hf16": ["-m", "cache=concat", "dtype=fp16", "dtype.compute=fp16", "engine=hf", NO_REPORT],
              # llama.cpp's K/V buffer in the storage dtype (exact) and with a q4_0 V (lossy); no test reads its
              # report, so it draws none (a report takes longer than both runs)
              "llamacpp": ["-m", "cache=prealloc", "engine=llamacpp", "engine.type_v=auto,q4_0",
                           NO_REPORT],
              # a re-positioned window streaming past a rotary model's 128 positions (the report's stream figure)
              "stream": ["-m", "model=tiny-gqa", "cache=window", "cache.positions=cache", "cache.sinks=0,1",
                         "max_len=256", "drift_text_len=256"]}
    out = {}
    for name, args in sweeps.items():
        own = {a.split("=")[0] for a in args if "=" in a}  # what this sweep sets itself
        small = [a for a in SMALL if a.split("=")[0] not in own]
        proc = run_py([*args, *small, f"hydra.sweep.dir={tmp / name}"], tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = tmp / name
        (tmp / f"{name}.stdout").write_text(proc.stdout)  # what the sweep printed
    proc = run_py([*SMALL, "compile=true", "cache=prealloc", f"hydra.run.dir={tmp / 'compiled'}"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out["compiled"] = tmp / "compiled"
    return out


def _runs(folders) -> list[tuple[Path, dict]]:
    found = []
    for f in folders:
        for p in sorted(Path(f).rglob("results.json")):
            if "report" not in p.parts:
                found.append((p.parent, json.loads(p.read_text())))
    return found


@pytest.mark.slow
def test_every_measurement_runs_on_every_kind_and_engine_where_it_applies(conformance):
    runs = _runs(conformance.values())
    assert len(runs) == len(CACHE_KINDS) + len(FULL_ATTENTION) + 4 + 2 * (len(HF_KINDS) + 1) + 1 + 1 + 2 + 2
    ran = {name: set() for name in MEASUREMENTS}
    for folder, r in runs:
        assert r["status"] == "ok", (folder, r.get("error"))
        assert measurements.undeclared(r) == [] and measurements.check_result_types(r) == []
        named = set((r.get("measurements") or "").split(","))
        for name, did in measurements.results_of(r).items():
            if MEASUREMENTS[name].optional and name not in named:  # runs only when named: neither ran nor skipped
                assert not did and f"{name}_skipped" not in r, (folder, name)
                continue
            assert did != (f"{name}_skipped" in r), (folder, name)  # it ran, or it says why not
            if did:
                ran[name].add((r["cache"], r["engine"]))
        for name, t in measurements.tables().items():
            f = folder / t["file"]
            makers = [m for m in t["by"] if measurements.results_of(r)[m]]
            assert f.is_file() == bool(makers), (folder, name)
            if makers:
                cols = pd.read_csv(f).columns
                assert set(t["columns"]) <= set(cols) and set(measurements.IDENTITY_COLUMNS) <= set(cols)
    for name in ("equivalence", "memory", "step_time", "peak_memory", "bandwidth", "batches", "serving"):
        assert ran[name] == ({(k, "kvlab") for k in CACHE_KINDS} | {(k, "hf") for k in HF_KINDS + ["quant"]}
                             | {("prealloc", "llamacpp")}), name
    for name in ("generation_drift", "text_drift"):  # every kind: in fp32, or in fp16 where fp32 is its reference
        assert {k for k, e in ran[name] if e == "kvlab"} == set(CACHE_KINDS), name
        assert {("concat", "hf"), ("quant", "hf")} <= ran[name], name  # HF in fp16, and its lossy QuantizedCache
        assert ("prealloc", "llamacpp") in ran[name], name  # llama.cpp's kernels drift from kvlab's fp32
    served = {(r["cache_label"], r["cache_exact"], r["engine_threads"] == r["threads"])
              for _, r in _runs([conformance["llamacpp"]])}  # engine.threads=0: as many as torch's
    assert served == {("prealloc · llamacpp", True, True), ("prealloc · llamacpp K f32 V q4_0", False, True)}
    assert {r["engine_threads"] for _, r in runs if r["engine"] != "llamacpp"} == {None}
    assert ran["compile"] == {("prealloc", "kvlab")}
    assert {k for k, e in ran["retrieval"] if e == "kvlab"} == set(CACHE_KINDS)
    assert ran["server"] == {(k, "kvlab") for k in CACHE_KINDS}  # every kind serves (each request checked)
    for name in ("niah", "mqar"):  # named, every kind runs them; the runs that name no measurements do not
        assert ran[name] == {(k, "kvlab") for k in CACHE_KINDS}, name
    assert [name for name in MEASUREMENTS if not ran[name]] == []  # a measurement registered later runs here too


@pytest.mark.slow
def test_hf_is_a_peer_in_the_grid(conformance):
    """`-m engine=kvlab,hf cache=concat,prealloc,quant/token`: six comparable runs, measured the same way, told
    apart by their engine in every table (quant with K per token on both: the one layout quanto runs)."""
    sweep, kinds = conformance["hf"], ("concat", "prealloc", "quant")
    got = {(r["engine"], r["cache"]): r for _, r in _runs([sweep])}
    assert set(got) == {(e, c) for e in ("kvlab", "hf") for c in kinds}
    for (engine, cache), r in got.items():
        assert r["status"] == "ok" and r["nbytes_match"] and r["nbytes_curve_match"], r
        assert r["tokens_identical"] or cache == "quant", r
        label = "quant k4/v4 g32 K/token" if cache == "quant" else cache
        assert cache != "quant" or (r["cache_k_axis"], r["cache_v_axis"], r["cache_quantize"]) == ("token", "token",
                                                                                                  "kv")
        assert r["cache_label"] == (label if engine == "kvlab" else f"{label} · hf")
    for e in ("kvlab", "hf"):  # same weights, same bytes: HF's exact caches hold what ours hold
        assert got[(e, "concat")]["cache_nbytes"] == got[("kvlab", "concat")]["cache_nbytes"]
        assert got[(e, "prealloc")]["cache_nbytes"] == got[("kvlab", "prealloc")]["cache_nbytes"]
    for e in ("kvlab", "hf"):  # both quantised caches drift off fp32, and a token costs less than in fp32
        q = got[(e, "quant")]
        assert q["drift_kl"] > 0 and q["bytes_per_token"] < got[(e, "concat")]["bytes_per_token"] / 2
    steps = pd.read_csv(sweep / "report" / "steps.csv")
    assert set(steps.engine) == {"kvlab", "hf"} and steps.cache_label.nunique() == 6
    # ours / HF from this one sweep: every (cache, context) at batch 1 from steps.csv, and batch 2 from batches.csv
    ratios = pd.read_csv(sweep / "report" / "engine_ratios.csv")
    settings = ("concat", "prealloc", "quant k4/v4 g32 K/token")  # each kind with its options
    assert set(zip(ratios.cache, ratios.context_len, ratios.batch)) == {
        (c, t, 1) for c in settings for t in (8, 32)} | {(c, 8, 2) for c in settings}
    cached = steps[steps["mode"] == "cached"].set_index(["cache_label", "context_len"]).ms_median
    for _, r in ratios[ratios.batch == 1].iterrows():
        assert r.ours_over_hf == pytest.approx(cached[r.cache, r.context_len] / cached[f"{r.cache} · hf",
                                                                                      r.context_len])
    assert "ours / HF cached decode-step time" in (sweep.parent / "hf.stdout").read_text()
    batches = pd.read_csv(sweep / "report" / "batches.csv")
    for _, g in batches.groupby("run_name"):
        g = g.set_index("batch")
        assert g.loc[2, "kv_bytes"] == 2 * g.loc[1, "kv_bytes"] and g.loc[2, "weight_bytes"] == g.loc[1, "weight_bytes"]
        assert g.loc[2, "tokens_per_s"] == pytest.approx(2 / (g.loc[2, "ms_median"] * 1e-3))


@pytest.mark.slow
def test_every_kind_serves_requests_each_equal_to_its_run_alone(conformance):
    """The every-kind sweep serves 3 requests on each kind (serve.*): requests.csv, tokens.csv and timeline.csv
    agree with the record, the budget is never exceeded, and the sweep's findings compare each kind with prealloc."""
    for folder, r in _runs([conformance["kvlab"]]):
        requests = pd.read_csv(folder / "requests.csv")
        tokens = pd.read_csv(folder / "tokens.csv")
        timeline = pd.read_csv(folder / "timeline.csv")
        assert len(requests) == r["server_requests"] == r["server_requests_identical"] == 3, r["cache"]
        assert requests["identical"].all() and len(tokens) == requests["output_tokens"].sum()
        assert r["server_ttft_ms_p99"] == pytest.approx(np.percentile(requests["ttft_ms"], 99))
        assert (timeline["kv_held_bytes"] <= r["server_kv_budget"]).all()
        assert (timeline["kv_used_bytes"] <= timeline["kv_held_bytes"]).all()
    text = (conformance["kvlab"] / "report" / "findings.md").read_text()
    assert "paged(block_size=16) over prealloc under 0.4 MB, requests running at once (peak)" in text
    assert "(n = 1: no interval)" in text and "20.4% - 38.2%" in text


@pytest.mark.slow
def test_every_figure_draws_from_a_sweep(conformance):
    drawn = set()
    for name in ("kvlab", "budgets", "hf", "stream"):
        rep = conformance[name] / "report"
        drawn |= {p.stem for p in rep.glob("*.png") if p.stat().st_size > 0}
        assert (rep / "report.html").is_file()
    # the leaderboard's figures: drawn by experiment=leaderboard's own sweep (tests/experiment/test_leaderboard.py)
    assert {f.stem for f in figures.FIGURES if f.table != "leaderboard"} <= drawn


@pytest.mark.slow
def test_every_kind_sweeps_beside_the_others(conformance):
    """`-m cache=<every kind>`: each run is measured the same way, exact kinds equal their references, lossy,
    windowed and evicting ones report drift, bytes match each kind's formula, and the report draws them side by
    side."""
    sweep = conformance["kvlab"]
    runs = {r["cache"]: r for _, r in _runs([sweep])}
    assert set(runs) == set(CACHE_KINDS) and all(r["status"] == "ok" for r in runs.values())
    for kind, r in runs.items():
        cls = CACHE_KINDS[kind]
        assert r["cache_exact"] == cls.exact and r["cache_label"] == cls.label(cls.Options())
        assert r["nbytes_match"] and r["nbytes_curve_match"]
        if cls.exact:
            assert r["tokens_identical"] and r["max_abs_logit_diff"] <= 1e-4
        plain = cls.full_attention(cls.Options())
        assert ("drift_kl" not in r) == plain
        memory = pd.read_csv(Path(r["run_dir"]) / "memory.csv")
        assert memory.nbytes_measured.notna().sum() == r["new_tokens"]
        if cls.evicts and kind != "duo":  # 47 tokens stored, 32 held: the policy dropped some, and the outputs moved
            assert r["cache_tokens"] == 32 and r["drift_max_abs"] > 1e-3, kind
    # duo's streaming heads hold sinks + recent = 16 + 64 at its defaults, more than the 47 tokens: it runs and
    # measures beside the others here; its eviction is the cache kinds' conformance suite's (tests/models)
    assert runs["duo"]["cache_tokens"] == 80 and runs["duo"]["nbytes_match"]
    assert runs["window"]["drift_max_abs"] > 1e-3 and runs["window"]["cache_tokens"] == 36
    assert runs["quant"]["cache_nbytes"] < 0.3 * runs["prealloc"]["cache_nbytes"]  # 4-bit, 128 slots, no fp32 tail
    report = sweep / "report"
    assert (report / "memory.png").is_file() and (report / "drift.png").is_file()
    table = pd.read_csv(report / "results.csv")
    assert table.cache_label.nunique() == len(CACHE_KINDS)
    assert "window S4+W32" in (report / "report.html").read_text()


@pytest.mark.slow
def test_a_budget_sweep_draws_quality_against_budget(conformance):
    """`-m cache=h2o,window cache.budget=16,24`: the window's budget is its sinks + window, each run holds its
    budget, and the report's budget figure draws both kinds at both sizes."""
    runs = [r for _, r in _runs([conformance["budgets"]])]
    assert sorted((r["cache"], r["cache_tokens"]) for r in runs) == [("h2o", 16), ("h2o", 24), ("window", 16),
                                                                     ("window", 24)]
    for r in runs:
        assert r["status"] == "ok" and r["nbytes_match"] and r["drift_delta_nll"] is not None
        if r["cache"] == "window":
            assert r["cache_window"] == r["cache_budget"] - r["cache_sinks"]
    from harness.analysis import plots

    drawn = plots.budget_quality(pd.DataFrame(runs))
    assert len(drawn) == 4 and (conformance["budgets"] / "report" / "budget.png").stat().st_size > 0
    assert plots.budget_quality(pd.DataFrame([r for _, r in _runs([conformance["kvlab"]])])).empty  # one size each


def test_a_programmatic_run_on_an_engine(tiny_model):
    from harness.core.engines import KvlabEngine
    from harness.core.measure import CacheSpec

    e = KvlabEngine(tiny_model)
    rec, tables = measurements.run_on(e, CacheSpec("concat", {}, torch.float32), [torch.tensor([[464, 3290]])], 5,
                                      names=["equivalence", "memory"])
    assert rec["tokens_identical"] and rec["nbytes_match"] and set(tables) == {"drift", "memory", "heads"}
    assert list(tables["drift"].columns) == measurements.table("drift")["columns"]


# ---- retrieval ---------------------------------------------------------------------------------------------------

def test_retrieval_draws_only_tokens_the_model_can_tell_apart(tiny_model):
    import copy

    from harness.core.copying import copy_accuracy, copy_sequences, distinct_ids

    m = copy.deepcopy(tiny_model)
    with torch.no_grad():
        m.transformer.wte.weight[1000:] = m.transformer.wte.weight[999]  # every id from 999 on shares one row
    ids = distinct_ids(m)
    assert ids.tolist() == list(range(999))
    seqs = copy_sequences(ids, 7, 3, seed=0)
    assert all(s.shape == (1, 14) and torch.equal(s[0, :7], s[0, 7:]) and int(s.max()) < 999 for s in seqs)
    assert not torch.equal(seqs[0], seqs[1])
    perfect = torch.nn.functional.one_hot(seqs[0][0, 1:], 50257).float()  # logits that predict every next token
    assert copy_accuracy(perfect, seqs[0], 7) == (1.0, 1.0)
    wrong = torch.roll(perfect, 1, dims=-1)
    assert copy_accuracy(wrong, seqs[0], 7) == (0.0, 0.0)


@pytest.mark.slow
def test_a_window_loses_what_full_attention_retrieves_on_the_shipped_mini():
    """On the reference model (which copies), a 64-token window cannot copy a 200-token sequence seen 200 tokens
    ago, while an exact kind's retrieval_acc equals its fp32 full-attention reference."""
    from harness.core.engines import KvlabEngine
    from harness.core.measure import CacheSpec
    from models.gpt2 import GPT2

    model = GPT2.from_pretrained(REPO / "models" / "weights" / "mini").eval()
    e = KvlabEngine(model)
    got, tables = {}, {}
    for kind, opts in (("prealloc", {}), ("window", {"window": 64, "sinks": 4})):
        got[kind], tables[kind] = measurements.run_on(e, CacheSpec(kind, opts, torch.float32),
                                                      [torch.tensor([[464, 3290]])], 2, names=["retrieval"],
                                                      max_len=400, retrieval_n=200, retrieval_k=2)
    full, window = got["prealloc"], got["window"]
    for kind, rows in ((k, t["retrieval_positions"]) for k, t in tables.items()):  # a row per copied token
        assert len(rows) == 400 and rows.groupby("sequence").seq_id.nunique().tolist() == [1, 1]
        assert rows.correct.mean() == pytest.approx(got[kind]["retrieval_acc"])
        assert rows.correct_ref.mean() == pytest.approx(got[kind]["retrieval_acc_ref"])
    ids = [t["retrieval_positions"].seq_id.tolist() for t in tables.values()]
    assert len(set(ids[0])) == 2 and ids[0] == ids[1]  # two sequences, the same in both runs: paired
    assert full["retrieval_n"] == window["retrieval_n"] == 200
    assert full["retrieval_acc"] == full["retrieval_acc_ref"] == window["retrieval_acc_ref"]
    chance = 1 / full["retrieval_vocab"]
    assert full["retrieval_acc_ref"] > 100 * chance, "the shipped mini copies (docs/reference-model.md)"
    assert window["retrieval_acc"] < full["retrieval_acc_ref"] / 2, (window, full)


@pytest.mark.parametrize("repeats,probed", [(1, 3), (5, 5), (40, 9)])
def test_the_bandwidth_probe_repeats_as_often_as_the_run_does_within_3_to_9(tiny_model, monkeypatch, repeats, probed):
    """A quick run (repeats=2) probes the machine quickly too; a careful one up to 9 times; the record says how
    often."""
    from harness.core import measure as core
    from harness.core.engines import KvlabEngine
    from harness.core.measure import CacheSpec

    seen = []
    real = core.bandwidth_probe
    monkeypatch.setattr(core, "bandwidth_probe", lambda device, nbytes, repeats=9: seen.append(repeats) or
                        real(device, 1 << 20, repeats=1))
    rec, _ = measurements.run_on(KvlabEngine(tiny_model), CacheSpec("prealloc", {}, torch.float32),
                                 [torch.tensor([[464, 3290]])], 2, names=["step_time", "bandwidth"], repeats=repeats,
                                 warmup=0, contexts=[4], max_len=16)
    assert seen == [probed] and rec["probe_repeats"] == probed

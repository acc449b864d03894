"""Sweep-end report: the sweep's runs as tables, seaborn plots and one self-contained report.html.

Runs by itself at the end of every multirun (``SweepReport``, a Hydra callback named in conf/config.yaml) and by
hand on any outputs/ folder:

    python -m harness.report outputs/multirun/2026-11-29_10-00-00      # writes <folder>/report/
    python -m harness.report outputs/ --out /tmp/all-runs --wandb disabled

``report/`` opens with findings.md (what the sweep found, in sentences made from its numbers, and for a paper
preset each claim beside kvlab's number: harness.analysis.findings), and holds results.parquet/.csv (one row per run),
steps.parquet/.csv (step times), drift.parquet/.csv (per decode step), memory.parquet/.csv (cache bytes vs tokens), a PNG per plot and report.html (tables, images
embedded, fingerprints, weights: opens with no network). Unless tracking is disabled, one W&B run with job_type
"aggregate" in the sweep's group gets the plots and the table, and the files this report wrote as an artifact.

The report folder follows kvlab's ownership rules (harness.common.ownership): every file is listed in the folder's
manifest before it is written; a folder that holds anything kvlab did not write, or that is a run's folder, is
refused in one line and left exactly as it was; one report writer at a time holds the folder's lock.
"""

from __future__ import annotations

import argparse
import base64
import html
import contextlib
import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
from hydra.experimental.callback import Callback

from harness import measurements
from harness.common import signals
from harness.common.errors import one_line
from harness.experiment import invocation as invocations
from harness.experiment import records
from harness.analysis import figures, findings, intervals, leaderboard, papers
from harness.common import ownership
from harness.analysis import plots
from harness.analysis import results
from harness.experiment import tracking
from harness.measurements import KEYS
from harness.analysis.results import shown

RUN_COLS = [KEYS.run_name, KEYS.status, KEYS.model, KEYS.model_family, KEYS.n_kv_head, KEYS.engine, KEYS.weights,
            KEYS.cache_label, KEYS.dtype, KEYS.device, KEYS.cache_exact, KEYS.batch, KEYS.prompt_lengths,
            KEYS.slurm_job_id]  # which run: the model's family and K/V heads name what its cache stores


def summary_cols() -> list[str]:
    """The runs table: which run, then every measurement's headline keys (``harness.measurements.shown_keys``)."""
    return RUN_COLS + measurements.shown_keys()


def serving_cols() -> list[str]:
    """The served-batches table: the setting, then every key the serving measurement records."""
    return [KEYS.model, KEYS.engine, KEYS.cache_label, KEYS.dtype, KEYS.batch, KEYS.prompt_lengths,
            *measurements.MEASUREMENTS["serving"].keys()]


FINGERPRINT_COLS = [KEYS.torch_version, KEYS.device_name, KEYS.threads, KEYS.attn_backend, KEYS.tf32,
                    KEYS.git_commit, KEYS.weights, KEYS.weights_source, KEYS.python_version]


def captions() -> dict[str, str]:
    """Figure stem -> its caption (``harness.analysis.figures``)."""
    return figures.captions()


NOT_EQUIVALENT = "not_equivalent"  # an exact kind in fp32 whose tokens differ or whose max |dlogit| > tolerance
NOT_EQUIVALENT_COLS = [KEYS.run_name, KEYS.model, KEYS.engine, KEYS.cache_label, KEYS.dtype, KEYS.device,
                       KEYS.status, KEYS.tokens_identical, KEYS.max_abs_logit_diff, KEYS.equivalence_tol,
                       KEYS.first_diff_step, KEYS.margin_at_first_diff, KEYS.error]
def report_tables() -> tuple[str, ...]:
    """The tables a report writes: the runs, every run table the measurements declare, and the engine ratios."""
    from harness import measurements

    return ("results", *measurements.tables(), "engine_ratios", "leaderboard")
PAGE, SPEC, WANDB = records.REPORT_PAGE, "wandb_report.json", "wandb"  # the page, the W&B Report spec, W&B's folder
CLI_HINT = "give --out a new or empty folder (or one a kvlab report wrote), or move those files away"


def _table(df: pd.DataFrame) -> str:
    t = df.to_html(index=False, na_rep="—", border=0, classes="t", escape=True, float_format=lambda x: f"{x:.4g}")
    return f'<div style="overflow-x:auto">{t}</div>'  # wide tables scroll instead of running off the page


def weights_notice(runs: pd.DataFrame) -> list[str]:
    """What the page says about the weights: which were used, and loudly when one sweep mixes pretrained and
    random weights (their drift figures are not comparable)."""
    if KEYS.weights_detail not in runs:
        return []
    details = sorted(runs[KEYS.weights_detail].dropna().unique())
    kinds = set(runs[KEYS.weights].dropna()) if KEYS.weights in runs else set()
    parts = []
    if {"random", "pretrained"} <= kinds:
        by = runs.groupby(KEYS.weights)[KEYS.run_name].count()
        parts.append('<p style="background:#fee;border:2px solid #c00;padding:8px"><b>Warning: this sweep mixes '
                     f"pretrained weights ({by.get('pretrained', 0)} runs) and random-init weights "
                     f"({by.get('random', 0)} runs).</b> Bytes and step times compare; drift and generated text do "
                     "not: random-init logits are nearly flat. See the <code>weights</code> column.</p>")
    if details:
        parts.append("<p><b>Weights:</b> " + "; ".join(html.escape(w) for w in details) + "."
                     + (" Random-init weights measure the cache exactly (speed, bytes, equivalence) but their drift "
                        "says little about trained models and they generate no meaningful text." if "random" in kinds
                        else "") + "</p>")
    return parts




def _setting(df: pd.DataFrame) -> pd.DataFrame:
    """``cache`` as the cache's label without its engine (``quant k4/v4 g32 · hf`` -> ``quant k4/v4 g32``), so
    that runs of one kind with other options are never pooled together."""
    if KEYS.cache_label not in df:
        return df
    return df.assign(cache=df[KEYS.cache_label].astype(str).str.split(" · ").str[0])


def engine_ratios(steps: pd.DataFrame, batches: pd.DataFrame | None = None) -> pd.DataFrame:
    """Ours / HF cached step time, measured in the same sweep: one row per (model, cache kind and options, dtype,
    device, context length, and batch where batches were timed); below 1 ours is faster. Empty without both
    engines."""
    rows = []
    if KEYS.engine in steps and {"kvlab", "hf"} <= set(steps[KEYS.engine].dropna()):
        s = _setting(steps[(steps[KEYS.mode] == "cached") & (steps.get(KEYS.status, "ok") == "ok")])
        p = s.pivot_table(index=[KEYS.model, KEYS.cache, KEYS.dtype, KEYS.device, KEYS.context_len],
                          columns=KEYS.engine, values=KEYS.ms_median, aggfunc="median").dropna()
        for idx, r in p.iterrows():
            rows.append(dict(zip(p.index.names, idx), batch=1, kvlab_ms=r["kvlab"], hf_ms=r["hf"]))
    if (batches is not None and len(batches) and KEYS.engine in batches
            and {"kvlab", "hf"} <= set(batches[KEYS.engine])):
        b = _setting(batches[batches[KEYS.batch] > 1])
        p = b.pivot_table(index=[KEYS.model, KEYS.cache, KEYS.dtype, KEYS.device, KEYS.context_len, KEYS.batch],
                          columns=KEYS.engine, values=KEYS.ms_median, aggfunc="median").dropna()
        for idx, r in p.iterrows():
            rows.append(dict(zip(p.index.names, idx), kvlab_ms=r["kvlab"], hf_ms=r["hf"]))
    df = pd.DataFrame(rows, columns=[KEYS.model, KEYS.cache, KEYS.dtype, KEYS.device, KEYS.context_len, KEYS.batch,
                                     "kvlab_ms", "hf_ms"])
    df["ours_over_hf"] = df["kvlab_ms"] / df["hf_ms"]
    return df.sort_values([KEYS.model, KEYS.cache, KEYS.batch, KEYS.context_len]).reset_index(drop=True)


def serving_table(ok: pd.DataFrame) -> pd.DataFrame:
    """One row per ok run that served a batch: throughput, waste and the per-sequence check, by cache and batch."""
    if KEYS.tokens_per_s not in ok or ok[KEYS.tokens_per_s].isna().all():
        return pd.DataFrame()
    df = ok[ok[KEYS.tokens_per_s].notna()]
    return df[[c for c in serving_cols() if c in df]].sort_values(
        [c for c in (KEYS.model, KEYS.prompt_lengths, KEYS.batch, KEYS.cache_label) if c in df]).reset_index(drop=True)


def drift_tables(ok: pd.DataFrame) -> list[str]:
    """Drift on text against fp32, one row per (model, cache, dtype), ranked by KL; and where runs sweep K's and V's
    bits separately, a K-vs-V table: ΔNLL and KL by k_bits (rows) x v_bits (columns)."""
    if KEYS.drift_kl not in ok or ok[KEYS.drift_kl].dropna().empty:
        return []
    d = ok[ok[KEYS.drift_kl].notna()]
    names = {**measurements.labels("text_drift"), **measurements.labels("retrieval")}  # key -> its header
    cols = [c for c in names if c in d]
    rank = (d.groupby([KEYS.model, KEYS.weights, KEYS.cache_label, KEYS.dtype], dropna=False)[cols].mean().reset_index()
            .sort_values([KEYS.model, KEYS.drift_kl]).rename(columns=names))
    parts = ["<h2>Drift on text vs fp32 (teacher-forced, every position; llama.cpp's --kl-divergence statistics)</h2>",
             _table(rank)]
    k_bits, v_bits = KEYS.cache_k_bits, KEYS.cache_v_bits
    if {k_bits, v_bits} <= set(d) and d[k_bits].nunique() * d[v_bits].nunique() > 1:
        q = d[d[k_bits].notna() & d[v_bits].notna()]
        for (model, dtype), g in q.groupby([KEYS.model, KEYS.dtype]):
            for col in (KEYS.drift_delta_nll, KEYS.drift_kl):
                t = g.pivot_table(index=k_bits, columns=v_bits, values=col, aggfunc="mean")
                t.index = [f"K {int(b)}-bit" for b in t.index]
                t.columns = [f"V {int(b)}-bit" for b in t.columns]
                parts += [f"<h3>K vs V sensitivity, {html.escape(str(model))} {html.escape(str(dtype))}: "
                          f"{names[col]}</h3>", _table(t.reset_index(names="K bits \\ V bits"))]
    return parts


def render_html(title: str, runs: pd.DataFrame, steps: pd.DataFrame, images: dict[str, Path],
                skipped: list | None = None, ratios: pd.DataFrame | None = None, found: str = "") -> str:
    """One HTML page with everything inline (images as data: URIs): no network, no other files needed."""
    ok, failed = runs[runs.status == "ok"], runs[runs.status != "ok"]
    not_eq = runs[runs.status == NOT_EQUIVALENT]
    skipped = skipped or []
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p>{len(runs)} runs: {len(ok)} ok, {len(failed)} not ok"
             + (f" ({len(not_eq)} not equivalent)" if len(not_eq) else "")
             + (f"; {len(skipped)} skipped (below)" if skipped else "") + ".</p>"]
    parts += weights_notice(runs)
    if len(not_eq):  # a broken cache must not read as a finding: said first, in red
        parts += ['<h2 style="color:#c00">Not equivalent: exact caches whose output differs from their reference</h2>',
                  '<p style="background:#fee;border:2px solid #c00;padding:8px"><b>'
                  f"{len(not_eq)} run{'s' if len(not_eq) > 1 else ''} of an exact cache kind in fp32 did not "
                  "reproduce the uncached reference</b> (tokens differ, or max |Δlogit| is over the tolerance): a "
                  "failure, not drift. Listed with the failed runs; never plotted, and not in the step, drift or memory "
                  "tables.</p>",
                  _table(not_eq[[c for c in NOT_EQUIVALENT_COLS if c in not_eq]])]
    parts.append(found)  # the Findings section (findings.html_section)
    if len(failed):
        cols = (KEYS.run_name, KEYS.model, KEYS.cache_label, KEYS.dtype, KEYS.device, KEYS.status, KEYS.error)
        parts += ["<h2>Failed runs</h2>", _table(failed[[c for c in cols if c in failed]])]
    if skipped:
        rows = pd.DataFrame([{"folder": shown(f), "why": shown(why)} for f, why in skipped])
        parts += ["<h2>Skipped: could not be read, or never finished</h2>", _table(rows)]
    shown_cols = [c for c in summary_cols() if c in runs and (c != KEYS.slurm_job_id or runs[c].notna().any())]
    parts += ["<h2>Runs</h2>", _table(runs[shown_cols])]  # the Slurm job ids where runs had them
    parts += drift_tables(ok)
    serving = serving_table(ok)
    if len(serving):
        parts += ["<h2>Served batches: throughput and KV waste (held slots that hold no token)</h2>",
                  _table(serving)]
    if ratios is not None and len(ratios):
        parts += ["<h2>Ours vs HF transformers: cached decode-step time, ours / HF (below 1: ours is faster)</h2>",
                  _table(ratios)]
    if len(steps):
        label = KEYS.cache_label if KEYS.cache_label in steps else KEYS.cache
        index = [KEYS.model, KEYS.device, KEYS.dtype, label, KEYS.mode]
        pivot = steps.pivot_table(index=index, columns=KEYS.context_len,
                                  values=KEYS.ms_median, aggfunc="median").reset_index()
        pivot.columns = [f"ctx {c} (ms)" if isinstance(c, (int, float)) else c for c in pivot.columns]
        parts += ["<h2>Decode-step time (median ms)</h2>", _table(pivot)]
    for stem, path in images.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts += [f"<h2>{html.escape(captions().get(stem, stem))}</h2>",
                  f'<figure><img alt="{stem}" src="data:image/png;base64,{data}">'
                  f"<figcaption>{path.name}</figcaption></figure>"]
    fp = runs[[c for c in FINGERPRINT_COLS if c in runs]].drop_duplicates()
    parts += ["<h2>Environment fingerprint</h2>", _table(fp)]
    style = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table.t{border-collapse:collapse;"
             "font-size:13px}table.t td,table.t th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
             "img{max-width:100%}figcaption{color:#666;font-size:12px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")


def _load(path: Path, invocation: str | None) -> dict:
    """Every readable run under ``path`` (with ``invocation``: only that invocation's runs), its tables, and what was
    skipped [(folder, why)]. Writes nothing."""
    found = results.scan(path, invocation)
    skipped = [(f, why) for f, why in found["skipped"]]
    skipped += [(f, "no results.json: the run was interrupted, refused or is still going")
                for f in _unfinished(path, found, invocation)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", results.IncompleteRunWarning)
        runs, frames = results.load_runs(path, invocation), results.load_tables(path, invocation)
    skipped += sorted({(None, str(w.message)) for w in caught if "its rows are missing" in str(w.message)},
                      key=lambda x: x[1])  # tables that could not be read
    if runs.empty:
        raise FileNotFoundError(f"{shown(path)}: no readable kvlab runs (results.json) found under it"
                                + (f"; skipped {len(skipped)}: {shown(skipped[0][1])}" if skipped else ""))
    return dict(runs=runs, skipped=skipped, frames=frames)


def _report_names(names) -> list[str]:
    """Of ``names``, those a kvlab report writes."""
    tables = {f"{s}.{e}" for s in report_tables() for e in ("csv", "parquet")}
    return [n for n in names if n in tables or n in (PAGE, SPEC, WANDB) or re.fullmatch(r"[\w.-]+\.png", n)]


def _own_wandb(out: Path) -> bool:
    """``out/wandb`` holds only the report's own aggregate W&B run (its id is ``wandb_id(out, "report")``)."""
    w = out / WANDB
    if not w.is_dir() or w.is_symlink():
        return False
    rid = re.escape(tracking.wandb_id(out, "report"))
    known = {"cache", "data", "latest-run", "debug.log", "debug-internal.log"}
    inside = ownership.entries(w)
    return bool(inside) and all(n in known or re.fullmatch(rf"(offline-)?run-\d{{8}}_\d{{6}}-{rid}", n)
                                for n in inside)


def _legacy_foreign(out: Path) -> list[str] | None:
    """For a report folder an earlier kvlab wrote before manifests (no manifest, its page is kvlab's): the names in
    it that are not that report's (a ``wandb/`` holding any other W&B run included). None: not such a folder."""
    if (out / ownership.MANIFEST).exists():
        return None
    try:
        with open(out / PAGE, encoding="utf-8", errors="replace") as f:
            if "<title>kvlab report: " not in f.read(4096):
                return None
    except OSError:
        return None
    names = ownership.foreign(out)
    ours = set(_report_names(names))
    return [n for n in names if n not in ours or (n == WANDB and not _own_wandb(out))]


def _refusal(out: Path, hint: str) -> tuple[Exception | None, bool]:
    """(why ``out`` may not take the report, or None; whether it is an earlier report to adopt). Writes nothing."""
    bad = _not_a_folder(out)
    if bad:
        return ownership.NotOurs(bad), False
    rep = records.within_report_folder(out.parent)
    if rep:
        return ownership.NotOurs(f"{shown(out)} lies inside the report folder {shown(rep)}: give --out a folder of "
                                 "its own, outside every report's"), False
    inside = records.within_run_folder(out)
    if inside:
        run, why = inside
        where = "is a run folder" if run == ownership.resolved(out) else f"lies inside the run folder {shown(run)}"
        return ownership.NotOurs(f"{shown(out)} {where} ({why}): give --out a folder of its own, outside every "
                                 "run's folder"), False
    if not ownership.foreign(out):
        return None, False
    legacy = _legacy_foreign(out)
    if legacy == []:
        return None, True
    if legacy:  # an earlier kvlab's report with someone else's files beside it: name those
        listed = ", ".join(repr(n)[1:-1] for n in legacy[:4]) + (f" and {len(legacy) - 4} more"
                                                                  if len(legacy) > 4 else "")
        return ownership.NotOurs(shown(f"report folder {out} holds files kvlab did not write ({listed}); "
                                       f"kvlab never empties or writes into such a folder: {hint}")), False
    try:
        ownership.refuse_foreign(out, "report folder", hint)
    except ownership.NotOurs as e:
        return ownership.NotOurs(shown(str(e))), False
    return None, False


def _not_a_folder(out: Path) -> str | None:
    """Why ``out`` cannot be a folder (None: it is one, or can be made): it, or a path above it, is a file."""
    for f in (out, *out.parents):
        if f.exists() or f.is_symlink():
            return None if f.is_dir() else (f"{shown(out)}: {shown(f)} is a file, not a folder: give --out a new or "
                                            "empty folder")
    return None


def _load_all(paths: list[Path], invocation: str | None) -> dict:
    """``_load`` of each folder, joined: several sweeps (from several machines or clusters) in one report. A run
    found under two of the folders counts once."""
    parts = [_load(p, invocation) for p in paths]
    runs = pd.concat([p["runs"] for p in parts], ignore_index=True)
    same = [c for c in (KEYS.run_name, KEYS.config_id, KEYS.finished_at) if c in runs]
    keep = ~runs[same].astype(str).duplicated()  # one run under two folders (or copied to both) counts once
    frames = {}
    for name in parts[0]["frames"]:
        tables = [p["frames"][name] for p in parts if p["frames"].get(name) is not None]
        frames[name] = pd.concat(tables, ignore_index=True).drop_duplicates() if tables else parts[0]["frames"][name]
    return dict(runs=runs[keep].reset_index(drop=True), frames=frames,
                skipped=[s for p in parts for s in p["skipped"]])


@contextlib.contextmanager
def _report_folder(path: str | Path | list, out: str | Path | None, invocation: str | None, hint: str):
    """Load the runs (of one folder, or of several: then ``out`` is needed), check the report folder may be written
    (refused in one line: ``ownership.NotOurs``, nothing touched), hold its lock, check again under it; yields
    (path, out, loaded), path the first folder."""
    paths = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
    if len(paths) > 1 and not out:
        raise FileNotFoundError("a report over several folders needs --out: a new or empty folder for it")
    path = paths[0]
    out = Path(out) if out else path / "report"
    loaded = _load(path, invocation) if len(paths) == 1 else _load_all(paths, invocation)
    loaded["title"] = " + ".join(shown(p.name) for p in paths)
    bad, _ = _refusal(out, hint)
    if bad:
        raise bad
    if out == path / "report" and (path / ownership.MANIFEST).exists():
        ownership.claim(path, "report")  # the sweep's (or run's) folder lists its report folder as kvlab's
    with ownership.locked(out, "report folder", invocation):
        bad, adopt = _refusal(out, hint)  # another writer may have come and gone while this one waited
        if bad:
            raise bad
        if adopt:
            ownership.adopt(out, set(_report_names(ownership.entries(out))), lambda f: _legacy_foreign(f) == [])
        yield path, out, loaded


def _write(path: Path, out: Path, loaded: dict) -> dict:
    """The report's files in ``out`` (checked and locked by ``_report_folder``), each claimed before it is
    written."""
    runs, skipped, frames = loaded["runs"], list(loaded["skipped"]), loaded["frames"]
    runs = intervals.with_intervals(runs, frames)  # <key>_lo / <key>_hi: each run's quality over its own texts
    if leaderboard.ran(runs):  # experiment=leaderboard: its table beside the others (csv, parquet, W&B), its figures
        frames = {**frames, "leaderboard": leaderboard.table(runs, frames)}
    steps, batches = frames["steps"], frames["batches"]
    ownership.claim(out, PAGE)  # first: the manifest says this is a report's folder (records.run_folder)
    tables = []
    for stem, df in (("results", runs), *frames.items()):
        tables += results.save_table(df, out, stem)
    images = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # matplotlib's glyph warnings for ✓/✗ on minimal fonts
        for stem, (fn, df) in figures.figures_for(runs, frames).items():
            try:
                fig = fn(df)
                buf = io.BytesIO()
                fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
                ownership.claim(out, f"{stem}.png")
                tracking.atomic_write(out / f"{stem}.png", buf.getvalue())
                images[stem] = out / f"{stem}.png"
            except Exception as e:  # one figure's bad input must not cost the report
                skipped.append((None, f"figure {stem} could not be drawn ({one_line(e)})"))
            finally:
                plots.plt.close("all")
    ownership.claim(out, findings.FILE)
    try:
        made = findings.make(runs, frames)
        found, section = findings.markdown(made), findings.html_section(made)
    except Exception as e:  # the findings' bad input must not cost the report
        made, found, section = None, f"# Findings\n\nNone could be made: {one_line(e)}\n", ""
        skipped.append((None, f"the findings could not be made ({one_line(e)})"))
    tracking.atomic_write(out / findings.FILE, found.encode("utf-8", "backslashreplace"))
    board = frames.get("leaderboard")
    if board is not None:
        ownership.claim(out, leaderboard.FILE)
        tracking.atomic_write(out / leaderboard.FILE, leaderboard.markdown(board).encode("utf-8", "backslashreplace"))
        section = leaderboard.html_section(board) + section
    page = out / PAGE
    ratios = engine_ratios(steps, batches)
    if len(ratios):
        tables += results.save_table(ratios, out, "engine_ratios")
    text = render_html(f"kvlab report: {loaded.get('title', shown(path.name))}", runs, steps, images, skipped,
                       ratios, section)
    tracking.atomic_write(page, text.encode("utf-8", "backslashreplace"))
    return dict(runs=runs, tables=tables, images=images, html=page, folder=out, skipped=skipped, ratios=ratios,
                frames=frames, findings=found, claims=made.claims if made else [],
                files=[*tables, out / findings.FILE, *([out / leaderboard.FILE] if board is not None else []),
                       *images.values(), page])


def build_report(path: str | Path, out: str | Path | None = None, invocation: str | None = None,
                 hint: str = CLI_HINT) -> dict:
    """Load every readable run under ``path`` (with ``invocation``: only that invocation's runs) and write the report
    folder (default ``path/report``). What could not be read is listed on the page, and in ``skipped``. A folder
    that holds files kvlab did not write, or a run's folder, is refused (``ownership.NotOurs``, one line) and left
    as it was. Returns tables, images (stem -> PNG path), html, the runs DataFrame, skipped [(folder, why)] and
    files (every file this report wrote)."""
    with _report_folder(path, out, invocation, hint) as (path, out, loaded):
        return _write(path, out, loaded)


def _unfinished(path: Path, found: dict, invocation: str | None) -> list[Path]:
    """Run folders under ``path`` with no results.json that belong in this report: every job folder without one;
    with ``invocation``, those it started (a run it started and that was refused or died included)."""
    if invocation is None:
        return list(found["interrupted"])
    mine = {ownership.resolved(f) for f in invocations.invocation_folders(invocation)}  # the run folders it started
    out = [f for f in found["interrupted"] if ownership.resolved(f) in mine]
    if mine:
        root, seen = ownership.resolved(path), {ownership.resolved(f) for f in out}
        seen |= {ownership.resolved(f) for f, _ in found["skipped"]} | {ownership.resolved(f) for f, _ in found["runs"]}
        for f in sorted(mine - seen):
            if (f == root or root in f.parents) and not (f / results.RESULTS).is_file():
                out.append(f)
    return out


def report_and_log(path: Path, mode: str, project: str, entity: str | None, group: str | None = None,
                   out: Path | None = None, invocation: str | None = None, hint: str = CLI_HINT) -> dict:
    """The report, then the aggregate W&B run (under the report folder's lock); a W&B failure is a warning in
    ``rep["wandb"]``, not a failed report. Only the files this report wrote go into the W&B artifact."""
    with _report_folder(path, out, invocation, hint) as (path, out, loaded):
        rep = _write(path, out, loaded)
        runs = rep["runs"]
        group = group or (runs[KEYS.group].dropna().iloc[0] if KEYS.group in runs and runs[KEYS.group].notna().any()
                          else path.name)
        if mode != "disabled":  # one aggregate run per sweep: a report made again replaces it (if it is kvlab's)
            ownership.remove(out, [WANDB])
            ownership.claim(out, WANDB)
        try:
            rep["wandb"] = tracking.log_wandb_aggregate(mode, project, entity, group, out, runs, rep["images"],
                                                        run_id=tracking.wandb_id(out, "report"),
                                                        tables=rep["frames"], page=rep["html"], files=rep["files"])
        except Exception as e:  # the report is written; W&B trouble is said, not fatal
            rep["wandb"] = f"failed: {one_line(e)}"
            print(f"kvlab report: W&B logging failed ({rep['wandb']}); the report is in {shown(out)}",
                  file=sys.stderr)
        if mode != "disabled":
            wandb_report_of(rep, group, project, entity, online=mode == "online" and not tracking.ONLINE_FAILED)
    return rep


def wandb_report_of(rep: dict, group: str, project: str, entity: str | None, online: bool) -> None:
    """The sweep's W&B Report: its spec beside report.html (``wandb_report.json``, always) and, for an online
    sweep, the Report itself, made by ``python -m harness.wandb_report --from-spec`` in a process of its own (a
    bounded wait). Trouble here is a line on stderr, never a failed report."""
    from harness.analysis import wandb_report

    try:
        runs = rep.get("runs")
        logged = None if runs is None else [c for c in runs.columns if runs[c].notna().any()]
        spec = wandb_report.build_spec(group, project, entity, findings=rep.get("findings"), logged=logged)
        ownership.claim(rep["folder"], SPEC)
        rep["wandb_report_spec"] = wandb_report.write_spec(rep["folder"], spec)
    except (ValueError, OSError) as e:
        print(f"kvlab report: no W&B Report spec ({one_line(e)})", file=sys.stderr)
        return
    if not online:
        return
    cmd = [sys.executable, "-m", "harness.wandb_report", "--from-spec", str(rep["wandb_report_spec"])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=wandb_report.SAVE_TIMEOUT_S + 60,
                              cwd=Path(__file__).resolve().parents[2])
        out = (proc.stdout.strip().splitlines() or [""])[-1]
        rep["wandb_report"] = out if proc.returncode == 0 else f"failed: {proc.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired:
        rep["wandb_report"] = "failed: no answer from W&B in time"
    if rep["wandb_report"].startswith("failed"):
        print(f"kvlab report: the W&B Report was not made ({rep['wandb_report']}); publish it later with "
              f"`python -m harness.wandb_report --from-spec {rep['wandb_report_spec']}`", file=sys.stderr)


def print_summary(rep: dict) -> None:
    runs = rep["runs"]
    failed = runs[runs.status != "ok"]
    n_eq = int((failed.status == NOT_EQUIVALENT).sum())
    print(f"kvlab report: {len(runs)} runs ({len(failed)} not ok{f', {n_eq} not equivalent' if n_eq else ''}) -> "
          f"{shown(rep['html'])}")
    if rep.get("findings"):
        print(f"kvlab findings: {shown(rep['folder'] / findings.FILE)}")
        for row in rep.get("claims", []):  # a paper preset: each claim's verdict, the paper's number beside ours
            holm = f" (after Holm: {row.adjusted})" if row.adjusted not in (None, row.verdict) else ""
            print(f"  {papers.verdict_text(row):>15}: {row.claim}{f' [{row.model}]' if row.model else ''}{holm} (paper "
                  f"{row.paper_number}; kvlab "
                  f"{row.our_number}{f'; n = {row.n}' if row.n else ''})")
    ratios = rep.get("ratios")
    if ratios is not None and len(ratios):
        print("kvlab report: ours / HF cached decode-step time (below 1: ours is faster), measured in this sweep:")
        print(ratios.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if rep.get("wandb_report"):
        print(f"kvlab report: W&B Report {rep['wandb_report']}")
    elif rep.get("wandb_report_spec"):
        spec = shown(rep["wandb_report_spec"])
        print(f"kvlab report: W&B Report spec {spec} (publish: `wandb sync` the runs, then "
              f"`python -m harness.wandb_report --from-spec {spec}`)")
    for _, r in failed.iterrows():
        print(f"kvlab: run {r['run_name']} {r['status']}: {r.get('error')}", file=sys.stderr)
    skipped = rep.get("skipped", [])
    for folder, why in skipped[:SKIPPED_SHOWN]:
        print(f"kvlab report: skipped {shown(folder)}{': ' if folder else ''}{shown(why)}", file=sys.stderr)
    if len(skipped) > SKIPPED_SHOWN:  # the page lists every one
        print(f"kvlab report: ... and {len(skipped) - SKIPPED_SHOWN:,} more skipped (each listed with why in "
              f"{shown(rep['html'])})", file=sys.stderr)


SKIPPED_SHOWN = 10  # skipped folders print_summary names one per line; the rest are a count (the page has them all)


def _can_create(folder: Path, what: str) -> None:
    """Stop before any work, in one line, when the outputs folder cannot be made or written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".kvlab-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        print(f"kvlab: cannot write the {what} {folder}: {e.strerror or e}; choose another with "
              f"hydra.{'sweep' if what == 'sweep folder' else 'run'}.dir=...", file=sys.stderr)
        raise SystemExit(2) from None


def _not_in_a_run(look: Path, folder: Path, what: str, key: str) -> None:
    """Stop before any work, in one line, when ``folder`` would be a run's folder or lie inside one (``look``: the
    folder checked, with the folders above it): that run could no longer be resumed or cleared."""
    inside = records.within_run_folder(look)
    if inside:
        run, why = inside
        where = "is a run's folder" if run == ownership.resolved(folder) else f"lies inside the run folder {shown(run)}"
        print(f"kvlab: the {what} {shown(folder)} {where} ({why}); kvlab never puts anything in a run's folder: "
              f"choose a folder outside every run's with hydra.{key}.dir=...", file=sys.stderr)
        raise SystemExit(2)
    rep = records.within_report_folder(look)
    if rep:
        where = "is a report folder" if rep == ownership.resolved(folder) else f"lies inside the report folder {shown(rep)}"
        print(f"kvlab: the {what} {shown(folder)} {where}, where no report would see its runs: choose a folder of "
              f"its own with hydra.{key}.dir=...", file=sys.stderr)
        raise SystemExit(2)


class SweepReport(Callback):
    """Hydra callback: checks the outputs folder can be written before any run; after a multirun, reports on the
    runs of this invocation (each config once). The exit code is read from the runs' files (run.py)."""

    def on_run_start(self, config, **kwargs) -> None:
        _not_in_a_run(Path(config.hydra.run.dir).parent, Path(config.hydra.run.dir), "run folder", "run")
        _can_create(Path(config.hydra.run.dir), "run folder")

    def on_multirun_start(self, config, **kwargs) -> None:
        from harness.experiment import slurm_check

        from harness.experiment import leaderboard as grid

        # a Slurm launcher from a preset or a config of the user's; experiment=leaderboard's grid
        line = slurm_check.composed_refusal(config) or grid.composed_refusal(config)
        if line:
            print(line, file=sys.stderr)
            raise SystemExit(2)
        sweep = Path(config.hydra.sweep.dir)
        _not_in_a_run(sweep, sweep, "sweep folder", "sweep")
        _can_create(sweep, "sweep folder")
        if (sweep / "multirun.yaml").exists() and "multirun.yaml" not in ownership.owned(sweep):
            print(f"kvlab: the sweep folder {shown(sweep)} holds a multirun.yaml kvlab did not write, which Hydra "
                  "would overwrite: choose another with hydra.sweep.dir=...", file=sys.stderr)
            raise SystemExit(2)
        try:
            ownership.claim(sweep, "multirun.yaml")  # Hydra writes it next; the runs go into folders of their own
        except ownership.NotOurs as e:
            print(f"kvlab: the sweep folder {shown(e)}; choose another with hydra.sweep.dir=...", file=sys.stderr)
            raise SystemExit(2) from None
        invocations.invocation()  # made here at the latest, so every job of the sweep inherits it

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)
        t = config.tracking
        try:
            rep = report_and_log(sweep, t.mode, t.project, t.entity,
                                 t.group or tracking.default_group(config.experiment, sweep.name),
                                 invocation=invocations.invocation(),
                                 hint=f"move them away, or write the report elsewhere with `python -m harness.report "
                                      f"{shown(sweep)} --out DIR`")
        except ownership.NotOurs as e:  # nothing of the folder's was touched; the runs' own files are complete
            print(f"kvlab: sweep report not written: {e}", file=sys.stderr)
            invocations.note_failure(f"{sweep} (the sweep report: {e})")
            return
        except Exception as e:  # the runs' own files are already complete: say so and keep the exit code honest
            stop = interrupted_by(e)
            if stop is not None:  # a signal, lost inside another exception (mid-import): stop as it asked
                raise stop from None
            print(f"kvlab: sweep report failed ({one_line(e)}); each run's results are in {shown(sweep)}",
                  file=sys.stderr)
            invocations.note_failure(f"{sweep} (the sweep report)")
            return
        print_summary(rep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report",
                                 description="Report on kvlab runs: tables, plots and report.html.")
    ap.add_argument("path", nargs="+", help="a run or sweep folder (or any folder above several); several folders "
                                            "(sweeps from several machines) make one report, in --out")
    ap.add_argument("--out", help="where to write the report (default: PATH/report)")
    ap.add_argument("--wandb", default="disabled", choices=["offline", "online", "disabled"],
                    help="also log an aggregate W&B run (default: disabled)")
    ap.add_argument("--project", default="kvlab")
    args = ap.parse_args(argv)
    signals.catch_signals()  # SIGTERM, SIGHUP, SIGUSR2 stop it as Ctrl-C does: one line, the lock released
    try:
        rep = report_and_log([Path(p) for p in args.path], args.wandb, args.project, None, None,
                             Path(args.out) if args.out else None)
    except KeyboardInterrupt as e:  # every file is written whole (atomic), and claimed first: the next one replaces it
        return _report_interrupted(e)
    except Exception as e:
        stop = interrupted_by(e)
        if stop is not None:  # a signal mid-import, which the half-loaded module's next use turned into another error
            return _report_interrupted(stop)
        if not isinstance(e, (ownership.NotOurs, OSError)):
            raise
        print(f"kvlab report: {e if isinstance(e, (ownership.NotOurs, FileNotFoundError)) else one_line(e)}",
              file=sys.stderr)
        return 2
    print_summary(rep)
    return 0


def interrupted_by(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or stop signal behind ``e`` (in its chain of causes and contexts), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _report_interrupted(e: KeyboardInterrupt) -> int:
    what, code = signals.interruption(e)
    print(f"kvlab report: interrupted ({what}); the report may be incomplete (each file in it is whole): run the "
          "same command again to make it", file=sys.stderr)
    return code

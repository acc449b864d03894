"""A ready-made W&B Report for a synced sweep: the sweep's charts, grouped the way report.html groups them.

What: one W&B Report (wandb-workspaces, ``wandb_workspaces.reports.v2``) over the runs of one W&B group (a sweep is
one group, ``<experiment>-<sweep folder>``) with job type ``run`` (the sweep's ``aggregate`` run is left out):
decode-step time vs context length (by cache kind, and by dtype), speedup, bytes per token, drift per decode step
(by dtype, and by cache kind), drift on text, the runs that are not ok (failed, interrupted, not equivalent) with
why, and the runs table.

How: in two steps, so that the first needs no network and no W&B at all.

1. ``build_spec(group)`` describes the report as plain JSON (title, description, and panels, each with its title,
   kind, x, y, groupby, the runs filter and the step metric); ``write_spec`` saves it (a sweep's report folder gets
   ``report/wandb_report.json``). The metric and config names are this module's constants (``HISTORY_KEYS``,
   ``SUMMARY_KEYS``, ``CONFIG_KEYS``, ``GROUP_BY``): exactly what ``harness.experiment.tracking`` logs for every run.
2. ``to_report(spec)`` turns a spec into a ``wr.Report`` (offline: nothing is sent), and ``create(spec)`` saves it
   to the W&B server and returns its URL: that step needs ``wandb login`` and the network.

Every chart sits in its own panel grid whose run set is filtered to the group, job type ``run`` and the runs whose
status is ok (``Metric("Group") == '<group>' and Metric("JobType") == 'run' and SummaryMetric("status") == 'ok'``,
wandb-workspaces' filter expression: a failed or not_equivalent run is never drawn as a good one) and grouped by the
chart's keys (``config.cache.kind``, ``config.dtype.name``, ...), so the runs table under each chart shows the same
groups the chart draws. The last two tables list the runs that are not ok, and every run (the spec's ``filters``).

    python -m harness.wandb_report quick-2026-11-30_23-51-40               # create it (entity: your default)
    python -m harness.wandb_report GROUP --entity me --project kvlab
    python -m harness.wandb_report GROUP --spec-only report/               # write the spec, no network
    python -m harness.wandb_report --from-spec outputs/multirun/<time>/report/wandb_report.json  # publish one

Without an API key or a network the command says so in one line (``wandb login``, or ``--spec-only``) and exits 2
within ``--timeout`` seconds per W&B call. Nothing here talks to W&B at import time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
from pathlib import Path

from harness import measurements
from harness.experiment.tracking import atomic_write

PROJECT = "kvlab"  # tracking's default project
JOB_TYPE = "run"  # each measurement's W&B run; the sweep's own run has job type "aggregate"
SPEC_FILE = "wandb_report.json"
SPEC_VERSION = 1
BAD_GROUP_CHARS = "/\\#?%:'\"=<>\n\r\t"  # not in a W&B group name, or not carried by the filter expression
API_TIMEOUT_S = 10.0  # each W&B call the CLI makes gets this long before it says so and stops
SAVE_TIMEOUT_S = 180.0  # saving looks up each run set's project and the report: several calls

# History keys every run logs (harness.experiment.tracking.log_history) -> the step metric they are logged against: what the
# measurements declare (harness.measurements.history_keys).
HISTORY_KEYS = measurements.history_keys()
STEP_METRICS = ("context_len", "decode_step")
# Summary keys (results.json's keys) the report shows: every measurement's headline keys, and which run.
SUMMARY_KEYS = (*measurements.shown_keys("wandb"), "cache_label", "dtype", "model", "model_family", "n_kv_head",
                "status")
# Config keys (the resolved Hydra config, plus tracking's ``effective``) the report groups by or shows.
CONFIG_KEYS = ("cache.kind", "dtype.name", "model.name", "effective.cache_label", "effective.device", "experiment",
               "batch", "prompt_lengths")
# What a panel groups by, in wandb-workspaces' run set syntax ("config.<key>").
GROUP_BY = {"cache": "config.cache.kind", "dtype": "config.dtype.name", "cache_label": "config.effective.cache_label",
            "model": "config.model.name", "batch": "config.batch", "prompt_lengths": "config.prompt_lengths"}
# The runs table's columns, as wandb-workspaces addresses them: "config:<top>.value.<rest>", "summary:<key>".
TABLE_COLUMNS = ["config:model.value.name", "config:effective.value.cache_label", "config:dtype.value.name",
                 "config:effective.value.device"] + [
    f"summary:{k}" for k in ("status", *measurements.shown_keys("wandb"))]

# The not-ok runs table: which run, its status and why.
FAILED_COLUMNS = TABLE_COLUMNS[:4] + ["summary:status", "summary:error"]


class PublishError(RuntimeError):
    """The report could not be created on the W&B server; the message is one line that says what to do."""


def check_group(group: str) -> str:
    """``group`` if it can name a sweep's W&B group here, else ValueError in one line."""
    if not isinstance(group, str) or not group.strip():
        raise ValueError("the W&B group is empty: pass the sweep's group, e.g. quick-2026-11-30_23-51-40")
    bad = sorted({c for c in group if c in BAD_GROUP_CHARS})
    if bad or group != group.strip():
        shown = " ".join(repr(c) for c in bad) or "leading/trailing spaces"
        raise ValueError(f"W&B group {group!r} has characters a group name cannot hold here ({shown})")
    return group


def runs_filter(group: str, ok: bool | None = None) -> str:
    """The run set filter: the group's runs with job type ``run`` (wandb-workspaces' filter expression syntax); with
    ``ok`` True only those whose status is ok (what charts draw), False only those whose status is not (failed,
    interrupted, not_equivalent)."""
    f = f"Metric(\"Group\") == '{check_group(group)}' and Metric(\"JobType\") == '{JOB_TYPE}'"
    return f if ok is None else f"{f} and SummaryMetric(\"status\") {'==' if ok else '!='} 'ok'"


def _unlogged(logged) -> set[str]:
    """The keys of the measurements that run only when named (``optional``) and that none of the sweep's runs logged
    (``logged``: the keys any run has; None: nothing left out)."""
    if logged is None:
        return set()
    optional = [set(cls.keys()) for cls in measurements.MEASUREMENTS.values() if cls.optional]
    return set().union(*(keys for keys in optional if not keys & set(logged)))


def measurement_panels(logged=None) -> list:
    """The charts every registered measurement declares (``Measurement.panels``), in registry order, the step-time
    charts first (what a sweep is usually read for); a measurement that runs only when named draws its charts only
    where the sweep's runs logged its keys (``_unlogged``)."""
    left_out = _unlogged(logged)
    found = [p for _, p in measurements.panels() if not set(p.y) & left_out]
    return sorted(found, key=lambda p: not p.title.startswith(("Decode-step", "Speedup")))


def _panel(title: str, kind: str, y: list[str], groupby: list[str], filters: str, x: str | None = None,
           caption: str = "", **extra) -> dict:
    return dict(title=title, kind=kind, x=x, y=list(y), groupby=list(groupby), filters=filters,
                step_metric=measurements.history_keys()[y[0]] if kind == "line" else None, caption=caption, **extra)


def build_spec(group: str, project: str = PROJECT, entity: str | None = None, findings: str | None = None,
               logged=None) -> dict:
    """The report as plain JSON-able data: title, description, where the runs are, the sweep's findings (the
    markdown of report/findings.md, when the sweep's report made one) and its panels (title, kind line/bar/table, x,
    y, groupby, filters, step_metric, caption, and for charts log_x/log_y; ``logged``: the keys the sweep's runs
    have, so the charts of a measurement they did not make are left out). No network, no W&B."""
    f, everyone, not_ok = runs_filter(group, ok=True), runs_filter(group), runs_filter(group, ok=False)
    left_out = _unlogged(logged)
    panels = [_panel(p.title, p.kind, list(p.y), [GROUP_BY[g] for g in p.groupby], f, p.x, p.caption,
                     **({} if p.kind != "line" else dict(log_x=p.log_x, log_y=p.log_y)))
              for p in measurement_panels(logged)]
    panels += [
        _panel("Runs that are not ok: failed, interrupted, not equivalent", "table", ["status"], [], not_ok, None,
               "Runs whose status is not ok, with the reason; not_equivalent: an exact cache in fp32 whose output "
               "differs from its reference (a failure). The charts above draw ok runs only.",
               columns=FAILED_COLUMNS),
        _panel("Runs", "table", [k for k in SUMMARY_KEYS if k not in left_out], [], everyone, None,
               f"The sweep's runs (job type {JOB_TYPE}); its aggregate run is left out.",
               columns=[c for c in TABLE_COLUMNS if c.removeprefix("summary:") not in left_out]),
    ]
    return dict(
        version=SPEC_VERSION, title=f"kvlab sweep {group}"[:128],
        description=(f"Decode-step time, speedup, cache bytes and drift of the kvlab runs in W&B group {group} "
                     f"(job type {JOB_TYPE}), grouped like the sweep's report.html."),
        entity=entity, project=project, group=group, job_type=JOB_TYPE, filters=everyone, panels=panels,
        findings=findings)


def _spec_path(path: str | Path) -> Path:
    """The spec file a path names: a folder (one that exists, or any path written with a trailing slash) holds
    ``wandb_report.json``; anything else is the file itself."""
    folder = isinstance(path, str) and path.endswith(("/", os.sep))  # Path() drops the slash: ask the text
    path = Path(path)
    return path / SPEC_FILE if folder or path.is_dir() else path


def _write_json(path: Path, spec: dict) -> Path:
    atomic_write(path, lambda f: (json.dump(spec, f, indent=2, ensure_ascii=False), f.write("\n")))
    return path


def write_spec(folder: str | Path, spec: dict) -> Path:
    """Write ``folder/wandb_report.json`` (temporary file, then renamed into place) and return its path."""
    return _write_json(Path(folder) / SPEC_FILE, spec)


def _refuse_not_a_spec(path: Path) -> None:
    """kvlab overwrites only what it wrote: a file at ``path`` that is not a kvlab W&B report spec is refused."""
    if not (path.exists() or path.is_symlink()):
        return
    try:
        spec_from_file(path)
    except ValueError:
        raise ValueError(f"{path} exists and is not a kvlab W&B report spec: kvlab does not overwrite it; write the "
                         "spec elsewhere") from None


SPEC_MAX = 4 * 2 ** 20  # bytes: a spec is a few KB


def spec_from_file(path: str | Path) -> dict:
    """Read a spec written by ``write_spec`` (a file, or a folder holding wandb_report.json); ValueError in one line
    when it is not one."""
    path = _spec_path(path)
    if path.exists():  # sized before it is read: a device or a huge file is not a spec
        from harness.common.ownership import file_problem

        why = file_problem(path, SPEC_MAX)
        if why:
            raise ValueError(f"{path}: not a kvlab W&B report spec ({why})")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({_one_line(e)})") from None
    need = ("title", "project", "group", "filters", "panels")
    missing = [k for k in need if not isinstance(spec, dict) or k not in spec]
    if missing:
        raise ValueError(f"{path}: not a kvlab W&B report spec (no {', '.join(missing)})")
    check_group(spec["group"])
    return spec


def _runset(wr, spec: dict, panel: dict):
    columns = panel.get("columns") or []
    return wr.Runset(entity=spec["entity"], project=spec["project"], name=f"{spec['group']} · {JOB_TYPE}s",
                     filters=panel["filters"], groupby=list(panel["groupby"]), pinned_columns=columns[:3],
                     visible_columns=columns)


def _charts(wr, panel: dict) -> list:
    """The wandb-workspaces panels of one spec panel: a line plot, or a bar plot per metric (their scales differ)."""
    # one key: the panel groups by it as well; several: the panel follows its run set's (nested) grouping
    by = dict(groupby=panel["groupby"][0], groupby_aggfunc="mean", groupby_rangefunc="minmax") \
        if len(panel["groupby"]) == 1 else {}
    if panel["kind"] == "line":
        return [wr.LinePlot(title=panel["title"], x=panel["x"], y=list(panel["y"]), log_x=panel.get("log_x"),
                            log_y=panel.get("log_y"), title_x=panel["x"], layout=wr.Layout(x=0, y=0, w=24, h=9),
                            **by)]
    if panel["kind"] == "bar":
        return [wr.BarPlot(title=f"{panel['title']}: {m}", metrics=[m], orientation="v",
                           layout=wr.Layout(x=12 * (i % 2), y=8 * (i // 2), w=12, h=8), **by)
                for i, m in enumerate(panel["y"])]
    if panel["kind"] == "table":
        return []  # a panel grid's run set is the runs table
    raise ValueError(f"spec panel {panel['title']!r}: unknown kind {panel['kind']!r} (line, bar or table)")


def to_report(spec: dict):
    """The ``wr.Report`` a spec describes. Builds objects only: nothing is sent until ``.save()``. The spec must
    name its entity (``create`` fills in the default entity first)."""
    if not spec.get("entity"):
        raise ValueError("the spec names no W&B entity: pass --entity, or let create() ask W&B for your default")
    import wandb_workspaces.reports.v2 as wr

    blocks = [wr.MarkdownBlock(text=f"Runs of W&B group `{spec['group']}` with job type `{JOB_TYPE}` in "
                                    f"`{spec['entity']}/{spec['project']}`. Made by `python -m harness.wandb_report`."),
              wr.TableOfContents()]
    if spec.get("findings"):  # what the sweep found, as its report.html opens
        blocks += [wr.MarkdownBlock(text=spec["findings"])]
    for panel in spec["panels"]:
        blocks += [wr.H2(text=panel["title"])]
        if panel.get("caption"):
            blocks += [wr.P(text=panel["caption"])]
        blocks += [wr.PanelGrid(runsets=[_runset(wr, spec, panel)], panels=_charts(wr, panel))]
    return wr.Report(entity=spec["entity"], project=spec["project"], title=spec["title"][:128],
                     description=spec.get("description", ""), blocks=blocks, width="fluid")


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()).split(" Consider increasing")[0]
    return text[:limit] or type(e).__name__


def _bounded(fn, seconds: float, what: str):
    """``fn()`` in a daemon thread, at most ``seconds``: a server that never answers cannot hang the command."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, name=f"kvlab-wandb-{what}", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"{what}: W&B did not answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


LOGIN_HINT = "run `wandb login` (or set WANDB_API_KEY), or write the spec offline with --spec-only FILE"


def create(spec: dict, timeout: float = API_TIMEOUT_S) -> str:
    """Save the spec's report on the W&B server and return its URL. Asks W&B for the default entity when the spec
    names none. Every failure is a ``PublishError`` with one line: no key, no network, no answer, no project."""
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    try:
        import wandb

        # at a terminal with no key, wandb asks for one: give the person time to paste it
        api = _bounded(lambda: wandb.Api(timeout=timeout), 600 if sys.stdin.isatty() else timeout + 20, "login")
        spec = copy.deepcopy(spec)
        if not spec.get("entity"):
            spec["entity"] = _bounded(lambda: api.default_entity, timeout + 20, "default entity")
            if not spec["entity"]:
                raise PublishError("W&B did not say which entity is yours: pass --entity")
    except PublishError:
        raise
    except Exception as e:
        raise PublishError(f"W&B cannot be reached or you are not logged in ({type(e).__name__}: {_one_line(e)}); "
                           f"{LOGIN_HINT}") from None
    report = to_report(spec)
    try:
        _bounded(report.save, max(SAVE_TIMEOUT_S, timeout), "saving the report")
        return report.url
    except Exception as e:
        raise PublishError(f"the report could not be saved to {spec['entity']}/{spec['project']} "
                           f"({type(e).__name__}: {_one_line(e)}); check the entity and project, and that the "
                           "sweep is synced (`wandb sync ...`)") from None


TIMEOUT_MAX_S = 600.0  # --timeout's bound: a W&B call that has not answered in 10 minutes will not
NAME_MAX = 128  # W&B's longest entity or project name


def _wandb_name(name: str) -> bool:
    """Whether ``name`` can name a W&B entity or project (what W&B itself refuses: empty, over 128 characters,
    one of / \\ # ? % :; and no whitespace or control characters here)."""
    return 0 < len(name) <= NAME_MAX and not any(c in "/\\#?%:" or c.isspace() or not c.isprintable() for c in name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m harness.wandb_report",
        description="Create a W&B Report for a synced kvlab sweep (a W&B group), or write its spec offline.")
    ap.add_argument("group", nargs="?", help="the sweep's W&B group, e.g. quick-2026-11-30_23-51-40")
    ap.add_argument("--entity", help="W&B entity (default: your default entity)")
    ap.add_argument("--project", help=f"W&B project (default: {PROJECT}, or the spec's)")
    ap.add_argument("--spec-only", metavar="FILE",
                    help=f"write the report's spec to FILE (a folder: FILE/{SPEC_FILE}) and stop; no network")
    ap.add_argument("--from-spec", metavar="FILE", help="publish a spec written before (e.g. by a sweep)")
    ap.add_argument("--timeout", default=str(API_TIMEOUT_S), metavar="SECONDS",
                    help=f"seconds each W&B call may take, in (0, {TIMEOUT_MAX_S:g}] (default {API_TIMEOUT_S:g})")

    def error(message):  # one line, exit 2 (argparse would print the usage first)
        raise ValueError(f"{message} (see python -m harness.wandb_report --help)")

    ap.error = error
    try:
        args = ap.parse_args(argv)
        # every flag is checked before anything is read, written or sent
        try:
            timeout = float(args.timeout)
        except ValueError:
            timeout = float("nan")
        if not 0 < timeout <= TIMEOUT_MAX_S:  # NaN fails too
            raise ValueError(f"--timeout {args.timeout}: give the seconds each W&B call may take, a number in "
                             f"(0, {TIMEOUT_MAX_S:g}]")
        args.timeout = timeout
        for flag, value in (("--entity", args.entity), ("--project", args.project)):
            if value is not None and not _wandb_name(value):
                raise ValueError(f"{flag} {value!r}: give a W&B {flag[2:]} name: 1 to {NAME_MAX} characters, none "
                                 "of / \\ # ? % : and no spaces")
        for flag, value in (("--spec-only", args.spec_only), ("--from-spec", args.from_spec)):
            if value is not None and not value.strip():
                raise ValueError(f"{flag} {value!r}: give a file (or a folder, for {SPEC_FILE} in it)")
        if (args.group is None) == (args.from_spec is None):
            raise ValueError("pass either GROUP or --from-spec FILE")
        if args.from_spec and args.spec_only:
            raise ValueError("--spec-only writes a spec from GROUP; --from-spec publishes one: use one of them")
        if args.from_spec:
            spec = spec_from_file(args.from_spec)
            spec.update({k: v for k, v in (("entity", args.entity), ("project", args.project)) if v})
        else:
            spec = build_spec(args.group, args.project or PROJECT, args.entity)
        if args.spec_only:
            path = _spec_path(args.spec_only)
            _refuse_not_a_spec(path)
            try:
                _write_json(path, spec)
            except OSError as e:
                raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
            print(f"kvlab wandb_report: wrote {path}; publish it with `python -m harness.wandb_report --from-spec "
                  f"{path}` after `wandb sync`")
            return 0
        url = create(spec, timeout=args.timeout)
    except (ValueError, OSError, PublishError) as e:
        print(f"kvlab wandb_report: {_one_line(e, 1000)}", file=sys.stderr)
        return 2
    print(url)
    return 0

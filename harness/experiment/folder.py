"""A run's folder and what it depended on: whether kvlab may take a folder (its own files only, or an empty or
failed attempt), whether a complete run of the same identity is already there (resume), and the ids of its inputs
(the prompts file, the checkpoint, the files its measurements read, kvlab's code) a resumed run must find unchanged."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from omegaconf import OmegaConf

from harness.core import inputs
from harness.common import ownership
from harness.experiment import tracking
from harness.experiment.weights import Weights
from models.hf_checkpoint import files_read


def partial_files() -> tuple[str, ...]:
    """What a run writes in its folder: what an earlier attempt may have left."""
    return (*tracking.run_files(), "wandb", ".hydra")


def _same_folder(recorded, folder: Path) -> bool:
    """Whether the run folder a record names (absolute, or relative to where kvlab ran) is ``folder``."""
    if not isinstance(recorded, str) or not recorded:
        return False
    here, p = ownership.resolved(folder), Path(recorded)
    if p.is_absolute():
        return ownership.resolved(p) == here
    parts = Path(os.path.normpath(p)).parts
    return ".." not in parts and here.parts[-len(parts):] == parts


def _first_row(path: Path) -> dict | None:
    """The header and first row of a CSV table kvlab wrote (read from its first 64 KiB), or None."""
    import csv
    import io

    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            head = f.read(2 ** 16)
        rows = csv.DictReader(io.StringIO(head))
        return next(rows, None)
    except (OSError, csv.Error):
        return None


def _not_its_files(folder: Path, run_name: str, record: dict | None) -> str | None:
    """Which of the run's tables and summary in ``folder`` are not this run's: a table whose rows do not say it
    (its identity columns), a run.log that does not start with its summary's head."""
    for name in tracking.table_files().values():
        if (folder / name).exists():
            row = _first_row(folder / name)
            if row is None or row.get("run_name") != run_name or (
                    record is not None and row.get("status") != record.get("status")):
                return f"its {name} is not this run's table"
    if (folder / tracking.LOG).exists():
        try:
            with open(folder / tracking.LOG, encoding="utf-8", errors="replace") as f:
                first = f.read(4096)
        except OSError:
            first = ""
        if not first.startswith(f"kvlab run {run_name}:"):
            return f"its {tracking.LOG} is not this run's summary"
    return None


def adoption_problem(folder: Path) -> str | None:
    """Why a folder without a manifest is not a run an earlier kvlab wrote *here* (None: it is). Proof: its
    results.json is a kvlab record whose run folder is this folder, and every table and summary beside it is that
    record's; or, for a run killed before its record, its .hydra/config.yaml is a kvlab config and its tables are
    the folder's run's."""
    from harness.experiment.records import RESULTS, read_record

    folder = Path(folder)
    if (folder / RESULTS).exists():
        record, _ = read_record(folder / RESULTS)
        if record is None or not (record.get("config_id") and record.get("run_name")):
            return f"its {RESULTS} is not a kvlab record"
        if not _same_folder(record.get("run_dir"), folder):
            return f"its {RESULTS} was written for another folder ({record.get('run_dir')})"
        return _not_its_files(folder, record["run_name"], record)

    try:
        job = (None if ownership.file_problem(folder / ".hydra" / "config.yaml", 2 ** 20)
               else OmegaConf.load(folder / ".hydra" / "config.yaml"))
        ours = job is not None and OmegaConf.select(job, "cache.kind") is not None and OmegaConf.select(
            job, "model.preset") is not None
    except Exception:
        ours = False
    if not ours:
        return "it holds no kvlab record"
    return _not_its_files(folder, folder.name, None)


def _is_kvlab_run(folder: Path) -> bool:
    """Whether a folder without a manifest is a run an earlier kvlab wrote here (``adoption_problem``)."""
    return adoption_problem(folder) is None


def take_folder(run_dir: Path) -> None:
    """Make sure ``run_dir`` is kvlab's to write in: new, empty, or holding only what kvlab's manifest lists (a run
    folder an earlier kvlab wrote before manifests is adopted when all it holds is a run's files and its record is a
    kvlab record). Anything else: ``NotOurs``, in one line, and nothing is touched."""
    adopted = ownership.adopt(run_dir, set(partial_files()), _is_kvlab_run)
    why = None if adopted or (Path(run_dir) / ownership.MANIFEST).exists() else adoption_problem(Path(run_dir))
    ownership.refuse_foreign(run_dir, "run folder", (f"{why}, so it is not adopted; " if why else "")
                             + "point hydra.run.dir (or hydra.sweep.dir) at a new or empty folder, or at a kvlab run "
                             "folder")
    for sub, made in INSIDE.items():  # the folders kvlab made are cleared whole: only while they hold only its own
        names = [n for n in ownership.entries(Path(run_dir) / sub) if not re.fullmatch(made, n)]
        if sub in ownership.owned(run_dir) and names:
            raise ownership.NotOurs(f"run folder {run_dir}: its {sub}/ holds files kvlab did not write "
                                    f"({', '.join(names[:4])}); kvlab never clears it: move them away")


INSIDE = {".hydra": r"(config|hydra|overrides)\.yaml",  # what kvlab and W&B write in the folders kvlab makes
          "wandb": r"(offline-)?run-\d{8}_\d{6}-\w+|latest-run|debug(-internal|-cli\.\w+)?\.log|data|cache"}


def _fresh_or_failed_attempt(run_dir: Path, ident: str) -> bool:
    """Whether a refused config may record its failure in ``run_dir``: it holds nothing of kvlab's yet, or only a
    failed or interrupted attempt of this same config (never a finished run, never another config's record)."""
    from harness.experiment.records import RESULTS, read_record

    if not ownership.owned(run_dir) & set(ownership.entries(run_dir)):
        return True
    record, _ = read_record(Path(run_dir) / RESULTS)
    return record is not None and record.get("config_id") == ident and record.get("status") != "ok"


def completed(run_dir: Path, ident: str) -> dict | None:
    """The run folder's record when it is complete (every file kvlab listed is there), ok and of this identity."""
    from harness.experiment.records import RESULTS, read_record

    record, _ = read_record(Path(run_dir) / RESULTS)
    ok = record is not None and record.get("status") == "ok" and record.get("config_id") == ident
    whole = all((Path(run_dir) / n).exists() for n in ownership.owned(run_dir))
    return record if ok and whole else None


def _finished_other(run_dir: Path, ident: str) -> str | None:
    """Why ``run_dir`` may not take this run: it holds a sweep report, or a finished run of another config (kvlab
    wrote them, but replacing one silently would lose it)."""
    from harness.experiment.records import RESULTS, read_record

    if "report.html" in ownership.owned(run_dir):
        return (f"{run_dir} is a sweep report folder: kvlab never measures a run into it; point hydra.run.dir at a new "
                "or empty folder")
    record, _ = read_record(Path(run_dir) / RESULTS)
    if record is not None and record.get("config_id") != ident and record.get("status") in ("ok", "not_equivalent"):
        return (f"{run_dir} holds a finished run of another config ({record.get('config_id')}, this one is {ident}): "
                "kvlab never replaces it; give this run a folder of its own (hydra.run.dir, hydra.sweep.subdir)")
    return None


INPUTS = {"inputs_prompts": "the prompts file", "inputs_checkpoint": "the checkpoint",
          "inputs_trace": "the serving trace", "inputs_cache": "the cache kind's files", "inputs_code": "kvlab's code"}


def changed_inputs(prior: dict, inputs: dict) -> list[str]:
    """What changed since ``prior`` was measured, among the inputs its config does not name (one phrase each)."""
    return [f"{what} changed ({prior.get(k) or 'not recorded'} -> {inputs[k]})" for k, what in INPUTS.items()
            if prior.get(k) != inputs[k]]


def _sha(chunks) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()[:16]


WHOLE_FILE = 256 * 2 ** 20  # checkpoints up to this size are hashed whole; larger ones by size and 64 samples


def file_id(path: Path) -> str:
    """A content id of a file: the sha256 of all of it, or of its size and 64 evenly spaced 64 KiB samples when it
    is large (a checkpoint of several GB costs milliseconds; a retrained one differs in every sample)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= WHOLE_FILE:
            return _sha(iter(lambda: f.read(2 ** 20), b""))

        def samples():
            yield str(size).encode()
            for i in range(64):
                f.seek(i * (size - 2 ** 16) // 63)
                yield f.read(2 ** 16)
        return _sha(samples())


def input_ids(prompts_path: Path | None, seed: int, w: Weights | None, files: list[str] | str | None = None,
              kind_file: Path | None = None, cache_files: tuple[str, ...] = ()) -> dict:
    """What a run's results depend on beyond its config: the prompts file's contents (``prompts_path``; None: random
    prompts), the checkpoint's contents (every file of it a load reads: ``models.hf_checkpoint.files_read``; the
    model's ``seed`` for random weights), the files its measurements read (``files``: a serving trace; recorded as
    ``inputs_trace``) and the code: kvlab's own (its sources and configs) and, for a kind from outside kvlab, its
    module's file (``kind_file``), so an edited kind is measured again; and the files the cache kind reads
    (``cache_files``: duo's heads file; ``inputs_cache``)."""
    files = [files] if isinstance(files, str) else list(files or [])
    prompts = "random prompts"
    if prompts_path is not None:
        path = Path(prompts_path)
        prompts = file_id(path) if path.is_file() and path.stat().st_size <= inputs.PROMPTS_FILE_MAX else "not read"
    if w is None or w.random:
        ckpt = f"random init (seed {seed})"
    elif Path(w.load_from).is_dir():
        ckpt = _sha(f"{f.name}:{file_id(f)}".encode() for f in files_read(w.load_from))
    else:
        ckpt = f"hub {w.load_from}"
    traced, cached = _files_id(files), _files_id(cache_files)
    code = _sha(p.read_bytes() for p in tracking.sources() + ([kind_file] if kind_file is not None else []))
    return dict(inputs_prompts=prompts, inputs_checkpoint=ckpt, inputs_trace=traced, inputs_cache=cached,
                inputs_code=code)


def _files_id(files) -> str | None:
    """One id of some input files' contents (None: no file; "not read" for one that is not there)."""
    ids = [file_id(Path(f)) if Path(f).is_file() else "not read" for f in files]
    return None if not ids else ids[0] if len(ids) == 1 else _sha(i.encode() for i in ids)


def _misplaced(run_dir: Path, sweep_at: tuple[str, str] | None) -> str | None:
    """Why a run may not go into ``run_dir`` at all (None: it may): a sweep's run outside its sweep folder (its report
    and exit code would look in the wrong place), or a folder inside another run's folder (that run could no longer
    be resumed or cleared). ``sweep_at``: the sweep's folder and subdir pattern, as the door read them (None: not a
    sweep)."""
    from harness.experiment.records import within_report_folder, within_run_folder

    if sweep_at is not None:
        sweep_dir, subdir = sweep_at
        sweep, here = ownership.resolved(sweep_dir), ownership.resolved(run_dir)
        if here == sweep or sweep not in here.parents:
            return (f"hydra.sweep.subdir={subdir} puts this run in {run_dir}, not inside the sweep folder "
                    f"{sweep_dir}: give a subdir inside it (the default names each run by its config)")
        if here == sweep / "report" or sweep / "report" in here.parents:
            return (f"hydra.sweep.subdir={subdir} puts this run in the sweep's report folder ({run_dir}), where no "
                    "report would see it: give another subdir (the default names each run by its config)")
    report_folder = within_report_folder(Path(run_dir).parent)
    if report_folder:
        return (f"run folder {run_dir} lies inside the report folder {report_folder}, where no report would see it: "
                "point hydra.run.dir (or hydra.sweep.dir) at a folder of its own")
    inside = within_run_folder(Path(run_dir).parent)
    if inside:
        return (f"run folder {run_dir} lies inside the run folder {inside[0]} ({inside[1]}), which kvlab would then "
                "no longer resume or clear: point hydra.run.dir (or hydra.sweep.dir) at a folder outside every run's "
                "folder")
    return None

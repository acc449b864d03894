"""One kvlab invocation's bookkeeping: its id (shared with the jobs a launcher starts), the run folders it started
and what failed where no run's file can say (notes in the machine's temp folder, one small file each), its exit
code, and which runs are measuring on this machine now. No module-level state: every process of an invocation
reads and writes the same notes.

    python run.py -m ...    # run.py: new_invocation(); each job: note_started(folder); at the end:
                            # invocation_failures() (empty: exit 0), forget_invocation()
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path


def invocation() -> str:
    """The id of this ``run.py`` invocation (made by ``new_invocation`` in run.py; made here for plain Python use),
    shared with the jobs a launcher starts through the environment."""
    if not os.environ.get("KVLAB_INVOCATION"):
        new_invocation()
    return os.environ["KVLAB_INVOCATION"]


def new_invocation() -> str:
    """A fresh invocation id for this process and the jobs it starts: never one inherited from a parent process."""
    os.environ["KVLAB_INVOCATION"] = uuid.uuid4().hex[:12]
    return os.environ["KVLAB_INVOCATION"]


def _notes(inv: str) -> Path:
    """Where this invocation notes the run folders it starts (one small file each, in the machine's temp folder):
    the exit code and the sweep report read exactly these, whichever process ran them."""
    return Path(tempfile.gettempdir()) / "kvlab-invocations" / inv


def note_started(run_dir: Path, refused: str | None = None) -> None:
    """Note that this invocation started a run in ``run_dir`` (and, if so, that it was refused without a record)."""
    notes = _notes(invocation())
    notes.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode(errors="surrogateescape")).hexdigest()[:16]
    data = json.dumps({"folder": str(Path(run_dir).resolve()), "refused": refused})
    (notes / f"{key}.json").write_text(data, encoding="utf-8", errors="surrogateescape")


def _noted(inv: str) -> list[dict]:
    notes = _notes(inv)
    out = []
    for f in sorted(notes.glob("*.json")) if notes.is_dir() else []:
        try:
            out.append(json.loads(f.read_text(encoding="utf-8", errors="surrogateescape")))
        except (OSError, ValueError):
            continue
    return out


def invocation_folders(inv: str | None = None) -> list[Path]:
    """The run folders invocation ``inv`` (default: this one) started, finished or not."""
    return [Path(n["folder"]) for n in _noted(inv or invocation()) if "folder" in n]


def note_failure(what: str) -> None:
    """Note a failure of this invocation that no run's file can show (a record that could not be written, a sweep
    report that was not): ``invocation_failures`` lists it, whichever process noted it."""
    notes = _notes(invocation())
    notes.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(what.encode(errors="surrogateescape")).hexdigest()[:16]
    (notes / f"failure-{key}.json").write_text(json.dumps({"failure": what}), encoding="utf-8",
                                               errors="surrogateescape")


def forget_invocation(inv: str | None = None) -> None:
    """Remove this invocation's notes (kvlab's own files in the temp folder) once its exit code is known."""
    shutil.rmtree(_notes(inv or invocation()), ignore_errors=True)


def invocation_failures() -> list[str]:
    """Runs of this invocation that did not end ok: records that are not ok, runs refused without a record, and run
    folders it started that hold no complete results.json. Empty: every run is ok (or nothing ran)."""
    from harness.experiment.records import RESULTS, read_record

    notes = _noted(invocation())
    bad = [n["failure"] for n in notes if n.get("failure")]
    for note in (n for n in notes if "folder" in n):
        folder = Path(note["folder"])
        if any(line.startswith(f"{folder} (") for line in bad):
            continue  # already said (a write error in this process)
        if note.get("refused"):
            bad.append(f"{folder} (refused: {note['refused']})")
            continue
        record, _ = read_record(folder / RESULTS)
        if record is None:
            bad.append(f"{folder} (no complete results.json)")
        elif record.get("status") != "ok":
            bad.append(f"{folder} ({record.get('status')}: {record.get('error')})")
    return bad


ACTIVE = Path(tempfile.gettempdir()) / "kvlab-active"  # one file per kvlab run measuring on this machine


def mark_active() -> Path:
    """Say that a run of this process is measuring (``concurrent_runs`` of other runs count it); unlink to end."""
    ACTIVE.mkdir(parents=True, exist_ok=True)
    me = ACTIVE / str(os.getpid())
    me.touch()
    return me


def concurrent_runs() -> int:
    """Other kvlab runs measuring on this machine now (their step times and ours share the cores)."""
    others = 0
    for f in ACTIVE.glob("*") if ACTIVE.is_dir() else []:
        if not f.name.isdigit() or int(f.name) == os.getpid():
            continue
        try:
            os.kill(int(f.name), 0)
            others += 1
        except ProcessLookupError:
            f.unlink(missing_ok=True)  # a run that died without cleaning up
        except PermissionError:
            others += 1  # alive, another user's
    return others

"""results.json read back, and the folders kvlab writes told apart: the run layer owns a run's record, writing it
(``tracking``) and reading it (``read_record``); the analysis layer's loaders and the run's resume both read
through here. ``shown``: a path or name as text that can be printed and written as UTF-8."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.common import ownership
from harness.experiment import tracking
from harness.experiment.tracking import RESULTS


def shown(path) -> str:
    """``path`` as text that can be printed, written as UTF-8 and put in a table: bytes that are not UTF-8 in a
    folder's name (kept by Python as surrogate escapes) are shown as ``\\xff``."""
    if path is None:
        return ""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    return _text(text)


def _text(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:  # surrogate escapes from a name, or lone surrogates from a JSON "\\udcff"
        return text.encode("utf-8", "surrogateescape" if _escapes_only(text) else "backslashreplace").decode(
            "utf-8", "backslashreplace")


def _escapes_only(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
        return True
    except UnicodeEncodeError:
        return False


REQUIRED = ("status", "run_name", "model", "cache", "dtype")  # what makes a results.json kvlab's


RECORD_MAX = 2 ** 20  # bytes: a run's results.json is a few KB; anything this big is not one


def read_record(path: Path) -> tuple[dict | None, str | None]:
    """A run's record from its results.json, or (None, why not)."""
    why = ownership.file_problem(path, RECORD_MAX)
    if why:
        return None, why
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # JSON too deep, an int too long
        return None, f"unreadable {RESULTS} ({type(e).__name__})"
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in REQUIRED):
        return None, f"{RESULTS} is not a kvlab record (it needs {', '.join(REQUIRED)} as text)"
    if not isinstance(record.setdefault("device", record.get("device_requested") or "unknown"), str):
        return None, f"{RESULTS} is not a kvlab record (its device is not text)"
    bad = [k for k, v in record.items() if isinstance(v, (list, dict))]
    if bad:
        return None, f"{RESULTS} is not a kvlab record ({_text(bad[0])!r} holds a {type(record[bad[0]]).__name__})"
    if "cache_full_attention" not in record:  # written before the kind's facts were recorded: worked out now
        record.update(kind_facts(record))
    # text that cannot be written as UTF-8 (a JSON "\\udcff"): shown escaped, so tables and pages can hold it
    return {_text(k): _text(v) if isinstance(v, str) else v for k, v in record.items()}, None


def kind_facts(record: dict) -> dict:
    """What a run records of its kind (``cache_full_attention``, ``cache_implied``), worked out from a record written
    before it did: its kind and its ``cache_<option>`` keys, asked of the kind's class (the engine's registry, read
    only here). {} for a kind kvlab no longer has."""
    from harness.experiment.describe import cache_record
    from harness.experiment.plan import CacheChoice
    from models.kv_cache import CACHE_KINDS

    cls = CACHE_KINDS.get(record.get("cache"))
    if cls is None:
        return {}
    options = {name: record[f"cache_{name}"] for name in cls.option_types()
               if record.get(f"cache_{name}") is not None}
    facts = cache_record(CacheChoice(record["cache"], options))
    return {k: facts[k] for k in ("cache_full_attention", "cache_implied") if k in facts}


def of_invocations(record: dict) -> list[str]:
    """The run.py invocations that made or confirmed a run (``invocations``, space-separated; a record written before
    that key has ``invocation`` alone)."""
    return str(record.get("invocations") or record.get("invocation") or "").split()


REPORT_PAGE = "report.html"  # a report folder's page: listed in its manifest before any of its tables is written


def run_folder(folder: str | Path) -> str | None:
    """Why ``folder`` is a run's folder (None: it is not): it holds a run's results.json, it is a Hydra job folder,
    or kvlab's manifest lists a run's tables there but no report page. A report never writes its tables into one
    (its steps.csv would replace the run's)."""
    folder = Path(folder)
    names = set(ownership.entries(folder))
    if RESULTS in names:
        return f"it holds a run's {RESULTS}"
    if ".hydra" in names:
        return "it is a Hydra job folder (.hydra)"
    mine = ownership.owned(folder)
    tables = sorted(n for n in names & set(tracking.run_files()) if n in mine)
    if tables and REPORT_PAGE not in mine:
        return f"it holds a run's {tables[0]}"
    return None


def within_run_folder(folder: str | Path) -> tuple[Path, str] | None:
    """The run folder ``folder`` is, or lies inside (the nearest), and why it is one (``run_folder``); None: neither.
    Nothing of kvlab's (a report, a sweep, another run) goes into a run's folder: its manifest would not list it, and
    the run could not be resumed or cleared."""
    here = ownership.resolved(folder)
    for f in (here, *here.parents):
        if f.is_dir():
            why = run_folder(f)
            if why:
                return f, why
    return None


def within_report_folder(folder: str | Path) -> Path | None:
    """The report folder (one whose manifest lists a report page) ``folder`` is, or lies inside (the nearest); None:
    neither. A run or a sweep there would be hidden from every report, and the report could no longer be replaced."""
    here = ownership.resolved(folder)
    for f in (here, *here.parents):
        if f.is_dir() and REPORT_PAGE in ownership.owned(f):
            return f
    return None

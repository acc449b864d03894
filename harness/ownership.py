"""What kvlab owns on disk, and one kvlab process at a time per folder.

Every folder kvlab writes into carries a manifest, ``.kvlab-manifest.json``: the names (files or folders, one level
deep) that kvlab put there. A name is claimed *before* it is written, so a crash mid-write leaves it listed. kvlab
deletes, overwrites or uploads only names its manifest lists; a folder that holds anything else is never emptied:
``foreign`` names what is not kvlab's, and the caller refuses in one line.

A folder kvlab measures in is locked (``.kvlab.lock``: host, pid, invocation, since) for as long as it works there. A
second kvlab process waits for it (one line says so); a lock whose process is gone (same host, pid no longer alive)
is taken over; a lock from another host is waited on, since its process cannot be asked.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

MANIFEST = ".kvlab-manifest.json"
LOCK = ".kvlab.lock"
BOOKKEEPING = (MANIFEST, LOCK)  # kvlab's own, in any folder it touched, listed or not
_UMASK = os.umask(0)
os.umask(_UMASK)


class NotOurs(ValueError):
    """A folder holds files kvlab did not write; the message is one line that says which and what to do."""


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def atomic_write(path: Path, write) -> None:
    """``write(f)`` into a unique temporary file beside ``path`` (text; or ``write`` is bytes, written as they are),
    flushed to disk, then renamed into place: a crash leaves the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        data = write if isinstance(write, bytes) else None
        with os.fdopen(fd, "wb") if data is not None else os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(data) if data is not None else write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are for everyone who may read the folder
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_json(path: Path, data: dict) -> None:
    atomic_write(path, lambda f: json.dump(data, f, indent=1, sort_keys=True))


def owned(folder: Path) -> set[str]:
    """The names kvlab's manifest in ``folder`` lists (empty: none, or no manifest)."""
    data = _read(Path(folder) / MANIFEST)
    names = data.get("names") if data else None
    return {n for n in names if isinstance(n, str) and "/" not in n} if isinstance(names, list) else set()


def _ours_temporary(name: str, mine: set[str]) -> bool:
    """A temporary file of kvlab's atomic writes (``.<name>.<random>.tmp``) of a name kvlab owns here."""
    return name.startswith(".") and name.endswith(".tmp") and any(
        name.startswith(f".{n}.") for n in (*mine, *BOOKKEEPING))


def entries(folder: Path) -> list[str]:
    """The names in ``folder`` (none when it does not exist), undecodable bytes kept as surrogate escapes."""
    try:
        return sorted(os.listdir(folder))
    except FileNotFoundError:
        return []


def foreign(folder: Path) -> list[str]:
    """Names in ``folder`` that kvlab did not write (empty: the folder is new, empty or all kvlab's)."""
    mine = owned(folder)
    return [n for n in entries(folder) if n not in mine and n not in BOOKKEEPING and not _ours_temporary(n, mine)]


def refuse_foreign(folder: Path, what: str, hint: str) -> None:
    """Raise ``NotOurs`` when ``folder`` holds names kvlab did not write."""
    names = foreign(folder)
    if names:
        shown = ", ".join(repr(n)[1:-1] for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise NotOurs(f"{what} {folder} holds files kvlab did not write ({shown}); kvlab never empties or writes "
                      f"into such a folder: {hint}")


def adopt(folder: Path, names: tuple[str, ...] | set[str], is_ours) -> bool:
    """A folder an earlier kvlab wrote before manifests existed: when it has no manifest, every name in it is one of
    ``names`` and ``is_ours(folder)`` confirms it (its record is a kvlab record), list them in a new manifest."""
    folder = Path(folder)
    present = [n for n in entries(folder) if n not in BOOKKEEPING]
    if (folder / MANIFEST).exists() or not present:
        return False
    if not all(n in names or n.endswith(".tmp") for n in present) or not is_ours(folder):
        return False
    claim(folder, *[n for n in present if n in names])
    return True


def claim(folder: Path, *names: str) -> None:
    """List ``names`` in ``folder``'s manifest (made with the folder if need be) before kvlab writes them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mine = owned(folder)
    if set(names) <= mine and (folder / MANIFEST).exists():
        return
    _write_json(folder / MANIFEST, {"names": sorted(mine | set(names)), "by": "kvlab"})


def remove(folder: Path, names) -> None:
    """Delete ``names`` from ``folder`` where the manifest lists them (anything else is left as it is), and the
    temporary files of kvlab's writes there."""
    import shutil

    folder = Path(folder)
    mine = owned(folder)
    for name in names:
        if name not in mine:
            continue
        p = folder / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists() or p.is_symlink():
            p.unlink()
    for n in entries(folder):
        if _ours_temporary(n, mine):
            (folder / n).unlink(missing_ok=True)


# ---- locks -------------------------------------------------------------------------------------------------------

POLL_S = 0.5


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc; None where there is no /proc): a pid reused
    by another process since a lock was taken shows another start."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder(folder: Path) -> dict | None:
    """Who holds ``folder``'s lock, when a live process does (None: free, or its holder is gone: dead, or its pid
    now another process's)."""
    data = _read(Path(folder) / LOCK)
    if data is None:  # no lock; or one being written now (kept), or left unreadable long ago (gone)
        try:
            age = time.time() - (Path(folder) / LOCK).stat().st_mtime
        except FileNotFoundError:
            return None
        return None if age > 10 else {"pid": None, "host": "?", "since": "?"}
    if data.get("host") == socket.gethostname() and isinstance(data.get("pid"), int):
        if not _alive(data["pid"]):
            return None
        now = _started(data["pid"])
        if now is not None and data.get("started") != now:  # the pid is another process's now
            return None
    return data


def _try_lock(path: Path, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(me, f)
    return True


@contextlib.contextmanager
def locked(folder: Path, what: str, invocation: str | None = None, wait_s: float | None = None):
    """Hold ``folder``'s lock for the ``with`` block. Held by a live process: one line says so and this one waits
    (until ``wait_s`` seconds have passed: then ``TimeoutError``, in one line); held by a dead one: taken over."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    me = dict(pid=os.getpid(), host=socket.gethostname(), invocation=invocation, started=_started(os.getpid()),
              since=time.strftime("%Y-%m-%dT%H:%M:%S"))
    said, t0 = False, time.monotonic()
    while not _try_lock(path, me):
        other = holder(folder)
        if other is None:  # its process is gone (or the lock was just released): take it over
            with contextlib.suppress(FileNotFoundError):
                if holder(folder) is None:
                    path.unlink()
            continue
        if wait_s is not None and time.monotonic() - t0 >= wait_s:
            raise TimeoutError(f"{what} {folder} is in use by kvlab process {other.get('pid')} on "
                               f"{other.get('host')} (since {other.get('since')}); try again when it has finished")
        if not said:
            print(f"kvlab: {what} {folder} is in use by kvlab process {other.get('pid')} on {other.get('host')} "
                  f"(since {other.get('since')}): waiting for it to finish", file=sys.stderr)
            said = True
        time.sleep(POLL_S)
    try:
        yield
    finally:
        if (_read(path) or {}).get("pid") == os.getpid():
            path.unlink(missing_ok=True)

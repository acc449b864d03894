"""What kvlab owns on disk, and one kvlab process at a time per folder.

Every folder kvlab writes into carries a manifest, ``.kvlab-manifest.json``: the names (files or folders, one level
deep) that kvlab put there. A name is claimed *before* it is written, so a crash mid-write leaves it listed. kvlab
deletes, overwrites or uploads only names its manifest lists; a folder that holds anything else is never emptied:
``foreign`` names what is not kvlab's, and the caller refuses in one line.

A manifest names the folder it was written for (its path, and its device and inode, which survive a rename): a
manifest copied from another folder, or a file of that name kvlab did not write, proves nothing here, and the folder
is treated as holding files kvlab did not write (never merged into, never overwritten). A manifest an earlier kvlab
wrote before manifests named their folder is trusted as it was.

A folder kvlab measures in is locked (``.kvlab.lock``: host, pid, invocation, since) for as long as it works there;
the holder refreshes the lock's time every ``HEARTBEAT_S`` seconds. A second kvlab process waits for it (one line
says so, and how to clear a lock left behind); a lock whose process is gone (same host, pid no longer alive) is taken
over, and so is a lock from another host that has not been refreshed for ``STALE_S`` seconds (its holder is gone
or cannot reach the folder).
"""

from __future__ import annotations

import contextlib
import errno
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


READ_MAX = 4 * 2 ** 20  # bytes: a manifest or a lock is a few hundred; anything bigger is not kvlab's


def resolved(path) -> Path:
    """``path`` made absolute with its links followed (as far as they can be: a loop or an unreadable part leaves
    the plain absolute path)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))


def file_problem(path: Path, limit: int) -> str | None:
    """Why ``path`` is not read (None: it may be): not a regular file (a device, FIFO or socket, a link to one), or
    more than ``limit`` bytes. Checked before a byte is read, so no file kvlab reads can grow without bound."""
    import stat

    try:
        st = os.stat(path)
    except OSError as e:
        return f"unreadable {Path(path).name} ({e.strerror or type(e).__name__})"
    if not stat.S_ISREG(st.st_mode):
        return f"{Path(path).name} is not a regular file"
    if st.st_size > limit:
        return f"{Path(path).name} holds {st.st_size:,} bytes, more than the {limit:,} kvlab reads for it"
    return None


def _read(path: Path) -> dict | None:
    """A small JSON object kvlab wrote (a manifest, a lock), or None: absent, not a regular file, too big, not JSON."""
    if file_problem(path, READ_MAX):
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
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


def _identity(folder: Path) -> dict:
    """What a manifest records of the folder it was written for: its path, and its (device, inode), which a rename
    or a move within one filesystem keeps."""
    folder = Path(folder)
    st = folder.stat()
    return {"folder": os.path.abspath(folder), "inode": [st.st_dev, st.st_ino]}


def manifest_problem(folder: Path) -> str | None:
    """Why ``folder``'s manifest is not kvlab's own for this folder (None: there is none, or it is): a file of that
    name that is not a kvlab manifest, or a kvlab manifest written for another folder (copied here)."""
    path = Path(folder) / MANIFEST
    if not path.exists() and not path.is_symlink():
        return None
    data = _read(path) if path.is_file() and not path.is_symlink() else None
    if data is None or data.get("by") != "kvlab" or not isinstance(data.get("names"), list):
        return f"its {MANIFEST} is not a manifest kvlab wrote"
    if "folder" not in data:  # written before manifests named their folder: trusted as it was
        return None
    here = _identity(folder)
    if data.get("inode") == here["inode"] or data.get("folder") == here["folder"]:
        return None
    return f"its {MANIFEST} was written for another folder ({data.get('folder')})"


def owned(folder: Path) -> set[str]:
    """The names kvlab's manifest in ``folder`` lists (empty: none, no manifest, or one that is not kvlab's own for
    this folder: ``manifest_problem``)."""
    data = _read(Path(folder) / MANIFEST)
    names = data.get("names") if data else None
    if not isinstance(names, list) or manifest_problem(folder):
        return set()
    return {n for n in names if isinstance(n, str) and "/" not in n}


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
    """Names in ``folder`` that kvlab did not write (empty: the folder is new, empty or all kvlab's). A manifest that
    is not kvlab's own for this folder (``manifest_problem``) is itself foreign, and lists nothing."""
    mine = owned(folder)
    bookkeeping = BOOKKEEPING if not manifest_problem(folder) else (LOCK,)
    return [n for n in entries(folder) if n not in mine and n not in bookkeeping and not _ours_temporary(n, mine)]


def refuse_foreign(folder: Path, what: str, hint: str) -> None:
    """Raise ``NotOurs`` when ``folder`` holds names kvlab did not write."""
    names = foreign(folder)
    if names:
        shown = ", ".join(repr(n)[1:-1] for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        why = manifest_problem(folder)
        raise NotOurs(f"{what} {folder} holds files kvlab did not write ({shown}{'; ' + why if why else ''}); kvlab "
                      f"never empties or writes into such a folder: {hint}")


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
    """List ``names`` in ``folder``'s manifest (made with the folder if need be) before kvlab writes them. A
    manifest that is not kvlab's own for this folder is never merged into or replaced: ``NotOurs``, in one line."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    why = manifest_problem(folder)
    if why:
        raise NotOurs(f"{folder}: {why}; kvlab never writes into such a folder: move the file away or choose "
                      "another folder")
    data = _read(folder / MANIFEST)
    mine = owned(folder)
    if set(names) <= mine and data is not None and "folder" in data:
        return
    _write_json(folder / MANIFEST, {"names": sorted(mine | set(names)), "by": "kvlab", **_identity(folder)})


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


HEARTBEAT_S = 30.0  # a lock's holder refreshes its time this often
STALE_S = 600.0  # a lock not refreshed for this long is taken over, whichever host holds it


def _age(path: Path) -> float | None:
    """Seconds since ``path`` was last written or refreshed (None: it is gone)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def holder(folder: Path) -> dict | None:
    """Who holds ``folder``'s lock, when a live process does (None: free, or its holder is gone: dead, its pid now
    another process's; on another host, where the process cannot be asked: its lock not refreshed for ``STALE_S``
    seconds)."""
    path = Path(folder) / LOCK
    data = _read(path)
    age = _age(path)
    if data is not None and not (isinstance(data.get("pid"), int) and isinstance(data.get("host"), str)):
        data = None  # not a lock kvlab wrote (kvlab's name a host and a pid): as an unreadable one
    if data is None:  # no lock; or one being written now (kept), or left unreadable long ago (gone)
        if age is None:
            return None
        return None if abs(age) > 10 else {"pid": None, "host": "?", "since": "?"}
    if data.get("host") != socket.gethostname():  # its process cannot be asked: a lock left unrefreshed is gone
        return None if age is not None and abs(age) > STALE_S else data  # (a time far in the future: as stale)
    if not _alive(data["pid"]):
        return None
    now = _started(data["pid"])
    if now is not None and data.get("started") != now:  # the pid is another process's now
        return None
    return data


def _heartbeat(path: Path, stop) -> None:
    """Refresh the lock's time while this process holds it, so other hosts can tell a live holder from a lost one."""
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            if (_read(path) or {}).get("pid") == os.getpid() and (_read(path) or {}).get("host") == socket.gethostname():
                os.utime(path)


def _try_lock(path: Path, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(me, f)
    return True


def _in_use(what: str, folder: Path, other: dict) -> str:
    where = "this host" if other.get("host") == socket.gethostname() else other.get("host")
    return (f"{what} {folder} is in use by kvlab process {other.get('pid')} on {where} (since {other.get('since')})")


@contextlib.contextmanager
def locked(folder: Path, what: str, invocation: str | None = None, wait_s: float | None = None):
    """Hold ``folder``'s lock for the ``with`` block. Held by a live process: one line says so (and how to clear a
    lock left behind) and this one waits (until ``wait_s`` seconds have passed: then ``TimeoutError``, in one line);
    held by a dead one, or from another host and not refreshed for ``STALE_S`` seconds: taken over, in one line."""
    import threading

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    if (path.exists() or path.is_symlink()) and not (path.is_file() and not path.is_symlink()):
        raise OSError(errno.EEXIST, f"{path} is not a lock kvlab wrote (a folder, link, FIFO or device): kvlab never "
                                    "removes it; move it away and run again")
    me = dict(pid=os.getpid(), host=socket.gethostname(), invocation=invocation, started=_started(os.getpid()),
              since=time.strftime("%Y-%m-%dT%H:%M:%S"))
    said, t0 = False, time.monotonic()
    while not _try_lock(path, me):
        other = holder(folder)
        if other is None:  # its process is gone (or the lock was just released): take it over
            stale, age = _read(path), _age(path)
            with contextlib.suppress(FileNotFoundError):
                if holder(folder) is None:
                    path.unlink()
                    if stale and stale.get("host") != socket.gethostname():
                        when = ("its time lies in the future" if age is not None and age < 0
                                else f"not refreshed for over {STALE_S:.0f} s")
                        print(f"kvlab: took over the lock of {what} {folder} from kvlab process {stale.get('pid')} "
                              f"on {stale.get('host')}: {when}", file=sys.stderr)
            continue
        if wait_s is not None and time.monotonic() - t0 >= wait_s:
            raise TimeoutError(f"{_in_use(what, folder, other)}; try again when it has finished")
        if not said and other.get("pid") is None:  # a lock being written now, or one kvlab cannot read
            print(f"kvlab: {what} {folder} has a lock kvlab cannot read ({path}): waiting up to 10 s for its writer, "
                  "then it is taken over", file=sys.stderr)
            said = True
        if not said:
            clear = (f"; if no kvlab process runs there, delete {path} (a lock not refreshed for {STALE_S:.0f} s is "
                     "taken over)" if other.get("host") != socket.gethostname() else
                     f"; if process {other.get('pid')} is not a kvlab run, delete {path}" if other.get("pid") else "")
            print(f"kvlab: {_in_use(what, folder, other)}: waiting for it to finish{clear}", file=sys.stderr)
            said = True
        time.sleep(POLL_S)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, stop), daemon=True, name="kvlab-lock-heartbeat")
    beat.start()
    try:
        yield
    finally:
        stop.set()
        if (_read(path) or {}).get("pid") == os.getpid():
            path.unlink(missing_ok=True)

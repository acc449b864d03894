"""python -m harness.measurements --keys | --list | --doc [FILE]"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.common.signals import reader_gone
from harness import measurements

PROG = "python -m harness.measurements"
# the line every docs/results.md kvlab wrote carries (``measurements.results_doc``'s third line, since the first):
# --doc replaces only a file that holds it near its head
MARKER = measurements.DOC_MARKER
MARKER_WITHIN = 4096  # bytes of an existing file read for it


class Refused(Exception):
    """A bad flag or an unwritable --doc FILE: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block (argparse would print the usage first)
        raise Refused(f"{message} (see {PROG} --help)")


def doc_path(text: str) -> Path:
    """The file ``--doc FILE`` writes, or Refused in one line before anything is written: FILE must be a file (new,
    or a regular file kvlab wrote, which it replaces) in a folder that exists. A symlink is written through, to what
    it names."""
    path = Path(text).resolve()
    if path.is_dir():
        raise Refused(f"--doc {text or repr(text)}: that is a folder: give the file to write docs/results.md to, e.g. "
                      "--doc docs/results.md (or --doc alone for stdout)")
    if path.exists() and not path.is_file():
        raise Refused(f"--doc {text}: not a regular file (a device, socket or pipe is not replaced): give a file "
                      "to write docs/results.md to")
    if not path.parent.is_dir():
        raise Refused(f"--doc {text}: folder {path.parent} does not exist: give a file in an existing folder")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise Refused(f"--doc {text}: cannot write in {path.parent}: give a file in a folder you can write")
    if path.exists() and not _ours(path, text):
        raise Refused(f"--doc {text}: a file kvlab did not write (no line '{MARKER} ...' near its head, as every "
                      "docs/results.md kvlab writes has); kvlab replaces only its own files: give a new file, or "
                      "--doc alone for stdout")
    return path


def _ours(path: Path, text: str) -> bool:
    """Whether the existing file ``path`` is a docs/results.md kvlab wrote: its first ``MARKER_WITHIN`` bytes hold
    a line starting with ``MARKER``."""
    try:
        with open(path, "rb") as f:
            head = f.read(MARKER_WITHIN)
    except OSError as e:
        raise Refused(f"--doc {text}: cannot read it to see whether kvlab wrote it ({e.strerror or type(e).__name__})"
                      ": give a new file, or --doc alone for stdout") from None
    return any(line.startswith(MARKER.encode()) for line in head.splitlines())




def main(argv=None) -> int:
    ap = _Parser(prog=PROG, description="What kvlab's measurements record.")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--keys", action="store_true", help="every results.json key: key, measurement, type, meaning")
    g.add_argument("--list", action="store_true", help="the measurements, in the order a run makes them")
    g.add_argument("--doc", nargs="?", const="-", metavar="FILE",
                   help="docs/results.md (to FILE, written whole or not at all: a new file, or one --doc wrote, "
                        "never another; or stdout)")
    try:
        args = ap.parse_args(argv)
        if args.keys or args.list or args.doc == "-":
            try:
                if args.keys:
                    print(measurements.keys_text())
                elif args.list:
                    for name, cls in measurements.MEASUREMENTS.items():
                        print(f"{name}\t{cls.about}")
                else:
                    sys.stdout.write(measurements.results_doc())
                sys.stdout.flush()
            except BrokenPipeError:  # | head: stop quietly, as Unix tools do
                return reader_gone()
        else:
            from harness.common.ownership import atomic_write

            path = doc_path(args.doc)
            text = measurements.results_doc()
            try:  # a temporary file beside it, renamed into place: never half a file
                atomic_write(path, lambda f: f.write(text))
            except OSError as e:
                why = e.strerror or type(e).__name__
                raise Refused(f"--doc {args.doc}: cannot write a file in {path.parent} ({why}): give a file in a "
                              "folder you can write") from None
    except Refused as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

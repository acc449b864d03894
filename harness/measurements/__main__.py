"""python -m harness.measurements --keys | --list | --doc [FILE]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import measurements


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.measurements",
                                 description="What kvlab's measurements record.")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--keys", action="store_true", help="every results.json key: key, measurement, type, meaning")
    g.add_argument("--list", action="store_true", help="the measurements, in the order a run makes them")
    g.add_argument("--doc", nargs="?", const="-", metavar="FILE", help="docs/results.md (to FILE, or stdout)")
    args = ap.parse_args(argv)
    if args.keys:
        print(measurements.keys_text())
    elif args.list:
        for name, cls in measurements.MEASUREMENTS.items():
            print(f"{name}\t{cls.about}")
    elif args.doc == "-":
        sys.stdout.write(measurements.results_doc())
    else:
        Path(args.doc).write_text(measurements.results_doc(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

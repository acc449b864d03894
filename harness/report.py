"""``python -m harness.report FOLDER``: the report over any folder of runs (harness.analysis.report).

A public door: the command and the names users type; the code lives in harness.analysis.report."""

import sys

from harness.analysis.report import main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())

"""``python -m harness.scorecard SWEEP...``: the paper presets' claims over several sweeps, Holm-corrected as one
family (harness.analysis.scorecard).

A public door: the command and the names users type; the code lives in harness.analysis.scorecard."""

import sys

from harness.analysis.scorecard import main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())

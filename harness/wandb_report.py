"""``python -m harness.wandb_report GROUP``: a W&B Report of a sweep (harness.analysis.wandb_report).

A public door: the command and the names users type; the code lives in harness.analysis.wandb_report."""

import os
import sys

from harness.analysis.wandb_report import main  # noqa: F401

if __name__ == "__main__":
    rc = main()
    if rc and "wandb" in sys.modules:
        # W&B failed: leave without wandb's exit hook, which waits for its service process to finish whatever it is
        # still trying (a call may still be waiting in its thread); the service stops by itself once we are gone.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)

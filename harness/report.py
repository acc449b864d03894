"""Sweep-end aggregation, as a Hydra callback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from harness import experiment


class SweepReport(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)
        failed = []
        for f in sorted(sweep.glob("*/results.json")):
            r = json.loads(f.read_text())
            if r.get("status") != "ok":
                failed.append((f.parent.name, r.get("error")))
                if str(f.parent) not in experiment.FAILED:
                    experiment.FAILED.append(str(f.parent))
        for name, err in failed:
            print(f"kvlab: run {name} failed: {err}", file=sys.stderr)

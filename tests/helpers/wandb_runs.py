"""What an offline W&B run wrote, read back with wandb's own reader (``wandb leet inspect --json``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

WANDB = Path(sys.executable).parent / "wandb"


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of the run's offline .wandb file, decoded by wandb itself."""
    (folder,) = list((run_dir / "wandb").glob("offline-run-*"))
    out = subprocess.run([str(WANDB), "leet", "inspect", "--json", str(folder)], capture_output=True, text=True,
                         env=dict(os.environ, WANDB_MODE="offline"), timeout=120)
    recs = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert recs, out.stderr[-2000:]
    return recs


def of_type(recs, kind):
    return [r[kind] for r in recs if r["type"] == kind]

"""``python -m harness.kvcalc gpt2``: KV-cache bytes for a preset or an HF config.json (harness.tools.kvcalc).

A public door: the command and the names users type; the code lives in harness.tools.kvcalc."""

import sys

from harness.tools.kvcalc import main  # noqa: F401
from harness.tools.kvcalc import bytes_per_token, kv_cache_bytes, kv_geometry, parse_memory, sequences_that_fit  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())

"""``python -m harness.heads --model mini --out heads.csv``: each K/V head's retrieval score, the input of
``cache=duo`` (harness.tools.heads).

A public door: the command and the names users type; the code lives in harness.tools.heads."""

import sys

from harness.tools.heads import main, score_heads  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())

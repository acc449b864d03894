"""``python -m harness.conformance package.module:ClassName [--options JSON | name=value ...]``: kvlab's cache-kind
conformance checks on a class written against models.kv_cache, one line per check (harness.tools.conformance).

A public door: the command and the names users type; the code lives in harness.tools.conformance."""

import sys

from harness.tools.conformance import CHECKS, main, run_checks  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())

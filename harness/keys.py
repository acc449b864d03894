"""``KEYS``: the names readers (report, plots, W&B report, loaders) look results up by.

    from harness.keys import KEYS
    df[KEYS.drift_kl]                   # == df["drift_kl"], but checked against the measurements' declarations

``KEYS.<name>`` is the string ``name`` when a results.json key, a run table's column or an identity column of that
name is declared (``harness.measurements.declared_names``), and an AttributeError naming the fix when not: a reader
of a key no measurement declares, or no longer declares, fails where it names it instead of drawing an empty
figure. A module of its own, importing the registry only when a name is looked up, so that the modules the
measurements themselves import (plots) can use it too.
"""

from __future__ import annotations


class _Keys:
    def __getattr__(self, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        from harness.measurements import declared_names

        if name not in declared_names():
            raise AttributeError(f"{name!r} is not a results.json key or table column any measurement declares: "
                                 "python -m harness.measurements --keys lists them")
        return name


KEYS = _Keys()

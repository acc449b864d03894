"""The runs of any folder as pandas tables, the public door (the code lives in harness.analysis.results):

    from harness.results import load_runs, load_steps, load_drift, load_memory, load_table, load_tables

Importing it loads no torch: the loaders need pandas and the measurements' declarations only."""

from harness.analysis.results import (load_batches, load_drift, load_layers, load_memory, load_runs,  # noqa: F401
                                      load_steps, load_table, load_tables)

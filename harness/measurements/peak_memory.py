"""Peak memory: the most the device (or the process, on a CPU) held while the measurements before it ran."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, key, register


@register
class PeakMemory(Measurement):
    name = "peak_memory"
    about = "peak device memory (CUDA) or resident set (CPU) of the run's measurements before it"
    stage = "step times"

    @dataclass(frozen=True)
    class Result:
        peak_memory_bytes: int = key("the peak since the run started measuring (see peak_memory_kind)", "B")
        peak_memory_kind: str = key("what was read: cuda_max_allocated, process_peak_rss, or "
                                    "process_max_rss_including_earlier_runs")

    def __init__(self, ctx):
        """Made before any measurement of the run runs: a new peak starts here (sweep jobs may share a process)."""
        from harness.core import measure

        super().__init__(ctx)
        self.reset = measure.reset_peak_memory(ctx.device)

    def run(self):
        from harness.core import measure

        return self.Result(**measure.peak_memory(self.ctx.device, self.reset))

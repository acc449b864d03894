"""Bandwidth: the bytes each timed step reads, the GB/s that makes, and the machine's own bandwidth probe."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, Table, key, register

PROBE_REPEATS = 9  # the most timed repeats of each probe (a run's repeats, at least 3, up to this)


@register
class Bandwidth(Measurement):
    name = "bandwidth"
    about = "bytes a cached step reads (weights + K/V), GB/s and flop/byte per context; the machine's probe"
    needs = ("step_time",)
    stage = "bandwidth"
    @classmethod
    def memory(cls, s, opts):
        """Its copy buffers 2 x max(min(w, 1 GiB), 256 MiB) and its matrix min(w, 1 GiB), w the decode weight
        bytes."""
        from harness.core.sizes import F32, decode_weight_bytes

        w = min(decode_weight_bytes(s.model, s.compute), 1 << 30)
        return [("bandwidth_probe", 0, 2 * max(w, 256 << 20) + max(1, w // 4 // 1024) * 1024 * F32
                 + 3 * 1024 * 1024 * F32)]

    @dataclass(frozen=True)
    class Result:
        probe_copy_gbps: float = key("a buffer copy's bandwidth (read + write), measured here", "GB/s")
        probe_matvec_gbps: float = key("a matrix-vector product's read bandwidth, matrix of the step's weight "
                                       "bytes", "GB/s")
        probe_gbps: float = key("the better of the two: what a step could reach", "GB/s")
        probe_bytes: int = key("bytes of the probe's matrix", "B")
        probe_gflops: float = key("fp32 matrix-matrix rate (1024 x 1024)", "GFLOP/s")
        probe_repeats: int = key("timed repeats of each probe, the median taken (the run's repeats, 3 .. 9)",
                                 "repeats")
        machine_balance: float = key("probe_gflops / probe_gbps: flop/byte where compute meets bandwidth",
                                     "flop/B")
        weight_bytes: int = key("weight bytes a decode step reads (one position row)", "B")
        kv_bytes_at_max_context: int = key("K/V bytes a cached step reads at the largest timed context", "B")
        gb_per_s_at_max_context: float = key("(weight + K/V bytes) / median cached step there", "GB/s")
        bw_fraction_at_max_context: float = key("that / probe_gbps", "fraction")
        flop_per_byte_at_max_context: float = key("a cached step's arithmetic intensity there", "flop/B")

    tables = (Table("steps", "steps.csv", on=("context_len", "mode"),
                    columns=("context_len", "mode", "flops", "weight_bytes", "kv_bytes", "bytes_read", "gb_per_s",
                             "flop_per_byte", "roofline_ms", "roofline_fraction"),
                    meaning="cached rows: what a step reads, the bandwidth it reaches, and how near it is to the "
                            "time reading those bytes at the probe's bandwidth takes (NaN for uncached)"),)

    def run(self):
        from harness.core import measure

        ctx = self.ctx
        repeats = min(PROBE_REPEATS, max(3, ctx.repeats))  # a quick run (repeats=2) probes quickly too
        probe = measure.bandwidth_probe(ctx.device, measure.weight_bytes(ctx.engine.model), repeats=repeats)
        steps = measure.with_bandwidth(ctx.tables["steps"], ctx.engine, ctx.spec, ctx.max_len, probe["probe_gbps"])
        top = steps[(steps.context_len == steps.context_len.max()) & (steps["mode"] == "cached")].iloc[0]
        res = self.Result(**probe, probe_repeats=repeats, weight_bytes=int(top["weight_bytes"]),
                          kv_bytes_at_max_context=int(top["kv_bytes"]),
                          gb_per_s_at_max_context=float(top["gb_per_s"]),
                          bw_fraction_at_max_context=float(top["gb_per_s"]) / probe["probe_gbps"],
                          flop_per_byte_at_max_context=float(top["flop_per_byte"]))
        return res, {"steps": steps[list(self.tables[0].columns)]}

"""Batches: decode throughput against batch size, and where the K/V read overtakes the weights."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, Table, key, option, register


@register
class Batches(Measurement):
    name = "batches"
    about = "decode tokens/s against batch size at batch_context, and the bytes each step reads"
    stage = "batch throughput"
    @classmethod
    def memory(cls, s, opts):
        """Per batch size B at context c = min(batch_context, max_len - 1): the previous batch's cache (and
        snapshot) is still held while the next is built and prefilled: the worst of cache(B_prev) + cache(B) +
        prefill and cache(B) + its snapshot + a decode step."""
        from harness.core.sizes import I64
        from models.kv_cache.base import itemsize

        phases, prev, c = [], 0, cls.context(s, opts)
        for B in opts.batch_sizes or []:
            held = s.cache_at(B, c + 1, prefilled=c)
            moments = [(prev + held, s.forward(B, c, 1) + 2 * B * (c + 1) * I64),
                       (held + s.snap(B, c + 1), s.layer_kv(B, c + 1) + B * s.model.vocab_size * itemsize(s.compute))]
            phases.append((f"batch_throughput(batch={B})", *max(moments, key=sum)))
            prev = held + s.snap(B, c + 1)
        return phases

    @classmethod
    def fills(cls, s, opts):
        c = cls.context(s, opts)
        return [(f"the throughput batch of {B} at context {c}", B, c + 1) for B in opts.batch_sizes or []]

    @staticmethod
    def context(s, opts) -> int:
        return min(opts.batch_context, s.max_len - 1) if s.max_len > 1 else 1

    @dataclass(frozen=True)
    class Options:
        batch_sizes: list[int] | None = option(None, "decode throughput vs batch (batches.csv); None: not measured")
        batch_context: int = option(512, "context each sequence holds while batches are timed (capped below "
                                         "max_len)")

    @dataclass(frozen=True)
    class Result:
        batch_kv_overtakes_weights_at: float | None = key("batch from which a step reads more K/V than weights",
                                                          "sequences")
        tokens_per_s_batch_min: float = key("decode throughput at the smallest batch", "tokens/s")
        tokens_per_s_batch_max: float = key("decode throughput at the largest batch", "tokens/s")
        batch_max: int = key("the largest batch timed", "sequences")

    tables = (Table("batches", "batches.csv", on=("batch",),
                    columns=("batch", "context_len", "ms_median", "ms_p10", "ms_p90", "ms_min", "repeats",
                             "tokens_per_s", "weight_bytes", "kv_bytes", "gb_per_s"),
                    meaning="decode throughput per batch size"),)

    @classmethod
    def check(cls, opts, max_len):
        from harness.common.errors import ConfigError
        from harness.measurements.base import MAX_LIST

        sizes = list(opts.batch_sizes or [])
        for b in sizes:
            if not (isinstance(b, int) and b >= 1):
                raise ConfigError(f"batch_sizes has {b!r}: give batch sizes >= 1, e.g. [1,8,32]")
        if len(sizes) > MAX_LIST:  # each entry's bytes are the memory check's
            raise ConfigError(f"batch_sizes has {len(sizes):,} sizes, over kvlab's cap of {MAX_LIST} per run: give "
                              f"at most {MAX_LIST}")
        if len(set(sizes)) != len(sizes):
            raise ConfigError(f"batch_sizes {sizes} repeats a size: give each once")
        if opts.batch_context < 1:
            raise ConfigError(f"batch_context={opts.batch_context} must be at least 1")
        if sizes and opts.batch_context >= max_len:
            raise ConfigError(f"batch_context={opts.batch_context}: a batch timed at context c needs 1 <= c < "
                              f"max_len={max_len}; use batch_context <= {max_len - 1}")

    def skip(self):
        return None if self.opts.batch_sizes else "batch_sizes is not set (e.g. batch_sizes=[1,8,32])"

    def run(self):
        from harness.core import measure

        ctx = self.ctx
        df = measure.batch_throughput(ctx.engine, ctx.spec, list(self.opts.batch_sizes),
                                      min(self.opts.batch_context, ctx.max_len - 1), ctx.max_len, ctx.repeats,
                                      ctx.warmup, ctx.device, ctx.seed, ctx.progress)
        return self.Result(**measure.batch_summary(df)), {"batches": df}

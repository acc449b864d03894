"""Step time: one decode step at each context length, cached and uncached; the prefill (time to first token)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.common import stats
from harness.measurements.base import Measurement, Panel, Table, key, option, register

STEP_MS = {"ms_median": "", "ms_p10": "_p10", "ms_p90": "_p90"}  # steps.csv column -> step_ms/<mode><suffix>


@register
class StepTime(Measurement):
    name = "step_time"
    about = "median and spread of one decode step per context length, cached vs uncached; TTFT; a cost model"
    stage = "step times"
    @classmethod
    def memory(cls, s, opts):
        """cache(1, the longest timed context + 1) (twice if the kind's ``checkpoint`` snapshots), the uncached
        forward over that context."""
        Tc = min(s.max_len, (max(opts.context_lengths) + 1) if opts.context_lengths else s.max_len)
        return [("step_times", s.cache_at(1, Tc) + s.snap(1, Tc), s.forward(1, Tc, 1) + s.layer_kv(1, Tc))]

    @classmethod
    def fills(cls, s, opts):
        top = max(opts.context_lengths) if opts.context_lengths else s.max_len - 1
        return [(f"the decode step at context {top}", 1, top + 1), ("the time to first token", 1, s.prompt_len)]

    @dataclass(frozen=True)
    class Options:
        context_lengths: list[int] | None = option(None, "timed contexts; default: those of 32, 128, 512 below "
                                                         "max_len")

    @dataclass(frozen=True)
    class Result:
        max_context_len: int = key("the largest timed context", "tokens")
        step_ms_cached_at_max_context: float = key("median cached decode step there", "ms", shown=True)
        step_ms_uncached_at_max_context: float = key("median uncached step there (the reference forward over "
                                                     "ctx + 1 tokens)", "ms", shown=True)
        speedup_at_max_context: float = key("uncached / cached there", "x", shown=True)
        ttft_ms: float = key("median prefill of the first prompt into an empty cache (time to first token)", "ms",
                             shown=True)
        ttft_ms_p10: float = key("its 10th percentile", "ms")
        ttft_ms_p90: float = key("its 90th percentile", "ms")
        cost_model: str | None = key("the fitted cached-step model (null: fewer than two contexts)")
        cost_a_ms: float | None = key("its fixed cost a (the weights)", "ms")
        cost_b_ms_per_token: float | None = key("its cost b per cached token", "ms/token")

    tables = (Table("steps", "steps.csv", on=("context_len", "mode"),
                    columns=("context_len", "mode", "ms_median", "ms_p10", "ms_p90", "ms_min", "repeats", "speedup"),
                    meaning="decode-step time per context length, cached and uncached"),)
    history = {**{f"step_ms/{mode}{sfx}": "context_len" for mode in ("cached", "uncached")
                  for sfx in STEP_MS.values()}, "step_ms/speedup": "context_len"}
    panels = (Panel("Decode-step time vs context length, by cache kind", "line",
                    ("step_ms/cached", "step_ms/uncached"), ("cache",),
                    "Median time (ms) of one decode step: cached (the cache kind) vs uncached (full recompute).",
                    "context_len", True, True),
              Panel("Decode-step time vs context length, by dtype", "line", ("step_ms/cached", "step_ms/uncached"),
                    ("dtype",), "The same step times, grouped by dtype.", "context_len", True, True),
              Panel("Speedup vs context length", "line", ("step_ms/speedup",), ("cache",),
                    "Speedup of a cached decode step over the uncached one (uncached / cached).", "context_len",
                    True, False))

    def run(self):
        from harness.core import measure

        ctx = self.ctx
        steps = measure.step_times(ctx.engine, ctx.spec, ctx.contexts, ctx.max_len, ctx.repeats, ctx.warmup,
                                   ctx.device, ctx.seed, ctx.progress)
        ttft = measure.time_to_first_token(ctx.engine, ctx.spec, ctx.prompts[0], ctx.max_len, ctx.repeats,
                                           ctx.warmup, ctx.device)
        top = steps[steps.context_len == steps.context_len.max()].set_index("mode")
        return self.Result(max_context_len=int(steps.context_len.max()),
                           step_ms_cached_at_max_context=float(top.loc["cached", "ms_median"]),
                           step_ms_uncached_at_max_context=float(top.loc["uncached", "ms_median"]),
                           speedup_at_max_context=float(top.loc["cached", "speedup"]),
                           **ttft, **stats.cost_model(steps)), {"steps": steps}

    @classmethod
    def summary(cls, r, tables):
        lines = [f"  TTFT              {r['ttft_ms']:.1f} ms ({r['prompt_len']}-token prompt)"]
        steps = tables.get("steps")
        if steps is None:
            return lines
        for c, g in steps.groupby("context_len"):
            g = g.set_index("mode")
            lines.append(f"  decode step       ctx {c:>4}: {g.loc['cached', 'ms_median']:8.2f} ms cached   "
                         f"{g.loc['uncached', 'ms_median']:8.2f} ms uncached   {g.loc['cached', 'speedup']:5.1f}x")
        return lines

    @classmethod
    def history_rows(cls, tables):
        steps = tables.get("steps")
        if steps is None:
            return []
        rows = []
        for ctx, g in steps.groupby("context_len"):
            row = {}
            for _, r in g.iterrows():
                row.update({f"step_ms/{r['mode']}{sfx}": float(r[col]) for col, sfx in STEP_MS.items()})
                if r["mode"] == "cached":
                    row["step_ms/speedup"] = float(r["speedup"])
            rows.append(("context_len", int(ctx), row))
        return rows

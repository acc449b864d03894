"""Compile: the compiled decode step's own cost (apart from step times) and whether it equals the eager one."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, key, register


@register
class Compile(Measurement):
    name = "compile"
    about = "compile=true: compile time, graphs, recompiles, and the compiled step against the eager one"
    stage = "compiled step"
    @classmethod
    def memory(cls, s, opts):
        """compile=true: two caches of batch 1, a prefill and a decode step's K/V."""
        if not s.compile:
            return []
        T = s.prompt_len + s.new_tokens
        return [("compiled_equivalence", 2 * s.cache_at(1, T), s.forward(1, s.prompt_len, 1) + s.layer_kv(1, T))]

    @classmethod
    def fills(cls, s, opts):
        return [("the compiled step's check", 1, s.prompt_len + s.new_tokens)] if s.compile else []

    @dataclass(frozen=True)
    class Result:
        compile_s: float = key("time torch.compile took, not in step times", "s")
        compile_warmup_s: float = key("the warm-up steps after it", "s")
        compile_graphs: int = key("graphs compiled", "graphs")
        compile_recompiles: int = key("recompiles over the compiled steps", "recompiles")
        compiled_steps: int = key("compiled decode steps run", "steps")
        compile_cudagraph_skips: int = key("steps CUDA graphs skipped", "steps")
        compile_mode: str = key("reduce-overhead (CUDA graphs) on a GPU, default on a CPU")
        compile_max_abs_logit: float = key("max |compiled - eager logit| over new_tokens steps", "logit")
        compile_tokens_identical: bool = key("every compiled step's argmax is the eager one's")

    def skip(self):
        return None if self.ctx.compiled else "compile=false"

    def run(self):
        from harness.core import measure

        from harness.core.engines import KvlabEngine

        ctx = self.ctx
        same = measure.compiled_equivalence(ctx.engine, KvlabEngine(ctx.engine.model), ctx.spec, ctx.prompts[0],
                                            ctx.new_tokens, ctx.max_len)
        mode = "reduce-overhead" if ctx.device.type == "cuda" else "default"
        return self.Result(**ctx.engine.compile_stats, compile_mode=mode, **same)

    @classmethod
    def not_equivalent(cls, r, tol):
        return ["the compiled step differs from its reference"] if r.get("compile_tokens_identical") is False else []

    @classmethod
    def summary(cls, r, tables):
        return [f"  compiled step     compile {r['compile_s']:.1f} s + warm-up {r['compile_warmup_s']:.2g} s (not in "
                f"step times; mode {r['compile_mode']}), {r['compile_graphs']} graph(s), {r['compile_recompiles']} "
                f"recompiles over {r['compiled_steps']} steps, {r['compile_cudagraph_skips']} CUDA-graph skips; = "
                f"eager: {r['compile_tokens_identical']} (max |dlogit| {r['compile_max_abs_logit']:.2g})"]

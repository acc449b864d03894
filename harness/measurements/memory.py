"""Memory: the bytes the cache holds after one generation against the kind's formula, and bytes vs tokens."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, Panel, Table, key, register


@register
class Memory(Measurement):
    name = "memory"
    about = "cache bytes after one generation against the kind's formula, bytes per token, bytes vs tokens"
    stage = "cache memory"
    @classmethod
    def memory(cls, s, opts):
        """cache(1, prompt_len + new_tokens), a prefill's transients and one layer's K/V of what the kind holds."""
        held = s.cls.held_tokens(s.max_len, s.max_len, s.opts)  # a window: its slots alone
        return [("cache_memory", s.cache_at(1, s.prompt_len + s.new_tokens),
                 s.forward(1, s.prompt_len, 1) + s.layer_kv(1, held))]

    @classmethod
    def fills(cls, s, opts):
        return [("the cache-bytes check", 1, s.prompt_len + s.new_tokens - 1)]

    @dataclass(frozen=True)
    class Result:
        cache_nbytes: int = key("bytes of K/V storage the cache holds after prompt + new_tokens - 1 steps", "B",
                                shown=True)
        predicted_nbytes: int = key("the kind's formula for the same tokens, from the asked storage dtype", "B")
        nbytes_match: bool = key("cache_nbytes == predicted_nbytes, exactly", shown=True)
        cache_tokens: int = key("token slots the cache holds then", "tokens")
        cache_filled_tokens: int = key("tokens the generation stored (prompt + new_tokens - 1)", "tokens")
        bytes_per_token: float = key("the kind's bytes per cached token (scales included)", "B/token", shown=True)
        measured_bytes_per_token: float = key("cache_nbytes / cache_tokens", "B/token")
        nbytes_curve_match: bool = key("measured bytes equal the formula after the prefill and every step")
        kv_overtakes_weights_at_context: float | None = key("context from which a batch-1 step reads more K/V than "
                                                            "weights (null: a kind that caps its reads)", "tokens")
        nbytes_at_max_len: int | None = key("the kind's formula for one sequence of max_len tokens (what it holds at "
                                            "the longest context)", "B")
        full_nbytes_at_max_len: int | None = key("fp32 full attention's K/V bytes for one sequence of max_len tokens: "
                                                 "what a compression ratio is taken against "
                                                 "(1 - nbytes_at_max_len / this)", "B")

    tables = (Table("memory", "memory.csv", on=("tokens",), columns=("tokens", "nbytes_formula", "nbytes_measured"),
                    meaning="cache bytes vs tokens: the formula out to max_len, measured where the generation "
                            "reached"),
              Table("heads", "heads.csv", on=("layer", "kv_head"), columns=("layer", "kv_head", "slots", "tokens",
                                                                            "role"),
                    meaning="per layer and K/V head, after the generation: the slots it holds room for, the tokens "
                            "in them, and its role (duo: retrieval or streaming; empty otherwise)"))
    panels = (Panel("Bytes per token", "bar", ("bytes_per_token", "cache_nbytes"), ("cache", "dtype"),
                    "Cache bytes per cached token (the kind's formula) and the cache's bytes at the end of the run."),)

    def run(self):
        from harness.core import measure

        ctx = self.ctx
        rec, curve, heads = measure.cache_memory(ctx.engine, ctx.spec, ctx.prompts[0], ctx.new_tokens, ctx.max_len)
        # the context from which a step reads more K/V than weights (batch 1); never, for a kind that caps its reads
        capped = measure.keys_read(ctx.engine, ctx.spec, ctx.max_len, ctx.max_len - 1) < ctx.max_len
        weights = measure.weight_bytes(ctx.engine.model)
        overtakes = None if capped else weights / rec["bytes_per_token"]
        return self.Result(**rec, kv_overtakes_weights_at_context=overtakes), {"memory": curve, "heads": heads}

    @classmethod
    def summary(cls, r, tables):
        return [f"  cache bytes       {r['cache_nbytes']:,} measured = {r['predicted_nbytes']:,} formula: "
                f"{r['nbytes_match']}  ({r['bytes_per_token']:,.0f} B/token, {r['cache_tokens']} tokens held)"]

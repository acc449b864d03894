"""Serving: one batch served as a server would (prompts of their own lengths), its throughput and KV waste."""

from __future__ import annotations

from dataclasses import dataclass

from harness.measurements.base import Measurement, Panel, key, register


@register
class Serving(Measurement):
    name = "serving"
    about = "a served batch of `batch` prompts (uniform or ragged): tokens/s, TTFT, KV waste, each sequence checked"
    stage = "served batch"
    @classmethod
    def memory(cls, s, opts):
        """The served batch (B = batch, prompts of prompt_len, n = new_tokens): the worst of a new cache built while
        the last repeat's is held, the prefill, the decode (with the B x n x V fp32 logits it keeps), and the check
        (those logits stacked: twice, plus a (prompt_len + n, V) reference forward)."""
        from harness.core.sizes import F32, I64
        from models.kv_cache.base import itemsize

        B, n, pl, V = s.batch, s.new_tokens, s.prompt_len, s.model.vocab_size
        full, empty, kept = s.cache_at(B, pl + n), s.cache_at(B, 0), B * n * V * F32
        moments = [(full + empty, 0), (s.cache_at(B, pl), s.forward(B, pl, 1) + 2 * B * pl * I64),
                   (full, s.layer_kv(B, pl + n) + kept + B * V * itemsize(s.compute)),
                   (full, 2 * kept + s.forward(1, pl + n, pl + n, F32))]
        return [(f"serve_batch(batch={B})", *max(moments, key=sum))]

    @classmethod
    def fills(cls, s, opts):
        return [(f"the served batch of {s.batch}", s.batch, s.prompt_len + s.new_tokens - 1)]

    @classmethod
    def inputs(cls, opts, src, s):
        """The served batch: ``batch`` prompts, each cut to its length (all prompt_len, or ragged: drawn)."""
        from harness.core.inputs import batch_lengths

        lengths = batch_lengths(s.batch, s.prompt_len, s.prompt_lengths, src.seed)
        return dict(served=[p[0, :n] for p, n in zip(src.prompts(s.batch, s.prompt_len), lengths)])  # (n,) each

    @dataclass(frozen=True)
    class Result:
        serve_batch: int = key("sequences served together", "sequences")
        serve_prompt_tokens: int = key("prompt tokens of the batch", "tokens")
        serve_longest_prompt: int = key("its longest prompt", "tokens")
        serve_shortest_prompt: int = key("its shortest prompt", "tokens")
        tokens_per_s: float = key("generated tokens over prefill + decode", "tokens/s", shown=True)
        decode_tokens_per_s: float | None = key("generated tokens over the decode steps alone", "tokens/s")
        serve_ttft_ms: float = key("the batch's prefill", "ms")
        kv_held_slots: int | None = key("token slots the cache holds at the end", "slots")
        kv_token_slots: int | None = key("of those, slots that hold a token", "slots")
        kv_waste: float | None = key("the held share that holds no token", "fraction", shown=True)
        serve_cache_nbytes: int = key("the cache's bytes at the end", "B")
        serve_pool_nbytes: int | None = key("a paged cache's block pool", "B")
        serve_tokens_identical: bool | None = key("each sequence's tokens are its own uncached reference's (exact "
                                                  "kinds; null for lossy)", shown=True)
        serve_max_abs_logit: float | None = key("max |dlogit| against those references", "logit")

    panels = (Panel("Served batch: throughput and KV waste", "bar", ("tokens_per_s", "kv_waste"),
                    ("cache_label", "batch", "prompt_lengths"),
                    "Each run's served batch: generated tokens/s, and the share of held cache slots that hold no "
                    "token."),)

    def run(self):
        from harness.core import measure

        ctx = self.ctx
        # always one warm-up: a compiled step compiles in it
        return self.Result(**measure.serve_batch(ctx.engine, ctx.spec, ctx.served, ctx.new_tokens, ctx.max_len,
                                                 min(ctx.repeats, 3), 1, ctx.device, check=ctx.spec.cls.exact))

    @classmethod
    def not_equivalent(cls, r, tol):
        return ["the served batch differs from its reference"] if r.get("serve_tokens_identical") is False else []

    @classmethod
    def summary(cls, r, tables):
        if r.get("kv_waste") is None:
            return []
        check = ("" if r.get("serve_tokens_identical") is None else
                 f" · each sequence = its own reference: {r['serve_tokens_identical']} "
                 f"(max |dlogit| {r['serve_max_abs_logit']:.2g})")
        return [f"  served batch      {r['serve_batch']} x {r.get('prompt_lengths', 'uniform')} prompts "
                f"({r['serve_shortest_prompt']}..{r['serve_longest_prompt']} tokens) + {r['new_tokens']} new: "
                f"{r['tokens_per_s']:,.0f} tokens/s · KV waste {r['kv_waste']:.1%} ({r['kv_token_slots']:,} of "
                f"{r['kv_held_slots']:,} held slots hold a token){check}"]
